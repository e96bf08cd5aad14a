"""The block-band kernel (bigbird's CPU fast path, approx/attention/_blockband.py) against a float64 softmax written
from BigBird's definition (tests/test_bigbird.py's reference mask) and against the gather kernel: partial blocks,
padding at the end, spread through the row and poisoned, no random blocks, every block drawn, K and V viewed in place
or copied, chunks, strided and half-precision inputs, and when it declines (gradients, dropout)."""

import math

import pytest
import torch
from test_bigbird import drawn, masked_attention, reference_mask

from approx import ApproxAttention
from approx.attention import _blockband, _blocksparse, _dense
from approx.attention.bigbird import BigBirdConfig
from approx.attention.sparse_transformer import SparseTransformerConfig

B, H, D = 2, 3, 16


def qkv(n, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, n, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))


def layer(kernel="band", **options):
    return ApproxAttention("bigbird", BigBirdConfig(kernel=kernel, full_fallback=False, **options), head_dim=D)


def fused_calls(monkeypatch, build: bool = True) -> list:
    """The calls of the C++ kernel to come, counted. ``build``: the test is skipped, saying why, where the kernel cannot
    be built, and the dense route for short inputs is turned off ("fused" runs what "auto" runs, which takes it)."""
    if build:
        try:
            _blockband.build_fused()
        except RuntimeError as err:
            pytest.skip(f"the block-band C++ kernel cannot be built here: {err}")
        monkeypatch.setattr(_dense, "dense_route", lambda *args, **kwargs: False)
    calls, real = [], _blockband._fused_row
    monkeypatch.setattr(_blockband, "_fused_row", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.fixture(params=["band", "fused"])
def kernel(request, monkeypatch):
    """The block-band kernel in plain torch (``kernel="band"``) or in C++ (``kernel="fused"``, see
    :func:`fused_calls`); checks afterwards that the C++ kernel ran exactly when asked for."""
    calls = fused_calls(monkeypatch, build=request.param == "fused")
    yield request.param
    assert bool(calls) == (request.param == "fused"), f"{len(calls)} C++ calls with kernel={request.param!r}"


def definition(lyr, q, k, v, mask, block, r):
    rand = [drawn(lyr, math.ceil(int(m.sum()) / block), r) for m in mask]
    return masked_attention(q.double(), k.double(), v.double(), reference_mask(mask, block, rand))


def spread_mask(n, real, seed=0):
    """(B, N): the first row all real, the second ``real`` tokens at random places (padding in between)."""
    mask = torch.ones(B, n, dtype=torch.bool)
    g = torch.Generator().manual_seed(seed)
    mask[1, torch.randperm(n, generator=g)[: n - real]] = False
    return mask


def end_mask(n, real):
    return torch.arange(n)[None, :] < torch.tensor([n, real])[:, None]


@pytest.mark.parametrize(
    "block,r,n,real,layout",
    [
        (4, 1, 60, 47, "end"),  # the last real block partial
        (4, 2, 64, 64, "end"),  # whole blocks, no padding: K and V viewed in place
        (5, 3, 73, 52, "spread"),  # padding between the real tokens: every row copied in its order
        (8, 1, 50, 17, "end"),  # three blocks: no random block is left
        (3, 0, 40, 40, "end"),  # no random blocks
        (4, 20, 48, 41, "spread"),  # every eligible block drawn
        (6, 2, 90, 90, "spread"),  # both rows without padding, n off the block grid
    ],
)
def test_matches_the_definition(block, r, n, real, layout, kernel):
    q, k, v = qkv(n)
    mask = (end_mask if layout == "end" else spread_mask)(n, real)
    lyr = layer(kernel, block=block, random_blocks=r)
    ref = definition(lyr, q, k, v, mask, block, r)
    with torch.no_grad():
        out = lyr(q, k, v, mask)
    real_q = mask[:, None, :, None]
    torch.testing.assert_close(out.masked_fill(~real_q, 0), ref.masked_fill(~real_q, 0), rtol=1e-12, atol=1e-12)


def test_both_row_layouts_run(monkeypatch):
    """Whole blocks in order view K and V in place, the rest are copied: both paths run, and agree."""
    paths = []
    real_load = _blockband._load
    monkeypatch.setattr(_blockband, "_load", lambda *a: paths.append("copy") or real_load(*a))
    q, k, v = qkv(64)
    lyr = layer(block=4, random_blocks=2)
    with torch.no_grad():
        lyr(q, k, v)
    assert paths == []  # 16 whole blocks in order: nothing copied
    mask = end_mask(64, 62)
    with torch.no_grad():
        out = lyr(q, k, v, mask)
    assert "copy" in paths
    ref = definition(lyr, q, k, v, mask, 4, 2)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[1, :, :62], ref[1, :, :62], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("spread", [True, False])
def test_poisoned_padding_never_reaches_a_real_row(kernel, spread):
    q, k, v = qkv(80, seed=3)
    mask = spread_mask(80, 61, seed=3) if spread else end_mask(80, 61)
    kp, vp = k.clone(), v.clone()
    kp[1, :, ~mask[1]], vp[1, :, ~mask[1]] = float("inf"), float("nan")
    lyr = layer(kernel, block=8, random_blocks=2)
    with torch.no_grad():
        out = lyr(q, kp, vp, mask)
    real_q = mask[:, None, :, None].expand_as(out)
    assert torch.isfinite(out[real_q]).all()
    torch.testing.assert_close(
        out.masked_fill(~real_q, 0),
        definition(lyr, q, k, v, mask, 8, 2).masked_fill(~real_q, 0),
        rtol=1e-12,
        atol=1e-12,
    )


def test_chunks_give_the_whole_answer(monkeypatch):
    """Chunks of one query block, of three, and all at once: the same output (flags found per chunk)."""
    q, k, v = qkv(130, seed=4)
    mask = end_mask(130, 101)
    lyr = layer(block=5, random_blocks=2)
    outs = []
    for elements in (1, 3 * 5 * 60, 1 << 20):
        monkeypatch.setattr(_blockband, "_CHUNK_ELEMENTS", elements)
        with torch.no_grad():
            outs.append(lyr(q, k, v, mask)[:, :, :101])
    ref = definition(lyr, q, k, v, mask, 5, 2)[:, :, :101]
    for out in outs:
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_strided_inputs_agree_with_the_gather_kernel(kernel):
    """q, k, v as a model passes them (views of one (B, N, 3, H, d) projection), float32: the gather kernel's output."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, 256, 3, H, D, generator=g)
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
    mask = end_mask(256, 200)
    with torch.no_grad():
        band = layer(kernel, block=16, random_blocks=3)(q, k, v, mask)
        gather = layer("gather", block=16, random_blocks=3)(q, k, v, mask)
    # padded queries too: both attend the global blocks' keys only
    torch.testing.assert_close(band, gather, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype, kernel):
    """Half-precision inputs, computed in float32: at most twice the gather kernel's error against the float64
    definition (plus one rounding step of the output dtype)."""
    q, k, v = qkv(96, seed=7, dtype=dtype)
    mask = end_mask(96, 77)
    with torch.no_grad():
        out = layer(kernel, block=8, random_blocks=2)(q, k, v, mask)
        gather = layer("gather", block=8, random_blocks=2)(q, k, v, mask)
    assert out.dtype == dtype
    ref = definition(layer(block=8, random_blocks=2), q, k, v, mask, 8, 2)
    real = mask[:, None, :, None].expand_as(ref)
    err, base = ((x.double() - ref)[real].abs().max() for x in (out, gather))
    assert err <= 2 * base + torch.finfo(dtype).eps


def test_auto_takes_it_for_inference_only(monkeypatch):
    """kernel='auto' on the CPU: the block-band kernel without gradients (above the dense route's length, here set
    low); with them the gather kernel, whose gradients match the float64 definition's."""
    monkeypatch.setattr(_dense, "DENSE_KEYS_PER_ROW", 0)
    calls = []
    real_attend = _blockband.attend
    monkeypatch.setattr(_blockband, "attend", lambda *a, **kw: calls.append(1) or real_attend(*a, **kw))
    q, k, v = qkv(60, seed=8)
    mask = end_mask(60, 47)
    lyr = layer("auto", block=4, random_blocks=1)
    with torch.no_grad():
        lyr(q, k, v, mask)
    assert calls == [1]
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    full = torch.ones(B, 60, dtype=torch.bool)  # (the definition's padded rows are NaN, which backward spreads)
    lyr(q, k, v, full).sum().backward()
    assert calls == [1]
    r = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    definition(lyr, *r, full, 4, 1).sum().backward()
    for mine, theirs in zip((q, k, v), r, strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-10, atol=1e-10)


def test_fused_runs_what_auto_runs_where_its_kernel_does_not(monkeypatch):
    """kernel='fused' with gradients: no C++ call, the gather kernel as under 'auto' (the same output and gradients
    to the bit); off the CPU a warning (the meta device stands in for a GPU) before what 'auto' runs there."""
    monkeypatch.setattr(_dense, "DENSE_KEYS_PER_ROW", 0)
    calls = fused_calls(monkeypatch, build=False)
    full = torch.ones(B, 60, dtype=torch.bool)
    grads, outs = {}, {}
    for kernel in ("auto", "fused"):
        x = [t.clone().requires_grad_() for t in qkv(60, seed=8)]
        outs[kernel] = layer(kernel, block=4, random_blocks=1)(*x, full)
        outs[kernel].sum().backward()
        grads[kernel] = [t.grad for t in x]
    assert calls == []
    torch.testing.assert_close(outs["fused"], outs["auto"], rtol=0, atol=0)
    for a, b in zip(grads["fused"], grads["auto"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    pattern = _blocksparse.Pattern(4, torch.zeros(1, 1, 15, 3, dtype=torch.long, device="meta"), neighbours=1)
    q, k, v = (t.to("meta") for t in qkv(60))
    with pytest.warns(UserWarning, match="kernel='fused' runs its C\\+\\+ kernel on the CPU only; on meta"):
        try:
            _blocksparse.attend(q, k, v, pattern, key_mask=None, scale=D**-0.5, kernel="fused")
        except (RuntimeError, NotImplementedError):
            pass  # what 'auto' runs may read values, which meta has not: the warning came first
    assert calls == []


def test_fused_says_why_it_cannot_build(monkeypatch):
    """A failed build is an error naming the option, the cause and the plain-torch way out; the options list
    'fused' among the kernels."""
    from torch.utils import cpp_extension

    from approx.attention import _cpp

    def broken(**kw):
        raise OSError("no C++ compiler found (g++)")

    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.setattr(_cpp, "_FAILED", {})
    monkeypatch.setattr(_dense, "dense_route", lambda *args, **kwargs: False)
    _blockband.build_fused.cache_clear()
    try:
        with torch.no_grad(), pytest.raises(RuntimeError, match=r"bigbird: kernel='fused' could not build .*no C\+\+"):
            layer("fused", block=4, random_blocks=1)(*qkv(60))
    finally:
        _blockband.build_fused.cache_clear()
    with pytest.raises(ValueError, match="auto, gather, flex, band, fused"):
        BigBirdConfig(kernel="fast")


def test_fused_through_a_patched_model(monkeypatch):
    """approx.patch(model, "bigbird", kernel="fused") on a BERT with a padded row: the plain-torch block-band kernel's
    outputs (a rounding apart), and the C++ kernel ran in every layer."""
    from conftest import batch, model_output, tiny_model

    import approx

    calls = fused_calls(monkeypatch)
    inputs = batch(seq_len=96, pad=21)
    opts = dict(block=8, random_blocks=2, full_fallback=False)
    with torch.no_grad():
        band = model_output(approx.patch(tiny_model("bert"), "bigbird", kernel="band", **opts), **inputs)
        assert calls == []
        model = approx.patch(tiny_model("bert"), "bigbird", kernel="fused", **opts)
        fused = model_output(model, **inputs)
    assert len(calls) == B * model.config.num_hidden_layers  # a call per batch row and layer
    keep = inputs["attention_mask"].bool()[..., None].expand_as(fused)
    torch.testing.assert_close(fused[keep], band[keep], rtol=1e-4, atol=1e-5)


def test_declines_with_a_reason():
    q, k, v = qkv(60)
    lyr = layer(block=4, random_blocks=1)
    with pytest.raises(RuntimeError, match="kernel='band' cannot run this call: it is inference only"):
        lyr(q.clone().requires_grad_(), k, v)
    with pytest.raises(ValueError, match="kernel"):
        SparseTransformerConfig(kernel="band")  # neither a band nor neighbouring blocks
    pattern = _blocksparse.Pattern(4, torch.zeros(1, 1, 15, 3, dtype=torch.long), neighbours=1)

    def why(*qkv_, key_mask=None, dropout=0.0, with_lse=False, p=pattern):
        return _blockband.unusable(*(qkv_ or (q, k, v)), p, key_mask=key_mask, dropout=dropout, with_lse=with_lse)

    assert why() is None
    assert "dropout" in why(dropout=0.1)
    assert "log-sum-exp" in why(with_lse=True)
    assert "as many queries as keys" in why(q, k[:, :, :50], v[:, :, :50])
    # blocks over positions (no order) with padding before real tokens: not what the kernel assumes
    start = torch.ones(B, 60, dtype=torch.bool)
    start[1, :5] = False
    assert "real tokens first" in why(key_mask=start)
    assert why(key_mask=end_mask(60, 50)) is None
    order = start.to(torch.uint8).argsort(dim=-1, descending=True, stable=True)[:, None]  # real first: fine
    assert (
        why(key_mask=start, p=_blocksparse.Pattern(4, pattern.kv_blocks, q_order=order, k_order=order, neighbours=1))
        is None
    )
    heads = order.expand(B, H, 60)
    per_head = _blocksparse.Pattern(4, pattern.kv_blocks, q_order=heads, k_order=heads, neighbours=1)
    assert "one order per batch row" in why(p=per_head)


def test_a_handmade_pattern_as_the_gather_kernel_runs_it(monkeypatch):
    """Any pattern with neighbours, not only bigbird's: blocks dropped at random (some query blocks left with no key
    at all, whose rows are 0), two listed blocks per query block and head, no shared keys, padding at the end (a
    partial last block); the first query blocks' windows start before the sequence. Both forms of the kernel."""
    calls = fused_calls(monkeypatch)
    g = torch.Generator().manual_seed(9)
    n, blk = 70, 5
    tq = math.ceil(n / blk)
    q, k, v = qkv(n, seed=9)
    near = torch.arange(tq)[:, None] + torch.arange(-2, 3)  # neighbours = 2
    listed = torch.randint(0, tq, (B, H, tq, 2), generator=g)
    listed[..., 1] = (listed[..., 0] + 1 + torch.randint(0, tq - 1, (B, H, tq), generator=g)) % tq  # distinct
    kv = torch.cat([near.expand(B, H, tq, 5), listed], -1)
    ok = torch.rand(B, H, tq, 7, generator=g) < 0.6
    ok[..., :5] &= (near >= 0) & (near < tq)
    ok[:, :, 3] = False  # query block 3: no key at all
    ok[..., 5:] &= ((listed[..., :, None] - near[:, None, :]).abs() > 0).all(-1)  # listed: not a neighbour
    pattern = _blocksparse.Pattern(blk, kv, ok, neighbours=2)
    mask = end_mask(n, 58)
    outs = {
        kernel: _blocksparse.attend(q, k, v, pattern, key_mask=mask, scale=D**-0.5, kernel=kernel)
        for kernel in ("gather", "band", "fused")
    }
    assert calls == [1, 1]  # a call per batch row
    for kernel in ("band", "fused"):
        assert outs[kernel][:, :, 3 * blk : 4 * blk].abs().max() == 0
        torch.testing.assert_close(outs[kernel][0], outs["gather"][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(outs[kernel][1, :, :58], outs["gather"][1, :, :58], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "case",
    [
        "start",  # neighbours = 2 and only block 0 global: the first window of the run starts before the sequence
        "end",  # the last block not global: the last window of the run ends after the sequence
        "partial",  # a partial last block with poisoned padding, listed by every query block
    ],
)
def test_views_only_where_whole_real_blocks_allow_them(case, monkeypatch):
    """Where K and V are viewed in place (no copy) and where they must be copied: handmade patterns at the edge of
    each condition give the gather kernel's output on every real row, on both forms of the kernel."""
    calls = fused_calls(monkeypatch)
    blk, n = 8, 64
    tq = n // blk
    neighbours, real, glob_blocks = {"start": (2, 64, [0, 6, 7]), "end": (1, 64, [0]), "partial": (1, 60, [0, 6, 7])}[
        case
    ]
    width = 2 * neighbours + 1
    near = torch.arange(tq)[:, None] + torch.arange(-neighbours, neighbours + 1)
    listed = torch.full((tq, 1), tq - 1)  # the last block, listed by every query block
    kv = torch.cat([near, listed], -1)[None, None]
    ok = ((near >= 0) & (near < tq) & (near != tq - 1))[None, None]
    ok = torch.cat([ok, (near.max(-1, keepdim=True).values < tq - 1)[None, None]], -1)
    mask = end_mask(n, real)
    pos = torch.arange(n)[None].expand(B, n)
    glob = torch.zeros(B, n, dtype=torch.bool)
    for t in glob_blocks:
        glob |= (pos >= t * blk) & (pos < (t + 1) * blk)
    glob &= mask
    pattern = _blocksparse.Pattern(blk, kv, ok, global_queries=glob, neighbours=neighbours)
    q, k, v = qkv(n, seed=11)
    k[1, :, real:], v[1, :, real:] = float("inf"), float("nan")
    outs = {
        kernel: _blocksparse.attend(q, k, v, pattern, key_mask=mask, scale=D**-0.5, kernel=kernel)
        for kernel in ("gather", "band", "fused")
    }
    assert width == kv.shape[-1] - 1 and calls == [1, 1]
    real_q = mask[:, None, :, None].expand_as(outs["band"])
    for kernel in ("band", "fused"):
        assert torch.isfinite(outs[kernel][real_q]).all()
        torch.testing.assert_close(outs[kernel][real_q], outs["gather"][real_q], rtol=1e-12, atol=1e-12)


def test_fused_reads_rows_blas_cannot_take_in_place(monkeypatch):
    """Keys broadcast along the sequence (a row stride of 0, which BLAS refuses as a leading dimension) and queries
    whose rows overlap: copied before the C++ kernel reads them, giving the plain-torch kernel's output."""
    calls = fused_calls(monkeypatch)
    g = torch.Generator().manual_seed(12)
    q, v = (torch.randn(B, H, 96, D, generator=g, dtype=torch.float64) for _ in range(2))
    k = torch.randn(B, H, 1, D, generator=g, dtype=torch.float64).expand(B, H, 96, D)  # row stride 0
    base = torch.randn(B, H, 96 * 2 + D, generator=g, dtype=torch.float64)
    q_overlap = base.unfold(-1, D, 2)[:, :, :96]  # rows 2 apart, D long: overlapping
    assert k.stride(2) == 0 and q_overlap.stride(2) == 2
    for qq in (q, q_overlap):
        with torch.no_grad():
            band = layer("band", block=8, random_blocks=2)(qq, k, v)
            fused = layer("fused", block=8, random_blocks=2)(qq, k, v)
        torch.testing.assert_close(fused, band, rtol=1e-12, atol=1e-12)
    assert calls == [1, 1, 1, 1]
    # rows one element wide whose last stride is not 1 (torch calls them contiguous, so copying would not help)
    thin = torch.randn(B * H * 96 * 5, generator=g, dtype=torch.float64).as_strided((B, H, 96, 1), (H * 96, 96, 1, 5))
    out = {}
    for kernel in ("band", "fused"):
        config = BigBirdConfig(kernel=kernel, block=8, random_blocks=2, full_fallback=False)
        lyr = ApproxAttention("bigbird", config, head_dim=1)
        with torch.no_grad():
            out[kernel] = lyr(thin, thin, thin)
    torch.testing.assert_close(out["fused"], out["band"], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel_", ["band", "fused"])
def test_fused_on_two_threads(kernel_, monkeypatch):
    """The suite runs on one thread (conftest); here two, so that the C++ kernel's tasks run in parallel (one per
    (head, query block)): the one-thread output and the definition's, to rounding (the global rows' SDPA and the
    products round differently on two threads, on both forms of the kernel)."""
    calls = fused_calls(monkeypatch, build=kernel_ == "fused")
    q, k, v = qkv(200, seed=13)
    mask = end_mask(200, 171)
    lyr = layer(kernel_, block=8, random_blocks=2)
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(1)
            one = lyr(q, k, v, mask)
            torch.set_num_threads(2)
            two = lyr(q, k, v, mask)
    finally:
        torch.set_num_threads(threads)
    assert bool(calls) == (kernel_ == "fused")
    torch.testing.assert_close(one, two, rtol=1e-12, atol=1e-12)
    real_q = mask[:, None, :, None]
    ref = definition(lyr, q, k, v, mask, 8, 2)
    torch.testing.assert_close(two.masked_fill(~real_q, 0), ref.masked_fill(~real_q, 0), rtol=1e-12, atol=1e-12)
