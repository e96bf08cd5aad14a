"""alpha-entmax attention: a cross-check of the two entmax algorithms, gradients, sparsity and masking (its exact
limit, alpha -> 1 is softmax, and the generic padding / dtype / gradient / save-load tests are in the generic
tests, from its registration)."""

import pytest
import torch
from conftest import batch, model_output, tiny_model
from entmax import entmax15, entmax_bisect
from reference import naive_weights

import approx
from approx import ApproxAttention
from approx.attention import entmax as entmax_mod
from approx.attention.entmax import EntmaxConfig

B, H, N, D = 2, 3, 64, 16
PAD = 20  # batch row 1 has PAD padded keys at the end


def inputs(seed=0, n=N, sharp=2.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, n, D, generator=g, dtype=torch.float64) * sharp
    k = torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, n - PAD :] = False
    return q.to(dtype), k.to(dtype), v.to(dtype), mask


def layer(**options):
    return ApproxAttention("entmax", EntmaxConfig(**options), head_dim=D)


def independent(q, k, v, mask, alpha, n_iter=60):
    """alpha-entmax attention written out here with the package's bisection (no approx code involved)."""
    scores = torch.einsum("bhnd,bhsd->bhns", q.double(), k.double()) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    return torch.einsum("bhns,bhsd->bhnd", entmax_bisect(scores, alpha=alpha, dim=-1, n_iter=n_iter), v.double())


# ---------------------------------------------------------------------------------------- the mapping


@pytest.mark.parametrize("alpha", [1.5, 1.3, 2.0])
@pytest.mark.parametrize("seed", range(2))
def test_matches_an_independent_bisection(alpha, seed):
    """alpha = 1.5 runs the sort-based entmax15: it must agree with a different algorithm (the package's
    bisection, written out here) to float64 precision. Other alphas check the masking and scaling wiring."""
    assert EntmaxConfig(alpha=alpha).exact_sort == (alpha == 1.5)
    q, k, v, mask = inputs(seed)
    out = layer(alpha=alpha)(q, k, v, mask)
    ref = independent(q, k, v, mask, alpha)
    # 2^-60 bisection steps: both sides are exact to a few hundred float64 epsilons
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-13)


def test_query_blocks_equal_one_pass(monkeypatch):
    """The fast path processes queries in blocks; the weights path in one pass. Blocks of 5 rows change nothing."""
    q, k, v, mask = inputs()
    lyr = layer()
    whole = lyr(q, k, v, mask)
    monkeypatch.setattr(entmax_mod, "_CHUNK_ELEMENTS", B * H * N * 5)
    torch.testing.assert_close(lyr(q, k, v, mask), whole, rtol=0, atol=1e-13)  # matmul blocking only
    torch.testing.assert_close(whole, lyr.weights(q, k, mask) @ v.masked_fill(~mask[:, None, :, None], 0))


# ----------------------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("alpha", [1.5, 1.3])
def test_gradcheck_float64(alpha):
    """Both backward formulas (entmax15's and the bisection's implicit gradient) against finite differences,
    with a padded key and weights that are exactly zero (the piecewise branch is exercised)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 4, generator=g, dtype=torch.float64) for _ in range(3))
    q = q * 3
    mask = torch.ones(1, 7, dtype=torch.bool)
    mask[0, 5:] = False
    lyr = ApproxAttention("entmax", EntmaxConfig(alpha=alpha), head_dim=4)
    w = lyr.weights(q, k, mask)
    assert (w[..., :5] == 0).any() and (w[..., 5:] == 0).all()
    args = tuple(t.clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: lyr(a, b, c, mask), args)


# ----------------------------------------------------------------------------------- sparsity and masking


@pytest.mark.parametrize("alpha", [1.5, 1.3])
def test_rows_without_real_keys_are_finite(alpha):
    # the hazard: on a row whose scores are all -inf, entmax15 raises (a support of size 0) and the bisection
    # returns NaN
    row = torch.full((1, 4), float("-inf"))
    with pytest.raises(RuntimeError):
        entmax15(row, dim=-1)
    assert not torch.isfinite(entmax_bisect(row, alpha=alpha, dim=-1)).any()
    q, k, v, mask = inputs(dtype=torch.float32)
    mask[1] = False  # batch row 1 has no real key at all
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = layer(alpha=alpha)(q, k, v, mask)
    assert torch.isfinite(out).all()
    out.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    # ... and the neighbouring batch row is unaffected
    with torch.no_grad():
        torch.testing.assert_close(out[0], layer(alpha=alpha)(q[:1], k[:1], v[:1], None)[0])


def test_exact_zeros_grow_with_alpha_and_padded_keys_get_none():
    q, k, v, mask = inputs(sharp=3.0)
    zeros = {}
    for alpha in (1.3, 1.5, 2.0):
        w = layer(alpha=alpha).weights(q, k, mask)  # (B, H, N, S)
        assert (w[1, :, :, N - PAD :] == 0).all(), "padded keys get attention"
        torch.testing.assert_close(w.sum(-1), torch.ones_like(w[..., 0]))
        zeros[alpha] = (w[0] == 0).double().mean().item()
    assert (naive_weights(q, k, mask)[0] > 0).all()  # softmax has no exact zero here ...
    assert 0.5 < zeros[1.3] < zeros[1.5] < zeros[2.0], zeros  # ... entmax has many, more as alpha grows


def test_poisoned_padding_changes_nothing():
    q, k, v, mask = inputs()
    out = layer()(q, k, v, mask)
    k2, v2 = k.clone(), v.clone()
    k2[1, :, N - PAD :] = 1e4
    v2[1, :, N - PAD :] = float("inf")
    torch.testing.assert_close(layer()(q, k2, v2, mask), out, rtol=0, atol=1e-13)


@pytest.mark.parametrize("alpha", [1.5, 1.3])
def test_restricting_keys_to_a_superset_of_the_support_changes_nothing(alpha):
    """The property Sparsefinder relies on: entmax over any superset of its support is the same distribution."""
    q, k, v, _ = inputs(sharp=3.0)
    q = q[:, :1, :2]  # 2 queries of one head, so the union of their supports leaves keys out
    k, v = k[:, :1], v[:, :1]
    lyr = layer(alpha=alpha)
    support = (lyr.weights(q, k, None) > 0).any(-2)[:, 0]  # (B, S)
    assert 0 < support.double().mean() < 0.5
    out = lyr(q, k, v, None)
    torch.testing.assert_close(lyr(q, k, v, support), out, rtol=0, atol=1e-13)
    # removing one key inside the support does change it (the check above could fail)
    first = support.double().argmax(-1)
    smaller = support.clone()
    smaller[torch.arange(B), first] = False
    assert (lyr(q, k, v, smaller) - out).abs().max() > 1e-3


def test_dropout_acts_on_the_weights():
    q, k, v, mask = inputs()
    assert torch.equal(layer()(q, k, v, mask, dropout=1.0), torch.zeros_like(q))
    assert torch.equal(layer()(q, k, v, mask, dropout=0.0), layer()(q, k, v, mask))


def test_cost_is_dense():
    for alpha in (1.5, 1.3):
        c = approx.get_method("entmax").cost(EntmaxConfig(alpha=alpha), n=512, s=256, d=64, dv=32)
        assert c.qk_pairs == 512 * 256 and c.flops > 2 * 512 * 256 * (64 + 32)


# ------------------------------------------------------------------------------------------- bad options


@pytest.mark.parametrize(
    "options, words",
    [
        ({"alpha": 1.0}, ["alpha", "'full'"]),
        ({"alpha": 1}, ["alpha", "'full'"]),
        ({"alpha": 0.5}, ["alpha", "> 1"]),
        ({"alpha": float("nan")}, ["alpha", "finite"]),
        ({"alpha": float("inf")}, ["alpha", "finite"]),
        ({"alpha": "1.5"}, ["alpha", "number"]),
        ({"alpha": True}, ["alpha", "number"]),
        ({"n_iter": 0}, ["n_iter"]),
        ({"n_iter": 2.5}, ["n_iter", "integer"]),
        ({"alpah": 1.5}, ["did you mean 'alpha'"]),
    ],
)
def test_bad_options(options, words):
    with pytest.raises(ValueError) as e:
        approx.get_method("entmax").make_config(**options)
    for w in words:
        assert w in str(e.value)


# ------------------------------------------------------------------------------------------------- model


def test_patched_tiny_bert():
    """Runs and is finite; alpha -> 1 is close to the unpatched (softmax) model; unpatch is bit-exact."""
    model = tiny_model("bert")
    inputs_ = batch(48, pad=13)
    with torch.no_grad():
        ref = model_output(model, **inputs_)
        approx.patch(model, "entmax")
        out = model_output(model, **inputs_)
        approx.patch(model, "entmax", alpha=1.001)
        near = model_output(model, **inputs_)
        approx.unpatch(model)
        restored = model_output(model, **inputs_)
    assert torch.isfinite(out).all() and torch.isfinite(near).all()
    assert not torch.equal(out, ref), "the patch had no effect, so this test could not fail"
    assert (near - ref).abs().max() < 0.01 * (out - ref).abs().max()
    assert torch.equal(restored, ref)
    assert not approx.is_patched(model)


# ------------------------------------------------------------------------------ issue 15: nothing silent


def test_alpha_a_hair_above_one_is_softmax_not_nan():
    """1 + 1e-9 rounds to 1 in float32 (the bisection divides by alpha - 1 = 0): it is computed in float64
    and is softmax up to ~1e-9; closer to 1 than float64 can resolve is refused, naming 'full'."""
    q, k, v, mask = inputs(dtype=torch.float32)
    out = layer(alpha=1 + 1e-9)(q, k, v, mask)
    assert torch.isfinite(out).all()
    exact = torch.einsum("bhns,bhsd->bhnd", naive_weights(q, k, mask), v.double())
    assert (out.double() - exact).abs().max() < 1e-5
    with pytest.raises(ValueError, match="'alpha'.*'full'"):
        EntmaxConfig(alpha=1 + 1e-12)


@pytest.mark.parametrize("n_iter", [1, 2, 3, 6])
@pytest.mark.parametrize("alpha", [1.3, 2.0])
def test_few_bisection_steps_do_not_depend_on_padding(alpha, n_iter):
    """With few bisection steps, the real tokens' outputs equal those of the package's bisection on the real
    keys alone (padding must not widen the bracket), for any amount of padding."""
    q, k, v, mask = inputs()
    lyr = layer(alpha=alpha, n_iter=n_iter)
    n_real = N - PAD
    reference = independent(q[1:, :, :n_real], k[1:, :, :n_real], v[1:, :, :n_real], None, alpha, n_iter)
    for extra in (0, 200):
        pad = lambda x: torch.cat([x, torch.randn(B, H, extra, x.shape[-1], dtype=x.dtype)], dim=2)  # noqa: E731
        m = torch.cat([mask, torch.zeros(B, extra, dtype=torch.bool)], dim=1)
        out = lyr(pad(q), pad(k), pad(v), m)
        torch.testing.assert_close(out[1:, :, :n_real], reference, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sharp", [3.0, 0.05])
def test_partial_sort_on_long_rows_matches_the_bisection(sharp):
    """Rows longer than ``_entmax.PARTIAL_SORT`` sort only their largest scores first; with flat scores the support
    overflows them and the row is solved again (sharp = 0.05: supports of well over 64 keys). Both against the
    package's bisection written out here."""
    from approx.attention import _entmax

    n = 3 * _entmax.PARTIAL_SORT + 11
    q, k, v, mask = inputs(7, n=n, sharp=sharp)
    out = layer()(q, k, v, mask)
    support = (layer().weights(q, k, mask) > 0).sum(-1)
    assert (support > _entmax.PARTIAL_SORT).any() == (sharp < 1)  # flat rows take the retry path
    torch.testing.assert_close(out, independent(q, k, v, mask, 1.5), rtol=0, atol=1e-13)
