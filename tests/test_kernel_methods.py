"""The kernelised methods (linear, Taylor, Efficient Attention, and FAVOR+ through the same helper): each against
its paper's dense float64 formula (``tests/reference.py``), at several shapes, with padding and S != N, in half
precision, with gradients; the shared helper's chunking against one chunk. The generic tests
(``test_methods.py``) cover the rest (padding invariance, poisoned padding, weights, dropout, cost, fallback)."""

import math

import pytest
import torch
from reference import KERNEL_ATTENTION

import approx
from approx import ApproxAttention
from approx.attention import _kernelized
from approx.attention.favor import FavorConfig

KERNELS = ["linear", "efficient", "taylor"]


def qkv(batch, heads, n, s, d, dv, *, seed=0, size=1.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = size * torch.randn(batch, heads, n, d, generator=g, dtype=torch.float64)
    k = size * torch.randn(batch, heads, s, d, generator=g, dtype=torch.float64)
    v = torch.randn(batch, heads, s, dv, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def key_mask(batch, s, seed=0):
    """Row 0 unpadded, the others padded at the end to random lengths (at least one real key), and one row with
    padding at the start as well."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, s, dtype=torch.bool)
    for row in range(1, batch):
        mask[row, int(torch.randint(1, s + 1, (1,), generator=g)) :] = False
    if batch > 2 and s > 3:
        mask[2, :2] = False
        mask[2, 2] = True
    return mask


def layer(method, d, **options):
    return ApproxAttention(method, approx.get_method(method).make_config(**options), head_dim=d)


def reference(method, q, k, v, mask, dtype=torch.float64):
    return KERNEL_ATTENTION[method](q, k, v, mask, q.shape[-1] ** -0.5, dtype=dtype)


SHAPES = [  # (batch, heads, n, s, d, dv)
    (1, 1, 1, 1, 4, 4),
    (2, 3, 17, 17, 8, 5),
    (3, 2, 33, 70, 16, 16),  # S > N
    (3, 2, 70, 9, 16, 24),  # S < N
    (1, 12, 130, 130, 64, 64),
]


@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "slices"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("method", KERNELS)
def test_equals_the_float64_formula(monkeypatch, method, shape, sliced):
    """The fast path (chunked, padded keys removed) equals the paper's dense formula over the real keys, with
    S != N (a key mask, no query mask) and with rows of very different lengths; also with the batch taken an item
    at a time (``sliced``: what CPU inference does with batches of short inputs too large for the cache)."""
    if sliced:
        monkeypatch.setattr(_kernelized, "_SLICE_ELEMENTS", 1)
    batch, heads, n, s, d, dv = shape
    q, k, v = qkv(*shape, seed=sum(shape), size=1.5)
    mask = key_mask(batch, s, seed=n)
    v = v.masked_fill(~mask[:, None, :, None], 1e9)  # padded values must not leak into any sum
    out = layer(method, d)(q, k, v, mask)
    assert out.shape == (batch, heads, n, dv) and out.dtype == torch.float64
    torch.testing.assert_close(out, reference(method, q, k, v, mask), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("method", KERNELS)
def test_no_mask_equals_an_all_real_mask(method):
    q, k, v = qkv(2, 2, 40, 40, 8, 8)
    lyr = layer(method, 8)
    torch.testing.assert_close(lyr(q, k, v, None), lyr(q, k, v, torch.ones(2, 40, dtype=torch.bool)))
    torch.testing.assert_close(lyr(q, k, v, None), reference(method, q, k, v, None), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("method", KERNELS)
def test_attention_scale_is_not_used(method):
    """A different kernel, not softmax: the softmax scale does not enter it (the docstrings say why)."""
    q, k, v = qkv(1, 2, 30, 30, 8, 8)
    lyr = layer(method, 8)
    torch.testing.assert_close(lyr(q, k, v, None, scale=1.0), lyr(q, k, v, None, scale=0.01), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", KERNELS)
def test_half_precision_within_rounding_of_the_float64_formula(method, dtype):
    """Half inputs are computed and summed in float32: against the float64 formula on the same (rounded) inputs,
    the error is the output's rounding to ``dtype`` plus a few times the plain float32 computation's error.
    Long rows (2000 keys) make sums accumulated in half precision fail this (their error grows with S)."""
    q, k, v = qkv(2, 2, 300, 2000, 16, 16, size=1.5, dtype=dtype)
    mask = torch.ones(2, 2000, dtype=torch.bool)
    mask[1, 1500:] = False
    out = layer(method, 16)(q, k, v, mask)
    assert out.dtype == dtype
    ref = reference(method, q, k, v, mask)
    plain32 = (reference(method, q, k, v, mask, dtype=torch.float32).double() - ref).abs().max()
    bound = torch.finfo(dtype).eps * ref.abs() + 4 * plain32
    assert ((out.double() - ref).abs() <= bound).all(), float(((out.double() - ref).abs() - bound).max())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", KERNELS)
def test_large_inputs_do_not_overflow_in_half_precision(method, dtype):
    q, k, v = qkv(1, 2, 200, 200, 16, 16, size=30.0)
    mask = torch.ones(1, 200, dtype=torch.bool)
    mask[0, 150:] = False
    out = layer(method, 16)(q.to(dtype), k.to(dtype), v.to(dtype), mask)
    assert torch.isfinite(out).all()
    # the implied weights are a distribution over real values: outputs stay within their range
    assert out.double().abs().max() <= v[0, :, :150].abs().max() * (1 + 1e-2)


@pytest.mark.parametrize("method", KERNELS)
def test_gradcheck_float64(method):
    q, k, v = qkv(2, 2, 7, 9, 4, 3, seed=3)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    lyr = layer(method, 4)
    args = tuple(t.clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: lyr(a, b, c, mask), args)


@pytest.mark.parametrize("method", KERNELS)
def test_gradients_match_the_float64_formula(method):
    """Gradients of the (out-of-place) autograd path equal those of the paper's formula."""
    q, k, v = qkv(2, 2, 20, 25, 8, 8, seed=5)
    mask = torch.ones(2, 25, dtype=torch.bool)
    mask[1, 18:] = False
    w = torch.randn(2, 2, 20, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    grads = []
    for f in (lambda a, b, c: layer(method, 8)(a, b, c, mask), lambda a, b, c: reference(method, a, b, c, mask)):
        args = tuple(t.clone().requires_grad_() for t in (q, k, v))
        (f(*args) * w).sum().backward()
        grads.append([a.grad for a in args])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


CHUNKED = [("linear", {}), ("efficient", {}), ("taylor", {}), ("favor", {}), ("favor", {"kernel": "relu"})]


@pytest.mark.parametrize("method, options", CHUNKED)
def test_tiny_chunks_equal_one_chunk(monkeypatch, method, options):
    """The shared helper runs over chunks of keys (with a running maximum per head or per feature where features
    are exponential) and of queries; chunks of 3 rows (not dividing N or S), a first chunk made of padding only
    and a later chunk that raises the maximum give the one-chunk result, on both the in-place (no gradient) and
    the autograd path."""
    q, k, v = qkv(3, 2, 40, 50, 8, 6, seed=7)
    k = k.clone()
    k[:, :, 30:] *= 4  # later chunks raise the running maxima (of some channels more than others)
    mask = key_mask(3, 50, seed=1)
    mask[0, :5] = False  # the first chunk of row 0 holds no real key
    lyr = layer(method, 8, **options)
    one = lyr(q, k, v, mask)  # one chunk: 512 rows
    monkeypatch.setattr(_kernelized, "_CHUNK", 3)
    torch.testing.assert_close(lyr(q, k, v, mask), one, rtol=1e-12, atol=1e-12)
    monkeypatch.setattr(_kernelized, "_SLICE_ELEMENTS", 1)  # and each batch item its own slice
    torch.testing.assert_close(lyr(q, k, v, mask), one, rtol=1e-12, atol=1e-12)
    with_grad = lyr(q.clone().requires_grad_(), k, v.clone().requires_grad_(), mask)
    torch.testing.assert_close(with_grad.detach(), one, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method, options", CHUNKED)
def test_uneven_slices_equal_the_whole_batch(monkeypatch, method, options):
    """CPU inference takes a batch in slices of items (``_SLICE_ELEMENTS``): slices of 2, 2 and 1 items (the last one
    smaller, reusing the first slice's scratch memory), a padded key mask and S != N give the whole batch's float32
    output to the bit; a (1, S) key mask shared by the batch is read for every slice."""
    q, k, v = qkv(5, 3, 40, 70, 8, 6, seed=11, dtype=torch.float32)
    mask = key_mask(5, 70, seed=2)
    lyr = layer(method, 8, **options)
    whole = lyr(q, k, v, mask)
    shared = lyr(q, k, v, mask[2:3])
    # the budget counts (item, head, key) rows times the features m: FAVOR+'s option, d = 8, or Taylor's [1, q/|q|]
    m = lyr.config.features if method == "favor" else {"linear": 8, "efficient": 8, "taylor": 9}[method]
    monkeypatch.setattr(_kernelized, "_SLICE_ELEMENTS", 2 * 3 * 70 * m)
    assert _kernelized._slice_items(q, k, m) == 2
    assert torch.equal(lyr(q, k, v, mask), whole)
    assert torch.equal(lyr(q, k, v, mask[2:3]), shared)
    assert torch.equal(lyr(q, k, v, mask[2:3].expand(5, -1)), shared)


@pytest.mark.parametrize("method, options", CHUNKED)
def test_the_in_place_path_leaves_the_inputs_alone(method, options):
    """Without gradients features are computed in scratch memory and in place: never over q, k or v."""
    q, k, v = qkv(2, 2, 30, 30, 8, 8, dtype=torch.float32)
    copies = [t.clone() for t in (q, k, v)]
    with torch.no_grad():
        for mask in (None, key_mask(2, 30)):
            layer(method, 8, **options)(q, k, v, mask)
    for t, copy in zip((q, k, v), copies):
        assert torch.equal(t, copy)


def relu_feature_attention(q, k, v, omega, key_mask, scale, eps):
    """The Performer's generalised kernel in float64: phi(x) = ReLU(w.x~) + eps with x~ = sqrt(scale) x,
    out_i = sum_j (phi(q_i).phi(k_j)) v_j / sum_j phi(q_i).phi(k_j) over the real keys."""
    q, k, v, omega = q.double(), k.double(), v.double(), omega.double()

    def phi(x):
        proj = torch.einsum("bhnd,md->bhnm", x * math.sqrt(scale), omega)
        return torch.where(proj > 0, proj, torch.zeros_like(proj)) + eps

    sim = torch.einsum("bhnm,bhsm->bhns", phi(q), phi(k)) * key_mask[:, None, None, :].double()
    return torch.einsum("bhns,bhsd->bhnd", sim, v) / sim.sum(-1, keepdim=True)


@pytest.mark.parametrize("features", [5, 64])
def test_favor_relu_kernel_equals_its_float64_formula(features):
    q, k, v = qkv(2, 3, 45, 60, 16, 16, seed=2)
    mask = key_mask(2, 60)
    cfg = FavorConfig(kernel="relu", hyperbolic=False, features=features, relu_eps=1e-3)
    lyr = ApproxAttention("favor", cfg, head_dim=16)
    ref = relu_feature_attention(q, k, v, lyr.state()["omega"], mask, 16**-0.5, 1e-3)
    torch.testing.assert_close(lyr(q, k, v, mask), ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lyr.weights(q, k, mask) @ v.masked_fill(~mask[:, None, :, None], 0), ref)


@pytest.mark.parametrize("method", KERNELS)
def test_cost_is_linear_in_length(method):
    spec = approx.get_method(method)
    small, large = (spec.cost(spec.config_class(), n=n, s=n, d=64, dv=64) for n in (1024, 16384))
    assert small.qk_pairs == large.qk_pairs == 0
    assert large.flops == pytest.approx(16 * small.flops, rel=1e-6)
    assert large.matmul_macs == 16 * small.matmul_macs
    # the literature's count: phi(K)^T V and phi(Q) times it, m = d (+ 1 for Taylor's constant feature)
    m = 65 if method == "taylor" else 64
    assert small.matmul_macs == 2 * 1024 * m * 64


@pytest.mark.parametrize(
    "method, options, words",
    [
        ("linear", {"eps": 0.0}, ["eps", "0 / 0"]),
        ("linear", {"eps": math.inf}, ["eps"]),
        ("linear", {"eps": -1.0}, ["eps"]),
        ("taylor", {"exact_below": -2}, ["exact_below"]),
        ("efficient", {"scale": 1.0}, ["scale", "exact_below"]),
    ],
)
def test_bad_options_name_the_option(method, options, words):
    with pytest.raises(ValueError) as e:
        approx.get_method(method).make_config(**options)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("method", [*KERNELS, "favor"])
def test_non_finite_padding_never_reaches_a_real_row(method):
    """inf and NaN in padded keys or values (whatever a model leaves at padding) change no real output: the padded
    keys' features and values are zeroed before the sums (a mutation that kept the values survived the finite poison
    of the generic tests: 0 times NaN is NaN)."""
    q, k, v = qkv(2, 2, 20, 20, 8, 8, seed=3, dtype=torch.float32)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, 12:] = False
    lyr = layer(method, 8, **({"features": 16} if method == "favor" else {}))
    clean = lyr(q, k, v, mask)
    for poisoned in ("keys", "values"):
        bad_k, bad_v = k.clone(), v.clone()
        bad = bad_k if poisoned == "keys" else bad_v
        bad[1, :, 12:] = float("inf")
        bad[1, 0, 15:] = float("nan")
        out = lyr(q, bad_k, bad_v, mask)
        assert torch.isfinite(out[1, :, :12]).all(), poisoned
        torch.testing.assert_close(out[:, :, :12], clean[:, :, :12], rtol=0, atol=0)
        torch.testing.assert_close(out[0], clean[0], rtol=0, atol=0)
