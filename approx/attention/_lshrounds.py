"""LSH's rounds in inference on the CPU (no gradient, no dropout), on buffers allocated once per call: the eager fast
path of ``lsh`` (plain torch).

The same computation as :func:`.lsh.attend_rounds` (which keeps every step differentiable): per round, queries,
keys and values are gathered into the round's sorted order, each query cluster meets its key cluster in one batched
(c x c) product, the pairs an earlier round found are masked, and the round's softmax is merged into the rounds
before it through the log-sum-exps. Both paths take the flat tables and each round's layout (sorted slots, key
rows, masks) from :func:`tables` and :func:`layout`. What differs is where the numbers live:

* a chunk's sorted queries, and the keys and values of each of its query clusters' key cluster, are gathered
  straight from the flat tables into three chunk-sized buffers reused by every chunk and round
  (``index_select(out=)``), just before the chunk's product reads them: gathering a whole round into three
  (B H N, d) buffers, fresh at every call, cost a page fault per 4 KiB of them and left the rows out of the cache by
  the time their chunk ran;
* a round's scores are computed a chunk of clusters at a time into reused (blocks, c, c) buffers (scores, the
  distances that find the pairs to drop, probabilities: 2 MiB each in float32, so that the masking, softmax and the
  product with the values that follow find them in cache), with the softmax scale and the pairs to drop folded into
  the product (``baddbmm``: the pairs are found with a few vectorised float operations on the cluster numbers, not
  boolean masks) and the exponentials taken by ``torch.softmax``;
* each chunk's output is merged into the running output right away: the rows it holds are read (their original
  positions), merged and written back, so no per-round (B, H, N, dv) output is made, concatenated or scattered.
  Query slots past the end of a row (the last cluster filled up) write to one spare row.

A fresh large tensor per call, per round or per chunk costs more than its arithmetic on the CPU (page faults): at
N = 16384 (4 rounds of 128, 2 CPU cores; torch.profiler, one call) the differentiable loop spent about 60 ms
concatenating its chunks' outputs and 65 ms scattering each round back. Side by side (one-off, no gradients), this
path was 1.35x faster than the loop at N = 4096 and 1.68x at 16384, then with the same output to the bit (1.10x and
1.47-1.52x when it still gathered whole rounds); dropping pairs by arithmetic made it another 1.17-1.34x faster, and
its output now differs from the loop's by rounding (about 1e-6 relative in float32). When a key cluster other than
cluster t serves query cluster t (fewer real keys than queries), each round also copies the small per-key masks and
cluster ids into query cluster order. tests/test_lsh.py checks this path and the differentiable one against a loop reference from the
papers' definition; the docs' Speed page has the measurements.
"""

from __future__ import annotations

import dataclasses

import torch

from ._common import compute_dtype, safe_key_mask, zero_padded_values

__all__ = ["Layout", "Tables", "attend", "id_dtype", "layout", "tables", "usable"]

# Largest score chunk of a round, in elements (blocks * c * c): 2 MiB in float32. One-off timings of the whole call,
# 4 rounds of 128, 2 CPU cores, side by side: N = 4096: 2^17 181 ms, 2^18 167, 2^19 159, 2^20 148, 2^21 154;
# N = 16384: 809, 718, 667, 690, 706
_CHUNK_ELEMENTS = 1 << 19


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout: float) -> bool:
    """Whether this path runs the call: on the CPU (its chunks are sized for a CPU's cache; on a GPU, where it was not
    measured, the differentiable loop's fewer and larger launches stay), with no attention dropout and no gradient to
    track."""
    tracked = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return q.device.type == "cpu" and dropout == 0.0 and not tracked


@dataclasses.dataclass
class Tables:
    """A call's shapes and its queries, keys and values as flat row tables (both eager paths of LSH): ``qf``
    (B H N, d), ``kf`` (B H S, d) and ``vf`` (B H S, dv, padded values zeroed) in the compute dtype ``dt``; ``q_base``,
    ``k_base`` (B H, 1) the first row of each (batch, head); ``blocks`` (B H Tq) the key cluster each query cluster
    meets in the (B H Tk) list, None when query cluster t meets key cluster t; ``real`` (B H, S) the real keys (None:
    every key)."""

    b: int
    h: int
    n: int
    s: int
    blk: int
    tq: int
    tk: int
    dt: torch.dtype
    qf: torch.Tensor
    kf: torch.Tensor
    vf: torch.Tensor
    q_base: torch.Tensor
    k_base: torch.Tensor
    blocks: torch.Tensor | None
    real: torch.Tensor | None

    def key_side(self, per_key: torch.Tensor) -> torch.Tensor:
        """(B H Tk, ...) per key cluster -> (B H Tq, ...): every query cluster's key cluster."""
        return per_key if self.blocks is None else per_key.index_select(0, self.blocks)


def tables(q, k, v, hashed, key_mask) -> Tables:
    """:class:`Tables` of a call; ``key_mask`` as :func:`~._common.safe_key_mask` returns it (one without padding, as
    a model passes for unpadded batches, is taken as None: no copies of the keys and values)."""
    if key_mask is not None and bool(key_mask.all()):
        key_mask = None
    dt = compute_dtype(q.dtype)
    b, h, n, d = q.shape
    s, dv, blk = k.shape[2], v.shape[-1], hashed.block
    tq, tk = -(-n // blk), -(-s // blk)
    bh, dev = b * h, q.device
    qf = q.to(dt).reshape(bh * n, d)
    # padded keys zeroed too: their scores are lowered by a finite amount (_softmax_chunk), which an inf or NaN (or a
    # score near that amount) in a padded key would defeat
    kf = zero_padded_values(k.to(dt), key_mask).reshape(bh * s, d)
    vf = zero_padded_values(v.to(dt), key_mask).reshape(bh * s, dv)
    q_base = (torch.arange(bh, device=dev) * n)[:, None]
    k_base = (torch.arange(bh, device=dev) * s)[:, None]
    kv = hashed.kv.view(b, 1, tq).expand(b, h, tq).reshape(bh, tq)  # each query cluster's key cluster
    blocks = None
    if not (tq == tk and bool((kv == torch.arange(tq, device=dev)).all())):
        blocks = (kv + (torch.arange(bh, device=dev) * tk)[:, None]).reshape(-1)
    real = None if key_mask is None else key_mask[:, None, :].expand(b, h, s).reshape(bh, s)
    return Tables(b, h, n, s, blk, tq, tk, dt, qf, kf, vf, q_base, k_base, blocks, real)


@dataclasses.dataclass
class Layout:
    """Round r of a call, per query cluster (X = B H Tq of them, c slots each; both eager paths): ``qpos`` (B H, Tq c)
    the original position of each sorted query slot (slots past the end of a row repeat its last query) and
    ``qrows`` (X c) its row in the flat query table; ``krows`` (X c) the rows of each query cluster's key cluster in
    the flat key table; ``bad`` (X, 1, c) the keys a query cluster may not use (past the end, padding; ``any_bad``:
    whether there is one); ``pairs``: per earlier round, (query target (X, c, 1), key cluster (X, 1, c)), equal where
    that round found the pair."""

    qpos: torch.Tensor
    qrows: torch.Tensor
    krows: torch.Tensor
    bad: torch.Tensor
    any_bad: bool
    pairs: list[tuple[torch.Tensor, torch.Tensor]]


def layout(t: Tables, hashed, r: int) -> Layout:
    """:class:`Layout` of round ``r`` of ``hashed`` (:class:`.lsh.Hashed`)."""
    bh, blk, dev = t.b * t.h, t.blk, t.qf.device
    x = bh * t.tq
    qpos = _slots(hashed.q_order[r].reshape(bh, t.n), t.tq * blk)  # (B H, Tq c)
    kpos = _slots(hashed.k_order[r].reshape(bh, t.s), t.tk * blk)  # (B H, Tk c)
    krows = t.key_side((kpos + t.k_base).view(bh * t.tk, blk)).reshape(-1)
    bad = (torch.arange(t.tk * blk, device=dev) >= t.s).expand(bh, -1)  # keys past the end, padding
    if t.real is not None:
        bad = bad | ~t.real.gather(1, kpos)
    bad = t.key_side(bad.reshape(bh * t.tk, 1, blk))
    pairs = [  # an earlier round found a pair where its query target equals the key's cluster
        (
            hashed.target[e].reshape(bh, t.n).gather(1, qpos).view(x, blk, 1),
            t.key_side(hashed.k_cluster[e].reshape(bh, t.s).gather(1, kpos).view(bh * t.tk, 1, blk)),
        )
        for e in range(r)
    ]
    return Layout(qpos, (qpos + t.q_base).reshape(-1), krows, bad, bool(bad.any()), pairs)


class _Scratch:
    """A chunk's reused buffers: scores (P, c, c), the distances that find the pairs to drop, the probabilities, the
    row maxima and log-sum-exps, the output (P, c, dv), the running output's rows it merges with, and the gathered
    queries, keys and values."""

    def __init__(self, per: int, blk: int, d: int, dv: int, dt: torch.dtype, dev: torch.device) -> None:
        self.scores = torch.empty(per, blk, blk, dtype=dt, device=dev)
        self.gap = torch.empty(per, blk, blk, dtype=dt, device=dev)
        self.prob = torch.empty(per, blk, blk, dtype=dt, device=dev)
        self.top = torch.empty(per, blk, 1, dtype=dt, device=dev)
        self.lse = torch.empty(per, blk, 1, dtype=dt, device=dev)
        self.out = torch.empty(per, blk, dv, dtype=dt, device=dev)
        self.prev = torch.empty(per * blk, dv, dtype=dt, device=dev)
        self.prev_lse = torch.empty(per * blk, dtype=dt, device=dev)
        self.qs = torch.empty(per * blk, d, dtype=dt, device=dev)
        self.ks = torch.empty(per * blk, d, dtype=dt, device=dev)
        self.vs = torch.empty(per * blk, dv, dtype=dt, device=dev)
        # a dropped pair's score is lowered by this much (_softmax_chunk): its exponential is 0 beside a pair kept
        self.drop = torch.finfo(dt).max / 8


def id_dtype(dt: torch.dtype, clusters: int) -> torch.dtype:
    """The floating dtype in which :func:`_softmax_chunk` compares cluster numbers 0 .. ``clusters`` - 1: the compute
    dtype ``dt`` while it holds them all exactly (below 2^24 in float32), float64 beyond."""
    return dt if clusters <= 2 / torch.finfo(dt).eps else torch.float64


def _slots(order: torch.Tensor, slots: int) -> torch.Tensor:
    """(B H, L) sorted positions -> (B H, slots): slots past the end repeat the last position."""
    extra = slots - order.shape[1]
    return torch.nn.functional.pad(order, (0, extra), mode="replicate") if extra > 0 else order


def _softmax_chunk(
    w: _Scratch, qs, ks, vs, kept, pairs: list, scale: float, p: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Query clusters ``qs`` (P, c, d) against their key clusters ``ks`` (P, c, d): the softmax over the pairs left,
    normalised, (P c, dv), with its log-sum-exp (P c). A row with no pair left (a later round's, every pair found
    before; round 0 always has one, a real key in every cluster a query meets) gives a log-sum-exp about
    ``-drop``, which :func:`_merge` weighs at exactly 0 beside the finite one of round 0. Dropped: the keys that
    ``kept`` (P, 1, c) has at 0 rather than 1 (None: none; padded keys are zeroed in the key table, so their scores
    are finite), and the ``pairs`` of earlier rounds, (query target (P, c, 1), key cluster (P, 1, c)) per round as
    floats (:func:`id_dtype`), equal where that round found the pair.

    The drops are found with arithmetic rather than boolean masks (a broadcast ``eq`` per earlier round, their
    ``or`` and a ``masked_fill`` took 142 ms of a 671 ms call under torch.profiler at N = 16384 with 4 rounds of
    128, the two products 187 ms; these float operations take about 25 ms): the smallest of the rounds' |target -
    cluster| and ``kept`` is 0 exactly where a pair is dropped and at least 1 elsewhere (cluster numbers are small
    integers, exact in floating point), so ``min(gap - 1, 0)`` is -1 or 0, and the product adds it times
    :attr:`_Scratch.drop` to the scores. ``torch.softmax`` then exponentiates in one vectorised pass (faster than
    ``exp`` and a sum), and the log-sum-exp is the row maximum minus the log of the largest probability."""
    sc = w.scores[:p]
    if pairs:
        target, cluster = pairs[0]
        torch.sub(target, cluster, out=sc).abs_()
        for target, cluster in pairs[1:]:
            torch.minimum(sc, torch.sub(target, cluster, out=w.gap[:p]).abs_(), out=sc)
        if kept is not None:
            torch.minimum(sc, kept, out=sc)
        sc.sub_(1.0).clamp_(max=0.0)
    elif kept is not None:
        torch.sub(kept.expand_as(sc), 1.0, out=sc)
    drop = w.drop if pairs or kept is not None else 0.0  # beta = 0: the buffer's old contents are ignored
    sc.baddbmm_(qs, ks.mT, beta=drop, alpha=scale)
    top = torch.amax(sc, -1, keepdim=True, out=w.top[:p])
    prob = torch.softmax(sc, -1, out=w.prob[:p])
    lse = torch.amax(prob, -1, keepdim=True, out=w.lse[:p]).log_().neg_().add_(top)
    out = torch.bmm(prob, vs, out=w.out[:p])
    return out.view(-1, out.shape[-1]), lse.view(-1)


def _merge(out, lse, rows, o, o_lse, w: _Scratch, first: bool) -> None:
    """Merge a chunk's softmax (``o`` (M, dv), ``o_lse`` (M,)) into the running ``out``/``lse`` at ``rows``."""
    if first:
        out.index_copy_(0, rows, o)
        lse.index_copy_(0, rows, o_lse)
        return
    m = rows.shape[0]
    prev = torch.index_select(out, 0, rows, out=w.prev[:m])
    prev_lse = torch.index_select(lse, 0, rows, out=w.prev_lse[:m])
    total = torch.logaddexp(prev_lse, o_lse)
    finite = total.masked_fill(torch.isinf(total), 0.0)  # guards a -inf in both (rows here always have a pair)
    prev.mul_((prev_lse - finite).exp_()[:, None]).addcmul_(o, (o_lse - finite).exp_()[:, None])
    out.index_copy_(0, rows, prev)
    lse.index_copy_(0, rows, total)


def attend(q, k, v, hashed, *, key_mask, scale: float) -> torch.Tensor:
    """The rounds of ``hashed`` (:class:`.lsh.Hashed`) merged: (B, H, N, dv) in v's dtype, as
    :func:`.lsh.attend_rounds` computes it, without gradients (nor forward-mode dual tensors or ``torch.func``
    transforms: the buffers are written in place)."""
    t = tables(q, k, v, hashed, safe_key_mask(key_mask))
    bh, n, blk, dt = t.b * t.h, t.n, t.blk, t.dt
    d, dv, dev = q.shape[-1], v.shape[-1], q.device
    x = bh * t.tq  # query clusters, one key cluster each
    out = torch.empty(bh * n + 1, dv, dtype=dt, device=dev)  # the rounds so far, and a spare last row (below)
    lse = torch.empty(bh * n + 1, dtype=dt, device=dev)
    per = max(1, _CHUNK_ELEMENTS // (blk * blk))
    work = _Scratch(min(per, x), blk, d, dv, dt, dev)
    # query slots past the end of a row repeat its last query (same keys, same value): they write to the spare row,
    # so that no real row is written twice
    slot_real = torch.arange(t.tq * blk, device=dev) < n
    ids = id_dtype(dt, t.tk)
    for r in range(hashed.q_order.shape[0]):
        lay = layout(t, hashed, r)
        dest = torch.where(slot_real, lay.qpos + t.q_base, bh * n).reshape(-1)  # original row of each query slot
        kept = (~lay.bad).to(dt) if lay.any_bad else None  # 1: a key the cluster may use, 0: past the end, padding
        pairs = [(target.to(ids), cluster.to(ids)) for target, cluster in lay.pairs]
        for c0 in range(0, x, per):
            c1 = min(x, c0 + per)
            m = (c1 - c0) * blk
            qs = torch.index_select(t.qf, 0, lay.qrows[c0 * blk : c1 * blk], out=work.qs[:m])
            ks = torch.index_select(t.kf, 0, lay.krows[c0 * blk : c1 * blk], out=work.ks[:m])
            vs = torch.index_select(t.vf, 0, lay.krows[c0 * blk : c1 * blk], out=work.vs[:m])
            o, o_lse = _softmax_chunk(
                work,
                qs.view(-1, blk, d),
                ks.view(-1, blk, d),
                vs.view(-1, blk, dv),
                None if kept is None else kept[c0:c1],
                [(target[c0:c1], cluster[c0:c1]) for target, cluster in pairs],
                scale,
                c1 - c0,
            )
            _merge(out, lse, dest[c0 * blk : c1 * blk], o, o_lse, work, first=r == 0)
    return out[: bh * n].view(t.b, t.h, n, dv).to(v.dtype)
