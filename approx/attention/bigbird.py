"""Block-sparse attention with sliding, global and random blocks (BigBird ITC).

Zaheer et al., "Big Bird: Transformers for Longer Sequences", NeurIPS 2020 (arXiv 2007.14062), the ITC
(internal transformer construction) variant that transformers' ``BigBirdBlockSparseAttention`` implements.

The real tokens of a row (L of them) are cut into nb = ceil(L / block) blocks of ``block`` tokens; the last one
is partial when L is not a multiple of ``block`` (its missing slots are masked, not filled). Query block t
attends the key blocks

* t - 1, t, t + 1 (sliding; no wrap-around, as in transformers),
* 0 and nb - 1, the global blocks: every query attends their tokens (a shared strip of keys) and their queries
  attend every real key (dense rows), and
* ``random_blocks`` r blocks drawn per query block and head, uniformly without replacement among the blocks not
  already chosen (neither global nor sliding); fewer when fewer are left,

and its softmax runs over the union of those keys only (a key is never counted twice).

Choices made here (and why):

* **Blocks over the real tokens.** Blocks, global blocks and the random choice depend on each row's real length
  only, never on the padded length (padding invariance: appending pads leaves real outputs unchanged). Block
  membership is a real token's rank among the real tokens of its row (its position when padding is at the end,
  the usual layout; any other layout gives the same outputs). transformers pads to a multiple of the block and
  puts its last global block at the end of the padded batch, so padding moves it.
* **The random choice is state.** A 32-bit key ``rand_key`` is drawn from ``seed`` once per layer, kept as a
  buffer (saved with the model) and changed only by ``approx.redraw``; it is never redrawn per call. Heads are
  unknown when a layer is patched, so the draws are not a table but a counter-based hash (Wellons' lowbias32, on
  32-bit integers) of (key, head, query block, slot): slot s of query block t takes the
  floor(u * (m_t - s))-th block of those still eligible (u uniform in [0, 1) from the hash, m_t eligible blocks):
  sequential sampling without replacement, O(r^2) work per query block. Rows with the same real length get the
  same blocks; within a row, heads and query blocks draw independently.
* **Uniform over every eligible block.** transformers (like Google's code) draws from a "plan" that, for lengths
  other than 1024/3072/4096, takes the random blocks among the first (2r + 5) blocks only; its last two middle
  query blocks may draw their own sliding blocks again (its comments: "Missing -3") and count them twice; in
  eval mode it uses block 0 for every random block ("no randomness in eval"), so block 0 is counted r + 1
  times. None of that is reproduced: the paper's pattern is r random blocks beyond the window and globals.
  ``tests/test_bigbird.py`` checks the computation against transformers' own on the same random blocks.
* **Short rows get full attention, as in transformers.** transformers switches the whole model to full
  attention when the (padded) length N <= (5 + 2r) * block, where the pattern covers most pairs anyway; here a
  batch row with at most (5 + 2r) * block real tokens gets exact attention (``_fallback.with_fallback``,
  ``at_most``). ``full_fallback=False`` turns that off, so the block pattern always runs (the exact limit:
  r >= nb - 2 random blocks cover every block). ``exact_below`` as for every method.
* Self-attention only (N = S): query block t is paired with key block t.
* Runs on the block-sparse kernels (:mod:`._blocksparse`): per query block the listed key blocks are the
  sliding ones (first, ``neighbours=1``) and the random ones, the global blocks are the kernels' shared keys and
  global query rows. On the CPU, inference runs on the block-band kernel (:mod:`._blockband`: the sliding blocks
  as views, the random ones gathered a chunk at a time), or on short inputs without padding or padded at the end
  on SDPA over the pattern's dense mask (:mod:`._dense`: faster there; only where ``full_fallback=False`` or the
  blocks are small, since the fallback makes such rows exact anyway); training, dropout and the GPU on the gather
  kernel or FlexAttention. Attention dropout is applied to the weights (the kernel's). ``kernel="fused"`` runs the
  block-band kernel's C++ form there instead (``csrc/block_band.cpp``, built on first use; the fastest on the CPU).

Cost: the pairs of the pattern (global rows and columns once each), 2 (d + dv) flops per pair, and as many
multiply-accumulates per pair in the literature's convention.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import MethodConfig, option
from ..registry import Cost, ExactLimit, register
from . import _blocksparse, _context, _fallback
from ._blocksparse import Pattern
from ._common import exact_rows, exact_weight_rows, safe_key_mask

_M32 = 0xFFFFFFFF
_BIG = 1 << 40  # larger than any block id: an unused entry of the excluded list


@dataclasses.dataclass(frozen=True)
class BigBirdConfig(MethodConfig):
    """Options of BigBird (ITC) block-sparse attention."""

    method = "bigbird"

    block: int = option(64, "tokens per block (transformers' block_size)")
    random_blocks: int = option(
        3, "random key blocks per query block and head, beyond the sliding and global ones (num_random_blocks)"
    )
    full_fallback: bool = option(
        True,
        "as transformers: a batch row with at most (5 + 2 * random_blocks) * block real tokens gets full "
        "attention; false: the block pattern always runs",
    )
    seed: int = option(0, "seed of the random blocks (state: kept with the model, changed by approx.redraw)")
    exact_below: int = option(0, "sequences with fewer real tokens get exact attention (0 = never)")
    kernel: str = _blocksparse.kernel_option(
        band="approx's block-band kernel (the sliding blocks as strided views of K and V, the random blocks gathered "
        "a chunk at a time; inference only)",
        fused="what 'auto' runs, with the block-band kernel in C++ where it runs (CPU inference; built on first use: "
        "a C++ compiler and ninja, about half a minute, then cached on disk; the fastest on the CPU, see the docs' "
        "Speed page)",
    )

    def unused(self) -> dict[str, str]:
        return {"seed": "random_blocks of 1 or more"} if self.random_blocks == 0 else {}

    def check(self) -> None:
        self.require(self.block >= 1, "block", "at least one token per block")
        self.require(self.random_blocks >= 0, "random_blocks", "0 (sliding and global blocks only) or more")
        self.require(self.seed >= 0, "seed", "seeds are non-negative integers")
        self.require(self.exact_below >= 0, "exact_below", "a length: 0 (off) or more")
        _blocksparse.check_kernel(self, band=True, fused=True)

    @property
    def at_most(self) -> int | None:
        """Rows with at most this many real tokens get full attention (transformers' rule), None when off."""
        return (5 + 2 * self.random_blocks) * self.block if self.full_fallback else None


def init_state(config: BigBirdConfig, *, head_dim: int, seed: int) -> dict[str, torch.Tensor]:
    """The key of the random block choice: one 32-bit integer (int64, so that casting a model leaves it alone)."""
    g = torch.Generator().manual_seed(seed)
    return {"rand_key": torch.randint(0, 1 << 32, (1,), generator=g, dtype=torch.int64)}


# ------------------------------------------------------------------------------------------ random blocks


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons) on 32-bit values held in int64: products stay below 2^63, shifts are logical."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def _uniform32(key: torch.Tensor, heads: int, tq: int, slot: int) -> torch.Tensor:
    """A 32-bit hash of (key, head, query block, slot) for every head and query block: (H, Tq) int64."""
    device = key.device
    h = _context.head_indices(heads, device)[:, None]  # the layer's head index: the same blocks on some heads alone
    t = torch.arange(tq, device=device)[None, :]
    x = _mix(key.reshape(()).to(torch.int64) & _M32)
    return _mix(_mix(_mix(x ^ h) ^ t) ^ slot)


def _sliding(nb: torch.Tensor, tq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key blocks t - 1, t, t + 1 of every query block, (Tq, 3), and which count: (B, 1, Tq, 3), only for the
    middle query blocks (1 <= t <= nb - 2) and only those that are middle blocks themselves (not global)."""
    t = torch.arange(tq, device=nb.device)
    ids = t[:, None] + torch.arange(-1, 2, device=nb.device)
    last = (nb - 2)[:, None, None, None]  # (B, 1, 1, 1): the last middle block
    middle_q = (t >= 1)[None, None, :, None] & (t[None, None, :, None] <= last)
    return ids, middle_q & (ids >= 1) & (ids <= last)


def random_blocks(key: torch.Tensor, nb: torch.Tensor, *, heads: int, tq: int, r: int):
    """The random key blocks of every (row, head, query block): ``nb`` (B,) real blocks per row -> block ids
    (B, H, Tq, r') and which are real, r' = min(r, most eligible). Slot s of query block t is the
    floor(u * (m - s))-th of the m - s eligible blocks left (eligible: 1 <= j <= nb - 2, |j - t| > 1, not chosen
    yet), u from the hash of (key, head, t, s): sampling without replacement, a function of nb only."""
    b = nb.shape[0]
    device = nb.device
    ids, slide_ok = _sliding(nb, tq)
    slide_ok = slide_ok.expand(b, 1, tq, 3)
    middle_q = slide_ok[..., 1]  # t itself is a middle block
    eligible = ((nb - 2).clamp(min=0)[:, None, None] - slide_ok.sum(-1)) * middle_q  # (B, 1, Tq): m_t
    width = min(r, max(0, int(eligible.max()) if eligible.numel() else 0))
    if width == 0:
        empty = torch.zeros(b, heads, tq, 0, dtype=torch.long, device=device)
        return empty, empty.bool()
    excluded = torch.where(slide_ok, ids.expand(b, 1, tq, 3), _BIG).expand(b, heads, tq, 3)
    chosen, valid = [], []
    for slot in range(width):
        left = eligible - slot  # (B, 1, Tq)
        pick = (_uniform32(key, heads, tq, slot)[None] * left.clamp(min=1)) >> 32  # (B, H, Tq): index among left
        j = 1 + pick
        for e in excluded.sort(-1).values.unbind(-1):  # ascending: skip every excluded block at or below j
            j = j + (e <= j)
        ok = (left > 0).expand_as(j)
        chosen.append(j.masked_fill(~ok, 0))
        valid.append(ok)
        excluded = torch.cat([excluded, j.masked_fill(~ok, _BIG)[..., None]], -1)
    return torch.stack(chosen, -1), torch.stack(valid, -1)


def _all_eligible(nb: torch.Tensor, *, tq: int):
    """Every eligible random block of every query block (r >= nb - 2: the draw takes them all): (B, 1, Tq, W)."""
    b = nb.shape[0]
    width = max(0, int(nb.max()) - 2)
    ids, slide_ok = _sliding(nb, tq)
    j = torch.arange(1, width + 1, device=nb.device)
    t = torch.arange(tq, device=nb.device)[:, None]
    ok = slide_ok[..., 1:2] & (j <= (nb - 2)[:, None, None, None]) & ((j - t).abs() > 1)
    return j.expand(b, 1, tq, width), ok


# ------------------------------------------------------------------------------------------------ pattern


def real_lengths(key_mask: torch.Tensor | None, b: int, n: int, device) -> torch.Tensor:
    """Real tokens per row, (B,) long (a row without any counts every position, as the kernel does)."""
    key_mask = safe_key_mask(key_mask)
    if key_mask is None:
        return torch.full((b,), n, dtype=torch.long, device=device)
    return key_mask.sum(-1)


def pattern(config: BigBirdConfig, state, *, b: int, h: int, n: int, s: int, key_mask, device, full_rows=None):
    """The BigBird pattern over the real tokens of each row. ``full_rows`` (B,) bool: rows whose real queries are
    all global (the fallback rows, for the graph statistics)."""
    if n != s:
        raise ValueError(f"bigbird: self-attention only (N = S), got N = {n}, S = {s}")
    blk = config.block
    key_mask = safe_key_mask(key_mask)
    length = real_lengths(key_mask, b, n, device)  # (B,)
    nb = (length + blk - 1) // blk
    tq = -(-n // blk)
    if key_mask is None:
        order, real = None, torch.ones(b, n, dtype=torch.bool, device=device)
        rank = torch.arange(n, device=device).expand(b, n)
    else:  # the real tokens first, in their order: block membership by rank among the real tokens
        real, rank = key_mask, key_mask.long().cumsum(-1) - 1
        order = None  # padding at the end only (the usual layout): the order is the identity
        if not bool((key_mask[:, 1:] <= key_mask[:, :-1]).all()):
            order = key_mask.to(torch.uint8).argsort(dim=-1, descending=True, stable=True)[:, None]
    glob = real & ((rank < blk) | (rank >= ((nb - 1) * blk)[:, None]))  # (B, N): tokens of the global blocks
    ids, slide_ok = _sliding(nb, tq)
    if config.random_blocks >= int(nb.max()) - 2:  # every eligible block is drawn: no need to draw
        rand, rand_ok = _all_eligible(nb, tq=tq)
    else:
        rand, rand_ok = random_blocks(state["rand_key"].to(device), nb, heads=h, tq=tq, r=config.random_blocks)
    kv = torch.cat([ids.expand(*rand.shape[:2], tq, 3), rand], -1)
    kv_ok = torch.cat([slide_ok.expand(*rand.shape[:2], tq, 3), rand_ok], -1)
    glob_q = glob if full_rows is None else glob | (real & full_rows[:, None])
    return Pattern(blk, kv, kv_ok, q_order=order, k_order=order, shared_keys=glob, global_queries=glob_q, neighbours=1)


def pattern_pairs(n: int, block: int, r: int) -> int:
    """(query, key) pairs of the pattern on n real tokens (the global rows and columns once each)."""
    nb = -(-n // block)
    if nb <= 2:
        return n * n
    size_last = n - (nb - 1) * block
    glob = block + size_last
    middle = nb - 2
    pairs = glob * n  # the global blocks' rows
    for t in range(1, middle + 1):
        slide = 1 + (t > 1) + (t < middle)  # sliding blocks that are middle blocks
        pairs += block * (glob + block * (slide + min(r, middle - slide)))
    return pairs


def cost(config: BigBirdConfig, *, n: int, s: int, d: int, dv: int) -> Cost:
    """The pattern's pairs on a row of n real tokens (full attention on the rows that fall back)."""
    if n != s or _fallback.exact_for_length(n, exact_below=config.exact_below, at_most=config.at_most):
        pairs = n * s
    else:
        pairs = pattern_pairs(n, config.block, config.random_blocks)
    return Cost(flops=2 * pairs * (d + dv), qk_pairs=pairs, matmul_macs=pairs * (d + dv))


# ------------------------------------------------------------------------------------------- registration


def _fallback_options(config: BigBirdConfig) -> dict:
    return {"exact_below": config.exact_below, "at_most": config.at_most}


def weights(q, k, *, key_mask, query_mask, scale, config, state) -> torch.Tensor:
    """The dense (B, H, N, S) matrix of the BigBird pattern (measuring only)."""
    b, h, n, _ = q.shape
    return _fallback.with_fallback(
        lambda: _blocksparse.dense_weights(
            q,
            k,
            pattern(config, state, b=b, h=h, n=n, s=k.shape[2], key_mask=key_mask, device=q.device),
            key_mask=key_mask,
            scale=scale,
        ),
        exact_weight_rows(q, k, key_mask, scale),
        query_mask=query_mask,
        shape=(b, n),
        device=q.device,
        **_fallback_options(config),
    )


def graph_stats(q, k, *, key_mask, query_mask, scale, config, state) -> dict[str, torch.Tensor]:
    """Sparsity and recall of the pattern against the entmax (alpha 1.5) gold graph, as Sparsefinder; rows that
    get full attention (the fallback) count every pair."""
    b, h, n, _ = q.shape
    full = _fallback.exact_rows(query_mask, n, b, q.device, **_fallback_options(config))
    pat = pattern(config, state, b=b, h=h, n=n, s=k.shape[2], key_mask=key_mask, device=q.device, full_rows=full)
    return _blocksparse.pattern_stats(q, k, pat, key_mask=key_mask, scale=scale)


@register(
    "bigbird",
    BigBirdConfig,
    cost=cost,
    init_state=init_state,
    weights=weights,
    stats=graph_stats,
    # 4-token blocks, one random block: 9 blocks at 35 real tokens (above the fallback's 28), 30 at 120
    test_options={"block": 4, "random_blocks": 1},
    # random blocks covering every block, with the pattern code running (no fallback to full attention)
    exact_limit=ExactLimit(options=lambda n: {"random_blocks": n, "full_fallback": False}),
)
def bigbird_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    scale: float,
    config: BigBirdConfig,
    state: dict[str, torch.Tensor],
    dropout: float = 0.0,
) -> torch.Tensor:
    """BigBird (ITC) block-sparse attention: sliding, global and random blocks, O(N (5 + r) block)."""
    b, h, n, _ = q.shape
    key_mask = _blocksparse.no_padding(key_mask)
    query_mask = query_mask if key_mask is not None else None

    def approximate() -> torch.Tensor:
        # without key padding the pattern is a function of the shapes, the options and the random key (by value:
        # a redraw, load_state or in-place change builds anew)
        key = None
        if key_mask is None:
            key = ("bigbird", config, int(state["rand_key"]), b, h, _context.head_key(), n, k.shape[2], q.device)
        pat = _blocksparse.cached(
            key, lambda: pattern(config, state, b=b, h=h, n=n, s=k.shape[2], key_mask=key_mask, device=q.device)
        )
        return _blocksparse.attend(q, k, v, pat, key_mask=key_mask, scale=scale, dropout=dropout, kernel=config.kernel)

    return _fallback.with_fallback(
        approximate,
        exact_rows(q, k, v, key_mask, scale, dropout),
        query_mask=query_mask,
        shape=(b, n),
        device=q.device,
        **_fallback_options(config),
    )
