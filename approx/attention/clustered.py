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
* Sequences with at most C real queries fall back to exact attention, per batch row; so do sequences with
  fewer than ``exact_below`` real tokens (off by default, so that measurements at short lengths measure the
  approximation; set it to the crossover length for speed).
* Speed (plain PyTorch, no Python loop over clusters, heads or batch items): on the CPU the vote sums of the
  K-means are updated with the queries that moved only and the loop stops at a fixed point (both give identical
  results; on a GPU the iterations run in full, without host synchronisation), only the 4C first queries in
  priority order are packed to pick the initial codes, and per-cluster rows are copied with ``index_select`` on
  flattened tables rather than gathered element by element.
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
    exact_below: int = option(
        0,
        "sequences with fewer real tokens get exact attention (0 = never; set it to the measured crossover for "
        "speed, README 'Speed'; rows with at most C real tokens are always exact)",
    )

    def check(self) -> None:
        self.require(self.clusters >= 1, "clusters", "need at least one cluster")
        self.require(self.exact_below >= 0, "exact_below", "a length: 0 (off) or more")
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
    if n <= config.clusters or n < config.exact_below:
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
    """(..., B) bool -> (...,) int64 code, B <= 63: eight bits to a byte, eight bytes viewed as one int64.

    Only equality of codes is used, so the byte order does not matter; working in uint8 moves an eighth of
    the memory that int64 shifts would.
    """
    lead, nbits = bits.shape[:-1], bits.shape[-1]
    padded = torch.nn.functional.pad(bits.to(torch.uint8), (0, 64 - nbits))  # (..., 64)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=bits.device)
    packed = (padded.view(*lead, 8, 8) * weights).sum(-1, dtype=torch.uint8)  # (..., 8) bytes
    return packed.view(torch.int64).view(lead)


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


def _distinct_by_priority(codes: torch.Tensor, real: torch.Tensor, clusters: int):
    """Among queries listed in priority order, the first occurrence of each distinct real code.

    ``codes`` and ``real`` are (B, H, M) in priority order. Returns the rank (position in that order) of the
    C best distinct codes (B, H, C), ``>= M`` where fewer than C distinct real codes exist, and their positions.
    """
    m = codes.shape[-1]
    by_code = codes.argsort(dim=-1, stable=True)  # equal codes together, highest priority first
    codes_g = codes.gather(-1, by_code)
    first = torch.ones_like(codes_g, dtype=torch.bool)
    first[..., 1:] = codes_g[..., 1:] != codes_g[..., :-1]
    rank = torch.where(first & real.gather(-1, by_code), by_code, by_code + m)  # priority rank of each code
    chosen, sel = rank.topk(min(clusters, m), dim=-1, largest=False)  # (B, H, C)
    return chosen, by_code.gather(-1, sel)


def _initial_centroids(
    bits: torch.Tensor,
    signs: torch.Tensor,
    real: torch.Tensor,
    clusters: int,
    salt: torch.Tensor,
    fresh: _FreshCodes,
) -> torch.Tensor:
    """C distinct codes of real queries, taken in a padding-independent pseudo-random order: (B, H, C, bits).

    The order is by a hash of (salt, head, position), padded queries last. Only the first 4C queries in that
    order are packed and compared; where they hold fewer than C distinct codes (many equal queries), every
    query is. Both give the same choice: the C highest-priority distinct codes.
    """
    batch, heads, n, nbits = signs.shape
    pos = torch.arange(n, device=signs.device)
    head = torch.arange(heads, device=signs.device)
    prio = hash_ints(salt.to(signs.device), head[:, None], pos[None, :]).expand(batch, heads, n)
    prio = prio.masked_fill(~real[:, None, :], 2**40)  # padded queries last
    key = prio * n + pos  # unique, so the order equals a stable sort of the priorities
    real_h = real[:, None, :].expand(batch, heads, n)

    def pick(m: int):
        order = key.topk(m, dim=-1, largest=False).indices if m < n else key.argsort(dim=-1)  # (B, H, M)
        cand = bits.gather(2, order[..., None].expand(-1, -1, -1, nbits))
        chosen, sel = _distinct_by_priority(pack_bits(cand), real_h.gather(-1, order), clusters)
        return chosen, order.gather(-1, sel), m

    chosen, query, m = pick(min(n, 4 * clusters))
    if m < n and bool((chosen >= m).any()):
        chosen, query, m = pick(n)
    cent = signs.gather(2, query[..., None].expand(-1, -1, -1, nbits))
    missing = chosen >= m  # fewer distinct codes than clusters
    return torch.where(missing[..., None], fresh[0], cent) if bool(missing.any()) else cent


def _assign(signs: torch.Tensor, cent: torch.Tensor) -> torch.Tensor:
    """Nearest centroid in Hamming distance: the first maximum of the +-1 agreement. (B, H, N).

    The agreement ``signs . cent`` is an integer in [-bits, bits]; with P >= C a power of two, the key
    ``P * agreement - c`` is largest for the best cluster and, among equal agreements, for the first one, so a
    plain ``amax`` (much faster than ``max(...).indices`` over a short last dimension) gives the index as
    ``-key mod P``. The key is one matrix product of ``[signs, 1]`` with ``[P * cent, -c]``: integers below
    2**24, exact in float32 whatever the summation order.
    """
    clusters, nbits = cent.shape[-2], cent.shape[-1]
    p = 1 << max(clusters - 1, 1).bit_length()  # power of two >= C
    if (nbits + 1) * p >= 2**24:  # keys would not be exact in float32: plain argmax
        return (signs[..., :nbits] @ cent.transpose(-1, -2)).max(-1).indices
    tag = -torch.arange(clusters, dtype=cent.dtype, device=cent.device).expand(*cent.shape[:-1])
    key = signs @ torch.cat([cent * p, tag[..., None]], dim=-1).transpose(-1, -2)  # (B, H, N, C)
    return torch.remainder(-key.amax(-1).long(), p)


def hamming_kmeans(
    bits: torch.Tensor,
    query_mask: torch.Tensor | None,
    clusters: int,
    iterations: int,
    salt: torch.Tensor,
    *,
    sync_free: bool | None = None,
) -> torch.Tensor:
    """Cluster index of every query, (B, H, N) long. Padded queries take no part (their index is arbitrary).

    Lloyd iterations: assign every query to its nearest centroid, then set each centroid to the bitwise
    majority of its members. Each (batch row, head) is its own K-means; all of them run together as one
    batch of matrix products. On the CPU two shortcuts leave the result identical:

    * the vote sums are integers held exactly in float32, so after the first iteration they are updated
      with the queries that moved only;
    * a (batch row, head) in which no query moved and no cluster is empty is at a fixed point (its centroids
      would not change again), so its assignment is final and it leaves the batch.

    Both need the host to look at device values every iteration; on a GPU, where such a synchronisation costs
    more than the arithmetic it saves, :func:`_kmeans_fixed_iterations` runs every iteration in full instead
    (the same assignment: a fixed point stays fixed). ``sync_free``: force one or the other (default: by device).
    """
    batch, heads, n, nbits = bits.shape
    g, dev = batch * heads, bits.device
    real = torch.ones(batch, n, dtype=torch.bool, device=dev) if query_mask is None else query_mask
    signs = torch.where(bits, 1.0, -1.0)  # (B, H, N, bits)
    fresh = _FreshCodes(salt, iterations + 1, heads, clusters, nbits, dev)
    cent = _initial_centroids(bits, signs, real, clusters, salt, fresh).reshape(g, clusters, nbits)
    w = real[:, None, :].float().expand(batch, heads, n).reshape(g * n, 1)  # padded queries vote with 0
    # one row per query: its +-1 vote on every bit and, last, its weight; votes[:, -1] counts the members.
    # Votes and counts move together in one index_add_ per iteration (few kernel launches: each can stall
    # when the CPU cores are shared).
    members = torch.cat([signs.reshape(g * n, nbits) * w, w], dim=-1)  # (G*N, bits + 1)
    live_signs = torch.cat([signs, signs.new_ones(batch, heads, n, 1)], dim=-1).reshape(g, n, nbits + 1)
    if sync_free is None:
        sync_free = dev.type != "cpu"
    if sync_free:
        return _kmeans_fixed_iterations(live_signs, members, cent, fresh, batch, iterations).view(batch, heads, n)
    votes = torch.zeros(g * clusters, nbits + 1, device=dev)
    result = torch.empty(g, n, dtype=torch.long, device=dev)
    live = torch.arange(g, device=dev)  # the (batch row, head) series still iterating
    previous = empty = None  # (L, N) assignments and (L, C) empty clusters of the live series
    for it in range(iterations):
        a = _assign(live_signs, cent[live])  # (L, N)
        rows = live[:, None] * clusters + a  # rows of the (G*C) vote table
        if previous is None or empty is None:
            votes.index_add_(0, rows.reshape(-1), members)
        else:
            moved = a != previous
            s_idx, pos = moved.nonzero(as_tuple=True)
            if s_idx.numel():
                src = members[live[s_idx] * n + pos]
                into, out_of = rows[s_idx, pos], live[s_idx] * clusters + previous[s_idx, pos]
                votes.index_add_(0, torch.cat([into, out_of]), torch.cat([src, -src]))
            done = ~moved.any(-1) & ~empty.any(-1)  # fixed points: their assignment is final
            if bool(done.any()):
                result[live[done]] = a[done]
                keep = ~done
                live, a, live_signs = live[keep], a[keep], live_signs[keep]
                if live.numel() == 0:
                    return result.view(batch, heads, n)
        previous = a
        v = votes.view(g, clusters, nbits + 1)[live]  # (L, C, bits + 1)
        c = torch.where(v[..., :-1] == 0, cent[live], torch.sign(v[..., :-1]))  # majority; a tie keeps the bit
        empty = v[..., -1] == 0
        if bool(empty.any()):
            codes = fresh[it + 1].expand(batch, heads, clusters, nbits).reshape(g, clusters, nbits)
            c = torch.where(empty[..., None], codes[live], c)
        cent[live] = c
    result[live] = _assign(live_signs, cent[live])
    return result.view(batch, heads, n)


def _kmeans_fixed_iterations(
    signs: torch.Tensor, members: torch.Tensor, cent: torch.Tensor, fresh: _FreshCodes, batch: int, iterations: int
) -> torch.Tensor:
    """The Lloyd iterations of :func:`hamming_kmeans` without a host synchronisation: (G, N) assignments.

    ``signs``: (G, N, bits + 1) +-1 codes with a trailing 1; ``members``: (G*N, bits + 1) weighted votes and
    weights; ``cent``: (G, C, bits) initial centroids. Every iteration recounts all the votes (one
    ``index_add_``) and every series runs all ``iterations``.
    """
    g, n = signs.shape[:2]
    clusters, nbits = cent.shape[-2:]
    offset = torch.arange(g, device=signs.device)[:, None] * clusters  # (G, 1)
    for it in range(iterations):
        rows = (_assign(signs, cent) + offset).reshape(-1)  # (G*N,) rows of the (G*C) vote table
        v = members.new_zeros(g * clusters, nbits + 1).index_add_(0, rows, members).view(g, clusters, nbits + 1)
        cent = torch.where(v[..., :-1] == 0, cent, torch.sign(v[..., :-1]))  # majority; a tie keeps the bit
        codes = fresh[it + 1].expand(batch, -1, -1, -1).reshape(g, clusters, nbits)
        cent = torch.where((v[..., -1] == 0)[..., None], codes, cent)  # an empty cluster gets a fresh code
    return _assign(signs, cent)


def cluster_queries(
    q: torch.Tensor, query_mask: torch.Tensor | None, config: ClusteredConfig, state: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Hash, then Hamming K-means: the cluster index of every query, (B, H, N) long."""
    bits = hash_queries(q, state["planes"], state["offsets"], query_mask)
    return hamming_kmeans(bits, query_mask, config.clusters, config.iterations, state["salt"])


def _flat_index(assign: torch.Tensor, clusters: int) -> torch.Tensor:
    """(B, H, N) cluster indices -> (B*H*N,) row indices into a (B*H*C, ...) table."""
    batch, heads, _ = assign.shape
    offset = torch.arange(batch * heads, device=assign.device).view(batch, heads, 1) * clusters
    return (assign + offset).reshape(-1)


def centroids(q: torch.Tensor, assign: torch.Tensor, query_mask: torch.Tensor | None, clusters: int):
    """Mean of the member queries of each cluster (B, H, C, d) and the member counts (B, H, C)."""
    batch, heads, n, d = q.shape
    flat = _flat_index(assign, clusters)
    rows = q.reshape(-1, d)
    if query_mask is not None:
        rows = q.masked_fill(~query_mask[:, None, :, None], 0.0).reshape(-1, d)
        w = query_mask[:, None, :].to(q.dtype).expand(batch, heads, n).reshape(-1)
    else:
        w = torch.ones(batch * heads * n, dtype=q.dtype, device=q.device)
    sums = q.new_zeros(batch * heads * clusters, d + 1).index_add(0, flat, torch.cat([rows, w[:, None]], dim=-1))
    total, count = sums[:, :d].view(batch, heads, clusters, d), sums[:, d].view(batch, heads, clusters)
    return total / count.clamp_min(1.0)[..., None], count


def centroid_attention(qc: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """A^c = softmax(s Q^c K^T + log m): (B, H, C, S)."""
    scores = (qc @ k.transpose(-1, -2)) * scale  # (B, H, C, S)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return scores.softmax(-1)


def short_rows(query_mask: torch.Tensor | None, n: int, config: ClusteredConfig, batch: int, device) -> torch.Tensor:
    """Batch rows that get exact attention: at most C real queries, or fewer than ``exact_below``. (B,) bool."""
    real = torch.full((batch,), n, device=device) if query_mask is None else query_mask.sum(-1)
    return (real <= config.clusters) | (real < config.exact_below)


def gather_clusters(x: torch.Tensor, assign: torch.Tensor) -> torch.Tensor:
    """Per-query rows of a per-cluster tensor: (B, H, C, *F) x (B, H, N) -> (B, H, N, *F).

    Rows are copied whole (``index_select`` on a (B*H*C, F) table), much faster on CPU than an elementwise
    ``gather`` with an index expanded over F.
    """
    batch, heads, c = x.shape[:3]
    flat = x.reshape(batch * heads * c, -1).index_select(0, _flat_index(assign, c))
    return flat.view(*assign.shape, *x.shape[3:])


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

    Sequences with at most C real queries, or fewer than ``config.exact_below``, get exact attention (or, with
    ``dense``, the exact attention matrix); the others are clustered and ``finish(q, k, v, key_mask, assign, ac)`` computes their output.
    """

    def exact(q_, k_, v_, m_):
        return dense_softmax(q_, k_, m_, scale) if dense else exact_attention(q_, k_, v_, m_, scale)

    batch, _, n, _ = q.shape
    if n <= config.clusters or n < config.exact_below:
        return exact(q, k, v, key_mask)
    short = short_rows(query_mask, n, config, batch, q.device)
    if bool(short.all()):
        return exact(q, k, v, key_mask)
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
