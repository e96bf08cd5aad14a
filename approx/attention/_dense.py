"""The sparse patterns on short inputs: SDPA over a pattern's dense mask (plain torch), the route that
``kernel="auto"`` takes for ``window``, ``bigbird`` and ``sparse-transformer`` in CPU inference on short inputs.

There the block kernels' work per block (gathers, element masks, a softmax per chunk) costs more than scoring every
pair: on 32 rows of 128 tokens the Sparse Transformer's gather kernel took 6.4x (stride 128) and 19x (stride 32),
BigBird's block-band kernel in blocks of 16 8.1x the time of SDPA over all pairs (benchmarks/short_inputs.py). So,
where :func:`dense_route` says so, the pattern becomes a dense mask and SDPA computes the softmax over its pairs,
each pair scored once, as the pattern's definition has it; training, dropout, other devices and ``kernel="gather"``
or ``"band"`` keep the block kernels. Where each method takes it:

* the window (:func:`try_dense`, a contiguous band): where the banded kernel would score at least as many keys per
  query as there are (576 for the default one-sided window of 256 in blocks of 64);
* BigBird (:func:`try_dense`, whole blocks in position order): up to :data:`DENSE_KEYS_PER_ROW` keys, or three
  quarters of the keys its kernel scores per query; its mask differs per row and head and is written at full size
  (B H N S float32: 48 MiB for 16 rows of 256 tokens and 12 heads; the call's allocation peak 66 MiB there against 7
  on the block-band kernel) by :func:`block_additive_mask`;
* the Sparse Transformer (its own module, from the definitions on positions): up to its ``DENSE_UP_TO`` keys.

What keeps the dense mask cheap (each measured on these shapes in one-off runs; the docs' Speed page, "Short inputs"): SDPA gets an
additive float mask, not a bool one (given a (B, H, N, S) bool mask SDPA on the CPU converts it: 2.2-3.4x the time of
a float one at 128-1024 tokens); padding at the end of every row (the usual layout) is cut off by one SDPA call per
row on its real keys, so that a mask shared by the rows is never expanded to (B, H, N, S); BigBird's mask is combined
per (query block, key) and copied over each block's rows (elementwise boolean operations at full size took 2.5x
SDPA's time at 256 tokens, torch.profiler).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._blocksparse import Pattern, _block_table, _with_global_and_real, token_rows
from ._common import compute_dtype, safe_key_mask, tracked, zero_padded_values

__all__ = ["DENSE_KEYS_PER_ROW", "attend_dense", "block_additive_mask", "dense_route", "try_dense"]

# BigBird's dense route: up to this many keys, or three quarters of the keys its kernel scores per query (measured:
# benchmarks/short_inputs.py; in blocks of 16 the route was 1.29x, 1.61x and 1.31x faster than the block-band kernel
# at 256 tokens in three runs)
DENSE_KEYS_PER_ROW = 256


def dense_route(q, k, v, *, dropout: float, kernel: str, limit: int) -> bool:
    """Whether a call of a sparse pattern runs on SDPA over its dense mask (:func:`attend_dense`): ``kernel`` is
    ``"auto"``, on the CPU, in inference (no gradient to track, no dropout), with at most ``limit`` queries and
    keys."""
    if kernel != "auto" or dropout > 0.0 or q.device.type != "cpu" or tracked(q, k, v):
        return False
    return max(q.shape[2], k.shape[2]) <= limit


def attend_dense(q, k, v, allowed: torch.Tensor, *, key_mask, scale: float, has=None) -> torch.Tensor:
    """Softmax attention over the pairs that the dense (B|1, H|1, N, S) bool mask ``allowed`` admits (the pattern's
    pairs; padded keys are taken out here), each pair scored once, by SDPA with an additive float mask (0 or -inf).
    A query with no allowed real key gets 0, as the block kernels give it. In v's dtype, the scores in the compute
    dtype (float32 for half-precision inputs). ``key_mask``: as :func:`._common.safe_key_mask` returns it. ``has``
    ((B|1, H|1, N, 1) bool): which queries hold an allowed real key, when the caller knows it already (else counted
    here from ``allowed``).

    Padding at the end of each row is cut off: one SDPA call per batch row on its real keys, the mask (the row's own,
    or the one shared by every row) sliced. Other padding adds -inf at the padded keys, a pass at the full (B, H, N,
    S) size, with the padded keys and values zeroed (a NaN there would give NaN beside the -inf)."""
    out_dtype, dt, dev = v.dtype, compute_dtype(q.dtype), q.device
    zero, ninf = torch.zeros((), dtype=dt, device=dev), torch.full((), float("-inf"), dtype=dt, device=dev)
    additive = torch.where(allowed, zero, ninf)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    lengths = _right_padded_lengths(key_mask)
    known = has is not None
    if key_mask is None:
        has = has if known else allowed.any(-1, keepdim=True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=additive, scale=scale)
    elif lengths is not None:
        # allowed keys among the first L of every query: a running count, read at each row's length
        count = None if known else allowed.to(torch.int32).cumsum(-1)
        out = torch.empty(*q.shape[:3], v.shape[-1], dtype=dt, device=dev)
        if not known:
            has = torch.zeros(q.shape[0], *allowed.shape[1:3], 1, dtype=torch.bool, device=dev)
        for row, length in enumerate(lengths):
            m = row if allowed.shape[0] > 1 else 0  # the row's own mask, or the shared one
            mask, keys = additive[m : m + 1, ..., :length], slice(0, length)
            out[row] = F.scaled_dot_product_attention(
                q[row : row + 1], k[row : row + 1, :, keys], v[row : row + 1, :, keys], attn_mask=mask, scale=scale
            )[0]
            if length and not known:
                has[row] = count[m, :, :, length - 1, None] > 0
    else:
        additive = additive + torch.where(key_mask, zero, ninf)[:, None, None, :]
        has = has if known else (allowed & key_mask[:, None, None, :]).any(-1, keepdim=True)
        k, v = zero_padded_values(k, key_mask), zero_padded_values(v, key_mask)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=additive, scale=scale)
    return out.masked_fill_(~has, 0.0).to(out_dtype)


def _right_padded_lengths(key_mask: torch.Tensor | None) -> list[int] | None:
    """Each row's real length when ``key_mask`` (B, S) puts every row's padding at its end (one host
    synchronisation), else None."""
    if key_mask is None or not bool((key_mask[:, 1:] <= key_mask[:, :-1]).all()):
        return None
    return key_mask.sum(-1).tolist()


def try_dense(q, k, v, pattern: Pattern, *, key_mask, scale, dropout, with_lse, kernel) -> torch.Tensor | None:
    """A block-sparse pattern's output by SDPA over its dense mask on a short input in CPU inference
    (:func:`dense_route`); None to go on with the block kernels. A contiguous band (``window``) takes it where the
    banded kernel would score at least as many keys per query as there are; whole blocks in position order
    (``bigbird``) up to :data:`DENSE_KEYS_PER_ROW` keys or three quarters of the keys its kernel scores per query;
    patterns that sort their tokens (LSH, the strided pattern's residues, BigBird with padding inside a row), carry
    an element mask that is not a band (a dilated window) or a score bias never."""
    if with_lse or pattern.bias is not None:
        return None
    n, s = q.shape[2], k.shape[2]
    if pattern.band is not None:
        from . import _band

        if not dense_route(
            q, k, v, dropout=dropout, kernel=kernel, limit=_band.keys_per_row(n, pattern.band, pattern.block)
        ):
            return None
        gap = torch.arange(n, device=q.device)[:, None] - torch.arange(s, device=q.device)[None, :]
        allowed = _with_global_and_real(pattern, (gap.abs() <= pattern.band)[None, None], None, n, s)
        return attend_dense(q, k, v, allowed, key_mask=safe_key_mask(key_mask), scale=scale)
    if pattern.q_order is not None or pattern.k_order is not None or pattern.allow is not None:
        return None
    shared = 0 if pattern.shared_keys is None else int(pattern.shared_keys.sum(-1).max())
    keys = pattern.kv_blocks.shape[-1] * pattern.block + shared
    if not dense_route(q, k, v, dropout=dropout, kernel=kernel, limit=max(DENSE_KEYS_PER_ROW, 3 * keys // 4)):
        return None
    key_mask = safe_key_mask(key_mask)
    dt, out_dtype = compute_dtype(q.dtype), v.dtype
    additive, has = block_additive_mask(pattern, q.shape[0], q.shape[1], n, s, key_mask, dt)
    # padded keys and values zeroed: a NaN or inf there would give NaN beside the mask's -inf
    k, v = zero_padded_values(k.to(dt), key_mask), zero_padded_values(v.to(dt), key_mask)
    out = F.scaled_dot_product_attention(q.to(dt), k, v, attn_mask=additive, scale=scale)
    return out.masked_fill_(~has, 0.0).to(out_dtype)


def block_additive_mask(pattern: Pattern, b: int, h: int, n: int, s: int, key_mask, dt: torch.dtype):
    """The additive (B, H, N, S) mask (0: a pair of the pattern, -inf: not) of a pattern of whole blocks in position
    order (no ``allow``, no sorting; ``bigbird``), written in one pass: the key blocks, shared keys' columns and
    padded keys are combined per (query block, key) first, copied over the rows of each block, and the global
    queries' rows written last. Also (B, H, N, 1) whether a query has a pair at all: SDPA's output for a query
    without one (every entry -inf) is replaced by 0 by the caller."""
    blk, dev = pattern.block, pattern.kv_blocks.device
    tq, tk = -(-n // blk), -(-s // blk)
    blockmask = _block_table(pattern, b, h, tq, tk, dev)
    real = torch.ones(b, s, dtype=torch.bool, device=dev) if key_mask is None else key_mask
    real = F.pad(real, (0, tk * blk - s)).view(b, 1, 1, tk, blk)  # slots past the end are not keys
    cols = torch.zeros(b, 1, 1, tk, blk, dtype=torch.bool, device=dev)
    if pattern.shared_keys is not None:
        cols = F.pad(pattern.shared_keys[:, :s], (0, tk * blk - s)).view(b, 1, 1, tk, blk) & real
    ninf = torch.full((), float("-inf"), dtype=dt, device=dev)
    zero = torch.zeros((), dtype=dt, device=dev)
    per_block = torch.where((blockmask[..., None] & real) | cols, zero, ninf)  # (B, H, Tq, Tk, blk)
    # a copy (contiguous: the global rows are written into it below; with one query block a reshape could be a view)
    additive = per_block[:, :, :, None].expand(b, h, tq, blk, tk, blk).contiguous().view(b, h, tq * blk, tk * blk)
    additive = additive[:, :, :n, :s]
    has = (blockmask & real.any(-1)).any(-1) | cols.any((-1, -2))  # (B, H, Tq)
    has = has[..., None].expand(b, h, tq, blk).reshape(b, h, tq * blk)[:, :, :n].contiguous()
    if pattern.global_queries is not None and bool(pattern.global_queries.any()):
        rows, ok = token_rows(pattern.global_queries[:, :n])  # (B, G)
        batch = torch.arange(b, device=dev)[:, None].expand_as(rows)
        row_mask = torch.where(real.view(b, 1, tk * blk)[..., :s], zero, ninf)  # (B, 1, S): every real key
        additive[batch[ok], :, rows[ok]] = row_mask.expand(b, h, s)[batch[ok]]
        has[batch[ok], :, rows[ok]] = real.view(b, -1).any(-1)[batch[ok], None]
    return additive, has[..., None]
