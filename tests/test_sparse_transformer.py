"""Sparse Transformer attention against an independent float64 reference: a dense mask written pair by pair from
the paper's definitions (strided / fixed, split / union heads, bidirectional), for the output, the weights, the
graph statistics and the cost; the exact limit, padding, gradients and the kernel's sparsity. The generic tests
(tests/test_methods.py ...) cover the default pattern's padding, precision, gradient and fallback behaviour."""

import pytest
import torch
from reference import naive_attention

from approx import ApproxAttention, get_method
from approx.attention import sparse_transformer as st
from approx.attention.sparse_transformer import SparseTransformerConfig

B, D = 2, 8
COMBINATIONS = [(p, h) for p in ("strided", "fixed") for h in ("split", "union")]


def inputs(n, heads, seed=0, pad=11):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, heads, n, D, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, n - pad :] = False
    return q, k, v, mask


def reference_mask(pattern, heads_mode, stride, c, heads, n):
    """(H, N, N) bool, pair by pair from the definitions with l = stride (no causal condition): strided
    A1 = {|i - j| < l}, A2 = {(i - j) mod l = 0}; fixed A1 = {j // l = i // l}, A2 = {j mod l >= l - c};
    split: head h attends A1 for even h and A2 for odd h; union: A1 or A2 in every head."""
    a1 = torch.zeros(n, n, dtype=torch.bool)
    a2 = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            if pattern == "strided":
                a1[i, j] = abs(i - j) < stride
                a2[i, j] = (i - j) % stride == 0
            else:
                a1[i, j] = j // stride == i // stride
                a2[i, j] = j % stride >= stride - c
    if heads_mode == "union":
        return (a1 | a2).expand(heads, n, n)
    return torch.stack([a1 if h % 2 == 0 else a2 for h in range(heads)])


def reference(q, k, v, mask, allowed, scale=D**-0.5):
    """Softmax over the allowed real keys in float64; a row without any (padding queries far from the real
    tokens): uniform weights over the real keys, the method's convention."""
    scores = torch.einsum("bhnd,bhsd->bhns", q, k) * scale
    ok = allowed[None] & mask[:, None, None, :]
    w = scores.masked_fill(~ok, float("-inf")).softmax(-1).nan_to_num(0.0)
    uniform = mask[:, None, None, :].double() / mask.sum(-1).double()[:, None, None, None]
    w = torch.where(ok.any(-1, keepdim=True), w, uniform)
    return w @ v, w


def options(pattern, heads_mode, **extra):
    base = {"stride": 6, "summary": 2} if pattern == "fixed" else {"stride": 5}
    return {"pattern": pattern, "heads": heads_mode, **base, **extra}


@pytest.mark.parametrize("kernel", ["gather", "auto"])  # auto: on these short inputs SDPA over the dense mask
@pytest.mark.parametrize("pad", [11, 43])
@pytest.mark.parametrize("block", [4, 7, 64])
@pytest.mark.parametrize("heads", [3, 4])
@pytest.mark.parametrize("pattern,heads_mode", COMBINATIONS)
def test_matches_the_dense_definition(pattern, heads_mode, heads, block, pad, kernel):
    """Output, weights and graph size equal the float64 reference built from the definitions, with a padded row
    (39 real tokens, or 7: fewer than 2 l, one or two keys per residue), an odd head count (A1 gets the extra
    head), for block sizes that do and do not divide l and N."""
    n = 50
    q, k, v, mask = inputs(n, heads, pad=pad)
    opts = options(pattern, heads_mode, block=block, kernel=kernel)
    allowed = reference_mask(pattern, heads_mode, opts["stride"], opts.get("summary", 8), heads, n)
    ref_out, ref_w = reference(q, k, v, mask, allowed)
    lyr = ApproxAttention("sparse-transformer", SparseTransformerConfig(**opts), head_dim=D)
    torch.testing.assert_close(lyr(q, k, v, mask), ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lyr.weights(q, k, mask), ref_w, rtol=1e-10, atol=1e-10)
    stats = get_method("sparse-transformer").stats(
        q, k, key_mask=mask, query_mask=mask, scale=D**-0.5, config=lyr.config, state={}
    )
    real = mask[:, None, :, None] & mask[:, None, None, :] & allowed[None]  # real queries and keys
    assert torch.equal(stats["predicted"], real.sum((0, 2, 3)).double())


@pytest.mark.parametrize("pattern,heads_mode", COMBINATIONS)
def test_cost_counts_the_pattern_pairs_exactly(pattern, heads_mode):
    """qk_pairs: the reference mask's pairs per head (split: the mean of two heads, one of each pattern), for
    lengths that are and are not multiples of l, and l past the length."""
    for n in (1, 5, 23, 48):
        for stride in (1, 3, 6, 60):
            summary = min(2, stride)
            config = SparseTransformerConfig(pattern=pattern, heads=heads_mode, stride=stride, summary=summary)
            allowed = reference_mask(pattern, heads_mode, stride, summary, 2, n)
            cost = get_method("sparse-transformer").cost(config, n=n, s=n, d=D, dv=D)
            assert cost.qk_pairs == -(-int(allowed.sum()) // 2), (n, stride)  # split: rounded up
            assert cost.matmul_macs == cost.qk_pairs * 2 * D


@pytest.mark.parametrize("kernel", ["gather", "auto"])
@pytest.mark.parametrize("extra", [0, 1, 9])
def test_exact_limit_strided_union(extra, kernel):
    """Strided with l >= N in union mode: every pair is in A1, exact attention by the pattern code (the block
    kernel, and the dense route that ``auto`` takes on short inputs)."""
    n = 40
    q, k, v, mask = inputs(n, 3)
    config = SparseTransformerConfig(pattern="strided", heads="union", stride=n + extra, block=8, kernel=kernel)
    out = ApproxAttention("sparse-transformer", config, head_dim=D)(q, k, v, mask)
    real = mask[:, None, :, None]
    assert ((out - naive_attention(q, k, v, mask, D**-0.5)) * real).abs().max() <= 1e-12
    assert get_method("sparse-transformer").cost(config, n=n, s=n, d=D, dv=D).qk_pairs == n * n


@pytest.mark.parametrize("pattern,heads_mode", COMBINATIONS)
def test_appended_pads_change_no_real_output(pattern, heads_mode):
    """Pads appended at the end (more than l of them, so residues and blocks of pads appear) leave the real
    tokens' outputs unchanged, batch rows of different real lengths included."""
    n, pad = 37, 23
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, 3, n + pad, D, generator=g, dtype=torch.float64) for _ in range(3))
    lyr = ApproxAttention(
        "sparse-transformer", SparseTransformerConfig(**options(pattern, heads_mode, block=8)), head_dim=D
    )
    lengths = torch.tensor([n, 29])
    short_mask = torch.arange(n)[None] < lengths[:, None]
    long_mask = torch.arange(n + pad)[None] < lengths[:, None]
    short = lyr(q[:, :, :n], k[:, :, :n], v[:, :, :n], short_mask)
    long = lyr(q, k, v, long_mask)
    for row, count in enumerate(lengths.tolist()):
        torch.testing.assert_close(long[row, :, :count], short[row, :, :count], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pattern,heads_mode", COMBINATIONS)
def test_gradients_equal_the_reference(pattern, heads_mode):
    """Gradients through the kernel (and the log-sum-exp merge of strided union) equal the reference's."""
    n, heads = 30, 3
    q, k, v, mask = inputs(n, heads, pad=7)
    opts = options(pattern, heads_mode, block=4)
    allowed = reference_mask(pattern, heads_mode, opts["stride"], opts.get("summary", 8), heads, n)
    lyr = ApproxAttention("sparse-transformer", SparseTransformerConfig(**opts), head_dim=D)
    real = mask[:, None, :, None].double()
    grads = []
    for run in (lambda *t: lyr(*t, mask), lambda *t: reference(*t, mask, allowed)[0]):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        (run(*leaves) * real).square().sum().backward()
        grads.append([t.grad for t in leaves])
    for ours, ref in zip(*grads, strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)


def test_kernel_blocks_stay_sparse():
    """The strided A2 part gathers only the runs of the residues a query block holds: at N = 2048, l = 64,
    block 32 every query block needs a few key blocks, not all 64 (and a padded row no more)."""
    n, blk, stride = 2048, 32, 64
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, 1500:] = False
    part = st._residues(blk, stride, mask, n, n, "cpu", skip_self=False)
    assert part.kv_blocks.shape[-1] <= 3
    window = st._window(blk, stride - 1, n, n, "cpu")
    assert window.kv_blocks.shape[-1] <= 2 * stride // blk + 1
    config = SparseTransformerConfig(pattern="fixed", heads="union", stride=64, block=32)
    assert st._blocks(config, 2, n, n, "cpu", local=True, summary=True).kv_blocks.shape[-1] == 2


def test_single_head_split_attends_a1():
    """With one head, "split" gives it A1 (the local pattern)."""
    n = 30
    q, k, v, mask = inputs(n, 1)
    lyr = ApproxAttention("sparse-transformer", SparseTransformerConfig(stride=4, block=8), head_dim=D)
    allowed = reference_mask("strided", "split", 4, 0, 1, n)
    torch.testing.assert_close(lyr(q, k, v, mask), reference(q, k, v, mask, allowed)[0], rtol=1e-10, atol=1e-10)


def test_a_query_without_a_real_key_gets_the_mean_of_the_real_values():
    """Fixed split on a row shorter than l - c: the A2 heads have no summary key yet; their queries (and the far
    padding queries of the A1 heads) get uniform weights over the real keys, in the output and the weights."""
    n = 24
    q, k, v, mask = inputs(n, 2, pad=10)  # row 1: 14 real tokens < l - c = 16
    config = SparseTransformerConfig(pattern="fixed", stride=20, summary=4, block=8)
    lyr = ApproxAttention("sparse-transformer", config, head_dim=D)
    out, w = lyr(q, k, v, mask), lyr.weights(q, k, mask)
    mean = v[1, 1, :14].mean(0)
    torch.testing.assert_close(out[1, 1], mean.expand(n, D), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w[1, 1, :, :14], torch.full((n, 14), 1 / 14, dtype=torch.float64))
    ref_out, ref_w = reference(q, k, v, mask, reference_mask("fixed", "split", 20, 4, 2, n))
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(w, ref_w, rtol=1e-10, atol=1e-10)
    # the graph statistics count the pairs those rows use: every real key (as the weights' nonzeros)
    stats = lyr.graph_stats(q, k, mask)
    real = mask[:, None, :, None] & mask[:, None, None, :]  # (B, 1, N, S): real queries and keys
    predicted = ((ref_w > 0) & real).sum((0, 2, 3)).to(stats["predicted"].dtype)
    torch.testing.assert_close(stats["predicted"], predicted)


@pytest.mark.slow
def test_flex_kernel_gives_the_gather_output():
    """Compiled FlexAttention on the residue-sorted strided pattern (per-row key orders, a padded row) and on the
    fixed pattern's shared summary keys gives the gather kernel's output; skipped where it cannot compile."""
    from approx.attention import _flex

    n = 300
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, 3, n, D, generator=g) for _ in range(3))
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, 250:] = False
    for pattern, heads_mode in (("strided", "split"), ("fixed", "union")):
        opts = {"pattern": pattern, "heads": heads_mode, "stride": 12, "summary": 3, "block": 32}
        gather = ApproxAttention("sparse-transformer", SparseTransformerConfig(kernel="gather", **opts), head_dim=D)
        flex = ApproxAttention("sparse-transformer", SparseTransformerConfig(kernel="flex", **opts), head_dim=D)
        with torch.no_grad():
            ref = gather(q, k, v, mask)
            try:
                out = flex(q, k, v, mask)
            except RuntimeError:
                if _flex._BROKEN.get("cpu"):
                    pytest.skip(f"FlexAttention cannot compile here: {_flex._BROKEN.get('cpu')}")
                raise
        torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[1, :, :250], ref[1, :, :250], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "bad,name",
    [
        ({"pattern": "dilated"}, "pattern"),
        ({"heads": "merged"}, "heads"),
        ({"stride": 0}, "stride"),
        ({"summary": 0}, "summary"),
        ({"pattern": "fixed", "stride": 4, "summary": 5}, "summary"),
        ({"block": 0}, "block"),
        ({"exact_below": -1}, "exact_below"),
        ({"kernel": "triton"}, "kernel"),
    ],
)
def test_invalid_options_are_refused_by_name(bad, name):
    with pytest.raises(ValueError, match=f"option '{name}'"):
        SparseTransformerConfig(**bad)


@pytest.mark.parametrize("pattern,heads_mode", COMBINATIONS)
def test_auto_runs_short_inference_on_the_dense_mask(pattern, heads_mode, monkeypatch):
    """kernel='auto' on the CPU: SDPA over the pattern's dense mask for inference with at most DENSE_UP_TO keys,
    the block kernel with gradients or above that length; both give the float64 definition's output. Rows padded
    at the end (one SDPA call per row on its real keys) and padding elsewhere (the -inf added at the padded keys)
    both; in float32 with NaN in the padded keys and values, which must not reach the real outputs."""
    from approx.attention import _dense

    calls = []
    real_dense = _dense.attend_dense
    monkeypatch.setattr(_dense, "attend_dense", lambda *a, **kw: calls.append(1) or real_dense(*a, **kw))
    n, heads = 50, 3
    q, k, v, mask = inputs(n, heads, pad=43)
    middle = mask.clone()
    middle[0, 20:24] = False  # padding inside a row (strided only: fixed refuses it)
    opts = options(pattern, heads_mode)
    allowed = reference_mask(pattern, heads_mode, opts["stride"], opts.get("summary", 8), heads, n)
    lyr = ApproxAttention("sparse-transformer", SparseTransformerConfig(**opts), head_dim=D)
    for m in [mask] + ([middle] if pattern == "strided" else []):
        ref, _ = reference(q, k, v, m, allowed)
        real = m[:, None, :, None]
        poisoned = [t.float().masked_fill(~real, float("nan")) for t in (k, v)]
        before = len(calls)
        out = lyr(q.float(), *poisoned, m)
        assert len(calls) == before + 1
        torch.testing.assert_close(out.masked_fill(~real, 0).double(), ref.masked_fill(~real, 0), rtol=1e-5, atol=1e-5)
    grad = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.testing.assert_close(lyr(*grad, mask), reference(q, k, v, mask, allowed)[0], rtol=1e-10, atol=1e-10)
    monkeypatch.setitem(st.DENSE_UP_TO, pattern, n - 1)
    torch.testing.assert_close(lyr(q, k, v, mask), reference(q, k, v, mask, allowed)[0], rtol=1e-10, atol=1e-10)
    assert len(calls) == 1 + (pattern == "strided")  # neither with gradients nor above the limit
