"""How far a difference of task metrics could move with other examples of the same kind: paired bootstrap intervals.

A method's metric and full attention's are measured on the same examples, so their difference is judged example by
example: the evaluation's examples are drawn again with replacement, as many as there were, both sides are scored on
each such resample with the task's own ``score``, and the interval holds the central ``level`` share of the
resampled differences (the paired bootstrap of Koehn, "Statistical significance tests for machine translation
evaluation", EMNLP 2004, with the percentile interval of Efron and Tibshirani; ``scipy.stats.bootstrap`` draws the
resamples and takes the percentiles). It answers "could this gap be the sample's luck?": an interval that holds 0
says the examples do not tell the two apart at that level.

::

    result = approx.evaluate(reader, "squad", ["clustered:clusters=25"])[0]
    result["intervals"]["metrics"]["f1"]    # {"difference": d, "low": lo, "high": hi}, method minus full

    a, b = approx.evaluate(reader, "squad", ["tuned/", "i-clustered"], predictions=True)
    paired_interval(task, a["mode"], examples, a["predictions"], b["predictions"])   # tuned minus i-clustered

Every metric a task reports is resampled the same way, whatever its form: a mean over examples (accuracy, F1, exact
match), a correlation (Pearson, Spearman, Matthews) or a ratio of sums (masked-LM loss over tokens: the unit
resampled is the window). Three paths give the same numbers: per-example values for means (``Task.example_values``),
every resample at once from confusion counts or moments (``Task.resample_scores``: GLUE's F1, Matthews and
correlations), and otherwise the task's ``score`` on each resample. What the interval does not cover: the
fine-tuning's own randomness (another seed gives another checkpoint), and a method's random state (another seed
draws other projections), both of which move a metric too. Examples are taken as independent; SQuAD's windows of one question are one example, as the metric
counts them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from .tasks import Task

__all__ = [
    "DEFAULT_LEVEL",
    "DEFAULT_RESAMPLES",
    "interval_options",
    "interval_text",
    "level_label",
    "paired_interval",
]

DEFAULT_RESAMPLES = 1000
_BATCH_ELEMENTS = 1 << 24  # per-example differences gathered at once by the vectorised path (128 MiB of float64)
DEFAULT_LEVEL = 0.95
METHOD = (
    "paired bootstrap over examples (Koehn 2004): the examples drawn again with replacement, both sides scored on each "
    "resample with the task's metric, percentile interval of the differences (scipy.stats.bootstrap)"
)


TAIL = 5  # resamples beyond each end of an interval, at least


def level_label(level: float) -> str:
    """An interval's level as a percentage, to the digits it has (0.95 -> "95%", 0.999 -> "99.9%"): a whole percent
    had printed 0.999 as "100%" and 0.975 as "98%"."""
    return f"{level * 100:.6g}%"


def check(resamples: int, level: float) -> None:
    """Refuse a number of resamples or a level that cannot make an interval."""
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"resamples must be a positive int, got {resamples!r} (0 or None turns intervals off)")
    if not (isinstance(level, float | int) and 0 < level < 1):
        raise ValueError(f"level must be between 0 and 1 (e.g. 0.95), got {level!r}")
    least = math.ceil(2 * TAIL / (1 - level) - 1e-9)
    if resamples < least:  # a percentile interval's ends are order statistics of the resamples beyond them
        raise ValueError(
            f"{resamples} resamples leave fewer than {TAIL} beyond each end of a {level_label(level)} interval, whose ends are "
            f"then no estimate: give at least {least} (1000 is the default)"
        )


def interval_options(resamples: int | None, level: float, seed: int) -> dict[str, Any] | None:
    """:func:`paired_interval`'s options as an evaluation passes them (None: no intervals, ``resamples`` 0 or None),
    checked."""
    if not resamples:
        return None
    check(resamples, level)
    return {"resamples": resamples, "level": level, "seed": seed}


def paired_interval(
    task: Task,
    mode: str,
    examples: Sequence[dict[str, Any]],
    predictions: Sequence[Any],
    reference_predictions: Sequence[Any],
    *,
    resamples: int = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
    seed: int = 0,
) -> dict[str, Any]:
    """The paired bootstrap interval of ``task``'s metrics under ``predictions`` minus under
    ``reference_predictions`` (both per example, in ``examples``' order, as ``approx.evaluate(...,
    predictions=True)`` returns them; WikiText: per window), for every metric the task reports.

    Returns ``{"method", "level", "resamples", "seed", "unit", "examples", "primary", "metrics"}`` with ``metrics[name] =
    {"difference", "low", "high"}``: the difference on the examples as given and the interval's ends. An end is NaN
    where the metric is undefined on some resample (a correlation of constant predictions). The resamples are drawn
    from ``seed``, the same draws for every metric; identical predictions give an interval of exactly 0."""
    from scipy import stats as scipy_stats
    from scipy.stats import bootstrap

    check(resamples, level)
    preds, refs = list(predictions), list(reference_predictions)
    examples = task.resampling_examples(list(examples), preds, mode)
    n = len(examples)
    if len(preds) != n or len(refs) != n:
        raise ValueError(
            f"{len(preds)} and {len(refs)} predictions for {n} examples: give one per example, in the examples' order"
        )
    if n < 2:
        raise ValueError(f"a bootstrap interval needs at least 2 examples, got {n}")
    observed_a, observed_b = task.score(examples, preds, mode), task.score(examples, refs, mode)
    names = [m for m in task.metrics if m in observed_a and m in observed_b]
    if not names:
        raise ValueError(f"{task.name} reports no metric in mode {mode!r}: nothing to compare")

    values, values_ref = task.example_values(examples, preds, mode), task.example_values(examples, refs, mode)
    if values is not None and values_ref is not None and set(names) <= set(values):
        # every metric is a mean over examples (over those not NaN): the difference of means is the mean of the
        # differences, since both sides count the same examples
        diffs = np.stack([np.asarray(values[m], float) - np.asarray(values_ref[m], float) for m in names])

        def statistic(idx, axis=-1):
            with warnings.catch_warnings():  # a resample without an example of a group: NaN, as score() has none
                warnings.simplefilter("ignore", RuntimeWarning)
                return np.nanmean(diffs[:, idx], axis=-1)

        vectorized = True
    elif _rows_cover(task.resample_scores(examples, preds, mode, np.arange(n)[None]), names):
        # every metric computed for all resamples at once, from their confusion counts or moments

        def statistic(idx, axis=-1):
            a, b = task.resample_scores(examples, preds, mode, idx), task.resample_scores(examples, refs, mode, idx)
            return np.stack([np.asarray(a[m], float) - np.asarray(b[m], float) for m in names])

        vectorized = True
    else:

        def statistic(idx):
            ex = [examples[i] for i in idx]
            with warnings.catch_warnings():  # a resample with one label or constant predictions: said once, above
                warnings.simplefilter("ignore")
                a = task.score(ex, [preds[i] for i in idx], mode)
                b = task.score(ex, [refs[i] for i in idx], mode)
            return np.array([a.get(m, math.nan) - b.get(m, math.nan) for m in names], dtype=float)

        vectorized = False
    with warnings.catch_warnings():
        # scipy says "The BCa confidence interval cannot be calculated" (DegenerateDataWarning) whenever some resample's
        # statistic is NaN, whatever the method (this one is the percentile): the interval is then NaN, which the
        # harness's report and evaluate() say in words (approx.harness.evaluation.undefined_notes)
        warnings.simplefilter("ignore", getattr(scipy_stats, "DegenerateDataWarning", RuntimeWarning))
        result = bootstrap(
            (np.arange(n),),
            statistic,
            n_resamples=resamples,
            vectorized=vectorized,
            batch=max(1, _BATCH_ELEMENTS // (n * len(names))) if vectorized else None,
            method="percentile",
            confidence_level=level,
            rng=np.random.default_rng(seed),
        )
    low = np.atleast_1d(result.confidence_interval.low)
    high = np.atleast_1d(result.confidence_interval.high)
    metrics = {}
    for i, m in enumerate(names):
        metrics[m] = {"difference": float(observed_a[m] - observed_b[m]), "low": float(low[i]), "high": float(high[i])}
    return {
        "method": METHOD,
        "level": float(level),
        "resamples": int(resamples),
        "seed": int(seed),
        "unit": task.resampling_unit(mode),
        "examples": n,
        "primary": task.primary_metric,
        "metrics": metrics,
    }


def _rows_cover(rows: dict[str, Any] | None, names: list[str]) -> bool:
    return rows is not None and set(names) <= set(rows)


def interval_text(entry: dict[str, float] | None, digits: int = 2) -> str:
    """``-3.21 [-4.90, -1.58]`` for a metric's entry of :func:`paired_interval`; ``-`` when there is none."""
    if not entry:
        return "-"

    def f(x: float) -> str:
        return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:+.{digits}f}"

    return f"{f(entry['difference'])} [{f(entry['low'])}, {f(entry['high'])}]"
