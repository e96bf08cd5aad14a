"""LSH attention (Reformer), made asymmetric for separate queries and keys as SMYRF does.

Kitaev, Kaiser, Levskaya, "Reformer: The Efficient Transformer", arXiv 2001.04451; Daras, Kitaev, Odena,
Dimakis, "SMYRF: Efficient Attention using Asymmetric Clustering", arXiv 2010.05315.

Reformer hashes shared queries/keys with random rotations and lets each query attend the keys of its own hash
bucket. A pretrained encoder has separate Q and K, so (SMYRF) both are first mapped onto one sphere of radius M,

    F(q) = [q; 0; sqrt(M^2 - |q|^2)],   G(k) = [k; sqrt(M^2 - |k|^2); 0],   M^2 = max |q|^2 + max |k|^2

(the maxima over the REAL queries and keys of each sequence and head), so that F(q) . G(k) = q . k and
|F(q) - G(k)|^2 = 2 M^2 - 2 q . k: a near query and key have a large dot product. Per round r, queries and keys
are sorted *separately* by the same random hash of F(q) and G(k), both sorted lists are cut into clusters of
``cluster_size`` c consecutive entries (balanced: every cluster but the last holds exactly c real tokens), and
the t-th query cluster attends the t-th key cluster (a block-diagonal pattern in the sorted orders). ``rounds``
independent hashes are combined exactly: each round's softmax over its pairs, a pair found in several rounds
counted in the first of them only (Reformer instead lowers its score by log n in each of its n rounds: the same
sum), is merged with the others through their log-sum-exp normalisers, O = sum_r exp(L_r - L) O_r,
L = logsumexp_r L_r. The result is exactly the softmax over the *union* of the rounds' pairs with the plain scores
(each pair counted once): the dense ``weights()``.

Choices made here:

* **The hash is one random projection per round, sorted as a continuous value** (the angle of F(q) or G(k)
  to a random direction a_r ~ N(0, I_{d+2}): all F(q), G(k) have norm M, so a_r . x orders them by angle): the
  continuous form of Reformer's hash (with 2 buckets it is sign(a_r . x)), and SMYRF's E2LSH projection sorted
  before flooring. Reformer's argmax over ``buckets`` rotations, sorted by (bucket, position), was measured and
  rejected: queries and keys are sorted separately, and their populations of each bucket differ (F and G live
  on different coordinates), so query cluster t and key cluster t hold unrelated buckets; on synthetic
  clustered and low-rank inputs (N = 512 and 2048, c = 64, 2 rounds) that covered 25-30 % and 6-8 % of the
  attention mass, no better than random clusters (25 %, 6 %), while the sorted projection covered 53-64 % and
  17-24 %. A rank-based cut of one projection needs no bucket count (nothing to tune with the length).
* Ties are broken by position (a stable sort); padded queries and keys are sorted last (their hash is +inf),
  so they never take a cluster slot of a real token and M^2 ignores them: appending padding changes nothing.
* Query cluster t attends key cluster min(t, T_k - 1), T_k the number of clusters holding a real key: for
  self-attention (as many real queries as keys) that is cluster t; with more real queries than keys (cross
  attention) the last clusters of queries attend the last cluster of keys instead of nothing.
* The directions are state: ``(rounds, head_dim + 2)`` drawn from ``seed``, **shared by every head** (heads are
  unknown when a layer is patched; each head still sorts its own projections), saved with the model and
  redrawn only by ``approx.redraw``. Hashing carries no gradient; attention does.
* Defaults: ``cluster_size = 64``, Reformer's chunk length (transformers' ``lsh_attn_chunk_length``) and one
  kernel block; ``rounds = 4``: the Reformer paper compares 1, 2, 4 and 8 hashes and quality improves with each;
  transformers' default of 1 hash leaves most of the attention mass out (on the synthetic inputs above, N = 512,
  c = 64: 31 % / 53 % / 76 % covered with 1 / 2 / 4 rounds). 4 x 64 = 256 keys per query.
* ``c >= N`` puts every real key in one cluster: exact attention through the same code. The first round then finds
  every pair, so a call whose padded length is at most c runs that round alone (cost: one round), whatever
  ``rounds`` says; the others would find the same pairs and be masked whole. A row with at most c real tokens in a
  longer batch is exact too (its later rounds are computed and masked; the cost model, per row, counts one round).
  ``exact_below`` (default 0) is the generic fallback to exact attention.

Runs on its own kernel (:func:`attend_rounds`): per round, queries and keys gathered into their sorted orders,
each query cluster against its key cluster as one batched product (B, H, N / c, c, c), the pairs of earlier rounds
masked; each round merged into the ones before it with :func:`~._blocksparse.merge`. On the CPU, without gradients or
dropout, the eager engine runs :mod:`._lshrounds` instead: the same computation on buffers allocated once per call,
every round of a group of (batch, head) rows before the next group, each round merged into the output by gathers
through the inverse of its sort, the pairs of earlier rounds dropped by float arithmetic on the cluster numbers
(1.35x faster than this loop at N = 4096, 1.68x at 16384, side by side, one-off, before the last two changes, which
made it another 1.17-1.34x and 1.06-1.12x faster). ``weights()`` and the graph statistics build the union of
the rounds as one dense pattern (:mod:`._blocksparse`). Cost: rounds * :func:`pairs_per_round` (about N c) pairs plus the hashing.
``engine="fused"`` runs CPU inference (no gradient, no dropout) on a C++ kernel instead (:mod:`._lshfused`,
``csrc/lsh_rounds.cpp``, built on first use): per (batch, head) row, round and query cluster, the gathers, the two
products (BLAS), the masking and softmax in vector registers and the merge into the running rows, with the cluster's
data in cache; elsewhere it runs what the eager engine runs.
``engine="compiled"`` runs each round's masking and softmax (:func:`round_blocks`) through torch.compile, 32 query
blocks per call over one static shape (on the CPU slower than the eager inference path at every length measured;
the docs' Speed page); rows shorter than a cluster, whose block is as long as they are, stay eager.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import MethodConfig, option
from ..registry import Cost, ExactLimit, register
from . import _blocksparse, _compiled, _fallback, _lshfused, _lshrounds
from ._blocksparse import Pattern
from ._common import compute_dtype, exact_rows, exact_weight_rows, safe_key_mask


@dataclasses.dataclass(frozen=True)
class LshConfig(MethodConfig):
    """Options of LSH (Reformer / SMYRF) attention."""

    method = "lsh"

    cluster_size: int = option(
        64, "c: queries and keys per cluster (balanced); query cluster t attends key cluster t (Reformer's chunk 64)"
    )
    rounds: int = option(4, "independent hashing rounds, merged exactly with duplicate pairs counted once")
    seed: int = option(0, "seed of the random hash directions (one per round, shared by the heads)")
    exact_below: int = option(0, "sequences with fewer real tokens get exact attention (0 = never)")
    engine: str = _compiled.engine_option(
        "'eager': plain PyTorch, operator by operator; 'fused': CPU inference on a C++ kernel, one pass per query "
        "cluster (built on first use: a C++ compiler and ninja, about half a minute, then cached on disk; the fastest "
        "on the CPU, see the docs' Speed page; with a gradient, attention dropout or off the CPU it runs what "
        "'eager' runs); 'compiled': each round's masking, softmax and sums fused by "
        "torch.compile around the two batched products (on the CPU slower than eager inference at every length "
        "measured, 1024 to 16384 tokens, "
        "see the docs' Speed page; the first call compiles, seconds; attention dropout and inputs "
        "shorter than a cluster stay eager)"
    )

    def check(self) -> None:
        _compiled.check_engine(self, extra=("fused",))
        self.require(self.cluster_size >= 1, "cluster_size", "at least one token per cluster")
        self.require(self.rounds >= 1, "rounds", "at least one hashing round")
        self.require(self.seed >= 0, "seed", "seeds are non-negative integers")
        self.require(self.exact_below >= 0, "exact_below", "a length: 0 (off) or more")


def init_state(config: LshConfig, *, head_dim: int, seed: int) -> dict[str, torch.Tensor]:
    """One random direction a_r ~ N(0, I) of the transformed space (head_dim + 2) per round, shared by the heads."""
    g = torch.Generator().manual_seed(seed)
    return {"directions": torch.randn(config.rounds, head_dim + 2, generator=g)}


def _rounds(config: LshConfig, n: int, s: int) -> int:
    """The rounds a call runs: one when a cluster holds every query and key (``c >= max(N, S)``), since the first
    round then finds every pair and the others would only find them again; else ``rounds``."""
    return 1 if config.cluster_size >= max(n, s) else config.rounds


def _first_rounds(config: LshConfig, state: dict[str, torch.Tensor], n: int, s: int) -> dict[str, torch.Tensor]:
    """``state`` with the directions of the rounds a call runs (:func:`_rounds`)."""
    return {**state, "directions": state["directions"][: _rounds(config, n, s)]}


def pairs_per_round(c: int, n: int, s: int) -> int:
    """The query-key pairs of one round: query cluster t (c queries, the last one N - (T_q - 1) c) against key cluster
    min(t, T_k - 1) (c keys, the last one S - (T_k - 1) c), T = ceil(length / c) clusters: N c when c divides N = S."""
    if n <= 0 or s <= 0:
        return 0
    tq, tk = -(-n // c), -(-s // c)
    last_q, last_k = n - (tq - 1) * c, s - (tk - 1) * c
    full = min(tq - 1, tk - 1)  # full query clusters against full key clusters
    return full * c * c + (tq - 1 - full) * c * last_k + last_q * (c if tq - 1 < tk - 1 else last_k)


def cost(config: LshConfig, *, n: int, s: int, d: int, dv: int) -> Cost:
    """rounds * :func:`pairs_per_round` pairs (about rounds * N * min(c, S); duplicates included: they are computed),
    plus the hashing: the norms and one projection per round of every query and key; one round when a cluster holds
    every token (:func:`_rounds`)."""
    if _fallback.exact_for_length(n, exact_below=config.exact_below):
        return Cost(flops=2 * n * s * (d + dv), qk_pairs=n * s, matmul_macs=n * s * (d + dv))
    rounds = _rounds(config, n, s)
    pairs = rounds * pairs_per_round(config.cluster_size, n, s)
    hashing = 2 * (n + s) * d + 2 * (n + s) * rounds * (d + 2)
    return Cost(flops=2 * pairs * (d + dv) + hashing, qk_pairs=pairs, matmul_macs=pairs * (d + dv))


# ------------------------------------------------------------------------------------------------ hashing


# Elements of x * x per block of rows in _squared_norms: 1 MiB in float32, a buffer reused from block to block
_NORM_ELEMENTS = 1 << 18


def _squared_norms(x: torch.Tensor) -> torch.Tensor:
    """(B, H, L, d) -> (B, H, L): ``(x * x).sum(-1)``, to the bit, a block of rows at a time through one reused buffer
    rather than one (B, H, L, d) temporary (about 100 MB for the queries and keys of 12 heads at L = 16384, a page
    fault for every 4 KiB of it)."""
    b, h, n, d = x.shape
    step = max(1, _NORM_ELEMENTS // max(1, b * h * d))
    if step >= n:
        return (x * x).sum(-1)
    out = x.new_empty(b, h, n)
    buf = x.new_empty(b, h, step, d)
    for i in range(0, n, step):
        j = min(n, i + step)
        sq = torch.mul(x[:, :, i:j], x[:, :, i:j], out=buf[:, :, : j - i])
        torch.sum(sq, -1, out=out[:, :, i:j])
    return out


def hash_projections(q, k, key_mask, query_mask, directions):
    """a_r . F(q) and a_r . G(k) for every round: (R, B, H, N) and (R, B, H, S) in the compute dtype, +inf for
    padded queries and keys (sorted last). M^2 = max |q|^2 + max |k|^2 over the real tokens of each (B, H)."""
    dt = compute_dtype(q.dtype)
    qf, kf = q.detach().to(dt), k.detach().to(dt)
    d = qf.shape[-1]
    a = directions.to(device=q.device, dtype=dt)  # (R, d + 2)
    qn, kn = _squared_norms(qf), _squared_norms(kf)  # (B, H, N), (B, H, S)
    q_real = None if query_mask is None else query_mask[:, None, :]
    k_real = None if key_mask is None else key_mask[:, None, :]
    q_max = (qn if q_real is None else qn.masked_fill(~q_real, 0.0)).amax(-1, keepdim=True)
    k_max = (kn if k_real is None else kn.masked_fill(~k_real, 0.0)).amax(-1, keepdim=True)
    m2 = q_max + k_max  # (B, H, 1)
    # F(q) = [q; 0; sqrt(M^2 - |q|^2)], G(k) = [k; sqrt(M^2 - |k|^2); 0]
    pq = qf @ a[:, :d].t() + (m2 - qn).clamp(min=0.0).sqrt()[..., None] * a[:, d + 1]  # (B, H, N, R)
    pk = kf @ a[:, :d].t() + (m2 - kn).clamp(min=0.0).sqrt()[..., None] * a[:, d]  # (B, H, S, R)
    if q_real is not None:
        pq = pq.masked_fill(~q_real[..., None], float("inf"))
    if k_real is not None:
        pk = pk.masked_fill(~k_real[..., None], float("inf"))
    return pq.permute(3, 0, 1, 2), pk.permute(3, 0, 1, 2)


def _order_keys(proj: torch.Tensor) -> torch.Tensor:
    """Integers in the order of the floats ``proj`` (float32 -> int32, float64 -> int64; -0.0 and 0.0 equal, +inf
    last), so that the sort below is an integer sort: 17 % faster than the float sort on the CPU (one-off, 2 threads:
    24 against 29 ms for 4 x 12 rows of 16384) and the same order. A float's bits read as a signed integer are in
    order for non-negative floats; a negative float's magnitude bits are negated. NaN has no place in either order."""
    if proj.dtype == torch.float32:
        bits, mag = proj.view(torch.int32), 0x7FFFFFFF
    elif proj.dtype == torch.float64:
        bits, mag = proj.view(torch.int64), 0x7FFFFFFFFFFFFFFF
    else:
        return proj
    return torch.where(bits < 0, -(bits & mag), bits)


def _sort_rows(proj: torch.Tensor) -> torch.Tensor:
    """The stable order of every row (last dimension) of ``proj``. On the CPU, float32 rows are sorted as one flat list
    of 64-bit integers, the row's number times 2^32 plus the float's order (:func:`_order_keys`, within +-2^31), so
    that rows stay apart and ties keep their positions: faster than a sort per row (one-off, 2 threads, 4 x 12 rows,
    medians of 20 interleaved calls, making the keys included: 2.5 against 5.0 ms at N = 4096, 15.0 against 23.7 ms
    at 16384). Elsewhere (float64, other devices), ``argsort`` row by row."""
    keys = _order_keys(proj)
    if keys.dtype != torch.int32 or proj.device.type != "cpu" or keys.numel() == 0:
        return keys.argsort(dim=-1, stable=True)
    *lead, length = keys.shape
    rows = keys.numel() // length
    row = torch.arange(rows, device=keys.device)
    flat = keys.to(torch.int64, memory_format=torch.contiguous_format).view(rows, length)
    flat.add_((row << 32)[:, None])  # row r's keys lie in (r 2^32 - 2^31, r 2^32 + 2^31): apart from every other row's
    order = torch.sort(flat.view(-1), stable=True).indices.view(rows, length)
    return order.sub_((row * length)[:, None]).view(*lead, length)


def _clusters(proj: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort (stable: ties by position) and cut into clusters of c: the sorted positions and every position's
    cluster, both (R, B, H, L)."""
    order = _sort_rows(proj)
    slots = torch.arange(proj.shape[-1], device=proj.device).div(c, rounding_mode="floor")  # each slot's cluster
    cluster = torch.empty_like(order).scatter_(-1, order, slots.expand_as(order))
    return order, cluster


@dataclasses.dataclass
class Hashed:
    """The rounds' sorted orders and clusters: ``q_order``/``target`` (R, B, H, N): queries' sorted positions and
    the key cluster each query attends; ``k_order``/``k_cluster`` (R, B, H, S); ``kv`` (B, 1, Tq, 1) the key
    block of every query block; ``block`` the kernel's block (c, or the padded length when c exceeds it)."""

    q_order: torch.Tensor
    target: torch.Tensor
    k_order: torch.Tensor
    k_cluster: torch.Tensor
    kv: torch.Tensor
    block: int


def hash_and_sort(q, k, key_mask, query_mask, config: LshConfig, state) -> Hashed:
    """Every round's hash, separate sorts of the queries and keys, and their clusters of ``cluster_size``."""
    b, _, n, _ = q.shape
    s = k.shape[2]
    c = config.cluster_size
    key_mask = safe_key_mask(key_mask)  # a row without real keys attends every key
    pq, pk = hash_projections(q, k, key_mask, query_mask, state["directions"])
    q_order, q_cluster = _clusters(pq, c)
    k_order, k_cluster = _clusters(pk, c)
    real_keys = torch.full((b,), s, device=q.device) if key_mask is None else key_mask.sum(-1)
    last = (real_keys + c - 1).div(c, rounding_mode="floor").clamp(min=1) - 1  # (B,) last cluster with a real key
    target = torch.minimum(q_cluster, last.view(1, b, 1, 1))
    block = min(c, max(n, s, 1))  # one block = one cluster (c >= the padded length: one block holds all)
    tq = -(-n // block)
    kv = torch.minimum(torch.arange(tq, device=q.device).view(1, tq), last.view(b, 1))  # (B, Tq)
    return Hashed(q_order, target, k_order, k_cluster, kv.view(b, 1, tq, 1), block)


def _at(table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """table (R, B, H, L) at original positions pos (B, H, ...) -> (R, B, H, ...)."""
    r, (b, h) = table.shape[0], pos.shape[:2]
    idx = pos.reshape(b, h, -1)[None].expand(r, b, h, -1)
    return table.gather(-1, idx).view(r, *pos.shape)


def pair_counts(hashed: Hashed, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """In how many rounds query i attends key j, elementwise on broadcastable original positions (the kernel's
    i (B, H, *lead, r, 1) and j (B, H, *lead, 1, E) -> (B, H, *lead, r, E)): the rounds where the key cluster
    query i attends is key j's cluster. A lookup per (B, H), so the patterns say ``flex=False``."""
    return (_at(hashed.target, i) == _at(hashed.k_cluster, j)).sum(0)


# Largest score chunk of one round, in elements (blocks * c * c), on the differentiable path: bounds the memory of a
# round (smaller chunks were measured no faster on the CPU; inference has its own path and chunk, :mod:`._lshrounds`)
_CHUNK_ELEMENTS = 1 << 22
# engine="compiled": query blocks per compiled call (the last one filled up), so that one static shape, compiled once,
# serves every length (inductor's CPU loops over dynamic shapes ran slower than the eager code); 32 to 64 blocks of
# 128 x 128 ran fastest per block on 2 CPU cores
COMPILED_BLOCKS = 32


def _fill(t: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """``t`` filled up with zeros along ``dim`` to ``size``."""
    shape = list(t.shape)
    shape[dim] = size - shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def _compiled_round(qs, ks, vs, bad, earlier, rounds: int, scale: float) -> tuple[list, list]:
    """One round's blocks through the compiled :func:`round_blocks`, :data:`COMPILED_BLOCKS` at a time (the last call
    filled up with blocks of zeros, their rows dropped): every call has one shape, so one compilation serves every
    length. ``earlier``: the earlier rounds' (query target, key cluster) pairs. Returns the outputs and
    log-sum-exps of the calls, in order."""
    x, blk = qs.shape[:2]
    targets = bad.new_full((max(1, rounds - 1), x, blk, 1), -1, dtype=torch.int32)  # -1: no earlier round
    clusters = bad.new_zeros((max(1, rounds - 1), x, 1, blk), dtype=torch.int32)
    for e, (target, cluster) in enumerate(earlier):
        targets[e], clusters[e] = target, cluster
    outs, lses = [], []
    for c0 in range(0, x, COMPILED_BLOCKS):
        c1, cut = c0 + COMPILED_BLOCKS, min(x, c0 + COMPILED_BLOCKS) - c0
        chunk = [t[c0:c1] for t in (qs, ks, vs, bad)] + [t[:, c0:c1] for t in (targets, clusters)]
        if cut < COMPILED_BLOCKS:
            chunk = [_fill(t, COMPILED_BLOCKS, dim=1 if i > 3 else 0) for i, t in enumerate(chunk)]
        o, lse = _compiled.call(round_blocks, *chunk, scale, method="lsh", dynamic=False)
        outs.append(o[:cut])
        lses.append(lse[:cut])
    return outs, lses


def round_blocks(qs, ks, vs, bad, targets, clusters, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Query blocks against their key blocks in one round: the softmax over the pairs left, (output (X, c, dv),
    log-sum-exp (X, c)); a row without a pair gives 0 and -inf. Masked: keys flagged ``bad`` (X, 1, c) (past the
    end, padding) and the pairs an earlier round found (query target ``targets`` (E, X, c, 1) equal to key cluster
    ``clusters`` (E, X, 1, c) in some earlier round; E = 1 with a target of -1 for none). Plain torch, nothing
    depending on the data's values: ``engine="compiled"`` fuses the mask, maximum, exponentials and sums into one
    loop around the two products."""
    sc = torch.bmm(qs, ks.transpose(1, 2)) * scale
    sc = sc.masked_fill(bad | (targets == clusters).any(0), float("-inf"))
    top = sc.detach().amax(-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # a row with no pair: exp(-inf) = 0 below
    e = (sc - top).exp()
    z = e.sum(-1, keepdim=True)
    return torch.bmm(e, vs) / z.clamp(min=torch.finfo(z.dtype).tiny), (top + z.log())[..., 0]


def attend_rounds(
    q, k, v, hashed: Hashed, *, key_mask, scale: float, dropout: float = 0.0, engine: str = "eager"
) -> torch.Tensor:
    """The rounds merged, on LSH's own kernel: (B, H, N, dv) in v's dtype.

    Per round, queries, keys and values are gathered into their sorted orders (rows of one flat table), and query
    cluster t meets its key cluster as one batched product, (B H Tq, c, c) scores in chunks: no per-pair look-up. A
    pair found in several rounds is counted in the first round that finds it and masked in the later ones (each pair
    once, as Reformer's lowering of its score by log n does), so the merged result is the softmax over the union of
    the rounds' pairs; each round keeps its log-sum-exp and is merged into the rounds before it as it ends
    (:func:`~._blocksparse.merge`). Gradients flow through every step but the hashing. Attention dropout drops each
    pair once, in the round that counts it (Reformer draws a mask per round: the same expectation).
    ``engine="compiled"``: each chunk through :func:`round_blocks` compiled (eager under attention dropout)."""
    from ._blocksparse import merge

    if engine == "fused":
        if _lshfused.usable(q, k, v, dropout=dropout, clusters=-(-k.shape[2] // hashed.block)):
            return _lshfused.attend(q, k, v, hashed, key_mask=key_mask, scale=scale)
        if q.device.type != "cpu":
            _lshfused.warn_off_cpu(q.device)
        engine = "eager"  # a gradient, attention dropout, another device: what the eager engine runs
    if engine == "eager" and _lshrounds.usable(q, k, v, dropout=dropout):
        return _lshrounds.attend(q, k, v, hashed, key_mask=key_mask, scale=scale)
    t = _lshrounds.tables(q, k, v, hashed, safe_key_mask(key_mask))  # the flat tables, shared with the inference path
    b, h, n, blk, dt = t.b, t.h, t.n, t.blk, t.dt
    d, dv, bh, dev, out_dtype = q.shape[-1], v.shape[-1], b * h, q.device, v.dtype
    x = bh * t.tq  # query clusters, one key cluster each
    per = max(1, _CHUNK_ELEMENTS // (blk * blk))
    rounds = hashed.q_order.shape[0]
    out = out_lse = None  # the rounds so far, merged (one output held, not one per round)
    neg = torch.tensor(float("-inf"), dtype=dt, device=dev)
    for r in range(rounds):
        lay = _lshrounds.layout(t, hashed, r)  # sorted slots, key rows and masks, shared with the inference path
        qs = t.qf.index_select(0, lay.qrows).view(x, blk, d)
        ks, vs = t.kf.index_select(0, lay.krows).view(x, blk, d), t.vf.index_select(0, lay.krows).view(x, blk, dv)
        # keys a query block may not use: past the end, padding, or found with it in an earlier round
        bad, earlier, masked = lay.bad, lay.pairs, r > 0 or lay.any_bad
        compiled = engine == "compiled" and dropout == 0.0
        o_r, lse_r = _compiled_round(qs, ks, vs, bad, earlier, rounds, scale) if compiled else ([], [])
        for c0 in () if compiled else range(0, x, per):
            c1 = min(x, c0 + per)
            sc = torch.baddbmm(qs.new_empty(()), qs[c0:c1], ks[c0:c1].transpose(1, 2), beta=0.0, alpha=scale)
            if masked:
                mask = bad[c0:c1]
                for target, cluster in earlier:
                    mask = mask | (target[c0:c1] == cluster[c0:c1])
                sc = sc.masked_fill_(mask, neg)
            top = sc.detach().amax(-1, keepdim=True)
            top = top.masked_fill(torch.isinf(top), 0.0)  # a row with no pair: exp(-inf) = 0 below
            e = sc.sub_(top).exp_()
            z = e.sum(-1, keepdim=True)
            if dropout > 0.0:
                e = torch.nn.functional.dropout(e, dropout)
            o_r.append(torch.bmm(e, vs[c0:c1]) / z.clamp(min=torch.finfo(dt).tiny))  # no pair: 0, not 0 / 0
            lse_r.append((top + z.log())[..., 0])  # -inf for a row with no pair
        o = (o_r[0] if len(o_r) == 1 else torch.cat(o_r)).view(bh, t.tq * blk, dv)[:, :n]
        lse = (lse_r[0] if len(lse_r) == 1 else torch.cat(lse_r)).view(bh, t.tq * blk)[:, :n]
        back = (hashed.q_order[r].reshape(bh, n) + t.q_base).reshape(-1)  # sorted slot -> original row
        o = o.new_empty(bh * n, dv).index_copy_(0, back, o.reshape(-1, dv)).view(b, h, n, dv)
        lse = lse.new_empty(bh * n).index_copy_(0, back, lse.reshape(-1)).view(b, h, n)
        out, out_lse = (o, lse) if out is None else merge(out, out_lse, o, lse)
    return out.to(out_dtype)


def union_pattern(hashed: Hashed, *, n: int, s: int) -> Pattern:
    """The union of the rounds' pairs as one pattern (a single block over everything, the element mask "found in
    some round"): what the merged rounds compute, for ``weights()`` and graph statistics (O(N S))."""
    one = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=hashed.kv.device)
    return Pattern(max(n, s, 1), one, allow=lambda i, j: pair_counts(hashed, i, j) > 0, flex=False)


# ----------------------------------------------------------------------------------------------- dense paths


def weights(q, k, *, key_mask, query_mask, scale, config, state) -> torch.Tensor:
    """The dense (B, H, N, S) matrix of the merged rounds: softmax over the union of their pairs (measuring only)."""
    b, _, n, _ = q.shape

    def approximate() -> torch.Tensor:
        hashed = hash_and_sort(q, k, key_mask, query_mask, config, _first_rounds(config, state, n, k.shape[2]))
        pat = union_pattern(hashed, n=n, s=k.shape[2])
        return _blocksparse.dense_weights(q, k, pat, key_mask=key_mask, scale=scale)

    return _fallback.with_fallback(
        approximate,
        exact_weight_rows(q, k, key_mask, scale),
        query_mask=query_mask,
        shape=(b, n),
        device=q.device,
        exact_below=config.exact_below,
    )


def graph_stats(q, k, *, key_mask, query_mask, scale, config, state) -> dict[str, torch.Tensor]:
    """Sparsity and recall of the union of the rounds' pairs against the entmax (alpha 1.5) gold graph."""
    hashed = hash_and_sort(q, k, key_mask, query_mask, config, _first_rounds(config, state, q.shape[2], k.shape[2]))
    pat = union_pattern(hashed, n=q.shape[2], s=k.shape[2])
    exact = _fallback.exact_rows(query_mask, q.shape[2], q.shape[0], q.device, exact_below=config.exact_below)
    return _blocksparse.pattern_stats(q, k, pat, key_mask=key_mask, scale=scale, exact_rows=exact)


@register(
    "lsh",
    LshConfig,
    cost=cost,
    init_state=init_state,
    weights=weights,
    stats=graph_stats,
    test_options={"cluster_size": 8, "rounds": 2},
    # one cluster holding every key: round 0 finds every pair (later rounds, which would find them again, are not
    # run; tests/test_lsh.py checks their de-duplication on its own)
    exact_limit=ExactLimit(options=lambda n: {"cluster_size": n}),
)
def lsh_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    scale: float,
    config: LshConfig,
    state: dict[str, torch.Tensor],
    dropout: float = 0.0,
) -> torch.Tensor:
    """LSH attention (Reformer, asymmetric as SMYRF): sorted hash clusters, rounds merged, O(rounds N c)."""
    b, _, n, _ = q.shape

    def approximate() -> torch.Tensor:
        hashed = hash_and_sort(q, k, key_mask, query_mask, config, _first_rounds(config, state, n, k.shape[2]))
        # rows shorter than a cluster make the block as long as they are: a shape per length, not worth compiling
        engine = config.engine if hashed.block == config.cluster_size or config.engine == "fused" else "eager"
        return attend_rounds(q, k, v, hashed, key_mask=key_mask, scale=scale, dropout=dropout, engine=engine)

    return _fallback.with_fallback(
        approximate,
        exact_rows(q, k, v, key_mask, scale, dropout),
        query_mask=query_mask,
        shape=(b, n),
        device=q.device,
        exact_below=config.exact_below,
    )
