"""LSH attention (Reformer, asymmetric as SMYRF): the properties of its definition. The generic tests
(tests/test_methods.py and others) cover padding, dtypes, gradients, dropout, weights and the exact limit too.

The reference below is written from the papers' definition with plain loops and dense masks; it reads only the
layer's random state (the hash directions), never the method's functions."""

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import batch, model_output, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import naive_attention

import approx
from approx import ApproxAttention, get_method
from approx.attention.lsh import LshConfig

B, H, D = 2, 3, 16


def inputs(n=120, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for _ in range(3))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def padded_mask(n, real_last_row):
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, real_last_row:] = False
    return mask


def lsh(**options):
    return ApproxAttention("lsh", LshConfig(**options), head_dim=D)


def reference_lsh(q, k, v, mask, directions, c, scale=D**-0.5):
    """Reformer's multi-round LSH attention on SMYRF's asymmetric transform, from the definition, float64.

    Per batch row and head, over the real tokens only: M^2 = max|q|^2 + max|k|^2, F(q) = [q, 0, sqrt(M^2 - |q|^2)],
    G(k) = [k, sqrt(M^2 - |k|^2), 0]; per round (direction a), queries and keys are sorted by (a . F, position),
    resp. (a . G, position), and the query at sorted rank p is in cluster p // c (keys alike); query i attends key
    j in that round when their clusters are equal. Reformer's weights: the sum over rounds of
    exp(s_ij - log n_ij) over the round's pairs (n_ij: rounds in which i attends j), normalised over all rounds."""
    q, k, v, directions = q.double(), k.double(), v.double(), directions.double()
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float64)
    for b in range(q.shape[0]):
        real = torch.arange(q.shape[2]) if mask is None else mask[b].nonzero()[:, 0]
        m = len(real)
        for h in range(q.shape[1]):
            qr, kr, vr = q[b, h, real], k[b, h, real], v[b, h, real]
            m2 = max(float(x @ x) for x in qr) + max(float(x @ x) for x in kr)
            f = [
                torch.cat([x, torch.zeros(1, dtype=x.dtype), torch.tensor([math.sqrt(m2 - float(x @ x))])]) for x in qr
            ]
            g = [
                torch.cat([x, torch.tensor([math.sqrt(m2 - float(x @ x))]), torch.zeros(1, dtype=x.dtype)]) for x in kr
            ]
            same = []  # per round: (m, m) bool, query i attends key j
            for a in directions:
                q_rank = sorted(range(m), key=lambda i: (float(f[i] @ a), i))
                k_rank = sorted(range(m), key=lambda j: (float(g[j] @ a), j))
                q_cluster, k_cluster = [0] * m, [0] * m
                for p, i in enumerate(q_rank):
                    q_cluster[i] = p // c
                for p, j in enumerate(k_rank):
                    k_cluster[j] = p // c
                same.append(torch.tensor([[q_cluster[i] == k_cluster[j] for j in range(m)] for i in range(m)]))
            n_pairs = torch.stack(same).sum(0).double()  # n_ij
            scores = qr @ kr.T * scale
            scores = scores - scores.max(-1, keepdim=True).values
            num = torch.zeros(m, m, dtype=torch.float64)
            for found in same:
                num += torch.where(found, torch.exp(scores - torch.log(n_pairs.clamp(min=1))), 0.0)
            out[b, h, real] = (num / num.sum(-1, keepdim=True)) @ vr
    return out


def real_rows(x, mask):
    return x.masked_fill(~mask[:, None, :, None], 0.0)


def fused_kernel():
    """LSH's fused C++ kernel, built (once per machine); the test is skipped, saying why, where it cannot be built
    (no C++ compiler or ninja)."""
    from approx.attention import _lshfused

    try:
        return _lshfused.build()
    except RuntimeError as err:
        pytest.skip(f"LSH's fused kernel cannot be built here: {err}")


@pytest.fixture(params=["inference", "autograd", "fused", "fused-clusters"])
def path(request, monkeypatch):
    """Which of LSH's paths a test runs: the eager engine's inference one (``_lshrounds``: no gradient, reused
    buffers), the differentiable loop (inputs that require gradients; see :func:`run`), or the fused engine's C++
    kernel (``_lshfused``: every call of the layer made with ``engine="fused"``), its work split by (batch, head) row
    or, ``fused-clusters``, by each round's query clusters (what it does with fewer rows than threads). Checks
    afterwards that it ran and that the others did not."""
    from approx.attention import _lshfused, _lshrounds
    from approx.attention import lsh as lsh_module

    if request.param.startswith("fused"):
        fused_kernel()
        rounds = lsh_module.attend_rounds
        monkeypatch.setattr(lsh_module, "attend_rounds", lambda *a, **kw: rounds(*a, **{**kw, "engine": "fused"}))
        monkeypatch.setattr(_lshfused, "SPLIT", "clusters" if request.param == "fused-clusters" else "rows")
    calls = {"inference": [], "fused": []}
    for name, module in (("inference", _lshrounds), ("fused", _lshfused)):
        real = module.attend
        monkeypatch.setattr(module, "attend", lambda *a, _f=real, _c=calls[name], **kw: _c.append(1) or _f(*a, **kw))
    fused = request.param.startswith("fused")
    yield "inference" if fused else request.param  # the kernel runs where the inference path would
    for name, made in calls.items():
        assert bool(made) == (request.param.split("-")[0] == name), f"{name}: {len(made)} calls on {request.param}"


def run(fn, path, q, k, v, *rest, **kw):
    """``fn(q, k, v, ...)`` on ``path``: with q requiring gradients for the differentiable loop (output detached)."""
    if path == "autograd":
        q = q.clone().requires_grad_()
    return fn(q, k, v, *rest, **kw).detach()


# --------------------------------------------------------------------------------------------- definition


@pytest.mark.parametrize("rounds, c", [(1, 8), (2, 8), (3, 16), (4, 5)])
def test_matches_the_definition(rounds, c, path):
    """Hashing, separate sorts, balanced clusters, de-duplicated rounds: against the loop reference, padded row
    included (the pads take no cluster slot: the reference never sees them), on both eager paths."""
    q, k, v = inputs(n=60)
    mask = padded_mask(60, 43)
    lyr = lsh(cluster_size=c, rounds=rounds)
    ref = reference_lsh(q, k, v, mask, lyr.state()["directions"], c)
    out = run(lyr, path, q, k, v, mask)
    torch.testing.assert_close(real_rows(out, mask), real_rows(ref, mask), rtol=1e-9, atol=1e-12)
    assert (real_rows(out - naive_attention(q, k, v, mask), mask)).abs().max() > 1e-3  # not exact attention


def test_dense_weights_are_the_merged_rounds(path):
    """weights() (softmax over the union of the rounds' pairs) reproduces the output, and each row's support is
    the union: a de-duplication error (a pair weighted twice) would break the first, a wrong union the second."""
    q, k, v = inputs(n=60)
    mask = padded_mask(60, 43)
    lyr = lsh(cluster_size=6, rounds=3)
    w = lyr.weights(q, k, mask)
    torch.testing.assert_close(run(lyr, path, q, k, v, mask), w @ real_rows(v, mask), rtol=1e-10, atol=1e-12)
    support = (w > 0).sum(-1)[real_rows(torch.ones(B, H, 60, 1), mask)[..., 0] > 0]
    assert support.min() >= 6 and support.max() <= 18 and support.float().mean() > 6  # c <= |union| <= rounds c


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        st.tuples(st.just(torch.float32), st.lists(st.floats(allow_nan=False, width=32), min_size=1, max_size=200)),
        st.tuples(st.just(torch.float64), st.lists(st.floats(allow_nan=False), min_size=1, max_size=200)),
    )
)
def test_hash_sort_keys_sort_as_the_floats(case):
    """The hashing sorts integer keys made from the projections' bits (faster than a float sort): a stable sort of the
    keys gives the stable float order, ties (-0.0 and 0.0 among them), infinities and subnormals included."""
    from approx.attention.lsh import _order_keys

    dtype, values = case
    specials = [0.0, -0.0, math.inf, -math.inf, 5e-45, -5e-45, 1.0, 1.0]
    x = torch.tensor(values + specials, dtype=dtype)
    keys = _order_keys(x)
    assert not keys.is_floating_point()
    assert torch.equal(keys.argsort(stable=True), x.argsort(stable=True))


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from([torch.float32, torch.float64]),
    st.integers(1, 5),
    st.lists(st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, -3e38, 3e38, 5e-45, math.inf]), min_size=1, max_size=40),
    st.integers(0, 2**31 - 1),
)
def test_hash_sort_of_every_row_is_the_stable_float_order(dtype, rows, values, seed):
    """The hashing sorts every row of projections at once (on the CPU, float32 rows as one flat list of 64-bit keys,
    the row's number above the float's order): each row gets the stable float order of its own values, ties (-0.0
    and 0.0, repeated values, +inf for padding) kept in position order, on a transposed (strided) input as the
    hashing passes it, against ``argsort`` of each row alone."""
    from approx.attention.lsh import _sort_rows

    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(values, dtype=dtype)
    x = pool[torch.randint(len(values), (len(values) + 7, rows, 3), generator=g)]  # (L, rows, 3): ties in every row
    proj = x.permute(1, 2, 0)  # (rows, 3, L), strided as hash_projections' permuted output is
    order = _sort_rows(proj)
    assert order.shape == proj.shape and order.dtype == torch.int64
    for r in range(rows):
        for j in range(3):
            assert torch.equal(order[r, j], proj[r, j].contiguous().argsort(stable=True)), (r, j)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hash_norms_in_blocks_are_the_plain_sums_to_the_bit(dtype, monkeypatch):
    """The hashing squares and sums the queries and keys a block of rows at a time (no (B, H, N, d) temporary): to the
    bit the plain ``(x * x).sum(-1)``, whose rounding decides near ties in the sort, on contiguous inputs and on
    strided ones laid out as a model passes them, with a last partial block."""
    from approx.attention import lsh as lsh_module

    monkeypatch.setattr(lsh_module, "_NORM_ELEMENTS", 3 * B * H * D)  # blocks of three rows: 70 = 23 * 3 + 1
    g = torch.Generator().manual_seed(3)
    strided = torch.randn(B, 70, H, D, generator=g, dtype=dtype).transpose(1, 2)
    for x in (strided, strided.contiguous(), strided[:, :, :2]):
        assert torch.equal(lsh_module._squared_norms(x), (x * x).sum(-1))


def test_clusters_are_balanced():
    """One round: every real query attends exactly c real keys, but the last cluster (90 = 11 * 8 + 2)."""
    q, k, _ = inputs(n=120)
    mask = padded_mask(120, 90)
    w = lsh(cluster_size=8, rounds=1).weights(q, k, mask)
    counts = (w > 0).sum(-1)  # (B, H, N)
    assert (counts[0] == 8).all()
    row = counts[1, :, :90]
    assert ((row == 8) | (row == 2)).all() and ((row == 2).sum(-1) == 2).all()


# ------------------------------------------------------------------------------------------ exact limits


@pytest.mark.parametrize("rounds", [1, 2, 4])
@pytest.mark.parametrize("c", [120, 500])
def test_one_cluster_is_exact(rounds, c, path):
    """c >= N: every real key in one cluster, every pair found in the first round, the only one run (later rounds
    would find the same pairs: their de-duplication is checked where they run, by the test below and the compiled
    engine's): exact attention, with a padded row, on both eager paths."""
    q, k, v = inputs()
    mask = padded_mask(120, 90)
    out = run(lsh(cluster_size=c, rounds=rounds), path, q, k, v, mask)
    assert real_rows(out - naive_attention(q, k, v, mask), mask).abs().max() <= 1e-9


@pytest.mark.parametrize("rounds", [1, 3])
def test_rows_no_longer_than_a_cluster_are_exact(rounds, path):
    """A row with at most c real tokens is exact (one cluster), the longer row of the same batch is not."""
    q, k, v = inputs()
    mask = padded_mask(120, 40)
    out = run(lsh(cluster_size=64, rounds=rounds), path, q, k, v, mask)
    err = real_rows(out - naive_attention(q, k, v, mask), mask).abs()
    assert err[1].max() <= 1e-9 and err[0].max() > 1e-3


# ------------------------------------------------------------------------------------------------ padding


@pytest.mark.parametrize("poison", [1e4, 1e307, float("inf"), float("nan")])
def test_padding_is_invisible_even_when_poisoned(poison, path):
    """Pads with huge, infinite or NaN queries, keys and values (huge ones would set M^2 and win the sort if counted;
    the inference path lowers a dropped key's score by a finite amount, which a non-finite or huge padded key would
    defeat) change nothing."""
    q, k, v = inputs(n=100)
    lyr = lsh(cluster_size=8, rounds=3)
    short = run(lyr, path, q[:1], k[:1], v[:1], None)
    pad = 37
    qp, kp, vp = (torch.cat([x[:1], poison * torch.ones(1, H, pad, D, dtype=x.dtype)], 2) for x in (q, k, v))
    mask = torch.arange(100 + pad)[None] < 100
    torch.testing.assert_close(run(lyr, path, qp, kp, vp, mask)[:, :, :100], short, rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------------- cross attention


def test_more_queries_than_keys_attend_the_last_key_cluster(path):
    """N > S (no query mask): the query clusters past the last key cluster attend it; every query gets a
    distribution over real keys and the output is its weights times v."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 50, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 20, D, generator=g, dtype=torch.float64) for _ in range(2))
    key_mask = torch.arange(20)[None] < 17
    spec, config = get_method("lsh"), LshConfig(cluster_size=8, rounds=2)
    state = spec.init_state(config, head_dim=D, seed=0)
    kw = dict(key_mask=key_mask, query_mask=None, scale=D**-0.5, config=config, state=state)
    out = run(spec.attend, path, q, k, v, **kw)
    w = spec.weights(q, k, **kw)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, 50, dtype=torch.float64))
    assert (w[..., 17:] == 0).all()
    torch.testing.assert_close(out, w @ v.masked_fill(~key_mask[:, None, :, None], 0.0))


@pytest.mark.parametrize("n,s", [(8, 16), (12, 20), (20, 12)])
def test_cross_attention_with_several_rows_and_heads(n, s, path):
    """N != S with several batch rows and heads: each (row, head) attends its own keys, as the dense union of the
    rounds says (weights() builds it without the round kernel)."""
    g = torch.Generator().manual_seed(n + s)
    q = torch.randn(2, 3, n, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 3, s, D, generator=g, dtype=torch.float64) for _ in range(2))
    spec, config = get_method("lsh"), LshConfig(cluster_size=4, rounds=2)
    state = spec.init_state(config, head_dim=D, seed=0)
    kw = dict(key_mask=None, query_mask=None, scale=D**-0.5, config=config, state=state)
    out = run(spec.attend, path, q, k, v, **kw)
    torch.testing.assert_close(out, spec.weights(q, k, **kw) @ v, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("per_chunk", [5, 32])
def test_rounds_split_into_chunks(monkeypatch, path, per_chunk):
    """A round's clusters computed a few at a time give the same output as the loop reference, on both eager paths.
    2 x 3 = 6 (batch, head) rows of 8 clusters of 8: with five clusters per chunk, the differentiable loop runs nine
    chunks of five and a last one of three, and the inference path takes each (batch, head) row alone, in a chunk of
    five and one of three; with 32 per chunk, the inference path takes four rows at a time, then the last two."""
    from approx.attention import _lshrounds
    from approx.attention import lsh as lsh_module

    for module in (lsh_module, _lshrounds):
        monkeypatch.setattr(module, "_CHUNK_ELEMENTS", per_chunk * 8 * 8)  # clusters of 8 per chunk
    q, k, v = inputs(n=60)
    mask = padded_mask(60, 43)
    lyr = lsh(cluster_size=8, rounds=3)
    ref = reference_lsh(q, k, v, mask, lyr.state()["directions"], 8)
    out = run(lyr, path, q, k, v, mask)
    torch.testing.assert_close(real_rows(out, mask), real_rows(ref, mask), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dt", [torch.float32, torch.float64])
def test_inference_path_compares_cluster_numbers_exactly(dt):
    """The inference path finds the pairs an earlier round found by subtracting cluster numbers in floating point:
    the dtype it takes tells every pair of cluster numbers apart (neighbours at the top of the range included), and
    float32 gives way to float64 where it could not."""
    from approx.attention._lshrounds import id_dtype

    for clusters in (2, 2**10, 2**24, 2**24 + 2, 2**53):
        ids = id_dtype(dt, clusters)
        top = torch.tensor([clusters - 2, clusters - 1], dtype=torch.float64).to(ids)
        assert ids in (dt, torch.float64) and top[1] - top[0] == 1, (dt, clusters, ids)
    assert id_dtype(torch.float32, 2**24) == torch.float32 and id_dtype(torch.float32, 2**24 + 2) == torch.float64


def test_inference_path_with_cluster_numbers_in_float64(monkeypatch):
    """The inference path's float64 branch for cluster numbers (taken past 2^24 clusters in float32, too many to
    reach in a test, so forced here): float64 distances written into the float32 score buffer give the loop
    reference's output, padding and three rounds included."""
    from approx.attention import _lshrounds

    calls = []
    monkeypatch.setattr(_lshrounds, "id_dtype", lambda dt, clusters: calls.append(dt) or torch.float64)
    q, k, v = inputs(n=60, dtype=torch.float32)
    mask = padded_mask(60, 43)
    lyr = lsh(cluster_size=8, rounds=3)
    ref = reference_lsh(q.double(), k.double(), v.double(), mask, lyr.state()["directions"], 8)
    with torch.no_grad():
        out = lyr(q, k, v, mask)
    assert calls == [torch.float32]  # the branch ran, once per call
    torch.testing.assert_close(real_rows(out.double(), mask), real_rows(ref, mask), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk", [None, 5 * 8 * 8, 36 * 8 * 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_inference_path_gives_the_differentiable_output(dtype, chunk, monkeypatch):
    """Without gradients LSH runs ``_lshrounds`` (reused buffers, groups of (batch, head) rows, each round merged by
    gathers once a group's chunks end). In float32, float16 and bfloat16, on strided inputs laid out as a model passes
    them, with padding, rows shorter than a cluster, more queries than keys (query clusters past the keys' attend
    the last key cluster) and fewer, in one chunk, in chunks of five clusters (one row per group, the last chunk partial) or of
    36 (nine clusters a row: groups of four rows, then a partial group of two), it gives the differentiable loop's
    output (half precision: at most a rounding apart, the two sum in different orders)."""
    from approx.attention import _lshrounds
    from approx.attention import lsh as lsh_module

    if chunk:
        for module in (lsh_module, _lshrounds):
            monkeypatch.setattr(module, "_CHUNK_ELEMENTS", chunk)
    calls, real = [], _lshrounds.attend
    monkeypatch.setattr(_lshrounds, "attend", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, 70, 3, H, D, generator=g).to(dtype)  # (B, N, 3, H, d): q, k, v are strided views
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    spec, config = get_method("lsh"), LshConfig(cluster_size=8, rounds=3)
    state = spec.init_state(config, head_dim=D, seed=0)
    for queries, keys, real_last in ((70, 70, 51), (70, 70, 6), (70, 37, 30), (20, 70, 51)):
        key_mask = torch.ones(2, keys, dtype=torch.bool)
        key_mask[1, real_last:] = False
        kw = dict(key_mask=key_mask, query_mask=None, scale=D**-0.5, config=config, state=state)
        qq, kk, vv = q[:, :, :queries], k[:, :, :keys], v[:, :, :keys]
        with torch.no_grad():
            fast = spec.attend(qq, kk, vv, **kw)
        assert calls, "the inference path did not run"
        calls.clear()
        slow = run(spec.attend, "autograd", qq, kk, vv, **kw)
        assert not calls, "the differentiable loop did not run"
        torch.testing.assert_close(fast, slow, **({"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}))


@pytest.mark.parametrize("path", ["differentiable", "inference"])
def test_merging_a_round_gives_an_input_the_same_bits_whatever_its_batch_holds(path):
    """torch computes ``logaddexp`` and ``exp`` in vector lanes and a scalar tail that round some inputs differently in
    the last bit, and an element falls in the tail or not with the tensor's size: merged in float32, a row's output
    depended on the rows merged with it. In a real model (MiniLM, positions extended, a 1500-token input alone and
    beside a short one), one token of layer 0 moved by 3e-7 and the last hidden states, past near ties in later
    layers' sorts, by up to 0.2. The differentiable path now merges in float64, the inference path on buffers a
    whole number of 64 lanes long: the same bits for a row merged alone (48 log-sum-exps: 16 of them in a 32-lane
    loop's tail) and beside another."""
    from approx.attention import _blocksparse, _lshrounds

    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        lse, other_lse = (torch.randn(2, 48, generator=g) * 4 + 3 for _ in range(2))
        out, other = (torch.randn(2, 48, 8, generator=g) for _ in range(2))
        if path == "differentiable":
            alone, alone_lse = _blocksparse.merge(out[:1].clone(), lse[:1], other[:1], other_lse[:1])
            both, both_lse = _blocksparse.merge(out.clone(), lse, other, other_lse)
        else:  # the inference path merges a round's rows (read through their slots, here in order) into the output
            work = _lshrounds._Scratch(1, 96, 8, 8, torch.float32, torch.device("cpu"))
            alone, alone_lse = out[0].clone(), lse[0].clone()
            _lshrounds._merge_round(alone, alone_lse, other[0], other_lse[0], torch.arange(48), work)
            both, both_lse = out.flatten(0, 1).clone(), lse.flatten().clone()
            _lshrounds._merge_round(both, both_lse, other.flatten(0, 1), other_lse.flatten(), torch.arange(96), work)
        assert torch.equal(alone.flatten(), both.flatten()[: alone.numel()])
        assert torch.equal(alone_lse.flatten(), both_lse.flatten()[:48])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_inference_path_computes_half_precision_in_float32_and_writes_no_input(dtype):
    """Half-precision inputs are computed in float32 and cast back: bit for bit the float32 output of the same values,
    cast. Contiguous inputs without a mask are read in place (the flat tables are views of them): they are left as
    they were."""
    q, k, v = (t.to(dtype).contiguous() for t in inputs(n=70, dtype=torch.float32))
    before = [t.clone() for t in (q, k, v)]
    spec, config = get_method("lsh"), LshConfig(cluster_size=8, rounds=3)
    kw = dict(
        key_mask=None, query_mask=None, scale=D**-0.5, config=config, state=spec.init_state(config, head_dim=D, seed=0)
    )
    with torch.no_grad():
        half = spec.attend(q, k, v, **kw)
        single = spec.attend(q.float(), k.float(), v.float(), **kw)
    assert half.dtype == dtype and torch.equal(half, single.to(dtype))
    for t, b in zip((q, k, v), before, strict=True):
        assert torch.equal(t, b)


@pytest.mark.parametrize("which", range(3))
def test_inference_path_is_taken_without_gradients_or_dropout_only(which):
    """Any of q, k, v requiring gradients (where gradients are recorded), attention dropout or another device than
    the CPU sends the call to the differentiable loop; under no_grad or inference_mode the inference path runs,
    whatever requires gradients."""
    from approx.attention._lshrounds import usable

    x = [torch.randn(1, 2, 8, D) for _ in range(3)]
    assert usable(*x, dropout=0.0) and not usable(*x, dropout=0.1)
    assert not usable(*(t.to("meta") for t in x), dropout=0.0)
    x[which].requires_grad_()
    assert not usable(*x, dropout=0.0)
    with torch.no_grad():
        assert usable(*x, dropout=0.0)
    with torch.inference_mode():
        assert usable(*(t.detach() for t in x), dropout=0.0)


# ------------------------------------------------------------------------------------------- compiled engine


def compiled(fn):
    """``fn()``, skipped (saying why) where torch.compile cannot compile (no C++ compiler)."""
    try:
        return fn()
    except RuntimeError as err:
        if "could not compile" in str(err):
            pytest.skip(f"torch.compile cannot compile here: {err}")
        raise


@pytest.fixture
def compiled_calls(monkeypatch):
    """The number of compiled round_blocks calls made (so a test fails when the eager code ran instead)."""
    from approx.attention import _compiled
    from approx.attention import lsh as lsh_module

    calls, real = [], _compiled.call

    def counting(fn, *args, **kw):
        if fn is lsh_module.round_blocks:
            calls.append(kw.get("dynamic"))
        return real(fn, *args, **kw)

    monkeypatch.setattr(_compiled, "call", counting)
    return calls


@pytest.mark.parametrize("rounds, c", [(1, 8), (4, 5)])
def test_compiled_engine_matches_the_definition(rounds, c, compiled_calls):
    """engine="compiled" (each round's mask and softmax fused by torch.compile, 32 query blocks per call): the loop
    reference, padded row included; with c = 5, 2 x 3 x 12 = 72 blocks make two full calls and one filled up."""
    q, k, v = inputs(n=60)
    mask = padded_mask(60, 43)
    lyr = lsh(cluster_size=c, rounds=rounds, engine="compiled")
    ref = reference_lsh(q, k, v, mask, lyr.state()["directions"], c)
    out = compiled(lambda: lyr(q, k, v, mask))
    torch.testing.assert_close(real_rows(out, mask), real_rows(ref, mask), rtol=1e-9, atol=1e-12)
    assert compiled_calls == [False] * rounds * -(-2 * 3 * -(-60 // c) // 32)  # static shapes, every round


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_engine_gives_the_eager_output_in_low_precision_and_cross_attention(dtype, compiled_calls):
    """float32 and bfloat16 (computed in float32), self-attention and cross-attention (more queries than keys: query
    clusters past the keys' attend the last key cluster, through the key-block look-up): the eager engine's output
    (in bfloat16 at most a rounding apart: the eager inference path exponentiates through ``torch.softmax``); rows
    shorter than a cluster stay eager (no compiled call)."""
    q, k, v = inputs(n=60, dtype=dtype)
    for keys in (60, 37):
        mask = padded_mask(keys, keys - 9)
        eager = lsh(cluster_size=8, rounds=3)(q, k[:, :, :keys], v[:, :, :keys], mask)
        out = compiled(
            lambda: lsh(cluster_size=8, rounds=3, engine="compiled")(q, k[:, :, :keys], v[:, :, :keys], mask)
        )  # noqa: B023
        torch.testing.assert_close(out, eager, **({"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}))
    assert compiled_calls
    compiled_calls.clear()
    short = [t[:, :, :6] for t in (q, k, v)]
    eager = lsh(cluster_size=8, rounds=3)(*short, None)
    torch.testing.assert_close(lsh(cluster_size=8, rounds=3, engine="compiled")(*short, None), eager, rtol=0, atol=0)
    assert compiled_calls == []


def test_compiled_engine_exact_limit_and_gradients():
    """Rows of at most c real tokens in a batch padded past c (3 rounds run: the later ones find only pairs already
    counted, all masked) are exact attention while the compiled code runs; its gradients are the eager engine's
    (float64)."""
    q, k, v = inputs()
    mask = torch.zeros(B, 120, dtype=torch.bool)
    mask[0, :60], mask[1, :40] = True, True
    out = compiled(lambda: lsh(cluster_size=64, rounds=3, engine="compiled")(q, k, v, mask))
    assert real_rows(out - naive_attention(q, k, v, mask), mask).abs().max() <= 1e-9
    grads = {}
    for engine in ("eager", "compiled"):
        x = [t.clone().requires_grad_() for t in inputs(n=60)]
        out = compiled(lambda: lsh(cluster_size=8, rounds=3, engine=engine)(*x, padded_mask(60, 43)))  # noqa: B023
        (real_rows(out, padded_mask(60, 43)) * torch.linspace(-1, 1, D, dtype=torch.float64)).sum().backward()
        grads[engine] = [t.grad for t in x]
    for name, a, b in zip("qkv", grads["compiled"], grads["eager"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=f"d{name}")
    with pytest.raises(ValueError, match="'eager', 'compiled'"):
        LshConfig(engine="fast")


# ---------------------------------------------------------------------------------------------- fused engine


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_engine_gives_the_eager_output(dtype):
    """engine="fused" (the C++ kernel) against the eager engine's inference path, a separate implementation: float32,
    float16 and bfloat16 (computed in float32), strided inputs laid out as a model passes them, padding, rows shorter
    than a cluster, more queries than keys and fewer (float32: a rounding apart; half precision: at most a rounding of
    the half type, the two sum in different orders). Half inputs give the float32 output of the same values, cast."""
    from approx.attention import _lshfused

    fused_kernel()
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, 70, 3, H, D, generator=g).to(dtype)  # (B, N, 3, H, d): q, k, v are strided views
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    spec = get_method("lsh")
    state = spec.init_state(LshConfig(cluster_size=8, rounds=3), head_dim=D, seed=0)
    for queries, keys, real_last in ((70, 70, 51), (70, 70, 6), (70, 37, 30), (20, 70, 51)):
        key_mask = torch.ones(2, keys, dtype=torch.bool)
        key_mask[1, real_last:] = False
        qq, kk, vv = q[:, :, :queries], k[:, :, :keys], v[:, :, :keys]
        out = {}
        for engine in ("eager", "fused"):
            config = LshConfig(cluster_size=8, rounds=3, engine=engine)
            kw = dict(key_mask=key_mask, query_mask=None, scale=D**-0.5, config=config, state=state)
            with torch.no_grad():
                out[engine] = spec.attend(qq, kk, vv, **kw)
                if engine == "fused" and dtype != torch.float32:
                    single = spec.attend(qq.float(), kk.float(), vv.float(), **kw)
                    assert out[engine].dtype == dtype and torch.equal(out[engine], single.to(dtype))
        tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}
        torch.testing.assert_close(out["fused"], out["eager"], **tol)
    assert _lshfused.build.cache_info().currsize == 1


def test_fused_engine_with_padding_inside_rows_on_two_threads():
    """Padding spread through a row (the padded tokens sort last in every round wherever they sit) and two threads
    (the suite runs on one; here the kernel's tasks run in parallel, split by (batch, head) row or by each round's
    clusters, to the bit alike, and alike for a single row): the loop reference."""
    from approx.attention import _lshfused

    fused_kernel()
    q, k, v = inputs(n=90, seed=4)
    mask = torch.ones(B, 90, dtype=torch.bool)
    mask[1, torch.randperm(90, generator=torch.Generator().manual_seed(4))[:23]] = False
    lyr = lsh(cluster_size=8, rounds=3, engine="fused")
    ref = reference_lsh(q, k, v, mask, lyr.state()["directions"], 8)
    threads, calls, real = torch.get_num_threads(), [], _lshfused.attend
    out = {}
    try:
        _lshfused.attend = lambda *a, **kw: calls.append(1) or real(*a, **kw)
        torch.set_num_threads(2)
        with torch.no_grad():
            for split in ("rows", "clusters", "auto"):  # (by row; by each round's clusters; rows here: B H > 2)
                _lshfused.SPLIT = split
                out[split] = lyr(q, k, v, mask)
            _lshfused.SPLIT = "auto"  # one (batch, head) row on two threads: each round's clusters
            one = lyr(q[1:, :1], k[1:, :1], v[1:, :1], mask[1:])
    finally:
        torch.set_num_threads(threads)
        _lshfused.attend = real
        _lshfused.SPLIT = "auto"
    assert calls == [1] * 4
    torch.testing.assert_close(real_rows(out["rows"], mask), real_rows(ref, mask), rtol=1e-9, atol=1e-12)
    assert torch.equal(out["rows"], out["clusters"]) and torch.equal(out["rows"], out["auto"])  # the same arithmetic
    assert torch.equal(one, out["rows"][1:, :1])


def test_fused_engine_runs_the_eager_paths_where_its_kernel_does_not(monkeypatch):
    """With a gradient to track, attention dropout, or off the CPU (the meta device stands in for a GPU, with a
    warning), engine="fused" runs what engine="eager" runs: the differentiable loop, same gradients; the kernel only
    in CPU inference, and only while the key clusters' numbers are exact in the compute dtype."""
    from approx.attention import _lshfused

    fused_kernel()
    calls, real = [], _lshfused.attend
    monkeypatch.setattr(_lshfused, "attend", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    mask = padded_mask(60, 43)
    grads = {}
    for engine in ("eager", "fused"):
        x = [t.clone().requires_grad_() for t in inputs(n=60)]
        out = lsh(cluster_size=8, rounds=3, engine=engine)(*x, mask)
        (real_rows(out, mask) * torch.linspace(-1, 1, D, dtype=torch.float64)).sum().backward()
        grads[engine] = [t.grad for t in x]
    assert calls == []
    for name, a, b in zip("qkv", grads["fused"], grads["eager"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"d{name}")
    x = inputs(n=60)
    assert _lshfused.usable(*x, dropout=0.0, clusters=8) and not _lshfused.usable(*x, dropout=0.1, clusters=8)
    assert _lshfused.usable(*(t.float() for t in x), dropout=0.0, clusters=2**24)
    assert not _lshfused.usable(*(t.float() for t in x), dropout=0.0, clusters=2**24 + 1)
    assert _lshfused.usable(*x, dropout=0.0, clusters=2**24 + 1)  # float64 holds them
    spec, config = get_method("lsh"), LshConfig(cluster_size=8, rounds=3, engine="fused")
    state = {name: t.to("meta") for name, t in spec.init_state(config, head_dim=D, seed=0).items()}
    kw = dict(key_mask=mask.to("meta"), query_mask=mask.to("meta"), scale=D**-0.5, config=config, state=state)
    with torch.no_grad(), pytest.warns(UserWarning, match="on meta it runs what engine='eager' runs"):
        with pytest.raises(RuntimeError, match="meta tensors"):  # the eager loop reads values, which meta has not
            spec.attend(*(t.to("meta") for t in x), **kw)
    assert calls == []
    with torch.no_grad():
        lsh(cluster_size=8, rounds=3, engine="fused")(*x, mask)
    assert calls == [1]


def test_fused_engine_says_why_it_cannot_build(monkeypatch):
    """A failed build (no compiler, no ninja, a compile error) is an error naming the engine, the cause and the way
    out, raised on the call that asked for the kernel; nothing falls back unsaid."""
    from torch.utils import cpp_extension

    from approx.attention import _cpp, _lshfused

    tries = []

    def broken(**kw):
        tries.append(kw["name"])
        raise OSError("no C++ compiler found (g++)")

    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.setattr(_cpp, "_FAILED", {})
    _lshfused.build.cache_clear()
    try:
        errors = []
        for _ in range(2):  # the second call says the same, without building again (torch would not either)
            with (
                torch.no_grad(),
                pytest.raises(RuntimeError, match=r"engine='fused' could not build .*no C\+\+ comp") as e,
            ):
                lsh(cluster_size=8, rounds=2, engine="fused")(*inputs(n=40), None)
            errors.append(e.value)
        assert len(tries) == 1
        assert errors[0] is not errors[1] and str(errors[0]) == str(errors[1])  # a new error: no earlier call's frames
    finally:
        _lshfused.build.cache_clear()
    with pytest.raises(ValueError, match="'eager', 'compiled', 'fused'"):
        LshConfig(engine="fast")


def test_fused_engine_through_a_patched_model():
    """approx.patch(model, "lsh", engine="fused") on a BERT with a padded row: the eager engine's outputs (a rounding
    apart), and the kernel ran in every layer."""
    from approx.attention import _lshfused

    fused_kernel()
    inputs_ = batch(seq_len=48, pad=13)
    with torch.no_grad():
        eager = model_output(approx.patch(tiny_model("bert"), "lsh", cluster_size=8, rounds=3), **inputs_)
        model = approx.patch(tiny_model("bert"), "lsh", cluster_size=8, rounds=3, engine="fused")
        real = _lshfused.attend
        calls = []
        _lshfused.attend = lambda *a, **kw: calls.append(1) or real(*a, **kw)
        try:
            fused = model_output(model, **inputs_)
        finally:
            _lshfused.attend = real
    assert len(calls) == model.config.num_hidden_layers
    keep = inputs_["attention_mask"].bool()[..., None].expand_as(fused)
    torch.testing.assert_close(fused[keep], eager[keep], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------- recall (stats)


def structured(n=256, seed=0):
    """Queries and keys around 8 shared centres: each query's large scores sit on the keys of its centre."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(8, D, generator=g, dtype=torch.float64) * 2
    q = centres[torch.randint(0, 8, (B, H, n), generator=g)] + 0.5 * torch.randn(B, H, n, D, generator=g)
    k = centres[torch.randint(0, 8, (B, H, n), generator=g)] + 0.5 * torch.randn(B, H, n, D, generator=g)
    return q, k


def recall(q, k, mask, **options):
    """|G ∩ Ĝ| / |G| and |Ĝ| / valid pairs, summed over heads and a few seeds of the directions."""
    hit = gold = predicted = valid = 0.0
    for seed in range(3):
        s = lsh(seed=seed, **options).graph_stats(q, k, mask)
        hit, gold = hit + float(s["hit"].sum()), gold + float(s["gold"].sum())
        predicted, valid = predicted + float(s["predicted"].sum()), valid + float(s["valid"].mean()) * H
    return hit / gold, predicted / valid


def test_more_rounds_and_larger_clusters_raise_recall():
    q, k = structured()
    mask = padded_mask(256, 200)
    by_rounds = [recall(q, k, mask, cluster_size=16, rounds=r) for r in (1, 2, 4)]
    by_size = [recall(q, k, mask, cluster_size=c, rounds=2) for c in (8, 16, 32)]
    for series in (by_rounds, by_size):
        recalls = [r for r, _ in series]
        assert all(a < b for a, b in zip(recalls, recalls[1:])), series
    # better than chance: random clusters of the same density would find about that fraction of the gold pairs
    for r, density in by_rounds + by_size:
        assert r > 1.5 * density, (r, density)


# ----------------------------------------------------------------------------------------- state and cost


def test_directions_are_seeded_state_shared_by_heads_and_redrawn():
    a, b = lsh(rounds=3), lsh(rounds=3)
    assert a.state()["directions"].shape == (3, D + 2)  # one per round, shared by every head
    assert torch.equal(a.state()["directions"], b.state()["directions"])
    assert not torch.equal(a.state()["directions"], lsh(rounds=3, seed=1).state()["directions"])
    q, k, v = inputs()
    before = a(q, k, v, None)
    a.redraw(5)
    assert not torch.equal(a.state()["directions"], b.state()["directions"])
    assert not torch.equal(a(q, k, v, None), before)


def test_redraw_through_a_patched_model():
    """Fixed until redrawn; the same redraw seed gives the same directions and outputs."""
    model = approx.patch(tiny_model("bert"), "lsh", cluster_size=8)
    inputs_ = batch(48, pad=13)
    with torch.no_grad():
        a = model_output(model, **inputs_)
        assert torch.equal(model_output(model, **inputs_), a)
        directions = approx.patched_layers(model)[0].state()["directions"].clone()
        approx.redraw(model, seed=1)
        assert not torch.equal(approx.patched_layers(model)[0].state()["directions"], directions)
        c = model_output(model, **inputs_)
        assert not torch.equal(c, a)
        approx.redraw(model, seed=1)
        assert torch.equal(model_output(model, **inputs_), c)


def test_cost():
    spec = get_method("lsh")
    cost = spec.cost(LshConfig(cluster_size=64, rounds=4), n=1024, s=1024, d=64, dv=32)
    assert cost.qk_pairs == 4 * 1024 * 64
    assert cost.matmul_macs == 4 * 1024 * 64 * (64 + 32)
    assert cost.flops > 2 * cost.matmul_macs  # plus the hashing
    short = spec.cost(LshConfig(cluster_size=64, rounds=2), n=40, s=40, d=64, dv=64)
    assert short.qk_pairs == 40 * 40  # one cluster: every pair, found in the one round run


@pytest.mark.parametrize("n, s, c", [(65, 65, 64), (100, 100, 16), (90, 90, 8), (50, 20, 8), (20, 50, 8), (45, 30, 64)])
def test_cost_counts_the_pattern_pairs(n, s, c):
    """One round's cost is the pairs of its pattern, a short last cluster included (N or S not a multiple of c): the
    support of the dense weights, counted for every head (small scores, so no weight underflows to 0); more rounds
    count each round's pairs (duplicates included), at least the union's."""
    g = torch.Generator().manual_seed(5)
    q = 0.1 * torch.randn(1, 2, n, D, generator=g, dtype=torch.float64)
    k = 0.1 * torch.randn(1, 2, s, D, generator=g, dtype=torch.float64)
    spec = get_method("lsh")
    for rounds in (1, 3):
        config = LshConfig(cluster_size=c, rounds=rounds)
        state = spec.init_state(config, head_dim=D, seed=0)
        w = spec.weights(q, k, key_mask=None, query_mask=None, scale=D**-0.5, config=config, state=state)
        support = [int((w[0, h] > 0).sum()) for h in range(2)]
        pairs = spec.cost(config, n=n, s=s, d=D, dv=D).qk_pairs
        if rounds == 1 or c >= max(n, s):  # (c >= N, S: one round runs)
            assert support == [pairs, pairs]
        else:
            assert (
                max(support)
                <= pairs
                == rounds * spec.cost(LshConfig(cluster_size=c, rounds=1), n=n, s=s, d=D, dv=D).qk_pairs
            )


def test_one_cluster_runs_one_round_and_is_exact(monkeypatch):
    """A call whose padded length fits one cluster hashes and attends one round, whatever ``rounds`` says (the
    others would find the same pairs), and gives exact attention; one token longer, every round runs."""
    import approx.attention.lsh as lsh_mod

    seen, real = [], lsh_mod.hash_and_sort

    def spy(q, k, key_mask, query_mask, config, state):
        seen.append(state["directions"].shape[0])
        return real(q, k, key_mask, query_mask, config, state)

    monkeypatch.setattr(lsh_mod, "hash_and_sort", spy)
    layer = lsh(cluster_size=32, rounds=4)
    for n, rounds in ((32, 1), (33, 4)):
        q, k, v = inputs(n)
        mask = padded_mask(n, n - 5)
        out = layer(q, k, v, mask)
        assert seen[-1] == rounds
        if n == 32:
            real_rows = mask[:, None, :, None].expand_as(out)
            torch.testing.assert_close(
                out[real_rows], naive_attention(q, k, v, mask)[real_rows], rtol=1e-10, atol=1e-12
            )


def test_the_split_benchmark_times_both_splits_and_records_how(tmp_path, monkeypatch, capsys):
    """benchmarks/lsh_split.py: both splits timed on the same inputs, the ratio printed, and a JSON with the settings
    and provenance; ``auto`` is left as it was."""
    from approx.attention import _lshfused

    fused_kernel()
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import lsh_split

    threads = torch.get_num_threads()
    try:
        lsh_split.main(["--threads", "2", "--heads", "1", "--lengths", "256", "--repeats", "1", "--cluster-size", "32",
                        "--output", str(tmp_path / "split.json")])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    record = json.loads((tmp_path / "split.json").read_text())
    (row,) = record["results"]
    assert row["auto"] == "clusters" and row["rows_s"] > 0 and row["clusters_s"] > 0
    assert record["provenance"]["git_commit"] is not None and record["settings"]["threads"] == 2
    assert "| (1, 1, 256, 64) |" in capsys.readouterr().out and _lshfused.SPLIT == "auto"
