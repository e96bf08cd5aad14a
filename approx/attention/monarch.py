"""MonarchAttention: softmax attention projected onto Monarch matrices by alternating maximisation.

Yaras, Xu, Abillama, Lee, Balzano, "MonarchAttention: Zero-Shot Conversion to Fast, Hardware-Aware Structured
Attention", NeurIPS 2025 (arXiv 2505.18698). Its code has an academic-only licence and was not read. From the
paper come the approach (a Monarch matrix fitted to softmax attention by alternating maximisation of the
variational form of softmax), the complexity (Theta(N sqrt(N) d) time, Theta(N d) memory) and the cost axis;
the factorisation below, the closed-form updates, their order and the initialisation are derived here and
checked against a plain float64 implementation of the same equations (``tests/test_monarch.py``).

Softmax is a maximiser: softmax(z) = argmax over the simplex of <a, z> + H(a) (H the Shannon entropy), so
A = softmax(Z), Z = s Q K^T, maximises f(M) = sum over query rows of <M_row, Z_row> + H(M_row), and f(M) equals
sum_rows lse(Z_row) - KL(M_row || A_row). MonarchAttention maximises f over Monarch matrices instead. With
blocks of b tokens (position p = k b + i: block k, slot i; m = N / b blocks), a Monarch matrix is
M = P^T L P R (R block diagonal with m blocks of b x b, L with b blocks of m x m, P the (m, b) -> (b, m)
transpose), entry by entry

    M[(l, j), (k, i)] = L[j, l, k] R[k, j, i],

so for every slot j and key block k the (m x b) submatrix M[(., j), (k, .)] has rank one. The rows of L[j, l, :]
(over key blocks k) and R[k, j, :] (over the keys i of block k) are distributions, so M is non-negative with
rows summing to one, and the entropy splits: H(M_(l,j)) = H(L[j, l]) + sum_k L[j, l, k] H(R[k, j]). Each factor
then has a closed-form maximiser given the other (the update equations, derived here from that identity):

* R given L: R[k, j] = softmax_i(alpha[k, j, i] / c[k, j]) with alpha[k, j, i] = sum_l L[j, l, k] Z[(l, j), (k, i)]
  and c[k, j] = sum_l L[j, l, k]; i.e. R[k, j] = softmax_i(s qbar[k, j] . k_(k, i)) where qbar[k, j] is the
  L-weighted mean of the queries (l, j): O(N b d) for the scores, O(N m d) for the means.
* L given R: L[j, l] = softmax_k(beta[j, l, k]), beta = s q_(l, j) . Ktil[k, j] + H(R[k, j]) with the key
  summaries Ktil[k, j] = sum_i R[k, j, i] k_(k, i) (O(N b d) and O(N m d)).
* Output: O_(l, j) = sum_k L[j, l, k] Vtil[k, j], Vtil[k, j] = sum_i R[k, j, i] v_(k, i).

Each update is an exact maximisation over one factor, so f never decreases, and the summed KL(M_row || A_row)
of the real query rows never increases, from step to step (``tests/test_monarch.py`` checks it). With b ~ sqrt(N)
time is Theta(N sqrt(N) d); no N x N tensor is formed, and without gradients the R (b x b per block) and L
(m x m per slot) scores are computed in chunks and reduced at once, so memory beyond the inputs is O(N d).

Choices made here (where the paper was not at hand or is silent, derived and stated):

* Initialisation (``start``): ``"identity"`` (the default) sets L[j, l, k] = [l == k] (M = R, block-diagonal
  attention), then ``steps`` rounds of "update R, update L". With one step (their RoBERTa runs) the first R update
  is exact softmax attention inside each block of b consecutive tokens, and the L update mixes every key block in
  through its summaries. ``"uniform"`` sets R uniform over each block's real keys instead (M then weighs each key
  block by its mean key: Ktil[k, j] is that mean for every slot, H(R[k, j]) the log of the block's real keys) and
  runs one L update given it before the rounds, so that the first R update of slot j fits the queries (l, j) in
  proportion to how much each attends to key block k rather than query (k, j) alone. It costs one L update more
  (2 N m d multiply-accumulates). On the SQuAD reader of the docs' MonarchAttention protocol (docs/results.md) it
  keeps more F1 at the default block for fewer products than a second identity round, and less with wide fixed
  blocks and every layer replaced: the default stays ``"identity"``.
* ``block_size`` is b, the tokens per block of R (m = ceil(N / b) blocks). 0 (the default) picks, per sequence,
  the power of two nearest sqrt(real length) (b = m = sqrt(N) is the Theta(N sqrt(N) d) setting; a power of two
  keeps the batched matmuls aligned and the number of distinct sizes in a batch small). Rows of a batch with
  different block sizes are computed group by group.
* Padding: each sequence is laid out by its real tokens only (real tokens in order at slots 0 .. n-1, pads
  after them, the last block filled up with masked slots), so where pads are, and how many, changes nothing
  for real rows. Masked keys are out of every R softmax (weight exactly 0) and key blocks without a real key out
  of every L softmax; padded queries are out of the R updates (out of qbar and c: the objective is summed over
  real query rows only). Where c = 0 (no real query weighs in; e.g. the slot of a pad in the last block at
  initialisation), qbar = 0: R is uniform over the block's real keys. Padded query rows get uniform attention
  over the real keys (their output is meaningless; this keeps every row a distribution).
* Exact limit: one block (b >= N, m = 1) makes L = 1 and the first R update exact softmax; it runs the same
  code (the L products are skipped as they are the identity), and costs what softmax costs. (Blocks of one
  token, b = 1, are exact too: R = 1 and L is softmax, at twice the cost.) So there is no
  separate "sequence shorter than the budget" fallback: short sequences are exact through the method itself.
  ``exact_below`` (default 0, never) gives rows with fewer real tokens exact attention (torch's SDPA).
* Cross-attention (N != S) uses the same b for queries and keys (ceil(N / b) query blocks).
* Computation: H(R[k, j]) = lse_i(alpha) - s qbar[k, j] . Ktil[k, j] (a dot of length d, not b); the R scores
  of a chunk of blocks go through one batched product into a reused buffer and straight on to Ktil and Vtil;
  the L update runs one head at a time on strided views where a head's scores are large (the rows (l, j) of a slot
  j are read and the output written where they are: regrouping them by copies cost more than the products on the
  CPU), and many heads at once, regrouped, where they are small (a batch of short inputs: the loop over heads had
  cost more than the products). With one key block (b >= N) only Vtil is computed. The query means of the second
  and later R updates are normalised over l in the log domain: in float32, where scores are a few hundred apart,
  every L[j, ., k] of a key block can underflow to zero while their ratios, all qbar needs, stay defined.
* Attention dropout is not applied: dropping entries of the implicit N x S Monarch matrix needs that matrix;
  a call with ``dropout > 0`` warns instead of ignoring it silently.
* Cost (``Cost.matmul_macs``, the paper's "attention FLOPs" axis): the multiply-accumulates of the products
  above; with one step and N = m b: N (2b + m) d + N (b + m) dv (the first R update needs no mean). For
  RoBERTa at N = 384 this gives 0.51x of softmax at b = 128 and 0.39x at b = 96, i.e. 0.67x and 0.59x with 8 of
  12 layers replaced, the paper's reported points. The uniform start adds N m d for its scores, N m d for the
  query means it gives, and the mean keys (elementwise).
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch
import torch.nn.functional as F

from ..config import MethodConfig, option
from ..registry import Cost, ExactLimit, register
from . import _fallback
from ._common import compute_dtype, exact_rows, exact_weight_rows, safe_key_mask
from ._fallback import exact_for_length

STARTS = ("identity", "uniform")


@dataclasses.dataclass(frozen=True)
class MonarchConfig(MethodConfig):
    """Options of MonarchAttention."""

    method = "monarch"

    block_size: int = option(
        0,
        "tokens per block b (m = ceil(N / b) blocks); 0 = per sequence, the power of two nearest sqrt(real "
        "length); b >= N is exact softmax attention",
    )
    steps: int = option(1, "rounds of alternating maximisation (update R, then L); 1 as in the paper's RoBERTa runs")
    start: str = option(
        "identity",
        "'identity': L = I, so the first R update is exact softmax inside each block; 'uniform': R uniform, so an L "
        "update weighing each key block by its mean key comes first (one L update more per call)",
        absent="identity",  # (what records written before the option meant: merges of results match them)
    )
    exact_below: int = option(
        0, "sequences with fewer real tokens get exact attention (0 = never: measure the approximation)"
    )

    def check(self) -> None:
        self.require(self.block_size >= 0, "block_size", "a block size: 0 (about sqrt(N), per sequence) or more")
        self.require(self.steps >= 1, "steps", "need at least one update of each factor")
        self.require(self.start in STARTS, "start", f"choose one of {', '.join(map(repr, STARTS))}")
        self.require(self.exact_below >= 0, "exact_below", "a length: 0 (off) or more")


def auto_block(n: int) -> int:
    """The power of two nearest sqrt(n) (in log scale): 16384 -> 128, 1024 -> 32, 384 -> 16, 120 -> 8."""
    return 1 << max(0, math.floor(math.log2(max(n, 1)) / 2 + 0.5))


def _block_for(config: MonarchConfig, n: int) -> int:
    return config.block_size or auto_block(n)


def cost(config: MonarchConfig, *, n: int, s: int, d: int, dv: int) -> Cost:
    if exact_for_length(n, exact_below=config.exact_below):
        return Cost(flops=2 * n * s * (d + dv), qk_pairs=n * s, matmul_macs=n * s * (d + dv))
    b = min(_block_for(config, s), max(n, s))  # a block longer than the sequence is the sequence
    mq, mk = -(-n // b), -(-s // b)
    gq, gk = mq * b, mk * b  # grid sizes (the last block filled up with masked slots)
    t = config.steps if mk > 1 else 1  # one key block: L = 1, so only the last R update counts, and only it runs
    u = 1 if config.start == "uniform" and mk > 1 else 0  # the uniform start: one L update before the first R update
    scores_r = t * gk * b  # alpha: one per (key block, slot, key)
    macs = scores_r * d + gk * b * dv  # alpha, and Vtil = R V (last step)
    one_mean = mk == 1 and (config.steps > 1 or config.start == "uniform")
    flops_extra = gq * (d + 1) if one_mean else 0  # (one key block: each slot's query mean)
    pairs = scores_r
    if t - 1 + u > 0:  # the L-weighted query means qbar (all but the first R update from L = I), in the log domain
        macs += (t - 1 + u) * gq * mk * d
        flops_extra += 2 * (t - 1 + u) * gq * mk
    if mk > 1:  # one block: L = 1, nothing more to compute
        macs += t * gk * b * d  # Ktil = R K
        macs += (t + u) * gq * mk * d + gq * mk * dv  # beta = q . Ktil, and O = L Vtil
        flops_extra += 2 * t * gk * b + u * gk * d  # the entropies H(R[k, j]) (a dot counted as b); the mean keys
        pairs += (t + u) * gq * mk
    return Cost(flops=2 * macs + flops_extra, qk_pairs=pairs, matmul_macs=macs)


# ----------------------------------------------------------------------------------------------- layout


@dataclasses.dataclass
class _Group:
    """Batch rows computed together: one block size, one grid. ``rows`` None: every batch row. Grids hold
    ``gq`` query and ``gk`` key slots (multiples of ``block``). ``q_pos``/``k_pos`` (R, g): the position each
    slot reads (None: slot = position); ``q_real``/``k_real`` (R, g) bool: the slot holds a real token (None:
    every slot does); ``q_slot``/``k_slot`` (R, N)/(R, S): the slot of every position, g for a pad (None: slot =
    position)."""

    rows: torch.Tensor | None
    block: int
    gq: int
    gk: int
    q_pos: torch.Tensor | None = None
    k_pos: torch.Tensor | None = None
    q_real: torch.Tensor | None = None
    k_real: torch.Tensor | None = None
    q_slot: torch.Tensor | None = None
    k_slot: torch.Tensor | None = None


def _compact(mask: torch.Tensor | None, length: int, grid: int, rows: int, device):
    """Positions, real flags and slots of one side (queries or keys) of a group: real tokens first, in order."""
    if mask is None:  # slot = position; slots past the end (the last block filled up) are masked
        real = None if grid == length else (torch.arange(grid, device=device) < length).expand(rows, grid)
        return None, real, None
    order = torch.argsort((~mask).to(torch.uint8), dim=-1, stable=True)  # (R, L): real positions first
    if grid > length:
        order = F.pad(order, (0, grid - length))
    count = mask.sum(-1, keepdim=True)  # (R, 1)
    real = torch.arange(grid, device=device) < count  # (R, grid)
    rank = mask.long().cumsum(-1) - 1
    slot = torch.where(mask, rank, torch.full_like(rank, grid))
    return order[:, :grid], real, slot


def _plan(n: int, s: int, key_mask, query_mask, config: MonarchConfig, batch: int, device) -> list[_Group]:
    """Groups of batch rows sharing a block size, each with its layout (see :class:`_Group`)."""
    if key_mask is not None and bool(key_mask.all()):
        key_mask = None
    if query_mask is not None and bool(query_mask.all()):
        query_mask = None
    nk = [s] * batch if key_mask is None else key_mask.sum(-1).tolist()
    nq = [n] * batch if query_mask is None else query_mask.sum(-1).tolist()
    sizes = [_block_for(config, x) for x in nk]
    groups = []
    for size in sorted(set(sizes)):
        members = [r for r in range(batch) if sizes[r] == size]
        rows = None if len(members) == batch else torch.tensor(members, device=device)
        longest_k, longest_q = max(nk[r] for r in members), max(nq[r] for r in members)
        b = min(size, max(longest_k, longest_q))  # a block longer than every sequence: one block, no spare slots
        gk, gq = -(-longest_k // b) * b, max(1, -(-longest_q // b)) * b  # (rows of pads alone: one spare block)
        kmask = key_mask if key_mask is None or rows is None else key_mask[rows]
        qmask = query_mask if query_mask is None or rows is None else query_mask[rows]
        k_pos, k_real, k_slot = _compact(kmask, s, gk, len(members), device)
        q_pos, q_real, q_slot = _compact(qmask, n, gq, len(members), device)
        groups.append(_Group(rows, b, gq, gk, q_pos, k_pos, q_real, k_real, q_slot, k_slot))
    return groups


def _rows_of(table_rows: torch.Tensor | None, batch: int, device) -> torch.Tensor:
    """The batch rows of a group (every row when None)."""
    return torch.arange(batch, device=device) if table_rows is None else table_rows


def _to_grid(x: torch.Tensor, rows, pos, real, grid: int, dt: torch.dtype) -> torch.Tensor:
    """(B, H, L, e) -> the group's (R, H, grid, e) in ``dt``: batch row ``rows[r]``'s token ``pos[r, slot]`` in each
    slot (None: slot = position), zero in masked slots. The tokens are read as rows of a (B L, H e) table by one
    ``index_select`` (a free view of a model's queries, keys and values, which are transposed views of (B, L, H, e)):
    a ``gather`` of the same elements cost about ten times as much on batches of short inputs. Only the group's
    tokens are converted to ``dt``."""
    b, h, length, e = x.shape
    if pos is None:
        x = (x if rows is None else x.index_select(0, rows)).to(dt)
        return x if grid == length else F.pad(x, (0, 0, 0, grid - length))
    flat = (pos + _rows_of(rows, b, x.device)[:, None] * length).reshape(-1)
    out = x.transpose(1, 2).reshape(b * length, h * e).index_select(0, flat).to(dt).view(pos.shape[0], grid, h, e)
    return out.masked_fill_(~real[:, :, None, None], 0.0).transpose(1, 2)  # (a pad's value may be inf: no 0 * inf)


# ------------------------------------------------------------------------------------------- the updates

_MIN = {torch.float32: torch.finfo(torch.float32).min, torch.float64: torch.finfo(torch.float64).min}
# score elements per chunk (R: blocks of b x b, L: slots of mq x mk): about 8 MB in float32 on a CPU, where
# batched products of 128 x 128 blocks run fastest in batches of about a hundred; memory stays O(N d)
_CHUNK = 1 << 21
_CHUNK_GPU = 1 << 26


def _chunk(x: torch.Tensor) -> int:
    return _CHUNK if x.device.type == "cpu" else _CHUNK_GPU


def _r_update(qbar, kg, vg, key_real, scale, grad, keep, summaries: bool = True):
    """R[k, j] = softmax_i(s qbar[k, j] . k_(k, i)) over the real keys of block k, reduced at once to its products.

    qbar (X, mk, b, d): the query means; kg (X, mk, b, d), vg (X, mk, b, dv) or None: keys and values, zero in
    masked slots; key_real (X, mk, b) bool or None. Returns Ktil = R K (X, mk, b, d), the entropies H(R[k, j])
    (X, mk, b) and Vtil = R V (X, mk, b, dv) (None without ``vg``); without ``summaries`` (one key block: no L update
    reads them) Ktil and the entropies are not computed (None)."""
    x, mk, b, d = kg.shape
    size = x * mk
    qf, kf = qbar.reshape(size, b, d), kg.reshape(size, b, d)
    vf = None if vg is None else vg.reshape(size, b, -1)
    kr = None if key_real is None else key_real.reshape(size, 1, b)
    step = max(1, _chunk(kg) // (b * b))
    minimum = _MIN[kg.dtype]
    if grad:
        parts: list[list[torch.Tensor]] = [[], [], []]
    else:
        ktil, ent = (kg.new_empty(size, b, d), kg.new_empty(size, b)) if summaries else (None, None)
        vtil = None if vf is None else vf.new_empty(size, b, vf.shape[-1])
        scores = kg.new_empty(min(step, size), b, b)  # reused: fresh pages cost more than the arithmetic
    rs = []
    for start in range(0, size, step):
        sl = slice(start, start + step)
        c = qf[sl].shape[0]
        if grad:
            alpha = torch.bmm(qf[sl], kf[sl].transpose(1, 2)) * scale  # (c, b, b)
            if kr is not None:
                alpha = alpha.masked_fill(~kr[sl], minimum)
        else:
            alpha = torch.baddbmm(scores[:c], qf[sl], kf[sl].transpose(1, 2), beta=0.0, alpha=scale, out=scores[:c])
            if kr is not None:
                alpha.masked_fill_(~kr[sl], minimum)
        top = alpha.detach().amax(-1, keepdim=True)  # (c, b, 1)
        ex = (alpha - top).exp() if grad else alpha.sub_(top).exp_()
        total = ex.sum(-1, keepdim=True)  # (c, b, 1)
        if keep is not None:
            rs.append(ex / total)
        if summaries:
            kt = torch.bmm(ex, kf[sl]) / total if grad else torch.bmm(ex, kf[sl], out=ktil[sl]).div_(total)  # (c,b,d)
            # H(R) = lse - <R, alpha>, and <R, alpha> = s qbar . (R K): a dot of length d, not b
            h = (top + total.log()).squeeze(-1) - scale * torch.linalg.vecdot(qf[sl], kt)  # (c, b)
            if grad:
                parts[0].append(kt)
                parts[1].append(h)
            else:
                ent[sl] = h
        if vf is not None:
            if grad:
                parts[2].append(torch.bmm(ex, vf[sl]) / total)
            else:
                torch.bmm(ex, vf[sl], out=vtil[sl]).div_(total)
    if keep is not None:
        keep["R"] = torch.cat(rs).view(x, mk, b, b)
    if grad:
        ktil, ent = (torch.cat(parts[0]), torch.cat(parts[1])) if summaries else (None, None)
        vtil = torch.cat(parts[2]) if parts[2] else None
    if not summaries:
        return None, None, None if vtil is None else vtil.view(x, mk, b, -1)
    return ktil.view(x, mk, b, d), ent.view(x, mk, b), None if vtil is None else vtil.view(x, mk, b, -1)


# heads of the L update taken together when one head's scores (b x mq x mk) are this small or smaller: batches of short
# inputs (32 sentences of 64 tokens: 384 heads of 8 x 8 x 8) otherwise spend their time in a Python loop over heads
_SMALL_HEAD = 1 << 12
_GROUP_ELEMENTS = 1 << 16


def _heads_per_group(x: int, per_head: int) -> int:
    """Heads the L update takes at once: one where a head's scores are large (its rows are read through strided views,
    no copies), else as many as :data:`_GROUP_ELEMENTS` scores hold (their rows regrouped by one copy)."""
    return 1 if per_head > _SMALL_HEAD else max(1, min(x, _GROUP_ELEMENTS // per_head))


def _query_means(beta: torch.Tensor, q: torch.Tensor, w: torch.Tensor, keep: list | None) -> torch.Tensor:
    """qbar[k] = sum_l L[l, k] w_l q_l / sum_l L[l, k] w_l for one chunk of slots: beta (c, mq, mk) the L scores,
    q (c, mq, d) the queries, w (c, mq, 1) the real-query flags; (c, mk, d).

    Normalised over l in the log domain: where a key block's weights L[., k] are all far below 1 (scores hundreds
    apart, e.g. float32 with |s q.k| of a few hundred) their products underflow to zero, while their ratios, which
    are all qbar needs, stay well defined. Rows l of padded queries are out (0 for a slot without a real query: its
    grid rows are zero). ``keep`` collects L itself."""
    log_l = torch.log_softmax(beta, -1)  # log L[l, k] (c, mq, mk)
    if keep is not None:
        keep.append(log_l.exp())
    pads = w == 0
    log_l = (
        log_l.masked_fill(pads, _MIN[log_l.dtype])
        if log_l.requires_grad
        else log_l.masked_fill_(pads, _MIN[log_l.dtype])
    )
    return torch.bmm(torch.softmax(log_l, 1).transpose(1, 2), q)


def _l_update(qg, w, ktil, ent, vtil, scale, grad, keep, out=None):
    """L[j, l] = softmax_k(s q_(l, j) . Ktil[k, j] + H(R[k, j])), then O = L Vtil when ``vtil`` is given (the last
    step), else the next R update's query means qbar[k, j] = sum_l L[j, l, k] w_(l, j) q_(l, j) / sum_l L[j, l, k]
    w_(l, j) (0 where no real query weighs in), normalised over l in the log domain (:func:`_query_means`).

    qg (X, mq, b, d), w (X, mq, b) the real-query flags, ktil (X, mk, b, d), ent (X, mk, b) (the most negative
    number for key blocks without a real key: out of the softmax), vtil (X, mk, b, dv) or None. A group of heads
    at a time (:func:`_heads_per_group`), a chunk of slots j at a time: a large head alone, through strided views (the
    batched products read and write the rows of a slot where they are: regrouping them by copies costs more than the
    products), small heads many at once, regrouped; the result, (X, mq, b, dv) or qbar (X, mk, b, d), is written to
    ``out`` when given (no gradients)."""
    x, mq, b, d = qg.shape
    mk = ktil.shape[1]
    step = max(1, _chunk(qg) // (mq * mk))
    group = _heads_per_group(x, b * mq * mk)
    heads, ls = [], []
    scratch = None if grad else qg.new_empty(min(step, b * group), mq, mk)  # reused: fresh pages cost more

    def slots(t: torch.Tensor, h: int) -> torch.Tensor:  # (X, m, b, e) -> heads h .. h + group as (G b, m, e)
        return t[h].transpose(0, 1) if group == 1 else t[h : h + group].transpose(1, 2).flatten(0, 1)

    for h in range(0, x, group):
        g = min(group, x - h)
        qh, kh = slots(qg, h), slots(ktil, h)  # (G b, mq, d), (G b, mk, d)
        bias = slots(ent[..., None], h).transpose(1, 2)  # (G b, 1, mk)
        wh = slots(w[..., None], h)  # (G b, mq, 1)
        vh = None if vtil is None else slots(vtil, h)  # (G b, mk, dv)
        if out is None:
            dest = None
        elif group == 1:
            dest = out[h].transpose(0, 1)  # (b, mq, dv) or (b, mk, d), written where the rows are
        else:
            dest = out.new_empty(g * b, *out.shape[1:2], out.shape[-1])
        pieces = []
        for start in range(0, g * b, step):
            sl = slice(start, start + step)
            c = qh[sl].shape[0]
            if grad:
                beta = torch.bmm(qh[sl], kh[sl].transpose(1, 2)) * scale + bias[sl]  # (c, mq, mk)
            else:  # (a bias in baddbmm would be copied into the whole output first: one pass more)
                beta = torch.baddbmm(
                    scratch[:c], qh[sl], kh[sl].transpose(1, 2), beta=0.0, alpha=scale, out=scratch[:c]
                )
                beta.add_(bias[sl])
            if vh is None:  # the next R update's query means, in the log domain (see below)
                num = _query_means(beta, qh[sl], wh[sl], keep=ls if keep is not None else None)
                if dest is None:
                    pieces.append(num)
                else:
                    dest[sl].copy_(num)
                continue
            top = beta.detach().amax(-1, keepdim=True)  # (c, mq, 1)
            ex = (beta - top).exp() if grad else beta.sub_(top).exp_()
            total = ex.sum(-1, keepdim=True)  # (c, mq, 1)
            if keep is not None:
                ls.append(ex / total)
            # O = L Vtil, normalised after the product (mq x dv instead of mq x mk)
            if dest is None:
                pieces.append(torch.bmm(ex, vh[sl]) / total)
            else:
                torch.div(torch.bmm(ex, vh[sl]), total, out=dest[sl])
        if dest is None:
            heads.append(torch.cat(pieces).unflatten(0, (g, b)).transpose(1, 2))
        elif group > 1:
            out[h : h + g].copy_(dest.unflatten(0, (g, b)).transpose(1, 2))
    if keep is not None:
        keep["L"] = torch.cat(ls).view(x, b, mq, mk)
    return torch.cat(heads) if out is None else out


def _uniform_start(qg, kg, w, k_real, empty, scale, grad, keep) -> torch.Tensor:
    """The first query means qbar (X, mk, b, d) from R uniform over each key block's real keys: Ktil[k, j] is then the
    block's mean key for every slot j and H(R[k, j]) the log of its number of real keys, and the L update given that R
    weighs each key block by its mean key (the L-weighted means of :func:`_l_update`)."""
    x, mk, b, d = kg.shape
    count = kg.new_full((x, mk, 1), b) if k_real is None else k_real.sum(-1, keepdim=True).to(kg.dtype)  # (X, mk, 1)
    mean = (kg.sum(2, keepdim=True) / count[..., None].clamp_min(1)).expand(x, mk, b, d)  # (a masked slot's key is 0)
    ent = count.clamp_min(1).log().expand(x, mk, b)
    if empty is not None:  # key blocks without a real key: out of the softmax
        ent = ent.masked_fill(empty[..., None], _MIN[ent.dtype])
    return _l_update(qg, w, mean, ent, None, scale, grad, keep, None if grad else qg.new_empty(x, mk, b, d))


def _monarch_grid(
    qg, kg, vg, q_real, k_real, scale, steps: int, grad: bool, keep=None, out=None, start: str = "identity"
) -> torch.Tensor:
    """MonarchAttention on grids: qg (X, mq, b, d), kg (X, mk, b, d), vg (X, mk, b, dv), zero in masked slots;
    q_real (X, mq, b), k_real (X, mk, b) bool or None; ``start`` as :class:`MonarchConfig`'s. Returns the output grid
    (X, mq, b, dv), written to ``out`` when given (no gradients)."""
    x, mq, b, d = qg.shape
    mk, dv = kg.shape[1], vg.shape[-1]
    # L = identity at the start: the query mean of (k, j) is the query (k, j) itself (0 for a pad: c = 0)
    if mq >= mk:
        qbar = qg[:, :mk]
    else:
        qbar = torch.cat([qg, qg.new_zeros(x, mk - mq, b, d)], dim=1)
    w = qg.new_ones(x, mq, b) if q_real is None else q_real.to(qg.dtype)
    if mk == 1:  # one key block: L = 1 whatever R is, so only the last R update counts (exact when mq = 1 too)
        if steps > 1 or start == "uniform":  # qbar = the mean of the real queries of each slot
            sums = torch.cat([qg, w[..., None]], dim=-1).sum(1, keepdim=True)  # (X, 1, b, d + 1)
            qbar = sums[..., :d] / sums[..., d:].clamp_min(torch.finfo(qg.dtype).tiny)
        _, _, vtil = _r_update(qbar, kg, vg, k_real, scale, grad, keep, summaries=False)
        if keep is not None:
            keep["L"] = qg.new_ones(x, b, mq, 1)
        res = vtil.expand(x, mq, b, dv)
        return res if out is None else out.copy_(res)
    empty = None if k_real is None else ~k_real.any(-1)  # (X, mk): key blocks without a real key
    if start == "uniform":
        qbar = _uniform_start(qg, kg, w, k_real, empty, scale, grad, keep)
    for t in range(steps):
        last = t == steps - 1
        ktil, ent, vtil = _r_update(qbar, kg, vg if last else None, k_real, scale, grad, keep)
        if empty is not None:
            ent = ent.masked_fill(empty[..., None], _MIN[ent.dtype])
        if last:
            return _l_update(qg, w, ktil, ent, vtil, scale, grad, keep, out)
        qbar = _l_update(qg, w, ktil, ent, None, scale, grad, keep, None if grad else qg.new_empty(x, mk, b, d))
    raise AssertionError("unreachable: steps >= 1")


def _group_grids(q, k, v, g: _Group, dt):
    """The group's rows laid out on its grids: (X, m, b, e) tensors and flags (see :func:`_monarch_grid`)."""
    rows, heads = (q.shape[0] if g.rows is None else g.rows.numel()), q.shape[1]
    b = g.block
    qg = _to_grid(q, g.rows, g.q_pos, g.q_real, g.gq, dt)
    kg = _to_grid(k, g.rows, g.k_pos, g.k_real, g.gk, dt)
    vg = _to_grid(v, g.rows, g.k_pos, g.k_real, g.gk, dt)

    def flags(real, grid):
        if real is None:
            return None
        return real[:, None].expand(rows, heads, grid).reshape(rows * heads, grid // b, b)

    x = rows * heads
    return (
        qg.reshape(x, g.gq // b, b, -1),
        kg.reshape(x, g.gk // b, b, -1),
        vg.reshape(x, g.gk // b, b, -1),
        flags(g.q_real, g.gq),
        flags(g.k_real, g.gk),
    )


def _uniform_values(vg: torch.Tensor, g: _Group, rows: int, heads: int) -> torch.Tensor:
    """Mean of the real values (R, H, 1, dv): the output of padded query rows."""
    dv = vg.shape[-1]
    total = vg.reshape(rows, heads, g.gk, dv).sum(2, keepdim=True)
    if g.k_real is None:
        return total / g.gk
    return total / g.k_real.sum(-1).to(vg.dtype)[:, None, None, None]


def _monarch(q, k, v, key_mask, query_mask, scale, config: MonarchConfig) -> torch.Tensor:
    """MonarchAttention output (B, H, N, dv) in q's dtype."""
    dt = compute_dtype(q.dtype)
    key_mask = safe_key_mask(key_mask)
    batch, heads, n, _ = q.shape
    s, dv = k.shape[2], v.shape[-1]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    groups = _plan(n, s, key_mask, query_mask, config, batch, q.device)
    outs = []  # per group, (R, N, H, dv): the layout a model reads the attention output in
    for g in groups:
        qg, kg, vg, q_real, k_real = _group_grids(q, k, v, g, dt)
        rows, mq = qg.shape[0] // heads, qg.shape[1]
        out = None if grad else qg.new_empty(rows, heads, g.gq, dv)  # written in place: no copy at the end
        grid = None if out is None else out.view(rows * heads, mq, g.block, dv)
        out = _monarch_grid(qg, kg, vg, q_real, k_real, scale, config.steps, grad, out=grid, start=config.start)
        out = out.reshape(rows, heads, g.gq, dv)
        if g.q_slot is None:
            outs.append(out[:, :, :n].transpose(1, 2))
            continue
        # each position reads its slot, a padded query row the uniform attention over the real keys (slot gq)
        ext = torch.cat([out, _uniform_values(vg, g, rows, heads)], dim=2).transpose(1, 2)  # (R, gq + 1, H, dv)
        flat = (g.q_slot + torch.arange(rows, device=q.device)[:, None] * (g.gq + 1)).reshape(-1)
        outs.append(ext.reshape(rows * (g.gq + 1), heads * dv).index_select(0, flat).view(rows, n, heads, dv))
    if len(outs) == 1:
        return outs[0].transpose(1, 2).to(q.dtype)
    if grad:
        order = torch.cat([_rows_of(g.rows, batch, q.device) for g in groups])
        return torch.cat(outs)[torch.argsort(order)].transpose(1, 2).to(q.dtype)
    result = outs[0].new_empty(batch, n, heads, dv)
    for g, out in zip(groups, outs, strict=True):
        result.index_copy_(0, _rows_of(g.rows, batch, q.device), out)
    return result.transpose(1, 2).to(q.dtype)


def _monarch_weights(q, k, key_mask, query_mask, scale, config: MonarchConfig) -> torch.Tensor:
    """The dense Monarch matrix (B, H, N, S): M[(l, j), (k, i)] = L[j, l, k] R[k, j, i] on each group's grid,
    mapped back to positions (padded keys: 0; padded query rows: uniform over the real keys)."""
    dt = compute_dtype(q.dtype)
    key_mask = safe_key_mask(key_mask)
    batch, heads, n, d = q.shape
    s = k.shape[2]
    outs, order = [], []
    for g in _plan(n, s, key_mask, query_mask, config, batch, q.device):
        ones = q.new_ones(1, 1, 1, 1).expand(*k.shape[:3], 1)  # values: a placeholder (only L, R are kept)
        qg, kg, vg, q_real, k_real = _group_grids(q, k, ones, g, dt)
        rows = qg.shape[0] // heads
        keep: dict = {}
        _monarch_grid(qg, kg, vg, q_real, k_real, scale, config.steps, grad=True, keep=keep, start=config.start)
        lf, rf = keep["L"], keep["R"]  # (X, b, mq, mk), (X, mk, b, b)
        dense = torch.einsum("xjlk,xkji->xljki", lf, rf).reshape(rows, heads, g.gq, g.gk)
        real = torch.ones(rows, g.gk, dtype=dt, device=q.device) if g.k_real is None else g.k_real.to(dt)
        uniform = (real / real.sum(-1, keepdim=True))[:, None, None, :].expand(rows, heads, 1, g.gk)
        dense = torch.cat([dense, uniform], dim=2)  # (R, H, gq + 1, gk)
        dense = F.pad(dense, (0, 1))  # a zero column for the padded keys
        q_slot = g.q_slot if g.q_slot is not None else torch.arange(n, device=q.device).expand(rows, n)
        k_slot = g.k_slot if g.k_slot is not None else torch.arange(s, device=q.device).expand(rows, s)
        dense = dense.gather(2, q_slot[:, None, :, None].expand(rows, heads, n, g.gk + 1))
        dense = dense.gather(3, k_slot[:, None, None, :].expand(rows, heads, n, s))
        outs.append(dense)
        order.append(torch.arange(batch, device=q.device) if g.rows is None else g.rows)
    if len(outs) == 1:
        return outs[0]
    return torch.cat(outs)[torch.argsort(torch.cat(order))]


# --------------------------------------------------------------------------------------------- register


def _with_fallback(approximate, exact, q: torch.Tensor, query_mask, config: MonarchConfig):
    """Batch rows with fewer than ``exact_below`` real tokens get ``exact(rows)`` (see :mod:`._fallback`)."""
    shape = (q.shape[0], q.shape[-2])
    return _fallback.with_fallback(
        approximate, exact, query_mask=query_mask, shape=shape, device=q.device, exact_below=config.exact_below
    )


def monarch_weights(q, k, *, key_mask, query_mask, scale, config, state) -> torch.Tensor:
    """Dense (B, H, N, S) Monarch attention matrix (analysis only)."""
    dt = compute_dtype(q.dtype)

    exact = exact_weight_rows(q, k, key_mask, scale, dt)

    def approximate() -> torch.Tensor:
        return _monarch_weights(q, k, key_mask, query_mask, scale, config)

    return _with_fallback(approximate, exact, q, query_mask, config)


@register(
    "monarch",
    MonarchConfig,
    cost=cost,
    weights=monarch_weights,
    test_options={},  # blocks of 8 or 16 at the generic tests' 35 to 137 tokens
    # one block covering the sequence: L = 1 and the first R update is softmax itself
    exact_limit=ExactLimit(options=lambda n: {"block_size": n}),
)
def monarch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    scale: float,
    config: MonarchConfig,
    state: dict[str, torch.Tensor],
    dropout: float = 0.0,
) -> torch.Tensor:
    """MonarchAttention: softmax attention projected onto Monarch matrices (alternating maximisation)."""
    if dropout > 0.0:
        warnings.warn(
            "monarch: attention dropout is not applied (MonarchAttention never forms the attention matrix to "
            "drop entries of); the model trains without it",
            RuntimeWarning,
            stacklevel=3,
        )

    exact = exact_rows(q, k, v, key_mask, scale)

    def approximate() -> torch.Tensor:
        return _monarch(q, k, v, key_mask, query_mask, scale, config)

    return _with_fallback(approximate, exact, q, query_mask, config)
