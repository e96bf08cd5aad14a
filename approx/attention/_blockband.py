"""Attention of query blocks to their neighbouring key blocks, a few listed key blocks and shared keys (plain torch,
inference): the CPU fast path of ``bigbird``.

A :class:`._blocksparse.Pattern` with ``neighbours = a`` lists for query block t (in the pattern's sorted order) the
key blocks t - a, ..., t + a first and then R blocks of its own (BigBird's random blocks). Per batch row and head:

* the row's real tokens, in the pattern's order, sit in one zero-padded buffer (a blocks of zeros at each end), so
  that the 2a + 1 neighbouring key blocks of every query block are *views* of it (``Tensor.unfold``), as in the
  window's banded kernel (:mod:`._band`): no copy of them per query block. Where every window lies inside the real
  tokens and they are already in order (no padding inside the row), K and V themselves are viewed, not copied;
* the R listed blocks are gathered a chunk of query blocks at a time into a reused buffer (``index_select``);
* the shared keys' scores are one product for the whole chunk;
* the three score products go side by side into one reused (blocks, block, (2a + 1 + R) block + G) buffer, with a
  ``-inf`` bias only on the query blocks that need one (a block not listed, or a key that is padding, past the end
  or shared: found beforehand, usually a few blocks per row), one softmax in place, and three products with the
  values into one reused output buffer.

With ``fused`` (bigbird's ``kernel="fused"``), each batch row's query blocks run on ``csrc/block_band.cpp``
instead of the chunks (:func:`_fused_row`): the same three score products side by side, bias and softmax, and three
products with the values, one (head, query block) per task, in C++.

Query blocks made only of global queries are skipped: global queries' rows are dense attention to every real key
(SDPA), written afterwards. Padded queries attend the shared keys only (0 without any), as in the gather kernel.
Work O(N ((2a + 1 + R) block + G) d), memory O(N d) plus one chunk. Every buffer is allocated once per batch row
and reused by its heads and chunks: a fresh large tensor per chunk costs more than its product on the CPU (page
faults). tests/test_blockband.py compares it with a float64 softmax from BigBird's definition and with the gather
kernel; the docs' Speed page has the measurements.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F

from ._common import compute_dtype

__all__ = ["attend", "unusable"]

# Largest score chunk, in elements (blocks * block * keys): 2 MiB in float32, so that the softmax and the products
# that follow the score products find it in cache. BigBird at N = 4096 on 2 CPU cores, one-off timings of the whole
# call: 2^19 elements 72-76 ms, 2^20 73-80 ms (within noise of each other), 2^18 80 ms, 2^21 90 ms, 2^16 108 ms
_CHUNK_ELEMENTS = 1 << 19


def unusable(q, k, v, pattern, *, key_mask, dropout: float, with_lse: bool) -> str | None:
    """Why this kernel cannot run this call (None: it can). Besides the pattern's ``neighbours``, it needs one order
    per batch row (``q_order`` (B|1, 1, N), the same tensor as ``k_order``) that puts the row's real tokens first,
    as BigBird's does, or none with padding at the end only (``key_mask`` (B, N) bool, safe_key_mask's)."""
    if pattern.neighbours is None:
        return "the pattern lists no neighbouring key blocks first (bigbird's patterns do)"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return "it is inference only (no gradient)"
    if dropout > 0.0:
        return "it applies no dropout"
    if with_lse:
        return "it returns no log-sum-exp"
    if q.shape[2] != k.shape[2]:
        return "it needs as many queries as keys"
    if pattern.allow is not None or pattern.bias is not None:
        return "it takes no element mask or score bias"
    if pattern.q_order is not pattern.k_order:
        return "it needs queries and keys in one order"
    if pattern.q_order is not None and pattern.q_order.shape[1] != 1:
        return "it needs one order per batch row, not one per head"
    if key_mask is not None:  # real tokens first: the first L slots of each row's order hold its L real tokens
        first = torch.arange(key_mask.shape[1], device=key_mask.device) < key_mask.sum(-1, keepdim=True)
        if pattern.q_order is not None:
            key_mask = key_mask.gather(1, pattern.q_order[:, 0].expand(key_mask.shape[0], -1))
        if not bool((key_mask == first).all()):
            return "it needs each row's real tokens first in the pattern's order (padding last)"
    return None


def _load(dst: torch.Tensor, src: torch.Tensor, order: torch.Tensor, prefix: bool) -> None:
    """``dst`` (L, d) = the rows ``order`` of ``src`` (N, d), cast to ``dst``'s dtype (``prefix``: the first L)."""
    if prefix:
        dst.copy_(src[: dst.shape[0]])
    elif src.dtype == dst.dtype:
        torch.index_select(src, 0, order, out=dst)
    else:
        dst.copy_(src[order])


def _head_keys(kh, vh, bufs, order, prefix: bool, *, block: int, neighbours: int, blocks: int):
    """One head's keys and values (N, d / dv): the neighbouring windows ((windows, d, W), (windows, W, dv)) and the
    blocks ((blocks, block, d), (blocks, block, dv)), views of the inputs (``bufs`` None) or of the zero-padded
    buffers ``bufs`` after loading the head into them; and the offset of block t's window (its index is t + offset)."""
    a, length, wide = neighbours, order.shape[0], (2 * neighbours + 1) * block
    if bufs is not None:
        for buf, x in zip(bufs, (kh, vh), strict=True):
            _load(buf[a * block : a * block + length], x, order, prefix)
        kh, vh = bufs
        start, offset = a * block, 0  # the buffer starts with a blocks of zeros
    else:
        start, offset = 0, -a
    windows = (kh.unfold(0, wide, block), vh.unfold(0, wide, block).transpose(1, 2))
    stack = tuple(x[start : start + blocks * block].view(blocks, block, x.shape[-1]) for x in (kh, vh))
    return windows, stack, offset


def _flagged(flags: torch.Tensor) -> list[list[int]]:
    """(Hb, T) bool -> per head, the flagged blocks."""
    return [row.nonzero().squeeze(-1).tolist() for row in flags]


def _in_chunk(blocks: list[int], t0: int, t1: int, device) -> torch.Tensor | None:
    """The flagged blocks within [t0, t1), as offsets in the chunk (None: none)."""
    inside = [t - t0 for t in blocks if t0 <= t < t1]
    return torch.tensor(inside, device=device) if inside else None


def _head(table, h: int):
    """Head ``h`` of a per-head table (a tensor or a list), or its only entry when the heads share it."""
    return table[h if len(table) > 1 else 0]


@dataclasses.dataclass
class _Row:
    """What every head of one batch row reads. Per head (first dim H, or 1 when shared) and real query block t:
    ``near_bias`` (Hb, T, (2a + 1) block) and ``listed_bias`` (Hb, T, R block), 0 or -inf on each of its keys, and
    the blocks needing them (``near_flags``, ``listed_flags``: lists per head); ``empty``: per head, the blocks with no
    key at all (none when there are shared keys); ``ids`` (Hb, T, R): the listed blocks; ``span``: the query blocks
    to run, [lo, hi) (those with a query that is not global); ``shared``: the real shared keys' positions or None."""

    near_bias: torch.Tensor
    listed_bias: torch.Tensor
    near_flags: list[list[int]]
    listed_flags: list[list[int]]
    empty: list[list[int]]
    ids: torch.Tensor
    span: tuple[int, int]
    shared: torch.Tensor | None


def _row_tables(pattern, bi: int, order, real, *, valid, dt, device) -> _Row:
    """The :class:`_Row` of batch row ``bi``: ``order`` its real tokens' positions in the pattern's order (L,),
    ``real`` (N,) bool, ``valid`` (B|1, H|1, Tq, K) which listed blocks count."""
    blk, a = pattern.block, pattern.neighbours
    width, length = 2 * a + 1, order.shape[0]
    blocks = -(-length // blk)
    neg = torch.tensor(float("-inf"), dtype=dt, device=device)
    zero = torch.zeros((), dtype=dt, device=device)
    shared = None
    if pattern.shared_keys is not None and bool((pattern.shared_keys[bi] & real).any()):
        shared = (pattern.shared_keys[bi] & real).nonzero().squeeze(-1)
    # keys a block may use: real (slot < L) and not shared (the shared keys have their own columns)
    free = torch.zeros(blocks * blk, dtype=torch.bool, device=device)
    free[:length] = True
    if pattern.shared_keys is not None:
        free[:length] &= ~pattern.shared_keys[bi, order]
    key_bias = torch.where(F.pad(free, (a * blk, a * blk)), zero, neg)  # ((blocks + 2a) block,): a blocks each side
    ok = valid[bi if valid.shape[0] > 1 else 0, :, :blocks]  # (Hb, T, K)
    near_bias = key_bias.unfold(0, width * blk, blk)[None] + torch.where(ok[..., :width], zero, neg).repeat_interleave(
        blk, -1
    )  # (Hb, T, width block)
    ids = pattern.kv_blocks[bi if pattern.kv_blocks.shape[0] > 1 else 0, :, :blocks, width:]  # (Hb, T, R)
    ok_listed = ok[..., width:] & (ids < blocks)
    ids = ids.clamp(0, max(blocks - 1, 0))
    block_bias = key_bias[a * blk : (a + blocks) * blk].view(blocks, blk)
    listed_bias = (block_bias[ids] + torch.where(ok_listed, zero, neg)[..., None]).flatten(-2)  # (Hb, T, R block)
    nothing = (near_bias == neg).all(-1) & (listed_bias == neg).all(-1)  # (Hb', T): no key in any block
    # query blocks to run: those with a query that is not global (global rows are dense, written afterwards)
    need = torch.ones(blocks, dtype=torch.bool, device=device)
    if pattern.global_queries is not None:
        glob = torch.ones(blocks * blk, dtype=torch.bool, device=device)
        glob[:length] = pattern.global_queries[bi, order]
        need = ~glob.view(blocks, blk).all(-1)
    at = need.nonzero().squeeze(-1).tolist()
    return _Row(
        near_bias,
        listed_bias,
        _flagged((near_bias == neg).any(-1)),
        _flagged((listed_bias == neg).any(-1)),
        _flagged(nothing) if shared is None else [[] for _ in range(nothing.shape[0])],
        ids,
        (at[0], at[-1] + 1) if at else (0, 0),
        shared,
    )


def attend(q, k, v, pattern, *, key_mask: torch.Tensor | None, scale: float, fused: bool = False) -> torch.Tensor:
    """Softmax attention of q (B, H, N, d) to k, v on ``pattern``'s pairs (a pattern with ``neighbours``; call
    :func:`unusable` first), among the real keys (``key_mask`` (B, N), None: all): (B, H, N, dv) in the compute
    dtype (float32 for half inputs), a view of a (B, N, H, dv) tensor (the layout the attention layer returns).
    ``key_mask`` must be :func:`._common.safe_key_mask`'s (no row without a real key). ``fused``: each batch row's
    query blocks run on the C++ kernel (:func:`_fused_row`, ``csrc/block_band.cpp``) rather than in chunks of plain
    torch; the rest (the row's tables, padded and global queries) is the same."""
    dt = compute_dtype(q.dtype)
    b, h, n, d = q.shape
    dv, dev = v.shape[-1], q.device
    blk, a = pattern.block, pattern.neighbours
    valid = (pattern.kv_blocks >= 0) & (pattern.kv_blocks < math.ceil(n / blk))
    if pattern.kv_valid is not None:
        valid = valid & pattern.kv_valid
    real = torch.ones(b, n, dtype=torch.bool, device=dev) if key_mask is None else key_mask.to(torch.bool)
    lengths = real.sum(-1).tolist()
    out = torch.empty(b, n, h, dv, dtype=dt, device=dev)
    for bi, length in enumerate(lengths):
        if pattern.q_order is None:  # (padding at the end only: unusable checks it)
            order, prefix = torch.arange(length, device=dev), True
        else:
            order = pattern.q_order[bi if pattern.q_order.shape[0] > 1 else 0, 0, :length]
            prefix = bool((order == torch.arange(length, device=dev)).all())  # no padding inside the row
        row = _row_tables(pattern, bi, order, real[bi], valid=valid, dt=dt, device=dev)
        if length < n:  # padded queries: the shared keys only (what the gather kernel gives them for bigbird)
            pad = (~real[bi]).nonzero().squeeze(-1)
            out[bi, pad] = 0.0 if row.shared is None else _dense(q, k, v, bi, pad, row.shared, scale, dt)
        run_row = _fused_row if fused else _plain_row
        run_row(q, k, v, out, bi, row, order, prefix, length, scale=scale, block=blk, neighbours=a, dt=dt)
        if pattern.global_queries is not None:
            glob = (pattern.global_queries[bi] & real[bi]).nonzero().squeeze(-1)
            if glob.numel():  # dense rows to every real key
                out[bi, glob] = _dense(q, k, v, bi, glob, slice(0, length) if prefix else order, scale, dt)
    return out.transpose(1, 2)


def _plain_row(q, k, v, out, bi: int, row: _Row, order, prefix: bool, length: int, *, scale, block, neighbours, dt):
    """Batch row ``bi``'s query blocks [lo, hi) of every head in plain torch, a head and a chunk of query blocks at a
    time (:func:`_chunk`), written into ``out`` (B, N, H, dv)."""
    blk, a, dev = block, neighbours, q.device
    h, d, dv = q.shape[1], q.shape[-1], v.shape[-1]
    blocks = -(-length // blk)
    (lo, hi), g = row.span, 0 if row.shared is None else row.shared.numel()
    # K, V viewed in place: in order, in whole real blocks (a partial one would read padding, which may hold
    # anything), in the compute dtype, and every window of the run inside them; else copied per head
    direct = prefix and k.dtype == v.dtype == dt and length % blk == 0 and lo >= a and (hi + a) * blk <= length
    kv_bufs = (
        None
        if direct
        else tuple(torch.zeros((blocks + 2 * a) * blk, x.shape[-1], dtype=dt, device=dev) for x in (k, v))
    )
    q_direct = prefix and q.dtype == dt and hi * blk <= length
    q_buf = None if q_direct else torch.zeros(blocks * blk, d, dtype=dt, device=dev)
    widths = ((2 * a + 1) * blk, row.ids.shape[-1] * blk, g)  # keys per query: near, listed, shared
    per = max(1, _CHUNK_ELEMENTS // (blk * sum(widths)))
    scratch = _Scratch(min(per, max(1, hi - lo)), blk, widths, d, dv, dtype=dt, device=dev)
    for hh in range(h):
        near, stack, off = _head_keys(
            k[bi, hh], v[bi, hh], kv_bufs, order, prefix, block=blk, neighbours=a, blocks=blocks
        )
        if q_direct:
            qh = q[bi, hh]  # (N, d)
        else:
            _load(q_buf[:length], q[bi, hh], order, prefix)
            qh = q_buf
        shared_kv = None if row.shared is None else (k[bi, hh, row.shared].to(dt), v[bi, hh, row.shared].to(dt))
        rows_out = out[bi, :, hh]  # (N, dv), written in place
        for t0 in range(lo, hi, per):
            t1 = min(hi, t0 + per)
            listed = _gather_listed(stack, _head(row.ids, hh)[t0:t1], scratch)
            fixes = [
                (cols, at, bias[at + t0, None, :])
                for cols, flags, bias in (
                    (slice(0, widths[0]), _head(row.near_flags, hh), _head(row.near_bias, hh)),
                    (
                        slice(widths[0], widths[0] + widths[1]),
                        _head(row.listed_flags, hh),
                        _head(row.listed_bias, hh),
                    ),
                )
                if (at := _in_chunk(flags, t0, t1, dev)) is not None
            ]
            o = _chunk(
                scratch,
                qh[t0 * blk : t1 * blk].view(t1 - t0, blk, d),
                (near[0][t0 + off : t1 + off], near[1][t0 + off : t1 + off]),
                listed,
                shared_kv,
                scale=scale,
                fixes=fixes,
                empty=_in_chunk(_head(row.empty, hh), t0, t1, dev),
            ).view(-1, dv)
            r0, r1 = t0 * blk, min(length, t1 * blk)
            if prefix:
                rows_out[r0:r1] = o[: r1 - r0]
            else:
                rows_out.index_copy_(0, order[r0:r1], o[: r1 - r0])


@functools.cache
def build_fused():
    """The C++ kernel of ``kernel="fused"`` (:func:`._cpp.load`): ``RuntimeError`` when it cannot be built."""
    from . import _cpp

    return _cpp.load("block_band", asked="bigbird: kernel='fused'", instead="kernel='auto' (the default)")


def _fused_row(q, k, v, out, bi: int, row: _Row, order, prefix: bool, length: int, *, scale, block, neighbours, dt):
    """Batch row ``bi``'s query blocks [lo, hi) of every head on the C++ kernel, written into ``out`` (B, N, H, dv):
    the same scores, biases, softmax and products as :func:`_chunk`, a (head, query block) per task."""
    kernel = build_fused()
    (lo, hi), blk, a = row.span, block, neighbours
    if hi <= lo:
        return
    h, dv = q.shape[1], v.shape[-1]
    blocks = -(-length // blk)
    # K, V read in place where every window of the run lies inside the real tokens, already in order, in whole blocks
    direct = prefix and k.dtype == v.dtype == dt and length % blk == 0 and lo >= a and (hi + a) * blk <= length
    if direct:
        kk, vv, offset = k[bi], v[bi], 0
    else:  # the row's tokens in order between a blocks of zeros at each end
        kk, vv = (torch.zeros(h, (blocks + 2 * a) * blk, x.shape[-1], dtype=dt, device=x.device) for x in (k, v))
        for buf, x in ((kk, k[bi]), (vv, v[bi])):
            buf[:, a * blk : a * blk + length] = x[:, :length] if prefix else x[:, order]
        offset = a * blk
    if prefix and q.dtype == dt and hi * blk <= length:
        qq = q[bi]
    else:
        qq = torch.zeros(h, blocks * blk, q.shape[-1], dtype=dt, device=q.device)
        qq[:, :length] = q[bi, :, :length] if prefix else q[bi][:, order]
    if row.shared is None:
        ks, vs = kk[:, :0], vv[:, :0]
    else:
        ks, vs = k[bi][:, row.shared].to(dt), v[bi][:, row.shared].to(dt)
    heads = max(row.near_bias.shape[0], row.listed_bias.shape[0], row.ids.shape[0])
    bias = torch.cat([row.near_bias.expand(heads, -1, -1), row.listed_bias.expand(heads, -1, -1)], -1).contiguous()
    ids = row.ids.expand(heads, -1, -1).long().contiguous()
    # BLAS reads rows through their stride, which must be at least a row long (a broadcast, stride-0 K is not)
    rows = tuple(x if _blas_rows(x) else x.contiguous() for x in (qq, kk, vv, ks, vs))
    if prefix:  # straight into the output's rows, those of the real tokens
        kernel.attend(*rows, ids, bias, out[bi].transpose(0, 1), lo, hi, a, blk, offset, length, float(scale))
    else:  # in the pattern's order, then to each token's own row
        tmp = torch.empty(h, blocks * blk, dv, dtype=dt, device=q.device)
        kernel.attend(*rows, ids, bias, tmp, lo, hi, a, blk, offset, length, float(scale))
        r0, r1 = lo * blk, min(length, hi * blk)
        out[bi].index_copy_(0, order[r0:r1], tmp[:, r0:r1].transpose(0, 1))


def _blas_rows(x: torch.Tensor) -> bool:
    """Whether BLAS can read the rows of ``x`` (.., rows, width) in place: contiguous rows, one after the other (a
    leading dimension of at least the width; rows overlapping or repeated by a stride 0 are not)."""
    width = x.shape[-1]
    rows_ok = x.shape[-2] <= 1 or max(1, width) <= x.stride(-2) <= 2**31 - 1  # (BLAS takes it as an int)
    return (width <= 1 or x.stride(-1) == 1) and rows_ok


def _gather_listed(stack, ids: torch.Tensor, buf: _Scratch):
    """The listed blocks ``ids`` (c, R) of c query blocks, gathered from the head's blocks ``stack`` into ``buf``:
    keys (c, R block, d) and values (c, R block, dv), or (None, None) without listed blocks."""
    c, r = ids.shape
    if r == 0:
        return None, None
    kb, vb = stack
    blk = kb.shape[1]
    keys = torch.index_select(kb, 0, ids.reshape(-1), out=buf.kl[: c * r]).view(c, r * blk, -1)
    values = torch.index_select(vb, 0, ids.reshape(-1), out=buf.vl[: c * r]).view(c, r * blk, -1)
    return keys, values


class _Scratch:
    """The buffers one batch row reuses from chunk to chunk (allocated once per row): all scores side by side, each
    product's scores, the listed blocks' keys and values, the output. ``widths``: keys per query (near, listed,
    shared)."""

    def __init__(self, rows, blk, widths, d, dv, *, dtype, device):
        wk, wl, g = widths
        self.s = torch.empty(rows, blk, wk + wl + g, dtype=dtype, device=device)
        self.near = torch.empty(rows, blk, wk, dtype=dtype, device=device)
        self.listed = torch.empty(rows, blk, wl, dtype=dtype, device=device)
        self.shared = torch.empty(rows * blk, g, dtype=dtype, device=device)
        self.kl = torch.empty(rows * (wl // blk), blk, d, dtype=dtype, device=device)
        self.vl = torch.empty(rows * (wl // blk), blk, dv, dtype=dtype, device=device)
        self.o = torch.empty(rows, blk, dv, dtype=dtype, device=device)


def _chunk(buf: _Scratch, qc, near, listed, shared, *, scale: float, fixes, empty) -> torch.Tensor:
    """The output (c, block, dv) of c query blocks ``qc`` (c, block, d): scores against their neighbouring keys
    ``near`` (keys (c, d, W1) and values (c, W1, dv), views), their listed blocks ``listed`` (keys (c, W2, d), values
    (c, W2, dv); (None, None) without), and the shared keys ``shared`` ((G, d), (G, dv); None without), side by side
    in one buffer; ``fixes``: (columns, blocks of the chunk, bias) added where a key is not allowed; ``empty``: the
    blocks with no allowed key at all (their rows get 0), or None; one softmax in place, three products."""
    c, blk, d = qc.shape
    wk, wl = near[0].shape[-1], 0 if listed[0] is None else listed[0].shape[1]
    s = buf.s[:c]
    s[..., :wk].copy_(torch.baddbmm(buf.near[:c], qc, near[0], beta=0.0, alpha=scale, out=buf.near[:c]))
    if wl:
        x = torch.baddbmm(buf.listed[:c], qc, listed[0].transpose(1, 2), beta=0.0, alpha=scale, out=buf.listed[:c])
        s[..., wk : wk + wl].copy_(x)
    if shared is not None:
        sh = buf.shared[: c * blk]
        x = torch.addmm(sh, qc.reshape(-1, d), shared[0].T, beta=0.0, alpha=scale, out=sh)
        s[..., wk + wl :].copy_(x.view(c, blk, -1))
    for cols, at, bias in fixes:
        s[at, :, cols] += bias
    p = torch.softmax(s, -1, out=s)
    if empty is not None:  # no key at all: 0 (the softmax of -inf alone is NaN)
        p[empty] = 0.0
    o = torch.bmm(p[..., :wk], near[1], out=buf.o[:c])
    if wl:
        o.baddbmm_(p[..., wk : wk + wl], listed[1])
    if shared is not None:
        o.view(-1, o.shape[-1]).addmm_(p[..., wk + wl :].reshape(c * blk, -1), shared[1])
    return o


def _dense(q, k, v, bi, queries, keys, scale, dt) -> torch.Tensor:
    """Dense attention (SDPA) of the queries ``queries`` of batch row ``bi`` to its keys ``keys`` (positions or a
    slice): (G, H, dv), the layout of ``attend``'s output."""
    o = F.scaled_dot_product_attention(
        q[bi : bi + 1, :, queries].to(dt), k[bi : bi + 1, :, keys].to(dt), v[bi : bi + 1, :, keys].to(dt), scale=scale
    )
    return o[0].transpose(0, 1)
