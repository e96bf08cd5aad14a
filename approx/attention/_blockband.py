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

Query blocks made only of global queries are skipped: global queries' rows are dense attention to every real key
(SDPA), written afterwards. Padded queries attend the shared keys only (0 without any), as in the gather kernel.
Work O(N ((2a + 1 + R) block + G) d), memory O(N d) plus one chunk. Every buffer is allocated once per call: a fresh
large tensor per chunk costs more than its product on the CPU (page faults). tests/test_blockband.py compares it with
a float64 softmax from BigBird's definition and with the gather kernel; the docs' Speed page has the measurements.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._common import compute_dtype

__all__ = ["attend", "unusable"]

# Largest score chunk, in elements (blocks * block * keys): 2 MiB in float32, so that the softmax and the products
# that follow the score products find it in cache (BigBird at N = 4096 on 2 CPU cores, one-off timing: 2^19 and
# 2^20 elements within noise of each other, 2^18 and 2^21 slower, 2^16 1.4x slower)
_CHUNK_ELEMENTS = 1 << 19


def unusable(q, k, v, pattern, *, dropout: float, with_lse: bool) -> str | None:
    """Why this kernel cannot run this call (None: it can)."""
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
    return None


def _load(dst: torch.Tensor, src: torch.Tensor, order: torch.Tensor, prefix: bool) -> None:
    """``dst`` (L, d) = the rows ``order`` of ``src`` (N, d), cast to ``dst``'s dtype (``prefix``: the first L)."""
    if prefix:
        dst.copy_(src[: dst.shape[0]])
    elif src.dtype == dst.dtype:
        torch.index_select(src, 0, order, out=dst)
    else:
        dst.copy_(src[order])


def _row_order(pattern, bi: int, length: int, device) -> tuple[torch.Tensor, bool]:
    """The positions of batch row ``bi``'s real tokens in the pattern's order (L,), and whether they are the first L
    positions in order (no padding inside the row)."""
    if pattern.q_order is None:
        return torch.arange(length, device=device), True
    order = pattern.q_order[bi if pattern.q_order.shape[0] > 1 else 0, 0, :length]
    return order, bool((order == torch.arange(length, device=device)).all())


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


def _row_tables(pattern, bi: int, order, length: int, *, valid, dt, device):
    """What every head of batch row ``bi`` reads: the bias of each query block's neighbouring and listed keys,
    which blocks need it, which have no key at all, the listed block ids, and the range of query blocks to run."""
    blk, a = pattern.block, pattern.neighbours
    width = 2 * a + 1
    tqb = -(-length // blk)
    neg = torch.tensor(float("-inf"), dtype=dt, device=device)
    zero = torch.zeros((), dtype=dt, device=device)
    # keys a block may use: real (slot < L) and not shared (the shared keys have their own columns)
    free = torch.zeros(tqb * blk, dtype=torch.bool, device=device)
    free[:length] = True
    if pattern.shared_keys is not None:
        free[:length] &= ~pattern.shared_keys[bi, order]
    padded = F.pad(free, (a * blk, a * blk))
    key_bias = torch.where(padded, zero, neg)  # (tqb + 2a) blk
    sel = bi if valid.shape[0] > 1 else 0
    ok = valid[sel, :, :tqb]  # (Hb, tqb, K)
    win_bias = key_bias.unfold(0, width * blk, blk)[None] + torch.where(ok[..., :width], zero, neg).repeat_interleave(
        blk, -1
    )  # (Hb, tqb, width blk)
    ids = pattern.kv_blocks[sel if pattern.kv_blocks.shape[0] > 1 else 0, :, :tqb, width:]
    ok_listed = ok[..., width:] & (ids < tqb)
    ids = ids.clamp(0, max(tqb - 1, 0))
    listed_bias = (
        key_bias[a * blk : a * blk + tqb * blk].view(tqb, blk)[ids] + torch.where(ok_listed, zero, neg)[..., None]
    ).flatten(-2)  # (Hb, tqb, R blk)
    win_flag, listed_flag = (win_bias == neg).any(-1), (listed_bias == neg).any(-1)
    nothing = (win_bias == neg).all(-1) & (listed_bias == neg).all(-1)  # (Hb', tqb): no block key at all
    # query blocks to run: those with a query that is not global (global rows are dense, written afterwards)
    need = torch.ones(tqb, dtype=torch.bool, device=device)
    if pattern.global_queries is not None:
        glob = torch.ones(tqb * blk, dtype=torch.bool, device=device)
        glob[:length] = pattern.global_queries[bi, order]
        need = ~glob.view(tqb, blk).all(-1)
    at = need.nonzero().squeeze(-1).tolist()
    span = (at[0], at[-1] + 1) if at else (0, 0)
    return win_bias, listed_bias, _flagged(win_flag), _flagged(listed_flag), nothing, ids, span


def attend(q, k, v, pattern, *, key_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Softmax attention of q (B, H, N, d) to k, v on ``pattern``'s pairs (a pattern with ``neighbours``; call
    :func:`unusable` first), among the real keys (``key_mask`` (B, N), None: all): (B, H, N, dv) in the compute
    dtype (float32 for half inputs), a view of a (B, N, H, dv) tensor (the layout the attention layer returns).
    ``key_mask`` must be :func:`._common.safe_key_mask`'s (no row without a real key)."""
    dt = compute_dtype(q.dtype)
    b, h, n, d = q.shape
    dv = v.shape[-1]
    dev = q.device
    blk, a = pattern.block, pattern.neighbours
    width = 2 * a + 1
    tq = math.ceil(n / blk)
    kvb = pattern.kv_blocks
    listed = kvb.shape[-1] - width
    valid = (kvb >= 0) & (kvb < tq)
    if pattern.kv_valid is not None:
        valid = valid & pattern.kv_valid
    real = torch.ones(b, n, dtype=torch.bool, device=dev) if key_mask is None else key_mask.to(torch.bool)
    lengths = real.sum(-1).tolist()
    out = torch.empty(b, n, h, dv, dtype=dt, device=dev)
    for bi in range(b):
        length = lengths[bi]
        tqb = -(-length // blk)
        order, prefix = _row_order(pattern, bi, length, dev)
        win_bias, listed_bias, win_flags, listed_flags, nothing, ids, (lo, hi) = _row_tables(
            pattern, bi, order, length, valid=valid.expand(-1, -1, tq, -1), dt=dt, device=dev
        )
        shared = None
        if pattern.shared_keys is not None and bool((pattern.shared_keys[bi] & real[bi]).any()):
            shared = (pattern.shared_keys[bi] & real[bi]).nonzero().squeeze(-1)
        g = 0 if shared is None else shared.numel()
        if length < n:  # padded queries: the shared keys only, as the gather kernel and the dense path give them
            pad = (~real[bi]).nonzero().squeeze(-1)
            if g:
                out[bi, pad] = _dense(q, k, v, bi, pad, shared, scale, dt)
            else:
                out[bi, pad] = 0.0
        empty = _flagged(nothing) if g == 0 else [[] for _ in range(nothing.shape[0])]
        # neighbours viewed in place: K, V in order, the right dtype, every window of the run inside the real blocks
        # (whole blocks only: a partial block would read padding, which may hold anything)
        direct = prefix and k.dtype == v.dtype == dt and length % blk == 0 and lo >= a and (hi + a) * blk <= length
        wk = width * blk
        wl = listed * blk
        per = max(1, _CHUNK_ELEMENTS // (blk * (wk + wl + g)))
        rows = min(per, max(1, hi - lo))
        scratch = _Scratch(rows, blk, (wk, wl, g), d, dv, listed, dtype=dt, device=dev)
        kv_bufs = None
        if not direct:
            kv_bufs = tuple(torch.zeros((tqb + 2 * a) * blk, x.shape[-1], dtype=dt, device=dev) for x in (k, v))
        qdirect = prefix and q.dtype == dt and hi * blk <= length
        qbuf = None if qdirect else torch.zeros(tqb * blk, d, dtype=dt, device=dev)
        for hh in range(h):
            (ku, vu), (kblocks, vblocks), off = _head_keys(
                k[bi, hh], v[bi, hh], kv_bufs, order, prefix, block=blk, neighbours=a, blocks=tqb
            )
            if qdirect:
                qh = q[bi, hh]
            else:
                _load(qbuf[:length], q[bi, hh], order, prefix)
                qh = qbuf
            shared_kv = (k[bi, hh, shared].to(dt), v[bi, hh, shared].to(dt)) if g else None
            og = out[bi, :, hh]  # (N, dv), written in place
            hw, hl = (hh if win_bias.shape[0] > 1 else 0), (hh if listed_bias.shape[0] > 1 else 0)
            he = hh if nothing.shape[0] > 1 else 0
            for t0 in range(lo, hi, per):
                t1 = min(hi, t0 + per)
                c = t1 - t0
                kr = vr = None
                if listed:
                    pick = ids[hh if ids.shape[0] > 1 else 0, t0:t1].reshape(-1)
                    kr = torch.index_select(kblocks, 0, pick, out=scratch.kl[: c * listed]).view(c, wl, d)
                    vr = torch.index_select(vblocks, 0, pick, out=scratch.vl[: c * listed]).view(c, wl, dv)
                fixes = (
                    (slice(0, wk), _in_chunk(win_flags[hw], t0, t1, dev), win_bias[hw]),
                    (slice(wk, wk + wl), _in_chunk(listed_flags[hl], t0, t1, dev), listed_bias[hl]),
                )
                o = _chunk(
                    scratch,
                    qh[t0 * blk : t1 * blk].view(c, blk, d),
                    (ku[t0 + off : t1 + off], vu[t0 + off : t1 + off]),
                    (kr, vr),
                    shared_kv,
                    scale=scale,
                    fixes=[(cols, at, bias[at + t0, None, :]) for cols, at, bias in fixes if at is not None],
                    empty=_in_chunk(empty[he], t0, t1, dev),
                ).view(-1, dv)
                r0, r1 = t0 * blk, min(length, t1 * blk)
                if prefix:
                    og[r0:r1] = o[: r1 - r0]
                else:
                    og.index_copy_(0, order[r0:r1], o[: r1 - r0])
        if pattern.global_queries is not None:
            _global_rows(q, k, v, bi, pattern.global_queries[bi] & real[bi], order, prefix, length, scale, out, dt)
    return out.transpose(1, 2)


class _Scratch:
    """The buffers one batch row reuses from chunk to chunk: all scores side by side, each product's scores, the
    listed blocks' keys and values, the output."""

    def __init__(self, rows, blk, widths, d, dv, listed, *, dtype, device):
        wk, wl, g = widths
        self.s = torch.empty(rows, blk, wk + wl + g, dtype=dtype, device=device)
        self.near = torch.empty(rows, blk, wk, dtype=dtype, device=device)
        self.listed = torch.empty(rows, blk, wl, dtype=dtype, device=device)
        self.shared = torch.empty(rows * blk, g, dtype=dtype, device=device)
        self.kl = torch.empty(rows * listed, blk, d, dtype=dtype, device=device)
        self.vl = torch.empty(rows * listed, blk, dv, dtype=dtype, device=device)
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


def _global_rows(q, k, v, bi, glob, order, prefix, length, scale, out, dt):
    """Rows of the global queries of batch row ``bi``: dense attention to every real key, into ``out``."""
    pos = glob.nonzero().squeeze(-1)
    if pos.numel():
        out[bi, pos] = _dense(q, k, v, bi, pos, slice(0, length) if prefix else order, scale, dt)
