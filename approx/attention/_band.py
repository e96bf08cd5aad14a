"""Attention over a contiguous band of keys (plain torch): the CPU fast path of ``window`` (inference), and its
training form for ``local="band"`` (:func:`attend_with_gradients`, at the end).

Query i attends the keys j with ``|i - j| <= reach``, plus a few *shared* keys every query attends (global tokens).
The keys of a block of ``block`` queries lie in one contiguous slice of ``block + 2 P`` keys (P: the reach rounded up
to whole blocks), so every block's keys and values are **views** of one zero-padded buffer holding a head's K and V
(``Tensor.unfold`` with step ``block``, overlapping windows; the buffer is reused from head to head): one batched
matrix product per chunk of blocks and no gathered copy of the keys per block, which is what makes the generic
gather kernel (:mod:`._blocksparse`) slow. Per chunk:

1. ``S = Q_blocks @ K_windows^T`` into a reused buffer (blocks, block, block + 2P);
2. the band's edges: only the first ``P - reach + block - 1`` and the last ``P - reach + block - 1`` columns hold
   pairs outside the band (the middle columns are within reach of every row of the block), so two thin strips get a
   ``-inf`` bias, not the whole matrix; windows touching padding, a sequence end or a shared key (counted once, in
   its own column) get a key bias too (found beforehand, usually a few blocks per row);
3. the shared keys' scores go into columns of each row that the band masks (every row of a block of two or more
   has at least ``block - 1`` of them), so one fused softmax over the row normalises band and shared keys
   together; their weights are read back from those columns and the columns zeroed before ``P @ V_windows``,
   and the shared values are added as one small product.

Work is O(N (block + 2P) d), memory O(N d) plus one chunk. Queries with no allowed key get 0 (as the gather kernel).
Global *queries* (dense rows) are the caller's: :func:`._blocksparse.attend` replaces those rows afterwards. A float64
softmax written from the window's definition agrees with it to rounding (tests/test_band.py). Measured on the CPU
against SDPA, FlexAttention and the gather kernel on the docs' Speed page.
"""

from __future__ import annotations

import itertools
import math

import torch

from ._common import compute_dtype, zero_padded_values

__all__ = ["attend", "attend_with_gradients", "keys_per_row", "unusable"]

# Largest score chunk, in elements (blocks * block * width): a few MiB, so the strips, softmax and product that
# follow the score product find it in cache
_CHUNK_ELEMENTS = 1 << 20
# The training form's fewest query blocks per chunk (see attend_with_gradients)
MIN_CHUNK_BLOCKS = 8


def _geometry(reach: int, block: int) -> tuple[int, int, int, int]:
    """(P, width, left, right): the padding on each side, the keys per block, and the band's masked strips: columns
    [0, left) and [right, width) hold pairs outside the band for some row; [left, right) none."""
    pad = -(-reach // block) * block
    width = block + 2 * pad
    return pad, width, min(width, pad - reach + block - 1), max(0, pad + reach + 1)


def keys_per_row(n: int, reach: int, block: int) -> int:
    """The keys the kernel scores per query on a sequence of ``n`` (a block's slice of ``block + 2 P``): more than
    ``n`` when the window reaches most of a short sequence."""
    return _geometry(min(reach, max(n - 1, 0)), block)[1]


def masked_columns(reach: int, block: int) -> int:
    """How many columns the band masks in every row of a block (the room for shared keys)."""
    pad, width, _, _ = _geometry(reach, block)
    return width - (2 * reach + 1)


def unusable(q, k, v, *, reach: int, block: int, shared: int, dropout: float) -> str | None:
    """Why the band kernel cannot run this call (None: it can)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return "it is inference only (no gradients)"
    if dropout > 0.0:
        return "it applies no dropout"
    if q.shape[2] != k.shape[2]:
        return "it needs as many queries as keys"
    if block < 2:
        return "it needs blocks of two rows or more"
    room = masked_columns(min(reach, max(q.shape[2] - 1, 0)), block)
    if shared > room:
        return f"{shared} shared keys do not fit the {room} masked columns of a row"
    return None


def _slots(reach: int, block: int, g: int, device) -> torch.Tensor:
    """(block, g): for row r of a block, g columns that the band masks (left of the band first)."""
    pad, width, _, _ = _geometry(reach, block)
    cols = torch.arange(width, device=device)
    r = torch.arange(block, device=device)[:, None]
    outside = (cols - pad - r).abs() > reach  # (block, width)
    order = torch.where(outside, cols, cols + width).argsort(dim=-1, stable=True)
    return order[:, :g]


def _span(flags: torch.Tensor) -> list[tuple[int, int]]:
    """The blocks flagged in ``flags`` (Tq,) bool as at most two ranges [lo, hi): those of the start and of the end
    of the sequence (where the sequence ends and shared keys are), or one range around all of them."""
    at = flags.nonzero()[:, 0].tolist()
    if not at:
        return []
    gaps = [i for i in range(1, len(at)) if at[i] != at[i - 1] + 1]
    if len(gaps) == 1:  # two runs
        return [(at[0], at[gaps[0] - 1] + 1), (at[gaps[0]], at[-1] + 1)]
    return [(at[0], at[-1] + 1)]


def _tables(q, key_mask, shared_keys, *, reach: int, block: int, dt):
    """What every chunk of :func:`attend` reads: the key bias of each block's window (B, Tq, width), the band's bias
    (block, width), the shared keys (left-aligned positions (B, G), their bias (B, 1, G) and their columns in a
    (block * width) row) or None, the rows with no allowed key (B, Tq, block), and per batch row the ranges of
    blocks that need the key bias (``spans``) or rows zeroed (``zeros``)."""
    from ._blocksparse import token_rows  # the shared keys, left-aligned (as the gather kernel takes them)

    b, _, n, _ = q.shape
    dev = q.device
    pad, width, _, _ = _geometry(reach, block)
    tq = math.ceil(n / block)
    npad = tq * block
    # which keys a window may use: real, inside the sequence, not shared (shared keys have their own column)
    real = torch.ones(b, n, dtype=torch.bool, device=dev) if key_mask is None else key_mask.to(torch.bool)
    usable = real if shared_keys is None else real & ~shared_keys[:, :n]
    key_ok = torch.zeros(b, 2 * pad + npad, dtype=torch.bool, device=dev)
    key_ok[:, pad : pad + n] = usable
    windows = key_ok.unfold(1, width, block)  # (B, Tq, width)
    neg = torch.tensor(float("-inf"), dtype=dt, device=dev)
    zero = torch.zeros((), dtype=dt, device=dev)
    key_bias = torch.where(windows, zero, neg)  # (B, Tq, width)
    rows_idx = torch.arange(block, device=dev)[:, None]
    cols = torch.arange(width, device=dev)
    band_bias = torch.where((cols - pad - rows_idx).abs() > reach, neg, zero)  # (block, width)

    shared = None
    real_shared = torch.zeros(b, n, dtype=torch.bool, device=dev)
    if shared_keys is not None:
        real_shared = shared_keys[:, :n] & real
        if bool(real_shared.any()):
            pos, ok = token_rows(real_shared)  # (B, G)
            flat = (_slots(reach, block, pos.shape[1], dev) + rows_idx * width).reshape(-1)  # in a (block * width) row
            shared = pos, torch.where(ok, zero, neg)[:, None, :], flat  # bias (B, 1, G)
    # queries with no allowed key (a window of padding only, and no shared key in their row): output 0
    csum = torch.nn.functional.pad(usable.to(torch.int32).cumsum(-1), (1, 0))  # (B, N + 1)
    i = torch.arange(npad, device=dev)
    lo, hi = (i - reach).clamp(0, n), (i + reach + 1).clamp(0, n)
    empty = (((csum[:, hi] - csum[:, lo]) == 0) & ~real_shared.any(-1, keepdim=True)).view(b, tq, block)
    # the range of blocks of each batch row that need more than the band's strips: a key bias, rows to zero
    spans = [_span(row) for row in ~windows.all(-1)]
    zeros = [_span(row) for row in empty.any(-1)]

    return key_bias, band_bias, shared, empty, spans, zeros


def _within(spans, t0: int, t1: int):
    """The (lo, hi) block ranges of ``spans`` clipped to the chunk's blocks [t0, t1), the empty ones left out."""
    for lo, hi in spans:
        lo, hi = max(lo, t0), min(hi, t1)
        if lo < hi:
            yield lo, hi


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    reach: int,
    block: int,
    key_mask: torch.Tensor | None,
    shared_keys: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Softmax attention of q (B, H, N, d) to the keys within ``reach`` of each query and to the ``shared_keys``
    (B, N) bool (or None), among the real keys (``key_mask`` (B, N), None: all): (B, H, N, dv) in the compute dtype
    (float32 for half inputs), a view of a (B, N, H, dv) tensor (the layout the attention layer returns). Call
    :func:`unusable` first.

    One batch row and one head at a time (several heads side by side when the sequence is short): their keys and
    values are copied into one zero-padded buffer that every head reuses (hot in cache, no large allocation), the
    queries are read and the output written in place (any strides with a unit last stride)."""
    dt = compute_dtype(q.dtype)
    b, h, n, d = q.shape
    dv = v.shape[-1]
    dev = q.device
    reach = min(reach, max(n - 1, 0))  # no pair is farther apart: the same pattern, narrower windows
    v = zero_padded_values(v, key_mask)
    # padded keys are zeroed too, in the buffer (an inf or NaN there would make the -inf bias NaN)
    padded = None if key_mask is None else ~key_mask.to(torch.bool)[:, :, None]
    with_padding = [False] * b if padded is None else padded.flatten(1).any(1).tolist()
    pad, width, left, right = _geometry(reach, block)
    tq = math.ceil(n / block)
    npad = tq * block

    key_bias, band_bias, shared, empty, spans, zeros = _tables(
        q, key_mask, shared_keys, reach=reach, block=block, dt=dt
    )

    out = torch.empty(b, n, h, dv, dtype=dt, device=dev)
    per = max(1, _CHUNK_ELEMENTS // (block * width))  # windows per chunk
    group = max(1, min(h, per // tq))  # heads side by side in the buffers (short sequences: several)
    kbuf = torch.zeros(2 * pad + group * npad, d, dtype=dt, device=dev)
    vbuf = torch.zeros(2 * pad + group * npad, dv, dtype=dt, device=dev)
    qbuf = None if npad == n else torch.zeros(group, npad, d, dtype=dt, device=dev)
    rows = min(per, group * tq)
    sbuf = torch.empty(rows, block, width, dtype=dt, device=dev)
    obuf = torch.empty(rows, block, dv, dtype=dt, device=dev)  # contiguous: MKL's batched product
    for bi, h0 in itertools.product(range(b), range(0, h, group)):
        nh = min(group, h - h0)
        heads = slice(h0, h0 + nh)
        used = 2 * pad + nh * npad
        kb = kbuf[pad : pad + nh * npad].view(nh, npad, d)[:, :n]
        kb.copy_(k[bi, heads])
        if with_padding[bi]:
            kb.masked_fill_(padded[bi], 0.0)
        vbuf[pad : pad + nh * npad].view(nh, npad, dv)[:, :n] = v[bi, heads]
        ku = kbuf[:used].unfold(0, width, block)  # (nh Tq, d, width): views, no copy
        vu = vbuf[:used].unfold(0, width, block).transpose(1, 2)  # (nh Tq, width, dv)
        if qbuf is None:
            qb = q[bi, heads].to(dt).reshape(nh * tq, block, d)
        else:
            qbuf[:nh, :n] = q[bi, heads]
            qb = qbuf[:nh].view(nh * tq, block, d)
        og = out[bi, :, heads].permute(1, 0, 2)  # (nh, N, dv), written in place
        if shared is not None:
            pos, sbias, flat = shared
            sk = kb[:, pos[bi]]  # (nh, G, d)
            sv = v[bi, heads][:, pos[bi]].to(dt)
        # chunks: whole heads (short sequences) or a range of one head's blocks
        step_h, step_t = (max(1, per // tq), tq) if group > 1 else (1, per)
        for a, t0 in itertools.product(range(0, nh, step_h), range(0, tq, step_t)):
            z, t1 = min(nh, a + step_h), min(tq, t0 + step_t)
            c, w0 = (z - a) * (t1 - t0), a * tq + t0
            s = torch.baddbmm(sbuf[:c], qb[w0 : w0 + c], ku[w0 : w0 + c], beta=0.0, alpha=scale, out=sbuf[:c])
            if left >= right:  # narrow windows: the band bias everywhere
                s += band_bias
            else:
                s[..., :left] += band_bias[:, :left]
                s[..., right:] += band_bias[:, right:]
            s4 = s.view(z - a, t1 - t0, block, width)
            for lo, hi in _within(spans[bi], t0, t1):
                s4[:, lo - t0 : hi - t0] += key_bias[bi, lo:hi, None, :]
            if shared is not None:
                # scores of the shared keys, into columns that the band masks in each row
                sc = torch.baddbmm(
                    sbias[bi], qb[w0 : w0 + c].reshape(z - a, -1, d), sk[a:z].transpose(1, 2), alpha=scale
                )
                s.view(c, -1).index_copy_(1, flat, sc.view(c, -1))
            p = torch.softmax(s, -1, out=s)
            for lo, hi in _within(zeros[bi], t0, t1):  # rows without a key: 0 (the softmax of -inf alone is NaN)
                p.view(z - a, t1 - t0, block, width)[:, lo - t0 : hi - t0].masked_fill_(empty[bi, lo:hi, :, None], 0.0)
            if shared is not None:
                ps = p.view(c, -1).index_select(1, flat).view(z - a, -1, pos.shape[1])  # the shared keys' weights
                p.view(c, -1).index_fill_(1, flat, 0.0)
                o = torch.baddbmm(torch.bmm(ps, sv[a:z]).view(c, block, dv), p, vu[w0 : w0 + c], out=obuf[:c])
            else:
                o = torch.bmm(p, vu[w0 : w0 + c], out=obuf[:c])
            r0, r1 = t0 * block, min(n, t1 * block)
            og[a:z, r0:r1] = o.view(z - a, (t1 - t0) * block, dv)[:, : r1 - r0]
    return out.transpose(1, 2)


# ------------------------------------------------------------------------------------------- with gradients


class _Slabs(torch.autograd.Function):
    """Copies of the row ranges ``spans`` ((start, length), ...; they may overlap) of x (B, H, L, d) along dim 2,
    whose one backward adds their gradients into one gradient of x: O(L d) in all. Slicing x per chunk instead
    gives every slice a backward that allocates a gradient of x's whole size: O(L d) per chunk."""

    @staticmethod
    def forward(ctx, x, spans):
        ctx.shape, ctx.spans = x.shape, spans
        return tuple(x[:, :, s : s + length].clone() for s, length in spans)

    @staticmethod
    def backward(ctx, *grads):
        out = grads[0].new_zeros(ctx.shape)
        for (s, length), g in zip(ctx.spans, grads, strict=True):
            out[:, :, s : s + length] += g
        return out, None


def _band_rows(q, k, v, ok, band, block: int, width: int, scale: float, dropout: float):
    """The output rows (B, H, c block, dv) of a chunk of c query blocks ``q`` (B, H, c block, d), from its slab of
    the padded keys and values (B, H, (c - 1) block + width, d) and which of them are real (B, ...): each block's
    window as a view of the slab (``Tensor.unfold``, overlapping; its backward adds the overlaps up), scores, a
    softmax over the pairs the ``band`` (block, width) allows among the real keys (a row with none gives 0),
    dropout, the product. Plain differentiable torch."""
    c = q.shape[2] // block
    qb = q.unflatten(2, (c, block))  # (B, H, c, block, d)
    ku, vu = k.unfold(2, width, block), v.unfold(2, width, block)  # (B, H, c, d | dv, width)
    allowed = ok[:, None].unfold(2, width, block)[:, :, :, None, :] & band  # (B, 1, c, block, width)
    s = torch.matmul(qb, ku) * scale
    s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)  # finite: a row with no allowed key has no NaN gradient
    p = torch.softmax(s, -1) * allowed  # (that row: uniform over nothing allowed, then 0)
    if dropout > 0.0:
        p = torch.nn.functional.dropout(p, dropout)
    return torch.matmul(p, vu.transpose(-1, -2)).flatten(2, 3)


def attend_with_gradients(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, reach: int, block: int, key_mask: torch.Tensor | None,
    scale: float, dropout: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """What :func:`attend` computes without shared keys, for training: differentiable, with attention dropout (on
    the weights, scaled by 1 / (1 - p), as transformers' functions apply it), in the compute dtype (B, H, N, dv).

    The queries go in chunks of blocks, each under activation checkpointing (``torch.utils.checkpoint``,
    non-reentrant, the random state kept so a chunk's dropout is drawn again the same), on copies of its queries
    and of its slab of keys and values (:class:`_Slabs`: the queries' N d, the keys' and values' N d times
    1 + (width - block) / (a chunk's rows), at most 1.25 with chunks of at least :data:`MIN_CHUNK_BLOCKS` blocks and
    margins P <= block): autograd keeps those and each chunk's output, and recomputes a chunk's scores when its
    gradient is needed (without gradients: plain views, nothing kept). So the memory is O(N d) plus one chunk,
    where autograd through the scores would keep O(N w) per head, more than SDPA's own backward on the dense band
    mask keeps on the CPU (its flash kernel saves the log-sum-exp only); the time is O(N w d)."""
    from torch.utils.checkpoint import checkpoint

    dt = compute_dtype(q.dtype)
    b, h, n, _ = q.shape
    reach = min(reach, max(n - 1, 0))
    pad, width, _, _ = _geometry(reach, block)
    tq = math.ceil(n / block)
    tail = tq * block - n
    real = torch.ones(b, n, dtype=torch.bool, device=q.device) if key_mask is None else key_mask.to(torch.bool)
    v = zero_padded_values(v.to(dt), real)  # (a padded key's value never reaches a real row: no inf * 0)
    qp = torch.nn.functional.pad(q.to(dt), (0, 0, 0, tail))
    kp = torch.nn.functional.pad(k.to(dt), (0, 0, pad, pad + tail))  # window of block t: [t block - P, ... + width)
    vp = torch.nn.functional.pad(v, (0, 0, pad, pad + tail))
    ok = torch.nn.functional.pad(real, (pad, pad + tail))
    rows, cols = torch.arange(block, device=q.device)[:, None], torch.arange(width, device=q.device)
    band = (rows + pad - cols).abs() <= reach  # (block, width): the same for every block
    # blocks per chunk: at least MIN_CHUNK_BLOCKS, so that a chunk's slab of keys and values (its blocks and the
    # windows' margins, width - block rows) is not much more than its queries' rows (with one block: 3 times)
    per = max(MIN_CHUNK_BLOCKS, _CHUNK_ELEMENTS // max(1, b * h * block * width))
    bounds = [(t0, min(tq, t0 + per)) for t0 in range(0, tq, per)]  # (the last chunk may be shorter)
    queries = [(t0 * block, (t1 - t0) * block) for t0, t1 in bounds]  # (start, rows) of each chunk
    slabs = [(t0 * block, (t1 - t0 - 1) * block + width) for t0, t1 in bounds]
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):  # nothing to keep: plain views
        outs = [
            _band_rows(qp[:, :, r : r + m], kp[:, :, s : s + length], vp[:, :, s : s + length],
                       ok[:, s : s + length], band, block, width, scale, dropout)
            for (r, m), (s, length) in zip(queries, slabs, strict=True)
        ]  # fmt: skip
        return torch.cat(outs, 2)[:, :, :n]
    qs, ks, vs = _Slabs.apply(qp, queries), _Slabs.apply(kp, slabs), _Slabs.apply(vp, slabs)
    outs = [
        checkpoint(
            _band_rows, qc, kc, vc, ok[:, s : s + length], band, block, width, scale, dropout, use_reentrant=False
        )
        for qc, kc, vc, (s, length) in zip(qs, ks, vs, slabs, strict=True)
    ]
    return torch.cat(outs, 2)[:, :, :n]
