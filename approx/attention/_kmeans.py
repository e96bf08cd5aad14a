"""K-means in Hamming space over the LSH codes of queries (:mod:`._hashing`), the clustering of clustered
and improved clustered attention (``clustered.py``, ``iclustered.py``; plain torch).

Vyas, Katharopoulos, Fleuret, "Fast Transformers with Clustered Attention", NeurIPS 2020 (arXiv 2007.04825),
section 3.2. Choices made here:

* K-means starts from C distinct codes picked in a pseudo-random order that depends only on (seed, head, rank of
  the query among the row's real ones), never on the padded length nor on where the padding is, so padding at
  either end changes nothing for real tokens.
  Hamming distances are computed as +-1 dot products (``B - 2 * hamming``); centroids are the bitwise
  majority of their members (a tie keeps the previous bit); an empty cluster gets a fresh random code.
* No Python loop over clusters, heads or batch items. On the CPU the K-means compares queries with the
  centroids that moved only (after two iterations, a few of the C), updates the vote sums with the queries
  that moved only, and stops at a fixed point; on a GPU the iterations run in full, without host
  synchronisation; both give identical clusters (tested). On the CPU only the 4C first queries in priority order
  are packed to pick the initial codes (every query where they hold fewer than C distinct codes); without host
  synchronisation every query is, at once, and every fresh code is drawn up front: the same codes (tested).
"""

from __future__ import annotations

import torch

from ._hashing import hash_ints, pack_bits


class _FreshCodes:
    """Pseudo-random +-1 codes for (salt, draw, head, cluster, bit), hashed per draw on first use.

    Draw 0 seeds clusters that found no distinct code; draw t > 0 replaces clusters left empty by iteration t.
    """

    def __init__(self, salt: torch.Tensor, heads: int, clusters: int, nbits: int, device, head_index=None) -> None:
        self.args = (salt, heads, clusters, nbits, device, head_index)
        self.draws: dict[int, torch.Tensor] = {}

    def __getitem__(self, draw: int) -> torch.Tensor:  # (1, H, C, B)
        if draw not in self.draws:
            salt, heads, clusters, nbits, device, head_index = self.args
            self.draws[draw] = fresh_draws(salt, draw, draw + 1, heads, clusters, nbits, device, head_index)[0]
        return self.draws[draw]


def fresh_draws(
    salt: torch.Tensor, first: int, stop: int, heads: int, clusters: int, nbits: int, device, head_index=None
):
    """The fresh codes of draws ``first`` .. ``stop - 1`` at once (see :class:`_FreshCodes`): (draws, 1, H, C, B).
    ``head_index``: each head's index in its layer (default 0 .. H - 1; see :func:`kmeans`)."""
    t = torch.arange(first, stop, device=device)[:, None, None, None]
    h = _heads(heads, device, head_index)[:, None, None]
    c = torch.arange(clusters, device=device)[None, :, None]
    b = torch.arange(nbits, device=device)[None, None, :]
    return ((hash_ints(salt.to(device), t, h, c, b) & 1).float() * 2 - 1)[:, None]


def _heads(heads: int, device, head_index: torch.Tensor | None) -> torch.Tensor:
    """Each head's index in its layer: ``head_index``, or 0 .. ``heads`` - 1."""
    return torch.arange(heads, device=device) if head_index is None else head_index.to(device)


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
    fresh: _FreshCodes | torch.Tensor,
    *,
    sync: bool = True,
    head_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """C distinct codes of real queries, taken in a padding-independent pseudo-random order: (B, H, C, bits).

    The order is by a hash of (salt, head, rank among the row's real queries), padded queries last: the same
    wherever the padding is (at the end, where the rank is the position, or at the start). Only the first 4C queries
    in that order are packed and compared; where they hold fewer than C distinct codes (many equal queries), every
    query is. Both give the same choice: the C highest-priority distinct codes. Without ``sync`` (no host
    synchronisation: GPU, compiled code), every query is compared at once and ``fresh`` is draw 0 itself, (1, H, C,
    bits), put wherever codes are missing."""
    batch, heads, n, nbits = signs.shape
    pos = torch.arange(n, device=signs.device)
    head = _heads(heads, signs.device, head_index)
    rank = torch.where(real, real.long().cumsum(-1) - 1, pos)  # (B, N): a real query's rank among the real ones
    prio = hash_ints(salt.to(signs.device), head[None, :, None], rank[:, None, :]).expand(batch, heads, n)
    prio = prio.masked_fill(~real[:, None, :], 2**40)  # padded queries last
    key = prio * n + rank[:, None, :]  # unique, so the order equals a stable sort of the priorities
    real_h = real[:, None, :].expand(batch, heads, n)

    def pick(m: int):
        order = key.topk(m, dim=-1, largest=False).indices if m < n else key.argsort(dim=-1)  # (B, H, M)
        cand = signs.gather(2, order[..., None].expand(-1, -1, -1, nbits)) > 0
        chosen, sel = _distinct_by_priority(pack_bits(cand), real_h.gather(-1, order), clusters)
        return chosen, order.gather(-1, sel), m

    if not sync:
        chosen, query, m = pick(n)
        cent = signs.gather(2, query[..., None].expand(-1, -1, -1, nbits))
        return torch.where((chosen >= m)[..., None], fresh, cent)
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
    head_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cluster index of every query from its code bits (B, H, N, bits) bool: (B, H, N) long (see :func:`kmeans`)."""
    signs = torch.ones(*bits.shape[:-1], bits.shape[-1] + 1, device=bits.device)
    signs[..., :-1].masked_fill_(~bits, -1.0)
    return kmeans(signs, query_mask, clusters, iterations, salt, sync_free=sync_free, head_index=head_index)


def kmeans(
    signs: torch.Tensor,
    query_mask: torch.Tensor | None,
    clusters: int,
    iterations: int,
    salt: torch.Tensor,
    *,
    sync_free: bool | None = None,
    head_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cluster index of every query, (B, H, N) long. Padded queries take no part (their index is arbitrary).

    ``signs``: the codes as +-1 with a trailing +1, (B, H, N, bits + 1) float32 (:func:`hash_signs`).
    Lloyd iterations: assign every query to its nearest centroid, then set each centroid to the bitwise
    majority of its members. Each (batch row, head) is its own K-means; all of them run together as one
    batch of matrix products. On the CPU, :func:`_kmeans_incremental` does only the work that the centroids
    which moved require; on a GPU, where the host synchronisations this needs cost more than the arithmetic
    they save, :func:`_kmeans_fixed_iterations` runs every iteration in full. Both give the same assignment
    (tested). ``sync_free``: force one or the other (default: by device). ``head_index``: each head's index in its
    layer, (H,) int64, by which the random starts are drawn (default 0 .. H - 1; a call holding some of its layer's
    heads passes theirs, so that a head clusters alike alone or beside the others).
    """
    batch, heads, n, width = signs.shape
    g, nbits, dev = batch * heads, width - 1, signs.device
    real = torch.ones(batch, n, dtype=torch.bool, device=dev) if query_mask is None else query_mask
    if sync_free is None:
        sync_free = dev.type != "cpu"
    sync_free = sync_free or not _exact_keys(clusters, nbits)
    if sync_free:  # every fresh code up front: draw 0 for the start, draw t + 1 for iteration t
        codes = fresh_draws(salt, 0, iterations + 1, heads, clusters, nbits, dev, head_index)
        cent = _initial_centroids(signs[..., :nbits], real, clusters, salt, codes[0], sync=False, head_index=head_index)
    else:
        fresh = _FreshCodes(salt, heads, clusters, nbits, dev, head_index)
        cent = _initial_centroids(signs[..., :nbits], real, clusters, salt, fresh, head_index=head_index)
    cent = cent.reshape(g, clusters, nbits)
    signs = signs.reshape(g, n, width)
    # one row per query: its +-1 vote on every bit and, last, its weight; the last column counts the members.
    # Votes and counts move together in one index_add_ (few kernel launches: each can stall when the CPU
    # cores are shared). Padded queries vote with weight 0.
    weight = real[:, None, :, None].float().expand(batch, heads, n, 1).reshape(g, n, 1)
    members = (signs if query_mask is None else signs * weight).reshape(g * n, width)
    if sync_free:
        result = _kmeans_fixed_iterations(signs, members, cent, codes[1:], batch, iterations)
    else:
        result = _kmeans_incremental(signs, members, cent, fresh, batch, iterations)
    return result.view(batch, heads, n)


def _majority(votes: torch.Tensor, cent: torch.Tensor, codes: torch.Tensor | None):
    """The centroid update: the bitwise majority of the members (a tie keeps the bit), ``codes`` (G, C, bits) for
    an empty cluster (None: empty clusters keep their code, the caller looks). ``votes`` (G, C, bits + 1), last column the member count.
    Returns the new centroids (G, C, bits) and which clusters are empty (G, C)."""
    new = torch.where(votes[..., :-1] == 0, cent, torch.sign(votes[..., :-1]))
    empty = votes[..., -1] == 0
    return (new, empty) if codes is None else (torch.where(empty[..., None], codes, new), empty)


def _kmeans_fixed_iterations(
    signs: torch.Tensor, members: torch.Tensor, cent: torch.Tensor, codes: torch.Tensor, batch: int, iterations: int
) -> torch.Tensor:
    """The Lloyd iterations of :func:`hamming_kmeans` without a host synchronisation: (G, N) assignments.

    ``signs``: (G, N, bits + 1) +-1 codes with a trailing 1; ``members``: (G*N, bits + 1) weighted votes and
    weights; ``cent``: (G, C, bits) initial centroids, G = ``batch`` x heads; ``codes``: (iterations, 1, H, C, bits)
    the fresh codes of each iteration's empty clusters (shared by the batch rows). Every iteration recounts all the
    votes (one ``index_add_``) and every series runs all ``iterations``: the plain reference of the CPU path, and
    the path that compiles.
    """
    g, n = signs.shape[:2]
    clusters, nbits = cent.shape[-2:]
    offset = torch.arange(g, device=signs.device)[:, None] * clusters  # (G, 1)
    for it in range(iterations):
        rows = (_assign(signs, cent) + offset).reshape(-1)  # (G*N,) rows of the (G*C) vote table
        v = members.new_zeros(g * clusters, nbits + 1).index_add_(0, rows, members).view(g, clusters, nbits + 1)
        cent, _ = _majority(v, cent, codes[it].expand(batch, -1, -1, -1).reshape(g, clusters, nbits))
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
        new, empty = _majority(votes.view(g, clusters, width), cent, None)
        if bool(empty.any()):  # fresh codes for the empty clusters
            new = torch.where(empty[..., None], fresh[it + 1].expand(batch, -1, -1, -1).reshape(g, clusters, -1), new)
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
