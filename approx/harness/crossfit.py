"""Score a 2-fold cross-fitted evaluation as one: every example of the split scored by a model that never saw it.

Where a task's train split is not available offline (SST-2, QNLI, SQuAD here), one model is fine-tuned on
each half of the dev split (``dev/0``, ``dev/1``, see :func:`approx.harness.tasks.base.cross_fit_half`) and evaluated
on the other half. :func:`merge_halves` joins the two evaluations (run with ``approx.evaluate(...,
predictions=True)``) method by method: the task metrics, under the method and under full attention, are
computed once over the *union* of the halves' predictions (so F1, Matthews or Pearson are not averages of
two halves), and so is agreement / the prediction difference. Quantities the harness accumulates per batch are
combined exactly where they are sums (cost, seconds, peak memory) and weighted by each half's feature count
where they are means (KL divergence, hidden-state cosine, attention error); the halves' own results are kept
under ``"halves"``.
"""

from __future__ import annotations

import math
from typing import Any

from .evaluation import cost_block
from .tasks import Task, get_task

__all__ = ["merge_halves"]


def _weighted(values: list[float | None], weights: list[int]) -> float | None:
    pairs = [(v, w) for v, w in zip(values, weights, strict=True) if v is not None]
    if not pairs:
        return None
    return sum(v * w for v, w in pairs) / sum(w for _, w in pairs)


def _merge_fidelity(task: Task, mode: str, halves: list[dict[str, Any]], preds, ref_preds) -> dict[str, Any]:
    fids = [h["fidelity"] for h in halves]
    weights = [h["features"] for h in halves]
    merged: dict[str, Any] = dict(task.fidelity([None] * len(preds), ref_preds, preds, mode))
    if "kl_divergence" in fids[0]:
        merged["kl_divergence"] = _weighted([f.get("kl_divergence") for f in fids], weights)
    layers = len(fids[0]["hidden_state_cosine"]["per_layer"])
    per_layer = [_weighted([f["hidden_state_cosine"]["per_layer"][i] for f in fids], weights) for i in range(layers)]
    merged["hidden_state_cosine"] = {"last": per_layer[-1], "per_layer": per_layer}
    err_layers = list(fids[0]["attention_relative_error"]["per_layer"])
    errors = {
        i: math.sqrt(_weighted([f["attention_relative_error"]["per_layer"][i] ** 2 for f in fids], weights))
        for i in err_layers
    }
    merged["attention_relative_error"] = {
        "mean": sum(errors.values()) / len(errors) if errors else None,
        "per_layer": errors,
    }
    flops = sum(f["cost"]["attention_flops"] for f in fids)
    pairs = sum(f["cost"]["qk_pairs"] for f in fids)
    full_flops = sum(
        f["cost"]["attention_flops"] / f["cost"]["flops_vs_full"] for f in fids if f["cost"]["flops_vs_full"]
    )
    full_pairs = sum(
        f["cost"]["qk_pairs"] / f["cost"]["qk_pairs_vs_full"] for f in fids if f["cost"]["qk_pairs_vs_full"]
    )
    merged["cost"] = cost_block(flops, pairs, full_flops, full_pairs)
    seconds = sum(f["seconds"] for f in fids)
    ref_seconds = sum(f["reference_seconds"] for f in fids)
    merged.update(seconds=seconds, reference_seconds=ref_seconds, speedup=ref_seconds / seconds if seconds else None)
    for key in ("peak_memory_mib", "reference_peak_memory_mib"):
        values = [f[key] for f in fids if f.get(key) is not None]
        merged[key] = max(values) if values else None
    merged["combined"] = (
        "task metrics and agreement over the union of both halves; KL, hidden-state cosine and attention error "
        "weighted by each half's features; cost, seconds summed; peak memory the larger"
    )
    return merged


def merge_halves(
    halves: list[list[dict[str, Any]]], examples: list[list[dict[str, Any]]], *, protocol: str | None = None
) -> list[dict[str, Any]]:
    """One result per method from the two halves' results (``approx.evaluate(..., predictions=True)`` on
    ``dev/1`` with the model trained on ``dev/0`` and vice versa) and the examples each half was scored on
    (``task.load("dev/1")`` etc., the same ``limit``). The per-example predictions are dropped from the merged
    result; each half's result, without them, is kept under ``"halves"``."""
    if len(halves) != len(examples):
        raise ValueError(f"got {len(halves)} halves of results but {len(examples)} of examples")
    if len({len(h) for h in halves}) != 1:
        raise ValueError("every half must have been evaluated under the same methods")
    merged = []
    for per_method in zip(*halves, strict=True):
        first = per_method[0]
        if {r["method"]["name"] for r in per_method} != {first["method"]["name"]} or any(
            r["method"] != first["method"] for r in per_method
        ):
            raise ValueError(f"the halves ran different methods: {[r['method'] for r in per_method]}")
        for r, ex in zip(per_method, examples, strict=True):
            if "predictions" not in r:
                raise ValueError("run approx.evaluate(..., predictions=True) to merge halves")
            if len(r["predictions"]) != len(ex):
                raise ValueError(f"{len(r['predictions'])} predictions for {len(ex)} examples: not the same split")
        task = get_task(first["task"])
        mode = first["mode"]
        all_examples = [e for ex in examples for e in ex]
        preds = [p for r in per_method for p in r["predictions"]]
        ref_preds = [p for r in per_method for p in r["reference_predictions"]]
        result = {k: v for k, v in first.items() if k not in ("predictions", "reference_predictions")}
        result.update(
            split="+".join(r["split"] for r in per_method),
            model=[r["model"] for r in per_method],
            metrics=task.score(all_examples, preds, mode),
            reference_metrics=task.score(all_examples, ref_preds, mode),
            fidelity=_merge_fidelity(task, mode, list(per_method), preds, ref_preds),
            examples=len(all_examples),
            features=sum(r["features"] for r in per_method),
            cross_fitting=protocol
            or "2-fold cross-fitting: each half scored by the model fine-tuned on the other half; metrics over both",
            halves=[
                {k: v for k, v in r.items() if k not in ("predictions", "reference_predictions")} for r in per_method
            ],
        )
        merged.append(result)
    return merged
