"""Masked-LM training through the fine-tuning path (issue 16): BERT's dynamic masking of WikiText windows, the
loss at the masked positions only, a bare encoder turned into a masked-LM checkpoint whose decoder stays tied to
the word embeddings, and the recipe that makes MiniLM-L6's (``recipes/minilm_mlm.py``) in miniature."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import FAMILY_HEADS, tiny_model
from evalfixtures import WORDS, vocab, write_checkpoint

import approx
from approx.harness.cli import main
from approx.harness.finetune import masked_lm_loss
from approx.harness.tasks import get_task
from approx.harness.tasks.wikitext import MASK_FRACTION, training_mask

MASK_ID = 4


def _mask(ids, **kw):
    args = dict(window=0, epoch=0, seed=0, mask_id=MASK_ID, candidates=torch.arange(10, 1010))
    return training_mask(ids, **{**args, **kw})


def test_training_mask_follows_berts_rule_on_a_long_window():
    g = torch.Generator().manual_seed(1)
    body = torch.randint(10, 1010, (20_000,), generator=g).tolist()
    ids = [2, *body, 3]
    inputs, labels = _mask(ids)
    chosen = [i for i, label in enumerate(labels) if label != -100]
    assert len(inputs) == len(labels) == len(ids)
    assert len(chosen) == round(MASK_FRACTION * len(body)) and 0 not in chosen and len(ids) - 1 not in chosen
    assert all(labels[i] == ids[i] for i in chosen)
    assert all(inputs[i] == ids[i] for i in range(len(ids)) if labels[i] == -100)  # only chosen positions change
    n = len(chosen)
    masked = sum(inputs[i] == MASK_ID for i in chosen) / n
    kept = sum(inputs[i] == ids[i] for i in chosen) / n
    swapped = sum(inputs[i] not in (MASK_ID, ids[i]) for i in chosen) / n
    # binomial standard error at n = 3000: 0.007 (80 %), 0.005 (10 %); 4 of them allowed
    assert masked == pytest.approx(0.8, abs=0.03)
    assert kept == pytest.approx(0.1, abs=0.025) and swapped == pytest.approx(0.1, abs=0.025)
    assert all(10 <= inputs[i] < 1010 for i in chosen if inputs[i] != MASK_ID)  # replacements from the candidates


def test_training_masks_are_drawn_per_seed_epoch_and_window():
    ids = [2, *range(10, 210), 3]
    first = _mask(ids)
    assert _mask(ids) == first  # deterministic
    for other in ({"epoch": 1}, {"window": 1}, {"seed": 1}):
        inputs, labels = _mask(ids, **other)
        assert labels != first[1], other  # other positions chosen
    short = _mask([2, 50, 3])  # at least one position
    assert short[1] == [-100, 50, -100]


def test_train_batch_masks_anew_each_epoch_without_touching_the_features(fixture_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(write_checkpoint(tmp_path / "m", "base"))
    task = get_task("wikitext2")
    examples, _ = task.load("valid", source="local", data_dir=str(fixture_dir))
    feats = task.train_features(examples, tok, max_length=32)
    before = [list(f.input_ids) for f in feats]
    assert tok.mask_token_id not in {t for ids in before for t in ids} and all(len(ids) == 32 for ids in before)
    e0, e0_again, e1 = (task.train_batch(feats, tok, epoch=e, seed=0) for e in (0, 0, 1))
    assert [f.input_ids for f in feats] == before and all("labels" not in f.extra for f in feats)
    assert [f.extra["labels"] for f in e0] == [f.extra["labels"] for f in e0_again]
    assert [f.extra["labels"] for f in e0] != [f.extra["labels"] for f in e1]
    special = set(tok.all_special_ids)
    for f, ids in zip(e0, before, strict=True):
        labels = f.extra["labels"]["labels"]
        chosen = [i for i, label in enumerate(labels) if label != -100]
        assert len(chosen) == round(MASK_FRACTION * 30) and all(labels[i] == ids[i] for i in chosen)
        assert all(f.input_ids[i] == tok.mask_token_id or f.input_ids[i] not in special for i in chosen)


@pytest.mark.parametrize("family", [f for f, head in FAMILY_HEADS if head == "masked-lm"])
def test_masked_lm_loss_is_the_models_own_loss_with_the_same_gradients(family):
    """Projecting only the labelled rows gives the model's own loss (float64, so the only difference is the order of
    the sums) and the same gradients, with padding and rows without any label in the batch, for every family with a
    masked-LM head (MobileBERT's reads its decoder's weights without calling it: every row is projected there)."""
    model = tiny_model(family, "masked-lm").double()  # eval mode: no dropout, both passes see the same network
    ids = torch.randint(5, 99, (3, 24), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(ids, -100)
    labels[0, [3, 7, 8]] = ids[0, [3, 7, 8]]
    labels[2, [1, 20]] = ids[2, [1, 20]]
    mask = torch.ones_like(ids)
    mask[2, 21:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    params = list(model.parameters())  # (some unused by the masked-LM loss: ESM's contact head, say)
    own = model(**batch).loss
    own_grads = torch.autograd.grad(own, params, allow_unused=True)
    mine = masked_lm_loss(model, batch, model.get_output_embeddings())
    mine_grads = torch.autograd.grad(mine, params, allow_unused=True)
    # (EuroBERT's own loss takes its logits to float32 first: agreement to float32 there)
    rtol, atol = (1e-12, 1e-14) if own.dtype == torch.float64 else (1e-6, 1e-9)
    torch.testing.assert_close(mine, own.to(mine.dtype), rtol=rtol, atol=0)
    for a, b in zip(mine_grads, own_grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=rtol * 100, atol=atol)
    assert "labels" in batch  # the caller's batch is left as it was
    assert model(**{k: v for k, v in batch.items() if k != "labels"}).logits.shape == (3, 24, 99)  # hook removed


def _patterned_wikitext(root: Path) -> Path:
    """A WikiText-2 folder whose text repeats a few sentences: a tiny model learns it in a few dozen steps."""
    rng = torch.Generator().manual_seed(0)
    sentences = [" ".join(WORDS[i : i + 6]) + " ." for i in range(0, 30, 6)]
    lines = []
    for h in range(8):
        lines += ["", f" = Heading {h} = ", ""]
        lines += [" " + " ".join(sentences[int(j)] for j in torch.randint(0, 5, (8,), generator=rng)) for _ in range(3)]
    (root / "wikitext-2").mkdir(parents=True)
    for split in ("valid", "test"):
        (root / f"wikitext-2/wiki.{split}.tokens").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def mlm_data(tmp_path_factory):
    return _patterned_wikitext(tmp_path_factory.mktemp("mlm-data"))


def _finetune(base, data, out, **kw):
    from approx.harness.finetune import finetune

    opts = dict(
        train_split="valid", data_dir=str(data), source="local", max_length=32, batch_size=4, learning_rate=2e-3,
        warmup=0.0, progress=False,
    )  # fmt: skip
    return finetune(base, "wikitext2", output_dir=out, **{**opts, **kw})


def test_a_bare_encoder_becomes_a_tied_masked_lm_checkpoint_that_learns(base_model, mlm_data, tmp_path):
    rec = _finetune(base_model, mlm_data, tmp_path / "ft", max_steps=80, eval_split="test")
    losses = rec["losses"]  # from about ln 68 = 4.2 nats; the mean of 5 batches moves by about 0.1 by chance
    assert len(losses) == 80 and sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5
    assert rec["head"] == {"name": "masked-lm", "fresh": True, "tied_to_word_embeddings": True}
    assert "80 % become [MASK]" in rec["train_protocol"] and rec["train_split"] == "valid"
    from transformers import AutoModelForMaskedLM

    model = AutoModelForMaskedLM.from_pretrained(tmp_path / "ft")
    assert json.loads((tmp_path / "ft" / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert approx.integration.checkpoint_heads(str(tmp_path / "ft")) == ["masked-lm"]
    # the saved checkpoint, through the harness in masked-LM mode, scores what the trained model scored
    (ev,) = rec["evaluation"]
    (again,) = approx.evaluate(
        str(tmp_path / "ft"), "wikitext2", ["full"], data_dir=str(mlm_data), source="local", max_length=32,
        progress=False,
    )  # fmt: skip
    assert ev["mode"] == again["mode"] == "masked-lm" and again["split"] == "test"
    assert again["reference_metrics"] == pytest.approx(ev["reference_metrics"], rel=1e-6)
    assert again["metrics"]["mlm_loss"] == pytest.approx(again["reference_metrics"]["mlm_loss"], rel=1e-5)
    # better than the untrained head on the same windows (a fresh head, random weights: about ln 68 nats)
    fresh = AutoModelForMaskedLM.from_pretrained(base_model)
    (before,) = approx.evaluate(
        fresh, "wikitext2", ["full"], tokenizer=approx.integration.load_pretrained(base_model)[1],
        data_dir=str(mlm_data), source="local", max_length=32, progress=False,
    )  # fmt: skip
    assert again["reference_metrics"]["mlm_loss"] < 0.9 * before["reference_metrics"]["mlm_loss"]


def test_every_epoch_gets_its_own_masks_and_resuming_replays_them(base_model, mlm_data, tmp_path, monkeypatch):
    task = get_task("wikitext2")
    seen = []
    original = type(task).train_batch

    def spy(self, features, tokenizer, *, epoch, seed):
        seen.append((epoch, tuple(f.example for f in features)))
        return original(self, features, tokenizer, epoch=epoch, seed=seed)

    monkeypatch.setattr(type(task), "train_batch", spy)
    run = dict(limit=8, max_steps=5)  # 8 windows, 2 batches per epoch: epochs 0, 1 and half of 2
    assert _finetune(base_model, mlm_data, tmp_path / "a", **run)["features"] == 8
    epochs = [e for e, _ in seen]
    assert epochs == sorted(epochs) and set(epochs) == {0, 1, 2} and epochs.count(0) == epochs.count(1) == 2
    assert sorted(w for e, batch in seen if e == 0 for w in batch) == list(range(8))  # every window once an epoch
    _finetune(base_model, mlm_data, tmp_path / "b", stop_after=3, **run)
    _finetune(base_model, mlm_data, tmp_path / "b", resume=True, **run)  # resumes in the middle of epoch 1
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_cli_finetunes_wikitext_on_valid(base_model, mlm_data, tmp_path, capsys):
    argv = ["finetune", "--model", base_model, "--task", "wikitext2", "--output-dir", str(tmp_path / "w")]
    argv += ["--train-split", "valid", "--eval-split", "test", "--data-dir", str(mlm_data), "--max-length", "32"]
    assert main([*argv, "--max-steps", "2", "--batch-size", "4", "--quiet"]) == 0, capsys.readouterr().err
    assert "mlm_loss" in capsys.readouterr().out
    assert json.loads((tmp_path / "w" / "finetune.json").read_text())["head"]["name"] == "masked-lm"


def test_minilm_mlm_recipe_smoke(mlm_data, tmp_path):
    """The recipe on a tiny encoder with 32 learned positions: fine-tune, evaluate at 32 tokens and zero-shot at
    128 with the positions copied, write the JSON, reuse the cached checkpoint on a second run."""
    from transformers import BertTokenizer

    base = tmp_path / "base"
    tiny_model("bert", vocab_size=len(vocab()), max_position_embeddings=32).save_pretrained(base)
    BertTokenizer(vocab=vocab()).save_pretrained(base)
    recipes = Path(__file__).resolve().parent.parent / "recipes"
    sys.path.insert(0, str(recipes))
    spec = importlib.util.spec_from_file_location("minilm_mlm", recipes / "minilm_mlm.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    out = tmp_path / "res.json"
    argv = [
        *("--model", str(base), "--data-dir", str(mlm_data), "--lengths", "32", "128", "--max-steps", "3"),
        *("--batch-size", "4", "--checkpoints", str(tmp_path / "ck"), "--results", str(out), "--quiet"),
    ]
    assert recipe.main(argv) == 0
    record = json.loads(out.read_text())
    short, long = record["results"]
    assert (short["max_length"], long["max_length"]) == (32, 128) and short["mode"] == long["mode"] == "masked-lm"
    assert short["split"] == long["split"] == "test" and long["examples"] < short["examples"]
    for r, line in zip(record["results"], record["table"], strict=True):
        assert line["bits_per_token"] == pytest.approx(r["reference_metrics"]["mlm_loss"] / math.log(2))
        assert line["windows"] == r["examples"] and line["max_length"] == r["max_length"]
    assert "copied" in record["table"][1]["positions"]
    checkpoint = record["checkpoint"]
    assert checkpoint["head"]["tied_to_word_embeddings"] and checkpoint["train_split"] == "valid"
    assert (
        checkpoint["settings"]["steps"] == 3 and len(checkpoint["losses"]) == 3 and not checkpoint["reused_from_cache"]
    )
    assert record["paper"]["longformer_roberta_base"] == {"512": 2.536, "4096": 2.652}
    table = recipe.markdown_table(record)
    assert "| bits/token @ 32 | bits/token @ 128 |" in table and "WikiText-103" in table
    assert recipe.main(argv) == 0
    assert json.loads(out.read_text())["checkpoint"]["reused_from_cache"]
