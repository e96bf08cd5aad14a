"""Paired bootstrap intervals against independent references: the normal approximation of a mean of paired
differences (SQuAD's per-question F1 and exact match, SST-2's accuracy), Zou's (2007) interval for the difference of
two correlations that share the gold labels (STS-B's Pearson), and the task's own score on every resample (the
per-question shortcut must draw and score the same resamples)."""

import math

import numpy as np
import pytest
from scipy.stats import norm

from approx.harness import resampling
from approx.harness.tasks import get_task

Z95 = norm.ppf(0.975)


def _normal_interval(d: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """mean +- z * sd / sqrt(n) of per-example differences (the central limit theorem's interval)."""
    z = norm.ppf(0.5 + level / 2)
    half = z * d.std(ddof=1) / math.sqrt(len(d))
    return d.mean() - half, d.mean() + half


def _squad(n: int, right: np.ndarray):
    """SQuAD examples whose gold answer is a word, and predictions right (the answer) or wrong (another word)."""
    examples = [{"id": str(i), "answers": [f"word{i}"], "question": "", "context": ""} for i in range(n)]
    preds = [f"word{i}" if r else "nothing" for i, r in enumerate(right)]
    return examples, preds


def test_squad_interval_matches_the_normal_approximation_of_paired_differences():
    rng = np.random.default_rng(1)
    n = 3000
    ref_right = rng.random(n) < 0.7
    right = np.where(rng.random(n) < 0.15, ~ref_right, ref_right)  # the method flips 15 % of the answers
    examples, preds = _squad(n, right)
    _, ref_preds = _squad(n, ref_right)
    task = get_task("squad")
    out = resampling.paired_interval(task, "fine-tuned", examples, preds, ref_preds, resamples=4000, seed=0)
    d = 100.0 * (right.astype(float) - ref_right.astype(float))  # per-question F1 and EM are 0 or 100 here
    lo, hi = _normal_interval(d)
    width = hi - lo
    for m in ("f1", "exact_match"):
        got = out["metrics"][m]
        assert got["difference"] == pytest.approx(d.mean(), abs=1e-9)
        assert got["low"] == pytest.approx(lo, abs=0.05 * width)  # a 90 % interval's ends sit 0.08 widths inside
        assert got["high"] == pytest.approx(hi, abs=0.05 * width)
    assert out["examples"] == n and out["resamples"] == 4000 and out["level"] == 0.95 and out["primary"] == "f1"
    assert out["unit"].startswith("question")


def test_the_per_question_shortcut_draws_and_scores_what_the_tasks_score_would(monkeypatch):
    rng = np.random.default_rng(2)
    n = 300
    golds = [[f"the red {i} house", f"house {i}"] for i in range(n)]
    examples = [{"id": str(i), "answers": g, "question": "", "context": ""} for i, g in enumerate(golds)]
    words = ["red", "house", "the", "blue", "tree"]

    def guess(i):  # partial overlaps: F1 strictly between 0 and 100 for many questions
        return " ".join(rng.choice(words, size=rng.integers(1, 4))) + (f" {i}" if rng.random() < 0.5 else "")

    preds, ref_preds = [guess(i) for i in range(n)], [guess(i) for i in range(n)]
    task = get_task("squad")
    values = task.example_values(examples, preds, "fine-tuned")
    scored = task.score(examples, preds, "fine-tuned")
    for m in ("f1", "exact_match"):  # the per-question values average to the task's metric
        assert np.mean(values[m]) == pytest.approx(scored[m], abs=1e-9)
    fast = resampling.paired_interval(task, "fine-tuned", examples, preds, ref_preds, resamples=300, seed=5)
    monkeypatch.setattr(type(task), "example_values", lambda self, *a: None)  # every resample scored by task.score
    slow = resampling.paired_interval(task, "fine-tuned", examples, preds, ref_preds, resamples=300, seed=5)
    for m in ("f1", "exact_match"):
        for key in ("difference", "low", "high"):
            assert fast["metrics"][m][key] == pytest.approx(slow["metrics"][m][key], abs=1e-9)


@pytest.mark.parametrize("name", ["sst2", "qnli", "rte", "wnli", "mnli", "cola", "mrpc", "qqp", "stsb"])
def test_glue_shortcuts_give_the_interval_that_scoring_every_resample_gives(name, monkeypatch):
    """Accuracy tasks give per-example values (MNLI's per group, NaN outside it) whose mean is the task's metric; the
    others score every resample at once from confusion counts or moments. Either way the interval is the one that
    scoring every resample with the task's own score gives (the same draws)."""
    task = get_task(name)
    rng = np.random.default_rng(6)
    n, groups = 240, list(task.groups)
    if name == "stsb":
        labels = rng.uniform(0, 5, n)
        preds, ref = (labels + rng.normal(0, 1.5, n)).tolist(), (labels + rng.normal(0, 1.2, n)).tolist()
        labels = labels.tolist()
    else:
        labels = rng.integers(0, 3 if name == "mnli" else 2, n)
        preds = np.where(rng.random(n) < 0.3, (labels + 1) % 2, labels).tolist()
        ref = np.where(rng.random(n) < 0.25, (labels + 1) % 2, labels).tolist()
        labels = labels.tolist()
    examples = [
        {"text": "", "text_pair": "", "label": y, "group": groups[i % len(groups)]} for i, y in enumerate(labels)
    ]
    values = task.example_values(examples, preds, "fine-tuned")
    scored = task.score(examples, preds, "fine-tuned")
    if values is not None:
        assert set(values) == set(scored) == set(task.metrics)
        for m in task.metrics:
            assert np.nanmean(values[m]) == pytest.approx(scored[m], abs=1e-9)
    else:  # every row of resample_scores is score() of that resample
        idx = rng.integers(0, n, (5, n))
        rows = task.resample_scores(examples, preds, "fine-tuned", idx)
        for b in range(5):
            expected = task.score([examples[i] for i in idx[b]], [preds[i] for i in idx[b]], "fine-tuned")
            for m in task.metrics:
                assert rows[m][b] == pytest.approx(expected[m], abs=1e-9)
    fast = resampling.paired_interval(task, "fine-tuned", examples, preds, ref, resamples=200, seed=3)
    monkeypatch.setattr(type(task), "example_values", lambda self, *a: None)
    monkeypatch.setattr(type(task), "resample_scores", lambda self, *a: None)  # every resample scored by score()
    slow = resampling.paired_interval(task, "fine-tuned", examples, preds, ref, resamples=200, seed=3)
    for m in task.metrics:
        for key in ("difference", "low", "high"):
            assert fast["metrics"][m][key] == pytest.approx(slow["metrics"][m][key], abs=1e-9)


def test_accuracy_interval_matches_the_normal_approximation():
    rng = np.random.default_rng(3)
    n = 2000
    labels = rng.integers(0, 2, n)
    ref = np.where(rng.random(n) < 0.8, labels, 1 - labels)
    pred = np.where(rng.random(n) < 0.1, 1 - ref, ref)
    task = get_task("sst2")
    examples = [{"text": "", "text_pair": None, "label": int(y), "group": ""} for y in labels]
    out = resampling.paired_interval(task, "fine-tuned", examples, pred.tolist(), ref.tolist(), resamples=3000, seed=1)
    d = 100.0 * ((pred == labels).astype(float) - (ref == labels).astype(float))
    lo, hi = _normal_interval(d)
    got = out["metrics"]["accuracy"]
    assert got["difference"] == pytest.approx(d.mean(), abs=1e-9)
    assert got["low"] == pytest.approx(lo, abs=0.05 * (hi - lo))
    assert got["high"] == pytest.approx(hi, abs=0.05 * (hi - lo))


def test_masked_lm_loss_interval_matches_the_delta_method_over_windows():
    """WikiText's loss is a ratio of sums over windows (masked tokens' loss over their count), the same windows and
    masks for both sides: D = sum(a_i - b_i) / sum(c_i), whose linearised variance is n var(a_i - b_i - D c_i) /
    (sum c_i)^2. The split is one example; the bootstrap draws its windows."""
    rng = np.random.default_rng(8)
    n = 1500
    counts = rng.integers(60, 80, n)
    ref_loss = counts * rng.gamma(4.0, 0.5, n)
    loss = ref_loss * rng.normal(1.03, 0.05, n)
    preds = [{"loss_sum": float(x), "count": int(c), "top1": []} for x, c in zip(loss, counts)]
    refs = [{"loss_sum": float(x), "count": int(c), "top1": []} for x, c in zip(ref_loss, counts)]
    task = get_task("wikitext2")
    out = resampling.paired_interval(task, "masked-lm", [{"text": ""}], preds, refs, resamples=3000, seed=4)
    d = (loss - ref_loss).sum() / counts.sum()
    z = loss - ref_loss - d * counts
    half = Z95 * math.sqrt(n) * z.std(ddof=1) / counts.sum()
    got = out["metrics"]["mlm_loss"]
    assert got["difference"] == pytest.approx(d, rel=1e-9)
    assert got["low"] == pytest.approx(d - half, abs=0.05 * 2 * half)
    assert got["high"] == pytest.approx(d + half, abs=0.05 * 2 * half)
    assert out["examples"] == n and out["unit"].startswith("window") and set(out["metrics"]) == set(task.metrics)


def _zou_interval(pred_a, pred_b, y, level=0.95):
    """Zou (2007), "Toward using confidence intervals to compare correlations": r(a, y) - r(b, y), Fisher-z
    intervals of each, combined through the correlation of the two estimates (they share y)."""
    n = len(y)
    r1, r2, r12 = np.corrcoef(pred_a, y)[0, 1], np.corrcoef(pred_b, y)[0, 1], np.corrcoef(pred_a, pred_b)[0, 1]
    z = norm.ppf(0.5 + level / 2)

    def fisher(r):
        return math.tanh(math.atanh(r) - z / math.sqrt(n - 3)), math.tanh(math.atanh(r) + z / math.sqrt(n - 3))

    (l1, u1), (l2, u2) = fisher(r1), fisher(r2)
    c = ((r12 - 0.5 * r1 * r2) * (1 - r1**2 - r2**2 - r12**2) + r12**3) / ((1 - r1**2) * (1 - r2**2))
    low = r1 - r2 - math.sqrt((r1 - l1) ** 2 + (u2 - r2) ** 2 - 2 * c * (r1 - l1) * (u2 - r2))
    high = r1 - r2 + math.sqrt((u1 - r1) ** 2 + (r2 - l2) ** 2 - 2 * c * (u1 - r1) * (r2 - l2))
    return 100 * low, 100 * high  # GLUE's correlations are reported times 100


def test_pearson_interval_matches_zous_interval_for_overlapping_correlations():
    rng = np.random.default_rng(4)
    n = 1500
    y = rng.normal(size=n)
    ref = 0.8 * y + 0.6 * rng.normal(size=n)
    pred = ref + 0.35 * rng.normal(size=n)  # the method adds noise to full attention's prediction
    task = get_task("stsb")
    examples = [{"text": "", "text_pair": "", "label": float(v), "group": ""} for v in y]
    out = resampling.paired_interval(task, "fine-tuned", examples, pred.tolist(), ref.tolist(), resamples=3000, seed=2)
    lo, hi = _zou_interval(pred, ref, y)
    got = out["metrics"]["pearson"]
    assert lo < got["difference"] < hi and hi < 0  # the added noise costs correlation, clearly
    assert got["low"] == pytest.approx(lo, abs=0.06 * (hi - lo))
    assert got["high"] == pytest.approx(hi, abs=0.06 * (hi - lo))
    assert set(out["metrics"]) == {"pearson", "spearman"} and out["primary"] == "pearson"


def test_identical_predictions_give_an_interval_of_exactly_zero_and_seeds_are_kept():
    task = get_task("mrpc")
    rng = np.random.default_rng(5)
    labels = rng.integers(0, 2, 200)
    preds = np.where(rng.random(200) < 0.8, labels, 1 - labels).tolist()
    examples = [{"text": "", "text_pair": "", "label": int(y), "group": ""} for y in labels]
    same = resampling.paired_interval(task, "fine-tuned", examples, preds, list(preds), resamples=200)
    for entry in same["metrics"].values():
        assert entry == {"difference": 0.0, "low": 0.0, "high": 0.0}
    other = np.where(rng.random(200) < 0.2, 1 - np.array(preds), preds).tolist()
    a = resampling.paired_interval(task, "fine-tuned", examples, other, preds, resamples=200, seed=7)
    b = resampling.paired_interval(task, "fine-tuned", examples, other, preds, resamples=200, seed=7)
    c = resampling.paired_interval(task, "fine-tuned", examples, other, preds, resamples=200, seed=8)
    assert a == b and a["metrics"] != c["metrics"] and a["seed"] == 7


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"resamples": 0}, "resamples must be a positive int"),
        ({"resamples": 10.0}, "resamples must be a positive int"),
        ({"level": 1.0}, "level must be between 0 and 1"),
        ({"level": 95}, "level must be between 0 and 1"),
    ],
)
def test_bad_options_are_refused(kwargs, words):
    task = get_task("sst2")
    examples = [{"label": i % 2, "group": ""} for i in range(4)]
    with pytest.raises(ValueError, match=words):
        resampling.paired_interval(task, "fine-tuned", examples, [0, 1, 0, 1], [0, 1, 1, 1], **kwargs)


def test_predictions_that_do_not_match_the_examples_are_refused():
    task = get_task("sst2")
    examples = [{"label": i % 2, "group": ""} for i in range(4)]
    with pytest.raises(ValueError, match="3 and 4 predictions for 4 examples"):
        resampling.paired_interval(task, "fine-tuned", examples, [0, 1, 0], [0, 1, 1, 1])
    with pytest.raises(ValueError, match="at least 2 examples"):
        resampling.paired_interval(task, "fine-tuned", examples[:1], [0], [1])


def test_interval_text():
    assert resampling.interval_text({"difference": -3.214, "low": -4.9, "high": 0.5}) == "-3.21 [-4.90, +0.50]"
    assert resampling.interval_text(None) == "-"
    assert resampling.interval_text({"difference": float("nan"), "low": 1.0, "high": 2.0}).startswith("nan")
