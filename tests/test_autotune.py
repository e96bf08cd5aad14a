"""approx.autotune (issue 20): the search against brute force, the tuned model against the unpatched one measured
here independently, the record through save / load / evaluate, the command line and the errors."""

from __future__ import annotations

import copy
import itertools
import json
import math
import random
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

import approx
from approx.harness.autotune import hull_path, parse_target
from approx.harness.cli import main
from approx.harness.spec import PER_LAYER, as_setup, short_label
from approx.harness.tasks import get_task

CANDIDATES = ["i-clustered:clusters=3,topk=4", "nystrom:landmarks=4", "linformer:projections=8", "efficient"]


def _data(count: int, seed: int, lo: int = 20, hi: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (count,), generator=g)
    return [torch.randint(5, 99, (int(n),), generator=g).tolist() for n in lengths]


def _batches(rows: list[list[int]], size: int = 4) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(0, len(rows), size):
        chunk = rows[i : i + size]
        n = max(map(len, chunk))
        ids = torch.zeros(len(chunk), n, dtype=torch.long)
        mask = torch.zeros(len(chunk), n, dtype=torch.long)
        for j, r in enumerate(chunk):
            ids[j, : len(r)], mask[j, : len(r)] = torch.tensor(r), 1
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def _cosine(reference, model, batches) -> float:
    """Mean over real tokens of the cosine between the two models' last hidden states, written here."""
    num = den = 0.0
    with torch.no_grad():
        for b in batches:
            a = reference(**b, output_hidden_states=True).hidden_states[-1].double()
            o = model(**b, output_hidden_states=True).hidden_states[-1].double()
            cos = (a * o).sum(-1) / (a.norm(dim=-1) * o.norm(dim=-1))
            num, den = num + float((cos * b["attention_mask"]).sum()), den + float(b["attention_mask"].sum())
    return num / den


def _patched_as(original, choices: list[str], seed: int = 0):
    """A copy of ``original`` patched layer by layer with ``choices`` (labels as the tuning reports them)."""
    model = copy.deepcopy(original)
    for i, label in enumerate(choices):
        setup = as_setup(label, seed)
        approx.patch(model, setup.method, layers=[i], **setup.options)
    return model


# ---------------------------------------------------------------------------------------------------- search


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cost_unit, loss_unit", [(1.0, 1.0), (1e9, 1e-6), (1e-3, 1e4)])
def test_hull_path_is_optimal_at_each_of_its_costs(seed, cost_unit, loss_unit):
    """Brute force over every assignment: no assignment costing at most a path point's cost has a lower summed
    loss (the path's points minimise loss + lambda * cost); costs fall strictly along the path. In any units: the
    search sees FLOP counts (1e9 a layer) and KL divergences of 1e-6, and the path is the same as in units of 1."""
    rng = random.Random(seed)
    layers, options = 4, 4
    unit_loss = [
        [0.0] + [rng.choice([0.0, rng.random(), rng.random() ** 3]) for _ in range(options - 1)] for _ in range(layers)
    ]
    unit_cost = [[1.0] + [rng.choice([rng.random(), 1.5]) for _ in range(options - 1)] for _ in range(layers)]
    loss = [[x * loss_unit for x in row] for row in unit_loss]
    cost = [[x * cost_unit for x in row] for row in unit_cost]
    path = hull_path(loss, cost)
    assert path == hull_path(unit_loss, unit_cost)
    assert path[0] == [0] * layers
    totals = [(sum(cost[i][a] for i, a in enumerate(p)), sum(loss[i][a] for i, a in enumerate(p))) for p in path]
    assert all(b[0] < a[0] for a, b in itertools.pairwise(totals))
    everything = [
        (sum(cost[i][a] for i, a in enumerate(p)), sum(loss[i][a] for i, a in enumerate(p)))
        for p in itertools.product(range(options), repeat=layers)
    ]
    for c, lo in totals:
        best = min(x for cc, x in everything if cc <= c * (1 + 1e-12))
        assert lo == pytest.approx(best, rel=1e-9, abs=1e-12 * loss_unit)
    assert all(cost[i][a] < cost[i][0] or a == 0 for p in path for i, a in enumerate(p))  # never dearer than full
    cheapest = min(c for c, _ in everything)
    assert totals[-1][0] == pytest.approx(cheapest)  # ends with every layer at its cheapest


def test_a_model_with_sliding_window_layers_is_tuned_on_its_other_layers(tmp_path):
    """ModernBERT's local layers are never patched: the search tunes its full-attention layers (0 and 2 of 4 here),
    the local ones keep the model's own attention in every run and read ``LOCAL_CHOICES["model"]``, and the
    cost is that of the tuned layers at the check inputs' lengths, from each method's cost model, summed here. The
    tuned model's fidelity is measured here against the unpatched model, the layers it holds are those the choices
    name (rebuilt here, bit for bit), and it saves and loads as tuned."""
    from approx.harness.autotune import LOCAL_CHOICES

    LOCAL_CHOICE = LOCAL_CHOICES["model"]

    original = tiny_model("modernbert", num_hidden_layers=4)
    assert approx.local_layers(original) == [1, 3]
    fit, check = _data(12, 21), _data(12, 22)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cheapest point may miss any target
        cheapest = approx.autotune(copy.deepcopy(original), fit, check_data=check, target=None, budget=1e-9,
                                   methods=CANDIDATES, batch_size=4, progress=False)  # fmt: skip
    target = 1 - (1 - cheapest.fidelity) / 4  # between the cheapest point and full attention
    model = copy.deepcopy(original)
    tuning = approx.autotune(model, fit, check_data=check, target=target, methods=CANDIDATES, batch_size=4,
                             progress=False)  # fmt: skip
    assert [tuning.choices[i] for i in (1, 3)] == [LOCAL_CHOICE] * 2 and len(tuning.choices) == 4
    assert LOCAL_CHOICE not in (tuning.choices[0], tuning.choices[2])
    assert all(p["choices"][1] == p["choices"][3] == LOCAL_CHOICE for p in tuning.path)
    assert sorted(approx.patched_layers(model)) == [0, 2] and {r["layer"] for r in tuning.table} == {0, 2}
    batches = _batches(check)
    measured = _cosine(original, model, batches)
    assert tuning.met and measured >= target and tuning.fidelity == pytest.approx(measured, abs=1e-6)
    rebuilt = copy.deepcopy(original)
    for i in (0, 2):
        setup = as_setup(tuning.choices[i])
        approx.patch(rebuilt, setup.method, layers=[i], **setup.options)
    with torch.no_grad():
        for b in batches:
            assert torch.equal(model(**b).last_hidden_state, rebuilt(**b).last_hidden_state)
    lengths = [len(r) for r in check]
    d = original.config.hidden_size // original.config.num_attention_heads
    for point in tuning.path:
        assert point["cost"] == pytest.approx(_flops_ratio([point["choices"][i] for i in (0, 2)], lengths, d=d))
    assert f"layer 1: {LOCAL_CHOICE}" in tuning.summary() and tuning.path[-1]["cost"] < 1
    folder = approx.save(model, tmp_path / "tuned")
    loaded = approx.load(folder)
    with torch.no_grad():
        assert torch.equal(loaded(**batches[0]).last_hidden_state, model(**batches[0]).last_hidden_state)
    assert approx.integration.tuning(loaded)["choices"] == tuning.choices


def test_modernbert_tuned_with_its_windows_on_the_band(monkeypatch, tmp_path):
    """``local="band"``: every run of the tuning but the unpatched reference's runs the sliding-window layers on approx's
    banded kernel (its calls counted), and so does the tuned model: its fidelity, measured here against the unpatched
    model, is the tuning's; the tuning and the saved folder record the mode. Refused for a model without such layers,
    for an unknown mode, and off the CPU."""
    from approx.attention import _band

    calls, attend = [0], _band.attend

    def counted(*args, **kwargs):
        calls[0] += 1
        return attend(*args, **kwargs)

    monkeypatch.setattr(_band, "attend", counted)
    original = tiny_model("modernbert", num_hidden_layers=4)
    fit, check = _data(12, 23), _data(12, 24)  # 20 to 60 tokens: longer than the window (4 on each side)
    model = copy.deepcopy(original)
    tuning = approx.autotune(model, fit, check_data=check, target=0.999, methods=CANDIDATES, batch_size=4,
                             progress=False, local="band")  # fmt: skip
    assert calls[0] > 0 and tuning.local == "band" and approx.local_mode(model) == "band"
    assert [tuning.choices[i] for i in (1, 3)] == ["band (sliding window)"] * 2
    calls[0] = 0
    measured = _cosine(original, model, _batches(check))
    assert calls[0] > 0 and tuning.fidelity == pytest.approx(measured, abs=1e-6)
    loaded = approx.load(approx.save(model, tmp_path / "tuned"))
    assert approx.local_mode(loaded) == "band" and approx.integration.tuning(loaded)["local"] == "band"
    with pytest.raises(ValueError, match="has no sliding-window layers"):
        approx.autotune(tiny_model("bert"), fit, methods=CANDIDATES, local="band", progress=False)
    with pytest.raises(ValueError, match="choose one of 'model', 'band'"):
        approx.autotune(copy.deepcopy(original), fit, methods=CANDIDATES, local="banded", progress=False)
    with pytest.raises(ValueError, match="on the CPU only"):
        approx.autotune(copy.deepcopy(original).to("meta"), fit, methods=CANDIDATES, local="band", progress=False)


def test_cli_tunes_modernbert_and_the_tuned_folder_evaluates_with_the_band(tmp_path, fixture_dir, capsys):
    """On the command line: a ModernBERT classifier is tuned on MRPC's training inputs (its sliding-window layer 1
    said, not tuned; with ``--local band``, run on the banded kernel), saved with the mode, and evaluated from the
    folder with ``--local band``: the sliding-window layer on the banded kernel, the tuned layer as chosen."""
    from evalfixtures import write_checkpoint

    model = str(write_checkpoint(tmp_path / "modernbert", "sequence-classification", family="modernbert"))
    out = tmp_path / "tuned"
    argv = ["autotune", "--model", model, "--task", "mrpc", "--split", "train", "--limit", "8", "--data-dir",
            str(fixture_dir), "--batch-size", "2", "--method", "efficient", "--target", "kl<=1", "--output-dir",
            str(out), "--local", "band", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    assert "layer 1: band (sliding window)" in capsys.readouterr().out
    saved = json.loads((out / "approx_config.json").read_text())
    assert (
        [x["layer"] for x in saved["layers"]] == [0] and saved["local"] == "band" and saved["tuning"]["local"] == "band"
    )
    result = tmp_path / "eval.json"
    argv = ["eval", "--model", model, "--task", "mrpc", "--method", str(out), "--local", "band", "--data-dir",
            str(fixture_dir), "--quiet", "--output", str(result)]  # fmt: skip
    assert main(argv) == 0
    record = json.loads(result.read_text())
    assert record["local"] == "band" and record["fidelity"]["cost"]["layers"]["sliding_window"] == [1]
    assert [(x["layer"], x["method"]) for x in record["method"]["layers"]] == [(0, "efficient")]
    # a checkpoint without sliding-window layers: exit 2 from its config, before its weights are loaded
    bert = str(write_checkpoint(tmp_path / "bert", "sequence-classification"))
    argv = ["autotune", "--model", bert, "--task", "mrpc", "--split", "train", "--limit", "8", "--data-dir",
            str(fixture_dir), "--method", "efficient", "--output-dir", str(tmp_path / "no"), "--local", "band"]  # fmt: skip
    capsys.readouterr()
    with mock.patch("approx.integration.load_pretrained", side_effect=AssertionError("loaded")):
        assert main(argv) == 2
    assert "(bert) has no sliding-window layers (its config has no sliding_window)" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


def test_parse_target():
    assert (parse_target(0.98).measure, parse_target(0.98).value) == ("cosine", 0.98)
    assert str(parse_target("kl <= 0.01")) == "kl<=0.01"
    assert (parse_target(" 0.9 ").measure, parse_target("0.9").value) == ("cosine", 0.9)  # as a command line gives it
    for bad in ("cosine<=0.9", "kl>=0.1", "cosine>=1.5", "kl<=-1", "f1>=0.9", "cosine>=0.9.9", "kl<=1e-", "1.5", None):
        with pytest.raises(ValueError, match="target .*expected|lies in"):
            parse_target(bad)


# ------------------------------------------------------------------------------------------ end to end, tiny


@pytest.fixture(scope="module")
def bert():
    return tiny_model("bert", num_hidden_layers=4)


def test_target_met_measured_independently_and_the_next_cheaper_point_fails(bert):
    fit, check = _data(12, 1), _data(12, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cheapest point may miss any target
        model = copy.deepcopy(bert)
        cheapest = approx.autotune(model, fit, check_data=check, target=None, budget=1e-9, methods=CANDIDATES,
                                   batch_size=4, progress=False)  # fmt: skip
    assert cheapest.choices == cheapest.path[-1]["choices"] and not cheapest.met
    target = 1 - (1 - cheapest.fidelity) / 4  # between the cheapest point and full attention
    model = copy.deepcopy(bert)
    tuning = approx.autotune(model, fit, check_data=check, target=target, methods=CANDIDATES, batch_size=4,
                             uniform=False, progress=False)  # fmt: skip
    batches = _batches(check)
    measured = _cosine(bert, model, batches)
    assert tuning.met and measured >= target
    assert tuning.fidelity == pytest.approx(measured, abs=1e-6)
    # the model holds exactly the layers the tuning reports: the same choices patched here agree bit for bit
    rebuilt = _patched_as(bert, tuning.choices)
    with torch.no_grad():
        for b in batches:
            assert torch.equal(model(**b).last_hidden_state, rebuilt(**b).last_hidden_state)
    index = next(j for j, p in enumerate(tuning.path) if p["choices"] == tuning.choices)
    if index + 1 < len(tuning.path):  # the bisection's bracket: the next cheaper point misses the target
        cheaper = tuning.path[index + 1]
        assert _cosine(bert, _patched_as(bert, cheaper["choices"]), batches) < target
        assert cheaper["measured_fidelity"] < target
    else:  # the cheapest point of all met the target
        assert index == len(tuning.path) - 1 and tuning.met
    assert approx.integration.tuning(model)["choices"] == tuning.choices


def test_budget_alone_keeps_the_first_point_within_it_and_costs_are_the_cost_models(bert):
    model = copy.deepcopy(bert)
    data = _data(16, 3)
    tuning = approx.autotune(
        model, data, target=None, budget=0.6, methods=CANDIDATES, batch_size=4, uniform=False, progress=False
    )
    within = [p for p in tuning.path if p["cost"] <= 0.6]
    assert tuning.choices == within[0]["choices"] and tuning.met
    # the held-out half (seeded shuffle, halved) and its cost from each layer's cost model, summed here
    order = list(range(len(data)))
    random.Random(0).shuffle(order)
    lengths = [len(data[i]) for i in order[len(order) // 2 :]]
    full = approx.get_method("full")
    mine = total = 0.0
    for label in tuning.choices:
        setup = as_setup(label)
        method = approx.get_method(setup.method)
        config = method.make_config(**setup.options)
        mine += sum(method.cost(config, n=n, s=n, d=8, dv=8).flops for n in lengths)
        total += sum(full.cost(full.config_class(), n=n, s=n, d=8, dv=8).flops for n in lengths)
    assert tuning.costs["flops_vs_full"] == pytest.approx(mine / total, rel=1e-9)
    assert tuning.cost == tuning.costs["flops_vs_full"]


def test_kl_target_on_a_classifier_measured_independently():
    original = tiny_model("bert", "sequence-classification", num_hidden_layers=3, num_labels=3)
    model = copy.deepcopy(original)
    fit, check = _data(8, 4), _data(8, 5)
    tuning = approx.autotune(model, fit, check_data=check, target="kl<=0.001", methods=CANDIDATES, batch_size=4,
                             progress=False)  # fmt: skip
    kl, count = 0.0, 0
    with torch.no_grad():
        for b in _batches(check):
            p = F.log_softmax(original(**b).logits.double(), -1)
            q = F.log_softmax(model(**b).logits.double(), -1)
            kl, count = kl + float((p.exp() * (p - q)).sum()), count + p.shape[0]
    assert tuning.fidelity == pytest.approx(kl / count, abs=1e-6)
    assert tuning.met == (kl / count <= 0.001)


def test_save_load_and_evaluate_a_tuned_model(tmp_path, base_model, fixture_dir):
    from transformers import AutoModel

    from approx.harness.data import wikitext_windows

    model, tok = approx.integration.load_pretrained(base_model, progress=False)
    windows = wikitext_windows(tok, fixture_dir, split="valid", length=24, count=6)
    tuning = approx.autotune(model.eval(), windows, target=0.9999, methods=CANDIDATES[1:], batch_size=2,
                             progress=False)  # fmt: skip
    folder = approx.save(model, tmp_path / "tuned", tokenizer=tok)
    meta = json.loads((folder / "approx_config.json").read_text())
    assert [x["method"] for x in meta["layers"]] == [as_setup(c).method for c in tuning.choices]
    assert meta["tuning"]["choices"] == tuning.choices and meta["tuning"]["target"] == "cosine>=0.9999"
    loaded = approx.load(folder, AutoModel).eval()
    ids = torch.tensor(windows[:2])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state)
    assert approx.integration.tuning(loaded) == meta["tuning"]
    approx.patch(loaded, "efficient", layers=[0])  # the layers change: the record no longer describes them
    assert approx.integration.tuning(loaded) is None
    (result,) = approx.evaluate(base_model, "wikitext2", [str(folder)], data_dir=str(fixture_dir), limit=2,
                                max_length=24, progress=False)  # fmt: skip
    assert result["method"]["name"] == PER_LAYER
    assert [x["layer"] for x in result["method"]["layers"]] == list(range(len(tuning.choices)))
    assert short_label(result["method"]).startswith(f"{PER_LAYER}[0")
    assert result["fidelity"]["cost"]["layers"]["patched"] == list(range(len(tuning.choices)))
    approx.unpatch(model)
    assert approx.integration.tuning(model) is None


def test_per_layer_label_merges_runs_of_layers():
    layers = [
        {"layer": 0, "method": "full", "config": {}},
        {"layer": 1, "method": "nystrom", "config": {"landmarks": 8}},
        {"layer": 2, "method": "nystrom", "config": {"landmarks": 8}},
        {"layer": 3, "method": "full", "config": {}},
    ]
    label = short_label({"name": PER_LAYER, "layers": layers})
    assert label == "per-layer[0 full; 1-2 nystrom:landmarks=8; 3 full]"


def test_errors_say_what_to_do(bert):
    data = _data(4, 6)
    model = copy.deepcopy(bert)
    cases = [
        (dict(target=None), "target"),
        (dict(budget=0), "budget"),
        (dict(cost="seconds"), "flops, matmul"),
        (dict(methods=["full"]), "always a candidate"),
        (dict(methods=["linformer:mode=fitted"]), "fitted state"),
        (dict(methods=["efficient", "efficient:exact_below=0"]), "named twice"),
        (dict(methods=["nosuch"]), "unknown"),
        (dict(methods=[]), "at least one"),
        (dict(batch_size=0), "batch_size"),
    ]
    for kwargs, words in cases:
        with pytest.raises(ValueError, match=words):
            approx.autotune(model, data, progress=False, **kwargs)
    with pytest.raises(ValueError, match="at least two"):
        approx.autotune(model, data[:1], progress=False, methods=["efficient"])
    with pytest.raises(ValueError, match="input 2 is an empty token-id list"):  # (a reshape error inside the model)
        approx.autotune(model, [[7, 8], [9], [], []], progress=False, methods=["efficient"])
    batches = _batches(data, 2)
    blank = [{**b, "attention_mask": torch.zeros_like(b["attention_mask"])} for b in batches]
    for halves, which in (
        ({"data": blank, "check_data": batches}, "search's"),
        ({"data": [x for pair in zip(batches, blank, strict=True) for x in pair]}, "check's"),
    ):
        # (measured as fidelity 0: a blind search, or "even full attention measures 0" on a blank check half)
        with pytest.raises(ValueError, match=f"the {which} calibration inputs hold no real token"):
            approx.autotune(model, **halves, progress=False, methods=["efficient"])
    tuned = approx.autotune(copy.deepcopy(bert), data, progress=False, methods="efficient", target="cosine>=0.5")
    assert tuned.candidates == ["efficient"]  # one spec as a string: one candidate (it was read letter by letter)
    layers = approx.patched_layers(approx.patch(copy.deepcopy(bert), "efficient"))
    tuned = approx.autotune(copy.deepcopy(bert), data, progress=False, methods=layers, target="cosine>=0.5")
    assert len(tuned.candidates) == 1  # a layers dict alone: one candidate, as approx.evaluate reads it
    with pytest.raises(ValueError, match="a bare encoder, or a regression head") as e:
        approx.autotune(model, data, target="kl<=0.1", methods=["efficient"], progress=False)
    assert "a kl target" in str(e.value) and "kl<=1" not in str(e.value)  # not the search's placeholder
    regression = tiny_model("bert", "sequence-classification", num_hidden_layers=2, num_labels=1)
    with pytest.raises(ValueError, match="use a cosine target"):  # one score per input: KL would always be 0
        approx.autotune(regression, data, target="kl<=0.1", methods=["efficient"], progress=False)
    approx.patch(model, "efficient")
    with pytest.raises(ValueError, match="unpatch"):
        approx.autotune(model, data, methods=["efficient"], progress=False)


# --------------------------------------------------------------------------------------------- command line


def test_cli_autotune_then_eval(tmp_path, base_model, fixture_dir, capsys):
    out = tmp_path / "tuned"
    argv = ["autotune", "--model", base_model, "--data-dir", str(fixture_dir), "--windows", "4", "--length", "24",
            "--batch-size", "2", "--method", "efficient", "--method", "nystrom:landmarks=4", "--target",
            "cosine>=0.999", "--output-dir", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "layer 0:" in printed and "target cosine>=0.999" in printed
    # the command it suggests reads the windows' length (approx eval's WikiText-2 split is test, not valid)
    assert (
        f"approx eval --model {base_model} --task wikitext2 --max-length 24 --data-dir {fixture_dir} --method {out}`"
        in (captured.err)
    )
    record = json.loads((out / "approx_autotune.json").read_text())
    assert record["tuning"]["candidates"] == ["efficient", "nystrom:landmarks=4"]
    assert record["calibration_data"]["windows"] == 4 and record["provenance"]["seed"] == 0
    assert record["calibration_data"]["file"] == str(Path(fixture_dir, "wikitext-2", "wiki.valid.tokens"))
    argv = ["eval", "--model", base_model, "--task", "wikitext2", "--method", str(out), "--limit", "2",
            "--max-length", "24", "--data-dir", str(fixture_dir), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert f"| {PER_LAYER}[" in captured.out and "holds a patched model's settings" not in captured.err
    # the tuned folder as --model alone is read plain (the reference): said, since its saved method does not run
    argv = ["eval", "--model", str(out), "--task", "wikitext2", "--method", "efficient", "--limit", "2",
            "--max-length", "24", "--data-dir", str(fixture_dir), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    assert f"--model {out} holds a patched model's settings" in capsys.readouterr().err


def test_cli_autotune_extends_positions_for_longer_inputs_and_records_it(tmp_path, base_model, fixture_dir):
    """Calibration windows longer than the model's 512 learned positions crashed in BERT's embeddings: the positions
    are extended as `approx finetune` extends them, recorded, and the tuned model is saved with them."""
    from approx.positions import position_limit

    out = tmp_path / "tuned"
    argv = ["autotune", "--model", base_model, "--data-dir", str(fixture_dir), "--windows", "2", "--length", "530",
            "--method", "efficient", "--output-dir", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    positions = json.loads((out / "approx_autotune.json").read_text())["calibration_data"]["positions"]
    assert positions["extended_from"] == 512 and positions["extended_to"] == 530
    assert position_limit(approx.load(out)) == 530


def test_cli_autotune_extends_positions_for_a_tasks_longer_inputs(tmp_path, data_dir):
    """The same from a task's inputs (batches of input dicts): squad-doc's windows of --max-length tokens over the
    real articles (the fixture's are shorter than 512 tokens)."""
    from evalfixtures import write_checkpoint

    from approx.positions import position_limit

    reader = write_checkpoint(tmp_path / "qa", "question-answering")
    out = tmp_path / "tuned-doc"
    argv = ["autotune", "--model", str(reader), "--data-dir", str(data_dir), "--task", "squad-doc", "--split", "dev",
            "--limit", "4", "--max-length", "600", "--method", "efficient", "--output-dir", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    record = json.loads((out / "approx_autotune.json").read_text())["calibration_data"]
    assert record["positions"]["extended_to"] == 600 and position_limit(approx.load(out)) == 600
    assert record["data_source"].startswith(f"local folder {data_dir}")  # where the examples were read


@pytest.mark.parametrize(
    "split, score_split, max_length, words, note",
    [
        ("dev/0", None, 128, "--task squad --split dev/1 --max-length 128", None),  # the other half
        ("dev/1", None, None, "--task squad --split dev/0", None),
        ("dev/0", "dev/1", None, "--task squad", "dev/0 and dev/1"),  # the score target read the other half
        ("dev/0", "train", None, "--task squad --split dev/1", None),
        (None, None, None, "--task squad", "dev"),  # the split approx eval reads by default: said
        ("dev", None, 256, "--task squad --max-length 256", "dev"),
        ("train", None, None, "--task squad", None),
    ],
)
def test_cli_autotune_suggests_an_evaluation_on_other_data(split, score_split, max_length, words, note):
    """The command printed after `approx autotune --task`: the other half of a cross-fitted split unless a score
    target scored on it, the calibration's length and data flags, and a warning when the tuning read the split that
    approx eval reads by default, or the half it would suggest."""
    from types import SimpleNamespace

    from approx.harness import cli

    args = SimpleNamespace(model="qa", task="squad", split=split, max_length=max_length, length=512, data_dir="d")
    hint = cli._eval_hint(args, get_task("squad"), "./tuned", score_split)
    assert f"`approx eval --model qa {words} --data-dir d --method ./tuned`" in hint
    assert (f"the tuning read {note}:" in hint) if note else "the tuning read" not in hint


@pytest.mark.parametrize(
    "args, words",
    [
        (["--method", "nosuch"], "unknown attention method"),
        (["--target", "f1>=3"], "target"),
        (["--method", "efficient:nosuch=1"], "unknown option"),
        (["--cost-examples", "64"], "--cost-examples: for calibration on a task's split (--task)"),
        (["--limit", "8", "--max-length", "64"], "--limit, --max-length: for calibration on a task's split"),
        (["--split", "train"], "--split: for calibration on a task's split (--task); this run calibrates on WikiText"),
        (["--task", "rte", "--windows", "4"], "--windows: for calibration on WikiText-2 windows (without --task)"),
        (["--task", "rte", "--length", "64"], "--length: for calibration on WikiText-2 windows"),
        (["--windows", "0"], "--windows must be at least 2, got 0"),
        (["--windows", "1"], "--windows must be at least 2, got 1 (the search and the check read different"),
        (["--task", "rte", "--cost-examples", "1"], "--cost-examples is at least 2"),
        (["--method", "sparsefinder"], "candidate sparsefinder has fitted state"),  # (it loaded the model first)
        (["--method", "full"], "'full' is always a candidate"),
    ],
)
def test_cli_autotune_refuses_bad_arguments_before_loading(tmp_path, capsys, args, words, monkeypatch):
    from approx import integration

    monkeypatch.setattr(integration, "load_pretrained", mock.Mock(side_effect=AssertionError("loaded")))
    assert main(["autotune", "--output-dir", str(tmp_path / "x"), *args]) == 2
    assert words in capsys.readouterr().err


def test_one_search_serves_several_targets_and_both_cost_conventions(bert):
    """Search.choose for a second target (or the other cost convention) gives what a fresh autotune gives."""
    from approx.harness.autotune import Search

    fit, check = _data(8, 7), _data(8, 8)
    model = copy.deepcopy(bert)
    search = Search(model, fit, check_data=check, methods=CANDIDATES, batch_size=4, progress=False)
    for target, cost in ((0.99999, "flops"), (0.9999, "flops"), (0.99995, "matmul")):
        mine = search.choose(target, cost=cost, progress=False)
        fresh_model = copy.deepcopy(bert)
        fresh = approx.autotune(fresh_model, fit, check_data=check, target=target, methods=CANDIDATES, cost=cost,
                                batch_size=4, progress=False)  # fmt: skip
        assert (mine.choices, mine.cost_convention) == (fresh.choices, cost)
        assert mine.fidelity == pytest.approx(fresh.fidelity, abs=1e-9)
        assert approx.settings(model) == approx.settings(fresh_model)
    with pytest.raises(ValueError, match="this search measured cosine"):
        search.choose("kl<=0.1", progress=False)


@pytest.mark.parametrize("seed", range(4))
def test_hull_path_on_nearly_collinear_points_and_broken_candidates(seed):
    """Points on one line up to rounding, and options whose loss is infinite (a method that broke down): costs still
    fall strictly along the path, each point is optimal at its cost (brute force), the broken options never appear."""
    rng = random.Random(100 + seed)
    layers, options = 3, 5
    loss, cost = [], []
    for _ in range(layers):
        slope = rng.random()
        cs = [1.0] + [rng.random() for _ in range(options - 1)]
        ls = [0.0] + [slope * (1.0 - c) * (1 + rng.uniform(-1e-15, 1e-15)) for c in cs[1:]]
        ls[-1] = math.inf if rng.random() < 0.7 else ls[-1]
        loss.append(ls)
        cost.append(cs)
    path = hull_path(loss, cost)
    totals = [(sum(cost[i][a] for i, a in enumerate(p)), sum(loss[i][a] for i, a in enumerate(p))) for p in path]
    assert all(b[0] < a[0] for a, b in itertools.pairwise(totals))
    assert all(math.isfinite(x) for _, x in totals)
    everything = [
        (sum(cost[i][a] for i, a in enumerate(p)), sum(loss[i][a] for i, a in enumerate(p)))
        for p in itertools.product(range(options), repeat=layers)
    ]
    for c, lo in totals:
        assert lo == pytest.approx(min(x for cc, x in everything if cc <= c + 1e-12), abs=1e-9)


def test_target_loss_of_a_broken_measurement_is_infinite():
    assert parse_target("kl<=0.1").loss(float("nan")) == math.inf
    assert parse_target(0.9).loss(float("inf")) == math.inf
    assert parse_target(0.9).loss(0.95) == pytest.approx(0.05)


def test_budget_holds_on_the_check_inputs_even_when_the_halves_differ_in_length(bert):
    """Long fit inputs, short held-out ones: the budget is judged at the held-out lengths, where the reported cost is
    measured; the reported cost is the path point's."""
    fit, check = _data(8, 9, lo=90, hi=120), _data(8, 10, lo=12, hi=20)
    model = copy.deepcopy(bert)
    tuning = approx.autotune(model, fit, check_data=check, target=None, budget=0.8, methods=CANDIDATES, batch_size=4,
                             progress=False)  # fmt: skip
    assert tuning.met and tuning.cost <= 0.8
    point = next(p for p in tuning.path if p["choices"] == tuning.choices)
    assert tuning.cost == pytest.approx(point["cost"], rel=1e-9)
    assert _cosine(bert, model, _batches(check)) == pytest.approx(tuning.fidelity, abs=1e-6)


def test_target_out_of_reach_within_the_budget_is_reported(bert):
    fit, check = _data(8, 11), _data(8, 12)
    model = copy.deepcopy(bert)
    with pytest.warns(UserWarning, match="cannot be met within cost"):
        tuning = approx.autotune(model, fit, check_data=check, target=0.99999999, budget=0.3, methods=CANDIDATES,
                                 batch_size=4, progress=False)  # fmt: skip
    assert not tuning.met and tuning.cost <= 0.3
    assert tuning.fidelity < 0.99999999


def test_kl_target_on_a_qa_model_with_token_types_padding_and_train_mode():
    """Start and end distributions over each input's real tokens, measured here in float64; the model's training
    flag is given back."""
    original = tiny_model("bert", "question-answering", num_hidden_layers=2)
    model = copy.deepcopy(original).train()
    g = torch.Generator().manual_seed(13)
    batches = []
    for _ in range(4):
        ids = torch.randint(5, 99, (3, 30), generator=g)
        mask = torch.ones(3, 30, dtype=torch.long)
        mask[1, 22:] = 0
        mask[2, 15:] = 0
        types = torch.zeros(3, 30, dtype=torch.long)
        types[:, 10:] = 1
        batches.append({"input_ids": ids, "attention_mask": mask, "token_type_ids": types * mask})
    tuning = approx.autotune(model, batches, target="kl<=0.0001", methods=CANDIDATES, progress=False)
    assert model.training
    model.eval()
    kl = count = 0.0
    with torch.no_grad():
        for b in batches[1::2]:  # the held-out half: dict batches alternate
            ref, out = original(**b), model(**b)
            for name in ("start_logits", "end_logits"):
                p = getattr(ref, name).double().masked_fill(~b["attention_mask"].bool(), -math.inf).log_softmax(-1)
                q = getattr(out, name).double().masked_fill(~b["attention_mask"].bool(), -math.inf).log_softmax(-1)
                terms = torch.where(p.exp() > 0, p.exp() * (p - q), torch.zeros_like(p)).sum(-1)
                kl, count = kl + float(terms.sum()), count + terms.numel()
    assert tuning.fidelity == pytest.approx(kl / count, abs=1e-6)
    assert tuning.met == (kl / count <= 0.0001 + 1e-9)


def test_finetune_from_a_tuned_folder_keeps_each_layers_choice(tmp_path, base_model, fixture_dir):
    from approx.harness.data import wikitext_windows
    from approx.harness.finetune import finetune

    model, tok = approx.integration.load_pretrained(base_model, progress=False)
    windows = wikitext_windows(tok, fixture_dir, split="valid", length=24, count=6)
    approx.autotune(model.eval(), windows, target=None, budget=0.5, methods=CANDIDATES[1:], batch_size=2,
                    progress=False)  # fmt: skip
    folder = approx.save(model, tmp_path / "tuned", tokenizer=tok)
    tuned = json.loads((folder / "approx_config.json").read_text())["layers"]
    finetune(base_model, "rte", output_dir=tmp_path / "ft", method=str(folder), train_split="dev/0",
             data_dir=str(fixture_dir), source="local", batch_size=4, max_steps=1, progress=False)  # fmt: skip
    trained = json.loads((tmp_path / "ft" / "approx_config.json").read_text())["layers"]
    assert trained == tuned


def test_exact_attention_meets_cosine_one_and_the_callers_generator_is_left_alone(bert):
    """Full attention on every layer gives the unpatched hidden states, whose cosine is 1 exactly (in float32 it
    measured 0.99999988 and missed ``cosine>=1``); the search draws nothing from the caller's torch generator."""
    model = copy.deepcopy(bert)
    torch.manual_seed(99)
    expected = torch.rand(3)
    torch.manual_seed(99)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "even full attention ... short of" warning
        tuning = approx.autotune(model, _data(8, 9), methods=["efficient"], target=1.0, batch_size=4, progress=False)
    assert torch.equal(torch.rand(3), expected)
    assert tuning.met and tuning.fidelity == 1.0 and set(tuning.choices) == {"full"}


def _saved_state(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "approx_state.safetensors"))


def test_finetune_from_a_folder_with_some_layers_patched_keeps_those_layers(tmp_path, base_model, fixture_dir):
    """A folder saved with one method on some layers is fine-tuned with that method on those layers only (it used
    to become the method on every layer), with the state the folder holds: FAVOR+ features loaded from another seed
    (the folder's options would draw others) and Linformer projections fitted by approx.fit (it was refused, the
    fine-tuning drawing them afresh) are the trained model's (buffers: training leaves them). A fitted method named
    without a fit is refused before the model loads, saying to fit it first."""
    from approx.harness.finetune import finetune

    model, tok = approx.integration.load_pretrained(base_model, progress=False)
    approx.patch(model, "favor", layers=[1], features=8)
    other = approx.patch(copy.deepcopy(model), "favor", layers=[1], features=8, seed=5)
    with pytest.warns(UserWarning):  # (the layer's seed option no longer says what its state is)
        approx.patched_layers(model)[1].load_state_dict(approx.patched_layers(other)[1].state_dict())
    folder = approx.save(model, tmp_path / "some", tokenizer=tok)
    run = dict(
        train_split="dev/0", data_dir=str(fixture_dir), source="local", batch_size=4, max_steps=1, progress=False
    )
    finetune(base_model, "rte", output_dir=tmp_path / "ft", method=str(folder), **run)
    trained = json.loads((tmp_path / "ft" / "approx_config.json").read_text())["layers"]
    assert [x["layer"] for x in trained] == [1] and trained[0]["config"]["features"] == 8
    want, got = _saved_state(folder), _saved_state(tmp_path / "ft")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    drawn = approx.patched_layers(approx.patch(copy.deepcopy(model), "favor", layers=[1], features=8))[1].state()
    assert not all(torch.equal(want[f"layer.1.{k}"], v) for k, v in drawn.items())  # (what it would have drawn)
    approx.patch(model, "linformer", layers=[0], mode="fitted", projections=8, length=64)
    approx.fit(model, [dict(tok(["a sentence of a few words to fit on"] * 2, return_tensors="pt"))], progress=False)
    fitted = approx.save(model, tmp_path / "fitted", tokenizer=tok)
    finetune(base_model, "rte", output_dir=tmp_path / "ft2", method=str(fitted), **run)
    want, got = _saved_state(fitted), _saved_state(tmp_path / "ft2")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    unfit, _ = approx.integration.load_pretrained(base_model, progress=False)
    approx.patch(unfit, "linformer", layers=[0], mode="fitted", projections=8, length=64)
    approx.save(unfit, tmp_path / "unfit", tokenizer=tok)  # (saved before its fit)
    with pytest.raises(ValueError, match=r"unfit: layers \[0\] have not been fitted yet; fit them first"):
        finetune(base_model, "rte", output_dir=tmp_path / "ft4", method=str(tmp_path / "unfit"), **run)
    assert not (tmp_path / "ft4" / "finetune.json").exists()
    with pytest.raises(ValueError, match=r"linformer learns its state .* fit it first .*--method FITTED"):
        finetune(str(tmp_path / "absent"), "rte", output_dir=tmp_path / "ft3", method="linformer:mode=fitted")


def test_a_method_name_is_the_method_even_beside_a_folder_of_that_name(tmp_path, monkeypatch, bert):
    """``"favor"`` names the method, also where the working directory holds a folder called favor (saved or not);
    ``./favor`` names the folder. A path that is not a saved folder, and no patched layers, are refused clearly."""
    from approx.harness.spec import as_setup

    model = copy.deepcopy(bert)
    approx.patch(model, "lsh", cluster_size=4)
    approx.save(model, tmp_path / "favor")
    (tmp_path / "window").mkdir()
    monkeypatch.chdir(tmp_path)
    assert as_setup("favor").method == "favor" and as_setup("favor:features=8").options == {"features": 8}
    assert as_setup("window").method == "window"
    assert as_setup("./favor").method == "lsh" and as_setup(Path("favor")).method == "lsh"  # a Path is a path
    with pytest.raises(FileNotFoundError, match="holds no approx_config.json"):
        as_setup(tmp_path / "window")
    with pytest.raises(ValueError, match="no patched layers"):
        as_setup({})


def test_budget_alone_means_the_same_in_python_and_on_the_command_line(bert):
    """A budget without a target keeps the most faithful point within it (no default cosine target added), and
    input dicts may be any mapping (a tokenizer's BatchEncoding), one alone being one batch."""
    from transformers import BatchEncoding

    data = _batches(_data(8, 10))
    given = [BatchEncoding(dict(b)) for b in data]
    tuned = approx.autotune(copy.deepcopy(bert), given, methods=CANDIDATES, budget=0.6, progress=False)
    assert tuned.target is None
    plain = approx.autotune(copy.deepcopy(bert), data, methods=CANDIDATES, target=None, budget=0.6, progress=False)
    assert (tuned.choices, tuned.fidelity) == (plain.choices, plain.fidelity)
    one = approx.autotune(copy.deepcopy(bert), dict(data[0]), methods=CANDIDATES, budget=0.6, progress=False)
    assert one.calibration["check_inputs"] == data[0]["input_ids"].shape[0] // 2
    with pytest.raises(ValueError, match="input 0 is a str"):
        approx.autotune(copy.deepcopy(bert), ["some text", "more text"], methods=CANDIDATES, progress=False)
    # NumPy rows, and a tokenizer's lists (no return_tensors) padded to one length, are inputs as before
    rows = _data(8, 10)
    as_numpy = approx.autotune(copy.deepcopy(bert), [np.array(r) for r in rows], methods=CANDIDATES, budget=0.6,
                               progress=False)  # fmt: skip
    assert as_numpy.choices == approx.autotune(copy.deepcopy(bert), rows, methods=CANDIDATES, budget=0.6,
                                               progress=False).choices  # fmt: skip
    lists = [BatchEncoding({k: v.tolist() for k, v in b.items()}) for b in data]
    assert approx.autotune(copy.deepcopy(bert), lists, methods=CANDIDATES, budget=0.6, progress=False).choices == (
        plain.choices
    )
    with pytest.raises(ValueError, match="pad the batch"):
        approx.autotune(copy.deepcopy(bert), [{"input_ids": [[1, 2], [3]], "attention_mask": [[1, 1], [1]]}] * 2,
                        methods=CANDIDATES, progress=False)  # fmt: skip


def _flops_ratio(choices: list[str], lengths: list[int], convention: str = "flops", d: int = 8) -> float:
    """The attention FLOPs (or matmul MACs) of ``choices`` (one label per layer) over inputs of ``lengths``, relative
    to full attention, summed here from each method's cost model (head size ``d``: 8 is the tiny model's)."""
    full = approx.get_method("full")
    field = "flops" if convention == "flops" else "matmul_macs"
    mine = total = 0.0
    for label in choices:
        setup = as_setup(label)
        method = approx.get_method(setup.method)
        config = method.make_config(**setup.options)
        mine += sum(getattr(method.cost(config, n=n, s=n, d=d, dv=d), field) for n in lengths)
        total += sum(getattr(full.cost(full.config_class(), n=n, s=n, d=d, dv=d), field) for n in lengths)
    return mine / total


def test_costs_are_taken_at_the_cost_inputs_lengths_and_the_model_never_runs_on_them(bert):
    """Short calibration inputs, long cost inputs: the path, the budget and the reported costs are at the cost inputs'
    lengths. Their token ids are out of the vocabulary, so a forward pass on them would fail."""
    fit, check = _data(8, 13, lo=12, hi=20), _data(8, 14, lo=12, hi=20)
    cost = [[10**6] * n for n in (150, 170, 190, 210, 160)]
    model = copy.deepcopy(bert)
    tuning = approx.autotune(model, fit, check_data=check, cost_data=cost, target=None, budget=0.7, methods=CANDIDATES,
                             batch_size=4, progress=False)  # fmt: skip
    lengths = [len(r) for r in cost]
    assert tuning.calibration["cost_inputs"] == len(cost) and tuning.calibration["check_inputs"] == len(check)
    assert tuning.costs["flops_vs_full"] == pytest.approx(_flops_ratio(tuning.choices, lengths), rel=1e-9)
    assert tuning.cost == tuning.costs["flops_vs_full"] <= 0.7 and tuning.met
    for point in tuning.path:  # every point of the path, at the cost inputs' lengths and not at the check inputs'
        assert point["cost"] == pytest.approx(_flops_ratio(point["choices"], lengths), rel=1e-9)
    cheapest = tuning.path[-1]["choices"]
    assert _flops_ratio(cheapest, lengths) < _flops_ratio(cheapest, [len(r) for r in check])
    with pytest.raises(ValueError, match="cost_data is empty"):
        approx.autotune(copy.deepcopy(bert), fit, cost_data=[], budget=0.7, methods=CANDIDATES, progress=False)


def test_cli_cost_examples_are_the_splits_first_examples(tmp_path, fixture_dir):
    """The costs at the lengths of the split's first N examples: the reported cost is the chosen layers' cost model
    summed here over those examples' tokenised lengths (not over the calibration inputs')."""
    from evalfixtures import write_checkpoint

    out, checkpoint = tmp_path / "tuned", str(write_checkpoint(tmp_path / "mrpc", "sequence-classification"))
    argv = ["autotune", "--model", checkpoint, "--data-dir", str(fixture_dir), "--task", "mrpc", "--split", "train",
            "--limit", "4", "--batch-size", "2", "--cost-examples", "12", "--method", "efficient", "--budget", "2",
            "--output-dir", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    record = json.loads((out / "approx_autotune.json").read_text())
    assert record["calibration_data"]["cost_examples"] == 12 and record["tuning"]["calibration"]["cost_inputs"] == 12
    from transformers import AutoTokenizer

    from approx.harness.tasks import get_task

    task = get_task("mrpc")
    examples, _ = task.load("train", source="local", data_dir=str(fixture_dir), limit=12)
    tok = AutoTokenizer.from_pretrained(checkpoint)
    lengths = [len(f.input_ids) for f in task.features(examples, tok, max_length=128, mode="fine-tuned")]
    assert len(set(lengths)) > 1  # lengths that differ, so that a wrong sample would show
    for convention, key in (("flops", "flops_vs_full"), ("matmul", "matmul_vs_softmax")):
        config = json.loads((Path(checkpoint) / "config.json").read_text())
        d = config["hidden_size"] // config["num_attention_heads"]
        expected = _flops_ratio(record["tuning"]["choices"], lengths, convention, d=d)
        assert record["tuning"]["costs"][key] == pytest.approx(expected, rel=1e-9)


# ------------------------------------------------------------------------------------ uniform settings (step 4)


def _uniform_oracle(bert, search_labels: list[str], check, lengths, convention: str, budget: float | None = None):
    """Each whole-layer candidate on every layer, patched and measured here: (label, cost, cosine) of those
    cheaper than full attention and within ``budget``, cheapest first."""
    batches, out = _batches(check), []
    for label in search_labels:
        choices = [label] * 4
        cost = _flops_ratio(choices, lengths, convention)
        if cost < 1.0 and (budget is None or cost <= budget + 1e-12):
            out.append((label, cost, _cosine(bert, _patched_as(bert, choices), batches)))
    return sorted(out, key=lambda x: x[1])


def _misjudged(bert, candidates, inflated, fit, check, **options):
    """A search whose per-layer losses of the ``inflated`` candidates (on every head, and on some heads) are
    multiplied by 10^6, as errors that add up otherwise than measured alone would: its path runs through the others
    and full attention."""
    from approx.harness.autotune import Search

    search = Search(copy.deepcopy(bert), fit, check_data=check, methods=candidates, batch_size=4, progress=False,
                    **options)  # fmt: skip
    for row in search.loss:
        for column, base in enumerate(search.bases):  # on every head, and on some heads with head_counts
            if candidates[base] in inflated:
                row[column + 1] *= 1e6
    search.paths.clear()
    return search


def test_a_uniform_setting_cheaper_than_the_path_point_that_meets_the_target_is_taken(bert):
    """Efficient Attention and Taylor misjudged: the path runs through Nystrom (cheaper on each layer, less faithful)
    and full attention, and its point for a target that both meet on every layer costs more than either. The tuning
    takes the cheapest of them (Efficient Attention), found here by patching and measuring each uniform setting
    independently; without ``uniform`` it keeps the path's point. A target that the path's cheapest point meets keeps
    that point (no uniform setting costs less); a candidate with an infinite loss on a layer is never taken; a
    candidate on some heads is not a uniform setting."""
    candidates = ["nystrom:landmarks=4", "efficient", "taylor"]
    fit, check = _data(8, 21), _data(8, 22)
    lengths = [len(r) for r in check]
    search = _misjudged(bert, candidates, ["efficient", "taylor"], fit, check, head_counts=(1,))
    oracle = {label: (cost, cos) for label, cost, cos in _uniform_oracle(bert, candidates, check, lengths, "flops")}
    target = min(oracle["efficient"][1], oracle["taylor"][1]) - 1e-9  # both meet it, measured here
    # the premises, measured here: Nystrom on every layer is the cheapest and misses the target, Efficient Attention
    # is cheaper than Taylor; the path never takes either, and its point costs more than both
    assert oracle["nystrom:landmarks=4"][0] < oracle["efficient"][0] < oracle["taylor"][0]
    assert oracle["nystrom:landmarks=4"][1] < target
    path_only = search.choose(target, uniform=False, progress=False)
    assert path_only.origin == "path" and path_only.uniform == [] and path_only.met
    assert all("efficient" not in c and "taylor" not in c for p in path_only.path for c in p["choices"])
    assert path_only.cost > oracle["taylor"][0]
    tuning = search.choose(target, progress=False)
    assert tuning.origin == "uniform" and tuning.met and tuning.choices == ["efficient"] * 4
    assert tuning.cost == pytest.approx(oracle["efficient"][0], rel=1e-9)
    assert tuning.fidelity == pytest.approx(oracle["efficient"][1], abs=1e-6)
    # the tuned model is that uniform setting as approx.patch makes it, bit for bit
    rebuilt = copy.deepcopy(bert)
    approx.patch(rebuilt, "efficient")
    with torch.no_grad():
        for b in _batches(check):
            assert torch.equal(search.model(**b).last_hidden_state, rebuilt(**b).last_hidden_state)
    # the record lists the whole-layer candidates only (not those on some heads), with their costs and the measured
    # fidelity of the ones verified: Nystrom and Efficient Attention, cheapest first, not Taylor
    records = {r["choice"]: r for r in tuning.uniform}
    assert list(records) == candidates
    weighed = [a for _, a in search._uniform("flops", None)]
    assert len(search.labels) == 2 * len(candidates) and weighed
    assert all(len(set(a)) == 1 and a[0] <= len(candidates) for a in weighed)  # whole-layer columns only
    for name, (cost, cos) in oracle.items():
        assert records[name]["cost"] == pytest.approx(cost, rel=1e-9)
        if name != "taylor":
            assert records[name]["measured_fidelity"] == pytest.approx(cos, abs=1e-6)
    assert "measured_fidelity" not in records["taylor"]
    assert "a uniform setting (efficient on every layer)" in tuning.summary()
    assert approx.integration.tuning(search.model)["origin"] == "uniform"
    # a target the path's cheapest point (Nystrom on every layer) meets: no uniform setting costs less
    cheapest = search.choose(oracle["nystrom:landmarks=4"][1] - 1e-9, progress=False)
    assert cheapest.origin == "path" and cheapest.choices == ["nystrom:landmarks=4"] * 4
    # Efficient Attention broken on layer 0: never taken, Taylor is
    search.loss[0][candidates.index("efficient") + 1] = math.inf
    search.paths.clear()
    tuning = search.choose(target, progress=False)
    assert tuning.origin == "uniform" and tuning.choices == ["taylor"] * 4


def test_a_score_target_weighs_the_uniform_settings_by_their_score(bert):
    """A score target: the uniform settings are scored, not verified on the fidelity measure. The scorer here is
    the mean cosine to the unpatched model on the held-out inputs, written in this file."""
    candidates = ["nystrom:landmarks=4", "efficient"]
    fit, check = _data(8, 21), _data(8, 22)
    batches = _batches(check)
    search = _misjudged(bert, candidates, ["efficient"], fit, check)
    calls = []

    def score(model):
        calls.append(1)
        return _cosine(bert, model, batches)

    oracle = {label: (cost, cos) for label, cost, cos in _uniform_oracle(bert, candidates, check, [len(r) for r in check],
                                                                         "flops")}  # fmt: skip
    target = f"score>={oracle['efficient'][1] - 1e-9!r}"
    tuning = search.choose(target, score=score, progress=False)
    assert tuning.origin == "uniform" and tuning.choices == ["efficient"] * 4 and tuning.met
    assert tuning.score["relative"] == pytest.approx(oracle["efficient"][1], abs=1e-6)
    assert {r["choice"]: r for r in tuning.uniform}["efficient"]["measured_score"] == pytest.approx(
        oracle["efficient"][1], abs=1e-6
    )
    assert not search.choose(target, score=score, uniform=False, progress=False).choices == ["efficient"] * 4


def test_a_budget_alone_keeps_the_most_faithful_of_the_path_point_and_the_uniform_settings(bert):
    """With a budget alone: the path's first point within it and every uniform setting within it, measured here
    independently; the tuning keeps the most faithful of them, here Efficient Attention on every layer (misjudged,
    so the path holds only Nystrom and full attention)."""
    candidates = ["nystrom:landmarks=4", "efficient"]
    fit, check = _data(8, 23), _data(8, 24)
    lengths = [len(r) for r in check]
    search = _misjudged(bert, candidates, ["efficient"], fit, check)
    oracle = _uniform_oracle(bert, candidates, check, lengths, "flops")
    budget = max(cost for _, cost, _ in oracle) + 1e-9
    path_only = search.choose(None, budget, uniform=False, progress=False)
    assert path_only.origin == "path" and path_only.cost <= budget
    options = [(path_only.choices, _cosine(bert, _patched_as(bert, path_only.choices), _batches(check)))]
    options += [([label] * 4, cos) for label, _, cos in oracle]
    best = max(options, key=lambda o: o[1])
    assert best[0] == ["efficient"] * 4  # the premise, measured here
    tuning = search.choose(None, budget, progress=False)
    assert tuning.choices == best[0] and tuning.met and tuning.cost <= budget and tuning.origin == "uniform"
    assert tuning.fidelity == pytest.approx(best[1], abs=1e-6)
    assert _cosine(bert, search.model, _batches(check)) == pytest.approx(best[1], abs=1e-6)
    assert "measures better than the search path's point within the budget" in tuning.summary()


def test_a_target_out_of_the_paths_reach_within_a_budget_is_met_by_a_uniform_setting(bert):
    """Target and budget: with Efficient Attention misjudged as above, the path's points within a budget of
    Efficient Attention's cost on every layer miss the target (measured here); that uniform setting meets it and is
    taken, and nothing is reported missed. Without ``uniform`` the miss is reported."""
    candidates = ["nystrom:landmarks=4", "efficient"]
    fit, check = _data(8, 25), _data(8, 26)
    lengths = [len(r) for r in check]
    search = _misjudged(bert, candidates, ["efficient"], fit, check)
    oracle = {label: (cost, cos) for label, cost, cos in _uniform_oracle(bert, candidates, check, lengths, "flops")}
    target, budget = oracle["efficient"][1] - 1e-9, oracle["efficient"][0] + 1e-9
    within = [p["choices"] for p in search.choose(target, uniform=False, progress=False).path if p["cost"] <= budget]
    assert within and all(_cosine(bert, _patched_as(bert, c), _batches(check)) < target for c in within)  # premise
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing reported missed
        tuning = search.choose(target, budget, progress=False)
    assert tuning.met and tuning.origin == "uniform" and tuning.choices == ["efficient"] * 4
    assert tuning.cost <= budget
    with pytest.warns(UserWarning, match="cannot be met within cost"):
        assert not search.choose(target, budget, uniform=False, progress=False).met


def test_cli_path_only(tmp_path, base_model, fixture_dir):
    out = tmp_path / "tuned"
    argv = ["autotune", "--model", base_model, "--data-dir", str(fixture_dir), "--windows", "4", "--length", "24",
            "--batch-size", "2", "--method", "efficient", "--target", "cosine>=0.5", "--output-dir", str(out),
            "--quiet"]  # fmt: skip
    assert main([*argv, "--path-only"]) == 0
    record = json.loads((out / "approx_autotune.json").read_text())["tuning"]
    assert record["origin"] == "path" and record["uniform"] == []
    assert main(argv) == 0
    record = json.loads((out / "approx_autotune.json").read_text())["tuning"]
    assert [r["choice"] for r in record["uniform"]] == ["efficient"]


def test_autotune_kl_is_scipys_per_distribution_and_per_real_masked_token():
    """The search's KL of the head's outputs (``_kl``: a sum and a count, so that batches add up): per distribution
    KL(reference || model) against scipy, with a relative tolerance (the end-to-end tests' absolute 1e-6 could not
    see a swapped direction on values of 1e-7); a masked LM's counts only the real tokens' distributions."""
    from scipy.stats import entropy

    from approx.harness.autotune import _kl

    g = torch.Generator().manual_seed(0)
    ref, out = torch.randn(4, 6, generator=g) * 2, torch.randn(4, 6, generator=g) * 2
    total, count = _kl(ref.log_softmax(-1), out.log_softmax(-1), torch.ones(4, dtype=torch.bool), "logits")
    want = entropy(ref.softmax(-1).numpy(), out.softmax(-1).numpy(), axis=-1)
    assert count == 4 and total == pytest.approx(float(want.sum()), rel=1e-6)
    ref, out = torch.randn(2, 5, 6, generator=g) * 2, torch.randn(2, 5, 6, generator=g) * 2  # (B, N, vocab)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    total, count = _kl(ref.log_softmax(-1), out.log_softmax(-1), mask, "logits")
    want = entropy(ref.softmax(-1).numpy(), out.softmax(-1).numpy(), axis=-1)
    assert count == 8 and total == pytest.approx(float(want[mask.numpy()].sum()), rel=1e-6)


def test_the_seed_draws_the_halves_and_the_candidates_state(bert):
    """``seed`` shuffles the calibration inputs before they are halved and draws each candidate's random state, as
    ``approx.patch(seed=...)`` would (ignoring it in either place had survived the tests): the same seed gives the
    same halves and state, another seed others; the halves split the inputs; each layer's state is its own."""
    from approx.harness.autotune import _candidate_layers, _split
    from approx.harness.spec import as_setup

    rows = [[5 + i, 6 + i, 7 + i] for i in range(20)]
    halves = {seed: _split(rows, seed, 4, 0) for seed in (0, 0, 1)}
    ids = {seed: [b["input_ids"][:, 0].tolist() for b in fit] for seed, (fit, _) in halves.items()}
    assert ids[0] != ids[1]
    fit, check = _split(rows, 0, 4, 0)
    assert [b["input_ids"].tolist() for b in fit] == [b["input_ids"].tolist() for b in halves[0][0]]
    seen = sorted(x for part in (fit, check) for b in part for x in b["input_ids"][:, 0].tolist())
    assert seen == [5 + i for i in range(20)]
    drawn = {s: _candidate_layers(bert, [as_setup("favor:features=8", s)])[0] for s in (0, 1)}
    again = _candidate_layers(bert, [as_setup("favor:features=8", 0)])[0]
    patched = approx.patch(copy.deepcopy(bert), "favor", features=8, seed=1)
    for i, layer in drawn[0].items():
        assert torch.equal(layer.state()["omega"], again[i].state()["omega"])
        assert not torch.equal(layer.state()["omega"], drawn[1][i].state()["omega"])
        assert torch.equal(drawn[1][i].state()["omega"], approx.patched_layers(patched)[i].state()["omega"])
    # each layer draws its own state from the seed and its index (one draw shared by every layer had survived)
    assert not torch.equal(drawn[0][0].state()["omega"], drawn[0][1].state()["omega"])
    # and a search draws its candidates with its seed (drawing them with the default had survived)
    from approx.harness.autotune import Search

    search = Search(copy.deepcopy(bert), _data(8, 1), check_data=_data(8, 2), methods=["favor:features=8"],
                    batch_size=4, progress=False, seed=1)  # fmt: skip
    for i, layer in search.options[0].items():
        assert torch.equal(layer.state()["omega"], approx.patched_layers(patched)[i].state()["omega"])


def test_hull_path_passes_every_point_of_a_hull_edge_in_layer_order_on_ties():
    """Collinear options of a layer (one edge of its hull): the path takes each in turn, nearest first, so a target
    met halfway along the edge is met there (taking the edge's far end at once had survived, and a target met at 0.75
    then fell back to 1); equal slopes in two layers are taken layer by layer, as documented."""
    loss = [[0.0, 0.25, 0.5, 0.75]]
    cost = [[1.0, 0.75, 0.5, 0.25]]
    assert hull_path(loss, cost) == [[0], [1], [2], [3]]
    two = hull_path([[0.0, 0.5], [0.0, 0.5]], [[1.0, 0.5], [1.0, 0.5]])
    assert two == [[0, 0], [1, 0], [1, 1]]


def test_the_tuning_objective_reads_only_the_real_tokens_whatever_padding_holds():
    """The masked-LM KL per real token against a float64 sum over real tokens, with NaN written in the approximate
    model's log-probabilities at padded positions (a product with the mask let NaN x 0 through)."""
    import math

    from approx.harness.autotune import _kl

    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    ref_logp = torch.randn(2, 4, 5, generator=g).log_softmax(-1)
    logp = torch.randn(2, 4, 5, generator=g).log_softmax(-1)
    logp[0, 3] = math.nan
    total, count = _kl(ref_logp, logp, mask, "logits")
    want = sum(
        float((ref_logp[b, t].double().exp() * (ref_logp[b, t].double() - logp[b, t].double())).sum())
        for b in range(2)
        for t in range(4)
        if mask[b, t]
    )
    assert count == 7 and total == pytest.approx(want, rel=1e-5)


def test_redraw_drops_the_tuning_record_it_makes_stale(bert, tmp_path):
    """approx.redraw of layers whose random state a seed draws: the record's fidelity was measured on the state drawn
    before, so the record is dropped with a warning (approx.save then writes none); a redraw that draws nothing (no
    layer reads a seed) keeps it."""
    model = copy.deepcopy(bert)
    tuning = approx.autotune(model, _data(8, 3), target="cosine>=0.5", methods=["favor:features=8"], progress=False)
    assert "favor" in {x["method"] for x in approx.settings(model)}, tuning.choices
    assert approx.integration.tuning(model) is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        approx.redraw(model, seed=0)  # the seed it was tuned with: the same state, and the record still holds
    assert approx.integration.tuning(model) is not None
    with pytest.warns(UserWarning, match="no longer describes it and is dropped"):
        approx.redraw(model, seed=3)
    assert approx.integration.tuning(model) is None
    assert "tuning" not in json.loads((approx.save(model, tmp_path / "t") / "approx_config.json").read_text())
    other = copy.deepcopy(bert)
    approx.autotune(other, _data(8, 3), target="cosine>=0.5", methods=["efficient"], progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        approx.redraw(other, seed=3)  # efficient draws no state: its record still describes it
    assert approx.integration.tuning(other) is not None
