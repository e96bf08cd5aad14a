"""Improved clustered attention ("i-clustered").

Vyas, Katharopoulos, Fleuret, "Fast Transformers with Clustered Attention", NeurIPS 2020 (arXiv 2007.04825),
section 3.3. On top of the clusters and centroid attention A^c of clustered attention (``clustered.py``):

1. T_j: the k real keys with the largest A^c_j for cluster j;
2. m_j = sum over T_j of A^c_j, the mass the centroid puts on them;
3. for a query i of cluster j, exact scores on T_j only: A^u_i = m_j softmax(s q_i K_{T_j}^T);
4. V_i = sum_{l in T_j} A^u_il V_l + (V^c_j - sum_{l in T_j} A^c_jl V_l).

With k at least the number of real keys this is exact attention, and its rows are never further (L1) from
the exact rows than the clustered ones (the paper's Proposition 2). Cost per batch item and head:
clustered attention plus O(N k max(d, dv)).
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import option
from ..registry import Cost, register
from .clustered import ClusteredConfig, gather_clusters, run
from .clustered import cost as clustered_cost
from .clustered import init_state as clustered_init_state


@dataclasses.dataclass(frozen=True)
class IClusteredConfig(ClusteredConfig):
    """Options of improved clustered attention: those of clustered attention plus ``topk``."""

    method = "i-clustered"

    topk: int = option(32, "keys k per cluster whose scores are recomputed exactly for each query (reference 32)")

    def check(self) -> None:
        super().check()
        self.require(self.topk >= 1, "topk", "need at least one key per cluster")


def cost(config: IClusteredConfig, *, n: int, s: int, d: int, dv: int) -> Cost:
    base = clustered_cost(config, n=n, s=s, d=d, dv=dv)
    if n <= config.clusters or n < config.exact_below:
        return base
    k = min(config.topk, s)
    return Cost(flops=base.flops + 2 * n * k * (d + dv), qk_pairs=base.qk_pairs + n * k)


def _top_keys(ac: torch.Tensor, key_mask: torch.Tensor | None, topk: int):
    """Indices (B, H, C, k) of each cluster's top-k real keys, their A^c weights, and which are real."""
    k = min(topk, ac.shape[-1])
    if key_mask is None:
        weight, index = ac.topk(k, dim=-1)
        return index, weight, None
    real = key_mask[:, None, None, :]  # (B, 1, 1, S)
    index = ac.masked_fill(~real, -1.0).topk(k, dim=-1).indices  # real keys first, even at weight 0
    real_top = real.expand_as(ac).gather(-1, index)  # only False when k exceeds the real keys
    return index, ac.gather(-1, index), real_top


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


def _block_size(n: int, clusters: int) -> int:
    """Queries per block: about half the mean cluster size, so padding wastes at most ~C * L rows."""
    return max(4, min(64, n // (2 * clusters)))


def _cluster_blocks(assign: torch.Tensor, clusters: int, block: int):
    """Lay queries out cluster by cluster in blocks of ``block`` rows that all belong to one cluster.

    Returns ``order`` (B, H, N): query indices sorted by cluster; ``slot`` (B, H, N): the padded row of the
    i-th sorted query; ``block_cluster`` (B, H, nb): the cluster of every block; and nb. A cluster of c
    queries takes ceil(c / block) blocks, so nb <= N / block + C.
    """
    batch, heads, n = assign.shape
    order = assign.argsort(dim=-1, stable=True)
    sorted_cluster = assign.gather(-1, order)
    counts = torch.zeros(batch, heads, clusters, dtype=torch.long, device=assign.device)
    counts.scatter_add_(2, assign, torch.ones_like(assign))
    blocks = (counts + block - 1) // block
    first_block = blocks.cumsum(-1) - blocks  # (B, H, C)
    first_query = counts.cumsum(-1) - counts
    rank = torch.arange(n, device=assign.device) - first_query.gather(-1, sorted_cluster)
    slot = first_block.gather(-1, sorted_cluster) * block + rank  # (B, H, N)
    nb = (n + clusters * (block - 1) + block - 1) // block
    block_cluster = torch.zeros(batch, heads, nb, dtype=torch.long, device=assign.device)
    block_cluster.scatter_(-1, slot // block, sorted_cluster)
    return order, slot, block_cluster, nb


def _improved(q, k, v, key_mask, assign, ac, topk, scale) -> torch.Tensor:
    """Improved clustered output (B, H, N, dv) from the clusters and A^c.

    Queries are sorted by cluster into blocks that share their cluster's top-k keys, so the recomputed
    scores are (L, d) x (d, k) matrix products per block rather than one gather of k keys per query. Every
    move of rows (queries into blocks, cluster keys to blocks, outputs back) is one ``index_select`` on a
    flattened table.
    """
    batch, heads, n, d = q.shape
    dv, clusters = v.shape[-1], ac.shape[2]
    bh = batch * heads
    index, weight, real_top = _top_keys(ac, key_mask, topk)  # (B, H, C, k)
    mass = weight.sum(-1)  # (B, H, C)
    kt, vt = _gather_keys(k, index), _gather_keys(v, index)  # (B, H, C, k, d), (B, H, C, k, dv)
    rest = ac @ v - (weight[..., None] * vt).sum(-2)  # (B, H, C, dv): centroid output off the top-k keys

    block = _block_size(n, clusters)
    order, slot, block_cluster, nb = _cluster_blocks(assign, clusters, block)
    head = torch.arange(bh, device=q.device).view(batch, heads, 1)
    slot = slot + head * (nb * block)  # row of the i-th sorted query in the (B*H*nb*L) block table
    # each block row reads its query, or the zero row appended after the B*H*N queries (padding rows)
    src = torch.full((bh * nb * block,), bh * n, dtype=torch.long, device=q.device)
    src[slot.reshape(-1)] = (order + head * n).reshape(-1)
    qp = torch.cat([q.reshape(bh * n, d), q.new_zeros(1, d)]).index_select(0, src).view(bh, nb, block, d)
    bc = (block_cluster + head * clusters).reshape(-1)  # (B*H*nb,) row of each block's cluster

    def per_block(x: torch.Tensor) -> torch.Tensor:  # (B, H, C, *F) -> (B*H, nb, *F)
        return x.reshape(bh * clusters, -1).index_select(0, bc).view(bh, nb, *x.shape[3:])

    scores = (qp @ per_block(kt).transpose(-1, -2)) * scale  # (B*H, nb, L, k)
    if real_top is not None:
        scores = scores.masked_fill(~per_block(real_top)[..., None, :], float("-inf"))
    au = scores.softmax(-1) * per_block(mass)[..., None, None]
    out = au @ per_block(vt) + per_block(rest)[..., None, :]  # (B*H, nb, L, dv)
    back = torch.empty_like(slot).scatter_(-1, order, slot)  # (B, H, N): block row of every query
    return out.reshape(-1, dv).index_select(0, back.reshape(-1)).view(batch, heads, n, dv)


def iclustered_weights(q, k, *, key_mask, query_mask, scale, config, state) -> torch.Tensor:
    """Dense (B, H, N, S) attention implied by improved clustered attention."""

    def finish(q, k, v, key_mask, assign, ac):
        index, weight, real_top = _top_keys(ac, key_mask, config.topk)
        au = _recomputed(q, _gather_keys(k, index), assign, weight.sum(-1), real_top, scale)
        return gather_clusters(ac, assign).scatter(-1, gather_clusters(index, assign), au)

    v = torch.zeros_like(k[..., :1])
    return run(q, k, v, key_mask, query_mask, scale, config, state, finish, dense=True)


@register("i-clustered", IClusteredConfig, cost=cost, init_state=clustered_init_state, weights=iclustered_weights)
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

    def finish(q, k, v, key_mask, assign, ac):
        return _improved(q, k, v, key_mask, assign, ac, config.topk, scale)

    return run(q, k, v, key_mask, query_mask, scale, config, state, finish)
