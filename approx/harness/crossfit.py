"""Score a 2-fold cross-fitted evaluation as one: every example of the split scored by a model that never saw it.

Where a task's train split is not available offline (SST-2, QNLI, SQuAD here), one model is fine-tuned on
each half of the dev split (``dev/0``, ``dev/1``, see :func:`approx.harness.tasks.base.cross_fit_half`) and evaluated
on the other half. :func:`merge_halves` joins the two evaluations (run with ``approx.evaluate(...,
predictions=True)``) method by method: the task metrics, under the method and under full attention, are
computed once over the *union* of the halves' predictions (so F1, Matthews or Pearson are not averages of
two halves), as is their bootstrap interval against full attention (``"intervals"``, when the halves have one: over
both halves' examples, with the halves' resamples, level and seed), and the fidelity is computed by the same
function as a single evaluation's (:func:`approx.harness.fidelity.summarize`) from the sum of the halves' fidelity sums, so it equals what one
evaluation of both halves would report. The halves' own results are kept under ``"halves"``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from . import fidelity as fid
from .resampling import paired_interval
from .tasks import get_task
from .tasks.base import splits_overlap

__all__ = ["examples_digest", "merge_halves"]

# what predictions=True adds to a result, and merging needs (results written before 2026-11-25 have no digest)
CARRIED = ("predictions", "reference_predictions", "fidelity_sums")
DROPPED = (*CARRIED, "examples_digest")  # left out of the merged result and of its halves


def examples_digest(examples: list[dict[str, Any]]) -> str:
    """A fingerprint of the examples a result scored, in order (SHA-256 of their JSON, 16 hex digits): merging checks
    that the examples given for a half are the ones it was scored on."""
    text = json.dumps(examples, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _trained_on(model: Any, task: str) -> str | None:
    """The split ``model`` (a folder ``approx finetune`` wrote) was fine-tuned on for ``task``, from its
    ``finetune.json``; None when it has none (a hub id, a model fine-tuned elsewhere, another task)."""
    record = Path(model) / "finetune.json" if isinstance(model, str) else None
    try:
        found = json.loads(record.read_text()) if record is not None and record.is_file() else {}
    except (OSError, ValueError):
        return None
    return found.get("train_split") if isinstance(found, dict) and found.get("task") == task else None


def _check_cross_fitting(per_method: tuple[dict[str, Any], ...], protocol: str | None) -> None:
    """Refuse halves the merged result would misdescribe (see :func:`merge_halves`)."""
    models = [r.get("model") for r in per_method]
    # a model is told apart by its weights (an object's name may be the checkpoint it was fine-tuned from, the same
    # for both); a path scored before 2026-12-01 has no digest, so one name with a digest missing on either side reads
    # as one model
    weights = [r.get("model_weights_sha256") for r in per_method]
    named_alike = len({json.dumps(m, default=str) for m in models}) == 1
    same = named_alike and (None in weights or len(set(weights)) == 1)
    if protocol is None and None not in models and same:
        if None not in weights:
            which = f"both halves were scored by the same model ({models[0]}, the same weights)"
        elif any(r.get("model_weights_sha256", "") is None for r in per_method):  # an object without a digest
            which = (
                f"both halves were scored by models named {models[0]}, which their records cannot tell apart (a "
                "model whose weights give no digest: quantized, or on the meta device)"
            )
        else:
            which = f"both halves were scored by the same model ({models[0]})"
        raise ValueError(
            f"{which}: 2-fold cross-fitting scores each half with the model fine-tuned on the other half; give "
            "protocol=... saying what was done to merge them anyway"
        )
    for r in per_method:
        trained = _trained_on(r.get("model"), r.get("task"))
        if trained is not None and r.get("split") and splits_overlap(trained, r["split"]):
            raise ValueError(
                f"the half {r['split']!r} was scored by {r['model']}, fine-tuned on {trained!r} (its finetune.json), "
                "which holds those examples: its scores are not held out"
            )


def merge_halves(
    halves: list[list[dict[str, Any]]], examples: list[list[dict[str, Any]]], *, protocol: str | None = None
) -> list[dict[str, Any]]:
    """One result per method from the two halves' results (``approx.evaluate(..., predictions=True)`` on
    ``dev/1`` with the model trained on ``dev/0`` and vice versa) and the examples each half was scored on
    (``task.load("dev/1")`` etc., the same ``limit``). The per-example predictions and fidelity sums are dropped from
    the merged result; each half's result, without them, is kept under ``"halves"``.

    The merged result says it was cross-fitted (``"cross_fitting"``: ``protocol``, by default "each half scored by
    the model fine-tuned on the other half"). So one model scoring both halves is refused under the default
    ``protocol`` (give one that says what was done to merge them anyway), and a half scored by a model whose
    ``finetune.json`` says it trained on that half's examples is refused always."""
    if len(halves) != len(examples):
        raise ValueError(f"got {len(halves)} halves of results but {len(examples)} of examples")
    if len({len(h) for h in halves}) != 1:
        raise ValueError("every half must have been evaluated under the same methods")
    digests = [examples_digest(ex) for ex in examples]
    merged = []
    for per_method in zip(*halves, strict=True):
        first = per_method[0]
        if {r["method"]["name"] for r in per_method} != {first["method"]["name"]} or any(
            r["method"] != first["method"] for r in per_method
        ):
            raise ValueError(f"the halves ran different methods: {[r['method'] for r in per_method]}")
        for r, ex in zip(per_method, examples, strict=True):
            if any(key not in r for key in CARRIED):
                raise ValueError("run approx.evaluate(..., predictions=True) to merge halves")
            if len(r["predictions"]) != len(ex):
                raise ValueError(f"{len(r['predictions'])} predictions for {len(ex)} examples: not the same split")
        for r, digest in zip(per_method, digests, strict=True):
            if r.get("examples_digest", digest) != digest:  # (results from before the digest are taken as given)
                raise ValueError(
                    f"the examples given for the half scored on {r.get('split')!r} are not the ones it was scored on "
                    "(another half's, another limit or another order): give each half's examples in the halves' order"
                )
        splits = [r.get("split") for r in per_method]
        if None not in splits and len(set(splits)) != len(splits):
            raise ValueError(f"the same half given twice: {splits}")
        for key in ("task", "task_version", "mode", "max_length", "local"):
            if len({json.dumps(r.get(key)) for r in per_method}) != 1:
                raise ValueError(f"the halves differ in {key!r}: {[r.get(key) for r in per_method]}")
        _check_cross_fitting(per_method, protocol)
        task = get_task(first["task"])
        mode = first["mode"]
        all_examples = [e for ex in examples for e in ex]
        preds = [p for r in per_method for p in r["predictions"]]
        ref_preds = [p for r in per_method for p in r["reference_predictions"]]
        result = {k: v for k, v in first.items() if k not in DROPPED}
        extended = [r for r in per_method if r.get("positions")]
        if extended:  # each half extended the positions to its own longest input: the merge reports the longest
            longest = max(extended, key=lambda r: r["positions"]["extended_to"])
            result.update(positions=longest["positions"], protocol=longest["protocol"])
        fidelity = fid.summarize(task, mode, fid.total_sums(r["fidelity_sums"] for r in per_method), ref_preds, preds)
        fidelity["combined"] = (
            "task metrics, agreement and every fidelity quantity computed once over both halves (from the sums "
            "of their per-batch records); peak memory the larger"
        )
        if first.get("intervals"):  # the halves' intervals replaced by one over both halves' examples, drawn alike
            options = {k: first["intervals"][k] for k in ("resamples", "level", "seed")}
            result["intervals"] = paired_interval(task, mode, all_examples, preds, ref_preds, **options)
        result.update(
            split="+".join(r["split"] for r in per_method),
            model=[r["model"] for r in per_method],
            **(
                {"model_weights_sha256": [r.get("model_weights_sha256") for r in per_method]}
                if any(r.get("model_weights_sha256") for r in per_method)
                else {}
            ),
            # each half's state (a fitted folder per half, say), or none: not the first half's as if it were both's
            **(
                {"method_state": [r.get("method_state") for r in per_method]}
                if any(r.get("method_state") for r in per_method)
                else {}
            ),
            metrics=task.score(all_examples, preds, mode),
            reference_metrics=task.score(all_examples, ref_preds, mode),
            fidelity=fidelity,
            examples=len(all_examples),
            features=sum(r["features"] for r in per_method),
            cross_fitting=protocol
            or "2-fold cross-fitting: each half scored by the model fine-tuned on the other half; metrics over both",
            halves=[{k: v for k, v in r.items() if k not in DROPPED} for r in per_method],
        )
        merged.append(result)
    return merged
