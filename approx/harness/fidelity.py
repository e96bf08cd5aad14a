"""Fidelity of patched models to the unpatched model on the same inputs, measured in one run.

A *setup* is a method with options, written ``name`` or ``name:option=value,option=value`` (e.g.
``i-clustered:clusters=25,topk=32``). :func:`hidden_state_fidelity` runs the unpatched model and every
setup on the same batches, interleaved, and reports the cosine of final hidden states and wall time.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..config import MethodConfig, did_you_mean
from ..integration import patch, unpatch
from ..registry import get_method


@dataclasses.dataclass(frozen=True)
class Setup:
    method: str
    options: dict[str, Any]

    @property
    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.method}:{opts}" if opts else self.method

    @classmethod
    def from_config(cls, config: MethodConfig) -> Setup:
        """A setup from a config object, e.g. ``Setup.from_config(IClusteredConfig(clusters=100))``."""
        return cls(config.method, config.to_dict())

    def config(self) -> dict[str, Any]:
        """All options of the method, defaults included."""
        return get_method(self.method).make_config(**self.options).to_dict()


def _coerce(value: str, kind: str, name: str, method: str) -> Any:
    try:
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        if kind == "bool":
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
    except ValueError:
        raise ValueError(f"{method}: option {name!r} expects a {kind}, got {value!r}") from None
    return value


def parse_setup(spec: str) -> Setup:
    """``"i-clustered:clusters=25,topk=32"`` -> Setup; values are typed from the method's config class."""
    name, _, rest = spec.partition(":")
    method = get_method(name.strip())
    kinds = {o["name"]: o["type"] for o in method.config_class.describe()}
    options: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            raise ValueError(f"{spec!r}: expected option=value, got {item!r}")
        if key not in kinds:
            raise ValueError(
                f"{method.name}: unknown option {key!r}{did_you_mean(key, kinds)}; options: {', '.join(kinds) or 'none'}"
            )
        options[key] = _coerce(value.strip(), kinds[key], key, method.name)
    method.make_config(**options)  # validate now, not halfway through a run
    return Setup(method.name, options)


def _batches(windows: list[list[int]], batch_size: int):
    for i in range(0, len(windows), batch_size):
        ids = torch.tensor(windows[i : i + batch_size])
        yield ids, torch.ones_like(ids)


@torch.inference_mode()
def hidden_state_fidelity(
    model: torch.nn.Module,
    windows: list[list[int]],
    setups: list[Setup],
    *,
    batch_size: int = 4,
    progress: bool = True,
) -> dict[str, Any]:
    """Cosine of final hidden states between each setup and the unpatched model, on equal-length windows.

    For every batch the unpatched model runs first, then each setup (patch, run, unpatch), so timings are
    side by side. Per setup: ``token_cosine`` (mean over tokens and windows), ``worst_window_cosine``
    (lowest per-window mean), ``pooled_cosine`` (mean-pooled sentence embeddings), ``seconds`` and
    ``speedup`` (unpatched seconds / setup seconds).
    """
    model.eval()
    device = next(model.parameters()).device
    ref_seconds = 0.0
    stats = {s.label: {"seconds": 0.0, "window_cos": [], "pooled_cos": []} for s in setups}

    def run(ids, mask):
        start = time.perf_counter()
        hidden = model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state.float()
        return hidden, time.perf_counter() - start

    n_batches = (len(windows) + batch_size - 1) // batch_size
    for ids, mask in tqdm(_batches(windows, batch_size), total=n_batches, disable=not progress, desc="fidelity"):
        ref, seconds = run(ids, mask)
        ref_seconds += seconds
        for setup in setups:
            patch(model, setup.method, **setup.options)
            try:
                out, seconds = run(ids, mask)
            finally:
                unpatch(model)
            st = stats[setup.label]
            st["seconds"] += seconds
            st["window_cos"] += F.cosine_similarity(out, ref, dim=-1).mean(-1).tolist()
            st["pooled_cos"] += F.cosine_similarity(out.mean(1), ref.mean(1), dim=-1).tolist()
    results = []
    for setup in setups:
        st = stats[setup.label]
        results.append(
            {
                "label": setup.label,
                "method": {"name": setup.method, **setup.config()},
                "token_cosine": sum(st["window_cos"]) / len(st["window_cos"]),
                "worst_window_cosine": min(st["window_cos"]),
                "pooled_cosine": sum(st["pooled_cos"]) / len(st["pooled_cos"]),
                "seconds": st["seconds"],
                "speedup": ref_seconds / st["seconds"] if st["seconds"] else None,
            }
        )
    return {"reference_seconds": ref_seconds, "windows": len(windows), "results": results}


def short_label(method: dict[str, Any]) -> str:
    """``name:opt=value`` with only the options that differ from the method's defaults."""
    name = method["name"]
    defaults = get_method(name).config_class().to_dict()
    opts = ",".join(f"{k}={v}" for k, v in method.items() if k != "name" and defaults.get(k) != v)
    return f"{name}:{opts}" if opts else name


def markdown_table(report: dict[str, Any], *, short: bool = False) -> str:
    rows = [
        "| setup | token cosine | worst window | pooled cosine | seconds | speed vs full |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| full (unpatched) | 1.0000 | 1.0000 | 1.0000 | {report['reference_seconds']:.2f} | 1.00x |",
    ]
    for r in report["results"]:
        label = short_label(r["method"]) if short else r["label"]
        rows.append(
            f"| {label} | {r['token_cosine']:.4f} | {r['worst_window_cosine']:.4f} | "
            f"{r['pooled_cosine']:.4f} | {r['seconds']:.2f} | {r['speedup']:.2f}x |"
        )
    return "\n".join(rows)


def wikitext_fidelity_report(
    setups: list[Setup],
    *,
    model_path: str | None = None,
    data_dir: str | None = None,
    windows: int = 8,
    length: int = 512,
    batch_size: int = 4,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Hidden-state fidelity of each setup on WikiText-2 test windows, as a self-describing result.

    ``model_path`` defaults to the offline MiniLM-L6; the report carries the protocol and provenance.
    """
    from ..integration import load_pretrained
    from .data import default_model_path, find_data_dir, wikitext_windows
    from .provenance import provenance

    folder = find_data_dir(data_dir, need="wikitext-2/wiki.test.tokens")
    torch.manual_seed(seed)
    model_path = model_path or default_model_path()
    model, tokenizer = load_pretrained(model_path)
    ids = wikitext_windows(tokenizer, folder, split="test", length=length, count=windows)
    report = hidden_state_fidelity(model, ids, setups, batch_size=batch_size, progress=progress)
    protocol = (wikitext_windows.__doc__ or "").split("Protocol: ")[-1].strip()
    return {
        "task": "wikitext2-hidden-state-fidelity",
        "task_version": 1,
        "model": model_path,
        "protocol": " ".join(protocol.split()),
        "window_length": length,
        **report,
        "provenance": provenance(seed=seed, device=next(model.parameters()).device, data_dir=str(folder)),
    }


def recipe_main(configs: list[MethodConfig], default_output: str, description: str, argv=None) -> dict[str, Any]:
    """Command line of a WikiText-2 fidelity recipe: run ``configs``, print the table, write the JSON."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=32, help="WikiText-2 test windows (default 32)")
    parser.add_argument("--length", type=int, default=512, help="tokens per window (default 512)")
    parser.add_argument("--data-dir", default=None, help="default: $APPROX_DATA_DIR, then ../shared/data")
    parser.add_argument("--output", type=Path, default=Path(default_output))
    args = parser.parse_args(argv)
    setups = [Setup.from_config(c) for c in configs]
    report = wikitext_fidelity_report(setups, data_dir=args.data_dir, windows=args.windows, length=args.length)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown_table(report))
    print(f"\nwrote {args.output}")
    return report
