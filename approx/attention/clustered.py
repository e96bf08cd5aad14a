"""Clustered attention.

Vyas, Katharopoulos, Fleuret, "Fast Transformers with Clustered Attention", NeurIPS 2020 (arXiv 2007.04825),
section 3.2. Queries are hashed with biased random hyperplanes, grouped by K-means in Hamming space, and
attention is computed for the C cluster centroids only; every query takes its centroid's output.

Cost per batch item and head: O(N C max(d, dv)) for the attention plus O(N B d) hashing and O(I N C B)
clustering, with N queries, C clusters, B bits and I iterations.

Choices made here (see ``../shared/reference/methods.md`` section 1):

* The planes a_b ~ N(0, I) and offsets u_b ~ N(0, 1) are drawn once from the seed when a layer is patched
  and kept as buffers, so a patched model is deterministic and saved with its state. The reference code
  draws new planes on every forward pass.
* Bit b of query q is ``[q . a_b > beta_b]`` with the bias ``beta_b = mean_b + std_b * u_b``, where mean_b
  and std_b are the mean and standard deviation of ``q . a_b`` over the real queries of that sequence and
  head: each hyperplane cuts through the query cloud at a random place, so Hamming distance between codes
  tracks Euclidean distance between queries (a fixed bias of unknown scale would leave most bits constant).
* K-means starts from C distinct codes picked in a pseudo-random order that depends only on (seed, head,
  position), never on the padded length, so appending padding changes nothing for real tokens.
  Hamming distances are computed as +-1 dot products (``B - 2 * hamming``); centroids are the bitwise
  majority of their members (a tie keeps the previous bit); an empty cluster gets a fresh random code.
* Sequences with at most C real queries fall back to exact attention, per batch row.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import MethodConfig, option
from ..registry import Cost, register
from ._common import (
    compute_dtype,
    dense_softmax,
    exact_attention,
    exact_for_rows,
    hash_ints,
    safe_key_mask,
    zero_padded_values,
)


@dataclasses.dataclass(frozen=True)
class ClusteredConfig(MethodConfig):
    """Options of clustered attention."""

    method = "clustered"

    clusters: int = option(25, "number of query clusters C (the paper uses 25 on GLUE/SQuAD, 100 for speed)")
    iterations: int = option(10, "Lloyd iterations of the Hamming K-means (reference default 10)")
    bits: int = option(63, "bits B of the LSH code of a query; codes are packed in int64, so at most 63")
    seed: int = option(0, "seed of the hash planes and of the K-means initialisation")

    def check(self) -> None:
        self.require(self.clusters >= 1, "clusters", "need at least one cluster")
        self.require(self.iterations >= 0, "iterations", "cannot be negative")
        self.require(1 <= self.bits <= 63, "bits", "a code is packed into a signed 64-bit integer: 1 to 63 bits")
        self.require(self.seed >= 0, "seed", "seeds are non-negative integers")


def init_state(config: ClusteredConfig, *, head_dim: int, seed: int) -> dict[str, torch.Tensor]:
    """Hash planes (B, d), plane offsets (B,) and a salt for the K-means initialisation."""
    g = torch.Generator().manual_seed(seed)
    return {
        "planes": torch.randn(config.bits, head_dim, generator=g),
        "offsets": torch.randn(config.bits, generator=g),
        "salt": torch.randint(0, 2**31 - 1, (1,), generator=g),
    }


def cost(config: ClusteredConfig, *, n: int, s: int, d: int, dv: int) -> Cost:
    if n <= config.clusters:
        return Cost(flops=2 * n * s * (d + dv), qk_pairs=n * s)
    c, b = config.clusters, config.bits
    hashing = 2 * n * b * d
    kmeans = 2 * (config.iterations + 1) * n * c * b
    attention = 2 * c * s * (d + dv)
    return Cost(flops=hashing + kmeans + attention, qk_pairs=c * s)


# ----------------------------------------------------------------------------------------------------------
# hashing and Hamming K-means


def hash_queries(
    q: torch.Tensor, planes: torch.Tensor, offsets: torch.Tensor, query_mask: torch.Tensor | None
) -> torch.Tensor:
    """Bits of the LSH code of every query: (B, H, N, d) -> (B, H, N, bits) bool."""
    proj = q.float() @ planes.float().t()  # (B, H, N, bits)
    if query_mask is None:
        var, mean = torch.var_mean(proj, dim=2, keepdim=True, correction=0)
        std = var.sqrt()
    else:
        w = query_mask[:, None, :, None].float()  # (B, 1, N, 1)
        n = w.sum(2, keepdim=True).clamp_min(1.0)
        proj = proj.masked_fill(w == 0, 0.0)
        mean = proj.sum(2, keepdim=True) / n
        std = (((proj - mean) * w) ** 2).sum(2, keepdim=True).div(n).sqrt()
    return proj > mean + std * offsets.float()  # (B, H, N, bits)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """(..., B) bool -> (...,) int64 code, B <= 63."""
    weights = torch.ones((), dtype=torch.int64, device=bits.device) << torch.arange(bits.shape[-1], device=bits.device)
    return (bits.long() * weights).sum(-1)


class _FreshCodes:
    """Pseudo-random +-1 codes for (salt, draw, head, cluster, bit), hashed in one go on first use.

    Draw 0 seeds clusters that found no distinct code; draw t > 0 replaces clusters left empty by iteration t.
    """

    def __init__(self, salt: torch.Tensor, draws: int, heads: int, clusters: int, nbits: int, device) -> None:
        self.args = (salt, draws, heads, clusters, nbits, device)
        self.table: torch.Tensor | None = None

    def __getitem__(self, draw: int) -> torch.Tensor:  # (1, H, C, B)
        if self.table is None:
            salt, draws, heads, clusters, nbits, device = self.args
            t = torch.arange(draws, device=device)[:, None, None, None]
            h = torch.arange(heads, device=device)[None, :, None, None]
            c = torch.arange(clusters, device=device)[None, None, :, None]
            b = torch.arange(nbits, device=device)[None, None, None, :]
            self.table = (hash_ints(salt.to(device), t, h, c, b) & 1).float() * 2 - 1  # (T, H, C, B)
        return self.table[draw][None]


def _initial_centroids(
    codes: torch.Tensor,
    signs: torch.Tensor,
    real: torch.Tensor,
    clusters: int,
    salt: torch.Tensor,
    fresh: _FreshCodes,
) -> torch.Tensor:
    """C distinct codes of real queries, taken in a padding-independent pseudo-random order: (B, H, C, bits)."""
    batch, heads, n, nbits = signs.shape
    pos = torch.arange(n, device=codes.device)
    head = torch.arange(heads, device=codes.device)
    prio = hash_ints(salt.to(codes.device), head[:, None], pos[None, :]).expand(batch, heads, n)
    prio = prio.masked_fill(~real[:, None, :], 2**40)  # padded queries last
    order = prio.argsort(dim=-1, stable=True)  # (B, H, N) positions by priority
    codes_o = codes.gather(-1, order)
    by_code = codes_o.argsort(dim=-1, stable=True)  # equal codes together, highest priority first
    codes_g = codes_o.gather(-1, by_code)
    first = torch.ones_like(codes_g, dtype=torch.bool)
    first[..., 1:] = codes_g[..., 1:] != codes_g[..., :-1]
    real_g = real[:, None, :].expand(batch, heads, n).gather(-1, order).gather(-1, by_code)
    rank = torch.where(first & real_g, by_code, by_code + n)  # priority rank of each distinct code
    chosen, sel = rank.topk(clusters, dim=-1, largest=False)  # (B, H, C)
    query = order.gather(-1, by_code.gather(-1, sel))  # positions of the chosen queries
    cent = signs.gather(2, query[..., None].expand(-1, -1, -1, nbits))
    missing = chosen >= n  # fewer distinct codes than clusters
    return torch.where(missing[..., None], fresh[0], cent) if bool(missing.any()) else cent


def _assign(signs: torch.Tensor, cent: torch.Tensor) -> torch.Tensor:
    """Nearest centroid in Hamming distance: argmax of +-1 agreement. (B, H, N)."""
    return (signs @ cent.transpose(-1, -2)).max(-1).indices  # first maximum on ties, like argmax; faster on CPU


def hamming_kmeans(
    bits: torch.Tensor, query_mask: torch.Tensor | None, clusters: int, iterations: int, salt: torch.Tensor
) -> torch.Tensor:
    """Cluster index of every query, (B, H, N) long. Padded queries take no part (their index is arbitrary)."""
    batch, heads, n, nbits = bits.shape
    real = torch.ones(batch, n, dtype=torch.bool, device=bits.device) if query_mask is None else query_mask
    signs = bits.float() * 2 - 1  # (B, H, N, bits)
    fresh = _FreshCodes(salt, iterations + 1, heads, clusters, nbits, bits.device)
    cent = _initial_centroids(pack_bits(bits), signs, real, clusters, salt, fresh)  # (B, H, C, bits)
    w = real[:, None, :].float().expand(batch, heads, n).reshape(-1)  # (B*H*N,)
    members = (signs * w.view(batch, heads, n, 1)).reshape(-1, nbits)  # padded queries vote with 0
    offset = torch.arange(batch * heads, device=bits.device).view(batch, heads, 1) * clusters
    for it in range(iterations):
        flat = (_assign(signs, cent) + offset).reshape(-1)  # cluster index in a (B*H*C) table
        votes = torch.zeros(batch * heads * clusters, nbits, device=bits.device).index_add_(0, flat, members)
        count = torch.zeros(batch * heads * clusters, device=bits.device).index_add_(0, flat, w)
        votes, count = votes.view_as(cent), count.view(batch, heads, clusters)
        cent = torch.where(votes == 0, cent, torch.sign(votes))  # majority; a tie keeps the bit
        empty = count == 0
        if bool(empty.any()):
            cent = torch.where(empty[..., None], fresh[it + 1], cent)
    return _assign(signs, cent)


def cluster_queries(
    q: torch.Tensor, query_mask: torch.Tensor | None, config: ClusteredConfig, state: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Hash, then Hamming K-means: the cluster index of every query, (B, H, N) long."""
    bits = hash_queries(q, state["planes"], state["offsets"], query_mask)
    return hamming_kmeans(bits, query_mask, config.clusters, config.iterations, state["salt"])


def centroids(q: torch.Tensor, assign: torch.Tensor, query_mask: torch.Tensor | None, clusters: int):
    """Mean of the member queries of each cluster (B, H, C, d) and the member counts (B, H, C)."""
    batch, heads, n, d = q.shape
    real = torch.ones(batch, n, dtype=torch.bool, device=q.device) if query_mask is None else query_mask
    w = real[:, None, :].to(q.dtype).expand(batch, heads, n)
    q = q.masked_fill(~real[:, None, :, None], 0.0)
    total = torch.zeros(batch, heads, clusters, d, dtype=q.dtype, device=q.device)
    total = total.scatter_add(2, assign[..., None].expand(-1, -1, -1, d), q)
    count = torch.zeros(batch, heads, clusters, dtype=q.dtype, device=q.device).scatter_add(2, assign, w)
    return total / count.clamp_min(1.0)[..., None], count


def centroid_attention(qc: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """A^c = softmax(s Q^c K^T + log m): (B, H, C, S)."""
    scores = (qc @ k.transpose(-1, -2)) * scale  # (B, H, C, S)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return scores.softmax(-1)


def short_rows(query_mask: torch.Tensor | None, n: int, clusters: int, batch: int, device) -> torch.Tensor:
    """Batch rows with at most ``clusters`` real queries: they get exact attention. (B,) bool."""
    if query_mask is None:
        return torch.full((batch,), n <= clusters, dtype=torch.bool, device=device)
    return query_mask.sum(-1) <= clusters


def gather_clusters(x: torch.Tensor, assign: torch.Tensor) -> torch.Tensor:
    """Per-query rows of a per-cluster tensor: (B, H, C, *F) x (B, H, N) -> (B, H, N, *F)."""
    batch, heads, c = x.shape[:3]
    flat = x.reshape(batch, heads, c, -1)
    out = flat.gather(2, assign[..., None].expand(-1, -1, -1, flat.shape[-1]))
    return out.reshape(*assign.shape, *x.shape[3:])


def prepare(q, k, v, key_mask, query_mask, config, state, scale):
    """Shared front half of clustered and improved-clustered attention.

    Returns (q, k, v) in the compute dtype with padded values zeroed, the safe key mask, the cluster index
    of every query (B, H, N) and the centroid attention A^c (B, H, C, S).
    """
    dt = compute_dtype(q.dtype)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    key_mask = safe_key_mask(key_mask)
    v = zero_padded_values(v, key_mask)
    assign = cluster_queries(q, query_mask, config, state)
    qc, _ = centroids(q, assign, query_mask, config.clusters)
    return q, k, v, key_mask, assign, centroid_attention(qc, k, key_mask, scale)


def run(q, k, v, key_mask, query_mask, scale, config, state, finish, *, dense: bool = False) -> torch.Tensor:
    """The driver shared by clustered and improved-clustered attention.

    Sequences with at most C real queries get exact attention (or, with ``dense``, the exact attention
    matrix); the others are clustered and ``finish(q, k, v, key_mask, assign, ac)`` computes their output.
    """

    def exact(q_, k_, v_, m_):
        return dense_softmax(q_, k_, m_, scale) if dense else exact_attention(q_, k_, v_, m_, scale)

    batch, _, n, _ = q.shape
    if n <= config.clusters:
        return exact(q, k, v, key_mask)
    short = short_rows(query_mask, n, config.clusters, batch, q.device)
    qf, kf, vf, km, assign, ac = prepare(q, k, v, key_mask, query_mask, config, state, scale)
    out = finish(qf, kf, vf, km, assign, ac)
    out = exact_for_rows(out, short, lambda r: exact(qf[r], kf[r], vf[r], None if km is None else km[r]))
    return out.to(q.dtype)


def clustered_weights(q, k, *, key_mask, query_mask, scale, config, state) -> torch.Tensor:
    """Dense (B, H, N, S) attention implied by clustered attention (row i = its centroid's row)."""
    v = torch.zeros_like(k[..., :1])
    return run(q, k, v, key_mask, query_mask, scale, config, state, lambda *x: gather_clusters(x[5], x[4]), dense=True)


@register("clustered", ClusteredConfig, cost=cost, init_state=init_state, weights=clustered_weights)
def clustered_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    scale: float,
    config: ClusteredConfig,
    state: dict[str, torch.Tensor],
    dropout: float = 0.0,
) -> torch.Tensor:
    """Clustered attention: LSH + Hamming K-means on queries, attention for the centroids only."""

    def finish(q, k, v, key_mask, assign, ac):
        return gather_clusters(ac @ v, assign)  # (B, H, N, dv): each query takes its centroid's output

    return run(q, k, v, key_mask, query_mask, scale, config, state, finish)
