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
* Bit b of query q is ``[q . a_b >= beta_b]`` with the bias ``beta_b = mean_b + std_b * u_b``, where mean_b
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
* Speed (plain PyTorch, no Python loop over clusters, heads or batch items). On the CPU the K-means compares
  queries with the centroids that moved only (after two iterations, a few of the C), updates the vote sums with
  the queries that moved only, and stops at a fixed point; on a GPU the iterations run in full, without host
  synchronisation; both give identical clusters (tested). The thresholds of the hash come from the queries'
  mean and covariance, so the codes are one product with a bias; the centroid outputs come from the fused SDPA
  kernel (A^c is never formed); only the 4C first queries in priority order are packed to pick the initial
  codes; per-cluster rows are copied with ``index_select`` on flattened tables. Large fresh tensors are avoided
  where a reused buffer does: on the CPU, first-touch page faults of a new 50 MB tensor cost more than a pass of
  arithmetic over it.
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
    softmax_,
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


def hash_signs(
    q: torch.Tensor, planes: torch.Tensor, offsets: torch.Tensor, query_mask: torch.Tensor | None
) -> torch.Tensor:
    """The LSH code of every query as +-1 values with a trailing +1: (B, H, N, d) -> (B, H, N, bits + 1) float32.

    Bit b is +1 where ``q . a_b - beta_b >= 0``. The mean and variance of ``q . a_b`` over the real queries
    come from the mean and covariance of the queries (a (d, d) product per head), so the codes take a single
    (N, d) x (d, bits + 1) product with the thresholds as its bias, and one sign pass in place. The trailing
    column (a zero plane with threshold -1) is the one that K-means needs next to the code.
    """
    qf = q.detach().float()  # codes carry no gradient
    nbits = planes.shape[0]
    if query_mask is None:
        count = torch.full((), qf.shape[2], dtype=torch.float32, device=q.device)
        real = qf
    else:  # padded queries (whatever their values) out of the statistics
        count = query_mask.sum(-1).clamp_min(1).float()[:, None, None]  # (B, 1, 1)
        real = qf.masked_fill(~query_mask[:, None, :, None], 0.0)
    mean = real.sum(2) / count  # (B, H, d)
    # E[q q^T] - mean mean^T: float32 loses about eps * |mean|^2 / var of the variance, far below what moves
    # a random threshold
    cov = (real.transpose(-1, -2) @ real) / count[..., None] - mean[..., :, None] * mean[..., None, :]
    a = planes.float()
    proj_mean = mean @ a.t()  # (B, H, bits)
    proj_std = ((a @ cov) * a).sum(-1).clamp_min(0.0).sqrt()  # sqrt(a_b^T cov a_b), (B, H, bits)
    threshold = proj_mean + proj_std * offsets.float()
    bias = torch.cat([-threshold, threshold.new_ones(*threshold.shape[:-1], 1)], dim=-1)  # (B, H, bits + 1)
    a = torch.cat([a, a.new_zeros(1, a.shape[1])])  # (bits + 1, d)
    batch, heads, n, d = qf.shape
    proj = torch.baddbmm(
        bias.reshape(batch * heads, 1, nbits + 1),
        qf.reshape(batch * heads, n, d),
        a.t().expand(batch * heads, d, nbits + 1),
    )
    return torch.copysign(torch.ones((), device=q.device), proj, out=proj).view(batch, heads, n, nbits + 1)


def hash_queries(
    q: torch.Tensor, planes: torch.Tensor, offsets: torch.Tensor, query_mask: torch.Tensor | None
) -> torch.Tensor:
    """Bits of the LSH code of every query: (B, H, N, d) -> (B, H, N, bits) bool (see :func:`hash_signs`)."""
    return hash_signs(q, planes, offsets, query_mask)[..., :-1] > 0


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
    """Pseudo-random +-1 codes for (salt, draw, head, cluster, bit), hashed per draw on first use.

    Draw 0 seeds clusters that found no distinct code; draw t > 0 replaces clusters left empty by iteration t.
    """

    def __init__(self, salt: torch.Tensor, heads: int, clusters: int, nbits: int, device) -> None:
        self.args = (salt, heads, clusters, nbits, device)
        self.draws: dict[int, torch.Tensor] = {}

    def __getitem__(self, draw: int) -> torch.Tensor:  # (1, H, C, B)
        if draw not in self.draws:
            salt, heads, clusters, nbits, device = self.args
            h = torch.arange(heads, device=device)[:, None, None]
            c = torch.arange(clusters, device=device)[None, :, None]
            b = torch.arange(nbits, device=device)[None, None, :]
            self.draws[draw] = ((hash_ints(salt.to(device), draw, h, c, b) & 1).float() * 2 - 1)[None]
        return self.draws[draw]


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
        cand = signs.gather(2, order[..., None].expand(-1, -1, -1, nbits)) > 0
        chosen, sel = _distinct_by_priority(pack_bits(cand), real_h.gather(-1, order), clusters)
        return chosen, order.gather(-1, sel), m

    chosen, query, m = pick(min(n, 4 * clusters))
    if m < n and bool((chosen >= m).any()):
        chosen, query, m = pick(n)
    cent = signs.gather(2, query[..., None].expand(-1, -1, -1, nbits))
    missing = chosen >= m  # fewer distinct codes than clusters
    return torch.where(missing[..., None], fresh[0], cent) if bool(missing.any()) else cent


def _key_base(clusters: int) -> int:
    """P, the power of two >= C that packs a cluster index under an agreement (see :func:`_key_table`)."""
    return 1 << max(clusters - 1, 1).bit_length()


def _exact_keys(clusters: int, nbits: int) -> bool:
    """Whether the packed keys are integers below 2**24, so exact in float32 whatever the summation order."""
    return (nbits + 1) * _key_base(clusters) < 2**24


def _key_table(cent: torch.Tensor) -> torch.Tensor:
    """[P * cent, -c]: (..., C, bits + 1), so that a query's ``[signs, 1] . row`` is ``P * agreement - c``.

    The agreement ``signs . cent`` is an integer in [-bits, bits]; with P >= C a power of two, the key is
    largest for the best cluster and, among equal agreements, for the first one, so a plain ``amax`` (much
    faster than ``max(...).indices`` over a short last dimension) finds it, and ``-key mod P`` decodes it.
    """
    clusters = cent.shape[-2]
    tag = -torch.arange(clusters, dtype=cent.dtype, device=cent.device).expand(*cent.shape[:-1])
    return torch.cat([cent * _key_base(clusters), tag[..., None]], dim=-1)


def _decode(best: torch.Tensor, clusters: int) -> torch.Tensor:
    """Cluster index of a packed key (see :func:`_key_table`)."""
    return torch.remainder(-best.long(), _key_base(clusters))


def _assign(signs: torch.Tensor, cent: torch.Tensor) -> torch.Tensor:
    """Nearest centroid in Hamming distance: the first maximum of the +-1 agreement. (B, H, N).

    ``signs`` carries a trailing 1 (..., N, bits + 1); one matrix product with :func:`_key_table` gives every
    packed key.
    """
    clusters, nbits = cent.shape[-2], cent.shape[-1]
    if not _exact_keys(clusters, nbits):  # keys would not be exact in float32: plain argmax
        return (signs[..., :nbits] @ cent.transpose(-1, -2)).max(-1).indices
    return _decode((signs @ _key_table(cent).transpose(-1, -2)).amax(-1), clusters)


def hamming_kmeans(
    bits: torch.Tensor,
    query_mask: torch.Tensor | None,
    clusters: int,
    iterations: int,
    salt: torch.Tensor,
    *,
    sync_free: bool | None = None,
) -> torch.Tensor:
    """Cluster index of every query from its code bits (B, H, N, bits) bool: (B, H, N) long (see :func:`kmeans`)."""
    signs = torch.ones(*bits.shape[:-1], bits.shape[-1] + 1, device=bits.device)
    signs[..., :-1].masked_fill_(~bits, -1.0)
    return kmeans(signs, query_mask, clusters, iterations, salt, sync_free=sync_free)


def kmeans(
    signs: torch.Tensor,
    query_mask: torch.Tensor | None,
    clusters: int,
    iterations: int,
    salt: torch.Tensor,
    *,
    sync_free: bool | None = None,
) -> torch.Tensor:
    """Cluster index of every query, (B, H, N) long. Padded queries take no part (their index is arbitrary).

    ``signs``: the codes as +-1 with a trailing +1, (B, H, N, bits + 1) float32 (:func:`hash_signs`).
    Lloyd iterations: assign every query to its nearest centroid, then set each centroid to the bitwise
    majority of its members. Each (batch row, head) is its own K-means; all of them run together as one
    batch of matrix products. On the CPU, :func:`_kmeans_incremental` does only the work that the centroids
    which moved require; on a GPU, where the host synchronisations this needs cost more than the arithmetic
    they save, :func:`_kmeans_fixed_iterations` runs every iteration in full. Both give the same assignment
    (tested). ``sync_free``: force one or the other (default: by device).
    """
    batch, heads, n, width = signs.shape
    g, nbits, dev = batch * heads, width - 1, signs.device
    real = torch.ones(batch, n, dtype=torch.bool, device=dev) if query_mask is None else query_mask
    fresh = _FreshCodes(salt, heads, clusters, nbits, dev)
    cent = _initial_centroids(signs[..., :nbits], real, clusters, salt, fresh).reshape(g, clusters, nbits)
    signs = signs.reshape(g, n, width)
    # one row per query: its +-1 vote on every bit and, last, its weight; the last column counts the members.
    # Votes and counts move together in one index_add_ (few kernel launches: each can stall when the CPU
    # cores are shared). Padded queries vote with weight 0.
    weight = real[:, None, :, None].float().expand(batch, heads, n, 1).reshape(g, n, 1)
    members = (signs if query_mask is None else signs * weight).reshape(g * n, width)
    if sync_free is None:
        sync_free = dev.type != "cpu"
    if sync_free or not _exact_keys(clusters, nbits):
        result = _kmeans_fixed_iterations(signs, members, cent, fresh, batch, iterations)
    else:
        result = _kmeans_incremental(signs, members, cent, fresh, batch, iterations)
    return result.view(batch, heads, n)


def _majority(votes: torch.Tensor, cent: torch.Tensor, fresh: _FreshCodes, it: int, batch: int, *, sync: bool):
    """The centroid update of iteration ``it``: the bitwise majority of the members (a tie keeps the bit), a
    fresh code for an empty cluster. ``votes`` (G, C, bits + 1), last column the member count. Returns the new
    centroids (G, C, bits) and which clusters are empty (G, C). ``sync``: look whether any cluster is empty
    before drawing fresh codes (a host synchronisation)."""
    g, clusters, nbits = cent.shape
    new = torch.where(votes[..., :-1] == 0, cent, torch.sign(votes[..., :-1]))
    empty = votes[..., -1] == 0
    if sync and not bool(empty.any()):
        return new, empty
    codes = fresh[it + 1].expand(batch, -1, -1, -1).reshape(g, clusters, nbits)
    return torch.where(empty[..., None], codes, new), empty


def _kmeans_fixed_iterations(
    signs: torch.Tensor, members: torch.Tensor, cent: torch.Tensor, fresh: _FreshCodes, batch: int, iterations: int
) -> torch.Tensor:
    """The Lloyd iterations of :func:`hamming_kmeans` without a host synchronisation: (G, N) assignments.

    ``signs``: (G, N, bits + 1) +-1 codes with a trailing 1; ``members``: (G*N, bits + 1) weighted votes and
    weights; ``cent``: (G, C, bits) initial centroids. Every iteration recounts all the votes (one
    ``index_add_``) and every series runs all ``iterations``: the plain reference of the CPU path.
    """
    g, n = signs.shape[:2]
    clusters, nbits = cent.shape[-2:]
    offset = torch.arange(g, device=signs.device)[:, None] * clusters  # (G, 1)
    for it in range(iterations):
        rows = (_assign(signs, cent) + offset).reshape(-1)  # (G*N,) rows of the (G*C) vote table
        v = members.new_zeros(g * clusters, nbits + 1).index_add_(0, rows, members).view(g, clusters, nbits + 1)
        cent, _ = _majority(v, cent, fresh, it, batch, sync=False)
    return _assign(signs, cent)


# rows of queries per matrix product in :func:`_best_keys`: the (G, rows, C) keys stay in one small buffer
_ROWS = 2048


def _best_keys(signs: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Each query's largest packed key against the rows of ``table``: (G, N, bits + 1) x (G, W, bits + 1) ->
    (G, N). Computed in blocks of rows through one reused buffer, so the (G, N, W) keys are never held whole
    (fresh pages of a large tensor cost more than the arithmetic on the CPU)."""
    g, n, _ = signs.shape
    table_t = table.transpose(-1, -2)
    rows = min(n, _ROWS)
    buf = signs.new_empty(g, rows, table.shape[1])
    best = signs.new_empty(g, n)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        part = torch.bmm(signs[:, start:stop], table_t, out=buf[:, : stop - start])
        torch.amax(part, dim=-1, out=best[:, start:stop])
    return best


def _kmeans_incremental(
    signs: torch.Tensor, members: torch.Tensor, cent: torch.Tensor, fresh: _FreshCodes, batch: int, iterations: int
) -> torch.Tensor:
    """The Lloyd iterations of :func:`_kmeans_fixed_iterations`, same result, with work in proportion to change.

    After the first two iterations few centroids still move (at N = 16384, C = 100: about a third of them in
    the third iteration, a tenth in the fourth). So an iteration compares every query with the centroids that
    changed only: a query's best key is the larger of its old best and the best changed one, except where its
    own centroid changed, whose best is searched again over all centroids. The vote sums (integers, exact in
    float32) are updated with the queries that moved only, and the loop stops once no centroid changes and
    none is empty (a fixed point: every later iteration would repeat it).
    """
    g, n, width = signs.shape
    clusters = cent.shape[1]
    offset = torch.arange(g, device=signs.device)[:, None] * clusters  # (G, 1)
    best = _best_keys(signs, _key_table(cent))  # (G, N)
    a = _decode(best, clusters)
    votes = members.new_zeros(g * clusters, width).index_add_(0, (a + offset).reshape(-1), members)
    for it in range(iterations):
        new, empty = _majority(votes.view(g, clusters, width), cent, fresh, it, batch, sync=True)
        changed = (new != cent).any(-1)  # (G, C)
        cols = int(changed.sum(-1).max())
        if cols == 0:
            if bool(empty.any()):
                continue  # the next fresh codes may move an empty cluster
            break
        cent, table = new, _key_table(new)
        stale = changed.gather(1, a)  # (G, N): queries whose own centroid moved, their best key is void
        rows = int(stale.sum(-1).max())
        if 2 * cols > clusters or 2 * rows > n:  # most centroids or queries affected: search everything
            best = _best_keys(signs, table)
        else:
            # the changed clusters of each series, padded with unchanged ones (comparing those is harmless)
            idx = changed.float().topk(cols, dim=-1).indices  # (G, W)
            best = torch.maximum(best, _best_keys(signs, table.gather(1, idx[..., None].expand(-1, -1, width))))
            if rows:  # the stale queries of each series, padded with others (their full search is their best)
                idx = stale.float().topk(rows, dim=-1).indices  # (G, R)
                flat = (idx + offset // clusters * n).reshape(-1)  # rows of the (G*N) query table
                picked = signs.reshape(g * n, width).index_select(0, flat).view(g, rows, width)
                best.scatter_(1, idx, _best_keys(picked, table))
        new_a = _decode(best, clusters)
        moved = (new_a != a).view(-1).nonzero().squeeze(1)  # flat (G*N) positions of the queries that moved
        if 3 * moved.numel() > g * n:  # many moved: a recount is cheaper
            votes.zero_().index_add_(0, (new_a + offset).reshape(-1), members)
        elif moved.numel():
            src, base = members.index_select(0, moved), moved // n * clusters  # their votes, their series' rows
            votes.index_add_(0, new_a.view(-1)[moved] + base, src)
            votes.index_add_(0, a.view(-1)[moved] + base, src, alpha=-1)
        a = new_a
    return a


def cluster_queries(
    q: torch.Tensor, query_mask: torch.Tensor | None, config: ClusteredConfig, state: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Hash, then Hamming K-means: the cluster index of every query, (B, H, N) long."""
    signs = hash_signs(q, state["planes"], state["offsets"], query_mask)
    return kmeans(signs, query_mask, config.clusters, config.iterations, state["salt"])


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
    total = q.new_zeros(batch * heads * clusters, d).index_add_(0, flat, rows).view(batch, heads, clusters, d)
    count = q.new_zeros(batch * heads * clusters).index_add_(0, flat, w).view(batch, heads, clusters)
    return total / count.clamp_min(1.0)[..., None], count


def centroid_attention(qc: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """A^c = softmax(s Q^c K^T + log m): (B, H, C, S), one (B, H, C, S) tensor written in place."""
    scores = (qc * scale) @ k.transpose(-1, -2)  # (B, H, C, S)
    if key_mask is not None:
        scores.masked_fill_(~key_mask[:, None, None, :], float("-inf"))
    return softmax_(scores)


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
    of every query (B, H, N) and the centroids Q^c (B, H, C, d).
    """
    dt = compute_dtype(q.dtype)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    key_mask = safe_key_mask(key_mask)
    v = zero_padded_values(v, key_mask)
    assign = cluster_queries(q, query_mask, config, state)
    qc, _ = centroids(q, assign, query_mask, config.clusters)
    return q, k, v, key_mask, assign, qc


def run(q, k, v, key_mask, query_mask, scale, config, state, finish, *, dense: bool = False) -> torch.Tensor:
    """The driver shared by clustered and improved-clustered attention.

    Sequences with at most C real queries, or fewer than ``config.exact_below``, get exact attention (or, with
    ``dense``, the exact attention matrix); the others are clustered and ``finish(q, k, v, key_mask, assign, qc)``
    computes their output from the cluster index of every query and the centroids.
    """

    def exact(q_, k_, v_, m_):
        return dense_softmax(q_, k_, m_, scale) if dense else exact_attention(q_, k_, v_, m_, scale)

    batch, _, n, _ = q.shape
    if n <= config.clusters or n < config.exact_below:
        return exact(q, k, v, key_mask)
    short = short_rows(query_mask, n, config, batch, q.device)
    if bool(short.all()):
        return exact(q, k, v, key_mask)
    qf, kf, vf, km, assign, qc = prepare(q, k, v, key_mask, query_mask, config, state, scale)
    out = finish(qf, kf, vf, km, assign, qc)
    out = exact_for_rows(out, short, lambda r: exact(qf[r], kf[r], vf[r], None if km is None else km[r]))
    return out.to(q.dtype)


def clustered_weights(q, k, *, key_mask, query_mask, scale, config, state) -> torch.Tensor:
    """Dense (B, H, N, S) attention implied by clustered attention (row i = its centroid's row)."""

    def finish(q, k, v, key_mask, assign, qc):
        return gather_clusters(centroid_attention(qc, k, key_mask, scale), assign)

    v = torch.zeros_like(k[..., :1])
    return run(q, k, v, key_mask, query_mask, scale, config, state, finish, dense=True)


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

    def finish(q, k, v, key_mask, assign, qc):
        # the C centroid rows A^c V through the fused kernel (A^c is never materialised); each query takes
        # its centroid's output
        return gather_clusters(exact_attention(qc, k, v, key_mask, scale), assign)

    return run(q, k, v, key_mask, query_mask, scale, config, state, finish)
