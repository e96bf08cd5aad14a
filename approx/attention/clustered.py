"""Clustered attention.

Vyas, Katharopoulos, Fleuret, "Fast Transformers with Clustered Attention", NeurIPS 2020 (arXiv 2007.04825),
section 3.2. Queries are hashed with biased random hyperplanes (:mod:`._hashing`), grouped by K-means in
Hamming space (:mod:`._kmeans`), and attention is computed for the C cluster centroids only; every query takes
its centroid's output.

Cost per batch item and head: O(N C max(d, dv)) for the attention plus O(N B d) hashing and O(I N C B)
clustering, with N queries, C clusters, B bits and I iterations (and O(R N C d) for R ``refine`` steps).

Choices made here:

* The planes a_b ~ N(0, I) and offsets u_b ~ N(0, 1) are drawn once from the seed when a layer is patched
  and kept as buffers, so a patched model is deterministic and saved with its state. The reference code
  draws new planes on every forward pass.
* Bit b of query q is ``[q . a_b >= beta_b]`` with the bias ``beta_b = mean_b + std_b * u_b``, where mean_b and
  std_b are the mean and standard deviation of ``q . a_b`` over the real queries of that sequence and head (see
  :mod:`._hashing`), and u_b is the layer's draw (``thresholds="random"``) or 0 (``"mean"``); K-means starts from C
  distinct codes in a padding-independent pseudo-random order, centroids are the bitwise majority of their members
  (see :mod:`._kmeans`).
* ``refine`` (not in the paper): Lloyd steps in Euclidean space on the queries themselves after the Hamming
  K-means (:func:`refine_clusters`). One step is the default: in ``recipes/sharper_clustering.py`` it lowered
  the attention-output error of every setting (by 7-30 %) and lowered no task metric; ``refine=0`` is the paper's
  clustering, and what a saved folder or a result from before the option means.
* Sequences with at most C real queries fall back to exact attention, per batch row; so do sequences with
  fewer than ``exact_below`` real tokens (off by default, so that measurements at short lengths measure the
  approximation; set it to the crossover length for speed). Both go through :mod:`._fallback`.
* Speed (plain PyTorch, no Python loop over clusters, heads or batch items): the thresholds of the hash come
  from the queries' mean and covariance, so the codes are one product with a bias; the centroid outputs come
  from the fused SDPA kernel (A^c is never formed); per-cluster rows are copied with ``index_select`` on
  flattened tables. Large fresh tensors are avoided where a reused buffer does: on the CPU, first-touch page
  faults of a new 50 MB tensor cost more than a pass of arithmetic over it.
* ``engine="compiled"`` runs the clustering (hash, K-means without host synchronisation, centroids) as one
  ``torch.compile`` graph (:mod:`._compiled`): about 150 operator calls instead of thousands, the same
  clusters (in float64; in float32 a hash bit at its threshold can round the other way, see :mod:`._compiled`); on
  the CPU it is slower than the eager code (its K-means cannot stop early or skip the centroids
  that did not move), so it is for GPUs.
* Attention dropout (training) acts on the centroid attention A^c (one mask per cluster, shared by its
  queries) and on the rows that fall back to exact attention; its expected output is the output without it.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import MethodConfig, option
from ..registry import Cost, ExactLimit, register
from . import _compiled, _context, _fallback
from ._common import (
    compute_dtype,
    dense_softmax,
    exact_attention,
    padded_exact_attention,
    safe_key_mask,
    softmax_,
    zero_padded_values,
)
from ._fallback import exact_for_length
from ._hashing import hash_signs
from ._kmeans import kmeans

THRESHOLDS = ("random", "mean")


@dataclasses.dataclass(frozen=True)
class ClusteredConfig(MethodConfig):
    """Options of clustered attention."""

    method = "clustered"

    clusters: int = option(25, "number of query clusters C (the paper uses 25 on GLUE/SQuAD, 100 for speed)")
    iterations: int = option(10, "Lloyd iterations of the Hamming K-means (reference default 10)")
    bits: int = option(63, "bits B of the LSH code of a query; codes are packed in int64, so at most 63")
    refine: int = option(
        1,
        "Lloyd steps in Euclidean space on the queries themselves after the Hamming K-means (0: the paper's "
        "clusters; each step moves every query to its nearest centroid, then recomputes the centroids; on the CPU "
        "the eager engine stops early at a fixed point, where more would change nothing; the cost counts them all; "
        "1 since issue #20: see the docs' Results, 'Sharper clustering')",
        absent=0,  # saved folders and results from before the option: the paper's clusters
    )
    thresholds: str = option(
        "random",
        "where each hash hyperplane cuts the real queries of a sequence and head: 'random' (their mean plus a "
        "random number of standard deviations, drawn once per layer) or 'mean' (through their mean: balanced bits)",
    )
    seed: int = option(0, "seed of the hash planes and of the K-means initialisation")
    engine: str = _compiled.engine_option()
    exact_below: int = option(
        0,
        "sequences with fewer real tokens get exact attention (0 = never; set it to the measured crossover for "
        "speed: see the docs' Speed page; rows with at most C real tokens are always exact)",
    )

    def unused(self) -> dict[str, str]:
        # one cluster holds every query: no hash, K-means or refinement runs (prepare), its centroid is their mean
        clustering = ("bits", "iterations", "refine", "thresholds", "seed")
        return {name: "clusters of 2 or more" for name in clustering} if self.clusters == 1 else {}

    def check(self) -> None:
        self.require(self.clusters >= 1, "clusters", "need at least one cluster")
        self.require(self.exact_below >= 0, "exact_below", "a length: 0 (off) or more")
        self.require(self.iterations >= 0, "iterations", "cannot be negative")
        self.require(self.refine >= 0, "refine", "a number of Lloyd steps: 0 (off) or more")
        self.require(1 <= self.bits <= 63, "bits", "a code is packed into a signed 64-bit integer: 1 to 63 bits")
        self.require(self.seed >= 0, "seed", "seeds are non-negative integers")
        _compiled.check_engine(self)
        self.require(self.thresholds in THRESHOLDS, "thresholds", f"one of {', '.join(map(repr, THRESHOLDS))}")


def init_state(config: ClusteredConfig, *, head_dim: int, seed: int) -> dict[str, torch.Tensor]:
    """Hash planes (B, d), plane offsets (B,) and a salt for the K-means initialisation."""
    g = torch.Generator().manual_seed(seed)
    return {
        "planes": torch.randn(config.bits, head_dim, generator=g),
        "offsets": torch.randn(config.bits, generator=g),
        "salt": torch.randint(0, 2**31 - 1, (1,), generator=g),
    }


def exact_for(config: ClusteredConfig, n: int) -> bool:
    """Whether a sequence of ``n`` real queries gets exact attention: at most C, or fewer than ``exact_below``."""
    return exact_for_length(n, exact_below=config.exact_below, at_most=config.clusters)


def cost(config: ClusteredConfig, *, n: int, s: int, d: int, dv: int) -> Cost:
    if exact_for(config, n):
        return Cost(flops=2 * n * s * (d + dv), qk_pairs=n * s, matmul_macs=n * s * (d + dv))
    c, b = config.clusters, config.bits
    clustering = c > 1  # one cluster holds every query: no hash, no K-means, no Euclidean step (prepare)
    hashing = 2 * n * b * d if clustering else 0
    kmeans = 2 * (config.iterations + 1) * n * c * b if clustering else 0
    refine = config.refine * (2 * n * c * d + 2 * n * d) if clustering else 0  # query-centroid products, new means
    attention = 2 * c * s * (d + dv)
    return Cost(flops=hashing + kmeans + refine + attention, qk_pairs=c * s, matmul_macs=c * s * (d + dv))


def offsets(config: ClusteredConfig, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """u_b of the thresholds ``mean_b + std_b * u_b``: the layer's random draws, or zeros (``thresholds="mean"``)."""
    return state["offsets"] if config.thresholds == "random" else torch.zeros_like(state["offsets"])


def cluster_queries(
    q: torch.Tensor, query_mask: torch.Tensor | None, config: ClusteredConfig, state: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Hash, Hamming K-means, then ``refine`` Euclidean Lloyd steps: the cluster index of every query, (B, H, N)."""
    signs = hash_signs(q, state["planes"], offsets(config, state), query_mask)
    head_index = _context.given_head_indices(q.shape[1], q.device)  # a call on some of the layer's heads: theirs
    assign = kmeans(signs, query_mask, config.clusters, config.iterations, state["salt"], head_index=head_index)
    return refine_clusters(q, assign, query_mask, config.clusters, config.refine)


def refine_clusters(
    q: torch.Tensor,
    assign: torch.Tensor,
    query_mask: torch.Tensor | None,
    clusters: int,
    steps: int,
    *,
    chunked: bool = True,
) -> torch.Tensor:
    """``steps`` Lloyd steps in Euclidean space from the clusters ``assign`` (B, H, N): each computes the centroids
    (the means of the real member queries) and moves every query to its nearest non-empty one,
    argmin_c |q - Q^c|^2 = argmax_c (q . Q^c - |Q^c|^2 / 2). The Hamming K-means clusters the queries' hash codes, a
    coarse image of the queries; these steps cluster the queries themselves, at O(N C d) each. Padded queries
    never count in a centroid; their index is whatever is nearest (their rows are discarded). ``chunked`` (eager
    code): the products a block of queries at a time; not (compiled code: no loop over the length, which would fix
    it in the graph): every query at once. On the CPU the eager steps stop at a fixed point (an assignment that a
    step leaves as it was: every later step would repeat it), so ``steps`` is a bound there; elsewhere every step
    runs, without host synchronisation."""
    if steps == 0:
        return assign
    with torch.no_grad():  # indices only: no gradient flows through a choice of cluster
        return _lloyd_steps(q.detach(), assign, query_mask, clusters, steps, chunked)


def _lloyd_steps(q, assign, query_mask, clusters: int, steps: int, chunked: bool) -> torch.Tensor:
    batch, heads, n, d = q.shape
    q3 = q.reshape(batch * heads, n, d)
    settle = chunked and q.device.type == "cpu"  # stop at a fixed point (host synchronisation is free on the CPU)
    for step in range(steps):
        qc, count = centroids(q, assign, query_mask, clusters)
        # -|Q^c|^2 / 2 per cluster, -inf for an empty one: the bias of one fused product per block of queries
        bias = (qc.square().sum(-1) * -0.5).masked_fill_(count == 0, float("-inf")).view(batch * heads, 1, clusters)
        qct = qc.view(batch * heads, clusters, d).transpose(1, 2)
        if not chunked:
            assign = torch.baddbmm(bias, q3, qct).argmax(-1).view(batch, heads, n)
            continue
        # a (B*H, rows, C) block at a time into one reused buffer, not one (B, H, N, C) tensor: it stays in cache
        rows = min(n, _REFINE_ROWS)
        block, nearest = q.new_empty(batch * heads, rows, clusters), assign.new_empty(batch * heads, n)
        for start in range(0, n, rows):
            part = q3[:, start : start + rows]
            out = block[:, : part.shape[1]]
            torch.argmax(torch.baddbmm(bias, part, qct, out=out), -1, out=nearest[:, start : start + rows])
        moved = nearest.view(batch, heads, n)
        if settle and step + 1 < steps and torch.equal(moved, assign):
            return assign
        assign = moved
    return assign


# queries per block of :func:`refine_clusters`'s query-centroid products: a (B*H, 256, C) block, 1.2 MB for one
# sequence of 12 heads at C = 100, fits in cache (measured at N = 16384, one thread: 256 rows took two thirds of the
# time of 2048); the compiled code takes every query at once
_REFINE_ROWS = 256


def _clusters(q, query_mask, planes, offsets, salt, clusters: int, iterations: int, refine: int, head_index=None):
    """Hash, K-means without host synchronisation, the Euclidean steps, centroids: the cluster index of every query
    (B, H, N) and the centroids Q^c (B, H, C, d). One function, so that ``engine="compiled"`` makes it one compiled
    graph (``head_index``: see :func:`kmeans`, read by the caller)."""
    signs = hash_signs(q, planes, offsets, query_mask)
    assign = kmeans(signs, query_mask, clusters, iterations, salt, sync_free=True, head_index=head_index)
    assign = refine_clusters(q, assign, query_mask, clusters, refine, chunked=False)
    return assign, centroids(q, assign, query_mask, clusters)[0]


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

    Returns (q, k, v) in the compute dtype with padded keys and values zeroed (a padded key's score is masked, which
    an overflowing one would turn into NaN), the safe key mask, the cluster index of every query (B, H, N) and the
    centroids Q^c (B, H, C, d).
    """
    dt = compute_dtype(q.dtype)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    key_mask = safe_key_mask(key_mask)
    k, v = zero_padded_values(k, key_mask), zero_padded_values(v, key_mask)
    if config.clusters == 1:  # every query in the one cluster, whatever a hash and a K-means would find: skipped
        assign = torch.zeros(q.shape[:3], dtype=torch.long, device=q.device)
        qc, _ = centroids(q, assign, query_mask, 1)
    elif config.engine == "compiled":
        args = (
            q,
            query_mask,
            state["planes"],
            offsets(config, state),
            state["salt"],
            config.clusters,
            config.iterations,
            config.refine,
            _context.given_head_indices(q.shape[1], q.device),
        )
        assign, qc = _compiled.call(_clusters, *args, method=config.method)
    else:
        assign = cluster_queries(q, query_mask, config, state)
        qc, _ = centroids(q, assign, query_mask, config.clusters)
    return q, k, v, key_mask, assign, qc


def run(
    q, k, v, key_mask, query_mask, scale, config, state, finish, *, dense: bool = False, dropout: float = 0.0
) -> torch.Tensor:
    """The driver shared by clustered and improved-clustered attention.

    Sequences with at most C real queries, or fewer than ``config.exact_below``, get exact attention (or, with
    ``dense``, the exact attention matrix); the others are clustered and ``finish(q, k, v, key_mask, assign, qc)``
    computes their output from the cluster index of every query and the centroids. ``dropout``: attention
    dropout of the exact rows (``finish`` applies it to the rows it computes).
    """

    def exact(q_, k_, v_, m_):
        return dense_softmax(q_, k_, m_, scale) if dense else padded_exact_attention(q_, k_, v_, m_, scale, dropout)

    prepared = []  # the inputs in the compute dtype, for the rows replaced by exact attention

    def approximate() -> torch.Tensor:
        qf, kf, vf, km, assign, qc = prepare(q, k, v, key_mask, query_mask, config, state, scale)
        prepared.extend((qf, kf, vf, km))
        return finish(qf, kf, vf, km, assign, qc)

    def exact_rows(rows: torch.Tensor | None) -> torch.Tensor:
        if rows is None:  # every row exact: nothing was prepared
            return exact(q, k, v, key_mask)
        qf, kf, vf, km = prepared
        return exact(qf[rows], kf[rows], vf[rows], None if km is None else km[rows])

    out = _fallback.with_fallback(
        approximate,
        exact_rows,
        query_mask=query_mask,
        shape=(q.shape[0], q.shape[2]),
        device=q.device,
        exact_below=config.exact_below,
        at_most=config.clusters,
    )
    return out if dense else out.to(q.dtype)  # (weights in the compute dtype, as every method's)


def clustered_weights(q, k, *, key_mask, query_mask, scale, config, state) -> torch.Tensor:
    """Dense (B, H, N, S) attention implied by clustered attention (row i = its centroid's row)."""

    def finish(q, k, v, key_mask, assign, qc):
        return gather_clusters(centroid_attention(qc, k, key_mask, scale), assign)

    v = torch.zeros_like(k[..., :1])
    return run(q, k, v, key_mask, query_mask, scale, config, state, finish, dense=True)


@register(
    "clustered",
    ClusteredConfig,
    cost=cost,
    init_state=init_state,
    weights=clustered_weights,
    test_options={"clusters": 8},
    # queries taking at most C distinct values: each cluster is one value, its centroid that query
    exact_limit=ExactLimit(options=lambda n: {"clusters": 8}, distinct_queries=8),
)
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
        # the C centroid rows A^c V through the fused kernel (A^c is never materialised, attention dropout
        # acts on it); each query takes its centroid's output
        return gather_clusters(exact_attention(qc, k, v, key_mask, scale, dropout), assign)

    return run(q, k, v, key_mask, query_mask, scale, config, state, finish, dropout=dropout)
