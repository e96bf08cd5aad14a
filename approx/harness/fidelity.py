"""Fidelity of a patched model to the unpatched model on the same inputs: the one place it is computed.

Per batch and method, :func:`batch_sums` records *sums* (and a few maxima / minima) that add up exactly
across batches, processes and the two halves of a cross-fitted split (:func:`add_sums`); :func:`summarize`
turns the total into a result's ``fidelity`` dict. A new fidelity quantity is one field in
:func:`batch_sums`, one line in :data:`_COMBINE` and its formula in :func:`summarize`.

The ``fidelity`` dict, per method:

* the task's own comparison of outputs (:meth:`approx.harness.tasks.Task.fidelity`): ``agreement`` and
  ``kl_divergence`` (mean KL(unpatched || patched)), or ``mean_abs_difference`` / ``max_abs_difference``;
* ``hidden_state_cosine``: ``per_layer``, the mean over real tokens of the cosine between patched and
  unpatched hidden states (``last`` is the final layer); ``worst_feature``, the lowest per-input mean of the
  last layer's token cosines (the worst window on WikiText); ``pooled``, the mean over inputs of the cosine
  between the mean-pooled (over real tokens) last hidden states;
* ``attention_relative_error``: per attention layer, ||O - O_exact|| / ||O_exact|| over real queries, where
  O_exact is exact attention on the *same* queries, keys and values (``mean`` over the patched layers, a layer
  patched with ``full``, as an autotuned model's exact layers are, included at 0; ``per_layer`` tells them apart);
* ``cost``: attention FLOPs and query-key pairs from the method's cost model at each input's real length (and
  its data, where the cost depends on it: window's global question tokens, ``Method.costs``; plus exact attention on
  a batch row the method broke down on, ``_fallback.BROKE_DOWN_ROWS``), and their ratio to
  full attention's, over the patched layers; and the literature's convention (the MonarchAttention paper's axis):
  ``matmul_macs``, the multiply-accumulates of the attention matrix products, its ratio to softmax's over the
  patched layers (``matmul_vs_softmax``) and over *every* attention layer of the model, unpatched ones counted as
  softmax (``matmul_vs_softmax_model``: the x axis of that paper's figures, where some layers stay exact);
  ``layers``: the indices of the patched layers and the number of attention layers, and a model's sliding-window
  layers (``sliding_window``: ModernBERT's local layers, never patched; its whole-model ratio is then None, as such
  a layer is neither softmax over the input nor a method);
* ``fallback_rows``: query rows (over layers and heads) on which the method broke down and got exact attention
  instead (FAVOR+ rows whose normaliser underflows); 0 when it approximated everywhere, as it claims;
* ``exact_inputs``: of the (patched layer call, input) pairs measured (layers running ``full``, as an autotuned
  model's exact layers do, left out), those whose attention output equalled exact
  attention's to the dtype's precision (relative error over the input's heads and real queries at most
  :func:`exact_tolerance`), and their ``share``: inputs within the method's budget (clustering with at least as many
  clusters as tokens, a window or a pattern covering every pair, BigBird's fallback on short inputs), a
  short-input fallback (``exact_below``). A method whose share is 1 ran exact attention on these inputs: its
  metrics say nothing about its approximation;
* ``seconds``, ``reference_seconds`` (whole-model forward time over all batches, timed in a pass without the
  probe, whose exact attention and graph run in a second, untimed pass), ``speedup``; ``seconds_per_example`` and ``reference_seconds_per_example`` (divided by the examples
  scored: a SQuAD question read in several windows counts once); ``graph`` for methods that predict an
  attention graph (sparsity, recall, exact fraction); ``peak_memory_mib`` and ``reference_peak_memory_mib``
  (the largest batch's peak) and ``..._per_input`` (the largest over batches of a batch's peak divided by its
  inputs: a conservative figure, in which a short last batch's fixed overhead can weigh most);
  ``retimed_batches`` and ``reference_retimed_batches``: batches whose pass ``torch.compile`` compiled for (a
  shape the harness's warm-up did not cover) and that were therefore run and timed a second time;
  ``allocated_peak_mib_per_input`` and its reference twin: the CPU allocator's peak on the longest batch divided
  by its inputs, when ``evaluate(allocations=True)`` measured it (else None).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

from ..attention import _fallback
from ..attention._common import exact_attention
from ..registry import get_method
from .fitting import GraphStatsProbe, graph_summary
from .memory import excluded

__all__ = ["AttentionProbe", "add_sums", "batch_sums", "cost_block", "summarize", "total_sums"]


# Graph statistics (``fidelity["graph"]``) are measured on calls with at most this many keys: the gold graph is an
# entmax over every (query, key) score, O(N^2) memory and O(N^2 log N) time per layer and head (at 8192 keys a
# single (12, N, N) float32 score tensor is 3 GiB); longer calls are counted in ``graph_not_measured`` instead.
GRAPH_MAX_KEYS = 1024


def exact_tolerance(dtype: torch.dtype) -> float:
    """The relative error (over an input's heads and real queries) below which a method's attention output counts as
    exact attention's, computed otherwise: 1e-5 in float32 and float64 (summation order moves float32 results by
    about 1e-7), one epsilon in half precision (9.8e-4 in float16, 7.8e-3 in bfloat16; exact attention by another
    path differs by about 3e-4 and 2.4e-3 there, and an approximation closer than an epsilon cannot be told from it
    at that precision)."""
    return max(1e-5, torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-5


class AttentionProbe:
    """Per patched-layer call: the exact attention on the same inputs (for the relative error), the cost of
    the method and of full attention at each row's real length, and graph counts; ``seconds`` is its own
    time. The harness runs it in a pass of its own, not in the pass it times and measures."""

    def __init__(self, total_layers: int | None = None, local_layers: list[int] | None = None) -> None:
        self.err_num: dict[str, float] = {}
        self.err_den: dict[str, float] = {}
        # the same sums per head, (H,) float64 tensors: which heads a method changes least (approx.autotune)
        self.head_err_num: dict[str, torch.Tensor] = {}
        self.head_err_den: dict[str, torch.Tensor] = {}
        # method FLOPs, method pairs, full FLOPs, full pairs, method matmul MACs, full matmul MACs
        self.cost = [0, 0, 0, 0, 0, 0]
        self.total_layers = total_layers  # attention layers of the model, patched or not
        self.local_layers = list(local_layers or [])  # those attending within a sliding window (never patched)
        self.seconds = 0.0
        self._full = get_method("full")
        self.graph = GraphStatsProbe()  # methods that predict an attention graph (Sparsefinder)
        self.graph_skipped = 0  # layer calls of such a method too long for the graph (GRAPH_MAX_KEYS)
        # (layer call, input) pairs whose attention output equalled exact attention's (to the dtype's precision), of those measured
        self.exact_inputs = [0, 0]
        self._broke_down = sum(_fallback.counts().values())

    def fallback_rows(self) -> int:
        """Query rows (summed over layers and heads) on which the method broke down since this probe was made
        and got exact attention instead (e.g. FAVOR+ rows whose normaliser underflows)."""
        return sum(_fallback.counts().values()) - self._broke_down

    def __call__(self, layer, q, k, v, key_mask, scale, out) -> None:
        if out.is_cuda:  # the method's own kernels, still queued, are the method's time
            torch.cuda.synchronize(out.device)
        start = time.perf_counter()
        with excluded():  # the probe's memory is not the method's (the graph's entmax is O(N^2)), if one is measured
            self._measure(layer, q, k, v, key_mask, scale, out)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        self.seconds += time.perf_counter() - start

    def _measure(self, layer, q, k, v, key_mask, scale, out) -> None:
        exact = exact_attention(q, k, v, key_mask, scale).float()
        diff = (out.float() - exact).pow(2).sum(-1)  # (B, H, N)
        ref = exact.pow(2).sum(-1)
        if key_mask is not None:
            diff, ref = diff * key_mask[:, None, :], ref * key_mask[:, None, :]
        i = str(layer.layer_index)
        self.err_num[i] = self.err_num.get(i, 0.0) + float(diff.sum())
        self.err_den[i] = self.err_den.get(i, 0.0) + float(ref.sum())
        per_head = diff.sum((0, 2)).double().cpu(), ref.sum((0, 2)).double().cpu()
        for sums, add in zip((self.head_err_num, self.head_err_den), per_head, strict=True):
            sums[i] = sums[i] + add if i in sums else add
        # per input, over heads and real queries: its output equal to exact attention's to the dtype's precision (an
        # input within the method's budget, a fallback, a pattern covering every pair), which results say
        # (not of a layer running `full`, exact by definition: an autotuned model's exact layers; counted, they had
        # made an approximation's share look like inputs within its budget)
        if layer.method.name != "full":
            rows_diff, rows_ref = diff.sum((1, 2)), ref.sum((1, 2))
            measured = rows_ref > 0
            matched = measured & (rows_diff <= exact_tolerance(out.dtype) ** 2 * rows_ref)
            self.exact_inputs[0] += int(matched.sum())
            self.exact_inputs[1] += int(measured.sum())
        heads, d, dv = q.shape[1], q.shape[-1], v.shape[-1]
        b, n = q.shape[0], k.shape[-2]
        # per row at its real length, summed over the heads (the method's and, with heads=, exact attention's on
        # the others); a method whose cost depends on the data (window's global question) reads it from the forward's
        # context, set while this runs
        mine = layer.costs(b=b, n=n, key_mask=key_mask, d=d, dv=dv, heads=heads)
        full = self._full.costs(self._full.config_class(), b=b, n=n, key_mask=key_mask, d=d, dv=dv)
        # batch rows the method broke down on (FAVOR+'s underflow) got exact attention on its heads besides
        method_heads = heads if layer.heads is None else len(layer.heads)
        for rows in _fallback.BROKE_DOWN_ROWS:
            for r in rows.tolist():
                mine[r] = mine[r] + full[r].scaled(method_heads)
        for c, f in zip(mine, full, strict=True):
            for j, value in enumerate(
                (c.flops, c.qk_pairs, heads * f.flops, heads * f.qk_pairs, c.matmul_macs, heads * f.matmul_macs)
            ):
                if value is None or self.cost[j] is None:  # a method that does not count matmuls (yet): none
                    self.cost[j] = None
                else:
                    self.cost[j] += value
        if k.shape[-2] <= GRAPH_MAX_KEYS:
            self.graph(layer, q, k, v, key_mask, scale, out)
        elif layer.method.stats is not None:
            self.graph_skipped += 1


def _hidden_sums(ref_hidden, hidden, mask: torch.Tensor) -> dict[str, Any]:
    """Token cosines per layer (embeddings excluded) summed over real tokens; per input of the last layer: the
    mean token cosine (its minimum kept) and the cosine of the mean-pooled states (summed)."""
    m = mask.bool()
    cos = [F.cosine_similarity(h.float(), r.float(), dim=-1) for r, h in zip(ref_hidden[1:], hidden[1:], strict=True)]
    lengths = m.sum(1, keepdim=True).float()  # (B, 1)
    # padding left out by selection, not by a product with the mask: what a padded position holds (NaN, inf)
    # does not reach the real tokens' numbers
    real = m[..., None]  # (B, N, 1)
    pooled = F.cosine_similarity(
        torch.where(real, hidden[-1].float(), 0.0).sum(1) / lengths,
        torch.where(real, ref_hidden[-1].float(), 0.0).sum(1) / lengths,
        dim=-1,
    )  # (B,)
    per_input = torch.where(m, cos[-1], 0.0).sum(1) / lengths[:, 0]  # (B,)
    return {
        "tokens": int(m.sum()),
        "inputs": int(mask.shape[0]),
        "cosine_sum": [float(c[m].sum()) for c in cos],
        "worst_input_cosine": float(per_input.min()),
        "pooled_cosine_sum": float(pooled.sum()),
    }


def batch_sums(
    ref_hidden: tuple[torch.Tensor, ...],
    hidden: tuple[torch.Tensor, ...],
    mask: torch.Tensor,
    probe: AttentionProbe,
    *,
    divergences: list[float | None],
    seconds: float,
    peak: float | None,
    reference_seconds: float,
    reference_peak: float | None,
    retimed: int = 0,
    reference_retimed: int = 0,
    allocated: float | None = None,
    reference_allocated: float | None = None,
) -> dict[str, Any]:
    """One method's fidelity record of one batch (JSON-serialisable; combine records with :func:`add_sums`).

    ``ref_hidden`` / ``hidden``: the unpatched and patched models' hidden states (embeddings first), ``mask``
    the (B, N) attention mask, ``divergences`` the task's per-input output divergences; ``retimed`` /
    ``reference_retimed``: 1 when the method's / the unpatched model's pass compiled and was timed again;
    ``allocated`` / ``reference_allocated``: the CPU allocator's peak MiB on this batch, when measured."""
    graph = {
        str(i): {name: torch.as_tensor(t).double().cpu().reshape(-1).tolist() for name, t in counts.items()}
        for i, counts in probe.graph.counts.items()
    }
    return {
        **_hidden_sums(ref_hidden, hidden, mask),
        "divergences": list(divergences),
        "error_num": dict(probe.err_num),
        "error_den": dict(probe.err_den),
        "cost": list(probe.cost),
        "total_layers": probe.total_layers,
        "local_layers": probe.local_layers,
        "graph": graph,
        "graph_skipped": probe.graph_skipped,
        "fallback_rows": probe.fallback_rows(),
        "exact_inputs": list(probe.exact_inputs),
        "seconds": seconds,
        "reference_seconds": reference_seconds,
        "peak_mib": peak,
        "reference_peak_mib": reference_peak,
        "peak_mib_per_input": None if peak is None else peak / mask.shape[0],
        "reference_peak_mib_per_input": None if reference_peak is None else reference_peak / mask.shape[0],
        "retimed_batches": retimed,
        "reference_retimed_batches": reference_retimed,
        "allocated_peak_mib_per_input": None if allocated is None else allocated / mask.shape[0],
        "reference_allocated_peak_mib_per_input": None
        if reference_allocated is None
        else reference_allocated / mask.shape[0],
    }


def _add(a, b):
    return a + b


def _add_counts(a: int | None, b: int | None) -> int:
    """Counts a record written before the field existed lacks (None: 0)."""
    return (a or 0) + (b or 0)


def _add_lists(a: list, b: list) -> list:
    """Elementwise sums; None (a count a method does not report) stays None."""
    return [None if x is None or y is None else x + y for x, y in zip(a, b, strict=True)]


def _add_pairs(a: list | None, b: list | None) -> list | None:
    """Elementwise sums of two count lists; None when either lacks them (a record written before the field existed:
    the other's counts alone would pass for the whole's)."""
    return None if a is None or b is None else [x + y for x, y in zip(a, b, strict=True)]


def _add_keyed(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in {**a, **b}}


def _add_graph(a: dict, b: dict) -> dict:
    return {
        i: {n: _add_lists(a[i][n], b[i][n]) for n in a[i]} if i in a and i in b else a.get(i, b.get(i))
        for i in {**a, **b}
    }


def _extreme(pick: Callable) -> Callable:
    """The smallest or largest (``pick``) of two records' values (None: not recorded); NaN if either is NaN, in
    either order (Python's min and max keep or drop a NaN by where it stands)."""

    def combine(a, b):
        values = [v for v in (a, b) if v is not None]
        if any(isinstance(v, float) and math.isnan(v) for v in values):
            return math.nan
        return pick(values) if values else None

    return combine


# how each field of batch_sums adds up across batches, processes and cross-fitted halves
_COMBINE: dict[str, Callable[[Any, Any], Any]] = {
    "tokens": _add,
    "inputs": _add,
    "cosine_sum": _add_lists,
    "worst_input_cosine": _extreme(min),
    "pooled_cosine_sum": _add,
    "divergences": _add,  # list concatenation
    "error_num": _add_keyed,
    "error_den": _add_keyed,
    "cost": _add_lists,
    "total_layers": _extreme(max),
    "local_layers": lambda a, b: a or b,  # the same model's: the same list (absent from records written before it)
    "graph": _add_graph,
    "graph_skipped": _add_counts,
    "fallback_rows": _add,
    "exact_inputs": _add_pairs,
    "seconds": _add,
    "reference_seconds": _add,
    "peak_mib": _extreme(max),
    "reference_peak_mib": _extreme(max),
    "peak_mib_per_input": _extreme(max),
    "reference_peak_mib_per_input": _extreme(max),
    "retimed_batches": _add_counts,
    "reference_retimed_batches": _add_counts,
    "allocated_peak_mib_per_input": _extreme(max),
    "reference_allocated_peak_mib_per_input": _extreme(max),
}


def add_sums(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two records of :func:`batch_sums` (or totals of them) as one."""
    return {key: combine(a.get(key), b.get(key)) for key, combine in _COMBINE.items()}


def total_sums(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The sum of several :func:`batch_sums` records."""
    records = iter(records)
    total = next(records)
    for r in records:
        total = add_sums(total, r)
    return total


def cost_block(
    flops: float,
    pairs: float,
    full_flops: float,
    full_pairs: float,
    macs: float | None = None,
    full_macs: float | None = None,
    *,
    patched_layers: list[str] | None = None,
    total_layers: int | None = None,
    local_layers: list[int] | None = None,
) -> dict[str, Any]:
    """The ``fidelity["cost"]`` entry: a method's attention FLOPs and query-key pairs and their ratio to full
    attention's (patched layers), and the matrix-product count of the literature, over the patched layers and
    over the whole model (each unpatched layer sees the same lengths as a patched one, so it counts as
    ``full_macs / len(patched_layers)`` of softmax). ``patched_layers``: the indices of the patched layers."""
    block = {
        "attention_flops": flops,
        "qk_pairs": pairs,
        "flops_vs_full": flops / full_flops if full_flops else None,
        "qk_pairs_vs_full": pairs / full_pairs if full_pairs else None,
    }
    if macs is None:  # a record written before matmul MACs were counted
        return block
    block.update(matmul_macs=macs, matmul_vs_softmax=macs / full_macs if full_macs else None)
    model_ratio = None
    patched = len(patched_layers) if patched_layers is not None else None
    if full_macs and patched and total_layers and not local_layers:
        per_layer = full_macs / patched
        model_ratio = (macs + (total_layers - patched) * per_layer) / (total_layers * per_layer)
    indices = None if patched_layers is None else [int(i) for i in patched_layers]
    layers: dict[str, Any] = {"patched": indices, "total": total_layers}
    if local_layers:  # a sliding-window layer is neither softmax over the input nor a method: no whole-model ratio
        layers["sliding_window"] = [int(i) for i in local_layers]
    block.update(matmul_vs_softmax_model=model_ratio, layers=layers)
    return block


def summarize(task, mode: str, sums: dict[str, Any], ref_predictions: list, predictions: list) -> dict[str, Any]:
    """The result's ``fidelity`` dict from the total of a method's :func:`batch_sums` records and the
    per-example predictions under full attention and under the method."""
    fidelity = dict(task.fidelity(sums["divergences"], ref_predictions, predictions, mode))
    per_layer = [c / sums["tokens"] for c in sums["cosine_sum"]]
    fidelity["hidden_state_cosine"] = {
        "last": per_layer[-1],
        "per_layer": per_layer,
        "worst_feature": sums["worst_input_cosine"],
        "pooled": sums["pooled_cosine_sum"] / sums["inputs"],
    }
    layers = sorted(sums["error_num"], key=int)
    errors = [math.sqrt(sums["error_num"][i] / max(sums["error_den"][i], 1e-30)) for i in layers]
    fidelity["attention_relative_error"] = {
        "mean": sum(errors) / len(errors) if errors else None,
        "per_layer": dict(zip(layers, errors, strict=True)),
    }
    fidelity["cost"] = cost_block(
        *sums["cost"],
        patched_layers=layers,
        total_layers=sums.get("total_layers"),
        local_layers=sums.get("local_layers"),
    )
    seconds, ref_seconds = sums["seconds"], sums["reference_seconds"]
    fidelity.update(seconds=seconds, reference_seconds=ref_seconds, speedup=ref_seconds / seconds if seconds else None)
    examples = max(len(predictions), 1)
    fidelity.update(seconds_per_example=seconds / examples, reference_seconds_per_example=ref_seconds / examples)
    if sums["graph"]:  # sparsity, recall and exact fraction of the predicted graph against the gold one
        counts = {
            int(i): {n: torch.tensor(v, dtype=torch.float64) for n, v in c.items()} for i, c in sums["graph"].items()
        }
        fidelity["graph"] = graph_summary(counts)
    if sums.get("graph_skipped"):  # said, not silent: the graph was not measured on these layer calls
        fidelity["graph_not_measured"] = {
            "layer_calls": sums["graph_skipped"],
            "why": f"inputs with more than {GRAPH_MAX_KEYS} keys: the gold graph is an entmax over all N^2 scores",
        }
    fidelity["fallback_rows"] = sums["fallback_rows"]
    if sums.get("exact_inputs") is not None:
        matched, measured = sums["exact_inputs"]
        fidelity["exact_inputs"] = {"share": matched / measured if measured else None, "matched": matched,
                                    "measured": measured}  # fmt: skip
    fidelity["peak_memory_mib"] = sums["peak_mib"]
    fidelity["reference_peak_memory_mib"] = sums["reference_peak_mib"]
    fidelity["peak_memory_mib_per_input"] = sums.get("peak_mib_per_input")
    fidelity["reference_peak_memory_mib_per_input"] = sums.get("reference_peak_mib_per_input")
    # batches whose pass compiled (a shape the warm-up did not cover) and was timed again: said, not hidden
    fidelity["retimed_batches"] = sums.get("retimed_batches") or 0
    fidelity["reference_retimed_batches"] = sums.get("reference_retimed_batches") or 0
    # the CPU allocator's peak per input, measured untimed in the warm-up (evaluate(allocations=True)), or None
    fidelity["allocated_peak_mib_per_input"] = sums.get("allocated_peak_mib_per_input")
    fidelity["reference_allocated_peak_mib_per_input"] = sums.get("reference_allocated_peak_mib_per_input")
    return fidelity
