"""The low-rank methods (Nystrom, Linformer) and their shared segment helper, against float64 formulas written
out here with plain loops: segments of the real tokens, the paper's pseudo-inverse iteration, padding that never
enters a landmark or a segment, Linformer's three modes and its length rule, fitting through the fit hook, half
precision and gradients. The generic tests (tests/test_methods.py) cover both methods as well."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import batch, model_output, tiny_model
from reference import naive_attention

import approx
from approx import ApproxAttention, get_method
from approx.attention import _segments
from approx.attention.linformer import LinformerConfig, fit_error
from approx.attention.nystrom import NystromConfig, iterative_pinv

B, H, D = 2, 3, 8
SCALE = D**-0.5


def make(n, seed=0, dtype=torch.float64, sharp=1.0, heads=H):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads, n, D, generator=g, dtype=torch.float64) * sharp
    k = torch.randn(B, heads, n, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, heads, n, D, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def right_padded(n, real_last_row):
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, real_last_row:] = False
    return mask


def real_rows(out, ref, mask):
    """Relative error over the real query rows."""
    real = mask[:, None, :, None]
    return float((out.double() - ref).masked_fill(~real, 0).norm() / ref.masked_fill(~real, 0).norm())


# ---------------------------------------------------------------------------------------- references


def loop_segments(mask_row, m):
    """The m segments of a row's real positions: real token of rank r goes to segment r * m // n."""
    real = [j for j, keep in enumerate(mask_row.tolist()) if keep]
    n = len(real)
    return [[real[r] for r in range(n) if r * m // n == t] for t in range(m)]


def loop_resample_matrix(mask_row, length):
    """(L, S) float64: row l averages the tokens resampled to position l (segment means when n >= L, the real
    token under the position's centre when n < L)."""
    real = [j for j, keep in enumerate(mask_row.tolist()) if keep]
    n, r = len(real), torch.zeros(length, len(mask_row), dtype=torch.float64)
    if n >= length:
        for t, seg in enumerate(loop_segments(mask_row, length)):
            r[t, seg] = 1.0 / len(seg)
    else:
        for pos in range(length):
            r[pos, real[(2 * pos + 1) * n // (2 * length)]] = 1.0
    return r


def paper_pinv(a, steps):
    """Xiong et al.'s iteration, written out for one matrix."""
    z = a.T / (a.abs().sum(0).max() * a.abs().sum(1).max())
    eye = torch.eye(a.shape[0], dtype=a.dtype)
    for _ in range(steps):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def nystrom_reference(q, k, v, mask, m, pinv):
    """softmax(s Q K~^T) pinv(softmax(s Q~ K~^T)) softmax(s Q~ K_real^T) V_real, landmarks = means of the real
    tokens' segments (empty segments left out), per batch row and head, float64."""
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float64)
    for b in range(q.shape[0]):
        segs = [s for s in loop_segments(mask[b], m) if s]
        real = [j for j, keep in enumerate(mask[b].tolist()) if keep]
        for h in range(q.shape[1]):
            ql = torch.stack([q[b, h, s].mean(0) for s in segs])
            kl = torch.stack([k[b, h, s].mean(0) for s in segs])
            k1 = torch.softmax(SCALE * q[b, h] @ kl.T, -1)
            k2 = torch.softmax(SCALE * ql @ kl.T, -1)
            k3 = torch.softmax(SCALE * ql @ k[b, h, real].T, -1)
            out[b, h] = k1 @ pinv(k2) @ k3 @ v[b, h, real]
    return out


def buggy_nystrom(q, k, v, mask, m):
    """The published zero-shot baseline's landmarks: means of fixed segments of the padded sequence, zeroed
    padding included (the bug approx must not have)."""
    q, k = q.double() * mask[:, None, :, None], k.double() * mask[:, None, :, None]
    n = q.shape[2]
    ql = q.view(q.shape[0], q.shape[1], m, n // m, -1).mean(3)
    kl = k.view(k.shape[0], k.shape[1], m, n // m, -1).mean(3)
    k1 = torch.softmax(SCALE * q @ kl.transpose(-1, -2), -1)
    k2 = torch.softmax(SCALE * ql @ kl.transpose(-1, -2), -1)
    scores = (SCALE * ql @ k.transpose(-1, -2)).masked_fill(~mask[:, None, None, :], float("-inf"))
    return k1 @ torch.linalg.pinv(k2) @ torch.softmax(scores, -1) @ v.double()


def linformer_mean_reference(q, k, v, mask, m):
    """softmax over segment means of the real keys with + log(size), times the segment means of the values."""
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float64)
    for b in range(q.shape[0]):
        segs = [s for s in loop_segments(mask[b], m) if s]
        sizes = torch.tensor([len(s) for s in segs], dtype=torch.float64)
        for h in range(q.shape[1]):
            kl = torch.stack([k[b, h, s].mean(0) for s in segs])
            vl = torch.stack([v[b, h, s].mean(0) for s in segs])
            out[b, h] = torch.softmax(SCALE * q[b, h] @ kl.T + sizes.log(), -1) @ vl
    return out


def linformer_projection_reference(q, k, v, mask, e, f, bias, length):
    """softmax(s Q (E R K)^T + bias) (F R V) with R the (L, S) resampling of each row's real tokens; e, f (H, k, L)
    and bias (H, k) per head."""
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float64)
    for b in range(q.shape[0]):
        r = loop_resample_matrix(mask[b], length)
        for h in range(q.shape[1]):
            keys, values = e[h].double() @ r @ k[b, h], f[h].double() @ r @ v[b, h]
            out[b, h] = torch.softmax(SCALE * q[b, h] @ keys.T + bias[h].double(), -1) @ values
    return out


# ------------------------------------------------------------------------------------------- segments


def odd_masks(n):
    """Rows of different lengths, padding at the end, at the start and in holes, a row shorter than m."""
    mask = torch.ones(4, n, dtype=torch.bool)
    mask[1, n - 13 :] = False
    mask[2, :5] = False
    mask[2, 20:27] = False
    mask[3, 6:] = False  # 6 real tokens
    return mask


@pytest.mark.parametrize("m", [1, 4, 7, 16])
def test_segment_means_match_a_loop_over_the_real_tokens(m):
    n = 50
    mask = odd_masks(n)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, n, 5, generator=g, dtype=torch.float64)
    x = x.masked_fill(~mask[:, None, :, None], 1e9)  # padding must not enter any mean
    means, sizes = _segments.segment_means(x, mask, m)
    assert means.shape == (4, 2, m, 5) and sizes.shape == (4, m)
    for b in range(4):
        segs = loop_segments(mask[b], m)
        assert sizes[b].tolist() == [len(s) for s in segs]
        real = int(mask[b].sum())
        if real >= m:  # near-equal sizes, every segment used
            assert set(sizes[b].tolist()) <= {real // m, -(-real // m)}
        for t, seg in enumerate(segs):
            want = x[b, :, seg].mean(1) if seg else torch.zeros(2, 5, dtype=torch.float64)
            torch.testing.assert_close(means[b, :, t], want, rtol=1e-12, atol=1e-12)
    logs = _segments.log_sizes(sizes, torch.float64)
    assert torch.equal(torch.isinf(logs[:, 0, 0]), sizes == 0)


def test_segment_means_without_mask_and_their_gradient():
    x = torch.randn(2, 3, 10, 4, dtype=torch.float64, requires_grad=True)
    means, sizes = _segments.segment_means(x, None, 3)
    assert sizes.tolist() == [[4, 3, 3]] * 2  # ranks 0-3, 4-6, 7-9
    torch.testing.assert_close(means[:, :, 0], x[:, :, :4].mean(2))
    torch.autograd.gradcheck(lambda t: _segments.segment_means(t, None, 3)[0], (x,))


@pytest.mark.parametrize("length", [4, 9, 44, 50, 64])
def test_resample_matches_its_definition(length):
    """n >= L: segment means; n < L: the real token under each position's centre; padding never taken."""
    n = 50
    mask = odd_masks(n)
    x = torch.randn(4, 2, n, 3, dtype=torch.float64).masked_fill(~mask[:, None, :, None], 1e9)
    out = _segments.resample(x, mask, length)
    for b in range(4):
        want = torch.einsum(
            "ls,hsd->hld", loop_resample_matrix(mask[b], length), x[b].masked_fill(~mask[b, None, :, None], 0)
        )
        torch.testing.assert_close(out[b], want, rtol=1e-12, atol=1e-12)
    same = _segments.resample(x[:1], None, n)  # n = L: the tokens themselves
    torch.testing.assert_close(same, x[:1])


def test_attend_summaries_paths_agree():
    """The in-place sliced path (no gradient) and the autograd path give the same output."""
    q, k, v = make(40)
    bias = torch.randn(B, 1, 1, 40, dtype=torch.float64)
    with torch.no_grad():
        fast = _segments.attend_summaries(q, k, v, bias, SCALE)
    slow = _segments.attend_summaries(q.requires_grad_(), k, v, bias, SCALE)
    torch.testing.assert_close(fast, slow.detach())
    torch.testing.assert_close(fast, torch.softmax(SCALE * q.detach() @ k.transpose(-1, -2) + bias, -1) @ v)


# -------------------------------------------------------------------------------------------- nystrom


def test_iterative_pinv_converges_to_the_pseudo_inverse():
    """On well-conditioned softmax matrices (float64), of different norms in one batch: the error to
    torch.linalg.pinv falls with every step until it reaches rounding level (after 6 to 12 steps, by the machine's
    arithmetic), and is there after 12; the paper's 6 are close."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(4, 16, 16, generator=g, dtype=torch.float64) * 0.5 + 3 * torch.eye(16, dtype=torch.float64)
    a = torch.softmax(scores, -1) * torch.tensor([1.0, 2.0, 0.1, 5.0], dtype=torch.float64)[:, None, None]
    exact = torch.linalg.pinv(a)
    errors = [float((iterative_pinv(a, steps) - exact).norm() / exact.norm()) for steps in range(1, 13)]
    assert all(x > y for x, y in zip(errors, errors[1:]) if x > 1e-12), errors  # (rounding level: any order)
    assert errors[5] < 1e-3 and errors[-1] < 1e-12, errors
    for i in range(4):  # the same as the paper's iteration written out per matrix
        torch.testing.assert_close(iterative_pinv(a, 6)[i], paper_pinv(a[i], 6), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("pinv", ["exact", "iterative"])
def test_nystrom_matches_the_dense_formula_with_padding(pinv):
    """Variable lengths in one batch: landmarks are the segment means of each row's real queries and keys."""
    n, m = 60, 7
    q, k, v = make(n)
    mask = right_padded(n, 45)
    out = ApproxAttention("nystrom", NystromConfig(landmarks=m, pinv=pinv), head_dim=D)(q, k, v, mask)
    inverse = torch.linalg.pinv if pinv == "exact" else (lambda a: paper_pinv(a, 6))
    ref = nystrom_reference(q, k, v, mask, m, inverse)
    real = mask[:, None, :, None]
    torch.testing.assert_close(out.masked_fill(~real, 0), ref.masked_fill(~real, 0), rtol=1e-9, atol=1e-9)
    assert real_rows(out, naive_attention(q, k, v, mask), mask) > 1e-3  # it is an approximation here


def test_nystrom_landmarks_ignore_padding():
    """Appending padding changes nothing (landmarks are means over real tokens only), whereas the published
    baseline's landmarks (fixed segments of the padded sequence, zeroed padding averaged in) do move: this test
    would fail with that bug."""
    n, n_real, m = 64, 40, 8
    q, k, v = make(n, seed=3)
    mask = right_padded(n, n_real)
    lyr = ApproxAttention("nystrom", NystromConfig(landmarks=m), head_dim=D)
    padded = lyr(q, k, v, mask)[1, :, :n_real]
    short = lyr(q[1:, :, :n_real], k[1:, :, :n_real], v[1:, :, :n_real], None)[0]
    torch.testing.assert_close(padded, short, rtol=1e-10, atol=1e-10)
    exact_pinv = ApproxAttention("nystrom", NystromConfig(landmarks=m, pinv="exact"), head_dim=D)(q, k, v, mask)
    buggy = buggy_nystrom(q, k, v, mask, m)
    assert (exact_pinv[1, :, :n_real] - buggy[1, :, :n_real]).abs().max() > 1e-2
    torch.testing.assert_close(exact_pinv[0], buggy[0], rtol=1e-8, atol=1e-8)  # no padding: the same formula


def test_nystrom_short_rows_are_exact():
    """Rows with at most m real tokens get exact attention (iterative pinv: the fallback; exact pinv: the formula
    itself, every token its own landmark)."""
    q, k, v = make(30)
    mask = right_padded(30, 12)
    ref = naive_attention(q, k, v, mask)
    for pinv in ("iterative", "exact"):
        out = ApproxAttention("nystrom", NystromConfig(landmarks=12, pinv=pinv), head_dim=D)(q, k, v, mask)
        torch.testing.assert_close(out[1, :, :12], ref[1, :, :12], rtol=1e-9, atol=1e-9)
        assert (out[0] - ref[0]).abs().max() > 1e-3  # 30 real tokens > 12 landmarks: approximated
    spec = get_method("nystrom")
    assert spec.cost(NystromConfig(landmarks=64), n=64, s=64, d=64, dv=64).qk_pairs == 64 * 64
    assert spec.cost(NystromConfig(landmarks=64), n=65, s=65, d=64, dv=64).qk_pairs < 65 * 65 + 65 * 64 * 2


def test_nystrom_refuses_bad_options():
    for options, word in [
        ({"landmarks": 0}, "landmarks"),
        ({"pinv": "svd"}, "pinv"),
        ({"pinv_iterations": -1}, "pinv_iterations"),
    ]:
        with pytest.raises(ValueError, match=word):
            NystromConfig(**options)


# ------------------------------------------------------------------------------------------ linformer


def linformer(mode="mean", **options):
    return ApproxAttention("linformer", LinformerConfig(mode=mode, **options), head_dim=D)


def test_linformer_mean_is_exact_with_a_segment_per_token():
    """k >= the number of real keys: every pooled key is one key (log 1 = 0), in a padded batch, without any
    fallback (mean has none)."""
    q, k, v = make(40)
    mask = right_padded(40, 25)
    ref = naive_attention(q, k, v, mask)
    for kk in (40, 57):
        out = linformer(projections=kk)(q, k, v, mask)
        assert real_rows(out, ref, mask) < 1e-12
    row = linformer(projections=25)(q, k, v, mask)  # row 1 (25 real) exact, row 0 (40) approximated
    torch.testing.assert_close(row[1, :, :25], ref[1, :, :25], rtol=1e-10, atol=1e-10)
    assert (row[0] - ref[0]).abs().max() > 1e-3


def test_linformer_mean_matches_the_dense_formula_with_padding():
    q, k, v = make(50, sharp=2.0)
    mask = right_padded(50, 37)
    for kk in (1, 6, 11):
        out = linformer(projections=kk)(q, k, v, mask)
        ref = linformer_mean_reference(q, k, v, mask, kk)
        torch.testing.assert_close(out[0], ref[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(out[1, :, :37], ref[1, :, :37], rtol=1e-10, atol=1e-10)
    # without the log(size) term the pooled keys would not carry their segments' mass: a different result
    q1 = linformer(projections=6)(q, k, v, mask)
    k_means, sizes = _segments.segment_means(k, mask, 6)
    v_means, _ = _segments.segment_means(v, mask, 6)
    no_log = torch.softmax(SCALE * q @ k_means.transpose(-1, -2), -1) @ v_means
    assert (no_log[0] - q1[0]).abs().max() > 1e-3 and len(set(sizes[1].tolist())) > 1


def test_linformer_mean_weights_are_the_dense_formula():
    q, k, v = make(30)
    mask = right_padded(30, 22)
    lyr = linformer(projections=5)
    w = lyr.weights(q, k, mask)
    for b in range(B):
        segs = [s for s in loop_segments(mask[b], 5) if s]
        for h in range(H):
            kl = torch.stack([k[b, h, s].mean(0) for s in segs])
            p = torch.softmax(SCALE * q[b, h] @ kl.T + torch.tensor([len(s) for s in segs]).double().log(), -1)
            want = torch.zeros(30, 30, dtype=torch.float64)
            for t, s in enumerate(segs):
                want[:, s] = p[:, t : t + 1] / len(s)
            torch.testing.assert_close(w[b, h], want, rtol=1e-10, atol=1e-12)
    for mode in ("random", "fitted"):
        with pytest.raises(NotImplementedError, match="not a distribution"):
            linformer(mode, projections=5).weights(q, k, mask)


def test_linformer_random_is_seeded_state_and_matches_the_formula():
    q, k, v = make(40)
    mask = right_padded(40, 29)
    a, b = linformer("random", projections=6, length=16, seed=1), linformer("random", projections=6, length=16, seed=1)
    c = linformer("random", projections=6, length=16, seed=2)
    assert torch.equal(a(q, k, v, mask), b(q, k, v, mask))
    assert not torch.equal(a(q, k, v, mask), c(q, k, v, mask))
    e = a.state()["proj_e"]
    assert e.shape == (6, 16) and abs(float(e.var()) - 1 / 6) < 0.06  # N(0, 1/k) entries
    c.load_state_dict(a.state_dict())  # the state is what is saved: another seed's layer then agrees
    assert torch.equal(c(q, k, v, mask), a(q, k, v, mask))
    state = a.state()
    ref = linformer_projection_reference(
        q, k, v, mask, state["proj_e"].expand(H, -1, -1), state["proj_f"].expand(H, -1, -1), torch.zeros(H, 6), 16
    )
    out = a(q, k, v, mask)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out[1, :, :29], ref[1, :, :29], rtol=1e-10, atol=1e-10)
    a.redraw(5)  # random state is redrawn on request
    assert not torch.equal(a.state()["proj_e"], state["proj_e"])


def structured(n, seed=0, heads=2):
    """Queries and keys from 4 latent dims plus noise, values random; row 1 padded by 10."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(heads, 4, D, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
    q = torch.einsum("bhnr,hrd->bhnd", torch.randn(B, heads, n, 4, generator=g, dtype=torch.float64), u)
    k = torch.einsum("bhnr,hrd->bhnd", torch.randn(B, heads, n, 4, generator=g, dtype=torch.float64), u)
    q, k = q + 0.1 * torch.randn_like(q), k + 0.1 * torch.randn_like(k)
    v = torch.randn(B, heads, n, D, generator=g, dtype=torch.float64)
    return q.float(), k.float(), v.float(), right_padded(n, n - 10)


_FITTED = {}


def fitted_layer(with_values: bool) -> ApproxAttention:
    """mode="fitted" at k = 8, L = 48, fitted on structured(48) (with or without the values), cached."""
    lyr = ApproxAttention("linformer", LinformerConfig(mode="fitted", projections=8, length=48), head_dim=D)
    if with_values not in _FITTED:
        q, k, v, mask = structured(48)
        sample = (q, k, mask, SCALE, v) if with_values else (q, k, mask, SCALE)
        lyr.fit([sample], steps=150, lr=0.005)
        _FITTED[with_values] = lyr.state()
    lyr.load_state(_FITTED[with_values])
    return lyr


@pytest.mark.parametrize("with_values", [True, False])
def test_fitting_lowers_the_output_error_on_its_data(with_values):
    """At the same k, the fitted projections beat mean pooling and random projections on the data they were
    fitted to: on the output error (with values) or on the implied matrix's error (the harness's samples carry
    no values), and in both cases on the output."""
    q, k, v, mask = structured(48)
    ref = naive_attention(q, k, v, mask)
    lyr = fitted_layer(with_values)
    errors = {
        mode: real_rows(linformer(mode, projections=8, length=48)(q, k, v, mask), ref, mask)
        for mode in ("mean", "random")
    }
    fitted = real_rows(lyr(q, k, v, mask), ref, mask)
    assert fitted < 0.8 * errors["mean"] and fitted < 0.8 * errors["random"], (fitted, errors)
    if not with_values:
        sample = [(q, k, mask, SCALE)]
        mean = fit_error(LinformerConfig(mode="mean", projections=8, length=48), {}, sample)
        assert fit_error(lyr.config, lyr.state(), sample) < 0.8 * mean
    state = lyr.state()
    assert state["proj_e"].shape == (2, 8, 48) and int(state["fitted"]) == 1
    torch.testing.assert_close(state["proj_f"].sum(-1), torch.ones(2, 8))  # implied rows sum to 1
    constant = torch.ones_like(v)  # so a constant value passes unchanged
    torch.testing.assert_close(lyr(q, k, constant, mask), constant, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_values", [True, False])
def test_the_fit_learns_nothing_from_a_row_of_padding_alone(with_values):
    """A batch row whose attention mask is all zeros (run by the attention as if every token were real, to keep its
    output finite) adds nothing to the fit's loss: the fitted state is the one without it (to rounding: the sums
    run over one more row of zeros). Samples of such rows alone are refused, by the fit and by ``fit_error``."""
    q, k, v, mask = structured(48)
    g = torch.Generator().manual_seed(5)
    garbage = [10 * torch.randn(1, *x.shape[1:], generator=g) for x in (q, k, v)]
    padded = [torch.cat([x, y]) for x, y in zip((q, k, v), garbage)]
    mask_padded = torch.cat([mask, torch.zeros(1, mask.shape[1], dtype=torch.bool)])
    config = LinformerConfig(mode="fitted", projections=8, length=48)
    fit = get_method("linformer").fit

    def sample(q, k, v, mask):
        return (q, k, mask, SCALE, v) if with_values else (q, k, mask, SCALE)

    fitted = fit(config, {}, [sample(q, k, v, mask)], steps=30, lr=0.005)
    with_row = fit(config, {}, [sample(*padded, mask_padded)], steps=30, lr=0.005)
    for name in ("proj_e", "proj_f", "bias"):
        torch.testing.assert_close(with_row[name], fitted[name], rtol=1e-4, atol=1e-5, msg=name)
    nothing = [sample(q, k, v, torch.zeros_like(mask))]
    with pytest.raises(ValueError, match="every row of the samples is padding"):
        fit(config, {}, nothing, steps=1)
    with pytest.raises(ValueError, match="every row of the samples is padding"):
        fit_error(config, fitted, nothing)


@pytest.mark.parametrize("n, n_real", [(48, 48), (80, 71), (30, 22), (20, 9)])
def test_fitted_projections_follow_the_length_rule(n, n_real):
    """At another length the fitted E, F act on the real tokens resampled to L (segment means above L, the
    token under each position below): the dense formula with those resampling matrices; padding excluded."""
    lyr = fitted_layer(True)
    q, k, v = make(n, heads=2, dtype=torch.float32)
    mask = right_padded(n, n_real)
    state = lyr.state()
    ref = linformer_projection_reference(q, k, v, mask, state["proj_e"], state["proj_f"], state["bias"], 48)
    out = lyr(q, k, v, mask)
    real = mask[:, None, :, None]
    if n_real > 8:  # at most k real tokens: exact attention (the budget)
        torch.testing.assert_close(out.masked_fill(~real, 0).double(), ref.masked_fill(~real, 0), rtol=1e-4, atol=1e-5)
    else:
        torch.testing.assert_close(
            out[1, :, :n_real].double(), naive_attention(q, k, v, mask)[1, :, :n_real], rtol=1e-5, atol=1e-5
        )
    short = lyr(q[1:, :, :n_real], k[1:, :, :n_real], v[1:, :, :n_real], None)[0]
    torch.testing.assert_close(out[1, :, :n_real], short, rtol=1e-5, atol=1e-6)


def test_unfitted_projections_refuse_to_run():
    q, k, v = make(20)
    lyr = linformer("fitted", projections=4)
    with pytest.raises(RuntimeError, match=r"fit first with approx\.fit"):
        lyr(q, k, v, None)
    with pytest.raises(RuntimeError, match="mode='mean' and mode='random' need no fit"):
        lyr(q[:, :, :3], k[:, :, :3], v[:, :, :3], None)  # even where the budget would make it exact
    state = fitted_layer(True).state()
    state["proj_e"] = state["proj_e"][:1]
    state["proj_f"], state["bias"] = state["proj_f"][:1], state["bias"][:1]
    one_head = ApproxAttention("linformer", LinformerConfig(mode="fitted", projections=8, length=48), head_dim=D)
    one_head.load_state(state)
    with pytest.raises(ValueError, match="fitted for 1 heads"):
        one_head(*make(20, dtype=torch.float32), None)


def test_which_configs_need_a_fit():
    spec = get_method("linformer")
    assert spec.needs_fit  # some of its configs are learned
    assert spec.requires_fit(LinformerConfig(mode="fitted"))
    assert not spec.requires_fit(LinformerConfig()) and not spec.requires_fit(LinformerConfig(mode="random"))
    sparsefinder = get_method("sparsefinder")
    assert sparsefinder.requires_fit(sparsefinder.config_class())
    assert not get_method("nystrom").needs_fit and not get_method("nystrom").requires_fit(NystromConfig())
    with pytest.warns(UserWarning, match="nothing to fit"):
        linformer().fit([tuple(make(10)[:2]) + (None, SCALE)])
    lyr = fitted_layer(True)
    before = lyr.state()["proj_e"].clone()
    lyr.redraw(3)  # learned state is kept
    assert torch.equal(lyr.state()["proj_e"], before)


def test_model_fit_through_the_hook_and_harness_refusals(tmp_path, capsys):
    """approx.fit learns the fitted mode's state on a tiny model (the model then runs and its state survives
    load_state_dict); a mean-mode model has nothing to fit; the CLI and the evaluation harness refuse an
    unfitted mode="fitted" and accept the other modes."""
    from approx.harness.cli import main
    from approx.harness.evaluation import _setups

    options = dict(mode="fitted", projections=8, length=32)
    model = approx.patch(tiny_model("bert"), "linformer", **options)
    with pytest.raises(RuntimeError, match="fit first"):
        model(**batch(40, pad=9))
    report = approx.fit(model, [batch(40, pad=9)], progress=False, steps=10)
    assert report["layers"] == [0, 1]
    with torch.no_grad():
        out = model_output(model, **batch(40, pad=9))
        assert torch.isfinite(out).all()
        other = approx.patch(tiny_model("bert"), "linformer", **options)
        other.load_state_dict(model.state_dict())
        assert torch.equal(model_output(other, **batch(40, pad=9)), out)
    assert approx.fit(approx.patch(tiny_model("bert"), "linformer"), [batch(16)], progress=False)["layers"] == []
    assert main(["fit", "--method", "linformer:mode=mean,projections=8", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err  # the options that give it learned state, written into the spec
    assert "learns its state only with mode=fitted: --method linformer:mode=fitted,projections=8" in err
    assert main(["fit", "--method", "favor", "--output-dir", str(tmp_path)]) == 2
    assert "nothing to fit with these options; methods with learned state: linformer (with mode=fitted)" in (
        capsys.readouterr().err
    )
    with pytest.raises(ValueError, match="must be fitted"):
        _setups(["linformer:mode=fitted"], 0, 4)
    assert [s.method for s in _setups(["linformer", "linformer:mode=random", "nystrom"], 0, 4)] == ["linformer"] * 2 + [
        "nystrom"
    ]


def test_linformer_dropout_keeps_the_expected_output():
    """Dropout on the (N, k) weights: at k = N (exact) the mean over draws is exact attention."""
    q, k, v = make(30)
    mask = right_padded(30, 20)
    lyr = linformer(projections=30)
    torch.manual_seed(0)
    outs = torch.stack([lyr(q, k, v, mask, dropout=0.3) for _ in range(200)])
    mean, bound = outs.mean(0), 6 * outs.std(0) / 200**0.5 + 1e-9
    ref = naive_attention(q, k, v, mask)
    assert ((mean - ref).abs() <= bound).masked_fill(~mask[:, None, :, None], True).all()
    assert not torch.equal(outs[0], outs[1])


def test_linformer_random_and_fitted_rows_within_the_budget_are_exact():
    q, k, v = make(20)
    mask = right_padded(20, 6)
    ref = naive_attention(q, k, v, mask)
    out = linformer("random", projections=6, length=16)(q, k, v, mask)
    torch.testing.assert_close(out[1, :, :6], ref[1, :, :6], rtol=1e-10, atol=1e-10)
    assert (out[0] - ref[0]).abs().max() > 1e-3
    spec = get_method("linformer")
    assert spec.cost(LinformerConfig(mode="random", projections=64), n=64, s=64, d=64, dv=64).qk_pairs == 64 * 64
    mean = spec.cost(LinformerConfig(projections=64), n=64, s=64, d=64, dv=64)  # no fallback: pooling + k keys
    assert mean.matmul_macs == 64 * 128 + 64 * 64 * 128


def test_linformer_refuses_bad_options():
    for options, word in [
        ({"mode": "learned"}, "mode"),
        ({"projections": 0}, "projections"),
        ({"length": 0}, "length"),
    ]:
        with pytest.raises(ValueError, match=word):
            LinformerConfig(**options)


# ----------------------------------------------------------------------------------------- both methods


CASES = [
    ("nystrom", {"landmarks": 8}),
    ("nystrom", {"landmarks": 8, "pinv": "exact"}),
    ("linformer", {"projections": 8}),
    ("linformer", {"mode": "random", "projections": 8, "length": 32}),
]


def layer_of(method, options):
    return ApproxAttention(method, get_method(method).make_config(**options), head_dim=D)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method, options", CASES)
def test_half_precision_is_computed_in_float32(method, options, dtype):
    """Half inputs: the output equals the float64 computation on the same (rounded) inputs up to the rounding of
    the output itself (the work is done in float32)."""
    q, k, v = make(64, dtype=torch.float32)
    mask = right_padded(64, 50)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    lyr = layer_of(method, options)
    out = lyr(q, k, v, mask)
    ref = lyr(q.double(), k.double(), v.double(), mask)
    real = mask[:, None, :, None]
    assert out.dtype == dtype and torch.isfinite(out).all()
    rel = float((out.double() - ref).masked_fill(~real, 0).abs().max() / ref.masked_fill(~real, 0).abs().max())
    assert rel < 4 * torch.finfo(dtype).eps, rel


@pytest.mark.parametrize("method, options", [*CASES, ("linformer", {"mode": "fitted", "projections": 3, "length": 5})])
def test_gradcheck(method, options):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 1, 7, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 6:] = False
    options = {**options, **({"landmarks": 3} if method == "nystrom" else {"projections": 3})}
    lyr = layer_of(method, options)
    if options.get("mode") == "fitted":
        lyr.load_state(
            {
                "proj_e": torch.randn(1, 3, 5, generator=g),
                "proj_f": torch.randn(1, 3, 5, generator=g),
                "bias": torch.randn(1, 3, generator=g),
                "fitted": torch.ones((), dtype=torch.uint8),
            }
        )
    torch.autograd.gradcheck(lambda a, b, c: lyr(a, b, c, mask)[:, :, :6], (q, k, v))


@pytest.mark.parametrize("method, options", [*CASES[:1], *CASES[2:]])
def test_padding_with_poisoned_values_never_leaks(method, options):
    """Padded keys of 1e3 and values of 1e9: the real outputs equal those of the unpadded row."""
    q, k, v = make(64, seed=2)
    mask = right_padded(64, 41)
    k[1, :, 41:], v[1, :, 41:] = 1e3, 1e9
    lyr = layer_of(method, options)
    out = lyr(q, k, v, mask)[1, :, :41]
    short = lyr(q[1:, :, :41], k[1:, :, :41], v[1:, :, :41], None)[0]
    torch.testing.assert_close(out, short, rtol=1e-9, atol=1e-9)


def test_costs_beat_softmax_at_length():
    """The matmul count at N = 16384, 64 landmarks / projections: a small fraction of softmax's 2 N^2 d."""
    softmax = 2 * 16384 * 16384 * 64
    for method in ("nystrom", "linformer"):
        spec = get_method(method)
        cost = spec.cost(spec.config_class(), n=16384, s=16384, d=64, dv=64)
        assert cost.matmul_macs < softmax / 30 and 2 * cost.matmul_macs <= cost.flops
        assert math.isfinite(cost.flops)


def test_nystrom_exact_limit_holds_for_float32_inputs():
    """Every token its own landmark with the exact pseudo-inverse on float32 inputs with peaked attention: the
    kernel matrix is ill-conditioned, so float32 factors would leave the output far from exact attention (about 1e-2
    here); the formula runs in float64 and the result is exact attention up to float32 rounding."""
    n = 128
    q, k, v = make(n, seed=5, sharp=4.0)
    mask = right_padded(n, 90)
    out = ApproxAttention("nystrom", NystromConfig(landmarks=n, pinv="exact"), head_dim=D)(
        q.float(), k.float(), v.float(), mask
    )
    assert out.dtype == torch.float32
    ref = naive_attention(q.float().double(), k.float().double(), v.float().double(), mask)
    real = mask[:, None, :, None]
    torch.testing.assert_close(out.double().masked_fill(~real, 0), ref.masked_fill(~real, 0), rtol=1e-5, atol=1e-5)


def test_nystrom_computes_no_more_landmarks_than_tokens():
    """More landmarks than tokens (the exact limit asked for at a longer length) compute, and cost, as many as there
    are tokens: the extra ones were empty, yet each short call paid their SVD. The output is the same exact
    attention."""
    n = 40
    q, k, v = make(n, seed=6, sharp=3.0)
    mask = right_padded(n, 25)
    at_n, many = (NystromConfig(landmarks=m, pinv="exact") for m in (n, 8 * n))
    outs = [ApproxAttention("nystrom", c, head_dim=D)(q, k, v, mask) for c in (at_n, many)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    ref = naive_attention(q, k, v, mask)
    real = mask[:, None, :, None]
    torch.testing.assert_close(outs[1].masked_fill(~real, 0), ref.masked_fill(~real, 0), rtol=1e-9, atol=1e-9)
    cost = get_method("nystrom").cost
    assert cost(many, n=n, s=n, d=D, dv=D) == cost(at_n, n=n, s=n, d=D, dv=D)
    seen = []
    real_pinv = torch.linalg.pinv
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.linalg, "pinv", lambda a, *args, **kw: seen.append(a.shape[-1]) or real_pinv(a, *args, **kw))
        ApproxAttention("nystrom", many, head_dim=D)(q, k, v, mask)
        # a batch padded further (to 100 positions): still as many as the longest row's real tokens, not positions
        padded = [F.pad(t, (0, 0, 0, 60)) for t in (q, k, v)]
        out = ApproxAttention("nystrom", many, head_dim=D)(*padded, F.pad(mask, (0, 60)))
    assert seen == [n, n]
    torch.testing.assert_close(out[:, :, :n].masked_fill(~real, 0), outs[0].masked_fill(~real, 0))


def test_linformer_means_score_no_more_segments_than_the_longest_row_has_keys(monkeypatch):
    """Linformer ``mean`` on a batch padded to a fixed length: as many segments as its longest row's real keys when
    they are fewer than the projections (10 real keys padded to 100 had scored 64 segments, 54 of them empty), and
    the same output as the batch padded no further."""
    from approx.attention import linformer

    seen = []
    means = linformer.segment_means
    monkeypatch.setattr(linformer, "segment_means", lambda x, mask, m: seen.append(m) or means(x, mask, m))
    q, k, v = make(10, seed=2)
    mask = right_padded(10, 7)
    lyr = ApproxAttention("linformer", LinformerConfig(projections=64), head_dim=D)
    short = lyr(q, k, v, mask)
    padded = lyr(*(F.pad(t, (0, 0, 0, 90)) for t in (q, k, v)), F.pad(mask, (0, 90)))
    assert seen == [10, 10, 10, 10]
    real = mask[:, None, :, None]
    torch.testing.assert_close(padded[:, :, :10].masked_fill(~real, 0), short.masked_fill(~real, 0))


@pytest.mark.parametrize("n", [20, 48, 300])
def test_mean_pooling_cost_counts_the_products_that_run(n):
    """Linformer ``mean``'s ``matmul_macs`` is the products that run (torch's FlopCounterMode, an independent count)
    plus the pooling (s (d + dv), an index_add the counter does not see); with fewer keys than projections it scores
    one segment per key, not empty segments as well (20 keys had run 3x the products its cost said)."""
    from torch.utils.flop_counter import FlopCounterMode

    method = get_method("linformer")
    config = method.make_config()
    q, k, v = (torch.randn(1, 1, n, 16) for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        method.attend(q, k, v, key_mask=None, query_mask=None, scale=0.25, config=config, state={})
    assert counter.get_total_flops() // 2 + n * 32 == method.cost(config, n=n, s=n, d=16, dv=16).matmul_macs


@pytest.mark.parametrize("n, landmarks, iterations", [(64, 8, 6), (200, 16, 3)])
def test_nystrom_cost_counts_the_products_that_run(n, landmarks, iterations):
    """Nyström's ``matmul_macs`` (and so its flops) is the products that run, counted by torch's FlopCounterMode (an
    independent count): the three factors and the iterative pseudo-inverse's four (m x m) products per step (a
    count of three had survived the tests)."""
    from torch.utils.flop_counter import FlopCounterMode

    method = get_method("nystrom")
    config = method.make_config(landmarks=landmarks, pinv_iterations=iterations)
    q, k, v = (torch.randn(1, 1, n, 16) for _ in range(3))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        method.attend(q, k, v, key_mask=None, query_mask=None, scale=0.25, config=config, state={})
    assert counter.get_total_flops() // 2 == method.cost(config, n=n, s=n, d=16, dv=16).matmul_macs
