"""Saving and loading a patched model by every usual way, and saved folders that are incomplete, corrupted or
hand-edited: each either loads to the model that was saved or fails with an error naming the file, leaving the
model exactly as it was (issue 15)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import batch, model_output, tiny_model
from evalfixtures import vocab

import approx
from approx.integration import load_pretrained, save_method_state
from approx.saved import SETTINGS_FILE, STATE_FILE, layers_digest

INPUTS = batch(48, pad=13)


def outputs(model) -> torch.Tensor:
    with torch.no_grad():
        return model_output(model, **INPUTS)


def tokenizer():
    from transformers import BertTokenizer

    v = vocab()  # the fixture words, filled up to the tiny models' 99 token embeddings
    return BertTokenizer(vocab={**v, **{f"[unused{i}]": i for i in range(len(v), 99)}})


def saved_folder(path: Path, method: str = "clustered", **options) -> tuple[torch.nn.Module, Path]:
    """A tiny BERT patched with ``method`` on layer 0, saved to ``path``."""
    model = tiny_model("bert")
    approx.patch(model, method, layers=[0], **(options or {"clusters": 6, "seed": 2}))
    approx.save(model, path, tokenizer=tokenizer())
    return model, path


# ------------------------------------------------------------------------------------------ 1. the tokenizer


def test_save_writes_the_tokenizer_and_load_pretrained_reads_it(tmp_path):
    model, folder = saved_folder(tmp_path / "m")
    loaded, tok = load_pretrained(folder)
    assert tok.get_vocab() == tokenizer().get_vocab()
    assert tok("the cat sits").input_ids == tokenizer()("the cat sits").input_ids


def test_folder_without_tokenizer_is_refused(tmp_path):
    """Without tokenizer files transformers builds an empty tokenizer (every word -> [UNK]): refused."""
    model = approx.patch(tiny_model("bert"), "full")
    approx.save(model, tmp_path / "m")
    with pytest.raises(ValueError, match="no tokenizer files") as e:
        load_pretrained(tmp_path / "m")
    assert str(tmp_path / "m") in str(e.value) and "tokenizer=" in str(e.value)


def test_tokenizer_of_another_vocabulary_is_refused(tmp_path):
    model = tiny_model("bert", vocab_size=4 * 99)  # embeddings of another vocabulary
    model.save_pretrained(tmp_path / "m")
    tokenizer().save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="not the model's tokenizer") as e:
        load_pretrained(tmp_path / "m")
    assert str(tmp_path / "m") in str(e.value)
    with pytest.raises(ValueError, match="not the model's tokenizer"):
        approx.save(approx.patch(model, "full"), tmp_path / "n", tokenizer=tokenizer())


# ------------------------------------------------------------------------------------------ 2. the usual ways


def test_save_pretrained_of_a_patched_model_writes_a_complete_folder(tmp_path):
    model, _ = saved_folder(tmp_path / "a")
    model.save_pretrained(tmp_path / "b")
    assert (tmp_path / "b" / SETTINGS_FILE).is_file() and (tmp_path / "b" / STATE_FILE).is_file()
    assert torch.equal(outputs(approx.load(tmp_path / "b").eval()), outputs(model))
    from transformers import AutoModel

    plain = AutoModel.from_pretrained(tmp_path / "b")  # still a plain checkpoint
    assert not approx.is_patched(plain)
    approx.unpatch(model)
    assert "save_pretrained" not in vars(model)


def test_save_pretrained_of_a_task_model_whose_encoder_is_patched_warns(tmp_path):
    """transformers' ``save_pretrained`` of a task model whose encoder was patched writes no approx_config.json (the
    folder loads with exact attention): it says so, naming the patched part and what to do, instead of saving without
    a word. The patched model's own save, the task model patched itself, and a plain state_dict do not warn."""
    import warnings

    from transformers import AutoModelForSequenceClassification

    model = tiny_model("bert", head="sequence-classification")
    approx.patch(model.bert, "favor", features=8)
    with pytest.warns(UserWarning, match=r"BertForSequenceClassification\.save_pretrained .* 'bert' is patched "
                      r"\(favor\).*approx\.save\(model\.bert, folder\)") as record:  # fmt: skip
        model.save_pretrained(tmp_path / "task")
    assert [w.filename for w in record if "approx:" in str(w.message)] == [__file__]  # pointing at the caller
    assert not (tmp_path / "task" / SETTINGS_FILE).exists()  # (what the warning is about)
    assert not approx.is_patched(AutoModelForSequenceClassification.from_pretrained(tmp_path / "task"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.state_dict()  # not a save
        approx.save(model.bert, tmp_path / "encoder")  # the patched model's own save: a complete folder
        approx.unpatch(model.bert)
        model.save_pretrained(tmp_path / "plain")  # unpatched: nothing to say
        approx.patch(model, "favor", features=8)
        model.save_pretrained(tmp_path / "whole")  # the task model patched: a complete folder
    assert (tmp_path / "encoder" / SETTINGS_FILE).is_file() and (tmp_path / "whole" / SETTINGS_FILE).is_file()


def test_a_trainer_saving_a_compiled_task_model_around_a_patched_encoder_warns(tmp_path):
    """A Trainer takes a compiled model's state dict in its own ``_save``, then hands it to ``save_pretrained``, so
    the hook saw no save (a reviewer's case); it now reads the Trainer's model. The patched model itself compiled
    saves a complete folder, and says nothing."""
    import warnings

    import transformers

    args = transformers.TrainingArguments(output_dir=str(tmp_path / "args"), report_to=[], use_cpu=True)
    model = tiny_model("bert", head="sequence-classification")
    approx.patch(model.bert, "favor", features=8)
    trainer = transformers.Trainer(model=torch.compile(model), args=args)
    with pytest.warns(UserWarning, match=r"'bert' is patched \(favor\).*approx\.save\(model\.bert, folder\)"):
        trainer.save_model(str(tmp_path / "task"))
    assert not (tmp_path / "task" / SETTINGS_FILE).exists()
    whole = approx.patch(tiny_model("bert", head="sequence-classification"), "favor", features=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        transformers.Trainer(model=torch.compile(whole), args=args).save_model(str(tmp_path / "whole"))
    assert (tmp_path / "whole" / SETTINGS_FILE).is_file()


def test_a_model_built_from_a_patched_models_config_leaves_the_patched_model_as_it_is():
    """``from_config(patched.config)`` shares the config object (transformers 5): patching and unpatching the twin
    must leave the patched model's implementation, and its outputs, as they were (a fallback to sdpa there once
    turned the patched model into exact attention in silence)."""
    from transformers import AutoModel

    model = tiny_model("bert").eval()
    approx.patch(model, "favor", features=8)
    inputs = batch(12)
    before = model(**inputs).last_hidden_state
    twin = AutoModel.from_config(model.config)
    approx.unpatch(approx.patch(twin, "efficient"))
    assert model.config._attn_implementation == "approx" and approx.is_patched(model)
    assert torch.equal(model(**inputs).last_hidden_state, before)


def test_models_made_from_one_config_are_patched_one_at_a_time():
    """transformers makes models from a config without copying it: two models of one config object (BertModel(config)
    twice, AutoModel.from_config(model.config)) shared their attention implementation, so patching one routed the
    other through approx (an eager model's outputs moved by 2e-7), and that one, patched in turn, recorded approx as
    its own implementation, which its unpatch then kept. A patched model now runs on its own copy of the config."""
    from transformers import AutoModel, PretrainedConfig

    model = tiny_model("bert").eval()
    model.set_attn_implementation("eager")
    inputs = batch(24, pad=5)
    before = model(**inputs).last_hidden_state
    shared = model.config
    twin = AutoModel.from_config(model.config).eval()
    assert twin.config is shared
    approx.patch(twin, "favor", features=8)
    assert model.config is shared and shared._attn_implementation == "eager" and not approx.is_patched(model)
    assert torch.equal(model(**inputs).last_hidden_state, before)
    configs = [m.config for m in twin.modules() if isinstance(getattr(m, "config", None), PretrainedConfig)]
    assert len(configs) > 1 and all(c is twin.config for c in configs)  # every module on the copy
    approx.patch(model, "clustered", clusters=8)
    approx.unpatch(model)
    assert model.config is shared and shared._attn_implementation == "eager"
    assert torch.equal(model(**inputs).last_hidden_state, before)
    approx.unpatch(twin)
    assert twin.config is shared
    # what was set on the copy while patched is carried back (here by approx.extend_positions), but the implementation
    approx.patch(model, "favor", features=8)
    approx.extend_positions(model, 2 * model.config.max_position_embeddings)
    longer = model.config.max_position_embeddings
    approx.unpatch(model)
    assert model.config is shared and shared.max_position_embeddings == longer
    assert shared._attn_implementation == "eager" and model.embeddings.position_embeddings.num_embeddings >= longer
    # ...and only what changed there: a change made meanwhile on the shared object itself, by a model sharing it, stays
    approx.patch(model, "favor", features=8)
    twin = AutoModel.from_config(shared)
    approx.extend_positions(twin, 2 * longer)
    approx.unpatch(model)
    assert shared.max_position_embeddings == 2 * longer == twin.embeddings.position_embeddings.num_embeddings


def test_the_encoder_of_a_composite_model_runs_patched(tmp_path):
    """A composite model (here EncoderDecoderModel) sets its own sub-config as its encoder's ``config`` after the
    encoder was built, and the encoder's modules keep the config they were built with, which their attention reads:
    ``approx.patch(ed.encoder, ...)`` set approx's implementation on the first only, and the encoder ran exact
    attention while it read, saved and evaluated as patched (a reviewer's finding). Its outputs are now a standalone
    patched encoder's of the same weights, and unpatch gives back the exact model and the configs its modules held."""
    from transformers import AutoModel, EncoderDecoderModel, PretrainedConfig

    tiny_model("bert").save_pretrained(tmp_path / "bert")
    ed = EncoderDecoderModel.from_encoder_decoder_pretrained(str(tmp_path / "bert"), str(tmp_path / "bert")).eval()
    encoder = ed.encoder
    held = {n: m.config for n, m in encoder.named_modules() if isinstance(getattr(m, "config", None), PretrainedConfig)}
    assert any(c is not encoder.config for c in held.values())  # the case: modules on another config object
    inputs = batch(24, pad=5)
    with torch.no_grad():
        before = encoder(**inputs).last_hidden_state
        alone = approx.patch(AutoModel.from_pretrained(tmp_path / "bert").eval(), "favor", features=8)
        approx.patch(encoder, "favor", features=8)
        out = encoder(**inputs).last_hidden_state
        assert (out - before).abs().max() > 1e-2
        torch.testing.assert_close(out, alone(**inputs).last_hidden_state, rtol=0, atol=1e-6)
        # the configs its modules hold are copies: the composite's own (ed.config.encoder) is left as it was
        assert ed.config.encoder._attn_implementation != "approx"
        # the copy changed behind the patch: the patched layers would not run, which is refused as for model.config
        encoder.encoder.layer[0].attention.self.config._attn_implementation = "sdpa"
        with pytest.raises(ValueError, match="is now 'sdpa'"):
            encoder(**inputs)
        encoder.encoder.layer[0].attention.self.config._attn_implementation = "approx"
        approx.unpatch(encoder)
        assert torch.equal(encoder(**inputs).last_hidden_state, before)
    assert all(m.config is held[n] for n, m in encoder.named_modules() if n in held)
    assert all(c._attn_implementation != "approx" for c in held.values())
    # the composite's set_attn_implementation reaches its sub-config, not the configs the encoder's modules hold: the
    # two disagree, and patching is refused before anything changes (it had swapped in copies, and left them there)
    ed.set_attn_implementation("eager")
    assert encoder.config is ed.config.encoder and encoder.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match=r"runs 'sdpa' attention where model.config says 'eager'.*set_attn_impl"):
        approx.patch(encoder, "favor", features=8)
    assert encoder.config is ed.config.encoder and not approx.is_patched(encoder)
    assert not any(k.startswith("_approx") for k in vars(encoder))
    assert all(m.config is held[n] for n, m in encoder.named_modules() if n in held)
    encoder.set_attn_implementation("sdpa")  # as the error says
    approx.unpatch(approx.patch(encoder, "favor", features=8))
    assert encoder.config is ed.config.encoder


def test_push_to_hub_is_refused_before_anything_is_written(tmp_path):
    """transformers uploads inside save_pretrained, before approx's files exist: an incomplete repository."""
    model = tiny_model("bert")
    approx.patch(model, "favor", features=8)
    for save in (lambda: approx.save(model, tmp_path / "a", push_to_hub=True),
                 lambda: model.save_pretrained(tmp_path / "b", push_to_hub=True)):  # fmt: skip
        with pytest.raises(ValueError, match="upload the folder whole"):
            save()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_state_dict_carries_the_method_state():
    model = approx.patch(tiny_model("bert"), "clustered", clusters=6, seed=1)
    state = model.state_dict()
    key = "encoder.layer.0.attention.self.approx_attention.planes"
    assert torch.equal(state[key], approx.patched_layers(model)[0].state()["planes"])
    other = approx.patch(tiny_model("bert"), "clustered", clusters=6, seed=5)
    other.load_state_dict(state)
    assert torch.equal(outputs(other), outputs(model))
    with pytest.raises(RuntimeError, match="approx_attention"):  # an unpatched model: loudly, not silently
        tiny_model("bert").load_state_dict(state)


@pytest.mark.parametrize("load", ["load_state_dict", "load_method_state"])
def test_state_not_drawn_from_the_recorded_seed_is_said_when_loaded(tmp_path, load):
    """State loaded into a patched model replaces the state its seed option drew, which approx.settings and
    approx.save go on recording: a warning says so (and how to record the right seed when a redraw drew it); state
    drawn from the recorded seed loads silently."""
    source = approx.patch(tiny_model("bert"), "favor", features=8, seed=1)
    approx.redraw(source, seed=7)  # as a RedrawSchedule does during fine-tuning
    approx.save(source, tmp_path / "m")

    def put(model):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if load == "load_state_dict":
                model.load_state_dict(source.state_dict())
            else:
                approx.load_method_state(model, tmp_path / "m")
        return [str(w.message) for w in caught if "state loaded into" in str(w.message)]

    stale = approx.patch(tiny_model("bert"), "favor", features=8, seed=1)
    said = put(stale)
    assert said and all("not drawn from its seed option (1)" in m and "approx.redraw(model, seed=S)" in m for m in said)
    assert torch.equal(outputs(stale), outputs(source))  # the state is loaded all the same
    approx.redraw(stale, seed=7)  # what the warning advises: the seed recorded, the same state
    assert torch.equal(outputs(stale), outputs(source)) and approx.settings(stale)[0]["config"]["seed"] == 7
    assert put(approx.patch(tiny_model("bert"), "favor", features=8, seed=7)) == []


def test_state_drawn_from_the_recorded_seed_elsewhere_loads_without_a_warning():
    """FAVOR+'s orthogonal features come from a QR factorisation, whose last bits differ between BLAS builds, CPUs
    and thread counts: the same seed's state drawn on another machine is the recorded seed's, and loads silently."""
    source = approx.patch(tiny_model("bert"), "favor", features=8, seed=3)
    state = {k: torch.nextafter(v, v + 1) if v.is_floating_point() and "approx" in k else v
             for k, v in source.state_dict().items()}  # fmt: skip
    assert any(not torch.equal(state[k], v) for k, v in source.state_dict().items())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        approx.patch(tiny_model("bert"), "favor", features=8, seed=3).load_state_dict(state)


def test_state_dict_carries_fitted_sparsefinder_state():
    model = approx.patch(tiny_model("bert"), "sparsefinder", window=64)
    approx.fit(model, [batch(40, seed=s) for s in range(2)], progress=False, steps=5)
    other = approx.patch(tiny_model("bert"), "sparsefinder", window=64)  # unfitted: empty placeholders
    other.load_state_dict(model.state_dict())
    assert torch.equal(outputs(other), outputs(model))


def test_torch_save_loads_in_a_fresh_process(tmp_path):
    model, _ = saved_folder(tmp_path / "m")
    torch.save(model, tmp_path / "model.pt")
    torch.save(outputs(model), tmp_path / "ref.pt")
    torch.save(INPUTS, tmp_path / "inputs.pt")
    script = f"""
import torch
model = torch.load({str(tmp_path / "model.pt")!r}, weights_only=False)
inputs = torch.load({str(tmp_path / "inputs.pt")!r})
import approx
assert approx.is_patched(model)
with torch.no_grad():
    out = model(**inputs).last_hidden_state
assert torch.equal(out, torch.load({str(tmp_path / "ref.pt")!r})), "outputs differ"
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]


# ------------------------------------------------------------------------------------------ 3. attentions


def test_output_attentions_returns_each_layers_weights():
    model = tiny_model("bert")
    with torch.no_grad():
        eager = tiny_model("bert")
        eager.set_attn_implementation("eager")
        ref = eager(**INPUTS, output_attentions=True).attentions
        approx.patch(model, "full", layers=[0])  # layer 1 stays exact
        got = model(**INPUTS, output_attentions=True).attentions
        assert len(got) == 2
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a[:, :, :35], b[:, :, :35], rtol=1e-5, atol=1e-6)
        approx.patch(model, "clustered", layers=[1], clusters=6)
        got = model(**INPUTS, output_attentions=True).attentions
        layer = approx.patched_layers(model)[1]
        assert got[1].shape == (2, 4, 48, 48) and torch.isfinite(got[1]).all()
        assert not torch.allclose(got[1], ref[1])
        assert layer.method.name == "clustered"
        assert model(**INPUTS).attentions is None  # only when asked for


# ------------------------------------------------------------------------------------------ 6. redraw


def test_redraw_takes_the_index_rules_of_patch():
    model = approx.patch(tiny_model("bert"), "favor", seed=0)
    before = {i: lyr.state()["omega"].clone() for i, lyr in approx.patched_layers(model).items()}
    approx.redraw(model, seed=3, layers=[-1])
    after = {i: lyr.state()["omega"] for i, lyr in approx.patched_layers(model).items()}
    assert torch.equal(after[0], before[0]) and not torch.equal(after[1], before[1])
    with pytest.raises(ValueError, match="layer 2 does not exist"):
        approx.redraw(model, layers=[2])
    with pytest.raises(ValueError, match="layers must be"):
        approx.redraw(model, layers=[0.0])
    approx.patch(model, "full", layers=[0])
    half = approx.patch(tiny_model("bert"), "favor", layers=[1])
    with pytest.raises(ValueError, match=r"layers \[0\] are not patched"):
        approx.redraw(half, layers=[0])


def test_redraw_records_its_seed_as_the_one_patch_would_draw_from(tmp_path):
    """After redraw(seed=5) the settings say seed 5, and patching afresh with seed 5 draws the same state; a layer
    not redrawn keeps its seed, and a saved model loads back with what it runs."""
    model = approx.patch(tiny_model("bert"), "favor", seed=0)
    approx.redraw(model, seed=5, layers=[1])
    assert [e["config"]["seed"] for e in approx.settings(model)] == [0, 5]
    fresh = approx.patch(tiny_model("bert"), "favor", seed=5)
    assert torch.equal(
        approx.patched_layers(model)[1].state()["omega"], approx.patched_layers(fresh)[1].state()["omega"]
    )
    approx.save(model, tmp_path / "m")
    assert approx.settings(approx.load(tmp_path / "m")) == approx.settings(model)
    before = {i: lyr.state()["omega"].clone() for i, lyr in approx.patched_layers(model).items()}
    with pytest.raises(ValueError, match="seed"):  # refused before any layer's state is drawn
        approx.redraw(model, seed=-1)
    assert all(torch.equal(lyr.state()["omega"], before[i]) for i, lyr in approx.patched_layers(model).items())
    assert [e["config"]["seed"] for e in approx.settings(model)] == [0, 5]


def test_redraw_schedule_refuses_an_unpatched_model_when_built():
    with pytest.raises(ValueError, match="not patched"):
        approx.RedrawSchedule(tiny_model("bert"), every=1)


# ------------------------------------------------------------------------------------------ 7. unpatch after load


def test_unpatch_after_load_gives_back_the_loaded_implementation(tmp_path):
    from transformers import AutoModel

    _, folder = saved_folder(tmp_path / "m")  # saved from an sdpa model
    plain = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    ref = outputs(plain)
    loaded = approx.load(folder, attn_implementation="eager").eval()
    approx.unpatch(loaded)
    assert loaded.config._attn_implementation == "eager"
    assert torch.equal(outputs(loaded), ref)


def test_load_reads_a_model_saved_from_eager_attention_as_it_ran(tmp_path):
    """A model loaded with eager attention, patched on layer 0 and saved: approx.load reads it with eager attention
    (transformers would pick sdpa), so the unpatched layer computes as it did and the outputs are the saved model's to
    the bit; unpatch gives eager back. A given attn_implementation still wins."""
    from transformers import AutoModel

    tiny_model("bert").save_pretrained(tmp_path / "plain")
    model = AutoModel.from_pretrained(tmp_path / "plain", attn_implementation="eager").eval()
    approx.patch(model, "clustered", layers=[0], clusters=6, seed=2)
    approx.save(model, tmp_path / "m", tokenizer=tokenizer())
    loaded = approx.load(tmp_path / "m").eval()
    assert torch.equal(outputs(loaded), outputs(model))
    assert approx.unpatch(loaded).config._attn_implementation == "eager"
    assert approx.unpatch(approx.load(tmp_path / "m", attn_implementation="sdpa")).config._attn_implementation == "sdpa"


# ------------------------------------------------------------------------------------------ 8. clean errors


def _edit_settings(folder: Path, edit, *, digest: bool = True) -> None:
    """Edit the settings; with ``digest``, record the edited layers' SHA-256 too (as approx.save would have), so that
    what the edit breaks is refused by the check it is for and not by the digest's."""
    file = folder / SETTINGS_FILE
    meta = json.loads(file.read_text())
    edit(meta)
    if digest and isinstance(meta.get("layers"), list) and "layers_sha256" in meta:
        meta["layers_sha256"] = layers_digest(meta["layers"])
    file.write_text(json.dumps(meta))


CORRUPTIONS = {
    "invalid JSON": lambda f: (f / SETTINGS_FILE).write_text('{"format": 1, "layers": ['),
    "missing layers": lambda f: _edit_settings(f, lambda m: m.pop("layers")),
    "unknown method": lambda f: _edit_settings(f, lambda m: m["layers"][0].update(method="clusterd")),
    "bad option": lambda f: _edit_settings(f, lambda m: m["layers"][0]["config"].update(clusters=0)),
    "unknown option": lambda f: _edit_settings(f, lambda m: m["layers"][0]["config"].update(bogus=1)),
    "layer out of range": lambda f: _edit_settings(f, lambda m: m["layers"].append({**m["layers"][0], "layer": 7})),
    "layer not an integer": lambda f: _edit_settings(f, lambda m: m["layers"][0].update(layer="0")),
    "missing state": lambda f: (f / STATE_FILE).unlink(),
    "truncated state": lambda f: (f / STATE_FILE).write_bytes((f / STATE_FILE).read_bytes()[:100]),
    "wrong-shape state": lambda f: _write_state(f, lambda s: {**s, "layer.0.planes": s["layer.0.planes"][:3]}),
    "NaN state": lambda f: _write_state(f, lambda s: {**s, "layer.0.offsets": s["layer.0.offsets"] * float("nan")}),
    "state of another layer": lambda f: _write_state(f, lambda s: {**s, "layer.1.planes": s["layer.0.planes"].clone()}),
    # valid settings, edited by hand after saving: the seed that drew the saved state, the budget
    "edited seed": lambda f: _edit_settings(f, lambda m: m["layers"][0]["config"].update(seed=5), digest=False),
    "edited budget": lambda f: _edit_settings(f, lambda m: m["layers"][0]["config"].update(clusters=5), digest=False),
    "state checksum removed": lambda f: _edit_settings(f, lambda m: m.pop("state_sha256")),
    "saved from a deeper model": lambda f: _edit_settings(f, lambda m: m.update(attention_layers=4)),
    "attention layers not an integer": lambda f: _edit_settings(f, lambda m: m.update(attention_layers="2")),
    "model type not a string": lambda f: _edit_settings(f, lambda m: m.update(model_type=["bert"])),
}


def _write_state(folder: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    save_file(edit(load_file(str(folder / STATE_FILE))), str(folder / STATE_FILE))


def assert_untouched(model, ref, was_patched, settings):
    assert approx.is_patched(model) == was_patched
    assert approx.settings(model) == settings
    assert torch.equal(outputs(model), ref)


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
@pytest.mark.parametrize("start", ["plain", "patched"])
def test_corrupted_folder_leaves_the_model_as_it_was(tmp_path, corruption, start):
    _, folder = saved_folder(tmp_path / "m")
    CORRUPTIONS[corruption](folder)
    model = tiny_model("bert", seed=4)
    if start == "patched":
        approx.patch(model, "i-clustered", layers=[1], clusters=6, topk=4)
    ref, was, settings = outputs(model), approx.is_patched(model), approx.settings(model)
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        approx.restore(model, folder)
    assert str(folder) in str(e.value)
    assert_untouched(model, ref, was, settings)
    with pytest.raises((ValueError, FileNotFoundError), match=str(folder)):
        approx.load(folder)


def test_settings_edited_after_saving_are_refused_and_formatting_is_not(tmp_path):
    """The layers' SHA-256 is in the settings: an edited setting is refused, saying how to change settings; the same
    settings written again in another layout (indentation, key order) load to the saved model. A folder saved before
    the digests existed (no ``layers_sha256``, with or without ``state_sha256``) loads as it is."""
    model, folder = saved_folder(tmp_path / "m")
    _edit_settings(folder, lambda m: m["layers"][0]["config"].update(clusters=5), digest=False)
    with pytest.raises(ValueError, match="changed after it was saved.*; undo the edit, or .* save it again"):
        approx.load(folder)
    model, folder = saved_folder(tmp_path / "n")
    meta = json.loads((folder / SETTINGS_FILE).read_text())
    (folder / SETTINGS_FILE).write_text(json.dumps(dict(reversed(list(meta.items()))), indent=7, sort_keys=True))
    assert torch.equal(outputs(approx.load(folder)), outputs(model))
    _edit_settings(folder, lambda m: m.pop("layers_sha256"))
    assert torch.equal(outputs(approx.load(folder)), outputs(model))
    _edit_settings(folder, lambda m: m.pop("state_sha256"))  # saved before either digest: as it is
    assert torch.equal(outputs(approx.load(folder)), outputs(model))


def test_restore_refuses_a_patched_model_and_leaves_it_as_it_was(tmp_path):
    """The saved model patches layer 0 only; restored onto a model patched on layer 1, layer 1 would keep its method
    and the result would not be the saved model: refused, naming the folder and the layers, nothing changed. Once
    unpatched, the restore gives the saved model's outputs."""
    saved_model, folder = saved_folder(tmp_path / "m")
    model = tiny_model("bert")
    approx.patch(model, "window", layers=[1], window=2)
    ref, settings = outputs(model), approx.settings(model)
    with pytest.raises(ValueError, match=r"already patched \(layers 1 window\)") as e:
        approx.restore(model, folder)
    assert str(folder) in str(e.value) and "approx.unpatch" in str(e.value)
    assert_untouched(model, ref, True, settings)
    approx.restore(approx.unpatch(model), folder)
    assert torch.equal(outputs(model), outputs(saved_model))


def test_restore_onto_a_model_of_another_depth_is_refused_and_of_another_type_warned(tmp_path):
    """A folder's layer indices count in the model it was saved from: restored onto a 4-layer BERT, a 2-layer BERT's
    folder patched layers 0 and 1 of 4 and said nothing (a reviewer's finding); it is refused, naming both depths,
    the model left as it was. Onto a RoBERTa of the same depth and shapes, it is patched, with a warning. A folder
    saved before the model was recorded restores as before."""
    saved_model, folder = saved_folder(tmp_path / "m")
    meta = json.loads((folder / SETTINGS_FILE).read_text())
    assert (meta["model_type"], meta["attention_layers"]) == ("bert", 2)
    deeper = tiny_model("bert", num_hidden_layers=4)
    ref = outputs(deeper)
    with pytest.raises(ValueError, match="saved from a model of 2 attention layers.*BertModel has 4") as e:
        approx.restore(deeper, folder)
    assert str(folder) in str(e.value)
    assert_untouched(deeper, ref, False, [])
    with pytest.raises(ValueError, match="of 2 attention layers"):
        approx.integration.saved_layers(deeper, folder)
    with pytest.warns(UserWarning, match="saved from a 'bert' model and RobertaModel is 'roberta'"):
        approx.restore(tiny_model("roberta"), folder)
    _edit_settings(folder, lambda m: [m.pop("attention_layers"), m.pop("model_type")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [s["layer"] for s in approx.settings(approx.restore(deeper, folder))] == [0]


def test_load_checks_the_folder_before_reading_weights(tmp_path):
    """A missing folder, a file and a plain Hugging Face checkpoint are named as such at once (never a hub lookup
    for a name that is not a folder)."""
    with pytest.raises(FileNotFoundError, match="no such folder"):
        approx.load(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no such folder"):
        approx.load("a_relative_name_that_does_not_exist")
    (tmp_path / "file").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no such folder"):
        approx.load(tmp_path / "file")
    tiny_model("bert").save_pretrained(tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match="not written by approx.save"):
        approx.load(tmp_path / "plain")


@pytest.mark.parametrize("layers", [0.0, "0", [0.5], True])
def test_layers_of_the_wrong_type_name_the_option(layers):
    model = tiny_model("bert")
    with pytest.raises(ValueError, match="layers must be"):
        approx.patch(model, "clustered", layers=layers)
    assert not approx.is_patched(model)


# ------------------------------------------------------------------------------------------ 9. random corruptions

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies


@hypothesis.settings(max_examples=40, deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(
    which=st.sampled_from([SETTINGS_FILE, STATE_FILE]),
    edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), max_size=4),
    cut=st.one_of(st.none(), st.floats(0, 1, exclude_max=True)),
)
def test_randomly_corrupted_folders_load_exactly_or_fail_cleanly(tmp_path_factory, which, edits, cut):
    """Random byte edits and truncations of a valid saved folder: it loads to the saved model (same settings,
    state and outputs) or raises ValueError/FileNotFoundError naming the file, leaving the model as it was."""
    folder = _SAVED["folder"]
    work = tmp_path_factory.mktemp("corrupt")
    for name in (SETTINGS_FILE, STATE_FILE):
        (work / name).write_bytes((folder / name).read_bytes())
    data = bytearray((work / which).read_bytes())
    for where, byte in edits:
        data[int(where * len(data))] = byte
    if cut is not None:
        data = data[: int(cut * len(data))]
    (work / which).write_bytes(bytes(data))
    model = _SAVED["fresh"]
    try:
        approx.restore(model, work)
    except (ValueError, FileNotFoundError) as e:
        assert str(work) in str(e)
        assert_untouched(model, _SAVED["fresh_out"], False, [])
        return
    try:  # loaded: the folder says what it loads; where it says what was saved, it is the saved model
        layers = json.loads((work / SETTINGS_FILE).read_text())["layers"]
        assert approx.settings(model) == sorted(layers, key=lambda e: e["layer"])
        if approx.settings(model) == approx.settings(_SAVED["model"]):
            for i, lyr in approx.patched_layers(model).items():
                for name, t in lyr.state().items():
                    assert torch.equal(t, approx.patched_layers(_SAVED["model"])[i].state()[name]), name
            assert torch.equal(outputs(model), _SAVED["out"])
    finally:
        approx.unpatch(model)


_SAVED: dict = {}


@pytest.fixture(autouse=True, scope="module")
def _saved_for_hypothesis(tmp_path_factory):
    model, folder = saved_folder(tmp_path_factory.mktemp("valid") / "m")
    fresh = tiny_model("bert")
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if "approx_attention" not in k})
    _SAVED.update(model=model, folder=folder, out=outputs(model), fresh=fresh, fresh_out=outputs(fresh))


def test_save_removes_the_fit_and_tuning_records_of_what_was_saved_there_before(tmp_path):
    """approx_fit.json and approx_autotune.json describe the method state saved with them: saving another state or
    other settings over the folder removes them (a fit record left behind said the new model had been fitted on the
    old one's model); saving the same again keeps them."""
    from approx.saved import TOOL_RECORDS

    folder = approx.save(approx.patch(tiny_model("bert"), "favor", features=8), tmp_path / "m")
    for record in TOOL_RECORDS:
        (folder / record).write_text("{}")
    approx.save(approx.load(folder), folder)  # the same state and settings again: the records still describe them
    assert all((folder / record).exists() for record in TOOL_RECORDS)
    approx.save(approx.patch(tiny_model("bert"), "lsh", cluster_size=8), folder)
    assert not any((folder / record).exists() for record in TOOL_RECORDS) and approx.settings(approx.load(folder))


def test_a_refused_state_file_leaves_every_layer_as_it_was(tmp_path):
    """``read_state`` loads all or nothing: a file whose second layer's state has another shape is refused, naming
    that layer, and the first layer (loaded before the refusal) is put back (no test had caught its rollback
    removed)."""
    from safetensors.torch import load_file, save_file

    from approx.saved import read_state

    approx.save(approx.patch(tiny_model("bert"), "favor", features=8, seed=1), tmp_path / "m")
    file = tmp_path / "m" / STATE_FILE
    state = load_file(str(file))
    second = next(key for key in sorted(state) if key.startswith("layer.1."))
    state[second] = state[second][:-1]
    save_file(state, str(file))
    target = approx.patch(tiny_model("bert"), "favor", features=8, seed=2)
    layers = approx.patched_layers(target)
    before = {i: {name: t.clone() for name, t in layer.state().items()} for i, layer in layers.items()}
    assert not torch.equal(before[0]["omega"], state["layer.0.omega"])  # a load of layer 0 would show
    with pytest.raises(ValueError, match="layer 1"):
        read_state(layers, tmp_path / "m")
    for i, layer in layers.items():
        assert all(torch.equal(t, before[i][name]) for name, t in layer.state().items())


def test_saving_a_stateless_model_over_a_folder_with_state_leaves_a_loadable_folder(tmp_path):
    """A folder saved from FAVOR+ (random features: a state file), then saved again from a window model (no state):
    the old state file goes, and the folder loads as the window model (a kept file had made the load fail: "holds
    state of layers 0, which are not patched")."""
    folder = tmp_path / "m"
    approx.save(approx.patch(tiny_model("bert"), "favor", features=8), folder)
    assert (folder / STATE_FILE).is_file()
    window = approx.patch(tiny_model("bert"), "window", window=2, block=4)
    approx.save(window, folder)
    assert not (folder / STATE_FILE).exists()
    loaded = approx.load(folder)
    assert [s["method"] for s in approx.settings(loaded)] == ["window", "window"]
    assert torch.equal(outputs(loaded), outputs(window))


def test_a_config_pickled_before_an_option_existed_means_what_it_meant():
    """Unpickling a config whose state predates ``refine`` (added with a default that changes the method) gives its
    ``absent`` value, 0, not today's default (ignoring ``absent`` there had survived the tests)."""
    import pickle

    from approx.attention.clustered import ClusteredConfig

    config = ClusteredConfig(clusters=6)
    old = pickle.loads(pickle.dumps(config))
    state = dict(old.__dict__)
    del state["refine"]
    fresh = ClusteredConfig.__new__(ClusteredConfig)
    fresh.__setstate__(state)
    assert fresh.refine == 0 and ClusteredConfig().refine == 1


# corruptions that a folder's digests would catch first (an edited state file's SHA-256 differs; an edited layer
# list's too): in a folder saved before the digests existed, each must still be caught by its own check
OLD_FOLDER_CORRUPTIONS = {
    "NaN state": (CORRUPTIONS["NaN state"], "layer.0.offsets holds values that are not finite"),
    "infinite state": (
        lambda f: _write_state(f, lambda s: {**s, "layer.0.planes": s["layer.0.planes"].fill_(float("inf"))}),
        "layer.0.planes holds values that are not finite",
    ),
    "a layer given twice": (
        lambda f: _edit_settings(f, lambda m: m["layers"].append(dict(m["layers"][0]))),
        "layer 0 is given twice",
    ),
    "state of another layer": (CORRUPTIONS["state of another layer"], "holds state of layers 1, which are not patched"),
}


@pytest.mark.parametrize("corruption", sorted(OLD_FOLDER_CORRUPTIONS))
def test_a_folder_saved_before_the_digests_is_still_checked(tmp_path, corruption):
    """Folders saved before 2026-11-29 have neither ``layers_sha256`` nor ``state_sha256`` and load as they are; NaN
    state or a layer listed twice is then caught by its own check, with its own message (with the digests in place the
    digest check refused these first, so the tests above never reached the checks)."""
    model, folder = saved_folder(tmp_path / "m")
    _edit_settings(folder, lambda m: (m.pop("layers_sha256"), m.pop("state_sha256")))
    assert torch.equal(outputs(approx.load(folder)), outputs(model))  # as saved: loads
    corrupt, words = OLD_FOLDER_CORRUPTIONS[corruption]
    corrupt(folder)
    fresh = tiny_model("bert", seed=4)
    ref = outputs(fresh)
    with pytest.raises(ValueError, match=re.escape(words)) as e:
        approx.restore(fresh, folder)
    assert str(folder) in str(e.value)
    assert_untouched(fresh, ref, False, [])


@pytest.mark.parametrize(
    ("tokens", "embeddings", "refused"),
    [
        (99, 99, False),  # the model's own
        (90, 100, False),  # embeddings padded by a few rows: 90 % covered
        (89, 100, True),  # under 90 %: another (smaller) vocabulary
        (100, 99, True),  # ids beyond the embeddings
        (0, 99, True),
    ],
)
def test_a_tokenizer_must_cover_at_least_nine_tenths_of_the_embeddings_and_no_more_than_all(
    tokens, embeddings, refused
):
    """The documented rule of ``check_vocabulary`` at its edges (the threshold had survived mutation: the tests used a
    vocabulary four times the tokenizer's)."""
    from approx.saved import check_vocabulary

    if refused:
        with pytest.raises(ValueError, match=f"has {tokens} tokens but the model has {embeddings} token embeddings"):
            check_vocabulary("m", tokens, embeddings)
    else:
        check_vocabulary("m", tokens, embeddings)


def test_fitted_state_of_other_options_is_refused_where_it_is_loaded(tmp_path):
    """An unfitted layer's placeholders know every dimension of its fitted state but the heads: Linformer's
    projections fitted for 16 projections, loaded into a layer of 8, are refused (they were taken, and the layer then
    computed with 16 while its settings said 8), through load_state_dict and through approx.load_method_state."""
    data = [batch(24, pad=3)]
    fitted = approx.patch(tiny_model("bert"), "linformer", mode="fitted", projections=16, length=64)
    approx.fit(fitted, data, progress=False, steps=3)
    other = approx.patch(tiny_model("bert"), "linformer", mode="fitted", projections=8, length=64)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"expected shape \(heads, 8(, 64)?\) for these options"):
        other.load_state_dict(fitted.state_dict())
    save_method_state(fitted, tmp_path)
    with pytest.raises(ValueError, match=r"expected shape \(heads, 8(, 64)?\) for these options"):
        approx.load_method_state(other, tmp_path)
    for k, v in other.state_dict().items():
        assert torch.equal(v, before[k])
    same = approx.patch(tiny_model("bert"), "linformer", mode="fitted", projections=16, length=64)
    same.load_state_dict(fitted.state_dict())  # the same options: taken
    torch.testing.assert_close(model_output(same, **data[0]), model_output(fitted, **data[0]), rtol=0, atol=0)


def test_a_layer_made_under_inference_mode_still_trains():
    """State drawn under torch.inference_mode (autotune measures its candidates there, and keeps the chosen ones)
    is made of ordinary tensors: training the patched model afterwards works (Linformer's random projections, saved
    for backward, failed with 'Inference tensors cannot be saved for backward')."""
    model = tiny_model("bert")
    with torch.inference_mode():
        approx.patch(model, "linformer", mode="random", projections=4, length=32)
        approx.redraw(model, seed=3)
        moved = approx.ApproxAttention("linformer", approx.patched_layers(model)[0].config, head_dim=8).to("meta")
    assert not any(t.is_inference() for lyr in approx.patched_layers(model).values() for t in lyr.state().values())
    assert not any(t.is_inference() for t in moved.state().values())  # moved there too (onto a GPU, say)
    model.train()
    model_output(model, **batch(24, pad=3)).sum().backward()
    tuned = tiny_model("bert")
    data = [torch.randint(5, 99, (30,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(8)]
    approx.autotune(tuned, data, budget=0.5, methods=["linformer:mode=random,projections=4,length=32"], batch_size=4,
                    progress=False, uniform=False)  # fmt: skip
    assert approx.is_patched(tuned)
    tuned.train()
    model_output(tuned, **batch(24, pad=3)).sum().backward()


def test_a_checkpoint_saved_over_an_approx_folder_is_refused_by_load(tmp_path):
    """A plain ``save_pretrained`` of another model into a folder approx.save wrote leaves its ``approx_config.json``
    behind: ``approx.load`` refuses the folder (the checkpoint's SHA-256, config and weights, differs from the one
    saved), saying how to read the model, rather than patching it with settings saved for another. So does a config
    edited afterwards (another activation, say, over the same weights). The plain model still loads without approx,
    and ``approx.restore`` still patches a model the caller loaded."""
    from transformers import AutoModel

    patched, folder = saved_folder(tmp_path / "m")
    assert torch.equal(outputs(approx.load(folder)), outputs(patched))
    other = tiny_model("bert", seed=7)
    other.save_pretrained(folder)
    with pytest.raises(
        ValueError, match=r"checkpoint .* is not the one approx.save wrote.*AutoModel.from_pretrained"
    ) as e:
        approx.load(folder)
    assert str(folder) in str(e.value) and "checkpoint_sha256" in str(e.value)
    plain = AutoModel.from_pretrained(folder)
    assert torch.equal(outputs(plain), outputs(other))
    approx.restore(plain, folder)
    assert approx.settings(plain) == approx.settings(patched)
    patched, folder = saved_folder(tmp_path / "n")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_act": "relu"}))
    with pytest.raises(ValueError, match="is not the one approx.save wrote"):
        approx.load(folder)


def test_the_checkpoint_digest_covers_every_shard(tmp_path):
    """A checkpoint saved in shards loads as saved; one shard changed afterwards is refused. A folder saved before
    the digest existed (no ``checkpoint_sha256``) loads as it is."""
    from safetensors.torch import load_file, save_file

    model = approx.patch(tiny_model("bert"), "clustered", layers=[0], clusters=6, seed=2)
    approx.save(model, tmp_path / "m", max_shard_size="20KB")
    shards = sorted((tmp_path / "m").glob("model-*.safetensors"))
    assert len(shards) > 2
    assert torch.equal(outputs(approx.load(tmp_path / "m")), outputs(model))
    weights = load_file(str(shards[1]))
    name = next(iter(weights))
    save_file({**weights, name: weights[name] + 1e-3}, str(shards[1]), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="is not the one approx.save wrote"):
        approx.load(tmp_path / "m")
    _edit_settings(tmp_path / "m", lambda m: m.pop("checkpoint_sha256"))
    assert approx.settings(approx.load(tmp_path / "m")) == approx.settings(model)


def test_save_method_state_refuses_a_folder_that_approx_save_wrote(tmp_path):
    """The settings of an approx folder record the SHA-256 of its state file: writing (or, for a model without state,
    removing) that file behind them would make the folder fail to load, so it is refused and the file kept."""
    model, folder = saved_folder(tmp_path / "m")
    before = (folder / STATE_FILE).read_bytes()
    for other in (approx.patch(tiny_model("bert"), "window", window=2), approx.patch(tiny_model("bert"), "favor")):
        with pytest.raises(ValueError, match=r"written by approx.save.*approx.save\(model, folder\)"):
            save_method_state(other, folder)
    assert (folder / STATE_FILE).read_bytes() == before
    assert torch.equal(outputs(approx.load(folder)), outputs(model))


def test_weight_files_an_earlier_save_left_are_removed(tmp_path, monkeypatch):
    """transformers removes an earlier save's shards only: a ``model.safetensors`` left beside new shards was read by
    ``from_pretrained`` first (the earlier model's weights under the new settings), and the digest approved it.
    ``approx.save`` removes, once the save has succeeded, the weight files it did not write, naming them: a single
    file beside new shards, an index and shards beside a new single file, another variant's files. Saving the same
    way again removes nothing; files that are not transformers' weight files (a user's ``model.bin``) stay. A save that
    fails removes nothing, and the folder it leaves is refused by approx.load."""
    first = approx.patch(tiny_model("bert", seed=0), "lsh", cluster_size=4, seed=1)
    second = approx.patch(tiny_model("bert", seed=1), "lsh", cluster_size=4, seed=2)
    folder = tmp_path / "m"
    # an older checkpoint's pytorch_model.bin, which transformers still reads (use_safetensors=False): removed too
    folder.mkdir()
    torch.save(tiny_model("bert", seed=7).state_dict(), folder / "pytorch_model.bin")
    with pytest.warns(UserWarning, match=r"removed pytorch_model\.bin"):
        approx.save(first, folder)
    assert not (folder / "pytorch_model.bin").exists() and torch.equal(outputs(approx.load(folder)), outputs(first))
    (folder / "model.bin").write_bytes(b"a user's file")
    with pytest.warns(UserWarning, match=r"removed model\.safetensors from .*this save did not write") as caught:
        approx.save(second, folder, max_shard_size="20KB")
    assert caught[0].filename == __file__  # (the warning points at the caller)
    assert not (folder / "model.safetensors").exists() and (folder / "model.safetensors.index.json").exists()
    assert (folder / "model.bin").read_bytes() == b"a user's file"
    assert torch.equal(outputs(approx.load(folder)), outputs(second))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        approx.save(second, folder, max_shard_size="20KB")  # the same files written again: nothing removed
    assert torch.equal(outputs(approx.load(folder)), outputs(second))
    with pytest.warns(UserWarning, match=r"removed model\.safetensors\.index\.json from"):  # (transformers: the shards)
        second.save_pretrained(folder)  # (a patched model's save_pretrained is approx.save) one file again
    assert sorted(f.name for f in folder.glob("model*")) == ["model.bin", "model.safetensors"]
    other = tmp_path / "v"
    approx.save(first, other, variant="fp16", max_shard_size="20KB")
    assert (other / "model.safetensors.index.fp16.json").exists()
    with pytest.warns(UserWarning, match=r"removed model\.safetensors\.index\.fp16\.json from"):
        approx.save(second, other)
    assert sorted(f.name for f in other.glob("model*")) == ["model.safetensors"]
    assert torch.equal(outputs(approx.load(other)), outputs(second))
    with pytest.warns(UserWarning, match=r"removed model\.safetensors from"):  # a variant of any name counts
        approx.save(first, other, variant="fp16+x")
    assert torch.equal(outputs(approx.load(other, variant="fp16+x")), outputs(first))
    before = {f.name: f.read_bytes() for f in folder.iterdir()}

    def failing(model, path, **kwargs):
        (Path(path) / "model-00001-of-00002.safetensors").write_bytes(b"half written")
        raise OSError("disk full")

    monkeypatch.setattr(type(first), "save_pretrained", failing)
    with pytest.raises(OSError, match="disk full"):
        approx.save(first, folder)
    monkeypatch.undo()
    after = {f.name: f.read_bytes() for f in folder.iterdir()}
    assert {k: v for k, v in after.items() if k in before} == before  # nothing removed
    with pytest.raises(ValueError, match="is not the one approx.save wrote"):
        approx.load(folder)


def test_evaluating_a_folder_as_its_own_method_checks_its_weights(tmp_path, fixture_dir):
    """``approx eval --model F --method F``: the weights of F and the layers saved in F. Weights written over F by a
    plain save are refused, as approx.load refuses them (they ran without a word)."""
    from evalfixtures import write_checkpoint
    from transformers import AutoModelForSequenceClassification

    path = write_checkpoint(tmp_path / "c", "sequence-classification")
    model = approx.patch(AutoModelForSequenceClassification.from_pretrained(path), "lsh", cluster_size=4)
    approx.save(model, path)
    run = dict(data_dir=str(fixture_dir), source="local", limit=4, progress=False)
    (result,) = approx.evaluate(str(path), "sst2", [str(path)], **run)
    assert result["method"]["name"] == "lsh"
    AutoModelForSequenceClassification.from_pretrained(path, num_labels=2).save_pretrained(path)  # plain, same weights
    approx.evaluate(str(path), "sst2", [str(path)], **run)  # (the same bytes: still the saved weights)
    tiny_model("bert", "sequence-classification", seed=5, vocab_size=99).save_pretrained(path)
    with pytest.raises(ValueError, match="is not the one approx.save wrote"):
        approx.evaluate(str(path), "sst2", [str(path)], **run)
