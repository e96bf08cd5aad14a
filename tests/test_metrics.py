"""Task metrics against hand-computed values, and SQuAD's answer normalisation against known cases."""

import math

import pytest
import torch

from approx.harness import metrics as M


def test_accuracy_and_binary_f1_by_hand():
    preds, gold = [1, 0, 1, 1, 0, 1], [1, 0, 0, 1, 1, 1]
    assert M.accuracy(preds, gold) == pytest.approx(100 * 4 / 6)
    # positive class: tp = 3, fp = 1, fn = 1 -> precision 3/4, recall 3/4, F1 0.75
    assert M.binary_f1(preds, gold) == pytest.approx(75.0)


def test_matthews_by_hand():
    preds, gold = [1, 1, 0, 0, 1, 0, 1], [1, 0, 0, 0, 1, 1, 1]
    tp, tn, fp, fn = 3, 2, 1, 1
    mcc = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert M.matthews(preds, gold) == pytest.approx(100 * mcc)
    assert M.matthews([1, 1, 1], [0, 1, 0]) == 0.0  # constant predictions


def test_pearson_and_spearman_by_hand():
    x, y = [1.0, 2.0, 3.0, 4.0], [2.0, 1.0, 4.0, 3.0]
    mx, my = 2.5, 2.5
    cov = sum((a - mx) * (b - my) for a, b in zip(x, y))
    r = cov / math.sqrt(sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y))
    assert M.pearson(x, y) == pytest.approx(100 * r)  # 0.6
    # ranks equal the values here, so Spearman is the same; a monotone transform keeps it
    assert M.spearman([v**3 for v in x], y) == pytest.approx(100 * r)
    # ties get average ranks: x ranks [1.5, 1.5, 3], y ranks [1, 2, 3] -> r = 0.866...
    assert M.spearman([5.0, 5.0, 7.0], [1.0, 2.0, 3.0]) == pytest.approx(100 * math.sqrt(3) / 2)
    assert math.isnan(M.pearson([1.0, 1.0], [1.0, 2.0]))


@pytest.mark.parametrize(
    "text, normal",
    [
        ("The Eiffel Tower", "eiffel tower"),
        ("  a  cat, an owl and the dog! ", "cat owl and dog"),
        ("Theatre", "theatre"),  # "the" only as a word
        ("1,000 B.C.", "1000 bc"),
        ("anthem", "anthem"),
    ],
)
def test_squad_normalisation_known_cases(text, normal):
    assert M.normalize_answer(text) == normal


def test_squad_exact_match_and_f1_by_hand():
    preds = ["the Denver Broncos", "Broncos of Denver", "Santa Clara"]
    golds = [["Denver Broncos"], ["Denver Broncos", "Broncos"], ["Levi's Stadium"]]
    assert M.squad_exact_match(preds, golds) == pytest.approx(100 / 3)
    # 2nd: vs "denver broncos": common 2, p = 2/3, r = 1 -> 0.8; vs "broncos": p = 1/3, r = 1 -> 0.5; best 0.8
    assert M.squad_f1(preds, golds) == pytest.approx(100 * (1 + 0.8 + 0) / 3)
    # the best of the gold answers, wherever it is in the list (scoring against the first one alone had survived)
    assert M.squad_exact_match(["Broncos"], [["Denver Broncos", "the Broncos"]]) == 100.0
    assert M.squad_f1(["Broncos"], [["Denver Broncos", "Broncos team"]]) == pytest.approx(100 * 2 / 3)


@pytest.mark.filterwarnings("ignore:A single label was found")  # scikit-learn on the all-zero row, as intended
def test_row_metrics_equal_scikit_learn_and_scipy_row_by_row():
    """What bootstrap resamples are scored with: each row of rows_* against the one-row metric (scikit-learn, scipy),
    edge cases included (no positive, constant predictions or labels, ties)."""
    import numpy as np

    rng = np.random.default_rng(0)
    pred, gold = rng.integers(0, 2, (40, 30)), rng.integers(0, 2, (40, 30))
    pred[0], gold[1], pred[2], gold[2] = 0, 1, 0, 0  # no predicted positive; constant labels; nothing positive at all
    for name, rows in (("accuracy", M.rows_accuracy), ("binary_f1", M.rows_binary_f1), ("matthews", M.rows_matthews)):
        got = rows(pred, gold)
        for b in range(len(pred)):
            assert got[b] == pytest.approx(getattr(M, name)(pred[b].tolist(), gold[b].tolist()), abs=1e-9), (name, b)
    x, y = rng.normal(size=(40, 25)), rng.normal(size=(40, 25))
    x[0], y[1] = 3.0, 1.0  # constant rows: NaN, as pearson() and spearman() give
    x[2] = np.round(x[2])  # ties: average ranks
    for name, rows in (("pearson", M.rows_pearson), ("spearman", M.rows_spearman)):
        got = rows(x, y)
        for b in range(len(x)):
            want = getattr(M, name)(x[b].tolist(), y[b].tolist())
            assert (math.isnan(got[b]) and math.isnan(want)) or got[b] == pytest.approx(want, abs=1e-9), (name, b)


def test_task_kl_is_scipys_kl_of_the_reference_from_the_model_averaged_over_inputs():
    """``Task.kl`` against scipy: KL(softmax(reference) || softmax(logits)) per distribution, the mean over the
    leading dimensions (its direction swapped, or a sum for the mean, had survived: the tests checked its sign)."""
    from scipy.stats import entropy

    from approx.harness.tasks.base import Task

    g = torch.Generator().manual_seed(0)
    ref, logits = torch.randn(3, 5, 7, generator=g) * 2, torch.randn(3, 5, 7, generator=g) * 2
    want = entropy(ref.softmax(-1).numpy(), logits.softmax(-1).numpy(), axis=-1).mean()
    assert Task.kl(ref, logits) == pytest.approx(float(want), rel=1e-6)
    assert Task.kl(ref, logits) != pytest.approx(Task.kl(logits, ref), rel=1e-3)  # the inputs are not symmetric
