"""Position extension (``approx.extend_positions``) on tiny models of every supported family, and on the real
MiniLM-L6: the trained rows are kept and tiled, short inputs give the old outputs bit-for-bit, long inputs run
under every method, the new length survives ``save_pretrained``/``from_pretrained``, refusals change nothing.

Expected tables are built here from the original tensor (never from the code's own output)."""

import copy

import numpy as np
import pytest
import torch
from conftest import ABSOLUTE_POSITIONS, ROTARY, batch, model_output, tiny_config, tiny_model

import approx
from approx.positions import extended_positions

METHODS = approx.methods()
ROWS = 64  # the tiny models' position table
NEW = 200  # tokens after extension


def offset_of(model) -> int:
    """Rows before the first real position: 2 for RoBERTa-like tables (padding_idx 1), else 0."""
    pad = model.base_model.embeddings.position_embeddings.padding_idx
    return 0 if pad is None else pad + 1


def table(model) -> torch.Tensor:
    return model.base_model.embeddings.position_embeddings.weight


def state(model) -> dict[str, torch.Tensor]:
    """Parameters and every buffer (the position-id buffers are not persistent, so not in state_dict)."""
    return {**{k: v.clone() for k, v in model.named_parameters()}, **{k: v.clone() for k, v in model.named_buffers()}}


def assert_same_state(before: dict[str, torch.Tensor], model) -> None:
    after = state(model)
    assert before.keys() == after.keys()
    for k in before:
        assert before[k].shape == after[k].shape and torch.equal(before[k], after[k]), k


@pytest.mark.parametrize("family", ABSOLUTE_POSITIONS)
def test_trained_rows_are_kept_and_tiled(family):
    model = tiny_model(family, "base", max_position_embeddings=ROWS)
    old = table(model).detach().clone()
    off = offset_of(model)
    trained = ROWS - off  # the old limit in tokens: 64, or 62 with RoBERTa's offset
    assert approx.extend_positions(model, np.int64(NEW)) is model  # NumPy integers as every option takes them
    assert type(model.config.max_position_embeddings) is int

    new = table(model).detach()
    assert new.shape == (off + NEW, old.shape[1])
    assert torch.equal(new[:ROWS], old)  # the first positions (and the offset rows) bit-identical
    for start in range(off, off + NEW, trained):  # every block of new rows is a copy of the trained rows
        n = min(trained, off + NEW - start)
        assert torch.equal(new[start : start + n], old[off : off + n]), start
    emb = model.base_model.embeddings
    assert model.config.max_position_embeddings == off + NEW
    assert emb.position_embeddings.num_embeddings == off + NEW
    assert torch.equal(emb.position_ids, torch.arange(off + NEW)[None])
    if hasattr(emb, "token_type_ids"):
        assert torch.equal(emb.token_type_ids, torch.zeros(1, off + NEW, dtype=torch.long))
    assert "position_ids" in dict(emb.named_buffers())  # still registered buffers


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_extending_twice_gives_the_model_extending_once_gives(family, tmp_path):
    """Extending to a length that is not a multiple of the trained rows, then further, repeats the trained rows, not
    the table the first extension made (position 100 of a 64-row table read row 0 after 90 then 200, row 36 after 200
    at once: a reviewer's finding), through a save and reload in between as well; rows trained after the first
    extension (fine-tuning) are kept, and a new position still takes its trained row."""
    from transformers import AutoModel

    once = approx.extend_positions(tiny_model(family, "base", max_position_embeddings=ROWS), NEW)
    twice = approx.extend_positions(tiny_model(family, "base", max_position_embeddings=ROWS), 90)
    assert torch.equal(table(approx.extend_positions(twice, NEW)), table(once))
    off, trained = offset_of(once), ROWS - offset_of(once)
    saved = approx.extend_positions(tiny_model(family, "base", max_position_embeddings=ROWS), 90)
    with torch.no_grad():
        table(saved)[off + 80] += 1.0  # a row trained at the new length
    saved.save_pretrained(tmp_path)
    loaded = approx.extend_positions(AutoModel.from_pretrained(tmp_path), NEW)
    want = table(once).clone()
    want[off + 80] += 1.0
    assert torch.equal(table(loaded), want)
    assert loaded.config.approx_trained_positions == trained
    with extended_positions(tiny_model(family, "base", max_position_embeddings=ROWS), NEW) as model:
        assert model.config.approx_trained_positions == trained
    assert not hasattr(model.config, "approx_trained_positions")  # the block leaves the config as it was
    # a model extended before the count was recorded: its table repeats the trained rows, and that period is taken
    old = approx.extend_positions(tiny_model(family, "base", max_position_embeddings=ROWS), 90)
    del old.config.approx_trained_positions
    assert approx.positions.trained_positions(old) == trained
    assert torch.equal(table(approx.extend_positions(old, NEW)), table(once))
    assert old.config.approx_trained_positions == trained
    assert approx.positions.trained_positions(tiny_model(family, "base", max_position_embeddings=ROWS)) == trained
    # rows that happen to be equal at both ends of a table are no period (a reviewer's finding: r[-1] = r[0] read as
    # 511 of 512 trained rows), and a table without values (built on meta, to be loaded) extends as before
    rows = torch.randn(512, 8)
    rows[-3:] = rows[:3]
    assert approx.positions._table_period(rows) == 512
    assert approx.positions._table_period(torch.cat([rows, rows[:100]])) == 512
    with torch.device("meta"):
        meta = AutoModel.from_config(tiny_config(family, max_position_embeddings=ROWS))
    assert table(approx.extend_positions(meta, NEW)).shape[0] == offset_of(meta) + NEW
    # a count edited by hand into something that is not one: said, and the table's period taken
    edited = approx.extend_positions(tiny_model(family, "base", max_position_embeddings=ROWS), 90)
    edited.config.approx_trained_positions = str(trained)
    with pytest.warns(UserWarning, match=r"approx_trained_positions = '\d+' is not a number of rows"):
        assert torch.equal(table(approx.extend_positions(edited, NEW)), table(once))


@pytest.mark.parametrize("family", ABSOLUTE_POSITIONS)
def test_short_inputs_are_unchanged_and_long_inputs_run(family):
    original = tiny_model(family, "base", max_position_embeddings=ROWS)
    extended = approx.extend_positions(copy.deepcopy(original), NEW)
    short = batch(ROWS - 2, pad=13)  # within the old limit of every family
    with torch.no_grad():
        assert torch.equal(model_output(extended, **short), model_output(original, **short))
        with pytest.raises(
            (IndexError, RuntimeError)
        ):  # the original cannot read it: the test input really is too long
            model_output(original, **batch(NEW))
        out = model_output(extended, **batch(NEW, pad=13))
    assert out.shape[1] == NEW and torch.isfinite(out).all()


@pytest.mark.parametrize("family", ABSOLUTE_POSITIONS)
@pytest.mark.parametrize("method", METHODS)
def test_every_method_reads_past_the_old_limit(family, method):
    spec = approx.get_method(method)
    if spec.requires_fit(spec.config_class(**spec.test_options)):
        pytest.skip(f"{method} needs fitting (approx.fit); not part of this test")
    opts = dict(spec.test_options)
    model = approx.extend_positions(tiny_model(family, "base", max_position_embeddings=ROWS), NEW)
    approx.patch(model, method, **opts)
    with torch.no_grad():
        out = model_output(model, **batch(NEW, pad=13))
    assert out.shape[1] == NEW and torch.isfinite(out).all()


@pytest.mark.parametrize("family", ROTARY)
def test_rotary_positions_are_refused_and_left_alone(family):
    """Families that rotate q and k (RoPE) have no position table to extend: refused, nothing changed. (Their inputs
    may run up to ``config.max_position_embeddings``, which the harness reads instead.)"""
    model = tiny_model(family, "base")
    before = state(model)
    assert approx.positions.position_limit(model) is None
    with pytest.raises(ValueError, match=r"positions are rotary \(RoPE\)") as e:
        approx.extend_positions(model, NEW)
    assert f"({model.config.max_position_embeddings})" in str(e.value) and "RotaryEmbedding" in str(e.value)
    assert_same_state(before, model)


def test_a_table_beside_relative_attention_is_refused():
    """DeBERTa-v2 with relative attention and a biased absolute table: its relative embeddings are sized by
    config.max_position_embeddings, so an extended model saved would not load again: refused, nothing changed."""
    from transformers import DebertaV2Config, DebertaV2Model

    config = DebertaV2Config(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=32, max_position_embeddings=64, relative_attention=True,
                             position_biased_input=True)  # fmt: skip
    model = DebertaV2Model(config).eval()
    before = state(model)
    with pytest.raises(ValueError, match=r"relative attention \(config.relative_attention\)"):
        approx.extend_positions(model, 200)
    assert_same_state(before, model)
    # relative positions alone (DeBERTa-v3: no table) read any length: nothing to extend, and nothing refused (a
    # plain fine-tuning past 64 tokens had been refused as a rotary model's is)
    config.position_biased_input = False
    relative = DebertaV2Model(config).eval()
    assert approx.positions.position_limit(relative) is None
    assert approx.positions.limit_for(relative, 200) is None
    with pytest.raises(ValueError, match="relative only .* reads any length as it is"):
        approx.extend_positions(relative, 200)
    rotary = tiny_model("esm", "base")
    with pytest.raises(ValueError, match="rotary"):
        approx.positions.limit_for(rotary, rotary.config.max_position_embeddings + 1)


@pytest.mark.parametrize("method", METHODS)
def test_extend_after_patch(method):
    spec = approx.get_method(method)
    if spec.requires_fit(spec.config_class(**spec.test_options)):
        pytest.skip(f"{method} needs fitting (approx.fit); not part of this test")
    patched = approx.patch(tiny_model("roberta", "base", max_position_embeddings=ROWS), method,
                           **approx.get_method(method).test_options)  # fmt: skip
    extended = approx.extend_positions(copy.deepcopy(patched), NEW)
    assert approx.is_patched(extended)
    short = batch(48, pad=13)
    with torch.no_grad():
        assert torch.equal(model_output(extended, **short), model_output(patched, **short))
        out = model_output(extended, **batch(NEW, pad=13))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("family", ABSOLUTE_POSITIONS)
def test_saved_model_keeps_the_new_length(family, tmp_path):
    from transformers import AutoModel

    model = approx.extend_positions(tiny_model(family, "base", max_position_embeddings=ROWS), NEW)
    model.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert loaded.config.max_position_embeddings == model.config.max_position_embeddings
    assert torch.equal(table(loaded), table(model))
    long = batch(NEW, pad=13)
    with torch.no_grad():
        assert torch.equal(model_output(loaded, **long), model_output(model, **long))


@pytest.mark.parametrize("method", ["full", "favor"])
def test_patched_model_saved_after_extension(method, tmp_path):
    from transformers import AutoModel

    model = approx.patch(tiny_model("roberta", "base", max_position_embeddings=ROWS), method)
    approx.extend_positions(model, NEW)
    model.save_pretrained(tmp_path / "a")  # a patched model's save_pretrained writes an approx folder
    approx.save(model, tmp_path / "b")
    long = batch(NEW, pad=13)
    for folder in ("a", "b"):
        plain = AutoModel.from_pretrained(tmp_path / folder).eval()  # loads with the new length, exact attention
        assert plain.config.max_position_embeddings == 2 + NEW and torch.equal(table(plain), table(model))
        reloaded = approx.load(tmp_path / folder).eval()
        with torch.no_grad():
            assert torch.isfinite(model_output(plain, **long)).all()
            assert torch.equal(model_output(reloaded, **long), model_output(model, **long))


def test_tokenizer_follows(tmp_path):
    from evalfixtures import vocab
    from transformers import AutoTokenizer, BertTokenizer

    tok = BertTokenizer(vocab=vocab())
    model = tiny_model("bert", "base", vocab_size=len(vocab()), max_position_embeddings=ROWS)
    approx.extend_positions(model, NEW, tokenizer=tok)
    assert tok.model_max_length == NEW
    ids = tok(" ".join(["the cat"] * 300), truncation=True)["input_ids"]
    assert len(ids) == NEW
    with torch.no_grad():
        assert torch.isfinite(model_output(model, input_ids=torch.tensor([ids]))).all()
    tok.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).model_max_length == NEW


@pytest.mark.parametrize("family", ["bert", "roberta"])
@pytest.mark.parametrize("max_length", [ROWS - 2, ROWS - 10, 1])
def test_a_length_not_larger_is_refused_untouched(family, max_length):
    from evalfixtures import vocab
    from transformers import BertTokenizer

    model = tiny_model(family, "base", max_position_embeddings=ROWS)
    tok = BertTokenizer(vocab=vocab())
    before, config, tok_max = state(model), model.config.to_dict(), tok.model_max_length
    with pytest.raises(ValueError, match=r"not larger than the current limit of \d+ tokens") as e:
        approx.extend_positions(model, max_length, tokenizer=tok)
    assert f"{ROWS} rows, offset {offset_of(model)}" in str(e.value)  # says what it found
    assert_same_state(before, model)
    assert model.config.to_dict() == config and tok.model_max_length == tok_max


def test_the_limit_itself_is_refused():
    model = tiny_model("bert", "base", max_position_embeddings=ROWS)
    with pytest.raises(ValueError, match="not larger than the current limit of 64 tokens"):
        approx.extend_positions(model, ROWS)
    model = tiny_model("roberta", "base", max_position_embeddings=ROWS)
    with pytest.raises(ValueError, match="not larger than the current limit of 62 tokens"):
        approx.extend_positions(model, ROWS - 2)
    approx.extend_positions(model, ROWS - 1)  # 63 tokens: one more than RoBERTa's 62
    assert table(model).shape[0] == ROWS + 1


@pytest.mark.parametrize(
    ("family", "overrides", "message"),
    [
        ("bert", {"position_embedding_type": "relative_key"}, "'relative_key', not learned absolute"),
        ("roberta", {"position_embedding_type": "relative_key_query"}, "'relative_key_query', not learned"),
        ("distilbert", {"sinusoidal_pos_embds": True}, "fixed sinusoids"),
    ],
)
def test_positions_that_are_not_learned_absolute_are_refused_untouched(family, overrides, message):
    model = tiny_model(family, "base", max_position_embeddings=ROWS, **overrides)
    before, config = state(model), model.config.to_dict()
    with pytest.raises(ValueError, match=message):
        approx.extend_positions(model, NEW)
    assert_same_state(before, model)
    assert model.config.to_dict() == config


def test_no_position_table_or_bad_length_is_refused():
    with pytest.raises(ValueError, match="found 0") as e:
        approx.extend_positions(torch.nn.Linear(2, 2), NEW)
    assert "no `config`" in str(e.value)
    model = tiny_model("bert", "base", max_position_embeddings=ROWS)
    before = state(model)
    for bad in (200.0, "200", True):
        with pytest.raises(ValueError, match="max_length must be an int"):
            approx.extend_positions(model, bad)
    assert_same_state(before, model)


@pytest.mark.realmodel
def test_minilm_reads_4096_tokens(minilm_path):
    from approx.integration import load_pretrained

    model, tokenizer = load_pretrained(minilm_path, progress=False)
    model.eval()
    old = table(model).detach().clone()
    assert old.shape[0] == 512
    approx.extend_positions(model, 4096, tokenizer=tokenizer)
    approx.patch(model, "full")
    assert tokenizer.model_max_length == 4096 and model.config.max_position_embeddings == 4096
    assert torch.equal(table(model)[:512], old) and torch.equal(table(model)[512:1024], old)
    ids = torch.randint(1000, len(tokenizer), (1, 4096), generator=torch.Generator().manual_seed(0))
    ids[0, 0], ids[0, -1] = tokenizer.cls_token_id, tokenizer.sep_token_id
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    assert out.shape == (1, 4096, 384) and torch.isfinite(out).all()
