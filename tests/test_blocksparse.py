"""The block-sparse kernel shared by the sparse-pattern methods: its gather path against a float64 masked softmax
built independently from the block lists, sorted orders, shared keys and global rows, combining patterns through
their log-sum-exp, and FlexAttention on the same pattern (same output; where it cannot run, why)."""

import pytest
import torch

from approx import ApproxAttention
from approx.attention import _blocksparse, _flex
from approx.attention._blocksparse import Pattern
from approx.attention.window import WindowConfig

B, H, D = 2, 3, 8


def qkv(n, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, n, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))


def masked_softmax(q, k, v, allowed):
    """float64 softmax over ``allowed`` (B, H, N, S) pairs; rows with none give 0."""
    scores = (q @ k.transpose(-1, -2)) * D**-0.5
    has = allowed.any(-1, keepdim=True)
    p = scores.masked_fill(~allowed, float("-inf")).masked_fill(~has, 0).softmax(-1) * has
    return p @ v


def random_pattern(n, block, k_blocks, seed):
    """Random key blocks per query block (B, H, Tq, K), random orders per (batch, head), a random element mask."""
    g = torch.Generator().manual_seed(seed)
    t = -(-n // block)
    kv = torch.randint(0, t, (B, H, t, k_blocks), generator=g)
    kv = torch.sort(kv, dim=-1).values
    dup = torch.cat([torch.zeros_like(kv[..., :1], dtype=torch.bool), kv[..., 1:] == kv[..., :-1]], -1)
    q_order = torch.stack([torch.randperm(n, generator=g) for _ in range(B * H)]).view(B, H, n)
    k_order = torch.stack([torch.randperm(n, generator=g) for _ in range(B * H)]).view(B, H, n)
    keep = torch.rand(n, n, generator=g) < 0.7
    return Pattern(block, kv, ~dup, q_order=q_order, k_order=k_order, allow=lambda i, j: keep[i, j])


def allowed_pairs(p: Pattern, n, key_mask):
    """The pattern's pairs written directly from its definition: query i (sorted slot a) attends key j (sorted
    slot c) when c's block is one of a's block's key blocks and allow(i, j)."""
    allowed = torch.zeros(B, H, n, n, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for a in range(n):
                i = int(p.q_order[b, h, a]) if p.q_order is not None else a
                blocks = {
                    int(x) for x, ok in zip(p.kv_blocks[b, h, a // p.block], p.kv_valid[b, h, a // p.block]) if ok
                }
                for c in range(n):
                    j = int(p.k_order[b, h, c]) if p.k_order is not None else c
                    if c // p.block in blocks and bool(p.allow(torch.tensor(i), torch.tensor(j))):
                        allowed[b, h, i, j] = True
    if key_mask is not None:
        allowed &= key_mask[:, None, None, :]
    return allowed


@pytest.mark.parametrize("seed", range(3))
def test_gather_kernel_matches_its_definition(seed):
    n = 37
    q, k, v = qkv(n, seed)
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, 30:] = False
    p = random_pattern(n, 5, 3, seed)
    out, lse = _blocksparse.attend(q, k, v, p, key_mask=mask, scale=D**-0.5, with_lse=True)
    allowed = allowed_pairs(p, n, mask)
    torch.testing.assert_close(out, masked_softmax(q, k, v, allowed), rtol=1e-12, atol=1e-12)
    scores = ((q @ k.transpose(-1, -2)) * D**-0.5).masked_fill(~allowed, float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)
    dense = _blocksparse.dense_weights(q, k, p, key_mask=mask, scale=D**-0.5)
    torch.testing.assert_close(dense @ v.masked_fill(~mask[:, None, :, None], 0), out, rtol=1e-12, atol=1e-12)


def test_shared_keys_and_global_rows_are_counted_once():
    n = 40
    q, k, v = qkv(n, 3)
    shared = torch.zeros(B, n, dtype=torch.bool)
    shared[:, [0, 17, 18]] = True
    glob = torch.zeros(B, n, dtype=torch.bool)
    glob[0, 5] = True
    t = -(-n // 8)
    diag = torch.arange(t)[None, None, :, None]  # block t attends block t
    p = Pattern(8, diag, shared_keys=shared, global_queries=glob)
    out = _blocksparse.attend(q, k, v, p, key_mask=None, scale=D**-0.5)
    block = torch.arange(n) // 8
    allowed = (block[:, None] == block[None, :])[None, None] | shared[:, None, None, :] | glob[:, None, :, None]
    torch.testing.assert_close(out, masked_softmax(q, k, v, allowed.expand(B, H, n, n)), rtol=1e-12, atol=1e-12)


def test_combining_disjoint_patterns_is_the_union():
    n = 32
    q, k, v = qkv(n, 4)
    even = Pattern(
        4,
        torch.arange(8)[None, None, :, None].expand(1, 1, 8, 8) * 0 + torch.arange(8),
        allow=lambda i, j: (i + j) % 2 == 0,
    )
    odd = Pattern(4, even.kv_blocks, allow=lambda i, j: ((i + j) % 2 == 1) & ((i - j).abs() < 5))
    outs, lses = zip(
        *(_blocksparse.attend(q, k, v, p, key_mask=None, scale=D**-0.5, with_lse=True) for p in (even, odd))
    )
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    union = ((i + j) % 2 == 0) | ((i - j).abs() < 5)
    torch.testing.assert_close(
        _blocksparse.combine(list(outs), list(lses)), masked_softmax(q, k, v, union.expand(B, H, n, n))
    )


def _dense_part(q, k, v, allowed):
    """The float64 softmax over ``allowed`` pairs and its log-sum-exp (-inf for a row with none), from the
    definition."""
    scores = ((q @ k.transpose(-1, -2)) * D**-0.5).masked_fill(~allowed, float("-inf"))
    return masked_softmax(q, k, v, allowed), torch.logsumexp(scores, -1)


@pytest.mark.parametrize("grad", [False, True])
def test_a_running_merge_is_the_softmax_over_the_union(grad):
    """merge, one part after another (as LSH merges its rounds), against a float64 softmax over the union of three
    disjoint pair sets, with rows found in one part only and a row found in none (0); with gradients (the
    out-of-place path) the gradient of q matches the union softmax's too."""
    n = 12
    q, k, v = qkv(n, 5)
    q.requires_grad_(grad)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    parts = [(j - i) % 3 == r for r in range(3)]
    parts[1] = parts[1] & (i < 6)  # rows 6.. have pairs in two parts only
    parts = [p & (i != 4) for p in parts]  # row 4: no pair anywhere
    with torch.set_grad_enabled(grad):
        out, lse = _dense_part(q, k, v, parts[0].expand(B, H, n, n))
        for p in parts[1:]:
            out, lse = _blocksparse.merge(out, lse, *_dense_part(q, k, v, p.expand(B, H, n, n)))
        union = (parts[0] | parts[1] | parts[2]).expand(B, H, n, n)
        want = masked_softmax(q, k, v, union)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert out[:, :, 4].abs().max() == 0
    if grad:
        g = torch.randn_like(want)
        (got,) = torch.autograd.grad((out * g).sum(), q)
        (ref,) = torch.autograd.grad((want * g).sum(), q)
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_flex_says_why_it_cannot_run():
    q, k, v = qkv(64, dtype=torch.float32)
    p = Pattern(8, torch.zeros(1, 1, 8, 1, dtype=torch.long))
    assert "float64" in _flex.unusable(q.double(), k, v, p, dropout=0.0)
    assert "dropout" in _flex.unusable(q, k, v, p, dropout=0.1)
    assert "log-sum-exp" in _flex.unusable(q, k, v, p, dropout=0.0, with_lse=True)
    assert "backward" in _flex.unusable(q.requires_grad_(), k, v, p, dropout=0.0)
    with pytest.raises(RuntimeError, match="kernel='flex' cannot run"):
        _blocksparse.attend(q.double(), k.double(), v.double(), p, key_mask=None, scale=1.0, kernel="flex")


@pytest.mark.parametrize(
    "options",
    [
        {"window": 9, "dilation": 2, "global_tokens": 3, "block": 32},
        # contiguous: blocks wholly within the window are FlexAttention's full blocks, and a window one short of a
        # block multiple puts the reach at a block's edge (its full blocks had been taken one block too far)
        {"window": 30, "dilation": 1, "global_tokens": 1, "block": 16},
    ],
    ids=["dilated", "contiguous"],
)
@pytest.mark.parametrize("rows", ["apart", "mask"])
def test_flex_gives_the_gather_output(rows, options, monkeypatch):
    """Compiled FlexAttention on the window pattern (global tokens, dilation, a padded row, N not a multiple of the
    block) gives the gather kernel's output, the global queries' rows computed after the kernel or inside its block
    mask; skipped with the reason where it cannot compile (no C++ compiler)."""
    monkeypatch.setattr(_flex, "GLOBAL_ROWS", rows)
    n = 300
    q, k, v = qkv(n, 5, dtype=torch.float32)
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, 250:] = False
    gather = ApproxAttention("window", WindowConfig(kernel="gather", **options), head_dim=D)
    flex = ApproxAttention("window", WindowConfig(kernel="flex", **options), head_dim=D)
    with torch.no_grad():
        ref = gather(q, k, v, mask)
        try:
            out = flex(q, k, v, mask)
        except RuntimeError as err:
            if _flex._BROKEN.get("cpu"):
                pytest.skip(f"FlexAttention cannot compile here: {_flex._BROKEN.get('cpu')}")
            raise err
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1, :, :250], ref[1, :, :250], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [8, 24])
def test_flex_is_not_used_on_the_cpu_at_blocks_it_gets_wrong(block):
    """torch's compiled CPU FlexAttention gives wrong outputs (NaN at 24) at blocks of 8 mod 16 rows, with no error: at
    any block not a multiple of 16 it is not used on the CPU, kernel='auto' (which took it at this length) runs the
    gather kernel and gives its output, and kernel='flex' is refused saying why (a reviewer's finding)."""
    from approx.attention.sparse_transformer import SparseTransformerConfig

    n = _flex.MIN_LENGTH + 76
    q, k, v = qkv(n, 7, dtype=torch.float32)
    out = {}
    with torch.no_grad():
        for kernel in ("gather", "auto"):
            config = SparseTransformerConfig(stride=32, block=block, kernel=kernel)
            out[kernel] = ApproxAttention("sparse-transformer", config, head_dim=D)(q, k, v)
        torch.testing.assert_close(out["auto"], out["gather"], rtol=1e-5, atol=1e-5)
        flex = ApproxAttention(
            "sparse-transformer", SparseTransformerConfig(stride=32, block=block, kernel="flex"), head_dim=D
        )
        with pytest.raises(RuntimeError, match="multiple of 16 rows only"):
            flex(q[..., :96, :], k[..., :96, :], v[..., :96, :])


def test_flex_runs_bigbird_like_gather():
    """BigBird is the hardest translation (per-row orders with the real tokens first, per-head random blocks,
    global blocks as shared keys and dense rows): FlexAttention gives the gather kernel's output."""
    from approx.attention.bigbird import BigBirdConfig

    n = 200
    q, k, v = qkv(n, 6, dtype=torch.float32)
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, 150:] = False
    options = {"block": 16, "random_blocks": 2, "full_fallback": False}
    out = {}
    for kernel in ("gather", "flex"):
        layer = ApproxAttention("bigbird", BigBirdConfig(kernel=kernel, **options), head_dim=D)
        with torch.no_grad():
            try:
                out[kernel] = layer(q, k, v, mask)
            except RuntimeError:
                if _flex._BROKEN.get("cpu"):
                    pytest.skip(f"FlexAttention cannot compile here: {_flex._BROKEN.get('cpu')}")
                raise
    torch.testing.assert_close(out["flex"][0], out["gather"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["flex"][1, :, :150], out["gather"][1, :, :150], rtol=1e-5, atol=1e-5)


def test_auto_stops_compiling_new_shapes_past_the_limit(monkeypatch):
    """kernel='auto' asks FlexAttention for at most MAX_SHAPES shapes per process, then warns and uses gather."""
    monkeypatch.setattr(_flex, "_SHAPES", {})
    monkeypatch.setattr(_flex, "MAX_SHAPES", 2)
    k = torch.zeros(1, 1, 2048, 8)
    p = Pattern(64, torch.zeros(1, 1, 1, 1, dtype=torch.long))
    assert _flex.worth_it(torch.zeros(1, 1, 2048, 8), k, p) and _flex.worth_it(torch.zeros(1, 2, 2048, 8), k, p)
    assert _flex.worth_it(torch.zeros(1, 1, 2048, 8), k, p)  # a shape already compiled
    with pytest.warns(RuntimeWarning, match="compiled 2 shapes"):
        assert not _flex.worth_it(torch.zeros(1, 3, 2048, 8), k, p)
    assert not _flex.worth_it(torch.zeros(1, 1, 512, 8), torch.zeros(1, 1, 512, 8), p)  # short: gather


@pytest.mark.parametrize("stride,block", [(128, 64), (256, 64), (128, 32), (512, 64)])
def test_auto_keeps_gather_where_shared_keys_fill_the_blocks(stride, block, monkeypatch):
    """On the CPU, kernel='auto' leaves FlexAttention out where shared keys would make it visit more than twice the
    keys per query block that the gather kernel scores: the Sparse Transformer's fixed pattern (summary keys in every
    block of l) at every stride and block size (split mode: its summary heads; union mode while the summary blocks
    outnumber the local ones); not the strided
    pattern, nor a window whose CLS token is its one shared key or whose long question fills the blocks it lies in."""
    from approx import tokens
    from approx.attention import sparse_transformer as st
    from approx.attention import window

    monkeypatch.setattr(_flex, "_SHAPES", {})
    n = 2048
    q = torch.zeros(2, 12, n, 8)

    def parts(**options):
        config = st.SparseTransformerConfig(stride=stride, block=block, **options)
        groups = st.head_groups(config, key_mask=None, b=2, n=n, s=n, device="cpu")
        return [p for _, patterns, _ in groups for p in patterns]

    fixed = parts(pattern="fixed") + parts(pattern="fixed", heads="union")
    # split: its local heads keep it; union at l = 512: its 8 local key blocks per query block outweigh the 4 blocks
    # of summary keys (FlexAttention visits 1.4x the gather kernel's keys), so it keeps it too
    assert [_flex.worth_it(q, q, p) for p in fixed] == [True, False, stride >= 512]
    assert all(_flex.worth_it(q, q, p) for p in parts(pattern="strided"))
    config = window.WindowConfig(block=block)
    assert _flex.worth_it(q, q, window.pattern(config, b=2, n=n, s=n, device="cpu"))
    question = torch.zeros(2, n, dtype=torch.bool)
    question[0, :600] = True  # a question of 600 tokens in one row: blocks full of shared keys
    with tokens(question_mask=question):
        long = window.pattern(window.WindowConfig(block=block, question_global=True), b=2, n=n, s=n, device="cpu")
    assert int(long.shared_keys.sum()) > 600 and _flex.worth_it(q, q, long)
    assert _flex.worth_it(q.to("meta"), q.to("meta"), fixed[1])  # another device: not measured, the rule is the CPU's


def test_short_inputs_benchmark(tmp_path, benchmark_script):
    """benchmarks/short_inputs.py in miniature: every setup's default and its alternative (the block kernel, the
    whole batch at once, or improved clustered attention's blocks of queries) give the same output (its printed
    difference), the JSON holds a row per setup with times, ratios and allocation peaks, FAVOR+'s batch slices hold a
    fraction of the whole batch's features, and the plot is drawn next to it."""
    import json

    bench = benchmark_script("short_inputs")
    out = tmp_path / "short.json"
    with pytest.raises(SystemExit):  # a setup that does not exist, said before anything runs
        bench.parse_args(["--setups", "favour"])
    bench.main(["--lengths", "256", "--repeats", "1", "--threads", "1", "--output", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["setup"] for r in rows] == [label for label, *_ in bench.SETUPS]
    assert all(r["max_abs_diff"] < 1e-5 and r["auto_ms"] > 0 and r["kernel_peak_mib"] is not None for r in rows)
    favor = next(r for r in rows if r["setup"] == "favor")  # 16 inputs of 256 tokens: 50 MB of features at once
    assert favor["kernel"] == "whole" and favor["auto_peak_mib"] < favor["kernel_peak_mib"] / 3
    assert out.with_suffix(".png").stat().st_size > 0
