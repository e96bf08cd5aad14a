"""Improved clustered attention ("i-clustered").

Vyas, Katharopoulos, Fleuret, "Fast Transformers with Clustered Attention", NeurIPS 2020 (arXiv 2007.04825),
section 3.3. On top of the clusters and centroid attention A^c of clustered attention (``clustered.py``):

1. T_j: the k real keys with the largest A^c_j for cluster j;
2. m_j = sum over T_j of A^c_j, the mass the centroid puts on them;
3. for a query i of cluster j, exact scores on T_j only: A^u_i = m_j softmax(s q_i K_{T_j}^T);
4. V_i = sum_{l in T_j} A^u_il V_l + (V^c_j - sum_{l in T_j} A^c_jl V_l).

With k at least the number of real keys this is exact attention, and its rows are never further (L1) from
the exact rows than the clustered ones (the paper's Proposition 2).

``topk_by="spread"`` (not in the paper; measured in ``recipes/sharper_clustering.py``) chooses T_j by the members'
expected weight instead of the centroid's: a member q = Q^c_j + e with e ~ N(0, diag(sigma_j^2)) (sigma_j^2 the
per-dimension variance of cluster j's real queries) has E[exp(s q . k)] = exp(s Q^c_j . k + s^2/2 sum_m sigma_jm^2
k_m^2), so keys are ranked by log A^c_jl + s^2/2 (sigma_j^2 . k_l^2), one more (C, S) product. Steps 2-4 are
unchanged (m_j is still the centroid's mass on T_j), and so are the exact limits. Cost per batch item and head:
clustered attention plus O(N k max(d, dv)).

Attention dropout (training) acts on the centroid attention A^c off the top-k keys (the remainder term, one
mask per cluster) and on each query's recomputed top-k softmax; the top-k keys and the mass m_j are chosen
from A^c without dropout, so the expected output is the output without dropout.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..config import option
from ..registry import Cost, ExactLimit, register
from . import _compiled
from ._common import block_rows, block_size, softmax_, tracked
from .clustered import ClusteredConfig, centroid_attention, centroids, exact_for, gather_clusters, run
from .clustered import cost as clustered_cost
from .clustered import init_state as clustered_init_state

TOPK_BY = ("centroid", "spread")


@dataclasses.dataclass(frozen=True)
class IClusteredConfig(ClusteredConfig):
    """Options of improved clustered attention: those of clustered attention plus ``topk``."""

    method = "i-clustered"

    topk: int = option(32, "keys k per cluster whose scores are recomputed exactly for each query (reference 32)")
    topk_by: str = option(
        "centroid",
        "how each cluster's k keys are chosen: 'centroid' (the k largest weights of the centroid's attention A^c, "
        "the paper) or 'spread' (A^c corrected by the spread of the cluster's queries: the members' expected weight "
        "under a diagonal Gaussian, one more C x S product)",
    )

    def check(self) -> None:
        super().check()
        self.require(self.topk >= 1, "topk", "need at least one key per cluster")
        self.require(self.topk_by in TOPK_BY, "topk_by", f"one of {', '.join(map(repr, TOPK_BY))}")


def cost(config: IClusteredConfig, *, n: int, s: int, d: int, dv: int) -> Cost:
    base = clustered_cost(config, n=n, s=s, d=d, dv=dv)
    if exact_for(config, n):
        return base
    k = min(config.topk, s)
    # spread: the members' variances (N d, not a matrix product) and their product with the squared keys (C S d)
    product = 0 if config.topk_by == "centroid" else config.clusters * s * d
    variances = 0 if config.topk_by == "centroid" else 2 * n * d
    return Cost(
        flops=base.flops + 2 * n * k * (d + dv) + variances + 2 * product,
        qk_pairs=base.qk_pairs + n * k,
        matmul_macs=base.matmul_macs + n * k * (d + dv) + product,
    )


def cluster_spread(q: torch.Tensor, assign: torch.Tensor, query_mask: torch.Tensor | None, qc: torch.Tensor):
    """Per-dimension variance of each cluster's real queries around its centroid ``qc``: (B, H, C, d)."""
    return (centroids(q.square(), assign, query_mask, qc.shape[2])[0] - qc.square()).clamp_min_(0.0)


def _key_ranks(ac: torch.Tensor, k: torch.Tensor, spread: torch.Tensor | None, scale: float) -> torch.Tensor | None:
    """What ``topk_by="spread"`` ranks keys by: log A^c + s^2/2 (sigma^2 . k^2), (B, H, C, S); None for "centroid"
    (A^c itself). A weight that underflowed to 0 counts as the smallest normal number (plus its spread term), so its
    rank stays finite and a real key still ranks above a padded one (:func:`_top_keys` puts those at -inf)."""
    if spread is None:
        return None
    tiny = torch.finfo(ac.dtype).tiny
    return ac.clamp_min(tiny).log().add_(spread @ k.square().transpose(-1, -2), alpha=0.5 * scale * scale)


def _top_keys(ac: torch.Tensor, key_mask: torch.Tensor | None, topk: int, rank: torch.Tensor | None = None):
    """Indices (B, H, C, k) of each cluster's top-k real keys, their A^c weights, and which are real. Keys are
    ranked by ``rank`` (finite; :func:`_key_ranks`) when given, else by A^c."""
    k = min(topk, ac.shape[-1])
    if key_mask is None:
        if rank is None:
            weight, index = ac.topk(k, dim=-1)
            return index, weight, None
        index = rank.topk(k, dim=-1).indices
        return index, ac.gather(-1, index), None
    real = key_mask[:, None, None, :]  # (B, 1, 1, S)
    by, below = (ac, -1.0) if rank is None else (rank, float("-inf"))
    index = by.masked_fill(~real, below).topk(k, dim=-1).indices  # real keys first, even at weight 0
    real_top = real.expand_as(ac).gather(-1, index)  # only False when k exceeds the real keys
    return index, ac.gather(-1, index), real_top


# bytes of A^c held at a time by _centroid_summary
_CENTROID_BYTES = 16 * 2**20


def _centroid_summary(
    qc, k, v, key_mask, topk: int, scale: float, dropout: float = 0.0, *, chunked: bool = True, spread=None
):
    """What improved clustered attention needs of A^c (B, H, C, S): the top-k keys of every cluster (indices,
    weights, which are real: see :func:`_top_keys`), A^c V (B, H, C, dv) and the top-k weights that A^c V
    used (B, H, C, k): with ``dropout``, A^c V and those come from A^c after attention dropout.

    A^c is computed for a few (batch row, head) series at a time, at most ``_CENTROID_BYTES`` of it, instead
    of one (B, H, C, S) tensor (78 MB at N = 16384, C = 100): a lower peak memory at the same speed. Not
    ``chunked`` (compiled code: one graph, no loop): every series at once. ``spread`` (B, H, C, d): the clusters'
    variances, to rank keys with (``topk_by="spread"``).
    """
    batch, heads, clusters, d = qc.shape
    s, bh = k.shape[2], batch * heads
    q3, k3, v3 = qc.reshape(bh, 1, clusters, d), k.reshape(bh, 1, s, d), v.reshape(bh, 1, s, v.shape[-1])
    m2 = None if key_mask is None else key_mask[:, None, :].expand(batch, heads, s).reshape(bh, s)
    sp = None if spread is None else spread.reshape(bh, 1, clusters, d)
    per = max(1, _CENTROID_BYTES // (clusters * s * qc.element_size())) if chunked else bh  # series per chunk
    parts = []
    for start in range(0, bh, per):
        rows = slice(start, start + per)
        mask = None if m2 is None else m2[rows]
        ac = centroid_attention(q3[rows], k3[rows], mask, scale)  # (b, 1, C, S)
        rank = None if sp is None else _key_ranks(ac, k3[rows], sp[rows], scale)
        index, weight, real_top = _top_keys(ac, mask, topk, rank)
        if dropout > 0.0:
            ac = F.dropout(ac, dropout)
            parts.append((index, weight, real_top, ac @ v3[rows], ac.gather(-1, index)))
        else:
            parts.append((index, weight, real_top, ac @ v3[rows], weight))

    def join(i: int) -> torch.Tensor | None:
        if parts[0][i] is None:
            return None
        return torch.cat([part[i] for part in parts]).view(batch, heads, *parts[0][i].shape[2:])

    return tuple(join(i) for i in range(5))


def _gather_keys(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of x (B, H, S, F) at index (B, H, C, k) -> (B, H, C, k, F), copied whole with ``index_select``."""
    batch, heads, c, k = index.shape
    s = x.shape[2]
    offset = torch.arange(batch * heads, device=x.device).view(batch, heads, 1, 1) * s
    rows = x.reshape(batch * heads * s, x.shape[-1]).index_select(0, (index + offset).reshape(-1))
    return rows.view(batch, heads, c, k, x.shape[-1])


def _recomputed(q, kt, assign, mass, real_top, scale) -> torch.Tensor:
    """A^u = m_j softmax(s q_i K_{T_j}^T) per query, (B, H, N, k): the plain O(N k d)-memory form, used by
    the dense weights (analysis) path; the fast path computes the same in cluster blocks."""
    keys = gather_clusters(kt, assign)  # (B, H, n, k, d)
    scores = (keys @ q[..., None]).squeeze(-1) * scale  # (B, H, n, k)
    if real_top is not None:
        scores = scores.masked_fill(~gather_clusters(real_top, assign), float("-inf"))
    return scores.softmax(-1) * gather_clusters(mass, assign)[..., None]


# In CPU inference on short inputs (at most _ROWS_UP_TO queries and keys, and each cluster's k keys at least an eighth
# of the keys), the top-k scores are taken from every query's row of keys instead, :func:`_improved_rows`. There the
# per-cluster tables of top keys and values, (C, k, d) per head, are larger than the keys they come from (25 clusters
# of 32 keys against 128 tokens), and each block of queries copies its cluster's tables. One-off, 12 heads of 32,
# padded batches of 4096 tokens, 2 threads, outputs within 1.5e-6, k = 32: 1.7x faster at 128 tokens, 1.1-1.2x at 256,
# slower at 384 (0.8x) and 512 (0.7x); a reviewer's runs with other k: 1.8x (k = 64) and 2.8x (k = 128) at 256 tokens,
# but 0.9x (k = 64) and 0.66x (k = 128) at 512-1024, and the (B, H, N, S) mask grows with N S: hence a bound on the
# length too. ``_ROWS_UP_TO = 0`` gives the blocks everywhere (what results measured before this route ran).
_ROWS_UP_TO = 256
_ROWS_KEYS_PER_TOP = 8

# rows of queries per chunk of blocks in :func:`_improved`: on the CPU small chunks stay hot in cache; on a GPU,
# where every chunk costs a dozen kernel launches, the blocks of up to a million queries go at once
_CHUNK_ROWS = 8192
_CHUNK_ROWS_GPU = 1 << 20


def _improved(q, k, v, key_mask, assign, qc, topk, scale, dropout: float = 0.0, *, chunked: bool = True, spread=None):
    """Improved clustered output (B, H, N, dv) from the clusters and their centroids.

    Queries are sorted by cluster into blocks that share their cluster's top-k keys, so the recomputed
    scores are (L, d) x (d, k) matrix products per block rather than one gather of k keys per query. Every
    move of rows (queries into blocks, cluster keys to blocks, outputs back) is one ``index_select`` on a
    flattened table. ``chunked`` (eager code): the blocks that hold queries, a chunk of them at a time, and A^c
    a few series at a time; not ``chunked`` (compiled code: shapes that do not depend on the data, no loop):
    every block at once, the empty ones too (their rows are the spare row: at most C blocks of waste). In CPU
    inference on short inputs the blocks give way to :func:`_improved_rows` (see ``_ROWS_UP_TO``).
    """
    batch, heads, n, d = q.shape
    dv, clusters = v.shape[-1], qc.shape[2]
    bh = batch * heads
    # (B, H, C, k) top keys and their A^c weights, A^c V and the weights it used (after dropout)
    summary = _centroid_summary(qc, k, v, key_mask, topk, scale, dropout, chunked=chunked, spread=spread)
    index, weight, real_top, cv, cv_weight = summary
    rows = chunked and dropout <= 0.0 and q.device.type == "cpu" and not tracked(q, k, v)
    if rows and max(n, k.shape[2]) <= _ROWS_UP_TO and k.shape[2] <= _ROWS_KEYS_PER_TOP * index.shape[-1]:
        return _improved_rows(q, k, v, assign, summary, scale)
    mass = weight.sum(-1)  # (B, H, C)
    kt, vt = _gather_keys(k, index), _gather_keys(v, index)  # (B, H, C, k, d), (B, H, C, k, dv)
    rest = cv - (cv_weight[..., None] * vt).sum(-2)  # (B, H, C, dv): centroid output off the top-k keys

    block = block_size(n, clusters)
    # (B*H*nb, L) query rows, the blocks in use (every block when not chunked), their clusters
    dest, used, bc = block_rows(assign, clusters, block, used=chunked)
    # per cluster (small): the scale goes into the keys, the mass m_j into the values
    tables = (kt * scale, vt * mass[..., None, None], rest[..., None, :], real_top)
    out = q.new_empty(bh * n + 1, dv)  # every query's output, and a spare row that padding rows are written to
    flat_q = q.reshape(bh * n, d)
    per = max(1, (_CHUNK_ROWS if q.device.type == "cpu" else _CHUNK_ROWS_GPU) // block)  # blocks per chunk
    chunks = range(0, used.numel(), per) if chunked else [None]
    for start in chunks:
        if start is None:
            rows, clus = dest, bc
        else:
            blocks = used[start : start + per]
            rows = dest.index_select(0, blocks)  # (b, L)
            clus = bc.index_select(0, blocks)
        kc, vc, rc, tc = (
            None if x is None else x.reshape(bh * clusters, *x.shape[3:]).index_select(0, clus) for x in tables
        )
        scores = flat_q.index_select(0, rows.view(-1).remainder(bh * n)).view(-1, block, d) @ kc.transpose(-1, -2)
        if tc is not None:
            scores.masked_fill_(~tc[:, None, :], float("-inf"))
        # out = rest + softmax(s q K_T^T) (m V_T): the exact part and the centroid's remainder in one product
        p = softmax_(scores) if dropout <= 0.0 else F.dropout(softmax_(scores), dropout)  # (b, L, k)
        out.index_copy_(0, rows.view(-1), torch.baddbmm(rc, p, vc).view(-1, dv))
    return out[: bh * n].view(batch, heads, n, dv)


def _improved_rows(q, k, v, assign, summary, scale: float) -> torch.Tensor:
    """:func:`_improved` from every query's row of keys (inference on short inputs: see ``_ROWS_UP_TO``), the same
    arithmetic to rounding: SDPA with an additive mask that keeps each query's cluster's real top-k keys (a -max
    bias elsewhere, whose exponential is 0) gives softmax(s q K_T^T) V_T, which the mass m_j scales; the centroid's
    remainder V^c_j - sum_{l in T_j} A^c_jl V_l is one (C, S) x (S, dv) product of the top weights scattered into
    place. ``summary``: what :func:`_centroid_summary` returns (without dropout)."""
    index, weight, real_top, cv, cv_weight = summary
    shape = (*index.shape[:3], k.shape[2])  # (B, H, C, S)
    rest = cv - q.new_zeros(shape).scatter_(-1, index, cv_weight) @ v  # (B, H, C, dv)
    keep = torch.ones_like(weight) if real_top is None else real_top.to(q.dtype)
    bias = q.new_zeros(shape).scatter_(-1, index, keep).sub_(1.0).mul_(torch.finfo(q.dtype).max)  # 0 or -max
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=gather_clusters(bias, assign), scale=scale)
    return out.mul_(gather_clusters(weight.sum(-1), assign)[..., None]).add_(gather_clusters(rest, assign))


def iclustered_weights(q, k, *, key_mask, query_mask, scale, config, state) -> torch.Tensor:
    """Dense (B, H, N, S) attention implied by improved clustered attention."""

    def finish(q, k, v, key_mask, assign, qc):
        ac = centroid_attention(qc, k, key_mask, scale)
        rank = _key_ranks(ac, k, _spread(config, q, assign, query_mask, qc), scale)
        index, weight, real_top = _top_keys(ac, key_mask, config.topk, rank)
        au = _recomputed(q, _gather_keys(k, index), assign, weight.sum(-1), real_top, scale)
        return gather_clusters(ac, assign).scatter(-1, gather_clusters(index, assign), au)

    v = torch.zeros_like(k[..., :1])
    return run(q, k, v, key_mask, query_mask, scale, config, state, finish, dense=True)


@register(
    "i-clustered",
    IClusteredConfig,
    cost=cost,
    init_state=clustered_init_state,
    weights=iclustered_weights,
    test_options={"clusters": 8, "topk": 16},
    # k at least the number of keys: every query's scores are recomputed exactly (the clusters still run)
    exact_limit=ExactLimit(options=lambda n: {"topk": n}),
)
def iclustered_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    scale: float,
    config: IClusteredConfig,
    state: dict[str, torch.Tensor],
    dropout: float = 0.0,
) -> torch.Tensor:
    """Improved clustered attention: clustered attention plus exact scores on each cluster's top-k keys."""

    def finish(q, k, v, key_mask, assign, qc):
        spread = _spread(config, q, assign, query_mask, qc)
        if config.engine == "compiled" and dropout <= 0.0:  # attention dropout: the eager code applies it
            args = (q, k, v, key_mask, assign, qc, config.topk, scale, spread)
            return _compiled.call(_improved_static, *args, method=config.method)
        return _improved(q, k, v, key_mask, assign, qc, config.topk, scale, dropout, spread=spread)

    return run(q, k, v, key_mask, query_mask, scale, config, state, finish, dropout=dropout)


def _improved_static(q, k, v, key_mask, assign, qc, topk: int, scale: float, spread=None) -> torch.Tensor:
    """:func:`_improved` without chunks or data-dependent shapes (the function ``engine="compiled"`` compiles)."""
    return _improved(q, k, v, key_mask, assign, qc, topk, scale, chunked=False, spread=spread)


def _spread(config: IClusteredConfig, q, assign, query_mask, qc) -> torch.Tensor | None:
    """The clusters' variances when ``topk_by="spread"`` ranks the keys with them, else None."""
    return cluster_spread(q, assign, query_mask, qc) if config.topk_by == "spread" else None
