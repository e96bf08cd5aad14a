"""FAVOR+ specific properties (the generic padding / dtype / gradient / save-load tests cover it as well)."""

import functools
import math

import pytest
import torch
from conftest import batch, model_output, tiny_model
from reference import favor_estimate, naive_attention

import approx
from approx import ApproxAttention
from approx.attention.favor import FavorConfig, random_directions, softmax_features

B, H, N, D = 2, 4, 96, 16


def inputs(seed, n=N):
    """Queries and keys with |x~|^2 = s |x|^2 about 1: the variance of positive random features grows like
    exp(|q~ + k~|^2), so at the norms of unit Gaussians in d = 16 (|x~|^2 about 4) the 1/sqrt(m) decay
    only shows at very large m (a property of FAVOR+, and why pretrained models need fine-tuning)."""
    g = torch.Generator().manual_seed(seed)
    q, k = (0.5 * torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, n - 20 :] = False
    return q, k, v, mask


def error(seed, **options):
    """Mean absolute error of FAVOR+ against float64 exact attention on the real tokens."""
    q, k, v, mask = inputs(seed)
    out = ApproxAttention("favor", FavorConfig(seed=seed, **options), head_dim=D)(q, k, v, mask)
    exact = naive_attention(q, k, v, mask)
    return (out - exact)[1, :, : N - 20].abs().mean().item() / 2 + (out - exact)[0].abs().mean().item() / 2


SEEDS = range(5)


@functools.cache
def _mean_error(options: tuple) -> float:
    return sum(error(s, **dict(options)) for s in SEEDS) / len(SEEDS)


def mean_error(**options):
    return _mean_error(tuple(sorted(options.items())))


def test_error_falls_as_features_grow():
    errors = [mean_error(features=m) for m in (16, 64, 256, 4096)]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors


def test_many_features_are_close_to_exact():
    """Monte-Carlo error shrinks like 1/sqrt(m): 8192 features must be far closer than 16 (sqrt(512) = 23x)."""
    assert mean_error(features=8192) < 0.15 * mean_error(features=16)


def test_orthogonal_beats_iid():
    for m in (64, 256):
        assert mean_error(features=m, orthogonal=True) < mean_error(features=m, orthogonal=False)


def test_hyperbolic_default_is_the_more_accurate():
    """The reason ``hyperbolic=True`` is the default: lower error at the same number of features."""
    assert FavorConfig().hyperbolic
    for m in (64, 256):
        assert mean_error(features=m, hyperbolic=True) < mean_error(features=m, hyperbolic=False)


@pytest.mark.parametrize("orthogonal", [False, True])
@pytest.mark.parametrize("hyperbolic", [False, True])
def test_softmax_kernel_estimator_is_unbiased(hyperbolic, orthogonal):
    """Mean of phi(q).phi(k) over many independent directions approaches exp(s q.k), within the Monte-Carlo
    standard error measured from the same samples. Orthogonal blocks too: each row of a block is marginally
    N(0, I) only when the QR factor's column signs are made random (LAPACK ties them to the input's diagonal; the
    bias this left, 0.90 against 1.10 for x and -x, cancels in the +-w pairs of the hyperbolic features)."""
    g = torch.Generator().manual_seed(0)
    draws = 200_000
    omega = random_directions(draws, D, orthogonal=orthogonal, generator=g).double()
    scale = D**-0.5
    for _ in range(3):
        q, k = (torch.randn(1, 1, 1, D, generator=g, dtype=torch.float64) * 0.7 for _ in range(2))
        fq = softmax_features(q, omega, scale, hyperbolic=hyperbolic)[0, 0, 0]
        fk = softmax_features(k, omega, scale, hyperbolic=hyperbolic)[0, 0, 0]
        m = fq.numel()
        samples = fq * fk * m  # each term times m is one unbiased sample of the kernel
        if hyperbolic:  # the two halves of a +-w pair are one sample
            samples = (samples[: m // 2] + samples[m // 2 :]) / 2
        target = math.exp(scale * (q * k).sum().item())
        stderr = samples.std().item() / math.sqrt(samples.numel())
        assert abs(samples.mean().item() - target) < 4 * stderr, (samples.mean().item(), target, stderr)


def test_relu_kernel_runs_and_is_a_different_approximation():
    q, k, v, mask = inputs(0)
    soft = ApproxAttention("favor", FavorConfig(), head_dim=D)(q, k, v, mask)
    relu = ApproxAttention("favor", FavorConfig(kernel="relu", hyperbolic=False), head_dim=D)(q, k, v, mask)
    assert torch.isfinite(relu).all() and (relu - soft).abs().max() > 1e-3


def test_no_overflow_in_half_precision_with_large_scores():
    q, k, v, mask = inputs(0)
    lyr = ApproxAttention("favor", FavorConfig(), head_dim=D)
    for dtype in (torch.float16, torch.bfloat16):
        out = lyr((q * 30).to(dtype), (k * 30).to(dtype), v.to(dtype), mask)  # exp(s q.k) ~ e^1000
        assert torch.isfinite(out).all(), dtype


def test_features_are_state_fixed_until_redrawn():
    model = approx.patch(tiny_model("bert"), "favor", features=64)
    inputs_ = batch(48, pad=13)
    with torch.no_grad():
        a, b = model_output(model, **inputs_), model_output(model, **inputs_)
        assert torch.equal(a, b)
        omega = approx.patched_layers(model)[0].state()["omega"].clone()
        approx.redraw(model, seed=1)
        assert not torch.equal(approx.patched_layers(model)[0].state()["omega"], omega)
        c = model_output(model, **inputs_)
        assert not torch.equal(c, a)
        approx.redraw(model, seed=1)  # the same seed gives the same features
        assert torch.equal(model_output(model, **inputs_), c)


def test_redraw_schedule():
    model = approx.patch(tiny_model("bert"), "favor", features=64)
    schedule = approx.RedrawSchedule(model, every=3, seed=5)
    omega = approx.patched_layers(model)[1].state()["omega"].clone()
    assert [schedule.step() for _ in range(6)] == [False, False, True, False, False, True]
    assert not torch.equal(approx.patched_layers(model)[1].state()["omega"], omega)
    # draw k uses seed + k, as documented: after two draws the model's state is patch(seed=7)'s, and recorded so
    # (seed + steps had survived the tests)
    drawn = approx.patch(tiny_model("bert"), "favor", features=64, seed=7)
    for i, layer in approx.patched_layers(model).items():
        assert torch.equal(layer.state()["omega"], approx.patched_layers(drawn)[i].state()["omega"])
    assert approx.settings(model)[0]["config"]["seed"] == 7
    with pytest.raises(ValueError, match="every"):
        approx.RedrawSchedule(model, every=0)


@pytest.mark.parametrize(
    "options, words",
    [
        ({"features": 0}, ["features"]),
        ({"features": 7}, ["features", "even"]),
        ({"kernel": "rbf"}, ["kernel", "'softmax'", "'relu'"]),
        ({"stabilizer": -1.0}, ["stabilizer"]),
        ({"orthogonal": "yes"}, ["orthogonal", "True or False"]),
        ({"feature": 64}, ["did you mean 'features'"]),
    ],
)
def test_bad_options(options, words):
    with pytest.raises(ValueError) as e:
        approx.get_method("favor").make_config(**options)
    for w in words:
        assert w in str(e.value)


def test_odd_features_allowed_without_hyperbolic():
    assert FavorConfig(features=7, hyperbolic=False).directions == 7
    assert FavorConfig(features=64).directions == 32


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
def test_gradcheck_float64(kernel):
    q, k, v, mask = (t[:1, :2, :12] if t.dim() == 4 else t[:1, :12] for t in inputs(0, n=12))
    mask = mask.clone()
    mask[0, 9:] = False
    cfg = FavorConfig(features=8, kernel=kernel, hyperbolic=kernel == "softmax")
    lyr = ApproxAttention("favor", cfg, head_dim=D).double()
    args = tuple(t.clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: lyr(a, b, c, mask), args)


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
def test_chunked_computation_equals_one_pass(monkeypatch, kernel):
    """The fast path runs over chunks of keys (with an online maximum) and queries; the dense weights path
    computes the same features in one pass. Small chunks exercise the rescaling."""
    from approx.attention import _kernelized

    q, k, v, mask = inputs(0)
    k = k.clone()
    k[0, :, 50:] *= 3  # a later chunk raises the running maximum
    mask[0, :10] = False  # the first chunk of row 0 has no real key
    lyr = ApproxAttention("favor", FavorConfig(kernel=kernel, hyperbolic=kernel == "softmax"), head_dim=D)
    monkeypatch.setattr(_kernelized, "_CHUNK", 8)
    out = lyr(q, k, v, mask)  # no gradient: features written to one scratch buffer per call
    dense = lyr.weights(q, k, mask) @ v.masked_fill(~mask[:, None, :, None], 0)
    torch.testing.assert_close(out, dense)
    with_grad = lyr(q.clone().requires_grad_(), k, v, mask)  # the autograd path allocates per chunk
    torch.testing.assert_close(with_grad.detach(), dense)


# ---------------------------------------------------------------- issue 15: nothing silent in FAVOR+ numerics


def _big_inputs(n, q_scale, k_scale, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = q_scale * torch.randn(1, 2, n, D, generator=g)
    k = k_scale * torch.randn(1, 2, n, D, generator=g)
    v = torch.randn(1, 2, n, D, generator=g)
    return q, k, v


def test_a_chunk_of_padding_keys_changes_no_real_output():
    """>= 512 padded positions before the real ones (a whole internal chunk of keys is padding) with
    large-norm keys: the real outputs equal those of the unpadded sequence and the float64 estimate."""
    from approx.attention import _fallback

    n_real, n_pad = 100, 600
    q, k, v = _big_inputs(n_real, 0.5, 12.0)
    g = torch.Generator().manual_seed(1)
    pad = lambda x: torch.cat([50 * torch.randn(1, 2, n_pad, D, generator=g), x], dim=2)  # noqa: E731
    mask = torch.ones(1, n_pad + n_real, dtype=torch.bool)
    mask[:, :n_pad] = False
    lyr = ApproxAttention("favor", FavorConfig(features=16), head_dim=D)
    short = lyr(q, k, v, None)
    padded = lyr(pad(q), pad(k), pad(v), mask)[:, :, n_pad:]
    reference = favor_estimate(q, k, v, lyr.state()["omega"], scale=D**-0.5)
    err = (short.double() - reference).abs().max().item()
    assert err < 1e-4
    assert (padded.double() - reference).abs().max().item() <= 2 * err + 1e-6
    _fallback.reset_counts()
    lyr(pad(q), pad(k), pad(v), mask)
    assert _fallback.counts().get("favor", 0) == 0  # the estimate itself, not a fallback


def test_rows_whose_normaliser_underflows_get_exact_attention_counted_and_warned():
    """Large-norm queries and keys: D of many rows underflows. No real row may come out as zeros: each is
    the estimate (float64) or, where it was lost, exact attention (float64), and those rows are counted."""
    from approx.attention import _fallback

    q, k, v = _big_inputs(100, 50.0, 50.0)
    lyr = ApproxAttention("favor", FavorConfig(), head_dim=D)
    _fallback.reset_counts()
    with pytest.warns(_fallback.FallbackWarning, match="favor"):
        out = lyr(q, k, v, None).double()
    exact = naive_attention(q, k, v)
    estimate = favor_estimate(q, k, v, lyr.state()["omega"], scale=D**-0.5)
    near_exact = (out - exact).abs().amax(-1) < 1e-3  # (B, H, N); float32 logits of size ~1e3
    near_estimate = (out - estimate).abs().amax(-1) < 1e-3
    assert not (out == 0).all(-1).any()
    assert (near_exact | near_estimate).all()
    assert _fallback.counts()["favor"] >= 1 and int(near_exact.sum()) >= _fallback.counts()["favor"]
    # only the counted rows are replaced: every other row keeps the estimate (not its whole batch row exact)
    assert int(near_estimate.sum()) >= near_estimate.numel() - _fallback.counts()["favor"]


def test_dense_weights_fall_back_on_the_same_rows():
    q, k, v = _big_inputs(100, 50.0, 50.0)
    lyr = ApproxAttention("favor", FavorConfig(), head_dim=D)
    w = lyr.weights(q, k, None).double()
    torch.testing.assert_close(w.sum(-1), torch.ones_like(w[..., 0]))


@pytest.mark.parametrize(
    "options, words",
    [
        ({"stabilizer": 0.0}, ["stabilizer", "NaN"]),
        ({"kernel": "relu", "relu_eps": 0.0}, ["relu_eps", "NaN"]),
        ({"kernel": "relu", "relu_eps": 1e30}, ["relu_eps", "overflow"]),
    ],
)
def test_options_that_can_only_give_nan_are_refused(options, words):
    with pytest.raises(ValueError) as e:
        FavorConfig(**options)
    for w in words:
        assert w in str(e.value)
    FavorConfig(relu_eps=0.0)  # unused by the softmax kernel: allowed


def test_dropout_is_not_ignored_silently():
    """FAVOR+ cannot drop entries of a matrix it never forms: it says so (once per place) when training."""
    q, k, v, mask = inputs(0)
    lyr = ApproxAttention("favor", FavorConfig(), head_dim=D)
    with pytest.warns(RuntimeWarning, match="dropout"):
        out = lyr(q, k, v, mask, dropout=0.1)
    assert torch.equal(out, lyr(q, k, v, mask))


def test_the_rows_that_broke_down_add_their_exact_attention_to_the_cost():
    """A batch of three sequences, the middle one's queries and keys of large norm (its normaliser underflows): the
    probe's cost of the call is FAVOR+'s on every row plus exact attention's on that batch row, at its real length
    and for every head (the replacement computes it for the whole row), and nothing for the others."""
    import warnings

    from approx import get_method
    from approx.attention import _fallback
    from approx.harness.fidelity import AttentionProbe

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 40, D, generator=g) for _ in range(3))
    q[1], k[1] = 50 * q[1], 50 * k[1]
    mask = torch.ones(3, 40, dtype=torch.bool)
    mask[1, 30:] = False  # (real length 30)
    lyr = ApproxAttention("favor", FavorConfig(features=16), head_dim=D)
    _fallback.reset_counts()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", _fallback.FallbackWarning)
        out = lyr(q, k, v, mask)
    assert _fallback.counts()["favor"] >= 1 and [r.tolist() for r in _fallback.BROKE_DOWN_ROWS] == [[1]]
    probe = AttentionProbe(total_layers=1)
    probe(lyr, q, k, v, mask, D**-0.5, out)
    favor, full = get_method("favor"), get_method("full")
    per_head = [favor.cost(lyr.config, n=m, s=m, d=D, dv=D) for m in (40, 30, 40)]
    exact_row = full.cost(full.config_class(), n=30, s=30, d=D, dv=D)
    assert probe.cost[0] == 2 * sum(c.flops for c in per_head) + 2 * exact_row.flops
    assert probe.cost[4] == 2 * sum(c.matmul_macs for c in per_head) + 2 * exact_row.matmul_macs
    lyr(q[[0, 2]], k[[0, 2]], v[[0, 2]], mask[[0, 2]])  # a call without a breakdown forgets the last one's rows
    assert _fallback.BROKE_DOWN_ROWS == []
    # the method called directly, again and again: the rows of its last breakdown alone are kept
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", _fallback.FallbackWarning)
        for _ in range(3):
            favor.attend(q, k, v, key_mask=mask, query_mask=mask, scale=D**-0.5, config=lyr.config, state=lyr.state())
    assert [r.tolist() for r in _fallback.BROKE_DOWN_ROWS] == [[1]]
    # below exact_below the row is exact anyway: no breakdown counted, and its cost is the cost model's (exact) alone
    short = ApproxAttention("favor", FavorConfig(features=16, exact_below=35), head_dim=D)
    _fallback.reset_counts()
    out = short(q, k, v, mask)
    assert _fallback.counts().get("favor", 0) == 0 and _fallback.BROKE_DOWN_ROWS == []
    probe = AttentionProbe(total_layers=1)
    probe(short, q, k, v, mask, D**-0.5, out)
    per_head = [favor.cost(short.config, n=m, s=m, d=D, dv=D) for m in (40, 30, 40)]
    assert per_head[1] == exact_row and probe.cost[0] == 2 * sum(c.flops for c in per_head)
