"""The harness reads inputs longer than the model's learned positions (issue 16): it extends them for the
evaluation, says so in the result, its protocol and provenance, gives a model object its own table back, and
refuses at once, untouched, a model whose positions cannot be extended."""

from __future__ import annotations

import math

import pytest
import torch
from evalfixtures import write_checkpoint, write_data

import approx
from approx.harness.tasks import get_task
from approx.harness.tasks.wikitext import mask_positions

LONG = 1024  # the tiny checkpoints have 512 learned positions


@pytest.fixture(scope="module")
def long_data(tmp_path_factory):
    """The evaluation fixtures, with a WikiText file long enough for two windows of LONG tokens."""
    root = write_data(tmp_path_factory.mktemp("long"))
    for split in ("test", "valid"):
        path = root / f"wikitext-2/wiki.{split}.tokens"
        path.write_text(path.read_text() * 40)
    return root


@pytest.fixture(scope="module")
def mlm_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("mlm") / "m", "masked-lm")


def _evaluate(model, methods, data, **kw):
    return approx.evaluate(
        model, "wikitext2", methods, data_dir=str(data), source="local", progress=False, max_length=LONG, **kw
    )


def _independent_mlm_loss(path, data, windows: int) -> float:
    """The masked-LM loss at LONG tokens without the harness: the checkpoint loaded plainly, its positions
    extended, each window masked by the protocol's rule and run alone."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = approx.extend_positions(AutoModelForMaskedLM.from_pretrained(path).eval(), LONG, tokenizer=tok)
    examples, _ = get_task("wikitext2").load(source="local", data_dir=str(data), limit=windows)
    plain = get_task("wikitext2").features(examples, tok, max_length=LONG, mode="fidelity")
    total, count = 0.0, 0
    for i, f in enumerate(plain):
        ids = torch.tensor([f.input_ids])
        pos = mask_positions(i, ids.shape[1] - 2)
        masked = ids.clone()
        masked[0, pos] = tok.mask_token_id
        with torch.no_grad():
            logits = model(input_ids=masked).logits[0, pos].double()
        total += float(torch.nn.functional.cross_entropy(logits, ids[0, pos], reduction="sum"))
        count += len(pos)
    return total / count


def test_a_folder_read_past_its_positions(mlm_checkpoint, long_data):
    results = _evaluate(str(mlm_checkpoint), ["full", "clustered:clusters=4"], long_data, limit=2, batch_size=1)
    exact, clustered = results
    assert exact["features"] == 2 and exact["max_length"] == LONG
    for r in results:
        assert r["positions"]["extended_from"] == 512 and r["positions"]["extended_to"] == LONG
        assert r["positions"]["trained_positions"] == 512  # the rows a new position copies: the table's own here
        assert f"extended to {LONG}" in r["protocol"]
        assert r["provenance"]["positions"] == r["positions"]
    # the reference is the extended model, checked against a run without the harness
    loss = _independent_mlm_loss(mlm_checkpoint, long_data, windows=2)
    assert exact["reference_metrics"]["mlm_loss"] == pytest.approx(loss, rel=1e-5)
    assert exact["reference_metrics"]["bits_per_token"] == pytest.approx(loss / math.log(2), rel=1e-5)
    # exact attention through the patch is the unpatched extended model
    assert exact["metrics"]["mlm_loss"] == pytest.approx(loss, rel=1e-5)
    assert exact["fidelity"]["hidden_state_cosine"]["last"] == pytest.approx(1.0, abs=1e-5)
    # per-example figures: the total over the examples scored
    f = clustered["fidelity"]
    assert f["seconds_per_example"] == pytest.approx(f["seconds"] / 2)
    assert f["reference_seconds_per_example"] == pytest.approx(f["reference_seconds"] / 2)
    assert clustered["metrics"]["mlm_loss"] != exact["metrics"]["mlm_loss"]  # the method really ran


def test_within_the_limit_nothing_is_extended(mlm_checkpoint, long_data):
    (r,) = approx.evaluate(
        str(mlm_checkpoint), "wikitext2", ["full"], data_dir=str(long_data), source="local", progress=False,
        max_length=256, limit=1,
    )  # fmt: skip
    assert "positions" not in r and "positions" not in r["provenance"] and "extended" not in r["protocol"]


def test_a_model_object_gets_its_own_positions_back(mlm_checkpoint, long_data):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    model = AutoModelForMaskedLM.from_pretrained(mlm_checkpoint).eval()
    tok = AutoTokenizer.from_pretrained(mlm_checkpoint)
    emb = model.bert.embeddings
    table, weight = emb.position_embeddings, emb.position_embeddings.weight
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tok_limit = tok.model_max_length
    (r,) = _evaluate(model, ["full"], long_data, tokenizer=tok, limit=1)
    assert r["positions"]["extended_to"] == LONG
    assert emb.position_embeddings is table and table.weight is weight and table.num_embeddings == 512
    assert model.config.max_position_embeddings == 512 and emb.position_ids.shape[-1] == 512
    assert tok.model_max_length == tok_limit
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("family, overrides", [("distilbert", {"sinusoidal_pos_embds": True})])
def test_positions_that_cannot_be_extended_are_refused_before_running(tmp_path, long_data, family, overrides):
    from conftest import tiny_model
    from evalfixtures import vocab
    from transformers import BertTokenizer

    model = tiny_model(family, "masked-lm", vocab_size=len(vocab()), **overrides)
    tok = BertTokenizer(vocab=vocab())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="fixed sinusoids") as err:
        _evaluate(model, ["full"], long_data, tokenizer=tok, limit=1)
    assert f"to {LONG} tokens" in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_a_bad_max_length_is_refused(mlm_checkpoint, long_data, bad):
    with pytest.raises(ValueError, match="max_length must be a positive int"):
        approx.evaluate(str(mlm_checkpoint), "wikitext2", ["full"], data_dir=str(long_data), max_length=bad)


def test_the_command_line_reads_past_the_positions(mlm_checkpoint, long_data, tmp_path):
    """The issue's first report: `approx eval --task wikitext2 --max-length 1024` crashed with a tensor-size error."""
    import json

    from approx.harness.cli import main

    out = tmp_path / "r.json"
    argv = ["eval", "--model", str(mlm_checkpoint), "--task", "wikitext2", "--max-length", str(LONG)]
    argv += ["--data-dir", str(long_data), "--limit", "1", "--method", "favor", "--features", "16", "--quiet"]
    assert main([*argv, "--output", str(out)]) == 0
    r = json.loads(out.read_text())  # one method: one object
    assert r["max_length"] == LONG and r["positions"]["extended_to"] == LONG and r["features"] == 1


def test_short_inputs_extend_nothing_whatever_the_max_length(tmp_path, long_data):
    """The longest input counts, not --max-length: short sentences read as they are."""
    folder = write_checkpoint(tmp_path / "cls", "sequence-classification")
    (r,) = approx.evaluate(
        str(folder), "sst2", ["full"], data_dir=str(long_data), source="local", progress=False, max_length=4096,
    )  # fmt: skip
    assert r["max_length"] == 4096 and "positions" not in r and "extended" not in r["protocol"]


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_extended_positions_restores_after_an_error_inside_the_block(family):
    from conftest import tiny_model

    from approx.positions import extended_positions, position_limit

    model = tiny_model(family, "masked-lm")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    limit = position_limit(model)
    with pytest.raises(RuntimeError, match="inside"):
        with extended_positions(model, 3 * limit):
            assert position_limit(model) == 3 * limit
            model(input_ids=torch.randint(5, 90, (1, 2 * limit)))  # reads past the old limit
            raise RuntimeError("inside")
    assert position_limit(model) == limit and model.config.max_position_embeddings == before_rows(before)
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(p is params[n] for n, p in model.named_parameters())
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)


def before_rows(state: dict[str, torch.Tensor]) -> int:
    return next(v.shape[0] for k, v in state.items() if k.endswith("position_embeddings.weight"))


def test_fine_tuning_past_the_positions_extends_them_for_good(tmp_path, long_data):
    """`approx finetune --max-length 1024` on a 512-position encoder: the positions are extended before training
    (recorded), and the saved checkpoint reads 1024 tokens through plain from_pretrained."""
    from transformers import AutoModelForMaskedLM

    from approx.harness.finetune import finetune
    from approx.positions import position_limit

    base = write_checkpoint(tmp_path / "base", "base")
    out = tmp_path / "ft"
    record = finetune(
        str(base), "wikitext2", output_dir=out, train_split="valid", data_dir=str(long_data), source="local",
        max_length=LONG, max_steps=1, batch_size=1, limit=1, progress=False,
    )  # fmt: skip
    assert record["positions"]["extended_from"] == 512 and record["positions"]["extended_to"] == LONG
    model = AutoModelForMaskedLM.from_pretrained(out)
    assert position_limit(model) == LONG and model.config.max_position_embeddings == LONG


def test_fine_tuning_a_rotary_model_past_its_length_is_refused_before_training(tmp_path, long_data, monkeypatch):
    """A 512-position rotary model (no table to extend) asked to fine-tune at 1024 tokens: refused, with what was
    found, as its evaluation at that length is (it had trained and saved a checkpoint recording nothing); so is
    `approx fit --length` past it."""
    from approx.harness import finetune as ft

    base = write_checkpoint(tmp_path / "base", "masked-lm", family="esm")

    def never(*args, **kwargs):
        raise AssertionError("trained before refusing")

    monkeypatch.setattr(ft, "_train", never)
    with pytest.raises(ValueError, match=r"positions are rotary \(RoPE\)"):
        ft.finetune(
            str(base), "wikitext2", output_dir=tmp_path / "ft", train_split="valid", data_dir=str(long_data),
            source="local", max_length=LONG, max_steps=1, batch_size=1, limit=1, progress=False,
        )  # fmt: skip
    assert not (tmp_path / "ft" / "finetune.json").exists()
    from approx.harness.cli import main

    argv = ["fit", "--model", str(base), "--method", "sparsefinder", "--length", str(LONG), "--windows", "1"]
    argv += ["--output-dir", str(tmp_path / "fit"), "--data-dir", str(long_data), "--quiet"]
    assert main(argv) != 0
    assert not (tmp_path / "fit").exists()


def test_halves_read_at_different_lengths_are_not_merged():
    from approx.harness.crossfit import merge_halves

    def half(n):
        return [{"task": "sst2", "task_version": 1, "mode": "fine-tuned", "max_length": n, "method": {"name": "full"},
                 "predictions": [0], "reference_predictions": [0], "fidelity_sums": {}}]  # fmt: skip

    with pytest.raises(ValueError, match="differ in 'max_length'"):
        merge_halves([half(1024), half(2048)], [[{}], [{}]])
