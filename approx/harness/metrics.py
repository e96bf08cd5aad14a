"""Task metrics, from well-kept libraries (scikit-learn, scipy) plus SQuAD's official answer normalisation.

The ``evaluate`` library would fetch its metric scripts from the Hugging Face hub, which fails offline, so
the same definitions are called from scikit-learn and scipy directly:

* accuracy, F1 (positive class 1), Matthews correlation: ``sklearn.metrics``;
* Pearson and Spearman correlation: ``scipy.stats``;
* SQuAD v1.1 exact match and F1: the official evaluation script's normalisation (lower case, drop
  punctuation, drop the articles a/an/the, collapse white space), maximum over the gold answers.

Every function returns a plain float: percentages in [0, 100] (as GLUE and SQuAD report them), and correlations
(Matthews, Pearson, Spearman) multiplied by 100 too, in [-100, 100], as the GLUE leaderboard reports them.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Sequence

import numpy as np

__all__ = [
    "accuracy",
    "binary_f1",
    "matthews",
    "pearson",
    "spearman",
    "normalize_answer",
    "squad_exact_match",
    "squad_f1",
]


def accuracy(predictions: Sequence[int], labels: Sequence[int]) -> float:
    from sklearn.metrics import accuracy_score

    return 100.0 * float(accuracy_score(labels, predictions))


def binary_f1(predictions: Sequence[int], labels: Sequence[int]) -> float:
    """F1 of the positive class (label 1), as GLUE reports it for MRPC and QQP."""
    from sklearn.metrics import f1_score

    return 100.0 * float(f1_score(labels, predictions, pos_label=1, average="binary", zero_division=0.0))


def matthews(predictions: Sequence[int], labels: Sequence[int]) -> float:
    """Matthews correlation (CoLA), times 100; 0 when a prediction or label column is constant."""
    from sklearn.metrics import matthews_corrcoef

    return 100.0 * float(matthews_corrcoef(labels, predictions))


def _constant(x: Sequence[float]) -> bool:
    a = np.asarray(x, dtype=np.float64)
    return a.size < 2 or bool(np.all(a == a[0]))


def pearson(predictions: Sequence[float], labels: Sequence[float]) -> float:
    """Pearson correlation times 100 (NaN when either side is constant, where it is undefined)."""
    from scipy.stats import pearsonr

    if _constant(predictions) or _constant(labels):
        return float("nan")
    return 100.0 * float(pearsonr(np.asarray(predictions, float), np.asarray(labels, float))[0])


def spearman(predictions: Sequence[float], labels: Sequence[float]) -> float:
    """Spearman rank correlation times 100 (ties get average ranks; NaN when either side is constant)."""
    from scipy.stats import spearmanr

    if _constant(predictions) or _constant(labels):
        return float("nan")
    return 100.0 * float(spearmanr(np.asarray(predictions, float), np.asarray(labels, float))[0])


# ------------------------------------------------------------------------ the same metrics, row by row (resampling)
# What a bootstrap interval scores on each resample (approx.harness.resampling): the metrics above for every row of
# (B, n) arrays at once, as numpy arithmetic on the rows' confusion counts or moments. Each equals its scikit-learn
# or scipy counterpart row by row (tests/test_metrics.py checks them against those), for labels 0 and 1.


def _binary(*arrays: np.ndarray) -> bool:
    return all(np.isin(a, (0, 1)).all() for a in arrays)


def _confusion(pred: np.ndarray, gold: np.ndarray) -> tuple[np.ndarray, ...]:
    p, g = pred == 1, gold == 1
    tp, fp, fn = (p & g).sum(-1), (p & ~g).sum(-1), (~p & g).sum(-1)
    return tp, fp, fn, pred.shape[-1] - tp - fp - fn


def rows_accuracy(pred: np.ndarray, gold: np.ndarray) -> np.ndarray:
    """:func:`accuracy` of each row."""
    return 100.0 * (pred == gold).mean(-1)


def rows_binary_f1(pred: np.ndarray, gold: np.ndarray) -> np.ndarray:
    """:func:`binary_f1` of each row (labels 0 and 1; 0 where there is no positive at all, as ``zero_division=0``)."""
    tp, fp, fn, _ = _confusion(pred, gold)
    denominator = 2 * tp + fp + fn
    return 100.0 * np.where(denominator > 0, 2 * tp / np.maximum(denominator, 1), 0.0)


def rows_matthews(pred: np.ndarray, gold: np.ndarray) -> np.ndarray:
    """:func:`matthews` of each row (labels 0 and 1; 0 where a prediction or label column is constant)."""
    tp, fp, fn, tn = (c.astype(np.float64) for c in _confusion(pred, gold))
    denominator = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return 100.0 * np.where(denominator > 0, (tp * tn - fp * fn) / np.where(denominator > 0, denominator, 1.0), 0.0)


def rows_pearson(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """:func:`pearson` of each row (NaN where either side is constant)."""
    xc = x - x.mean(-1, keepdims=True)
    yc = y - y.mean(-1, keepdims=True)
    sx, sy = np.sqrt((xc * xc).sum(-1)), np.sqrt((yc * yc).sum(-1))
    constant = (x == x[..., :1]).all(-1) | (y == y[..., :1]).all(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = (xc * yc).sum(-1) / (sx * sy)
    return np.where(constant, np.nan, 100.0 * np.clip(r, -1.0, 1.0))


def rows_spearman(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """:func:`spearman` of each row: Pearson of the average ranks."""
    from scipy.stats import rankdata

    return rows_pearson(rankdata(x, axis=-1), rankdata(y, axis=-1))


# ------------------------------------------------------------------------------------------------ SQuAD v1.1

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD v1.1 normalisation: lower case, no punctuation, no articles, single spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _exact(prediction: str, truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(truth))


def _f1(prediction: str, truth: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = collections.Counter(pred) & collections.Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def squad_exact_match(predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> float:
    """Share of questions whose prediction equals a gold answer after normalisation, times 100."""
    return 100.0 * float(
        np.mean([max(_exact(p, t) for t in golds) for p, golds in zip(predictions, answers, strict=True)])
    )


def squad_f1(predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> float:
    """Mean over questions of the best token-overlap F1 against the gold answers, times 100."""
    return 100.0 * float(
        np.mean([max(_f1(p, t) for t in golds) for p, golds in zip(predictions, answers, strict=True)])
    )
