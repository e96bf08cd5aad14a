"""Patching real transformers models (tiny ones built from configs): every supported family and task head,
exactness of ``full``, unpatch, layer selection, save/load, refusals."""

import copy
import functools
import re
import types
import warnings

import pytest
import torch
from conftest import FAMILIES, FAMILY_HEADS, HEADS, batch, heads_of, model_output, tiny_config, tiny_model

import approx
from approx.integration import SUPPORTED_MODEL_TYPES, UnsupportedModelError, _key_mask, attach

METHODS = approx.methods()


def options(method):
    """The options at which the method approximates on the tests' 48-token inputs, from its registration."""
    return dict(approx.get_method(method).test_options)


def patched(model, method, **opts):
    """``approx.patch``, then ``approx.fit`` on the tests' own batch for methods with learned state."""
    approx.patch(model, method, **opts)
    spec = approx.get_method(method)
    if spec.requires_fit(spec.config_class(**opts)):
        approx.fit(model, [batch(48, pad=13)], progress=False, steps=100)
    return model


@pytest.mark.parametrize("family, head", FAMILY_HEADS)
def test_full_reproduces_unpatched_model(family, head):
    model = tiny_model(family, head)
    inputs = batch(48, pad=13)
    with torch.no_grad():
        ref = model_output(model, **inputs)
        approx.patch(model, "full")
        out = model_output(model, **inputs)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_every_supported_family_has_a_tiny_model():
    """The families the tests run are the supported ones (a family added to SUPPORTED_MODEL_TYPES is tested by
    every family test here), and each has a tiny model of that family; test_unpatch_is_bit_exact then checks
    that it patches and unpatches bit-exactly."""
    assert list(FAMILIES) == list(SUPPORTED_MODEL_TYPES)
    for family in FAMILIES:
        assert tiny_model(family).config.model_type == family
    assert [h for f, h in FAMILY_HEADS if f == "bert"] == HEADS  # every head, where the family has it


@pytest.mark.parametrize("family", FAMILIES)
def test_unpatch_is_bit_exact(family):
    model = tiny_model(family)
    inputs = batch(48, pad=13)
    with torch.no_grad():
        ref = model_output(model, **inputs)
        approx.patch(model, "i-clustered", clusters=6)
        patched = model_output(model, **inputs)
        approx.unpatch(model)
        out = model_output(model, **inputs)
    assert not torch.equal(patched, ref), "the patch had no effect, so this test could not fail"
    assert torch.equal(out, ref)
    assert not approx.is_patched(model)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", METHODS)
def test_model_padding_invariance(family, method):
    """Appending pads to a sequence leaves its real-token outputs unchanged, for every method."""
    model = patched(tiny_model(family), method, **options(method))
    short = batch(40)
    padded = {k: torch.cat([v, torch.zeros(2, 17, dtype=v.dtype)], dim=1) for k, v in short.items()}
    with torch.no_grad():
        a = model_output(model, **short)
        b = model_output(model, **padded)[:, :40]
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_iclustered_with_topk_covering_all_keys_equals_unpatched(family):
    model = tiny_model(family)
    inputs = batch(48, pad=13)
    with torch.no_grad():
        ref = model_output(model, **inputs)
        approx.patch(model, "i-clustered", clusters=6, topk=48)
        out = model_output(model, **inputs)
        approx.patch(model, "clustered", clusters=6)
        clus = model_output(model, **inputs)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1, :35], ref[1, :35], rtol=1e-4, atol=1e-4)
    assert (clus - ref).abs().max() > 1e-3, "clustered attention is exact on this model: the test is too weak"


@pytest.mark.parametrize("method", METHODS)
def test_gradients_reach_attention_projections(method):
    model = patched(tiny_model("bert", "sequence-classification"), method, **options(method))
    model.train()
    out = model(**batch(48, pad=13), labels=torch.tensor([0, 1]))
    out.loss.backward()
    grad = model.bert.encoder.layer[0].attention.self.query.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_model(dtype):
    model = tiny_model("bert").to(dtype)
    inputs = batch(48, pad=13)
    with torch.no_grad():
        ref = model_output(model, **inputs).float()
        for method in METHODS:
            patched(model, method, **options(method))
            out = model_output(model, **inputs)
            assert out.dtype == dtype and torch.isfinite(out).all(), method
            assert torch.nn.functional.cosine_similarity(out.float(), ref, dim=-1).mean() > 0.5, method


def test_layers_select_and_mix_methods():
    model = tiny_model("bert", num_hidden_layers=3)
    approx.patch(model, "clustered", layers=[0, 2], clusters=6)
    approx.patch(model, "i-clustered", layers=[1], clusters=6, topk=4)
    assert [(s["layer"], s["method"]) for s in approx.settings(model)] == [
        (0, "clustered"),
        (1, "i-clustered"),
        (2, "clustered"),
    ]
    approx.patch(model, "full", layers=-1)  # negative indices count from the end
    assert approx.settings(model)[2]["method"] == "full"


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_unselected_layers_compute_as_they_did(implementation):
    """Layers left unpatched by ``layers=`` run the implementation the model had, to the bit: eager attention's
    arithmetic differs from SDPA's in the last bits, and an eager model's unpatched layers had run SDPA (up to 4e-6
    away); padding included."""
    model = tiny_model("bert")
    model.set_attn_implementation(implementation)
    inputs = batch(48, pad=13)
    with torch.no_grad():
        ref = model(**inputs, output_hidden_states=True).hidden_states
        approx.patch(model, "clustered", layers=[1], clusters=6)
        out = model(**inputs, output_hidden_states=True).hidden_states
    torch.testing.assert_close(out[1], ref[1], rtol=0, atol=0)  # after layer 0: untouched
    assert (out[2] - ref[2]).abs().max() > 1e-3


def test_another_attention_implementation_is_refused_while_patched(tmp_path):
    """set_attn_implementation on a patched model would route around its layers while it still reads, saves and
    evaluates as patched: refused, naming unpatch; changing the config behind the patch is refused when the layers
    are read (settings, save). After unpatch the model takes any implementation again."""
    model = approx.patch(tiny_model("bert"), "favor")
    with pytest.raises(ValueError, match=r"set_attn_implementation\('sdpa'\) would route around them; approx.unpatch"):
        model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "approx" and len(approx.settings(model)) == 2
    model.set_attn_implementation({"": "approx"})  # approx's own, in transformers' dict form: kept
    approx.save(model, tmp_path / "m")
    written = {f.name: f.read_bytes() for f in (tmp_path / "m").iterdir()}
    model.config._attn_implementation = "eager"
    for call in (lambda: approx.settings(model), lambda: approx.save(model, tmp_path / "m"), lambda: model(**batch(8))):
        with pytest.raises(ValueError, match="its attention implementation is now 'eager'"):
            call()
    assert {f.name: f.read_bytes() for f in (tmp_path / "m").iterdir()} == written  # a refused save writes nothing
    classifier = approx.patch(tiny_model("bert", "sequence-classification"), "favor")
    classifier.bert.set_attn_implementation("sdpa")  # the inner encoder, sharing the config
    with pytest.raises(ValueError, match="its attention implementation is now 'sdpa'"):
        classifier(**batch(8))
    # the task model of a patched encoder: its setting is refused at the next forward, which says what unpatch restores
    outer = tiny_model("bert", "sequence-classification")
    outer.bert.set_attn_implementation("eager")
    approx.patch(outer.bert, "favor")
    outer.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match=r"now 'sdpa'.*unpatching restores 'eager'.*to run 'sdpa', set it after"):
        outer(**batch(8))
    approx.unpatch(model)
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("head", ["base", "sequence-classification"])
def test_save_load_round_trip(tmp_path, method, head):
    import transformers

    model = tiny_model("roberta", head)
    spec = approx.get_method(method)
    if "seed" in spec.config_class.option_names():  # a seed of 3 where the options read one (Linformer's means: none)
        seed = {} if "seed" in spec.make_config(**options(method)).unused() else {"seed": 3}
        patched(model, method, **options(method), **seed)
    else:
        patched(model, method)
    approx.patch(model, "full", layers=[1])
    inputs = batch(48, pad=13)
    with torch.no_grad():
        out = model_output(model, **inputs)
    approx.save(model, tmp_path / "ckpt")
    cls = transformers.AutoModel if head == "base" else transformers.AutoModelForSequenceClassification
    loaded = approx.load(tmp_path / "ckpt", model_class=cls).eval()
    assert approx.settings(loaded) == approx.settings(model)
    for i, lyr in approx.patched_layers(loaded).items():
        for name, t in lyr.state().items():
            assert torch.equal(t, approx.patched_layers(model)[i].state()[name])
    with torch.no_grad():
        assert torch.equal(model_output(loaded, **inputs), out)
    # the checkpoint itself is a plain Hugging Face one: it loads without approx and runs exact attention
    plain = cls.from_pretrained(tmp_path / "ckpt").eval()
    assert not approx.is_patched(plain)


def test_saved_state_is_used_not_redrawn(tmp_path):
    model = approx.patch(tiny_model("bert"), "clustered", clusters=6)
    lyr = approx.patched_layers(model)[0]
    lyr.load_state({**lyr.state(), "planes": torch.randn_like(lyr.state()["planes"])})
    approx.save(model, tmp_path)
    loaded = approx.load(tmp_path)
    assert torch.equal(approx.patched_layers(loaded)[0].state()["planes"], lyr.state()["planes"])


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_saves_and_loads(family, tmp_path):
    """approx.save then approx.load gives the same outputs bit for bit (FAVOR+'s random features are its state), with
    the family's last task head, and unpatching the loaded model gives the unpatched model's outputs."""
    head = heads_of(family)[-1]
    model = tiny_model(family, head)
    inputs = batch(48, pad=13)
    with torch.no_grad():
        plain = model_output(model, **inputs)
        out = model_output(approx.patch(model, "favor", features=16, seed=3), **inputs)
        approx.save(model, tmp_path)
        loaded = approx.load(tmp_path, type(model)).eval()
        assert approx.settings(loaded) == approx.settings(model)
        assert torch.equal(model_output(loaded, **inputs), out)
        assert not torch.equal(out, plain), "the patch had no effect, so this test could not fail"
        assert torch.equal(model_output(approx.unpatch(loaded), **inputs), plain)


def test_method_state_save_and_load(tmp_path):
    """save_method_state writes the patched layers' state (None for stateless methods); load_method_state puts it
    back, refusing names or shapes that differ."""
    from approx.integration import load_method_state, save_method_state

    assert save_method_state(approx.patch(tiny_model("bert"), "full"), tmp_path / "none") is None
    assert not (tmp_path / "none").exists()
    model = approx.patch(tiny_model("bert"), "clustered", clusters=6, seed=4)
    file = save_method_state(model, tmp_path)
    assert file == tmp_path / "approx_state.safetensors" and file.is_file()
    other = approx.patch(tiny_model("bert"), "clustered", clusters=6)
    load_method_state(other, tmp_path)
    for i, lyr in approx.patched_layers(model).items():
        for name, t in lyr.state().items():
            assert torch.equal(approx.patched_layers(other)[i].state()[name], t)
    with pytest.raises(ValueError, match="shape"):
        load_method_state(approx.patch(tiny_model("bert"), "clustered", clusters=6, bits=8), tmp_path)
    with pytest.raises(ValueError, match="state of 'favor'"):
        load_method_state(approx.patch(tiny_model("bert"), "favor"), tmp_path)
    with pytest.raises(ValueError, match="not patched"):
        load_method_state(approx.patch(tiny_model("bert"), "clustered", layers=[0]), tmp_path)


# ------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("family", ["deberta-v2", "mpnet"])
def test_models_outside_the_registry_are_refused(family):
    from transformers import AutoModel

    model = AutoModel.from_config(tiny_config(family))
    with pytest.raises(UnsupportedModelError) as e:
        approx.patch(model, "full")
    assert "AttentionInterface" in str(e.value) and family in str(e.value)
    assert not approx.is_patched(model)


def test_sliding_window_layers_keep_the_models_own_attention():
    """ModernBERT's local layers attend within a sliding window: approx never patches them. ``layers=None`` patches
    the full-attention layers, naming a local layer is refused (the model left as it was), and the local layers run
    the model's own windowed attention, in a model loaded with SDPA or with eager attention: ``full`` on the other
    layers gives the unpatched outputs."""
    from transformers import AutoModel

    from approx.integration import local_layers

    model = tiny_model("modernbert")  # layer 0 full attention, layer 1 a window of 4 tokens on each side
    assert local_layers(model) == [1]
    with pytest.raises(ValueError, match=r"layers \[1\] of ModernBertModel attend within a sliding window.*: \[0\]"):
        approx.patch(model, "lsh", layers=[0, 1])
    assert not approx.is_patched(model)
    approx.patch(model, "lsh")
    assert [e["layer"] for e in approx.settings(model)] == [0]
    inputs = batch(48, pad=13)
    for implementation in ("sdpa", "eager"):
        torch.manual_seed(0)
        plain = AutoModel.from_config(tiny_config("modernbert"), attn_implementation=implementation).eval()
        with torch.no_grad():
            ref = model_output(plain, **inputs)
            out = model_output(approx.patch(plain, "full"), **inputs)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    # training: the local layer's attention dropout too, drawn as the unpatched model draws it
    torch.manual_seed(0)
    plain = AutoModel.from_config(tiny_config("modernbert", attention_dropout=0.3)).train()
    torch.manual_seed(1)
    ref = model_output(plain, **inputs)
    approx.patch(plain, "full")
    torch.manual_seed(1)
    torch.testing.assert_close(model_output(plain, **inputs), ref, rtol=1e-6, atol=1e-6)


def test_a_patched_modernbert_gives_every_layers_attention_weights():
    """``output_attentions`` of a patched SDPA-loaded ModernBERT: a weight tensor per layer, the sliding-window layer's
    (run by SDPA, which gives none) computed from its band, equal to the unpatched eager model's."""
    from transformers import AutoModel

    torch.manual_seed(0)
    eager = AutoModel.from_config(tiny_config("modernbert"), attn_implementation="eager").eval()
    torch.manual_seed(0)
    model = approx.patch(AutoModel.from_config(tiny_config("modernbert")).eval(), "full")
    inputs = batch(24, pad=5)
    with torch.no_grad():
        ref = eager(**inputs, output_attentions=True).attentions
        got = model(**inputs, output_attentions=True).attentions
    assert len(got) == len(ref) == 2
    for r, g in zip(ref, got, strict=True):
        torch.testing.assert_close(g[0], r[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g[1, :, :19, :19], r[1, :, :19, :19], rtol=1e-5, atol=1e-6)  # real rows, real keys
        assert float(g[1, :, :19, 19:].abs().max()) == 0.0  # no weight on padding
    # the sliding-window layer's padded query 23, whose window (19 to 27) holds padding only: eager attention's
    # weights, spread over every key (they had been NaN)
    torch.testing.assert_close(got[1][1, :, 23], ref[1][1, :, 23])
    torch.testing.assert_close(got[1][1, :, 23], torch.full_like(got[1][1, :, 23], 1 / 24))


@pytest.mark.parametrize("method", ["full", "favor", "window", "monarch"])
def test_attention_weights_come_in_the_models_dtype(method):
    """``output_attentions`` of a bfloat16 model: weights in bfloat16 for every layer, as eager attention gives them
    (methods that compute them in float32 returned float32, so one model's layers gave two dtypes: a reviewer's
    finding), and close to the float32 model's."""
    model = tiny_model("bert")
    inputs = batch(24, pad=5)
    approx.patch(model, method, layers=[0], **options(method))
    with torch.no_grad():
        want = model(**inputs, output_attentions=True).attentions
        got = model.to(torch.bfloat16)(**inputs, output_attentions=True).attentions
    assert [w.dtype for w in got] == [torch.bfloat16] * 2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w, rtol=0, atol=0.1)  # (bfloat16 q, k: 8 bits of mantissa)


def _left_and_right_padded(seq_len: int = 40) -> dict[str, torch.Tensor]:
    """Three rows: unpadded, padded after 13 real tokens (longer than the tiny window), padded before 9."""
    inputs = batch(seq_len, batch_size=3)
    inputs["attention_mask"][1, 13:] = 0
    inputs["attention_mask"][2, :9] = 0
    inputs["input_ids"].masked_fill_(inputs["attention_mask"] == 0, 0)
    return inputs


def _count_band_calls(monkeypatch, name: str = "attend") -> list[int]:
    """Count the calls of the banded kernel (``name="attend_with_gradients"``: of its training form), a one-element
    list incremented per call."""
    from approx.attention import _band

    calls, attend = [0], getattr(_band, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return attend(*args, **kwargs)

    monkeypatch.setattr(_band, name, counted)
    return calls


@pytest.mark.parametrize("implementation, seq_len", [("sdpa", 40), ("eager", 40), ("sdpa", 150)])
def test_local_band_computes_the_sliding_window_layers_own_attention(implementation, seq_len, monkeypatch):
    """``local="band"``: ModernBERT's sliding-window layer runs approx's banded kernel, and the model gives the unpatched
    model's outputs on every real token to rounding (padding after and before the real tokens, a window shorter than
    them; inputs within one of the kernel's blocks of 64 rows and over several), with any method on the other layers as
    that method with the layer's own attention gives them, and the layer's attention weights when asked; a mask the
    caller made (which transformers hands the layer as it is, without the window) runs the layer's own attention;
    unpatch restores the model bit for bit."""
    calls = _count_band_calls(monkeypatch)
    inputs = _left_and_right_padded(seq_len)
    real = inputs["attention_mask"].bool()
    plain = tiny_model("modernbert")  # layer 0 full attention, layer 1 a window of 4 tokens on each side
    plain.set_attn_implementation(implementation)
    eager = tiny_model("modernbert")  # the same weights, with eager attention, which gives the weights
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        ref = plain(**inputs)
        want_weights = eager(**inputs, output_attentions=True).attentions[1]
        assert approx.local_mode(approx.patch(plain, "full")) == "model"
        assert calls[0] == 0  # ("full" on layer 0 is SDPA: eager attention rounds otherwise)
        torch.testing.assert_close(model_output(plain, **inputs), ref.last_hidden_state, rtol=1e-6, atol=1e-6)
        approx.patch(plain, "full", local="band")
        assert approx.local_mode(plain) == "band" and approx.settings(plain)[0]["layer"] == 0
        got = plain(**inputs, output_attentions=True)
        assert calls[0] == 1  # the local layer, once
        torch.testing.assert_close(got.last_hidden_state[real], ref.last_hidden_state[real], rtol=1e-5, atol=1e-5)
        weights = got.attentions[1]  # the local layer's, over the real keys of real rows
        for row in range(3):
            keys = real[row]
            torch.testing.assert_close(weights[row][:, keys][..., keys], want_weights[row][:, keys][..., keys])
        if implementation == "sdpa":  # (eager attention adds a boolean mask to its scores as numbers: not compared)
            own_mask = {**inputs, "attention_mask": real[:, None, None, :].expand(3, 1, seq_len, seq_len).clone()}
            unpatched = tiny_model("modernbert")
            torch.testing.assert_close(
                model_output(plain, **own_mask), model_output(unpatched, **own_mask), rtol=1e-6, atol=1e-6
            )
            assert calls[0] == 1  # (the caller's 4D mask: no window in it, so the layer ran its own attention)
        lsh_band = model_output(approx.patch(plain, "lsh", cluster_size=8, rounds=2), **inputs)  # local kept: band
        assert approx.local_mode(plain) == "band" and calls[0] == 2
        lsh_own = model_output(approx.patch(plain, "lsh", cluster_size=8, rounds=2, local="model"), **inputs)
        assert approx.local_mode(plain) == "model" and calls[0] == 2
        torch.testing.assert_close(lsh_band[real], lsh_own[real], rtol=1e-5, atol=1e-5)
        assert (lsh_band[real] - ref.last_hidden_state[real]).abs().max() > 1e-3  # (LSH approximates layer 0)
        approx.patch(plain, "full", local="band")
        approx.unpatch(plain)
        assert approx.local_mode(plain) == "model"
        assert torch.equal(model_output(plain, **inputs), ref.last_hidden_state) and calls[0] == 2
        assert approx.local_mode(approx.patch(plain, "full")) == "model"  # a new patch starts from the model's own
        model_output(plain, **inputs)
        assert calls[0] == 2


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_local_band_trains_its_windows_on_the_bands_training_form(monkeypatch):
    """With gradients tracked or in training mode the banded kernel (inference only) gives way to its training form
    on the same window (differentiable, checkpointed chunks): in float64 the outputs on real tokens and every
    parameter's gradient are the unpatched model's (its own attention on the dense band mask), with padding after
    and before the real tokens, in training mode, in eval mode with gradients (no warning now), under gradient
    checkpointing, and in training mode without gradients (reentrant checkpointing's first forward)."""
    band_calls = _count_band_calls(monkeypatch)
    training_calls = _count_band_calls(monkeypatch, "attend_with_gradients")
    inputs = _left_and_right_padded(40)
    real = inputs["attention_mask"].bool()

    def loss_and_grads(model):
        model.zero_grad()
        out = model_output(model, **inputs)
        out[real].pow(2).sum().backward()
        return out.detach(), _grads(model)

    for mode, checkpointing in (("train", False), ("eval", False), ("train", True)):
        plain = tiny_model("modernbert").double()
        getattr(plain, mode)()
        if checkpointing:
            plain.gradient_checkpointing_enable()
        ref, ref_grads = loss_and_grads(plain)
        approx.patch(plain, "full", local="band")
        before = training_calls[0]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (no "ran its own attention" warning)
            out, grads = loss_and_grads(plain)
        assert training_calls[0] > before and band_calls[0] == 0, (mode, checkpointing)
        torch.testing.assert_close(out[real], ref[real], rtol=1e-12, atol=1e-12)
        assert len(grads) == len(ref_grads)
        for got, want in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8 * float(want.abs().max()))
    plain = tiny_model("modernbert").double().train()
    with torch.no_grad():
        ref = model_output(plain, **inputs)
        approx.patch(plain, "full", local="band")
        before = training_calls[0]
        torch.testing.assert_close(model_output(plain, **inputs)[real], ref[real], rtol=1e-12, atol=1e-12)
        assert training_calls[0] == before + 1 and band_calls[0] == 0
        model_output(plain.eval(), **inputs)  # inference: the banded kernel
    assert band_calls[0] == 1 and training_calls[0] == before + 1


def test_local_band_applies_attention_dropout_in_training():
    """Attention dropout (ModernBERT's ``attention_dropout``) is applied on the band's weights in training, as
    transformers' own functions apply it: a training forward differs from one without dropout, repeats under the same
    seed, and the window's output averaged over many draws is its output without dropout (within 6 standard errors)."""
    from approx.attention import _band

    inputs = batch(40, pad=11)
    real = inputs["attention_mask"].bool()
    outs = {}
    for dropout in (0.0, 0.3, 0.3):
        model = approx.patch(tiny_model("modernbert", attention_dropout=dropout).train(), "full", local="band")
        torch.manual_seed(3)
        outs.setdefault(dropout, []).append(model_output(model, **inputs)[real])
    assert torch.equal(*outs[0.3]) and not torch.allclose(outs[0.3][0], outs[0.0][0])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 8, generator=g, dtype=torch.float64) for _ in range(3))
    key_mask = torch.ones(2, 40, dtype=torch.bool)
    key_mask[1, 29:] = False
    plain = _band.attend_with_gradients(q, k, v, reach=4, block=64, key_mask=key_mask, scale=0.3)
    torch.manual_seed(0)
    draws = torch.stack(
        [
            _band.attend_with_gradients(q, k, v, reach=4, block=64, key_mask=key_mask, scale=0.3, dropout=0.2)
            for _ in range(150)
        ]
    )
    bound = 6 * draws.std(0) / 150**0.5 + 1e-9
    assert not torch.equal(draws[0], plain) and ((draws.mean(0) - plain).abs() <= bound).all()


def test_a_dict_of_masks_per_layer_type_reads_as_the_unpatched_model_reads_it(monkeypatch):
    """transformers 5 takes a dict of 4D masks per layer type as ``attention_mask`` (ModernBERT: ``full_attention`` and
    ``sliding_attention``) and hands each layer its own: a patched model, ``band`` set, reads it the same (before,
    the question hook took the dict for a padding mask and failed); the sliding layer, given a mask it did not build,
    runs its own attention."""
    calls = _count_band_calls(monkeypatch)
    inputs = batch(40, pad=11)
    real, i = inputs["attention_mask"].bool(), torch.arange(40)
    masks = {
        "full_attention": real[:, None, None, :].expand(2, 1, 40, 40).clone(),
        "sliding_attention": (((i[:, None] - i[None, :]).abs() <= 4)[None, None] & real[:, None, None, :]).clone(),
    }
    model = tiny_model("modernbert")
    with torch.no_grad():
        ref = model_output(model, input_ids=inputs["input_ids"], attention_mask=masks)
        torch.testing.assert_close(ref[real], model_output(model, **inputs)[real])  # (the dict is the model's masks)
        approx.patch(model, "full", local="band")
        got = model_output(model, input_ids=inputs["input_ids"], attention_mask=masks)
    torch.testing.assert_close(got[real], ref[real], rtol=1e-6, atol=1e-6)
    assert calls[0] == 0


def test_local_band_is_refused_where_there_is_no_window_and_unknown_modes_list_the_known():
    """``local`` other than 'model' or 'band' is refused, listing both; 'band' on a model without sliding-window layers
    is refused as such; either leaves the model as it was. 'band' on layers off the CPU, where the kernel does not run,
    is said."""
    model = tiny_model("modernbert")
    with pytest.raises(ValueError, match=r"local='banded': choose one of 'model', 'band'"):
        approx.patch(model, "full", local="banded")
    assert not approx.is_patched(model)
    bert = tiny_model("bert")
    with pytest.raises(ValueError, match=r"local='band': BertModel has no sliding-window layers"):
        approx.patch(bert, "full", local="band")
    assert not approx.is_patched(bert)
    assert approx.local_mode(approx.patch(bert, "full", local="model")) == "model"
    with pytest.warns(
        UserWarning, match=r"runs approx's banded kernel on the CPU only; the sliding-window layers on meta"
    ):
        approx.patch(tiny_model("modernbert").to("meta"), "full", local="band")  # (a device the kernel does not run on)
    no_window = tiny_model("modernbert")
    no_window.layers[1].attn.config = types.SimpleNamespace()  # (a layer whose window approx cannot read)
    with pytest.raises(ValueError, match=r"the window of layers \[1\] of ModernBertModel cannot be read"):
        approx.patch(no_window, "full", local="band")
    assert not approx.is_patched(no_window)


def test_local_band_is_saved_and_loaded_and_a_bad_record_is_refused(tmp_path):
    """``approx.save`` records ``local`` ("band"; absent for the model's own attention) and ``approx.load`` brings it
    back; a folder whose ``local`` is unknown, or ``band`` for a model without a window, is refused naming the file,
    the model left as it was."""
    import json

    from transformers import AutoModel

    inputs = _left_and_right_padded()
    model = approx.patch(tiny_model("modernbert"), "lsh", cluster_size=8, rounds=2, local="band")
    with torch.no_grad():
        want = model_output(model, **inputs)
    approx.save(model, tmp_path / "band")
    settings = json.loads((tmp_path / "band" / "approx_config.json").read_text())
    assert settings["local"] == "band"
    loaded = approx.load(tmp_path / "band").eval()
    assert approx.local_mode(loaded) == "band"
    with torch.no_grad():
        assert torch.equal(model_output(loaded, **inputs), want)
    approx.save(approx.patch(model, "full", local="model"), tmp_path / "own")
    assert "local" not in json.loads((tmp_path / "own" / "approx_config.json").read_text())
    assert approx.local_mode(approx.load(tmp_path / "own")) == "model"
    settings["local"] = "banded"
    (tmp_path / "band" / "approx_config.json").write_text(json.dumps(settings))
    fresh = AutoModel.from_config(tiny_config("modernbert"))
    with pytest.raises(ValueError, match=r"approx_config.json: local='banded': choose one of"):
        approx.restore(fresh, tmp_path / "band")
    assert not approx.is_patched(fresh)
    approx.save(approx.patch(tiny_model("bert"), "full"), tmp_path / "bert")
    settings = json.loads((tmp_path / "bert" / "approx_config.json").read_text())
    (tmp_path / "bert" / "approx_config.json").write_text(json.dumps({**settings, "local": "band"}))
    bert = AutoModel.from_config(tiny_config("bert"))
    with pytest.raises(ValueError, match=r"approx_config.json: local='band': BertModel has no sliding-window layers"):
        approx.restore(bert, tmp_path / "bert")
    assert not approx.is_patched(bert)


def _count_dense_masks(monkeypatch) -> list[int]:
    """Count the dense masks transformers' SDPA mask function builds (``sdpa_mask``, which approx's mask function calls
    for a sliding-window layer's own attention), a one-element list incremented per call."""
    from transformers import masking_utils as mu

    calls, build = [0], mu.sdpa_mask

    def counted(*args, **kwargs):
        calls[0] += 1
        return build(*args, **kwargs)

    monkeypatch.setattr(mu, "sdpa_mask", counted)
    return calls


def test_the_mask_of_a_sliding_window_layer_is_its_bands_keys_and_its_dense_mask_when_asked(monkeypatch):
    """Asked for a sliding-window mask (transformers passes ``local_size``), the mask function hands over the band's
    keys (B, 1, 1, N), marked with the reach for `local="band"`, without building the O(N^2) mask; the layer's own
    attention gets the dense mask of the window and the padding, |i - j| <= w and key j real, built once when first
    asked for. A symmetric window that is not that band gets its dense mask, unmarked."""
    from transformers import masking_utils as mu

    from approx.integration import _BAND_REACH, _dense_mask, _key_padding_mask

    built = _count_dense_masks(monkeypatch)
    padding = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1] * 8]).bool()  # (as transformers hands it over)
    i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
    want = ((i - j).abs() <= 2)[None, None] & padding[:, None, None, :]
    for keys, dense in ((padding, want), (None, ((i - j).abs() <= 2)[None, None].expand(2, 1, 8, 8))):
        mask = _key_padding_mask(
            2, 8, 8, mask_function=mu.sliding_window_bidirectional_mask_function(2), attention_mask=keys, local_size=2
        )
        assert mask.shape == (2, 1, 1, 8) and getattr(mask, _BAND_REACH) == 2 and built[0] == 0
        assert torch.equal(mask[:, 0, 0], padding if keys is not None else torch.ones(2, 8, dtype=torch.bool))
        assert torch.equal(_dense_mask(mask), dense) and _dense_mask(mask) is _dense_mask(mask) and built[0] == 1
        built[0] = 0
    # shorter than the reach: transformers decides (no padding, every pair in the window: no mask at all)
    short = mu.sliding_window_bidirectional_mask_function(9)
    assert _key_padding_mask(2, 8, 8, mask_function=short, attention_mask=None, local_size=9) is None
    mask = _key_padding_mask(2, 8, 8, mask_function=short, attention_mask=padding, local_size=9)
    assert getattr(mask, _BAND_REACH) == 9 and torch.equal(
        _dense_mask(mask), padding[:, None, None, :].expand(2, 1, 8, 8)
    )

    # a symmetric window that is not that band (cut at position 4) is served, but not marked for the banded kernel
    def cut(batch_idx, head_idx, q_idx, kv_idx):
        return ((q_idx - kv_idx).abs() <= 2) & (q_idx // 4 == kv_idx // 4)

    mask = _key_padding_mask(2, 8, 8, mask_function=cut, attention_mask=padding, local_size=2)
    want = (((i - j).abs() <= 2) & (i // 4 == j // 4))[None, None] & padding[:, None, None, :]
    assert torch.equal(mask, want) and not hasattr(mask, _BAND_REACH)

    def corners(batch_idx, head_idx, q_idx, kv_idx):  # the band and one more pair each way, far outside it
        return ((q_idx - kv_idx).abs() <= 2) | ((q_idx - kv_idx).abs() == 7)

    mask = _key_padding_mask(2, 8, 8, mask_function=corners, attention_mask=padding, local_size=2)
    assert bool(mask[1, 0, 0, 7]) and not hasattr(mask, _BAND_REACH)

    def wider(batch_idx, head_idx, q_idx, kv_idx):  # the band and one pair just outside it, (2, 5) and (5, 2)
        return ((q_idx - kv_idx).abs() <= 2) | (((q_idx - kv_idx).abs() == 3) & (q_idx + kv_idx == 7))

    mask = _key_padding_mask(2, 8, 8, mask_function=wider, attention_mask=padding, local_size=2)
    assert bool(mask[1, 0, 2, 5]) and not hasattr(mask, _BAND_REACH)

    # the band written by hand, the band and one far pair on a middle row (which samples of rows would miss), one that
    # reads the batch, and transformers' own window of another reach: each gets its dense mask, unmarked
    def band(batch_idx, head_idx, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 2

    def linked(batch_idx, head_idx, q_idx, kv_idx):  # tokens 3 and 23 of 40 see each other
        return band(batch_idx, head_idx, q_idx, kv_idx) | ((q_idx - kv_idx).abs() == 20) & (q_idx + kv_idx == 26)

    def per_batch(batch_idx, head_idx, q_idx, kv_idx):
        return band(batch_idx, head_idx, q_idx, kv_idx) | ((batch_idx == 1) & ((q_idx - kv_idx).abs() == 3))

    wide = mu.sliding_window_bidirectional_mask_function(3)
    d = (torch.arange(40)[:, None] - torch.arange(40)[None, :]).abs()  # the second row's mask of each, from |i - j|
    with_link = (d <= 2).clone()
    with_link[3, 23] = with_link[23, 3] = True
    wants = {band: d <= 2, linked: with_link, per_batch: d <= 3, wide: d <= 3}
    for other, want in wants.items():
        mask = _key_padding_mask(2, 40, 40, mask_function=other, attention_mask=None, local_size=2)
        assert mask.shape == (2, 1, 40, 40) and not hasattr(mask, _BAND_REACH), other
        assert torch.equal(mask[1, 0], want), other


def _narrower(sliding_window):  # a window reaching one less than transformers' |i - j| <= w
    def inner(batch_idx, head_idx, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() < sliding_window

    return inner


def _linked(sliding_window):  # transformers' window, and tokens 5 and 30 linked (a far pair)
    def inner(batch_idx, head_idx, q_idx, kv_idx):
        far = (torch.minimum(q_idx, kv_idx) == 5) & ((q_idx - kv_idx).abs() == 25)
        return ((q_idx - kv_idx).abs() <= sliding_window) | far

    return inner


@pytest.mark.parametrize("overlay", [_narrower, _linked])
def test_a_window_function_that_moved_its_convention_runs_the_layers_own_attention(overlay, monkeypatch):
    """The band's keys are handed over only where transformers' window function for the reach allows exactly
    |i - j| <= reach (checked once per reach): a release whose window reached one less (|i - j| < reach), or linked
    two far tokens, would get its own dense mask, and the model with ``local="band"`` still gives the unpatched
    model's outputs."""
    from transformers import masking_utils as mu

    from approx import integration

    built = _count_dense_masks(monkeypatch)
    band_calls = _count_band_calls(monkeypatch)
    monkeypatch.setattr(mu, "sliding_window_bidirectional_overlay", overlay)
    monkeypatch.setattr(integration, "_window_convention", functools.cache(integration._window_convention.__wrapped__))
    model = tiny_model("modernbert")
    inputs = batch(40, pad=11)
    with torch.no_grad():
        ref = model_output(model, **inputs)
        approx.patch(model, "full", local="band")
        built[0] = 0
        torch.testing.assert_close(model_output(model, **inputs), ref, rtol=1e-6, atol=1e-6)
    assert (built[0], band_calls[0]) == (1, 0) and not integration._window_convention(4)


def test_local_band_never_builds_the_dense_window_mask_and_the_models_own_attention_builds_it_once(monkeypatch):
    """A forward of a patched ModernBERT with two sliding-window layers: with ``local="band"`` no O(N^2) mask is built
    (the band runs from the keys) unless the weights are asked for; with the layers' own attention one, which both
    layers share."""
    built = _count_dense_masks(monkeypatch)
    band_calls = _count_band_calls(monkeypatch)
    model = tiny_model("modernbert", num_hidden_layers=3, global_attn_every_n_layers=3)  # layers 1 and 2: windows
    inputs = batch(40, pad=11)
    with torch.no_grad():
        ref = model_output(model, **inputs)
        built[0] = 0
        approx.patch(model, "full", local="band")
        got = model_output(model, **inputs)
        assert (built[0], band_calls[0]) == (0, 2)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        model(**inputs, output_attentions=True)
        assert (built[0], band_calls[0]) == (1, 4)
        approx.patch(model, "full", local="model")
        built[0] = 0
        torch.testing.assert_close(model_output(model, **inputs), ref, rtol=1e-6, atol=1e-6)
        assert (built[0], band_calls[0]) == (1, 4)


def test_grouped_query_attention_is_expanded_as_transformers_does():
    """EuroBERT's tiny model shares each key/value head between two query heads: a patched layer and a layer left
    unpatched (exact attention through approx's function) both reproduce the unpatched model."""
    model = tiny_model("eurobert")
    assert model.config.num_key_value_heads * 2 == model.config.num_attention_heads
    inputs = batch(48, pad=13)
    with torch.no_grad():
        ref = model_output(model, **inputs)
        for layers in ([0], [1], None):
            out = model_output(approx.patch(model, "full", layers=layers), **inputs)
            torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
            approx.unpatch(model)


def test_a_head_size_other_than_hidden_over_heads_is_read_from_the_module():
    """Llama-style modules (EuroBERT) may set head_dim apart from hidden_size / heads: methods with state sized by the
    head (FAVOR+'s features, LSH's directions) are drawn for the head the module has."""
    model = tiny_model("eurobert", head_dim=16)  # 4 heads of 16 on a hidden size of 32
    inputs = batch(48, pad=13)
    with torch.no_grad():
        ref = model_output(model, **inputs)
        for method in ("favor", "lsh"):
            out = model_output(approx.patch(model, method), **inputs)
            assert out.shape == ref.shape and torch.isfinite(out).all()
        assert approx.patched_layers(model)[0].state()["directions"].shape[-1] == 16 + 2


def test_unpatched_layers_of_an_eager_grouped_query_model_run_as_they_did():
    """A model loaded with eager attention runs its own eager function in the layers left unpatched, on the key/value
    heads as they come (it expands them itself): EuroBERT patched on one layer gives the unpatched outputs."""
    from transformers import AutoModel

    config = tiny_config("eurobert")
    torch.manual_seed(0)
    model = AutoModel.from_config(config, attn_implementation="eager").eval()
    inputs = batch(48, pad=13)
    with torch.no_grad():
        ref = model_output(model, **inputs)
        for layers in ([0], [1]):
            out = model_output(approx.patch(model, "full", layers=layers), **inputs)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            approx.unpatch(model)


def test_mask_patterns_beside_padding_are_refused():
    """The registered mask function hands over the key padding only: asked for a causal, sliding-window or chunked
    pattern (a model type listed by mistake, or a new transformers release), it refuses instead of dropping it."""
    from transformers import masking_utils as mu

    from approx.integration import _key_padding_mask

    padding = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    mask = _key_padding_mask(2, 6, 6, mask_function=mu.bidirectional_mask_function, attention_mask=padding)
    assert torch.equal(mask, padding.bool()[:, None, None, :])
    for other in (mu.causal_mask_function, mu.sliding_window_bidirectional_mask_function(3)):
        with pytest.raises(NotImplementedError, match="another mask pattern"):
            _key_padding_mask(2, 6, 6, mask_function=other, attention_mask=padding)
    # a causal window, asked for with a local size as a bidirectional one is (which a local layer's own attention
    # gets, see test_the_mask_of_a_sliding_window_layer_is_its_band_and_padding), is refused too
    for causal in (mu.sliding_window_causal_mask_function(3), mu.chunked_causal_mask_function(3, torch.zeros(2))):
        with pytest.raises(NotImplementedError, match="another mask pattern"):
            _key_padding_mask(2, 6, 6, mask_function=causal, attention_mask=padding, local_size=3)


@pytest.mark.parametrize(
    "name, value",
    [
        ("sliding_window", 4),
        ("softcap", 30.0),
        ("s_aux", torch.zeros(4)),
        ("sinks", torch.zeros(4)),
        ("is_causal", True),
        ("cu_seq_lens_q", torch.tensor([0, 3, 6])),
        ("cu_seq_lens_k", torch.tensor([0, 3, 6])),
    ],
)
def test_arguments_that_change_the_scores_are_refused(name, value):
    """The registered attention function refuses, rather than ignores, the arguments of transformers' attention
    functions that change what softmax is taken over (a window, a cap on the scores, sink logits, causal attention,
    the boundaries of packed sequences)."""
    from approx.integration import _attention_forward

    model = approx.patch(tiny_model("bert"), "full")
    module = approx.integration.attention_modules(model)[0]
    q = k = v = torch.randn(1, 4, 6, 8)
    unset = dict(sliding_window=None, softcap=None, is_causal=False, cu_seq_lens_q=None, cu_seq_lens_k=None)
    out, _ = _attention_forward(module, q, k, v, None, **unset)
    assert out.shape == (1, 6, 4, 8)  # unset (None, False), they change nothing and pass
    with pytest.raises(NotImplementedError, match=name):
        _attention_forward(module, q, k, v, None, **{name: value})


def test_decoder_and_cross_attention_are_refused():
    from transformers import AutoModel

    model = AutoModel.from_config(tiny_config("bert", is_decoder=True, add_cross_attention=True))
    with pytest.raises(UnsupportedModelError) as e:
        approx.patch(model, "clustered")
    reasons = e.value.reasons
    assert any("causal" in r for r in reasons) and any("cross-attention" in r for r in reasons)


def test_non_transformers_module_is_refused():
    with pytest.raises(UnsupportedModelError, match="PreTrainedModel"):
        approx.patch(torch.nn.Linear(3, 3), "full")


@pytest.mark.parametrize("thing", ["bert-base-uncased", None, 3])
def test_what_is_not_a_module_is_refused_by_name(thing):
    """A model's name or folder (not loaded yet), or anything else that is not a torch module: a clear refusal,
    not an AttributeError from deep inside."""
    with pytest.raises(UnsupportedModelError, match=f"{type(thing).__name__} is not a torch module") as e:
        approx.patch(thing, "full")
    assert ("load it first" in str(e.value)) is isinstance(thing, str)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"method": "clusterd"}, ["did you mean 'clustered'", "full"]),
        ({"method": "clustered", "clusters": 0}, ["clusters"]),
        ({"method": "clustered", "bogus": 1}, ["bogus"]),
        ({"method": "clustered", "layers": [5]}, ["layer 5", "2 attention layers"]),
        ({"method": "clustered", "layers": []}, ["empty"]),
        ({"method": "clustered", "layers": [0, 0]}, ["layer 0 is given twice (0)"]),
        ({"method": "clustered", "layers": [1, -1]}, ["layer 1 is given twice (1 and -1)"]),  # 2 layers: -1 is 1
    ],
)
def test_bad_input_leaves_model_untouched(kwargs, words):
    model = tiny_model("bert")
    inputs = batch(48, pad=13)
    with torch.no_grad():
        ref = model_output(model, **inputs)
    with pytest.raises(ValueError) as e:
        approx.patch(model, **kwargs)
    for w in words:
        assert w in str(e.value)
    assert not approx.is_patched(model)
    assert not any(hasattr(m, "approx_attention") for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model_output(model, **inputs), ref)


def test_numpy_and_torch_integers_are_options_and_layers_and_float_options_are_floats():
    """A sweep's values (numpy.arange, a 0-d tensor) are integers like any other; a float option given an int is
    recorded as a float, as its type says; a bool is neither."""
    import numpy as np

    model = approx.patch(tiny_model("bert"), "clustered", clusters=np.int64(6), layers=[np.int64(1)])
    assert approx.settings(model) == [
        {"layer": 1, "method": "clustered", "config": approx.get_method("clustered").make_config(clusters=6).to_dict()}
    ]
    assert type(approx.settings(model)[0]["config"]["clusters"]) is int
    assert approx.get_method("entmax").make_config(alpha=2).to_dict()["alpha"] == 2.0
    assert type(approx.get_method("entmax").make_config(alpha=torch.tensor(2)).alpha) is float
    assert approx.get_method("entmax").make_config(alpha=torch.tensor(1.5)).alpha == 1.5
    for bad in (True, np.bool_(True), torch.tensor(True), 6.0, "6", torch.tensor([[6]]), np.array([6])):
        with pytest.raises(ValueError, match="must be an integer"):
            approx.get_method("clustered").make_config(clusters=bad)
    for bad in (True, np.bool_(False), 10**400, "2", torch.tensor([2.0])):
        with pytest.raises(ValueError, match="must be a number"):
            approx.get_method("entmax").make_config(alpha=bad)
    with pytest.raises(ValueError, match="layers must be integers"):
        approx.patch(tiny_model("bert"), "clustered", layers=[np.bool_(True)])


def test_unpatch_of_unpatched_model_raises():
    with pytest.raises(ValueError, match="not patched"):
        approx.unpatch(tiny_model("bert"))


def _logits(model):
    with torch.no_grad():
        return model_output(model, **batch(48, pad=13))


def test_a_model_inside_or_around_a_patched_one_is_refused(tmp_path):
    """One set of attention modules patched through two models (``model.bert``, then the task model around it, or
    the other way round) would run through two configs, and neither ``unpatch`` would restore the model: patching,
    restoring, attaching, saving and unpatching the other one are refused, naming the patched one, and the model
    runs as patched. Unpatching the patched one gives the original back to the bit, and the other can then be
    patched."""
    model = tiny_model("bert", "sequence-classification")
    ref = _logits(model)
    approx.save(approx.patch(tiny_model("bert", "sequence-classification"), "full"), tmp_path / "saved")
    for patched_one, other, name in ((model.bert, model, "bert"), (model, model.bert, None)):
        approx.patch(patched_one, "window", window=2, block=4)
        out = _logits(model)
        assert not torch.equal(out, ref)
        refusals = {
            "patch": lambda: approx.patch(other, "clustered", clusters=6),  # noqa: B023
            "restore": lambda: approx.restore(other, tmp_path / "saved"),  # noqa: B023
            "attach": lambda: attach(other, copy.deepcopy(approx.patched_layers(patched_one))),  # noqa: B023
        }
        for what, call in refusals.items():
            with pytest.raises(ValueError, match="patch one model") as e:
                call()
            assert (name is None) == ("through a model that holds it" in str(e.value)), what
            assert approx.settings(patched_one)[0]["method"] == "window" and not approx.is_patched(other)
            assert torch.equal(_logits(model), out)
        calls = {
            "unpatch": lambda: approx.unpatch(other),  # noqa: B023
            "save": lambda: approx.save(other, tmp_path / "x"),  # noqa: B023
            "redraw": lambda: approx.redraw(other),  # noqa: B023
            "fit": lambda: approx.fit(other, [batch(48, pad=13)], progress=False),  # noqa: B023
        }
        for what, call in calls.items():
            with pytest.raises(ValueError, match=r"not patched.*(unpatch that one|model\.bert)") as e:
                call()
            assert "save_pretrained" not in str(e.value), what  # (which would drop the encoder's patch)
        # the read-only views of the task model describe its patched encoder
        assert approx.settings(model) == approx.settings(patched_one)
        assert approx.settings(model.bert) == ([] if name is None else approx.settings(patched_one))
        approx.unpatch(patched_one)
        assert torch.equal(_logits(model), ref)
        assert approx.settings(model) == approx.settings(model.bert) == []
    approx.patch(model.bert, "full")
    assert torch.equal(_logits(model), ref)
    approx.unpatch(model.bert)
    assert torch.equal(_logits(approx.patch(model, "full")), ref)


def test_local_mode_of_a_task_model_is_its_patched_encoders():
    """``approx.local_mode`` of a ModernBERT task model whose encoder was patched with ``local="band"`` says ``"band"``
    (it said ``"model"``), as ``approx.settings`` lists the encoder's layers."""
    model = tiny_model("modernbert", "sequence-classification")
    approx.patch(model.model, "full", local="band")
    assert approx.local_mode(model) == "band" and not approx.is_patched(model)
    assert approx.settings(model) == approx.settings(model.model) != []
    approx.unpatch(model.model)
    assert approx.local_mode(model) == "model" and approx.settings(model) == []


def test_non_padding_masks_are_refused():
    causal = torch.tril(torch.ones(4, 4, dtype=torch.bool))[None, None].expand(2, 1, 4, 4)
    with pytest.raises(ValueError, match="key-padding"):
        _key_mask(causal, 2, 4)
    padding = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(_key_mask(padding[:, None, None, :].expand(2, 1, 4, 4), 2, 4), padding)
    additive = torch.zeros(2, 1, 1, 4).masked_fill(~padding[:, None, None, :], torch.finfo(torch.float32).min)
    assert torch.equal(_key_mask(additive, 2, 4), padding)
    assert torch.equal(_key_mask(padding[:, None, None, :].long(), 2, 4), padding)  # an integer 0/1 mask, as in 2-D
    for masked in (-10000.0, float("-inf")):  # BERT's extended mask, and -inf
        assert torch.equal(
            _key_mask(torch.zeros(2, 1, 1, 4).masked_fill(~padding[:, None, None, :], masked), 2, 4), padding
        )
    with pytest.raises(ValueError, match="holds -2, neither 0 .* a bias on the scores"):
        _key_mask(torch.zeros(2, 1, 1, 4).masked_fill(~padding[:, None, None, :], -2.0), 2, 4)


def test_patch_takes_a_config_object_as_evaluate_does():
    """``approx.patch(model, config)`` patches with the config's options (it called the config "an unknown attention
    method"); options given beside it override them, checked as options named are (unknown ones, one that another
    leaves unused); a config of another class under a method's name is refused."""
    from approx.attention.nystrom import NystromConfig

    inputs = batch(20, pad=4)
    by_name = approx.patch(tiny_model("bert"), "i-clustered", clusters=6, topk=8)
    config = approx.get_method("i-clustered").make_config(clusters=6, topk=4)
    by_config = approx.patch(tiny_model("bert"), config, topk=8)
    assert approx.settings(by_config) == approx.settings(by_name)
    with torch.no_grad():
        assert torch.equal(by_config(**inputs).last_hidden_state, by_name(**inputs).last_hidden_state)
    model = tiny_model("bert")
    with pytest.raises(ValueError, match="unknown option"):
        approx.patch(model, config, nosuch=1)
    with pytest.raises(ValueError, match="'pinv_iterations' = 3 has no effect here"):
        approx.patch(model, NystromConfig(pinv="exact"), pinv_iterations=3)
    # the same option set inside the config object (approx.evaluate refuses it too: test_evaluation), also when every
    # option differs from its default (which from_options takes for a record); an override that makes it used is taken
    with pytest.raises(ValueError, match="'pinv_iterations' = 3 has no effect here"):
        approx.patch(model, NystromConfig(pinv="exact", pinv_iterations=3))
    with pytest.raises(ValueError, match="'pinv_iterations' = 3 has no effect here"):
        approx.patch(model, NystromConfig(landmarks=8, pinv="exact", pinv_iterations=3, exact_below=5))
    approx.patch(model, NystromConfig(pinv="exact", pinv_iterations=3), pinv="iterative")
    assert approx.settings(model)[0]["config"] == NystromConfig(pinv_iterations=3).to_dict()
    approx.unpatch(model)
    # a config read from a record (a result's or a saved folder's) is taken as written, as the record loads
    recorded = NystromConfig.from_record(NystromConfig(pinv="exact", pinv_iterations=3).to_dict())
    approx.patch(model, recorded)
    assert approx.patched_layers(model)[0].config == recorded
    approx.unpatch(model)
    # ... with overrides: only they are checked (the record's own unused value is not theirs to leave out)
    approx.patch(model, recorded, landmarks=8)
    assert approx.settings(model)[0]["config"] == {**recorded.to_dict(), "landmarks": 8}
    approx.unpatch(model)
    with pytest.raises(ValueError, match="'pinv_iterations' = 4 has no effect here"):
        approx.patch(model, recorded, pinv_iterations=4)
    assert not approx.is_patched(model)

    class Other(NystromConfig):
        method = "favor"

    with pytest.raises(TypeError, match="is not favor's config"):
        approx.patch(model, Other())
    assert not approx.is_patched(model)


def test_a_recorded_config_stays_recorded_through_redraw():
    """A config read from a record stays one when approx.redraw records a new seed in it (it was rebuilt by
    dataclasses.replace, lost the mark, and its record's unused value was then refused when given again)."""
    from approx.attention.favor import FavorConfig

    recorded = FavorConfig.from_record(FavorConfig(features=16, relu_eps=0.01).to_dict())
    model = approx.patch(tiny_model("bert"), recorded)
    approx.redraw(model, seed=5)
    config = approx.patched_layers(model)[0].config
    assert config.seed == 5 and config.recorded and config.relu_eps == 0.01
    again = approx.patch(tiny_model("bert"), config)
    assert approx.patched_layers(again)[0].config == config


@pytest.mark.parametrize("method, options", [("linformer", {"projections": 8}), ("bigbird", {"random_blocks": 0})])
def test_redraw_records_no_seed_the_other_options_leave_unused(method, options, recwarn):
    """Linformer's segment means and BigBird without random blocks read no seed: approx.redraw records none in them
    (it had, and such a config was then refused when given back to approx.patch), and a save and load after a redraw
    says nothing of a seed."""
    model = approx.patch(tiny_model("bert"), method, **options)
    approx.redraw(model, seed=3)
    config = approx.patched_layers(model)[0].config
    assert config.seed == 0
    approx.patch(tiny_model("bert"), config)  # given back as it is
    again = approx.patch(tiny_model("bert"), method, **options)
    again.load_state_dict(model.state_dict())
    assert not [w for w in recwarn if "seed" in str(w.message)]


def test_an_outer_product_padding_mask_is_padding():
    """The original BERT's "3-D" padding mask, m_i & m_j (a padded query's row allows nothing), is padding: the keys
    its rows allow (it had been refused as "a causal or custom attention pattern"). Rows that differ otherwise are
    still refused: a row with no key at a real position, rows of real queries that differ, heads that differ."""
    padding = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    outer = padding[:, None, :, None] & padding[:, None, None, :]  # (3, 1, 5, 5)
    assert torch.equal(_key_mask(outer, 3, 5), padding)
    additive = torch.zeros(3, 1, 5, 5).masked_fill(~outer, torch.finfo(torch.float32).min)
    assert torch.equal(_key_mask(additive, 3, 5), padding)
    assert torch.equal(_key_mask(outer.expand(3, 4, 5, 5), 3, 5), padding)  # every head alike
    real_row_empty = outer.clone()
    real_row_empty[0, 0, 2] = False  # position 2 is a real token
    other_keys = outer.clone()
    other_keys[0, 0, 2, 3] = False  # a real query that leaves out a real key
    heads = outer.expand(3, 2, 5, 5).clone()
    heads[1, 1, :, 4] = False  # a head without the last key
    cross = padding[:, None, :4, None] & padding[:, None, None, :]  # 4 queries, 5 keys: no row can be told padded
    for mask in (real_row_empty, other_keys, heads, cross):
        with pytest.raises(ValueError, match="beyond padding"):
            _key_mask(mask, 3, 5)


@pytest.mark.parametrize("family", ["bert", "roberta"])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_an_outer_product_padding_mask_reproduces_the_two_d_masks_model(family, kind):
    """A model given the "3-D" padding mask (as 4-D) computes every real token as the unpatched model given the 2-D
    mask does, patched with ``full``, and an approximation gives what it gives with the 2-D mask."""
    model = tiny_model(family)
    inputs = batch(24, pad=9)
    m = inputs["attention_mask"].bool()
    outer = m[:, None, :, None] & m[:, None, None, :]
    mask = outer if kind == "bool" else torch.zeros(outer.shape).masked_fill(~outer, torch.finfo(torch.float32).min)
    real = m[..., None]
    with torch.no_grad():
        base = model(**inputs).last_hidden_state
        approx.patch(model, "full")
        full = model(input_ids=inputs["input_ids"], attention_mask=mask).last_hidden_state
        approx.patch(model, "favor", features=16)
        favor_2d = model(**inputs).last_hidden_state
        favor_4d = model(input_ids=inputs["input_ids"], attention_mask=mask).last_hidden_state
    torch.testing.assert_close(full * real, base * real, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(favor_4d * real, favor_2d * real, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["full", "favor", "window"])
def test_an_extended_mask_of_minus_10000_masks_the_padding(method):
    """BERT's original "extended" additive mask (0 for a real key, -10000 for padding, (B, 1, 1, S)) gives what the
    2-D mask gives, patched as unpatched; it had been read as every key real (only values below half the dtype's
    minimum counted as masked), so the padding was attended without a word."""
    model = tiny_model("bert")
    inputs = batch(24, pad=9)
    extended = (1.0 - inputs["attention_mask"][:, None, None, :].float()) * -10000.0
    with torch.no_grad():
        base = model(input_ids=inputs["input_ids"], attention_mask=extended).last_hidden_state
        approx.patch(model, method)
        two_d = model(**inputs).last_hidden_state
        four_d = model(input_ids=inputs["input_ids"], attention_mask=extended).last_hidden_state
    torch.testing.assert_close(four_d, two_d, rtol=0, atol=0)
    if method == "full":
        torch.testing.assert_close(four_d[:, :15], base[:, :15], rtol=1e-5, atol=1e-5)


def test_transformers_4_is_refused(monkeypatch):
    import sys

    model = tiny_model("bert")
    # transformers replaces its lazy module in sys.modules once models are loaded: patch the live one
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")
    with pytest.raises(UnsupportedModelError, match="transformers 4.57.1"):
        approx.patch(model, "full")
    assert not approx.is_patched(model)


@pytest.mark.parametrize("method, options", [("favor", {"features": 16}), ("lsh", {"cluster_size": 8})])
def test_casting_a_patched_model_to_half_precision_keeps_the_state_as_drawn(method, options):
    """Patching then casting to bfloat16 gives the model that casting then patching gives, to the bit: the state
    stays in float32 (it had been rounded to bfloat16 by the cast, changing outputs); a cast to float64 applies."""
    cast_late = approx.patch(tiny_model("bert"), method, **options).to(torch.bfloat16)
    cast_early = approx.patch(tiny_model("bert").to(torch.bfloat16), method, **options)
    late, early = (approx.patched_layers(m)[0].state() for m in (cast_late, cast_early))
    assert all(late[n].dtype == torch.float32 and torch.equal(late[n], early[n]) for n in late)
    with torch.no_grad():
        assert torch.equal(model_output(cast_late, **batch(24, pad=5)), model_output(cast_early, **batch(24, pad=5)))
    assert all(t.dtype == torch.float64 for t in approx.patched_layers(cast_late.double())[0].state().values())


def test_one_texts_unbatched_ids_fit_as_a_batch_of_one_and_fail_as_unpatched_in_a_forward():
    """``approx.fit(model, tokenizer(text))`` (a mapping of 1-D lists) fits on a batch of one: it had crashed with an
    IndexError from the patched model's question lookup. A forward of 1-D ``input_ids`` fails with the error the
    unpatched model gives (transformers' own), not inside approx; other shapes are refused naming them."""
    ids = batch(40)["input_ids"][0]
    one = {"input_ids": ids.tolist(), "attention_mask": [1] * len(ids)}
    model = approx.patch(tiny_model("bert"), "sparsefinder")
    assert approx.fit(model, one, progress=False, steps=2)["layers"] == [0, 1]
    batched = approx.patch(tiny_model("bert"), "sparsefinder")
    approx.fit(batched, [{k: torch.tensor([v]) for k, v in one.items()}], progress=False, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), batched.state_dict().values()))
    with pytest.raises(ValueError, match=r"input_ids \(1, 1, 40\)"):
        approx.fit(model, {"input_ids": ids[None, None]}, progress=False, steps=2)
    unpatched = tiny_model("bert")
    with pytest.raises(Exception) as plain:
        unpatched(input_ids=ids)
    with pytest.raises(type(plain.value), match=re.escape(str(plain.value))):
        approx.patch(unpatched, "window", question_global=True)(input_ids=ids)


def test_a_probe_sees_its_own_threads_forwards():
    """A probe opened in one thread sees the patched layers that thread runs, not those another thread runs meanwhile
    (the probes were one list for the process: approx.fit had taken another model's queries and keys, run by another
    thread, into its samples, and the fit changed)."""
    import threading

    from approx.integration import attention_probe

    mine = approx.patch(tiny_model("bert").eval(), "favor", features=8)
    theirs = approx.patch(tiny_model("bert").eval(), "clustered", clusters=2)
    inputs = batch(16)
    seen = []
    with torch.no_grad(), attention_probe(lambda layer, *a: seen.append(layer)):
        thread = threading.Thread(target=lambda: theirs(**inputs))
        thread.start()
        thread.join()
        assert seen == []  # the other thread's forward, run while the probe was open
        mine(**inputs)
    assert seen and all(layer in approx.patched_layers(mine).values() for layer in seen)
    # a thread of its own sees what it runs, and not the probes opened in the thread that started it
    outer, inner = [], []

    def run() -> None:
        with torch.no_grad(), attention_probe(lambda layer, *a: inner.append(layer)):
            theirs(**inputs)

    with attention_probe(lambda layer, *a: outer.append(layer)):
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    assert outer == [] and inner and all(layer in approx.patched_layers(theirs).values() for layer in inner)


def test_probes_closed_out_of_order_each_stop_alone():
    """Two generators each probing their own forwards, the first ending first: the second's probe still sees its
    forwards and the first's sees nothing more (resetting the probes to what they were at entry had dropped the open
    one and kept the closed one for good)."""
    from approx.integration import attention_probe

    model = approx.patch(tiny_model("bert").eval(), "favor", features=8)
    inputs = batch(16)
    seen: dict[str, int] = {"a": 0, "b": 0}

    def stream(name: str, count: int):
        def probe(*args):
            seen[name] += 1

        with attention_probe(probe):  # (not torch.no_grad, whose blocks must close in order: it would leave it off)
            for _ in range(count):
                yield model(**inputs)

    a, b = stream("a", 1), stream("b", 3)
    next(a), next(b)
    assert next(a, None) is None  # a's block closes first
    layers = len(approx.patched_layers(model))
    before = dict(seen)
    for _ in b:
        pass
    assert seen["a"] == before["a"] and seen["b"] == before["b"] + 2 * layers
    model(**inputs)  # every block closed: nobody sees it
    assert seen["b"] == before["b"] + 2 * layers and seen["a"] == before["a"]
    # one probe open in two blocks: the block that closes takes out its own entry, the others keep their order
    from approx.layer import probes

    def p1(*args):
        pass

    def p2(*args):
        pass

    def holding():
        with attention_probe(p1):
            yield

    g = holding()
    next(g)
    with attention_probe(p2), attention_probe(p1):
        g.close()
        assert probes() == (p2, p1)
    assert probes() == ()


def test_one_probe_instance_is_open_in_one_thread_at_a_time_and_called_once_when_nested():
    """Entering an attention_probe open in another thread is refused (its exit could not tell which thread's block
    closes: a block closed from a third thread had stopped the other thread's probe); nested in one thread, the probe
    is called once per layer (it had been called once per block)."""
    import threading

    from approx.integration import attention_probe
    from approx.layer import probes

    shared = attention_probe("P")
    errors: list[BaseException] = []

    def second():
        try:
            shared.__enter__()
        except RuntimeError as err:
            errors.append(err)

    with shared:
        t = threading.Thread(target=second)
        t.start()
        t.join()
        with shared:
            assert probes() == ("P",)
        assert probes() == ("P",)
    assert probes() == ()
    assert len(errors) == 1 and "make one attention_probe(probe) per block" in str(errors[0])
    # a thread or an asyncio task whose context was copied from the opener's holds its entry: refused all the same
    # (it had been let in, and a generator closed from a third thread then stopped the wrong block)
    import asyncio
    import contextvars

    def copied():
        try:
            shared.__enter__()
        except RuntimeError as err:
            errors.append(err)

    async def child():
        try:
            shared.__enter__()
        except RuntimeError as err:
            errors.append(err)

    async def parent():
        with shared:
            await asyncio.create_task(child())

    with shared:
        t = threading.Thread(target=contextvars.copy_context().run, args=(copied,))
        t.start()
        t.join()
    asyncio.run(parent())
    assert len(errors) == 3 and probes() == ()

    def stream():
        with shared:
            yield

    g = stream()
    next(g)
    closer = threading.Thread(target=g.close)
    closer.start()
    closer.join()
    assert probes() == ()
    model = approx.patch(tiny_model("bert").eval(), "favor", features=8)
    calls: list[object] = []
    counted = attention_probe(lambda layer, *a: calls.append(layer))
    with torch.no_grad(), counted, counted:
        model(**batch(16))
    assert len(calls) == len(approx.patched_layers(model))
    calls.clear()  # two instances of one callable are two probes, each called (a function as a bound method)

    def record(layer, *args):
        calls.append(layer)

    with torch.no_grad(), attention_probe(record), attention_probe(record):
        model(**batch(16))
    assert len(calls) == 2 * len(approx.patched_layers(model))


def test_probe_closed_in_another_thread_stops_in_the_opening_one():
    """A generator probing its forwards, opened in one thread and closed in another: the probe stops in the thread
    that opened it, whose context the closing thread cannot change (it had stayed open there for good)."""
    import threading

    from approx.integration import attention_probe
    from approx.layer import probes

    model = approx.patch(tiny_model("bert").eval(), "favor", features=8)
    inputs = batch(16)
    seen: list[object] = []

    def stream():
        with attention_probe(lambda layer, *a: seen.append(layer)):
            yield

    g = stream()
    next(g)  # opened in this thread
    assert len(probes()) == 1
    closer = threading.Thread(target=g.close)
    closer.start()
    closer.join()
    assert probes() == ()
    with torch.no_grad():
        model(**inputs)
    assert seen == []
