"""BigBird (ITC): an independent float64 reference from the definition, the random choice (eligible, distinct,
uniform, a function of the real length only, state that redraw changes and saving keeps), the fallback to full
attention, the pair count, and transformers' own BigBirdBlockSparseAttention on the same random blocks."""

import math

import pytest
import torch
from reference import naive_attention

from approx import ApproxAttention
from approx.attention import _fallback
from approx.attention.bigbird import BigBirdConfig, cost, pattern_pairs, random_blocks

B, H, D = 2, 3, 16


def qkv(n, seed=0, batch=B):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, H, n, D, generator=g, dtype=torch.float64) for _ in range(3))


def mask_of(n, real):
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, real:] = False
    return mask


def layer(**options):
    return ApproxAttention("bigbird", BigBirdConfig(**options), head_dim=D)


def drawn(lyr, nb, r):
    """The random blocks the layer's state gives a row of ``nb`` real blocks: {(head, query block): set}."""
    ids, ok = random_blocks(lyr.rand_key, torch.tensor([nb]), heads=H, tq=nb, r=r)
    return {(h, t): {int(j) for j, o in zip(ids[0, h, t], ok[0, h, t]) if o} for h in range(H) for t in range(nb)}


def reference_mask(key_mask, block, rand):
    """(B, H, N, N) from the paper's definition, over each row's real tokens in order: blocks of ``block`` real
    tokens (the last one partial); i attends j when either is in the first or last block, their blocks are at
    most one apart, or j's block is one of the random blocks ``rand[row][(head, i's block)]``."""
    b, n = key_mask.shape
    out = torch.zeros(b, H, n, n, dtype=torch.bool)
    for row in range(b):
        pos = key_mask[row].nonzero().squeeze(-1).tolist()  # the real tokens, in order
        nb = math.ceil(len(pos) / block)
        for h in range(H):
            for a, i in enumerate(pos):
                for c, j in enumerate(pos):
                    bi, bj = a // block, c // block
                    glob = bi in (0, nb - 1) or bj in (0, nb - 1)
                    out[row, h, i, j] = glob or abs(bi - bj) <= 1 or bj in rand[row].get((h, bi), set())
    return out


def definition_of(lyr, q, k, v, key_mask, block, r):
    """The layer's attention from the paper's definition, on the random blocks its state draws."""
    rand = [drawn(lyr, math.ceil(int(m.sum()) / block), r) for m in key_mask]
    return masked_attention(q, k, v, reference_mask(key_mask, block, rand))


def masked_attention(q, k, v, allowed):
    scores = (q @ k.transpose(-1, -2)) * D**-0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize(
    "block,r,n,real",
    [
        (4, 1, 60, 47),  # the last real block partial
        (4, 2, 64, 64),
        (5, 3, 73, 52),
        (8, 1, 50, 17),  # three blocks: no random block is left
        (3, 0, 40, 40),  # no random blocks
    ],
)
# training's kernel, inference's on the CPU, and auto: on these short inputs SDPA over the dense mask
@pytest.mark.parametrize("kernel", ["gather", "band", "auto"])
def test_matches_the_definition(block, r, n, real, kernel):
    q, k, v = qkv(n)
    mask = mask_of(n, real)
    lyr = layer(block=block, random_blocks=r, full_fallback=False, kernel=kernel)
    rand = [drawn(lyr, math.ceil(int(m.sum()) / block), r) for m in mask]
    allowed = reference_mask(mask, block, rand)
    ref = masked_attention(q, k, v, allowed)
    real_q = mask[:, None, :, None]
    torch.testing.assert_close(
        lyr(q, k, v, mask).masked_fill(~real_q, 0), ref.masked_fill(~real_q, 0), rtol=1e-12, atol=1e-12
    )
    w = lyr.weights(q, k, mask)
    assert torch.equal((w > 0) & real_q, allowed & real_q)
    # the random blocks are many more than the sliding ones could explain: the pattern is not exact
    if r and real >= 7 * block:
        assert not allowed[0].all()


def test_any_padding_layout_gives_the_same_outputs():
    """Blocks are over the real tokens of a row: pads before, between or after them change nothing."""
    q, k, v = qkv(50)
    lyr = layer(block=4, random_blocks=2)
    short = lyr(q[:1], k[:1], v[:1])
    where = torch.tensor([0, 3, 4, 20, 21, 22, 40])  # pads at the start, in the middle and at the end
    keep = torch.ones(57, dtype=torch.bool)
    keep[where + torch.arange(len(where))] = False
    mask = keep[None].expand(1, 57)

    def spread(x):  # the 50 tokens at the kept positions, noise elsewhere
        y = torch.randn(1, H, 57, x.shape[-1], dtype=x.dtype) * 100
        y[:, :, keep] = x[:1]
        return y

    out = lyr(spread(q), spread(k), spread(v), mask)
    torch.testing.assert_close(out[:, :, keep], short, rtol=1e-12, atol=1e-12)


def test_random_blocks_are_eligible_distinct_and_uniform():
    """Per query block and head: min(r, m) distinct blocks among the m middle blocks outside the window; over many
    keys every eligible block is drawn about as often."""
    nb, r, t = 12, 3, 5
    eligible = [j for j in range(1, nb - 1) if abs(j - t) > 1]
    counts = dict.fromkeys(eligible, 0)
    draws = 600
    for key in range(draws):
        ids, ok = random_blocks(torch.tensor([key * 7919]), torch.tensor([nb]), heads=H, tq=nb, r=r)
        for h in range(H):
            for q_block in range(nb):
                got = [int(j) for j, o in zip(ids[0, h, q_block], ok[0, h, q_block]) if o]
                allowed = [j for j in range(1, nb - 1) if abs(j - q_block) > 1] if 1 <= q_block <= nb - 2 else []
                assert len(set(got)) == len(got) == min(r, len(allowed)) and set(got) <= set(allowed)
            for j in ids[0, h, t].tolist():
                counts[j] += 1
    expected = draws * H * r / len(eligible)  # 5400 / 7 draws per block
    assert all(abs(c - expected) < 5 * math.sqrt(expected) for c in counts.values()), counts
    # heads and query blocks draw independently
    ids, _ = random_blocks(torch.tensor([1]), torch.tensor([40]), heads=H, tq=40, r=3)
    assert not torch.equal(ids[0, 0], ids[0, 1])


def test_random_choice_depends_on_the_real_length_only():
    """The same real length gives the same blocks whatever the padded length and the other rows; another real
    length may give others."""
    key = torch.tensor([42])
    alone, _ = random_blocks(key, torch.tensor([10]), heads=H, tq=10, r=2)
    batch, ok = random_blocks(key, torch.tensor([25, 10]), heads=H, tq=30, r=2)
    torch.testing.assert_close(batch[1, :, :10].masked_fill(~ok[1, :, :10], 0), alone[0], rtol=0, atol=0)
    assert not ok[1, :, 10:].any()  # padded query blocks draw nothing
    q, k, v = qkv(200)
    lyr = layer(block=4, random_blocks=2)
    mask = mask_of(200, 50)  # row 1: 13 real blocks of 50 in a batch padded to 200
    torch.testing.assert_close(lyr(q, k, v, mask)[1, :, :50], lyr(q[1:, :, :50], k[1:, :, :50], v[1:, :, :50])[0])


def test_redraw_changes_the_choice_and_saving_keeps_it():
    q, k, v = qkv(120)
    lyr = layer(block=4, random_blocks=2)
    before, out = lyr.rand_key.clone(), lyr(q, k, v)
    assert torch.equal(lyr(q, k, v), out)  # state: never redrawn per call
    other = layer(block=4, random_blocks=2, seed=1)
    assert not torch.equal(other(q, k, v), out)
    lyr.redraw(7)
    assert not torch.equal(lyr.rand_key, before) and not torch.equal(lyr(q, k, v), out)
    redrawn = lyr(q, k, v)
    fresh = layer(block=4, random_blocks=2)
    fresh.load_state_dict(lyr.state_dict())
    assert torch.equal(fresh(q, k, v), redrawn)
    lyr.redraw(7)
    assert torch.equal(lyr(q, k, v), redrawn)  # the same seed draws the same blocks
    assert lyr.half().rand_key.dtype == torch.int64  # casting a model leaves the key alone


def test_short_rows_get_full_attention_as_in_transformers(monkeypatch):
    """A row with at most (5 + 2r) * block real tokens gets exact attention (transformers' rule), per row;
    full_fallback=False keeps the pattern."""
    q, k, v = qkv(80)
    mask = mask_of(80, 36)  # block 4, r 2: the limit is 36 tokens
    ref = naive_attention(q, k, v, mask)
    out = layer(block=4, random_blocks=2)(q, k, v, mask)
    torch.testing.assert_close(out[1, :, :36], ref[1, :, :36], rtol=1e-12, atol=1e-12)
    assert (out[0] - ref[0]).abs().max() > 1e-3  # 80 tokens: the pattern
    off = layer(block=4, random_blocks=2, full_fallback=False)(q, k, v, mask)
    torch.testing.assert_close(off[0], out[0], rtol=0, atol=0)
    assert (off[1, :, :36] - ref[1, :, :36]).abs().max() > 1e-3
    assert BigBirdConfig(block=4, random_blocks=2).at_most == 36 and BigBirdConfig(full_fallback=False).at_most is None
    seen = {}
    real = _fallback.with_fallback
    monkeypatch.setattr(_fallback, "with_fallback", lambda *a, **kw: seen.update(kw) or real(*a, **kw))
    layer(block=4, random_blocks=2)(q, k, v, mask)
    assert seen["at_most"] == 36


def test_exact_when_random_blocks_cover_every_block():
    q, k, v = qkv(90)
    mask = mask_of(90, 70)
    out = layer(block=8, random_blocks=12, full_fallback=False)(q, k, v, mask)
    torch.testing.assert_close(out[:, :, :70], naive_attention(q, k, v, mask)[:, :, :70], rtol=1e-12, atol=1e-12)
    # one block fewer than needed by the middle query blocks far from both ends is not exact
    assert (layer(block=8, random_blocks=5, full_fallback=False)(q, k, v, mask) - naive_attention(q, k, v, mask))[
        0
    ].abs().max() > 1e-3


@pytest.mark.parametrize("n,block,r", [(100, 4, 1), (97, 8, 2), (40, 16, 3), (64, 8, 9), (20, 8, 1)])
def test_pair_count_matches_the_mask(n, block, r):
    lyr = layer(block=block, random_blocks=r, full_fallback=False)
    q, k, _ = qkv(n)
    w = lyr.weights(q, k)
    assert pattern_pairs(n, block, r) == int((w[0] > 0).sum()) // H
    c = cost(BigBirdConfig(block=block, random_blocks=r, full_fallback=False), n=n, s=n, d=64, dv=32)
    assert c.qk_pairs == pattern_pairs(n, block, r) and c.matmul_macs == c.qk_pairs * 96
    stats = lyr.graph_stats(q, k)
    assert torch.equal(stats["predicted"], torch.full((H,), float(B * pattern_pairs(n, block, r)), dtype=torch.float64))
    # with the fallback on, short rows count as full attention
    short = BigBirdConfig(block=block, random_blocks=r)
    assert cost(short, n=n, s=n, d=64, dv=64).qk_pairs == (n * n if n <= short.at_most else pattern_pairs(n, block, r))
    stats = layer(block=block, random_blocks=r).graph_stats(q, k)
    assert stats["predicted"][0] == B * (n * n if n <= short.at_most else pattern_pairs(n, block, r))


def test_cost_grows_linearly():
    config = BigBirdConfig()
    a, b = (cost(config, n=n, s=n, d=64, dv=64).qk_pairs for n in (4096, 8192))
    assert 1.9 < b / a < 2.1 and a < 4096 * 4096 / 4


def test_refuses_cross_attention_and_bad_options():
    q, _, _ = qkv(30)
    _, k, v = qkv(40)
    with pytest.raises(ValueError, match="self-attention"):
        layer(block=4, random_blocks=1)(q, k, v)
    for options in ({"block": 0}, {"random_blocks": -1}, {"seed": -1}):
        with pytest.raises(ValueError, match=next(iter(options))):
            BigBirdConfig(**options)


# ------------------------------------------------------------------------------------------- transformers


# auto: on these inputs SDPA over the dense mask; band: the block-band kernel; gather: training's kernel
@pytest.mark.parametrize("kernel", ["auto", "band", "gather"])
@pytest.mark.parametrize("block,r,blocks", [(16, 1, 12), (16, 2, 12), (8, 3, 14)])
def test_transformers_block_sparse_attention_agrees(block, r, blocks, kernel, monkeypatch):
    """transformers' BigBirdBlockSparseAttention on the same q, k, v and the same random blocks (its own draw is
    replaced by ours: in eval it uses block 0 for every random block, in training a plan of the first (2r + 5)
    blocks), no padding, N a multiple of the block and above its full-attention limit: outputs and weights, from each
    of the kernels."""
    bb = pytest.importorskip("transformers.models.big_bird.modeling_big_bird", reason="transformers' BigBird")
    from transformers import BigBirdConfig as HFConfig

    n = block * blocks
    assert n > (5 + 2 * r) * block and n not in (1024, 3072, 4096)  # transformers' own plans for those lengths
    q, k, v = qkv(n)
    lyr = layer(block=block, random_blocks=r, kernel=kernel)
    rand = [drawn(lyr, blocks, r)[(h, t)] for h in range(H) for t in range(1, blocks - 1)]
    assert all(len(s) == r for s in rand)  # every middle query block has its r blocks (none fewer)
    table = torch.tensor([sorted(s) for s in rand]).view(H, blocks - 2, r).numpy()

    hf = bb.BigBirdBlockSparseAttention(
        HFConfig(
            hidden_size=H * D,
            num_attention_heads=H,
            block_size=block,
            num_random_blocks=r,
            max_position_embeddings=n,
            attention_type="block_sparse",
        )
    ).eval()
    monkeypatch.setattr(hf, "_bigbird_block_rand_mask_with_head", lambda **kw: list(table))
    ones = torch.ones(B, n, dtype=torch.float64)
    blocked, band, from_mask, to_mask = bb.BigBirdModel.create_masks_for_block_sparse_attn(ones, block)
    theirs, probs = hf.bigbird_block_sparse_attention(
        q, k, v, band, from_mask, to_mask, blocked, blocked, H, r, D, block, block, B, n, n,
        seed=None, plan_from_length=None, plan_num_rand_blocks=None,
    )  # fmt: skip
    torch.testing.assert_close(lyr(q, k, v), theirs.transpose(1, 2), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lyr.weights(q, k), probs, rtol=1e-10, atol=1e-10)


def test_auto_runs_short_inference_on_the_dense_mask(monkeypatch):
    """kernel='auto' on the CPU: SDPA over the pattern's dense mask for inference on short inputs (at most
    DENSE_KEYS_PER_ROW keys, or three quarters of the keys the kernel scores per query), the block kernels with
    gradients or on longer inputs; every route gives the definition's output, in float32 with NaN in the padded
    keys and values, padding at the end of a row and inside it."""
    from approx.attention import _dense

    calls = []
    real_mask = _dense.block_additive_mask
    monkeypatch.setattr(_dense, "block_additive_mask", lambda *a, **kw: calls.append(1) or real_mask(*a, **kw))
    n, block, r = 60, 4, 1
    q, k, v = qkv(n)
    lyr = layer(block=block, random_blocks=r, full_fallback=False)
    end = mask_of(n, 47)
    inside = end.clone()
    inside[0, 10:13] = False
    for mask, routed in ((end, 1), (inside, 0)):  # padding inside a row sorts the tokens: the block kernels
        ref = definition_of(lyr, q, k, v, mask, block, r)
        real = mask[:, None, :, None]
        poisoned = [t.float().masked_fill(~real, float("nan")) for t in (k, v)]
        before = len(calls)
        with torch.no_grad():
            out = lyr(q.float(), *poisoned, mask)
        assert len(calls) == before + routed
        torch.testing.assert_close(out.masked_fill(~real, 0).double(), ref.masked_fill(~real, 0), rtol=1e-5, atol=1e-5)
    grad = [t.clone().requires_grad_() for t in (q, k, v)]
    lyr(*grad, end)
    monkeypatch.setattr(_dense, "DENSE_KEYS_PER_ROW", n - 1)  # 3/4 of 24 keys per query: below 60 as well
    with torch.no_grad():
        lyr(q, k, v, end)
    assert len(calls) == 1  # neither with gradients nor above the limit
