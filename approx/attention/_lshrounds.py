"""LSH's rounds in inference on the CPU (no gradient, no dropout), on buffers allocated once per call: the eager fast
path of ``lsh`` (plain torch).

The same computation as :func:`.lsh.attend_rounds` (which keeps every step differentiable): per round, queries,
keys and values are gathered into the round's sorted order, each query cluster meets its key cluster in one batched
(c x c) product, the pairs an earlier round found are masked, and the round's softmax is merged into the rounds
before it through the log-sum-exps. Both paths take the flat tables and each round's layout (sorted slots, key
rows, masks) from :func:`tables` and :func:`layout`. What differs is where the numbers live:

* the (batch, head) rows are taken a group at a time (as many as one chunk of clusters holds, or one), every round
  of a group before the next group, so that the group's queries, keys, values and output stay in the cache from one
  round to the next rather than being read from memory once per round;
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
* a chunk's output and log-sum-exps are written, in the round's sorted order, into one buffer for the group's round
  (slots past the end of a row, the last cluster filled up, too); once the round is done, each original row reads
  its slot back through the inverse of the sort (a gather) and is merged into the running output in place. Merging
  each chunk as it ended instead (a gather of the running rows and a scatter back, ``index_copy_``) cost more: a
  scatter of a chunk's rows took 3.5-6.5x a gather of as many (one-off micro-benchmark).

A fresh large tensor per call, per round or per chunk costs more than its arithmetic on the CPU (page faults): at N
= 16384 (4 rounds of 128, 2 CPU cores; torch.profiler, one call) the differentiable loop spent about 60 ms
concatenating its chunks' outputs and 65 ms scattering each round back. Side by side (one-off, no gradients), this
path was 1.35x faster than the loop at N = 4096 and 1.68x at 16384, then with the same output to the bit (1.10x and
1.47-1.52x when it still gathered whole rounds); dropping pairs by arithmetic made it another 1.17-1.34x faster (its
output now differs from the loop's by rounding, about 1e-6 relative in float32), and the groups and the merge by
gathers another 1.06-1.12x (median of 15 or 7 interleaved calls, N = 1024 to 16384), with the same arithmetic: the
same bits at power-of-two lengths, elsewhere within 1-2 ulp (the merge's ``logaddexp`` rounds differently in its
vectorised loop and its scalar tail, and the merge's blocks then ended at different rows; the merge now runs on
buffers without a scalar tail here and in float64 on the differentiable path, see :func:`_merge_round`). When a key
cluster other than cluster t serves query cluster t (fewer real keys than queries), each round also copies the small
per-key masks and cluster ids into query cluster order. tests/test_lsh.py checks this path and the differentiable
one against a loop reference from the papers' definition; the docs' Speed page has the measurements.
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
    """Round r of a call, per query cluster (X = B H Tq of them, c slots each; both eager paths): ``qrows`` (X c) the
    row in the flat query table of each sorted query slot (slots past the end of a row repeat its last query);
    ``krows`` (X c) the rows of each query cluster's key cluster in
    the flat key table; ``bad`` (X, 1, c) the keys a query cluster may not use (past the end, padding; ``any_bad``:
    whether there is one); ``pairs``: per earlier round, (query target (X, c, 1), key cluster (X, 1, c)), equal where
    that round found the pair."""

    qrows: torch.Tensor
    krows: torch.Tensor
    bad: torch.Tensor
    any_bad: bool
    pairs: list[tuple[torch.Tensor, torch.Tensor]]


def layout(t: Tables, hashed, r: int) -> Layout:
    """:class:`Layout` of round ``r`` of ``hashed`` (:class:`.lsh.Hashed`), the earlier rounds' cluster numbers in the
    dtype its ``target`` and ``k_cluster`` have: :func:`attend` passes them as floats of the compute dtype (or
    float64, :func:`id_dtype`), converted once per call, rather than integers converted after every look-up (the four
    rounds' layouts at N = 16384, c = 128, float32: 9 against 19 ms, one-off, 2 threads)."""
    bh, blk, dev = t.b * t.h, t.blk, t.qf.device
    x = bh * t.tq
    qpos = _slots(hashed.q_order[r].reshape(bh, t.n), t.tq * blk)  # (B H, Tq c)
    kpos = _slots(hashed.k_order[r].reshape(bh, t.s), t.tk * blk)  # (B H, Tk c)
    qrows = (qpos + t.q_base).reshape(-1)
    kflat = (kpos + t.k_base).reshape(-1)  # per key cluster
    krows = t.key_side(kflat.view(bh * t.tk, blk)).reshape(-1)  # per query cluster
    bad = (torch.arange(t.tk * blk, device=dev) >= t.s).expand(bh, -1)  # keys past the end, padding
    if t.real is not None:
        bad = bad | ~t.real.reshape(-1).index_select(0, kflat).view(bh, -1)
    bad = t.key_side(bad.reshape(bh * t.tk, 1, blk))
    pairs = [  # an earlier round found a pair where its query target equals the key's cluster
        (
            hashed.target[e].reshape(-1).index_select(0, qrows).view(x, blk, 1),
            hashed.k_cluster[e].reshape(-1).index_select(0, krows).view(x, 1, blk),
        )
        for e in range(r)
    ]
    return Layout(qrows, krows, bad, bool(bad.any()), pairs)


class _Scratch:
    """A chunk's reused buffers: scores (P, c, c), the distances that find the pairs to drop, the probabilities,
    the row maxima, the rows of a round that a block of the running output merges with (and their log-sum-exps), and
    the gathered queries, keys and values."""

    def __init__(self, per: int, blk: int, d: int, dv: int, dt: torch.dtype, dev: torch.device) -> None:
        self.scores = torch.empty(per, blk, blk, dtype=dt, device=dev)
        self.gap = torch.empty(per, blk, blk, dtype=dt, device=dev)
        self.prob = torch.empty(per, blk, blk, dtype=dt, device=dev)
        self.top = torch.empty(per, blk, 1, dtype=dt, device=dev)
        self.prev = torch.empty(per * blk, dv, dtype=dt, device=dev)
        # the merge's log-sum-exps and weights, a whole number of LANES long (see _merge_round)
        lanes = -(-per * blk // LANES) * LANES
        self.prev_lse = torch.empty(lanes, dtype=dt, device=dev)
        self.run_lse = torch.empty(lanes, dtype=dt, device=dev)
        self.total = torch.empty(lanes, dtype=dt, device=dev)
        self.w_prev = torch.empty(lanes, dtype=dt, device=dev)
        self.w_o = torch.empty(lanes, dtype=dt, device=dev)
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
    w: _Scratch,
    qs,
    ks,
    vs,
    kept,
    pairs: list,
    scale: float,
    p: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    lse_lanes: torch.Tensor,
) -> None:
    """Query clusters ``qs`` (P, c, d) against their key clusters ``ks`` (P, c, d): the softmax over the pairs left,
    normalised, into ``out`` (P, c, dv), with its log-sum-exp into ``lse`` (P, c, 1). A row with no pair left (a
    later round's, every pair found before; round 0 always has one, a real key in every cluster a query meets) gives
    a log-sum-exp about ``-drop``, which :func:`_merge_round` weighs at exactly 0 beside the finite one of round 0.
    Dropped: the keys that ``kept`` (P, 1, c) has at 0 rather than 1 (None: none; padded keys are zeroed in the key
    table, so their scores are finite), and the ``pairs`` of earlier rounds, (query target (P, c, 1), key cluster
    (P, 1, c)) per round as floats (:func:`id_dtype`), equal where that round found the pair. ``lse_lanes``: the flat
    buffer ``lse`` starts, a whole number of :data:`LANES` long (its log runs there: no element in a scalar tail).

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
    torch.amax(prob, -1, keepdim=True, out=lse)
    lse_lanes.log_()  # (past the chunk: the next chunk's slots, or spare ones; written again before they are read)
    lse.neg_().add_(top)
    torch.bmm(prob, vs, out=out)


# torch computes elementwise ``exp``, ``log`` and ``logaddexp`` in vector lanes, then a scalar tail that rounds some
# inputs differently in the last bit; whether an element falls in the tail depends on its place in the tensor, which
# depends on what else the batch holds. Run on a whole number of LANES elements (a multiple of every CPU's vector
# loop: 2 x 16 floats with AVX-512), no element is in a tail: an input gets the same bits in any batch.
LANES = 64


def _lanes(n: int) -> int:
    return -(-n // LANES) * LANES


def _merge_round(out, lse, so, slse, src, w: _Scratch) -> None:
    """Merge a round (``so`` (slots, dv), ``slse`` (slots,) in its sorted order) into the running ``out``/``lse``
    (original order), a block of rows at a time: row i takes slot ``src[i]``. Read by gathers, written in place
    (a scatter of the round's rows, ``index_copy_``, cost 3.5-6.5x a gather of as many rows, one-off). The
    log-sum-exps and weights are computed on :data:`LANES`-padded buffers (0 past the block's rows), so that a row's
    bits do not depend on where its block ends."""
    step = w.prev.shape[0]
    for a in range(0, out.shape[0], step):
        b = min(out.shape[0], a + step)
        m, padded = b - a, _lanes(b - a)
        o = torch.index_select(so, 0, src[a:b], out=w.prev[:m])
        o_lse, prev_lse = w.prev_lse[:padded], w.run_lse[:padded]
        torch.index_select(slse, 0, src[a:b], out=o_lse[:m])
        prev_lse[:m].copy_(lse[a:b])
        if padded > m:
            o_lse[m:].zero_()
            prev_lse[m:].zero_()
        total = torch.logaddexp(prev_lse, o_lse, out=w.total[:padded])
        lse[a:b].copy_(total[:m])
        total.masked_fill_(torch.isinf(total), 0.0)  # guards a -inf in both (rows always have a pair)
        w_prev = torch.sub(prev_lse, total, out=w.w_prev[:padded]).exp_()
        w_o = torch.sub(o_lse, total, out=w.w_o[:padded]).exp_()
        out[a:b].mul_(w_prev[:m, None]).addcmul_(o, w_o[:m, None])


def attend(q, k, v, hashed, *, key_mask, scale: float) -> torch.Tensor:
    """The rounds of ``hashed`` (:class:`.lsh.Hashed`) merged: (B, H, N, dv) in v's dtype, as
    :func:`.lsh.attend_rounds` computes it, without gradients (nor forward-mode dual tensors or ``torch.func``
    transforms: the buffers are written in place)."""
    t = tables(q, k, v, hashed, safe_key_mask(key_mask))
    bh, n, blk, dt, tq = t.b * t.h, t.n, t.blk, t.dt, t.tq
    d, dv, dev = q.shape[-1], v.shape[-1], q.device
    rounds = hashed.q_order.shape[0]
    per = max(1, _CHUNK_ELEMENTS // (blk * blk))  # query clusters per chunk
    group = max(1, per // tq)  # (batch, head) rows per group: every round of a group before the next group
    out = torch.empty(bh * n, dv, dtype=dt, device=dev)  # the rounds so far, merged, in the original order
    lse = torch.empty(bh * n, dtype=dt, device=dev)
    so = torch.empty(min(bh, group) * tq, blk, dv, dtype=dt, device=dev)  # a group's round, in its sorted order
    slse_flat = torch.empty(_lanes(so.shape[0] * blk) + LANES, dtype=dt, device=dev)  # spare lanes at the end
    slse = slse_flat[: so.shape[0] * blk].view(so.shape[0], blk, 1)
    work = _Scratch(min(per, so.shape[0]), blk, d, dv, dt, dev)
    ids = id_dtype(dt, t.tk)  # the earlier rounds' cluster numbers as floats, converted once
    as_ids = dataclasses.replace(hashed, target=hashed.target[:-1].to(ids), k_cluster=hashed.k_cluster[:-1].to(ids))
    lays = [layout(t, as_ids, r) for r in range(rounds)]
    kept = [(~lay.bad).to(dt) if lay.any_bad else None for lay in lays]  # 1: a key the cluster may use, 0: not
    # the slot of every original row in each round's sorted order (the inverse of the sort), within its (B H) row
    positions = torch.arange(n, device=dev).expand(bh, n)
    slot_base = (torch.arange(bh, device=dev) * (tq * blk))[:, None]
    src = [
        torch.empty(bh, n, dtype=torch.long, device=dev)
        .scatter_(1, hashed.q_order[r].reshape(bh, n), positions)
        .add_(slot_base)
        .view(-1)
        for r in range(rounds)
    ]
    for g0 in range(0, bh, group):
        g1 = min(bh, g0 + group)
        x0, x1, rows = g0 * tq, g1 * tq, slice(g0 * n, g1 * n)  # its query clusters, its rows of the output
        for r, lay in enumerate(lays):
            for c0 in range(x0, x1, per):
                c1 = min(x1, c0 + per)
                m, sl = (c1 - c0) * blk, slice(c0 * blk, c1 * blk)
                qs = torch.index_select(t.qf, 0, lay.qrows[sl], out=work.qs[:m])
                ks = torch.index_select(t.kf, 0, lay.krows[sl], out=work.ks[:m])
                vs = torch.index_select(t.vf, 0, lay.krows[sl], out=work.vs[:m])
                _softmax_chunk(
                    work,
                    qs.view(-1, blk, d),
                    ks.view(-1, blk, d),
                    vs.view(-1, blk, dv),
                    None if kept[r] is None else kept[r][c0:c1],
                    [(target[c0:c1], cluster[c0:c1]) for target, cluster in lay.pairs],
                    scale,
                    c1 - c0,
                    so[c0 - x0 : c1 - x0],
                    slse[c0 - x0 : c1 - x0],
                    slse_flat[(c0 - x0) * blk : (c0 - x0) * blk + _lanes((c1 - c0) * blk)],
                )
            slots = src[r][rows] - x0 * blk
            if r == 0:
                torch.index_select(so.view(-1, dv), 0, slots, out=out[rows])
                torch.index_select(slse.view(-1), 0, slots, out=lse[rows])
            else:
                _merge_round(out[rows], lse[rows], so.view(-1, dv), slse.view(-1), slots, work)
    return out.view(t.b, t.h, n, dv).to(v.dtype)
