"""A task's metric on labelled examples for the model as it is, patched or not: what a ``score`` target of
:func:`approx.autotune` verifies its choice against.

::

    score = task_scorer(model, tok, "squad", split="dev/0", skip=64, limit=400)   # F1, SQuAD's primary metric
    score(model)                   # the unpatched model's F1 on those 400 questions
    tuning = approx.autotune(model, inputs, target="score>=0.99", score=score)   # keep 99 % of it

A fidelity target (cosine of the hidden states, KL of the head's outputs) is a proxy: on a QA reader, a KL of 0.02
on a few dozen held-out inputs can cost one point of F1 or none. A scorer measures what the user reports instead,
on labelled examples the tuning may read (the model's training data, never the data it will be evaluated on). The
examples are read and tokenised once; each call runs the model over them in batches, longest first, and scores the
predictions with the task's own ``predict`` and ``score``, as the harness does (``approx.evaluate`` gives the same
number for the same examples, settings and model: ``tests/test_autotune_score.py`` checks it).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import torch
from tqdm.auto import tqdm

from ..integration import model_head_from_name
from .resampling import paired_interval
from .tasks import Feature, Task, get_task
from .tasks.base import collate

__all__ = ["TaskScorer", "check_metric", "task_scorer"]


@dataclasses.dataclass
class TaskScorer:
    """Callable: ``scorer(model)`` is ``metric`` of ``task`` on the examples, for ``model`` as it is (patched or
    not; it runs in eval mode without gradients, its training flag restored). :meth:`describe` says what it reads."""

    task: Task
    mode: str
    metric: str
    split: str
    skip: int
    examples: list[dict[str, Any]]
    features: list[Feature]
    max_length: int
    batch_size: int
    pad_id: int
    source: str = ""
    progress: bool = False
    prepared: dict[str, Any] = dataclasses.field(default_factory=dict)  # what the task's prepare() said (labels)

    def __call__(self, model: torch.nn.Module) -> float:
        return self.scored(model)[0]

    def scored(self, model: torch.nn.Module) -> tuple[float, list[Any]]:
        """The metric and the per-example predictions it was computed from (what :meth:`interval` compares)."""
        device = next(model.parameters()).device
        # the task object is shared (one per registered task) and prepare() keeps what predict() reads (GLUE's label
        # map): prepared again for this model, so that another checkpoint prepared meanwhile changes nothing here
        with warnings.catch_warnings(record=True) as said:  # (said once, when the scorer was made for this model)
            warnings.simplefilter("always")
            prepared = self.task.prepare(model, self.mode)
        if prepared != self.prepared:  # another checkpoint than the scorer's: its warnings are news
            for w in said:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        order = sorted(range(len(self.features)), key=lambda i: -len(self.features[i].input_ids))
        outputs: list[Any] = [None] * len(self.features)
        training = model.training
        model.eval()
        try:
            with torch.inference_mode():
                bar = tqdm(total=len(order), disable=not self.progress, desc=f"score {self.task.name}", unit="input")
                with bar:
                    for start in range(0, len(order), self.batch_size):
                        idx = order[start : start + self.batch_size]
                        feats = [self.features[i] for i in idx]
                        inputs = collate(feats, self.pad_id, device)
                        out = model(**inputs, output_hidden_states=True)
                        for i, o in zip(idx, self.task.outputs(out, inputs, feats, self.mode), strict=True):
                            outputs[i] = o
                        bar.update(len(idx))
        finally:
            model.train(training)
        predictions = self.task.predict(self.examples, self.features, outputs, self.mode)
        return float(self.task.score(self.examples, predictions, self.mode)[self.metric]), predictions

    def interval(self, predictions: list[Any], reference_predictions: list[Any], **options: Any) -> dict[str, Any]:
        """The paired bootstrap interval of the metric under ``predictions`` minus under ``reference_predictions``
        on the scorer's examples (:func:`approx.harness.resampling.paired_interval`; ``options``: its resamples,
        level, seed)."""
        return paired_interval(self.task, self.mode, self.examples, predictions, reference_predictions, **options)

    def describe(self) -> dict[str, Any]:
        """What the scorer reads, for a tuning's record."""
        return {
            "task": self.task.name,
            "task_version": self.task.version,
            "mode": self.mode,
            "metric": self.metric,
            "split": self.split,
            "examples": f"{self.skip} to {self.skip + len(self.examples)} (of the split, as its limit reads them)",
            "count": len(self.examples),
            "max_length": self.max_length,
            "source": self.source,
            **({"label_mapping": self.prepared["label_mapping"]} if "label_mapping" in self.prepared else {}),
        }


def task_scorer(
    model: torch.nn.Module,
    tokenizer: Any,
    task: str | Task,
    *,
    split: str,
    metric: str | None = None,
    skip: int = 0,
    limit: int | None = None,
    max_length: int | None = None,
    batch_size: int = 32,
    data_dir: str | None = None,
    source: str | None = None,
    progress: bool = False,
) -> TaskScorer:
    """A :class:`TaskScorer` of ``task``'s ``metric`` (default: the task's primary metric) on the labelled examples
    ``skip`` to ``skip + limit`` of ``split`` (those that a limit of ``skip + limit`` reads and one of ``skip`` does
    not: :meth:`~approx.harness.tasks.base.Task.load_after`; the split's order, or ``squad-doc``'s round-robin over
    articles, MNLI's over its matched and mismatched sets), for the head ``model`` has. Use the data the model was trained on (or other labelled data it will not
    be evaluated on), past the examples the tuning calibrates on: ``skip`` = the calibration's ``limit`` when both
    read the same split.

    Only a metric where higher is better can be kept as a fraction (``score>=0.99``); a loss or perplexity is refused
    (use a ``kl`` target instead)."""
    spec = get_task(task) if isinstance(task, str) else task
    chosen = check_metric(spec, metric)
    if skip < 0 or (limit is not None and limit < 1) or batch_size < 1:
        raise ValueError(f"skip >= 0, limit >= 1 and batch_size >= 1 expected; got {skip}, {limit}, {batch_size}")
    mode = spec.mode_for(model_head_from_name(type(model).__name__))
    examples, where = spec.load_after(split, skip, limit=limit, source=source, data_dir=data_dir)
    if not examples:
        raise ValueError(f"{spec.name} {split}: no examples past the first {skip}; read fewer for calibration")
    if limit is not None and len(examples) < limit:
        warnings.warn(
            f"{spec.name} {split}: {len(examples)} labelled examples past the first {skip}, not the {limit} asked: "
            f"scoring on {len(examples)}",
            stacklevel=2,  # task_scorer's caller
        )
    prepared = spec.prepare(model, mode) or {}
    length = spec.default_max_length if max_length is None else max_length
    features = spec.features(examples, tokenizer, max_length=length, mode=mode)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return TaskScorer(
        spec, mode, chosen, split, skip, examples, features, length, batch_size, pad, where.describe(), progress,
        prepared,
    )  # fmt: skip


def check_metric(task: Task, metric: str | None) -> str:
    """The metric a score target keeps: ``metric`` (default: the task's primary one), refused when the task has no
    such metric or when lower is better (a fraction of a loss is not "kept")."""
    chosen = task.primary_metric if metric is None else metric
    if chosen not in task.metrics:
        raise ValueError(f"{task.name} has no metric {chosen!r}; its metrics: {', '.join(task.metrics)}")
    if chosen in task.lower_is_better:
        kept = [m for m in task.metrics if m not in task.lower_is_better]
        raise ValueError(
            f"{task.name}'s {chosen} is lower when better: a score target keeps a fraction of a metric where higher "
            f"is better ({', '.join(kept) or 'none here'}); use a kl target for this task"
        )
    return chosen


def relative(score: float, reference: float) -> float:
    """``score`` as a fraction of the unpatched model's ``reference``; refused where that is meaningless."""
    if not (math.isfinite(reference) and reference > 0):
        raise ValueError(
            f"the unpatched model scores {reference} on the scorer's examples: a score target keeps a fraction of a "
            "positive score; give more examples, another metric, or a kl or cosine target"
        )
    return score / reference
