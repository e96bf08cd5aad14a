"""Method-level tests on plain tensors. The generic ones are driven by the registry (each method's
``test_options`` and ``exact_limit``), so a new method is covered without editing this file; the
clustered-specific ones check the paper's properties."""

import math
import re
import warnings

import pytest
import torch
from reference import KERNEL_ATTENTION, naive_attention, naive_weights

import approx
from approx import ApproxAttention, get_method
from approx.attention import _dense, _fallback, _hashing, _kernelized, _kmeans, iclustered
from approx.attention import clustered as clustered_mod

METHODS = approx.methods()
B, H, D = 2, 3, 16

# The sparse patterns run short CPU inference on SDPA over their dense mask (kernel="auto", approx/attention/_dense.py),
# and improved clustered attention recomputes its top-k scores on every query's row of keys on short inputs
# (iclustered._ROWS_UP_TO). Each generic test runs them a second time with that route off (test id METHOD@kernels),
# on the block kernels taken otherwise, so that those stay tested at these sizes too.
DENSE_ROUTED = ("window", "bigbird", "sparse-transformer", "i-clustered")
# These take a batch in slices of items in CPU inference (approx/attention/_kernelized.py, _slice_items), which the
# tests' small batches never need: each generic test runs them a second time with every item its own slice
# (METHOD@slices).
BATCH_SLICED = ("favor", "linear", "efficient", "taylor")


def with_kernels(methods):
    routed = [pytest.param(m, id=f"{m}@kernels", marks=pytest.mark.block_kernels) for m in methods if m in DENSE_ROUTED]
    sliced = [pytest.param(m, id=f"{m}@slices", marks=pytest.mark.batch_slices) for m in methods if m in BATCH_SLICED]
    return [*methods, *routed, *sliced]


@pytest.fixture(autouse=True)
def _variants(request, monkeypatch):
    if request.node.get_closest_marker("block_kernels"):
        monkeypatch.setattr(_dense, "dense_route", lambda *args, **kwargs: False)
        monkeypatch.setattr(iclustered, "_ROWS_UP_TO", 0)
    if request.node.get_closest_marker("batch_slices"):
        monkeypatch.setattr(_kernelized, "_SLICE_ELEMENTS", 1)


def make_qkv(n=120, seed=0, dtype=torch.float32, sharp=3.0, dv=D):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, n, D, generator=g, dtype=torch.float64) * sharp
    k = torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, n, dv, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def padded_mask(n, real_last_row):
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, real_last_row:] = False
    return mask


_FITTED: dict = {}


def layer(method, **options):
    """A fresh layer; a config with learned state (``requires_fit``) is fitted on the tests' own inputs
    (``make_qkv()`` with a padded row), once per option set."""
    spec = get_method(method)
    config = spec.config_class(**options)
    lyr = ApproxAttention(method, config, head_dim=D)
    if spec.requires_fit(config):
        key = (method, tuple(sorted(options.items())))
        if key not in _FITTED:
            q, k, _ = make_qkv()
            lyr.fit([(q, k, padded_mask(120, 90), D**-0.5)])
            _FITTED[key] = lyr.state()
        lyr.load_state(_FITTED[key])
    return lyr


def small_budget(method):
    """The options at which the method approximates on these inputs, from its registration."""
    return dict(get_method(method).test_options)


# ---------------------------------------------------------------------------------------------- generic


@pytest.mark.parametrize("method", with_kernels(METHODS))
def test_shape_dtype_and_finite(method):
    q, k, v = make_qkv(dv=D + 4)
    out = layer(method, **small_budget(method))(q, k, v, padded_mask(120, 90))
    assert out.shape == (B, H, 120, D + 4) and out.dtype == torch.float32
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("method", with_kernels(METHODS))
def test_padding_invariance(method):
    """Appending pad tokens leaves the outputs of real tokens unchanged (fixed seed)."""
    n_real, n_pad = 100, 37
    q, k, v = make_qkv(n_real + n_pad)
    lyr = layer(method, **small_budget(method))
    short = lyr(q[:, :, :n_real], k[:, :, :n_real], v[:, :, :n_real], None)
    padded = lyr(q, k, v, padded_mask(n_real + n_pad, n_real).logical_or(torch.tensor([[True], [False]])))
    # row 0 is unpadded at full length; row 1 has n_pad pads at the end
    torch.testing.assert_close(padded[1, :, :n_real], short[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_a_tokenizers_integer_mask_is_read_as_the_bool_mask_and_other_masks_are_refused(method):
    """A 0/1 integer key mask (a tokenizer's attention_mask: long, or uint8) gives the bool mask's output, to the bit;
    a float mask (perhaps additive: 0 at a real key), an integer other than 0/1 and a mask of another shape are
    refused, saying so, by the layer's forward, weights and graph statistics (a reviewer's finding: MonarchAttention
    read a uint8 mask's ~ as 254 and 255, silently)."""
    q, k, v = make_qkv(40)
    mask = padded_mask(40, 25)
    lyr = layer(method, **small_budget(method))
    want = lyr(q, k, v, mask)
    for dtype in (torch.long, torch.uint8, torch.int32):
        torch.testing.assert_close(lyr(q, k, v, mask.to(dtype)), want, rtol=0, atol=0, msg=str(dtype))
    with pytest.raises(TypeError, match="additive"):
        lyr(q, k, v, mask.float())
    with pytest.raises(ValueError, match="0 .padding. and 1"):
        lyr(q, k, v, mask.long() * 2)
    with pytest.raises(ValueError, match=r"a \(B, S\) = \(2, 40\) mask"):
        lyr(q, k, v, mask[:, None, None, :])
    # a (1, S) mask, one for the whole batch, is read as its (B, S) expansion (the block-sparse, LSH and Monarch
    # methods failed inside on it, and the Sparse Transformer gave wrong rows: a reviewer's finding)
    one = padded_mask(40, 25)[1:]
    torch.testing.assert_close(lyr(q, k, v, one), lyr(q, k, v, one.expand(2, -1)), rtol=0, atol=0)
    if get_method(method).weights is not None:
        torch.testing.assert_close(lyr.weights(q, k, one), lyr.weights(q, k, one.expand(2, -1)), rtol=0, atol=0)
    if get_method(method).weights is not None:
        torch.testing.assert_close(lyr.weights(q, k, mask.long()), lyr.weights(q, k, mask), rtol=0, atol=0)
        with pytest.raises(TypeError, match="additive"):
            lyr.weights(q, k, mask.float())
    if get_method(method).stats is not None:
        with pytest.raises(TypeError, match="additive"):
            lyr.graph_stats(q, k, mask.float())


@pytest.mark.parametrize("method", with_kernels(METHODS))
def test_an_input_computes_the_same_in_any_batch(method):
    """An input's outputs do not depend on the other inputs of its batch (a model's prediction for an example must
    not change with what it is batched with): each row of a padded batch equals that row run alone, unpadded."""
    q, k, v = make_qkv(120, seed=3)
    lyr = layer(method, **small_budget(method))
    batch = lyr(q, k, v, padded_mask(120, 90))
    for row, n in ((0, 120), (1, 90)):
        alone = lyr(q[row : row + 1, :, :n], k[row : row + 1, :, :n], v[row : row + 1, :, :n], None)
        torch.testing.assert_close(batch[row, :, :n], alone[0], rtol=1e-5, atol=1e-5, msg=f"row {row}")


@pytest.mark.parametrize("method", with_kernels(METHODS))
def test_left_padding_gives_the_unpadded_outputs_or_is_refused(method):
    """Pad tokens at the start of a row (a left-padding tokenizer) leave the outputs of its real tokens as they are
    without padding, or the call is refused with an error that says so; never a different result in silence."""
    n_real, n_pad = 100, 37
    q, k, v = make_qkv(n_real + n_pad)
    lyr = layer(method, **small_budget(method))
    short = lyr(q[:, :, n_pad:], k[:, :, n_pad:], v[:, :, n_pad:], None)
    mask = torch.ones(B, n_real + n_pad, dtype=torch.bool)
    mask[1, :n_pad] = False
    try:
        padded = lyr(q, k, v, mask)
    except ValueError as e:
        assert "padding must come after the real tokens" in str(e)
        return
    torch.testing.assert_close(padded[1, :, n_pad:], short[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "method, options",
    [
        ("sparsefinder", {"global_tokens": 0, "last_token": True}),
        ("sparsefinder", {"global_tokens": 2}),
        ("sparse-transformer", {"pattern": "fixed", "summary": 2}),
        ("sparse-transformer", {"pattern": "fixed", "summary": 2, "heads": "union"}),
    ],
)
def test_left_padding_is_refused_where_an_option_takes_positions_for_tokens(method, options):
    """The last real token found by counting real tokens, or the first positions: under left padding both would be
    the wrong tokens, so the forward, the weights and the graph statistics refuse the batch."""
    q, k, v = make_qkv(60)
    mask = torch.ones(B, 60, dtype=torch.bool)
    mask[1, :9] = False
    lyr = layer(method, **{**small_budget(method), **options})
    for call in (lambda: lyr(q, k, v, mask), lambda: lyr.weights(q, k, mask), lambda: lyr.graph_stats(q, k, mask)):
        with pytest.raises(ValueError, match="padding must come after the real tokens"):
            call()


@pytest.mark.parametrize("method", with_kernels(METHODS))
def test_poisoned_padding(method):
    """Padded values set to 1e9 must not leak: outputs stay finite and within the range of real values."""
    q, k, v = make_qkv()
    mask = padded_mask(120, 70)
    v = v.clone()
    v[1, :, 70:] = 1e9
    k = k.clone()
    k[1, :, 70:] = 1e3  # keys of pads that would dominate if the mask were dropped
    out = layer(method, **small_budget(method))(q, k, v, mask)
    assert torch.isfinite(out).all()
    assert out[1, :, :70].abs().max() <= v[1, :, :70].abs().max() + 1e-4


@pytest.mark.parametrize(
    "method", with_kernels([m for m in METHODS if m != "full"])
)  # full is torch's SDPA, as unpatched
def test_overflowing_padding_changes_nothing(method):
    """Padded keys and values near float32's largest value (scores, projections and sums over them overflow) leave
    every real output as it is with ordinary padding: padding is out of every sum, normaliser, landmark and feature,
    not masked after."""
    q, k, v = make_qkv()
    mask = padded_mask(120, 70)
    lyr = layer(method, **small_budget(method))
    clean = lyr(q, k, v, mask)
    k, v = k.clone(), v.clone()
    k[1, :, 70:95], k[1, :, 95:] = 3e38, -3e38
    v[1, :, 70:95], v[1, :, 95:] = -3e38, 3e38
    poisoned = lyr(q, k, v, mask)
    torch.testing.assert_close(poisoned[:, :, :70], clean[:, :, :70], rtol=0, atol=0)


@pytest.mark.parametrize("route", ["own", "exact rows"])
@pytest.mark.parametrize("method", with_kernels([m for m in METHODS if m != "full"]))
def test_non_finite_padding_never_reaches_a_real_row(method, route):
    """inf and NaN at padded keys and values (whatever a model leaves at padding) reach no real row, on the method's
    own path and on the rows it gives exact attention (``exact_below``): those had run SDPA on the inputs as they
    were, whose masked weight of 0 times an inf value, or a NaN score, is NaN. (``full`` is SDPA, as unpatched.)"""
    q, k, v = make_qkv()
    mask = padded_mask(120, 70)
    options = small_budget(method)
    if route == "exact rows":
        if "exact_below" not in get_method(method).config_class.option_names():
            pytest.skip(f"{method} has no exact rows")
        options["exact_below"] = 100  # row 1 (70 real tokens) exact, row 0 approximated
    lyr = layer(method, **options)
    clean = lyr(q, k, v, mask)
    for poisoned in ("keys", "values"):
        bad_k, bad_v = k.clone(), v.clone()
        bad = bad_k if poisoned == "keys" else bad_v
        bad[1, :, 70:95] = float("inf")
        bad[1, 0, 95:] = float("nan")
        out = lyr(q, bad_k, bad_v, mask)
        assert torch.isfinite(out[1, :, :70]).all(), poisoned
        torch.testing.assert_close(out[:, :, :70], clean[:, :, :70], rtol=0, atol=0)


@pytest.mark.parametrize("method", with_kernels(METHODS))
def test_non_finite_padding_leaves_real_outputs_and_gradients_as_finite_padding_does(method):
    """inf and NaN at padded queries, keys and values at once (a hidden state gone bad at padding): the real rows and
    the real tokens' gradients are those of finite padding. entmax's sort had crashed on a padded query's NaN scores,
    and an inf padded key or query, whose masked products are 0 in the forward, had given the real tokens NaN
    gradients (0 * inf) in most methods (a reviewer's finding)."""
    q, k, v = make_qkv()
    mask = padded_mask(120, 70)
    lyr = layer(method, **small_budget(method))

    def run(q, k, v):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = lyr(q, k, v, mask)
        (out[0].square().sum() + out[1, :, :70].square().sum()).backward()
        return out.detach(), [t.grad for t in (q, k, v)]

    out, grads = run(q, k, v)
    bad = [t.clone() for t in (q, k, v)]
    for t in bad:
        t[1, :, 70:95] = float("inf")
        t[1, 0, 95:] = float("nan")
    bad_out, bad_grads = run(*bad)
    torch.testing.assert_close(bad_out[0], out[0], rtol=0, atol=0)
    torch.testing.assert_close(bad_out[1, :, :70], out[1, :, :70], rtol=0, atol=0)
    for g, bad_g in zip(grads, bad_grads, strict=True):
        assert torch.isfinite(bad_g).all()
        torch.testing.assert_close(bad_g[0], g[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(bad_g[1, :, :70], g[1, :, :70], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_half_precision_weights_are_computed_in_float32(method):
    """A method's dense weights of bfloat16 inputs come in float32, as the forward computes (exact attention's,
    clustering's and improved clustering's had been rounded to bfloat16, full's scores too: 0.075 from softmax with
    sharp queries, further than a method at its exact limit); the integration casts them to the model's dtype."""
    spec = get_method(method)
    if spec.weights is None or spec.requires_fit(spec.config_class(**spec.test_options)):
        pytest.skip(f"{method} exposes no weights, or needs fitting first")
    q, k, v = (x.to(torch.bfloat16) for x in make_qkv(n=37, sharp=60.0))
    mask = padded_mask(37, 20)
    try:
        weights = layer(method, **small_budget(method)).weights(q, k, mask)
    except NotImplementedError:
        pytest.skip(f"{method} exposes no weights with these options")
    assert weights.dtype == torch.float32
    if method == "full":
        exact = naive_weights(q.double(), k.double(), mask)
        real = mask[:, None, :, None].expand_as(weights)
        assert (weights.double() - exact)[real].abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", with_kernels(METHODS))
def test_half_precision(method, dtype):
    q, k, v = (x.to(dtype) for x in make_qkv(dtype=torch.float32))
    mask = padded_mask(120, 90)
    lyr = layer(method, **small_budget(method))
    out = lyr(q, k, v, mask)
    assert out.dtype == dtype and torch.isfinite(out).all()
    # the same inputs (already rounded to the half type) in float32: the method's arithmetic is float32 either way
    # (sums over N would overflow float16), so the outputs differ by the output's rounding (and, for full attention,
    # by the fused kernel's half arithmetic); rounding the *inputs* moves queries across hash planes and cluster
    # boundaries, which is why this compares on rounded inputs and not with the float32 inputs' output
    ref = lyr(q.float(), k.float(), v.float(), mask)
    real = mask[:, None, :, None].expand_as(ref)
    tolerance = {torch.float16: 4e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert (out.float()[real] - ref[real]).abs().max() <= tolerance
    exact = naive_attention(q.double(), k.double(), v.double(), mask).float()[real]
    err32, err_half = (ref[real] - exact).abs().mean(), (out.float()[real] - exact).abs().mean()
    assert err_half <= 1.05 * err32 + 5e-3, (float(err_half), float(err32))  # as close to exact attention


@pytest.mark.parametrize("method", with_kernels(METHODS))
def test_autocast_leaves_the_method_its_own_precision(method):
    """Under autocast (a model run in torch.autocast, whose projections hand attention bfloat16 tensors on the CPU),
    a method computes as it does on those bfloat16 inputs without autocast: in its own precision, with its own
    buffers. Five methods had failed there on a product's dtype."""
    q, k, v = make_qkv(dtype=torch.bfloat16)
    lyr = layer(method, **small_budget(method))
    mask = padded_mask(120, 90)
    plain = lyr(q, k, v, mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = lyr(q, k, v, mask)
        weights = lyr.weights(q, k, mask) if get_method(method).weights is not None else None
    assert auto.dtype == plain.dtype and torch.equal(auto, plain)
    if weights is not None:
        assert torch.equal(weights, lyr.weights(q, k, mask))


@pytest.mark.parametrize("method", with_kernels(METHODS))
def test_gradients_flow(method):
    q, k, v = (t.requires_grad_() for t in make_qkv(dtype=torch.float32))
    out = layer(method, **small_budget(method))(q, k, v, padded_mask(120, 90))
    out.square().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


@pytest.mark.parametrize("method", with_kernels(METHODS))
def test_deterministic_under_seed(method):
    q, k, v = make_qkv()
    mask = padded_mask(120, 90)
    a = layer(method, **small_budget(method))(q, k, v, mask)
    b = layer(method, **small_budget(method))(q, k, v, mask)
    assert torch.equal(a, b)


# Settings under which a method leaves options unused (``MethodConfig.unused``: a value given for one is refused), with
# another value for each: every config class that says it leaves options unused is here
UNUSED = {  # method -> (options, other values of options they leave unused), a case per mode
    "bigbird": [({"block": 4, "random_blocks": 0}, {"seed": 7})],
    "clustered": [({"clusters": 1}, {"bits": 7, "iterations": 2, "refine": 0, "thresholds": "mean", "seed": 5})],
    "entmax": [({}, {"n_iter": 3})],
    "favor": [({"features": 16}, {"relu_eps": 0.5}), ({"features": 16, "kernel": "relu"}, {"hyperbolic": False})],
    "i-clustered": [
        ({"clusters": 1, "topk": 8}, {"bits": 7, "iterations": 2, "refine": 0, "thresholds": "mean", "seed": 5})
    ],
    "linformer": [({"projections": 8}, {"length": 16, "seed": 7})],
    "nystrom": [({"landmarks": 8, "pinv": "exact"}, {"pinv_iterations": 2})],
    "sparse-transformer": [({"stride": 16, "block": 8}, {"summary": 3})],
    "sparsefinder": [({"grouping": "distance"}, {"buckets": 4, "top_clusters": 2})],
    "window": [({"window": 0, "block": 8}, {"dilation": 3}), ({"window": 0, "global_tokens": 0}, {"dilation": 2})],
}


def test_every_method_that_leaves_options_unused_is_checked():
    overriding = [m for m in METHODS if get_method(m).config_class.unused is not approx.MethodConfig.unused]
    assert sorted(overriding) == sorted(UNUSED)


@pytest.mark.parametrize("method, base, other", [(m, *case) for m in sorted(UNUSED) for case in UNUSED[m]])
def test_an_option_said_unused_changes_nothing(method, base, other):
    """What ``unused`` names is never read: another value for it gives the same output, to the bit, and the same cost
    (it is refused when given, so it must not matter when a record holds it; at one cluster the clustered methods'
    cost had still counted a hash and a K-means that changed nothing)."""
    spec = get_method(method)
    assert set(other) <= set(spec.config_class(**base).unused())
    q, k, v = make_qkv()
    mask = padded_mask(120, 90)
    assert torch.equal(layer(method, **base)(q, k, v, mask), layer(method, **base, **other)(q, k, v, mask))
    for n in (40, 120):
        sizes = {"n": n, "s": n, "d": 16, "dv": 16}
        assert spec.cost(spec.config_class(**base), **sizes) == spec.cost(spec.config_class(**base, **other), **sizes)


@pytest.mark.parametrize("method", with_kernels(METHODS))
def test_weights_are_distributions_consistent_with_output(method):
    spec = get_method(method)
    if spec.weights is None:
        pytest.skip(f"{method} exposes no dense weights")
    q, k, v = make_qkv(dtype=torch.float64)
    mask = padded_mask(120, 90)
    lyr = layer(method, **small_budget(method))
    w = lyr.weights(q, k, mask)
    assert (w >= 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones_like(w[..., 0]))
    assert (w[1, :, :, 90:] == 0).all(), "padded keys get attention"
    # the fast path and the dense path are separate code: they must agree
    torch.testing.assert_close(lyr(q, k, v, mask), w @ v.masked_fill(~mask[:, None, :, None], 0))


@pytest.mark.parametrize("method", with_kernels(METHODS))
def test_cost_is_reported(method):
    spec = get_method(method)
    cost = spec.cost(spec.config_class(**small_budget(method)), n=1024, s=1024, d=64, dv=64)
    assert 0 <= cost.qk_pairs <= 1024 * 1024 and 0 < cost.flops
    # the literature's convention (matrix-product multiply-accumulates): every method states it, and it never
    # exceeds the full cost model (2 flops per multiply-accumulate, plus whatever else the method does)
    assert cost.matmul_macs is not None and 0 < 2 * cost.matmul_macs <= cost.flops, cost
    full = get_method("full").cost(get_method("full").config_class(), n=1024, s=1024, d=64, dv=64)
    assert full.matmul_macs == 2 * 1024 * 1024 * 64  # softmax: 2 N^2 d, the MonarchAttention paper's count
    # a batch row without a real token (all padding) costs nothing; MonarchAttention's cost had divided by zero
    empty = spec.cost(spec.config_class(**small_budget(method)), n=0, s=0, d=64, dv=64)
    assert (empty.flops, empty.qk_pairs) == (0, 0), empty


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(1, 0, 0), (0, 7, 7), (2, 5, 0), (2, 0, 6)], ids=["N=0", "B=0", "S=0", "N=0,S>0"])
def test_an_empty_input_gives_an_empty_output(method, shape):
    """No query or no key: zeros of the right shape (a softmax over no key is 0, as full attention gives), gradients
    that flow, weights of the right shape and a cost of 0 (a kernel method had counted its queries' features with no key). Eight methods had crashed here, each its own way (a chunk
    step of 0, a maximum over no key, a concatenation of no chunk)."""
    b, n, s = shape
    q = torch.randn(b, H, n, D, requires_grad=True)
    k, v = torch.randn(b, H, s, D), torch.randn(b, H, s, D + 2)
    lyr = layer(method, **small_budget(method))
    out = lyr(q, k, v, torch.ones(b, s, dtype=torch.bool) if n == s else None)
    assert out.shape == (b, H, n, D + 2) and not out.any()
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape
    if get_method(method).weights is not None:
        assert lyr.weights(q.detach(), k).shape == (b, H, n, s)
    if n == 0 or s == 0:  # (a cost is per batch row: B = 0 has no row to count)
        cost = get_method(method).cost(lyr.config, n=n, s=s, d=D, dv=D + 2)
        assert (cost.flops, cost.qk_pairs, cost.matmul_macs) == (0, 0, 0), cost


FALLBACK = [m for m in METHODS if "exact_below" in get_method(m).config_class.option_names()]


@pytest.mark.parametrize("method", with_kernels(FALLBACK))
def test_exact_below_threshold_equals_reference(method):
    """``exact_below``: a batch row with fewer real tokens gets exact attention (float64 reference); a row
    at or above the threshold (exactly at it too, as the cost model counts it) is approximated, in the same batch and
    on the whole-batch short cut."""
    q, k, v = make_qkv(dtype=torch.float64)
    mask = padded_mask(120, 90)  # row 0: 120 real tokens, row 1: 90
    ref = naive_attention(q, k, v, mask)
    out = layer(method, exact_below=100, **small_budget(method))(q, k, v, mask)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-9, atol=1e-9)
    assert (out[0] - ref[0]).abs().max() > 1e-3, "row 0 (120 >= 100 real tokens) should be approximated"
    approx_only = layer(method, **small_budget(method))(q, k, v, mask)  # default 0: never exact
    torch.testing.assert_close(out[0], approx_only[0], rtol=1e-9, atol=1e-9)
    assert (approx_only[1] - ref[1]).abs().max() > 1e-3
    everything = layer(method, exact_below=121, **small_budget(method))(q, k, v, mask)
    torch.testing.assert_close(everything, ref, rtol=1e-9, atol=1e-9)
    at = layer(method, exact_below=90, **small_budget(method))(q, k, v, mask)  # row 1 has exactly 90: approximated
    torch.testing.assert_close(at, approx_only, rtol=1e-9, atol=1e-9)
    if get_method(method).weights is None:
        return  # no dense path to check (Nystrom's implied matrix is signed)
    w = layer(method, exact_below=100, **small_budget(method)).weights(q, k, mask)
    torch.testing.assert_close(w[1], naive_weights(q, k, mask)[1], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("method", with_kernels(FALLBACK))
def test_exact_below_default_off_and_in_cost(method):
    spec = get_method(method)
    assert spec.config_class().exact_below == 0  # honest measurements by default
    on = spec.cost(spec.config_class(exact_below=2048, **small_budget(method)), n=1024, s=1024, d=64, dv=64)
    assert on.qk_pairs == 1024 * 1024
    off = spec.cost(spec.config_class(exact_below=1024, **small_budget(method)), n=1024, s=1024, d=64, dv=64)
    assert off.qk_pairs < 1024 * 1024
    with pytest.raises(ValueError, match="exact_below"):
        spec.config_class(exact_below=-1)


def test_full_matches_float64_reference():
    q, k, v = make_qkv()
    mask = padded_mask(120, 90)
    out = layer("full")(q, k, v, mask)
    ref = naive_attention(q, k, v, mask)
    err = (out.double() - ref).abs().max()
    scores = (q @ k.transpose(-1, -2)) * D**-0.5  # the plain float32 eager computation
    plain = scores.masked_fill(~mask[:, None, None, :], float("-inf")).softmax(-1) @ v
    err32 = (plain.double() - ref).abs().max()
    assert err <= 4 * err32  # within a few times the rounding error of plain float32 attention


LIMITED = [m for m in METHODS if m != "full"]


def limit_inputs(n=120, distinct=None):
    """float64 inputs at a scale where a Monte-Carlo estimate is usable (|x~|^2 about 1, as in test_favor.py);
    ``distinct``: the queries take only that many distinct values."""
    q, k, v = make_qkv(n=n, dtype=torch.float64, sharp=1.0)
    q, k = q * 0.5, k * 0.5
    if distinct is not None:
        q = q[:, :, :distinct][:, :, torch.arange(n) % distinct]
    return q, k, v


def limit_reference(limit, q, k, v, mask):
    """Softmax attention in float64, or the float64 formula of the kernel a method computes instead (``kernel``)."""
    if limit.kernel is None:
        return naive_attention(q, k, v, mask)
    assert limit.kernel in KERNEL_ATTENTION, f"no float64 reference for kernel {limit.kernel!r} in tests/reference.py"
    return KERNEL_ATTENTION[limit.kernel](q, k, v, mask, D**-0.5)


@pytest.fixture
def fallback_spy(monkeypatch):
    """Counts the calls of the shared fallback helper and of the approximation / exact paths it chooses."""
    calls = {"helper": 0, "approximate": 0, "exact": 0}
    real = _fallback.with_fallback

    def spy(approximate, exact=None, **kw):
        calls["helper"] += 1

        def counted_approximate():
            calls["approximate"] += 1
            return approximate()

        def counted_exact(rows):
            calls["exact"] += 1
            return exact(rows)

        return real(counted_approximate, None if exact is None else counted_exact, **kw)

    monkeypatch.setattr(_fallback, "with_fallback", spy)
    return calls


@pytest.mark.parametrize("method", with_kernels(LIMITED))
def test_exact_limit_while_the_approximation_runs(method, fallback_spy):
    """Every method reaches float64 exact attention along its registered ``exact_limit``, with a padded row, and
    the approximation code runs there: the shared fallback helper never takes its exact branch."""
    limit = get_method(method).exact_limit
    q, k, v = limit_inputs(distinct=limit.distinct_queries)
    mask = padded_mask(120, 90)
    ref = limit_reference(limit, q, k, v, mask)
    real = mask[:, None, :, None]  # padded query rows are meaningless: compare the real ones

    def run(**options):
        out = layer(method, **{**small_budget(method), **limit.options(120), **options})(q, k, v, mask)
        return (out - ref).masked_fill(~real, 0.0)

    if limit.approaches is None:
        assert run().abs().max() <= 1e-9
    else:
        errors = [float(run(**step).norm() / ref.masked_fill(~real, 0.0).norm()) for step in limit.approaches(120)]
        assert all(a > b for a, b in zip(errors, errors[1:])), errors
        assert errors[-1] <= limit.ratio * errors[0], errors
    assert fallback_spy["helper"], f"{method} does not compute through approx.attention._fallback.with_fallback"
    assert fallback_spy["approximate"] and not fallback_spy["exact"], (
        f"{method} took its exact fallback: the limit was reached by the fallback, not by the approximation"
    )


@pytest.mark.parametrize("n", [48, 120])
@pytest.mark.parametrize("method", with_kernels(LIMITED))
def test_test_budgets_approximate(method, n):
    """Every method but ``full`` declares an exact limit, and its ``test_options`` (the generic tests' budget, at
    both lengths the generic tests use) are not exact: the generic tests can fail."""
    spec = get_method(method)
    assert spec.exact_limit is not None, f"{method} declares no exact_limit"
    q, k, v = make_qkv(n=n, dtype=torch.float64)
    mask = padded_mask(n, n - 13)
    err = (layer(method, **small_budget(method))(q, k, v, mask) - naive_attention(q, k, v, mask)).abs()
    for row, real in ((0, n), (1, n - 13)):
        assert err[row, :, :real].max() > 1e-3, f"{method} at {small_budget(method)} is exact on {real} tokens"


# -------------------------------------------------------------------------------------- clustered family


@pytest.mark.parametrize("seed", range(5))
def test_improved_never_further_than_clustered(seed):
    """The paper's Proposition 2: L1 distance of every attention row to the exact row."""
    q, k, v = make_qkv(n=150, seed=seed, dtype=torch.float64)
    mask = padded_mask(150, 110)
    exact = naive_weights(q, k, mask)
    opts = dict(clusters=10, seed=seed)
    clus = layer("clustered", **opts).weights(q, k, mask)
    impr = layer("i-clustered", topk=8, **opts).weights(q, k, mask)
    d_clus = (clus - exact).abs().sum(-1)
    d_impr = (impr - exact).abs().sum(-1)
    assert (d_impr <= d_clus + 1e-12).all()
    assert d_impr.mean() < 0.9 * d_clus.mean()  # and strictly better on average


@pytest.mark.parametrize("seed", range(4))
def test_sync_free_kmeans_gives_the_same_clusters(seed):
    """The GPU K-means (every iteration in full, no host synchronisation) against the CPU one (incremental votes,
    stop at a fixed point): identical assignments, padding and empty clusters included."""
    g = torch.Generator().manual_seed(seed)
    n, heads, clusters = 300, 3, [5, 40][seed % 2]
    q = torch.randn(2, heads, n, D, generator=g) * torch.rand(2, heads, 1, D, generator=g) * 3
    q[:, :, : n // 3] = q[:, :, :1]  # many equal queries: fewer distinct codes than clusters for some heads
    mask = padded_mask(n, n - 70)
    state = get_method("clustered").init_state(clustered_mod.ClusteredConfig(seed=seed), head_dim=D, seed=seed)
    bits = _hashing.hash_queries(q, state["planes"], state["offsets"], mask)
    for iterations in (1, 3, 10):
        args = (bits, mask, clusters, iterations, state["salt"])
        incremental = _kmeans.hamming_kmeans(*args, sync_free=False)
        full = _kmeans.hamming_kmeans(*args, sync_free=True)
        assert torch.equal(full, incremental)


def test_incremental_kmeans_equals_full_iterations_at_scale(monkeypatch):
    """The CPU K-means compares queries with the centroids that moved only (and searches again the rows whose own
    centroid moved); at C = 100 over 3000 queries most iterations take that partial path. Against the plain
    iterations, in small row blocks: identical assignments, padding included."""
    g = torch.Generator().manual_seed(0)
    n, clusters = 3000, 100
    q = torch.randn(2, 2, n, D, generator=g) * torch.rand(2, 2, 1, D, generator=g) * 3
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, 2500:] = False
    state = get_method("clustered").init_state(clustered_mod.ClusteredConfig(), head_dim=D, seed=0)
    signs = _hashing.hash_signs(q, state["planes"], state["offsets"], mask)
    widths = []
    best_keys = _kmeans._best_keys
    monkeypatch.setattr(_kmeans, "_best_keys", lambda s, t: widths.append(t.shape[1]) or best_keys(s, t))
    monkeypatch.setattr(_kmeans, "_ROWS", 128)  # many row blocks, a short last one
    incremental = _kmeans.kmeans(signs, mask, clusters, 10, state["salt"], sync_free=False)
    assert any(w < clusters for w in widths), "the partial path never ran"
    full = _kmeans.kmeans(signs, mask, clusters, 10, state["salt"], sync_free=True)
    assert torch.equal(incremental, full)


@pytest.mark.parametrize("thresholds", ["random", "mean"])
def test_hash_codes_follow_their_definition(thresholds):
    """Bit b is set where q . a_b >= mean_b + std_b * u_b (u_b the layer's draw, or 0 with thresholds="mean"), mean
    and std over the real queries of the (batch row, head): checked against a float64 two-pass computation, on a
    cloud far from the origin and with padding, away from the thresholds (float32 rounding may flip a bit that
    sits on one); and the method clusters the codes of its own thresholds."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 200, D, generator=g, dtype=torch.float64) * 2 + 20.0
    mask = torch.ones(2, 200, dtype=torch.bool)
    mask[1, 150:] = False
    q[1, :, 150:] = 1e4  # padded queries must not move the thresholds
    config = clustered_mod.ClusteredConfig(thresholds=thresholds, refine=0)  # the hash and K-means alone
    state = layer("clustered").state()
    bits = _hashing.hash_queries(q.float(), state["planes"], clustered_mod.offsets(config, state), mask)
    proj = q @ state["planes"].double().t()  # (B, H, N, bits)
    w = mask[:, None, :, None].double()
    mean = (proj * w).sum(2, keepdim=True) / w.sum(2, keepdim=True)
    std = (((proj - mean) * w) ** 2).sum(2, keepdim=True).div(w.sum(2, keepdim=True)).sqrt()
    u = state["offsets"].double() if thresholds == "random" else 0.0
    margin = proj - (mean + std * u)
    real = mask[:, None, :, None].expand_as(margin)
    clear = (margin.abs() > 1e-3 * std) & real
    assert clear[real].float().mean() > 0.9
    assert torch.equal(bits[clear], (margin >= 0)[clear])
    signs = torch.where(bits, 1.0, -1.0)
    signs = torch.cat([signs, torch.ones_like(signs[..., :1])], dim=-1)
    expected = _kmeans.kmeans(signs, mask, config.clusters, config.iterations, state["salt"])
    assert torch.equal(clustered_mod.cluster_queries(q.float(), mask, config, state), expected)


def test_iclustered_chunks_agree_with_the_dense_path(monkeypatch):
    """Improved clustered attention reduces A^c a few series at a time and computes the blocks of queries in
    chunks; with one series and one block per chunk, the output still equals the separate dense weights path."""
    monkeypatch.setattr(iclustered, "_CENTROID_BYTES", 1)
    monkeypatch.setattr(iclustered, "_CHUNK_ROWS", 1)
    q, k, v = make_qkv(dtype=torch.float64)
    mask = padded_mask(120, 90)
    lyr = layer("i-clustered", clusters=8, topk=6)
    w = lyr.weights(q, k, mask)
    torch.testing.assert_close(lyr(q, k, v, mask), w @ v.masked_fill(~mask[:, None, :, None], 0))


def test_iclustered_applies_dropout_without_gradients(monkeypatch):
    """Attention dropout in a call that tracks no gradient (a model in train mode under no_grad) is applied where the
    blocks of queries apply it: the short-input route (every query's row of keys), which has none, is not taken."""
    q, k, v = make_qkv()
    lyr = layer("i-clustered", clusters=8, topk=16)

    def dropped():
        torch.manual_seed(0)
        with torch.no_grad():
            return lyr(q, k, v, padded_mask(120, 90), dropout=0.5)

    default = dropped()
    monkeypatch.setattr(iclustered, "_ROWS_UP_TO", 0)  # the blocks
    assert torch.equal(default, dropped())


def test_short_sequences_fall_back_to_exact():
    q, k, v = make_qkv(n=20, dtype=torch.float64)
    mask = padded_mask(20, 15)
    for method in ("clustered", "i-clustered"):
        out = layer(method, clusters=25)(q, k, v, mask)
        torch.testing.assert_close(out, naive_attention(q, k, v, mask))


def test_rows_with_few_real_tokens_fall_back_per_row():
    """A batch row with at most C real tokens is exact even when the padded length exceeds C."""
    q, k, v = make_qkv(n=60, dtype=torch.float64)
    mask = padded_mask(60, 20)  # row 1: 20 real tokens, 40 pads
    out = layer("clustered", clusters=25)(q, k, v, mask)
    torch.testing.assert_close(out[1, :, :20], naive_attention(q, k, v, mask)[1, :, :20])


def test_clustering_recovers_well_separated_groups():
    """Hand-made queries: 4 tight groups far apart are recovered exactly (up to label permutation)."""
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(4, D, generator=g) * 10
    labels = torch.arange(64) % 4
    q = centers[labels] + 1e-3 * torch.randn(64, D, generator=g)
    q = q.expand(B, H, 64, D)
    cfg = get_method("clustered").config_class(clusters=4)
    state = layer("clustered", clusters=4).state()
    assign = clustered_mod.cluster_queries(q, None, cfg, state)  # (B, H, N)
    for row in assign.reshape(-1, 64):
        pairs = set(zip(labels.tolist(), row.tolist()))
        assert len(pairs) == 4 and len({c for _, c in pairs}) == 4, pairs


def test_hash_bits_track_euclidean_distance():
    """With the bias term, near queries share more bits than far ones, also for queries far from the origin
    (without a bias, a shifted cloud would hash every query to the same side of most planes)."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, 1, 200, D, generator=g) + 50.0  # a cloud far from the origin
    state = layer("clustered").state()
    bits = _hashing.hash_queries(base, state["planes"], state["offsets"], None)[0, 0].float()
    dist = torch.cdist(base[0, 0], base[0, 0])
    ham = torch.cdist(bits, bits, p=1)
    iu = torch.triu_indices(200, 200, 1)
    corr = torch.corrcoef(torch.stack([dist[iu[0], iu[1]], ham[iu[0], iu[1]]]))[0, 1]
    assert corr > 0.5
    assert bits.mean(0).sub(0.5).abs().mean() < 0.3  # bits are informative, not constant


def test_padded_queries_take_no_part_in_clustering():
    q, k, v = make_qkv(n=80)
    mask = padded_mask(80, 50)
    q_poison = q.clone()
    q_poison[1, :, 50:] = 1e4  # padded queries far away must not drag centroids
    lyr = layer("i-clustered", clusters=8)
    torch.testing.assert_close(lyr(q_poison, k, v, mask)[1, :, :50], lyr(q, k, v, mask)[1, :, :50])


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "method, options, words",
    [
        ("clustered", {"clusters": 0}, ["clusters"]),
        ("i-clustered", {"topk": 0}, ["topk"]),
        ("clustered", {"bits": 0}, ["bits"]),
        ("clustered", {"bits": 64}, ["bits", "63"]),
        ("clustered", {"iterations": -1}, ["iterations"]),
        ("clustered", {"clusters": 2.5}, ["clusters", "integer"]),
        ("clustered", {"clusters": True}, ["clusters", "integer"]),
        ("clustered", {"topk": 3}, ["topk", "clusters"]),  # topk is an i-clustered option
        ("i-clustered", {"cluster": 3}, ["cluster", "did you mean 'clusters'"]),
        ("full", {"clusters": 3}, ["clusters", "none"]),
        ("clustered", {"refine": -1}, ["refine"]),
        ("i-clustered", {"topk_by": "members"}, ["topk_by", "'centroid'", "'spread'"]),
        ("clustered", {"topk_by": "spread"}, ["topk_by"]),  # an i-clustered option
    ],
)
def test_bad_options_name_the_option(method, options, words):
    with pytest.raises(ValueError) as e:
        get_method(method).make_config(**options)
    for w in words:
        assert w in str(e.value)


def test_unknown_method_lists_methods():
    with pytest.raises(ValueError) as e:
        get_method("i-clusterd")
    msg = str(e.value)
    assert "did you mean 'i-clustered'" in msg
    for m in METHODS:
        assert m in msg


# ------------------------------------------------------------------------------- attention dropout (issue 15)


def _with_dropout(lyr, q, k, v, mask, p):  # the output, and whether a warning said dropout is not applied
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = lyr(q, k, v, mask, dropout=p)
    return out, any("dropout" in str(w.message) for w in caught)


@pytest.mark.parametrize("method", with_kernels(METHODS))
def test_dropout_is_applied_in_training_or_announced(method):
    """In training (dropout > 0) the real outputs change, or a warning says dropout is not applied; in eval
    (transformers passes dropout = 0) they are the outputs without dropout."""
    q, k, v = make_qkv()
    mask, lyr = padded_mask(120, 90), layer(method, **small_budget(method))
    plain, real = lyr(q, k, v, mask), mask[:, None, :, None]
    assert torch.equal(lyr(q, k, v, mask, dropout=0.0), plain)
    torch.manual_seed(0)
    dropped, announced = _with_dropout(lyr, q, k, v, mask, 0.3)
    changed = not torch.equal(dropped.masked_fill(~real, 0), plain.masked_fill(~real, 0))
    assert changed != announced, f"{method}: dropout changed the outputs: {changed}, announced: {announced}"


def test_the_docs_name_the_methods_that_warn_instead_of_dropping():
    """docs/getting-started.md names the methods that never form attention weights and warn rather than drop (its
    list had gone stale as methods came): it must name exactly the methods whose call with dropout warns."""
    from pathlib import Path

    text = " ".join((Path(__file__).resolve().parent.parent / "docs" / "getting-started.md").read_text().split())
    listed = re.search(r"The methods that never form the weights \(([^)]*)\) warn once", text)
    assert listed, "the sentence naming the methods that warn is gone from getting-started.md"
    q, k, v = make_qkv()
    mask = padded_mask(120, 90)
    warning = {m for m in METHODS if _with_dropout(layer(m, **small_budget(m)), q, k, v, mask, 0.3)[1]}
    assert set(re.findall(r"`([\w-]+)`", listed.group(1))) == warning


def _mean_with_dropout(lyr, q, k, v, mask, p, draws):
    torch.manual_seed(0)
    outs = torch.stack([lyr(q, k, v, mask, dropout=p) for _ in range(draws)])
    return outs.mean(0), 6 * outs.std(0) / draws**0.5 + 1e-9  # the mean and 6 standard errors


@pytest.mark.parametrize("method", with_kernels(METHODS))
def test_dropout_keeps_the_expected_output(method):
    """Dropout on attention weights (scaled by 1 / (1 - p)) keeps the output's expectation: the mean over many
    draws is the output without dropout, within 6 standard errors; at the method's exact limit, that is float64
    exact attention."""
    q, k, v = limit_inputs()
    mask, lyr = padded_mask(120, 90), layer(method, **small_budget(method))
    real = mask[:, None, :, None]
    if _with_dropout(lyr, q, k, v, mask, 0.2)[1]:
        pytest.skip(f"{method} does not apply attention dropout (it says so)")
    mean, bound = _mean_with_dropout(lyr, q, k, v, mask, 0.2, 150)
    assert ((mean - lyr(q, k, v, mask)).abs() <= bound).masked_fill(~real, True).all()
    limit = get_method(method).exact_limit
    spec = get_method(method)
    fitted = spec.requires_fit(spec.config_class(**small_budget(method)))
    if method == "full" or (limit.approaches is None and not fitted):  # (fits are slow)
        q, k, v = limit_inputs(distinct=None if method == "full" else limit.distinct_queries)
        options = {} if method == "full" else limit.options(120)
        mean, bound = _mean_with_dropout(layer(method, **{**small_budget(method), **options}), q, k, v, mask, 0.2, 150)
        ref = naive_attention(q, k, v, mask) if method == "full" else limit_reference(limit, q, k, v, mask)
        assert ((mean - ref).abs() <= bound).masked_fill(~real, True).all()


GRAPH_METHODS = [m for m in METHODS if get_method(m).stats is not None]


@pytest.mark.parametrize("method", with_kernels(GRAPH_METHODS))
def test_a_row_of_padding_alone_adds_nothing_to_the_graph_statistics(method):
    """A batch row without a real token (all padding) is not counted: the statistics of a real row beside it are
    those of the real row alone."""
    q, k, _ = make_qkv(40)
    mask = torch.ones(B, 40, dtype=torch.bool)
    mask[1] = False
    lyr = layer(method, **small_budget(method))
    both = lyr.graph_stats(q, k, mask)
    alone = lyr.graph_stats(q[:1], k[:1], mask[:1])
    if both is None:
        pytest.skip(f"{method} reports no graph statistics")
    for name in alone:
        torch.testing.assert_close(both[name], alone[name], msg=name)


def test_kmeans_centroid_update_is_the_members_majority_and_a_tie_keeps_the_bit():
    """The Hamming K-means update, against its definition bit by bit: each centroid bit is the sign of its members'
    vote, a tied vote keeps the centroid's bit, and an empty cluster takes the fresh code given (or keeps its own).
    (The incremental and fixed-iteration paths share it, so comparing them could not catch a wrong tie rule.)"""
    g = torch.Generator().manual_seed(0)
    groups, clusters, bits = 3, 5, 7
    cent = torch.randint(0, 2, (groups, clusters, bits), generator=g).float() * 2 - 1
    members = torch.randint(0, 4, (groups, clusters), generator=g)
    members[0, 1] = 0  # an empty cluster
    members[1, 2] = 2  # two members: ties likely
    votes = torch.zeros(groups, clusters, bits + 1)
    for gi in range(groups):
        for c in range(clusters):
            for _ in range(int(members[gi, c])):
                votes[gi, c, :bits] += torch.randint(0, 2, (bits,), generator=g).float() * 2 - 1
            votes[gi, c, bits] = members[gi, c]
    fresh = torch.full((groups, clusters, bits), 7.0)
    for codes in (None, fresh):
        new, empty = _kmeans._majority(votes, cent, codes)
        for gi in range(groups):
            for c in range(clusters):
                assert bool(empty[gi, c]) == (int(members[gi, c]) == 0)
                for b in range(bits):
                    vote = float(votes[gi, c, b])
                    want = cent[gi, c, b] if vote == 0 else (1.0 if vote > 0 else -1.0)
                    if codes is not None and int(members[gi, c]) == 0:
                        want = 7.0
                    assert float(new[gi, c, b]) == want, (gi, c, b, vote)
    assert bool((votes[..., :bits] == 0).any()), "the draw should hold a tied vote"


def test_more_cost_models_are_their_formulas():
    """The cost models of the low-rank, kernel and Monarch families, entmax and i-clustered's ``spread`` against their
    formulas written out here (d != dv, so a d for a dv shows; a sixth mutation round found a Linformer E/F term
    counting keys only, Nystrom's m x m pairs, i-clustered's spread product and short-sequence caps untested):
    Nystrom: n m (d + dv) + m^2 d + m s (d + dv) + m^2 dv, plus 4 I m^3 (iterative) or 11 m^3 (SVD), flops twice
    that plus the landmark sums (n + s) d, pairs n m + m^2 + m s; Linformer: s (d + dv) pooling, + k L (d + dv)
    for E and F (random, fitted), + n k (d + dv), k at most S for mean; the kernel family (m features, f flops per
    input element): f (n + s) d + 2 (n + s) m (dv + 1) + n dv flops, (n + s) m dv products; MonarchAttention with
    t steps (b, gq = gk = n, mq = mk = n / b): pairs t gk b + t gq mk; entmax: full attention's products plus
    n s (ceil(log2 s) + 10) (exact sort) or 4 I n s (bisection)."""
    n, s, d, dv = 300, 260, 16, 24
    for pinv, extra in (("iterative", 4 * 6 * 8**3), ("exact", 11 * 8**3)):
        config = get_method("nystrom").make_config(landmarks=8, pinv=pinv, pinv_iterations=6)
        cost = get_method("nystrom").cost(config, n=n, s=s, d=d, dv=dv)
        macs = n * 8 * (d + dv) + 64 * d + 8 * s * (d + dv) + 64 * dv + extra
        assert (cost.matmul_macs, cost.flops, cost.qk_pairs) == (macs, 2 * macs + (n + s) * d, n * 8 + 64 + 8 * s)
    # more landmarks than tokens: counted at as many as there are (n = s = 20: 20 landmarks, whatever was asked)
    many = get_method("nystrom").cost(get_method("nystrom").make_config(landmarks=512, pinv="exact"), n=20, s=20, d=d,
                                      dv=dv)  # fmt: skip
    macs = 20 * 20 * (d + dv) + 400 * d + 20 * 20 * (d + dv) + 400 * dv + 11 * 20**3
    assert (many.matmul_macs, many.qk_pairs) == (macs, 3 * 400)
    for mode in ("random", "fitted"):
        config = get_method("linformer").make_config(mode=mode, projections=16, length=128)
        cost = get_method("linformer").cost(config, n=n, s=s, d=d, dv=dv)
        macs = s * (d + dv) + 16 * 128 * (d + dv) + n * 16 * (d + dv)
        assert (cost.matmul_macs, cost.flops, cost.qk_pairs) == (macs, 2 * macs, n * 16)
    short = get_method("linformer").cost(get_method("linformer").make_config(projections=64), n=n, s=40, d=d, dv=dv)
    assert short.qk_pairs == n * 40 and short.matmul_macs == 40 * (d + dv) + n * 40 * (d + dv)
    for name, m, f in (("linear", d, 3), ("efficient", d, 4), ("taylor", d + 1, 3)):
        cost = get_method(name).cost(get_method(name).make_config(), n=n, s=s, d=d, dv=dv)
        flops = f * (n + s) * d + 2 * (n + s) * m * (dv + 1) + n * dv
        assert (cost.flops, cost.matmul_macs, cost.qk_pairs) == (flops, (n + s) * m * dv, 0), name
    config = get_method("monarch").make_config(block_size=4, steps=2)
    cost = get_method("monarch").cost(config, n=16, s=16, d=d, dv=dv)
    assert cost.qk_pairs == 2 * 16 * 4 + 2 * 16 * 4
    # the entropies (a dot of length b per key block and slot, each round), and the second round's query means
    # normalised over the query blocks (two per query and key block)
    assert cost.flops == 2 * cost.matmul_macs + 2 * 2 * 16 * 4 + 2 * 1 * 16 * 4
    one = get_method("monarch").cost(get_method("monarch").make_config(block_size=16, steps=2), n=16, s=16, d=d, dv=dv)
    assert one.flops == 2 * one.matmul_macs + 16 * (d + 1)  # one key block: each slot's query mean
    # the uniform start: one more L update (the scores against each key block's mean key and the query means it
    # gives, normalised over the query blocks) and the mean keys themselves (a sum of the block's keys per block)
    uniform = get_method("monarch").cost(get_method("monarch").make_config(block_size=4, start="uniform"), n=16, s=16,
                                         d=d, dv=dv)  # fmt: skip
    ident = get_method("monarch").cost(get_method("monarch").make_config(block_size=4), n=16, s=16, d=d, dv=dv)
    assert uniform.matmul_macs == ident.matmul_macs + 2 * 16 * 4 * d and uniform.qk_pairs == ident.qk_pairs + 16 * 4
    assert uniform.flops == 2 * uniform.matmul_macs + 2 * 16 * 4 + 2 * 16 * 4 + 16 * d
    for options in ({"block_size": 16, "start": "uniform"}, {"block_size": 16, "steps": 2}):  # one block: one mean
        cost = get_method("monarch").cost(get_method("monarch").make_config(**options), n=16, s=16, d=d, dv=dv)
        assert cost.flops == 2 * cost.matmul_macs + 16 * (d + 1), options
    for alpha, mapping in ((1.5, n * s * (math.ceil(math.log2(s)) + 10)), (1.3, n * s * 4 * 50)):
        cost = get_method("entmax").cost(get_method("entmax").make_config(alpha=alpha), n=n, s=s, d=d, dv=dv)
        assert cost.flops == 2 * n * s * (d + dv) + mapping and cost.matmul_macs == n * s * (d + dv)
    c, b, it, k = 12, 31, 7, 9
    options = dict(clusters=c, bits=b, iterations=it, refine=0, topk=k)
    centroid = get_method("i-clustered").cost(get_method("i-clustered").make_config(**options), n=n, s=s, d=d, dv=dv)
    spread = get_method("i-clustered").make_config(**options, topk_by="spread")
    cost = get_method("i-clustered").cost(spread, n=n, s=s, d=d, dv=dv)
    assert cost.matmul_macs == centroid.matmul_macs + c * s * d and cost.qk_pairs == centroid.qk_pairs
    assert cost.flops == centroid.flops + 2 * n * d + 2 * c * s * d
    few = get_method("i-clustered").cost(get_method("i-clustered").make_config(**{**options, "topk": 64}), n=n, s=40,
                                         d=d, dv=dv)  # fmt: skip
    assert few.qk_pairs == c * 40 + n * 40  # at most S keys per query


def test_cost_models_are_the_docs_formulas():
    """Each cost model against the formula docs/methods.md states for it, written out here: the generic cost test
    only bounds the counts, and a K-means count off by one iteration, a halved top-k term or FAVOR+'s value products
    counted for the queries only had survived it.
    clustered: hashing 2 N B d + K-means 2 (I + 1) N C B + attention 2 C S (d + dv) (+ refine 2 N C d + 2 N d),
    C S pairs, C S (d + dv) products; i-clustered: clustered plus 2 N k (d + dv), N k pairs; FAVOR+: 2 (N + S) m' d
    for the features plus 2 (N + S) m (dv + 1), and its products the projections (N + S) m' d plus (N + S) m dv (the
    kernel family's)."""
    n, s, d, dv = 300, 260, 16, 24
    c, b, it, k = 12, 31, 7, 9
    for refine in (0, 1):
        config = get_method("clustered").make_config(clusters=c, bits=b, iterations=it, refine=refine)
        cost = get_method("clustered").cost(config, n=n, s=s, d=d, dv=dv)
        flops = 2 * n * b * d + 2 * (it + 1) * n * c * b + 2 * c * s * (d + dv) + refine * (2 * n * c * d + 2 * n * d)
        assert (cost.flops, cost.qk_pairs, cost.matmul_macs) == (flops, c * s, c * s * (d + dv))
        improved = get_method("i-clustered").make_config(clusters=c, bits=b, iterations=it, refine=refine, topk=k)
        icost = get_method("i-clustered").cost(improved, n=n, s=s, d=d, dv=dv)
        assert icost.flops == flops + 2 * n * k * (d + dv) and icost.qk_pairs == c * s + n * k
        assert icost.matmul_macs == c * s * (d + dv) + n * k * (d + dv)
    for hyperbolic, m, directions in ((True, 64, 32), (False, 64, 64)):
        config = get_method("favor").make_config(features=m, hyperbolic=hyperbolic)
        assert config.directions == directions
        cost = get_method("favor").cost(config, n=n, s=s, d=d, dv=dv)
        assert cost.flops == 2 * (n + s) * directions * d + 2 * (n + s) * m * (dv + 1) and cost.qk_pairs == 0
        assert cost.matmul_macs == (n + s) * directions * d + (n + s) * m * dv
