"""MonarchAttention specific properties (the generic tests in test_methods.py cover it as well).

The oracle is ``naive_monarch``: the paper's alternating maximisation written plainly in float64, on the dense
score matrix Z = s Q K^T with loops over blocks and slots (no query means, no chunks, no layout tricks), from
the update equations derived from the variational form of softmax.
"""

import math

import pytest
import torch
from reference import naive_attention, naive_weights

from approx import ApproxAttention, get_method
from approx.attention import monarch
from approx.attention.monarch import MonarchConfig, auto_block

D = 6


def naive_monarch(q, k, v, block, steps, scale, start="identity"):
    """MonarchAttention of one head on real tokens only, float64: (N, d), (S, d), (S, dv) -> ((N, dv), (N, S)).

    Token p sits in block p // b, slot p % b; M[(lb, j), (k, i)] = L[j, lb, k] R[k, j, i]. L starts as the identity
    (L[j, lb, k] = [lb == k]); each step sets every R[k, j] to its maximiser given L, then every L[j, lb] given R:
      R[k, j, i] = softmax_i(sum_l L[j, lb, k] Z[(lb, j), (k, i)] / sum_l L[j, lb, k])   (uniform where the sum is 0)
      L[j, lb, k] = softmax_k(sum_i R[k, j, i] Z[(lb, j), (k, i)] + H(R[k, j]))
    with lb over the query rows that exist and i, k over the keys and key blocks that exist. ``start="uniform"``:
    R starts uniform over each block's keys instead, and an L update given that R comes before the steps."""
    q, k, v = q.double(), k.double(), v.double()
    n, s = q.shape[0], k.shape[0]
    b = block
    mq, mk = -(-n // b), -(-s // b)
    z = scale * q @ k.T
    lf = torch.zeros(b, mq, mk, dtype=torch.float64)
    for j in range(b):
        for lb in range(min(mq, mk)):
            lf[j, lb, lb] = 1.0
    rf = torch.zeros(mk, b, b, dtype=torch.float64)

    def update_r():
        for kb in range(mk):
            keys = [i for i in range(b) if kb * b + i < s]
            for j in range(b):
                rows = [lb for lb in range(mq) if lb * b + j < n]
                c = sum(lf[j, lb, kb] for lb in rows)
                alpha = torch.zeros(len(keys), dtype=torch.float64)
                if c > 0:
                    for t, i in enumerate(keys):
                        alpha[t] = sum(lf[j, lb, kb] * z[lb * b + j, kb * b + i] for lb in rows) / c
                rf[kb, j] = 0.0
                rf[kb, j, keys] = torch.softmax(alpha, 0)

    def update_l():
        for j in range(b):
            for lb in range(mq):
                if lb * b + j >= n:
                    continue
                beta = torch.zeros(mk, dtype=torch.float64)
                for kb in range(mk):
                    keys = [i for i in range(b) if kb * b + i < s]
                    r = rf[kb, j, keys]
                    entropy = -torch.special.xlogy(r, r).sum()  # 0 log 0 = 0
                    beta[kb] = (r * z[lb * b + j, [kb * b + i for i in keys]]).sum() + entropy
                lf[j, lb] = torch.softmax(beta, 0)

    if start == "uniform":
        for kb in range(mk):
            keys = [i for i in range(b) if kb * b + i < s]
            rf[kb, :, keys] = 1.0 / len(keys)
        update_l()
    for _ in range(steps):
        update_r()
        update_l()
    m = torch.zeros(n, s, dtype=torch.float64)
    for row in range(n):
        lb, j = divmod(row, b)
        for col in range(s):
            kb, i = divmod(col, b)
            m[row, col] = lf[j, lb, kb] * rf[kb, j, i]
    return m @ v, m


def inputs(n, seed=0, batch=2, heads=2, sharp=1.0, s=None):
    g = torch.Generator().manual_seed(seed)
    s = n if s is None else s
    q = torch.randn(batch, heads, n, D, generator=g, dtype=torch.float64) * sharp
    k = torch.randn(batch, heads, s, D, generator=g, dtype=torch.float64)
    v = torch.randn(batch, heads, s, D + 1, generator=g, dtype=torch.float64)
    return q, k, v


def layer(**options):
    return ApproxAttention("monarch", MonarchConfig(**options), head_dim=D)


@pytest.mark.parametrize(
    "n, block, steps",
    [(24, 4, 1), (23, 4, 2), (23, 5, 3), (17, 3, 1), (30, 6, 2), (9, 2, 4), (12, 1, 2), (12, 12, 2), (12, 20, 1)],
)
@pytest.mark.parametrize("group", [1, 4, None])
@pytest.mark.parametrize("start", ["identity", "uniform"])
def test_matches_the_naive_algorithm(monkeypatch, n, block, steps, group, start):
    """Output and dense weights equal the plain float64 loops, N a multiple of b or not, one or several steps, either
    start, the L update taking the heads one at a time (strided views), four at a time (of six: the last group short)
    or all at once."""
    monkeypatch.setattr(monarch, "_heads_per_group", lambda x, per_head: x if group is None else group)
    q, k, v = inputs(n, seed=n + block + steps, sharp=2.0, heads=3)
    lyr = layer(block_size=block, steps=steps, start=start)
    out, w = lyr(q, k, v), lyr.weights(q, k)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            ref_out, ref_w = naive_monarch(q[b, h], k[b, h], v[b, h], block, steps, D**-0.5, start)
            torch.testing.assert_close(out[b, h], ref_out, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(w[b, h], ref_w, rtol=1e-12, atol=1e-12)


def test_cross_attention_matches_the_naive_algorithm():
    """N queries, S keys (N != S): the same b on both sides, ceil(N / b) query and ceil(S / b) key blocks."""
    for n, s in ((10, 17), (19, 7)):
        q, k, v = inputs(n, seed=n, s=s)
        for steps, start in ((1, "identity"), (2, "identity"), (1, "uniform")):
            out = monarch.monarch_attention(
                q,
                k,
                v,
                key_mask=None,
                query_mask=None,
                scale=D**-0.5,
                config=MonarchConfig(block_size=3, steps=steps, start=start),
                state={},
            )
            for b in range(q.shape[0]):
                for h in range(q.shape[1]):
                    ref, _ = naive_monarch(q[b, h], k[b, h], v[b, h], 3, steps, D**-0.5, start)
                    torch.testing.assert_close(out[b, h], ref, rtol=1e-12, atol=1e-12)


def _mask(n, real, where="end"):
    """(1, n) bool with ``real`` real tokens: pads at the end, the start, or scattered."""
    mask = torch.zeros(1, n, dtype=torch.bool)
    if where == "end":
        mask[0, :real] = True
    elif where == "start":
        mask[0, n - real :] = True
    else:
        mask[0, torch.randperm(n, generator=torch.Generator().manual_seed(real))[:real]] = True
    return mask


@pytest.mark.parametrize("where", ["end", "start", "scattered"])
@pytest.mark.parametrize("block", [0, 4])
@pytest.mark.parametrize("start", ["identity", "uniform"])
def test_padding_anywhere_changes_nothing(where, block, start):
    """Rows are laid out by their real tokens: wherever the pads are, the real rows equal the naive algorithm on
    the real tokens alone, padded keys get weight exactly 0, and poisoned pads (values inf, keys 1e3) do not leak;
    padded query rows get uniform attention over the real keys."""
    n, real = 31, 19
    q, k, v = inputs(n, seed=3, batch=1)
    mask = _mask(n, real, where)
    q, k, v = q.clone(), k.clone(), v.clone()
    k[:, :, ~mask[0]] = 1e3
    v[:, :, ~mask[0]] = float("inf")
    lyr = layer(block_size=block, steps=2, start=start)
    out, w = lyr(q, k, v, mask), lyr.weights(q, k, mask)
    b = block or auto_block(real)
    idx = mask[0].nonzero().squeeze(1)
    for h in range(q.shape[1]):
        ref_out, ref_w = naive_monarch(q[0, h, idx], k[0, h, idx], v[0, h, idx], b, 2, D**-0.5, start)
        torch.testing.assert_close(out[0, h, idx], ref_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(w[0, h][idx][:, idx], ref_w, rtol=1e-12, atol=1e-12)
    assert (w[0, :, :, ~mask[0]] == 0).all()
    pads = (~mask[0]).nonzero().squeeze(1)
    torch.testing.assert_close(out[0, :, pads], v[0, :, idx].mean(-2, keepdim=True).expand(-1, len(pads), -1))


def test_variable_lengths_in_one_batch():
    """Each row of a batch is computed as if alone (its own block size when ``block_size=0``), padding and all."""
    n = 70
    lengths = [70, 9, 33, 64, 17]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(len(lengths), 2, n, D, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    lyr = layer(steps=2)
    out = lyr(q, k, v, mask)
    assert len({auto_block(x) for x in lengths}) > 1  # several block sizes in the batch
    for r, real in enumerate(lengths):
        alone = lyr(q[r : r + 1, :, :real], k[r : r + 1, :, :real], v[r : r + 1, :, :real])
        torch.testing.assert_close(out[r : r + 1, :, :real], alone, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("start", ["identity", "uniform"])
@pytest.mark.parametrize("steps", [1, 3])
def test_exact_limits(steps, start):
    """One block (b >= N: L = 1, R the softmax itself) and blocks of one token (b = 1: R = 1, L the softmax
    itself) are exact softmax attention, padding included."""
    q, k, v = inputs(40, seed=5, sharp=2.0)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 27:] = False
    ref = naive_attention(q, k, v, mask)
    for block in (40, 64, 1):
        out = layer(block_size=block, steps=steps, start=start)(q, k, v, mask)
        torch.testing.assert_close(out[0], ref[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out[1, :, :27], ref[1, :, :27], rtol=1e-12, atol=1e-12)
    cost = monarch.cost(MonarchConfig(block_size=64, start=start), n=40, s=40, d=D, dv=D)
    assert cost.matmul_macs == 40 * 40 * 2 * D  # one block costs what softmax costs (scores and values)


def _objective(w, q, k, mask, scale):
    """f(M) = sum over real query rows of <M_row, Z_row> + H(M_row), and its bound sum lse(Z_row) (f at softmax)."""
    z = scale * q @ k.transpose(-1, -2)
    z = z.masked_fill(~mask[:, None, None, :], float("-inf"))
    inner = torch.where(w > 0, w * (z.clamp_min(-1e300) - w.clamp_min(1e-300).log()), torch.zeros_like(w))
    rows = mask[:, None, :].expand(w.shape[:3])
    return inner.sum(-1)[rows].sum(), torch.logsumexp(z, -1)[rows].sum()


@pytest.mark.parametrize("start", ["identity", "uniform"])
@pytest.mark.parametrize("seed", range(3))
def test_more_steps_never_move_away_from_softmax(seed, start):
    """Each update maximises the objective f over one factor exactly, so f never decreases from step to step and
    never passes its maximum, reached at softmax; f = sum lse(Z_row) - sum KL(M_row || softmax(Z_row)): the
    summed KL divergence to exact attention never increases. (On these inputs the output error falls too, which
    is not guaranteed.)"""
    q, k, v = inputs(60, seed=seed, sharp=1.5)
    mask = torch.ones(2, 60, dtype=torch.bool)
    mask[1, 47:] = False
    ref = naive_attention(q, k, v, mask)
    values, errors = [], []
    for steps in range(1, 7):
        lyr = layer(block_size=6, steps=steps, start=start)
        f, bound = _objective(lyr.weights(q, k, mask), q, k, mask, D**-0.5)
        values.append(float(f))
        out = lyr(q, k, v, mask)
        errors.append(float((out - ref)[0].norm() + (out - ref)[1, :, :47].norm()))
    assert all(b >= a - 1e-9 * abs(a) for a, b in zip(values, values[1:])), values
    assert values[-1] > values[0] and values[-1] <= float(bound) + 1e-9
    assert errors[2] < errors[0], errors


def test_weights_have_monarch_structure():
    """M[(l, j), (k, i)] = L[j, l, k] R[k, j, i]: for every slot j and key block k the (m x b) submatrix over
    (l, i) has rank one, every row of L and R is a distribution, and M is far from rank one as a whole."""
    m, b = 5, 4
    q, k, _ = inputs(m * b, seed=2, sharp=2.0)
    w = layer(block_size=b, steps=2).weights(q, k)  # (B, H, N, N)
    blocks = w.reshape(*w.shape[:2], m, b, m, b).permute(0, 1, 3, 4, 2, 5)  # (B, H, j, k, l, i)
    sv = torch.linalg.svdvals(blocks)  # (B, H, b, m, min(m, b))
    assert (sv[..., 1] <= 1e-12 * sv[..., 0]).all()
    # the factors: L[j, l, k] = sum_i M[(l, j), (k, i)]; R[k, j, i] = M[(l, j), (k, i)] / L[j, l, k]
    lf = blocks.sum(-1)  # (B, H, j, k, l)
    torch.testing.assert_close(lf.sum(3), torch.ones_like(lf[:, :, :, 0]))
    rf = blocks / lf[..., None]
    torch.testing.assert_close(rf.sum(-1), torch.ones_like(rf[..., 0]))
    torch.testing.assert_close(rf, rf[..., :1, :].expand_as(rf))  # R[k, j] is the same for every l
    assert (torch.linalg.svdvals(w)[..., 1] > 1e-3).all()


def test_chunks_agree_with_one_pass(monkeypatch):
    """The R and L updates are computed a chunk of blocks / heads at a time; one block per chunk gives the same
    output (padding, several steps)."""
    q, k, v = inputs(45, seed=4, batch=2, heads=3)
    mask = torch.ones(2, 45, dtype=torch.bool)
    mask[1, 30:] = False
    lyr = layer(block_size=5, steps=3)
    whole = lyr(q, k, v, mask)
    monkeypatch.setattr(monarch, "_CHUNK", 1)
    torch.testing.assert_close(lyr(q, k, v, mask), whole, rtol=1e-12, atol=1e-12)
    with torch.enable_grad():
        q2 = q.clone().requires_grad_()
        torch.testing.assert_close(lyr(q2, k, v, mask), whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_error_is_the_input_rounding(dtype):
    """Half inputs are computed in float32: against float64 MonarchAttention on the same (rounded) inputs the
    error is float32's, and against the unrounded inputs it is about what rounding the inputs costs."""
    q, k, v = inputs(300, seed=1, sharp=2.0)
    mask = torch.ones(2, 300, dtype=torch.bool)
    mask[1, 211:] = False
    lyr = layer()
    low = [t.to(dtype) for t in (q, k, v)]
    out = lyr(*low, mask)
    assert out.dtype == dtype and torch.isfinite(out).all()
    same_inputs = lyr(*(t.double() for t in low), mask)
    real = mask[:, None, :, None]
    err = ((out.double() - same_inputs) * real).abs().max()
    assert err <= 4 * torch.finfo(dtype).eps * same_inputs.abs().max()
    # against the unrounded inputs: about what rounding the inputs costs exact attention
    moved = ((out.double() - lyr(q, k, v, mask)) * real).abs().max()
    exact_moved = ((naive_attention(*low, mask) - naive_attention(q, k, v, mask)) * real).abs().max()
    assert moved <= 3 * exact_moved


@pytest.mark.parametrize("steps, start", [(2, "identity"), (3, "identity"), (1, "uniform"), (2, "uniform")])
def test_float32_with_scores_hundreds_apart(steps, start):
    """Scores of several hundred in float32: the L weights of a key block can all underflow, while the query means
    the next R update needs are their ratios. Against the float64 algorithm on the same (rounded) inputs the float32
    output stays close (it collapsed to a uniform R before the means were normalised in the log domain)."""
    q, k, v = (t.float() for t in inputs(64, seed=3, sharp=200.0, heads=2))
    assert (q @ k.transpose(-1, -2)).abs().max() * D**-0.5 > 500
    out = layer(block_size=8, steps=steps, start=start)(q, k, v)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            ref, _ = naive_monarch(q[b, h], k[b, h], v[b, h], 8, steps, D**-0.5, start)
            torch.testing.assert_close(out[b, h].double(), ref, rtol=0, atol=1e-3 * ref.abs().max().item())


@pytest.mark.parametrize("start", ["identity", "uniform"])
def test_gradcheck(start):
    """Gradients of the whole algorithm (two steps, a padded row, N not a multiple of b) in float64."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 1, 11, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, 8:] = False
    lyr = layer(block_size=3, steps=2, start=start)
    real = mask[:, None, :, None]
    assert torch.autograd.gradcheck(lambda q, k, v: lyr(q, k, v, mask) * real, (q, k, v))


def test_cost_follows_the_paper():
    """``matmul_macs`` counts the products of the algorithm: with one step, N (2b + m) d + N (b + m) dv. At the
    paper's RoBERTa setting (N = 384, d = 64, 8 of 12 layers replaced) blocks of 128 and 96 give 0.67x and 0.59x
    of softmax's attention FLOPs, the points of its SQuAD figure; with b about sqrt(N) it grows like N sqrt(N)."""
    full = get_method("full").cost(get_method("full").config_class(), n=384, s=384, d=64, dv=64).matmul_macs
    for block, ratio in ((128, 0.67), (96, 0.59)):
        macs = monarch.cost(MonarchConfig(block_size=block), n=384, s=384, d=64, dv=64).matmul_macs
        m = 384 // block
        assert macs == 384 * (2 * block + m) * 64 + 384 * (block + m) * 64
        assert round((4 + 8 * macs / full) / 12, 2) == ratio
    small, large = (monarch.cost(MonarchConfig(), n=n, s=n, d=64, dv=64).matmul_macs for n in (1024, 16384))
    assert large / small == pytest.approx(16 * math.sqrt(16), rel=0.01)
    more = monarch.cost(MonarchConfig(steps=3), n=1024, s=1024, d=64, dv=64)
    assert more.matmul_macs > small and more.qk_pairs < 1024 * 1024


@pytest.mark.parametrize(
    "options, n",
    [
        ({}, 256),
        ({}, 300),
        ({"steps": 3}, 300),
        ({"block_size": 16}, 100),
        ({"block_size": 128}, 128),
        ({"block_size": 128, "steps": 3}, 100),
        ({"start": "uniform"}, 300),
        ({"block_size": 16, "steps": 2, "start": "uniform"}, 100),
        ({"block_size": 128, "start": "uniform"}, 100),
    ],  # fmt: skip
)
@pytest.mark.parametrize("grad", [False, True])
def test_cost_counts_the_products_that_run(options, n, grad):
    """``matmul_macs`` equals the multiply-accumulates of the matrix products the call runs, counted by torch's own
    FlopCounterMode (an independent count), on the inference path and the differentiable one; with one key block
    (b >= N) one R update runs whatever ``steps`` says, and neither Ktil nor the entropies are computed."""
    from torch.utils.flop_counter import FlopCounterMode

    config = MonarchConfig(**options)
    q, k, v = (torch.randn(1, 1, n, 16) for _ in range(3))
    with torch.set_grad_enabled(grad), FlopCounterMode(display=False) as counter:
        get_method("monarch").attend(q.requires_grad_(grad), k, v, key_mask=None, query_mask=None, scale=0.25,
                                     config=config, state={})  # fmt: skip
    assert counter.get_total_flops() == 2 * monarch.cost(config, n=n, s=n, d=16, dv=16).matmul_macs


def test_auto_block_and_bad_options():
    assert [auto_block(n) for n in (1, 2, 3, 35, 48, 100, 120, 384, 512, 1024, 16384)] == [
        1, 2, 2, 8, 8, 8, 8, 16, 32, 32, 128,
    ]  # fmt: skip
    for options, word in (
        ({"block_size": -1}, "block_size"),
        ({"steps": 0}, "steps"),
        ({"exact_below": -2}, "exact_below"),
        ({"start": "random"}, "start"),
    ):
        with pytest.raises(ValueError, match=word):
            MonarchConfig(**options)


def test_not_exact_at_the_default():
    q, k, v = inputs(120, seed=0, sharp=1.0)
    out = layer()(q, k, v)
    assert (out - naive_attention(q, k, v)).abs().max() > 1e-2
    assert torch.equal(layer()(q, k, v), out)  # deterministic
    assert (layer().weights(q, k) - naive_weights(q, k)).abs().max() > 1e-2


def test_rows_without_real_tokens_stay_finite():
    """A batch row of pads alone (alone in its batch, or beside real rows): finite, every key taken as real."""
    q, k, v = inputs(20, seed=6, batch=1)
    for mask in (torch.zeros(1, 20, dtype=torch.bool), torch.tensor([[False] * 20, [True] * 12 + [False] * 8])):
        rows = mask.shape[0]
        qr, kr, vr = (t.expand(rows, *t.shape[1:]) for t in (q, k, v))
        for block in (0, 4):
            out = layer(block_size=block)(qr, kr, vr, mask)
            torch.testing.assert_close(out[0], v[0].mean(-2, keepdim=True).expand_as(out[0]))
