"""Strided and fixed sparse attention (Sparse Transformer).

Child, Gray, Radford, Sutskever, "Generating Long Sequences with Sparse Transformers", arXiv 1904.10509, §4.

Two factorised patterns of stride (block length) ``l`` = ``stride``, each the union of two sets of keys for query
i:

* ``strided``: A1_i = {j : |i - j| < l} (i and the l - 1 positions on each side) and
  A2_i = {j : (i - j) mod l = 0} (every l-th key, in phase with i);
* ``fixed``: A1_i = {j : floor(j / l) = floor(i / l)} (i's block of l positions) and
  A2_i = {j : j mod l >= l - c} (the last c = ``summary`` positions of every block: "summary" keys).

The paper is causal (j <= i, autoregressive image, text and audio models); approx patches encoders, so the
condition is dropped: the patterns are **bidirectional**. Padded keys are never attended (the key mask is
applied on top of the pattern).

Heads (``heads``): the paper (§4.3) interleaves the two factorised patterns across residual blocks, merges
them in one head, or gives separate patterns to parallel heads. ``"split"`` (default) is the per-head
interleaving: even heads 0, 2, 4, ... attend A1 and odd heads 1, 3, ... attend A2, so an odd head count gives A1
the extra head (a single head attends A1 only). ``"union"`` is the "merged head": every head attends A1 ∪ A2,
each pair once.

A query whose pattern holds no real key gets uniform weights over the real keys (the mean of the real values,
no dropout), the limit of a softmax whose scores are all equal, rather than an undefined softmax over nothing:
padding queries further than l past the last real token (A1 heads), and, for real queries, only the fixed A2
heads of a sequence of at most l - c tokens (no summary position yet: use ``"union"`` or ``exact_below`` for
inputs that short). It costs one mean per head; exact rows would cost O(pads * N) on padded batches.

Positions are those of the padded sequence from 0 (padding is at the end, so the real tokens' pairs do not move
when pads are appended). Runs on the block-sparse kernel (:mod:`._blocksparse`), ``block`` rows per query block:

* strided A1 is a window (query block t attends the key blocks [t * block - l + 1, (t + 1) * block + l - 1]
  touches, the element mask keeps |i - j| < l);
* strided A2 becomes contiguous after sorting queries by (i mod l, i) and keys by (is_pad, j mod l, j): the keys
  of one residue are one run of real keys (pads sorted last, so appending pads changes no real key's run), and a
  query block attends the runs of the residues it holds; the element mask keeps equal residues;
* fixed A1 is block diagonal (a query block attends the key blocks covering its l-blocks, the element mask keeps
  floor(i / l) = floor(j / l)); fixed A2 is a strip of summary key columns shared by every query (the kernel's
  ``shared_keys``, which it leaves out of the blocks, so that a summary key in i's own block is counted once).

Strided ``"union"`` runs A1 and A2 \\ A1 = {j != i : (i - j) mod l = 0} (disjoint pair sets, kept apart by the
element masks) and merges them exactly with their log-sum-exp (:func:`._blocksparse.combine`); fixed
``"union"`` is one call (blocks plus shared summary keys). ``"split"`` is one kernel call per half of the heads.
Which queries hold a real key (for the uniform rows above) is counted from prefix sums of the key mask, not read
from the kernel's log-sum-exp, so that single-pattern calls can run on FlexAttention (``kernel``, see
:mod:`._flex`: on the CPU it returns no log-sum-exp, so strided ``"union"`` runs the gather kernel there). Short
inputs in CPU inference (``kernel="auto"``, up to :data:`DENSE_UP_TO` queries and keys) run on SDPA over the
pattern's dense mask instead (:mod:`._dense`), built from the definitions on positions (:func:`position_mask`):
faster there than the block kernel.
Exact limit: the strided pattern with l >= N in ``"union"`` mode (A1 then holds every pair), computed by this
code, not by the exact fallback. Cost: the exact pair count of the pattern (see :func:`cost`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..config import MethodConfig, option
from ..registry import Cost, ExactLimit, register
from . import _blocksparse, _context, _dense, _fallback
from ._blocksparse import Pattern
from ._common import compute_dtype, exact_rows, exact_weight_rows, refuse_left_padding, safe_key_mask

PATTERNS = ("strided", "fixed")
# Inference on the CPU with at most this many keys runs on SDPA over the pattern's dense mask (position_mask): faster
# there than the block kernel (measured with each pattern's default options and with stride 32: docs, Speed, "Short
# inputs")
DENSE_UP_TO = {"strided": 768, "fixed": 512}
HEADS = ("split", "union")


@dataclasses.dataclass(frozen=True)
class SparseTransformerConfig(MethodConfig):
    """Options of Sparse Transformer attention (strided or fixed factorised patterns)."""

    method = "sparse-transformer"

    pattern: str = option(
        "strided",
        "strided: A1 = {|i - j| < l}, A2 = {(i - j) mod l = 0}; fixed: A1 = {floor(i/l) = floor(j/l)}, "
        "A2 = {j mod l >= l - summary} (both bidirectional: the paper's j <= i is dropped for encoders)",
    )
    stride: int = option(128, "l: the stride (strided) or block length (fixed); the paper used 128 and 256")
    summary: int = option(8, "c: summary positions at the end of every block of l (fixed only; the paper: 8 to 32)")
    heads: str = option(
        "split",
        "split: even heads attend A1, odd heads A2 (an odd head count gives A1 the extra head); "
        "union: every head attends A1 ∪ A2",
    )
    block: int = option(64, "rows per query block of the kernel (speed only: the output does not depend on it)")
    exact_below: int = option(0, "sequences with fewer real tokens get exact attention (0 = never)")
    kernel: str = _blocksparse.kernel_option()

    def unused(self) -> dict[str, str]:
        return {"summary": "pattern='fixed'"} if self.pattern != "fixed" else {}

    def check(self) -> None:
        choose = "choose one of {}"
        self.require(self.pattern in PATTERNS, "pattern", choose.format(", ".join(map(repr, PATTERNS))))
        self.require(self.heads in HEADS, "heads", choose.format(", ".join(map(repr, HEADS))))
        self.require(self.stride >= 1, "stride", "a stride (block length) of 1 or more")
        self.require(self.summary >= 1, "summary", "at least one summary position per block")
        if self.pattern == "fixed":
            self.require(self.summary <= self.stride, "summary", "at most the block length l = stride")
        self.require(self.block >= 1, "block", "at least one row per block")
        self.require(self.exact_below >= 0, "exact_below", "a length: 0 (off) or more")
        _blocksparse.check_kernel(self)


# ------------------------------------------------------------------------------------------------ cost


def _band_pairs(n: int, s: int, reach: int) -> int:
    """Pairs (i < n, j < s) with |i - j| <= reach: per offset t = i - j, the rows where both fit."""
    t = torch.arange(-reach, reach + 1, dtype=torch.float64)
    return int((torch.minimum(torch.tensor(float(n)), s + t) - t.clamp(min=0)).clamp(min=0).sum())


def _per_residue(n: int, r: int) -> torch.Tensor:
    """How many of the positions 0..n-1 fall in each residue class mod r: (r,) float64."""
    return torch.full((r,), float(n // r), dtype=torch.float64) + (torch.arange(r) < n % r).double()


def _per_block(n: int, length: int, blocks: int) -> torch.Tensor:
    """How many of the positions 0..n-1 fall in each of the first ``blocks`` l-blocks: (blocks,) float64."""
    start = torch.arange(blocks, dtype=torch.float64) * length
    return (torch.clamp(start + length, max=float(n)) - start).clamp(min=0)


@functools.lru_cache(maxsize=4096)  # the cost model asks per head and per row length, a few small tensor ops each
def pattern_pairs(config: SparseTransformerConfig, n: int, s: int) -> tuple[int, int, int]:
    """Exact pair counts (i < n, j < s, every token real) of A1, A2 and A1 ∪ A2."""
    if n == 0 or s == 0:
        return 0, 0, 0
    m = max(n, s)
    stride = min(config.stride, m)  # past the longest side, every larger l gives the same pairs
    if config.pattern == "strided":
        a1 = _band_pairs(n, s, stride - 1)
        a2 = int((_per_residue(n, stride) * _per_residue(s, stride)).sum())
        return a1, a2, a1 + a2 - min(n, s)  # A1 ∩ A2 = {i = j}
    c = config.summary
    blocks = -(-m // stride)
    q_in, k_in = _per_block(n, stride, blocks), _per_block(s, stride, blocks)
    # summary keys in every block: [start + l - c, start + l) with the real l (past both sides: one block)
    end = torch.arange(blocks, dtype=torch.float64) * stride + config.stride
    summary = (end.clamp(max=float(s)) - (end - c).clamp(min=0.0)).clamp(min=0)
    a1 = int((q_in * k_in).sum())
    a2 = n * int(summary.sum())
    return a1, a2, a1 + a2 - int((q_in * summary).sum())


def cost(config: SparseTransformerConfig, *, n: int, s: int, d: int, dv: int) -> Cost:
    """Exact pair counts of the pattern over n queries and s keys, all real (the harness counts each row of a padded
    batch at its real length, ``Method.costs``): the union in ``"union"`` mode; in ``"split"`` mode the mean of A1 and A2 over two heads
    (rounded up; a layer's cost counts each head's own half, :func:`head_cost`). The kernel evaluates whole blocks,
    more products than pairs: the count is the pattern's, the literature's convention."""
    return _pairs_cost(config, n=n, s=s, d=d, dv=dv, head=None)


def head_cost(config: SparseTransformerConfig, *, n: int, s: int, d: int, dv: int, head: int) -> Cost:
    """One head's cost as :func:`cost` counts it, by the head's index in its layer: in ``"split"`` mode an even
    head's A1 and an odd head's A2, so that a layer's count of the pattern's pairs is exact for any set of heads (an
    odd count, or ``on_heads``). A query whose pattern holds no real key (fixed A2 on a sequence of at most l - c
    tokens: an odd head there counts 0) gets the mean of the real values, which no pair is counted for."""
    return _pairs_cost(config, n=n, s=s, d=d, dv=dv, head=head)


def _pairs_cost(config: SparseTransformerConfig, *, n: int, s: int, d: int, dv: int, head: int | None) -> Cost:
    if _fallback.exact_for_length(n, exact_below=config.exact_below):
        pairs = n * s
    else:
        a1, a2, union = pattern_pairs(config, n, s)
        if config.heads == "union":
            pairs = union
        elif head is None:
            pairs = -(-(a1 + a2) // 2)
        else:
            pairs = a1 if head % 2 == 0 else a2
        pairs = min(n * s, pairs)
    return Cost(flops=2 * pairs * (d + dv), qk_pairs=pairs, matmul_macs=pairs * (d + dv))


# --------------------------------------------------------------------------------------------- patterns


def _window(blk: int, reach: int, n: int, s: int, device) -> Pattern:
    """Strided A1: |i - j| <= reach = l - 1, in position order."""
    tq, tk = -(-n // blk), -(-s // blk)
    starts = torch.arange(tq, device=device) * blk
    kv, valid = _blocksparse.range_blocks(starts - reach, starts + blk + reach, blk, tk)

    def allow(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return (i - j).abs() <= reach

    return Pattern(blk, kv[None, None], valid[None, None], allow=allow)


def _residues(blk: int, stride: int, key_mask, n: int, s: int, device, *, skip_self: bool) -> Pattern:
    """Strided A2: (i - j) mod l = 0 (without i = j when ``skip_self``: A2 \\ A1), queries sorted by (i mod l, i)
    and keys by (is_pad, j mod l, j), so that each residue's real keys are one run of sorted slots."""
    r = min(stride, max(n, s))  # residues of positions below max(n, s) (and their equalities) are those mod l
    tq, tk = -(-n // blk), -(-s // blk)
    i, j = torch.arange(n, device=device), torch.arange(s, device=device)
    q_order = ((i % r) * n + i).argsort()  # (N,)
    real = torch.ones(1, s, dtype=torch.bool, device=device) if key_mask is None else key_mask  # (B|1, S)
    k_order = (((~real).long() * r + j % r) * s + j).argsort(-1)  # (B|1, S): real keys first
    count = torch.zeros(real.shape[0], r, dtype=torch.long, device=device)
    count.scatter_add_(1, (j % r).expand_as(real), real.long())  # real keys per residue (B|1, r)
    end = count.cumsum(-1)
    begin = end - count
    starts = torch.arange(tq, device=device) * blk
    first = q_order[starts] % r  # residue of the first and last query of every query block (Tq,)
    last = q_order[(starts + blk).clamp(max=n) - 1] % r
    kv, valid = _blocksparse.range_blocks(begin[:, first], end[:, last], blk, tk)  # (B|1, Tq, K)

    def allow(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        diff = i - j
        ok = diff.remainder(r) == 0
        return ok & (diff != 0) if skip_self else ok

    return Pattern(blk, kv[:, None], valid[:, None], q_order=q_order[None, None], k_order=k_order[:, None], allow=allow)


def _summary_keys(config: SparseTransformerConfig, b: int, s: int, device) -> torch.Tensor:
    """Fixed A2: the keys j with j mod l >= l - c, (B, S) bool."""
    j = torch.arange(s, device=device)
    return (j % config.stride >= config.stride - config.summary).expand(b, s)


def _blocks(config: SparseTransformerConfig, b: int, n: int, s: int, device, *, local: bool, summary: bool):
    """Fixed A1 (``local``: i's own l-block) and/or A2 (``summary``: the summary columns, shared by every query)."""
    blk = config.block
    tq, tk = -(-n // blk), -(-s // blk)
    shared = _summary_keys(config, b, s, device) if summary else None
    if not local:
        none = torch.zeros(1, 1, tq, 1, dtype=torch.long, device=device)
        return Pattern(blk, none, none.bool(), shared_keys=shared)
    length = min(config.stride, max(n, s))  # past the longest side, every position is in block 0 either way
    starts = torch.arange(tq, device=device) * blk
    ends = (starts + blk).clamp(max=n) - 1
    kv, valid = _blocksparse.range_blocks(starts // length * length, (ends // length + 1) * length, blk, tk)

    def allow(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return i.div(length, rounding_mode="floor") == j.div(length, rounding_mode="floor")

    return Pattern(blk, kv[None, None], valid[None, None], allow=allow, shared_keys=shared)


def _has_key(config: SparseTransformerConfig, key_mask, n: int, s: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Which queries hold a real key in A1 and in A2: two (B|1, N) bool, counted from the real keys' prefix sums
    (no kernel log-sum-exp needed: the kernel's FlexAttention path does not return one on the CPU)."""
    m, stride = max(n, s), config.stride
    real = torch.ones(1, s, dtype=torch.bool, device=device) if key_mask is None else key_mask  # (B|1, S)
    cum = torch.nn.functional.pad(real.long().cumsum(-1), (1, 0))  # (B|1, S + 1): real keys before each slot
    i = torch.arange(n, device=device)

    def between(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:  # real keys in [lo, hi), (B|1, N) > 0
        return (cum[:, hi.clamp(0, s)] - cum[:, lo.clamp(0, s)]) > 0

    length = min(stride, m)
    if config.pattern == "strided":
        j = torch.arange(s, device=device)
        per_residue = torch.zeros(real.shape[0], length, dtype=torch.long, device=device)
        per_residue.scatter_add_(1, (j % length).expand_as(real), real.long())
        return between(i - length + 1, i + length), per_residue[:, i % length] > 0
    summary = (real & _summary_keys(config, real.shape[0], s, device)).any(-1, keepdim=True)  # (B|1, 1)
    return between(i // length * length, (i // length + 1) * length), summary.expand(-1, n)


def _refuse_left_padding(config: SparseTransformerConfig, key_mask) -> None:
    if config.pattern == "fixed":  # its blocks and summary columns are absolute positions, counted from the row's start
        refuse_left_padding(
            key_mask, "sparse-transformer", "pattern='fixed'", takes="cuts each row into blocks from its first position"
        )


def head_groups(config: SparseTransformerConfig, *, key_mask, b: int, n: int, s: int, device):
    """[(heads, [patterns], has_key)]: the heads (a slice, or positions: :func:`_halves`), the disjoint patterns whose
    union they attend and which queries hold a real key in that union ((B|1, N) bool)."""
    stride, blk = config.stride, config.block
    _refuse_left_padding(config, key_mask)
    key_mask = safe_key_mask(key_mask)
    in_a1, in_a2 = _has_key(config, key_mask, n, s, device)
    if config.pattern == "strided":
        a1 = _window(blk, min(stride, max(n, s)) - 1, n, s, device)
        if config.heads == "union":
            if stride >= max(n, s):  # A2 \ A1 is empty: A1 holds every pair
                return [(slice(None), [a1], in_a1)]
            a2 = _residues(blk, stride, key_mask, n, s, device, skip_self=True)
            return [(slice(None), [a1, a2], in_a1 | in_a2)]
        a2 = _residues(blk, stride, key_mask, n, s, device, skip_self=False)
        even, odd = _halves()
        return [(even, [a1], in_a1), (odd, [a2], in_a2)]
    if config.heads == "union":
        return [(slice(None), [_blocks(config, b, n, s, device, local=True, summary=True)], in_a1 | in_a2)]
    even, odd = _halves()
    return [
        (even, [_blocks(config, b, n, s, device, local=True, summary=False)], in_a1),
        (odd, [_blocks(config, b, n, s, device, local=False, summary=True)], in_a2),
    ]


def _halves() -> tuple[slice | list[int], slice | list[int]]:
    """The call's heads that attend A1 and A2 in ``"split"`` mode: the layer's even and odd heads. Slices of the
    call's heads, or their positions in the call when it holds some of its layer's heads only (:mod:`._context`)."""
    given = _context.head_key()
    if given is None:
        return slice(0, None, 2), slice(1, None, 2)
    return [i for i, h in enumerate(given) if h % 2 == 0], [i for i, h in enumerate(given) if h % 2 == 1]


def pattern_mask(config: SparseTransformerConfig, *, key_mask, b: int, h: int, n: int, s: int, device):
    """The pattern as a dense (B, H, N, S) bool mask (real keys only), from the kernel's own block lists."""
    mask = torch.zeros(b, h, n, s, dtype=torch.bool, device=device)
    for heads, parts, _ in head_groups(config, key_mask=key_mask, b=b, n=n, s=s, device=device):
        count = len(range(h)[heads]) if isinstance(heads, slice) else len(heads)
        for part in parts if count else []:
            mask[:, heads] |= _blocksparse.dense_mask(part, b=b, h=count, n=n, s=s, key_mask=key_mask, device=device)[0]
    return mask


def position_mask(config: SparseTransformerConfig, *, h: int, n: int, s: int, device) -> torch.Tensor:
    """The pattern as a dense (1, H|1, N, S) bool mask, padded keys included, from its definition on positions (A1,
    A2 and the heads that attend them), not from the kernel's block lists: what the dense route of short inputs runs
    (:func:`._dense.dense_route`; :func:`._dense.attend_dense` takes the padded keys out)."""
    stride = config.stride
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(s, device=device)[None, :]
    if config.pattern == "strided":
        a1, a2 = (i - j).abs() < stride, (i - j).remainder(stride) == 0
    else:
        a1, a2 = (
            i.div(stride, rounding_mode="floor") == j.div(stride, rounding_mode="floor"),
            (j % stride >= stride - config.summary).expand(n, s),
        )
    if config.heads == "union":
        mask = (a1 | a2)[None, None]
    else:
        mask = torch.where(_even_heads(h, device)[:, None, None], a1, a2)[None]
    return mask


def _even_heads(h: int, device) -> torch.Tensor:
    """(H,) bool: the call's heads that attend A1 in ``"split"`` mode (:func:`_halves`)."""
    even = torch.zeros(h, dtype=torch.bool, device=device)
    even[_halves()[0]] = True
    return even


def _mask_pattern(mask: torch.Tensor) -> Pattern:
    """A dense (B, H, N, S) mask as a Pattern (one block over everything, the mask as element mask), for the
    kernel module's dense weights and statistics (not a function of positions: ``flex=False``)."""
    n, s = mask.shape[-2:]
    one = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=mask.device)
    return Pattern(max(n, s, 1), one, allow=lambda i, j: mask, flex=False)


def _real_mean(v: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """The mean of the real values (B, H, dv), in the compute dtype: the output of a query whose pattern holds no
    real key (uniform weights over the real keys)."""
    v = v.to(compute_dtype(v.dtype))
    key_mask = safe_key_mask(key_mask)
    if key_mask is None:
        return v.mean(2)
    real = key_mask[:, None, :, None]  # (B, 1, S, 1)
    return v.masked_fill(~real, 0.0).sum(2) / real.sum(2)


def weights(q, k, *, key_mask, query_mask, scale, config, state) -> torch.Tensor:
    """The dense (B, H, N, S) matrix of the pattern (measuring only); a row whose pattern holds no real key is
    uniform over the real keys, as in the attention."""
    b, h, n, _ = q.shape
    s = k.shape[2]

    def dense() -> torch.Tensor:
        mask = pattern_mask(config, key_mask=key_mask, b=b, h=h, n=n, s=s, device=q.device)
        w = _blocksparse.dense_weights(q, k, _mask_pattern(mask), key_mask=key_mask, scale=scale)
        real = torch.ones(b, s, device=w.device) if key_mask is None else safe_key_mask(key_mask)
        real = real.to(w.dtype)
        uniform = (real / real.sum(-1, keepdim=True))[:, None, None, :]  # (B, 1, 1, S)
        return torch.where(mask.any(-1, keepdim=True), w, uniform)

    return _fallback.with_fallback(
        dense,
        exact_weight_rows(q, k, key_mask, scale),
        query_mask=query_mask,
        shape=(b, n),
        device=q.device,
        exact_below=config.exact_below,
    )


def graph_stats(q, k, *, key_mask, query_mask, scale, config, state) -> dict[str, torch.Tensor]:
    """Sparsity and recall of the pattern against the entmax (alpha 1.5) gold graph, as Sparsefinder."""
    b, h, n, _ = q.shape
    mask = pattern_mask(config, key_mask=key_mask, b=b, h=h, n=n, s=k.shape[2], device=q.device)
    mask = mask | ~mask.any(-1, keepdim=True)  # a row with no key in its pattern averages every real key (weights())
    exact = _fallback.exact_rows(query_mask, n, b, q.device, exact_below=config.exact_below)
    return _blocksparse.pattern_stats(q, k, _mask_pattern(mask), key_mask=key_mask, scale=scale, exact_rows=exact)


@register(
    "sparse-transformer",
    SparseTransformerConfig,
    cost=cost,
    head_cost=head_cost,
    weights=weights,
    stats=graph_stats,
    test_options={"stride": 6, "block": 8},
    # strided with l >= N, every head attending A1 ∪ A2: A1 alone holds every pair, through the pattern code
    exact_limit=ExactLimit(options=lambda n: {"pattern": "strided", "stride": n, "heads": "union"}),
)
def sparse_transformer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    scale: float,
    config: SparseTransformerConfig,
    state: dict[str, torch.Tensor],
    dropout: float = 0.0,
) -> torch.Tensor:
    """Sparse Transformer attention (strided or fixed factorised pattern), O(N (l + N / l)) or O(N (l + c N / l))."""
    b, h, n, _ = q.shape
    s = k.shape[2]
    key_mask = _blocksparse.no_padding(key_mask)

    def dense() -> torch.Tensor:  # short inputs in inference on the CPU: SDPA over the dense mask
        _refuse_left_padding(config, key_mask)
        real = safe_key_mask(key_mask)
        has = _has_key(config, real, n, s, q.device)  # which queries hold a real key in A1, A2 (prefix sums)
        if config.heads == "union":
            has = (has[0] | has[1])[:, None, :, None]
        else:
            has = torch.where(_even_heads(h, q.device)[:, None], has[0][:, None], has[1][:, None])[..., None]
        allowed = position_mask(config, h=h, n=n, s=s, device=q.device)
        o = _dense.attend_dense(q, k, v, allowed, key_mask=real, scale=scale, has=has)
        mean = _real_mean(v, key_mask)[:, :, None]  # (B, H, 1, dv): the queries without a real key
        return torch.where(has, o, mean).to(v.dtype)

    def approximate() -> torch.Tensor:
        limit = DENSE_UP_TO[config.pattern]
        if _dense.dense_route(q, k, v, dropout=dropout, kernel=config.kernel, limit=limit):
            return dense()
        out = v.new_empty(b, h, n, v.shape[-1])  # (B, H, N, dv)
        # without key padding the patterns are a function of the shapes and options
        key = None if key_mask is not None else ("sparse-transformer", config, _context.head_key(), b, n, s, q.device)
        groups = _blocksparse.cached(
            key, lambda: head_groups(config, key_mask=key_mask, b=b, n=n, s=s, device=q.device)
        )
        for heads, parts, has_key in groups:
            qh, kh, vh = q[:, heads], k[:, heads], v[:, heads]
            if qh.shape[1] == 0:
                continue
            run = functools.partial(_blocksparse.attend, qh, kh, vh, key_mask=key_mask, scale=scale, dropout=dropout)
            if len(parts) == 1:
                o = run(parts[0], kernel=config.kernel)
            else:  # disjoint pair sets, merged by their log-sum-exp
                runs = [run(p, with_lse=True, kernel=config.kernel) for p in parts]
                o = _blocksparse.combine([o for o, _ in runs], [lse for _, lse in runs])
            mean = _real_mean(vh, key_mask)[:, :, None]  # (B, h, 1, dv): the queries without a real key
            out[:, heads] = torch.where(has_key[:, None, :, None], o, mean).to(v.dtype)
        return out

    return _fallback.with_fallback(
        approximate,
        exact_rows(q, k, v, key_mask, scale, dropout),
        query_mask=query_mask,
        shape=(b, n),
        device=q.device,
        exact_below=config.exact_below,
    )
