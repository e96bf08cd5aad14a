"""Task metrics, from well-kept libraries (scikit-learn, scipy) plus SQuAD's official answer normalisation.

The ``evaluate`` library would fetch its metric scripts from the Hugging Face hub, which fails offline, so
the same definitions are called from scikit-learn and scipy directly:

* accuracy, F1 (positive class 1), Matthews correlation: ``sklearn.metrics``;
* Pearson and Spearman correlation: ``scipy.stats``;
* SQuAD v1.1 exact match and F1: the official evaluation script's normalisation (lower case, drop
  punctuation, drop the articles a/an/the, collapse white space), maximum over the gold answers.

Every function returns a plain float in [0, 100] for percentages (as GLUE and SQuAD report them) or in
[-1, 1] for correlations (multiplied by 100 too, as the GLUE leaderboard does).
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
