"""Sparsefinder: attention computed only on a predicted graph of query-key pairs, per head.

Treviso, Góis, Fernandes, Fonseca, Martins, "Predicting Attention Sparsity in Transformers", SPNLP 2022
(arXiv 2109.12188). The gold graph G_h of a head is the support of alpha-entmax(s Q K^T) (masked). Learned
per-head projections q' = W^Q_h q, k' = W^K_h k to r dimensions (4 in the reference code) are trained so that
pairs of G_h are close and pairs outside it far apart (margin loss; see ``approx/attention/_fitting.py``).
The predicted graph Ĝ_h (``approx/attention/_graph.py``) joins, in the projected space:

* ``distance``: ||q'_i - k'_j|| <= t (O(N S) comparisons in r dimensions, computed in query blocks);
* ``bucketing``: each of the r dimensions is cut into beta buckets holding equally many real keys; i and j
  are joined when they share a bucket in any dimension;
* ``kmeans``: B centroids learned on projected queries and keys; a key belongs to its nearest centroid, a
  query to its ``top_clusters`` nearest ones; i and j are joined when j's cluster is one of i's;

plus a ``window`` (|i - j| <= w) and global tokens (the first ``global_tokens`` positions and optionally the
last real token: every query attends to them and they attend to every key). Attention is then alpha-entmax
(``target="entmax"``: the model runs entmax, and a graph containing G gives exactly the entmax output, the
sparse-consistency property) or softmax (``target="softmax"``: zero-shot on softmax checkpoints, G being the
entmax support of the same scores) restricted to Ĝ.

Fast paths (``sparsefinder_attention``): keys are sorted by bucket / cluster, every query gathers the keys of
its groups (a padded list of width max group size per slot), its window and the global keys, with each key
counted once; scores, entmax / softmax and the value sum are computed on those gathered keys only, in query
blocks. With ``kmeans`` and ``top_clusters=1`` (the default), the queries of a cluster share its keys, so they
are sorted by cluster into blocks whose group scores are one matrix product per block (the keys gathered once
per block, not once per query), chunks of blocks padded only to their own largest cluster
(``_cluster_block_attention``); entmax sorts only the top scores of a row first. No (N, S) matrix is formed
except for ``distance``, where it is inherent (one block of rows at a time). ``simulated_weights`` builds the
same graph as a dense (N, S) mask: for measuring and tests only. A query whose graph is empty (possible only
with ``window=0`` and ``global_tokens=0``) gets a zero output.

The projections and centroids are fitted state: ``approx.fit(model, data)`` (or ``approx fit``) learns them
from the model's own queries and keys; running before fitting raises an error saying so.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from ..config import MethodConfig, option
from ..registry import Cost, ExactLimit, register
from . import _fallback
from ._common import block_rows, block_size, compute_dtype, refuse_left_padding, safe_key_mask, zero_padded_values
from ._entmax import MAX_ALPHA, MIN_ALPHA_GAP, entmax
from ._fitting import SparsefinderFitConfig, fit_kmeans, fit_projections, gold_graph
from ._graph import bucket_ids, cluster_ids, entries, global_rows, group_ids, predicted_mask, reach

__all__ = ["SparsefinderConfig", "SparsefinderFitConfig", "bucket_ids", "cluster_ids", "graph_stats", "predicted_mask"]

GROUPINGS = ("distance", "bucketing", "kmeans")
TARGETS = ("entmax", "softmax")
NOT_FITTED = (
    "sparsefinder: the projections and centroids are not fitted; fit first with approx.fit(model, data) "
    "or `approx fit --model M --output-dir OUT` (see `approx fit --help`), then run or save the model"
)


@dataclasses.dataclass(frozen=True)
class SparsefinderConfig(MethodConfig):
    """Options of Sparsefinder attention."""

    method = "sparsefinder"

    grouping: str = option("kmeans", "how the graph is predicted: 'distance', 'bucketing' or 'kmeans'")
    target: str = option(
        "entmax", "'entmax': entmax on the graph (exact when it holds G); 'softmax': softmax on the graph (zero-shot)"
    )
    alpha: float = option(1.5, "alpha of the entmax that defines the gold graph G (and the attention if target=entmax)")
    projection_dim: int = option(4, "r, dimension of the learned query / key projections (reference default 4)")
    threshold: float = option(1.0, "distance grouping: join q and k when their projected distance is at most threshold")
    buckets: int = option(8, "bucketing: beta buckets per projected dimension, each with equally many real keys")
    clusters: int = option(8, "kmeans: number of centroids B learned in the projected space (about sqrt(N))")
    top_clusters: int = option(1, "kmeans: a query attends to the keys of its top_clusters nearest centroids")
    window: int = option(
        1, "also join tokens at most window positions apart (0: no window, not even i = j; >= N: every pair)"
    )
    global_tokens: int = option(
        1,
        "the first global_tokens positions (CLS; padding must come after the real tokens: left padding is refused) "
        "attend to and are attended by every token",
    )
    last_token: bool = option(
        False,
        "the last real token is global as well (SEP in BERT-style inputs; padding must come after the real tokens)",
    )
    seed: int = option(0, "seed of the initial projections, of the k-means initialisation and of negative sampling")

    def unused(self) -> dict[str, str]:
        # (clusters is read by every grouping: approx.fit draws its k-means, and the state's shape follows it)
        readers = {"threshold": "distance", "buckets": "bucketing", "top_clusters": "kmeans"}
        return {name: f"grouping={g!r}" for name, g in readers.items() if g != self.grouping}

    def check(self) -> None:
        self.require(self.grouping in GROUPINGS, "grouping", f"choose one of {', '.join(GROUPINGS)}")
        self.require(self.target in TARGETS, "target", f"choose one of {', '.join(TARGETS)}")
        self.require(math.isfinite(self.alpha) and self.alpha > 1, "alpha", "alpha-entmax needs alpha > 1")
        self.require(self.alpha - 1 >= MIN_ALPHA_GAP, "alpha", f"alpha - 1 below {MIN_ALPHA_GAP:g} cannot be resolved")
        self.require(self.alpha <= MAX_ALPHA, "alpha", f"at most {MAX_ALPHA:g} (larger alpha gives NaN)")
        self.require(self.projection_dim >= 1, "projection_dim", "need at least one projected dimension")
        self.require(self.threshold >= 0, "threshold", "a distance threshold is at least 0")
        self.require(self.buckets >= 1, "buckets", "need at least one bucket")
        self.require(self.clusters >= 1, "clusters", "need at least one cluster")
        self.require(
            1 <= self.top_clusters <= self.clusters, "top_clusters", "must be between 1 and the number of clusters"
        )
        self.require(self.window >= 0, "window", "a window is at least 0")
        self.require(self.global_tokens >= 0, "global_tokens", "cannot be negative")


# ---------------------------------------------------------------------------------------------- state


def init_state(config: SparsefinderConfig, *, head_dim: int, seed: int) -> dict[str, torch.Tensor]:
    """Unfitted placeholders: the number of heads is known only when fitting, so the projections
    (H, d, r) and centroids (H, B, r) start empty and ``fitted`` is 0."""
    r = config.projection_dim
    return {
        "proj_q": torch.zeros(0, head_dim, r),
        "proj_k": torch.zeros(0, head_dim, r),
        "centroids": torch.zeros(0, config.clusters, r),
        "fitted": torch.zeros((), dtype=torch.uint8),
    }


def fit(config: SparsefinderConfig, state, samples, *, progress: bool = False, **settings):
    """Fitted state from ``samples``: a list of (q, k, key_mask, scale) with q, k (B, H, N, d), the model's own
    queries and keys. ``settings`` are those of :class:`SparsefinderFitConfig` (steps, lr, queries, margin...);
    with ``fit_projections_too=False`` only the centroids are refitted on the existing projections."""
    fit_settings = SparsefinderFitConfig.from_options(**settings)
    if fit_settings.fit_projections_too:
        proj_q, proj_k, _ = fit_projections(
            samples, config.alpha, config.projection_dim, fit_settings, seed=config.seed, progress=progress
        )
    else:
        _require_fitted(state)
        proj_q, proj_k = state["proj_q"].float(), state["proj_k"].float()
    centroids = fit_kmeans(
        samples,
        proj_q,
        proj_k,
        config.clusters,
        seed=config.seed,
        iterations=fit_settings.kmeans_iterations,
        points=fit_settings.kmeans_points,
    )
    return {"proj_q": proj_q, "proj_k": proj_k, "centroids": centroids, "fitted": torch.ones((), dtype=torch.uint8)}


def teacher(config: SparsefinderConfig) -> tuple[str, dict]:
    """The attention the graph predicts, run while fitting: entmax for ``target="entmax"``, else exact softmax."""
    return ("entmax", {"alpha": config.alpha}) if config.target == "entmax" else ("full", {})


def _require_fitted(state) -> None:
    if int(state["fitted"]) != 1:
        raise RuntimeError(NOT_FITTED)


def _projected(q, k, state, dt, config):
    """q' (B, H, N, r) and k' (B, H, S, r) with each head's fitted projection."""
    _require_fitted(state)
    if q.shape[2] != k.shape[2]:  # (every path reads its projections here first)
        raise ValueError(
            f"sparsefinder: self-attention only (N = S): its window and global tokens are positions that queries and "
            f"keys share; got N = {q.shape[2]}, S = {k.shape[2]}"
        )
    heads, fitted_shape = q.shape[1], (q.shape[1], q.shape[-1], config.projection_dim)
    for name, want in (("proj_q", fitted_shape), ("proj_k", fitted_shape), ("centroids", (heads, config.clusters))):
        got = tuple(state[name].shape[: len(want)])
        if got != want:
            raise ValueError(
                f"sparsefinder state {name!r} has shape {tuple(state[name].shape)}, expected {want}+ for these "
                "inputs and options (heads, head_dim, projection_dim, clusters): fit again with these options"
            )
    qp = torch.einsum("bhnd,hdr->bhnr", q.to(dt), state["proj_q"].to(dt))
    kp = torch.einsum("bhsd,hdr->bhsr", k.to(dt), state["proj_k"].to(dt))
    return qp, kp


# ----------------------------------------------------------------------------------------- normaliser


# entmax15 sorts only the largest _ENTMAX_K scores of a row first (exact: rows whose support fills them are
# solved again with twice as many); sorting every gathered entry costs far more on the CPU
_ENTMAX_K = 32


def _normalize(scores: torch.Tensor, valid: torch.Tensor, config: SparsefinderConfig, *, target: str) -> torch.Tensor:
    """entmax or softmax over the valid entries of the last dim; rows without any valid entry give zeros."""
    has = valid.any(-1, keepdim=True)
    scores = scores.masked_fill(~valid, float("-inf")).masked_fill(~has, 0.0)
    p = scores.softmax(-1) if target == "softmax" else entmax(scores, config.alpha, partial_sort=_ENTMAX_K)
    return p * has


# -------------------------------------------------------------------------------------- dense paths


def _check_padding(config: SparsefinderConfig, key_mask: torch.Tensor | None) -> None:
    """Global tokens are the first ``global_tokens`` positions and the last real token found by counting: both need
    the padding after the real tokens."""
    if config.global_tokens:
        refuse_left_padding(key_mask, "sparsefinder", "global_tokens", first=config.global_tokens)
    if config.last_token:
        refuse_left_padding(key_mask, "sparsefinder", "last_token")


def simulated_weights(q, k, *, key_mask, query_mask, scale, config, state) -> torch.Tensor:
    """The dense (B, H, N, S) attention matrix on the predicted graph ("simulated": measuring and tests only)."""
    _check_padding(config, key_mask)
    return _fallback.with_fallback(lambda: _simulated_weights(q, k, key_mask, scale, config, state))  # no fallback


def _simulated_weights(q, k, key_mask, scale, config, state) -> torch.Tensor:
    dt = compute_dtype(q.dtype)
    key_mask = safe_key_mask(key_mask)
    qp, kp = _projected(q, k, state, dt, config)
    mask = predicted_mask(qp, kp, key_mask, slice(None), config, state)
    scores = (q.to(dt) @ k.to(dt).transpose(-1, -2)) * scale
    return _normalize(scores, mask, config, target=config.target)


def graph_stats(
    q, k, *, key_mask, query_mask, scale, config, state, block: int = 128, gold: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Counts per head (H,) summed over the batch, over real queries and keys only: ``predicted`` |Ĝ|,
    ``valid`` pairs, ``gold`` |G|, ``hit`` |G ∩ Ĝ|, ``queries`` and ``exact`` (queries whose G ⊆ Ĝ).
    Sparsity = 1 - predicted / valid, recall = hit / gold, exact fraction = exact / queries.
    O(N S) by nature (G needs every score); computed in blocks of ``block`` query rows. ``gold``: the
    (B, H, N, S) gold graph when already known (sweeps over budgets on the same inputs)."""
    _check_padding(config, key_mask)
    dt = compute_dtype(q.dtype)
    counted = key_mask  # the real tokens (a row of padding alone has none: nothing of it is counted)
    key_mask = safe_key_mask(key_mask)
    q, k = q.detach().to(dt), k.detach().to(dt)
    qp, kp = _projected(q, k, state, dt, config)
    groups = None if config.grouping == "distance" else group_ids(qp, kp, key_mask, config, state)
    b, h, n, _ = q.shape
    qmask = torch.ones(b, n, dtype=torch.bool, device=q.device) if counted is None else counted
    names = ("predicted", "valid", "gold", "hit", "queries", "exact")
    out = {name: torch.zeros(h, dtype=torch.float64) for name in names}
    for start in range(0, n, block):
        rows = slice(start, min(n, start + block))
        pred = predicted_mask(qp, kp, key_mask, rows, config, state, groups)  # (B, H, r, S)
        g = gold_graph(q[:, :, rows], k, key_mask, scale, config.alpha) if gold is None else gold[:, :, rows]
        real = qmask[:, None, rows, None]  # (B, 1, r, 1)
        valid = real & (torch.ones_like(pred) if counted is None else counted[:, None, None, :])
        missed = (g & ~pred & real).sum(-1)  # (B, H, r)
        out["predicted"] += (pred & real).sum((0, 2, 3)).double().cpu()
        out["valid"] += valid.sum((0, 2, 3)).double().cpu()
        out["gold"] += (g & real).sum((0, 2, 3)).double().cpu()
        out["hit"] += (g & pred & real).sum((0, 2, 3)).double().cpu()
        out["queries"] += real[..., 0].expand(b, h, -1).sum((0, 2)).double().cpu()
        out["exact"] += ((missed == 0) & real[..., 0]).sum((0, 2)).double().cpu()
    return out


def _gather(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x (B, H, S, d), pos (B, H, r, E) -> (B, H, r, E, d)."""
    b, h, s, d = x.shape
    base = (torch.arange(b * h, device=x.device) * s).reshape(b, h, 1, 1)
    return x.reshape(b * h * s, d)[(pos + base).flatten()].reshape(*pos.shape, d)


def cost(config: SparsefinderConfig, *, n: int, s: int, d: int, dv: int) -> Cost:
    """Score and value products on the predicted edges, for balanced groups (the real count is data
    dependent: see the graph statistics), plus the projections and the grouping. ``distance`` compares
    every pair in r dimensions; bucketing sorts the keys per dimension; kmeans compares with B centroids."""
    r = config.projection_dim
    glob = min(s, config.global_tokens + int(config.last_token))
    local = min(s, 2 * config.window + 1) if config.window else 0
    if config.grouping == "distance":
        group, overhead = s, 3 * n * s * r  # every pair compared; the edges are data dependent (upper bound)
    elif config.grouping == "bucketing":
        group = min(s, r * math.ceil(s / config.buckets))
        overhead = s * r * math.ceil(math.log2(max(s, 2))) + n * r * math.ceil(math.log2(max(config.buckets, 2)))
    else:
        group = min(s, config.top_clusters * math.ceil(s / config.clusters))
        overhead = 3 * (n + s) * config.clusters * r
    edges = min(s, group + local + glob)
    pairs = min(n * s, n * edges + glob * s)
    return Cost(
        flops=2 * pairs * (d + dv) + 2 * (n + s) * d * r + overhead,
        qk_pairs=pairs,
        matmul_macs=pairs * (d + dv) + (n + s) * d * r,
    )


# Largest number of gathered key elements of one query block: B * H * rows * E * d <= _CHUNK_ELEMENTS.
_CHUNK_ELEMENTS = 1 << 23
# Cluster-block path: scores plus gathered group keys and values of one chunk of blocks, in elements
_BLOCK_ELEMENTS = 1 << 21


def _extra_entries(q_ids, k_ids, key_mask, n: int, s: int, config):
    """The window and global keys of every query that are not in its own cluster (those are group entries):
    flat key rows (B*H*N, E) of the (B*H*S) key table and which are real (each key counted once)."""
    b, h = q_ids.shape[:2]
    dev = q_ids.device
    i = torch.arange(n, device=dev)
    w = min(reach(config), s - 1)
    offsets = torch.arange(-w, w + 1, device=dev) if w >= 0 else torch.zeros(0, dtype=torch.long, device=dev)
    wpos = i[:, None] + offsets  # (N, 2w+1)
    wvalid = (wpos >= 0) & (wpos < s)
    glob = global_rows(key_mask, n, s, config, dev)  # (B, S)
    n_glob = int(glob.sum(-1).max())
    gl = glob.to(torch.uint8).argsort(dim=-1, descending=True, stable=True)[:, :n_glob]  # (B, n_glob)
    glvalid = glob.gather(-1, gl)[:, None, :] & ((gl[:, None, :] - i[:, None]).abs() > w)  # (B, N, n_glob)
    pos = torch.cat([wpos.clamp(0, s - 1).expand(b, n, -1), gl[:, None, :].expand(b, n, n_glob)], dim=-1)
    valid = torch.cat([wvalid.expand(b, n, -1), glvalid.expand(b, n, n_glob)], dim=-1)  # (B, N, E)
    if key_mask is not None:
        valid = valid & key_mask.gather(-1, pos.flatten(1)).view(pos.shape)
    pos, valid = pos[:, None].expand(b, h, n, -1), valid[:, None].expand(b, h, n, -1)
    own = k_ids[..., 0].gather(-1, pos.flatten(2)).view(pos.shape) == q_ids[..., :1]  # already a group entry
    rows = pos + (torch.arange(b * h, device=dev) * s).view(b, h, 1, 1)
    return rows.reshape(b * h * n, -1), (valid & ~own).reshape(b * h * n, -1)


def _cluster_lists(k_ids, key_mask, clusters: int):
    """The real keys of every cluster as flat rows of the (B*H*S) key table: (B*H*C, W), W the largest
    cluster, left-aligned; which entries are real; and the size of every cluster (B*H*C,)."""
    b, h, s = k_ids.shape[:3]
    ids = k_ids[..., 0]
    if key_mask is not None:  # padded keys go to an id no query has
        ids = ids.masked_fill(~key_mask[:, None, :], clusters)
    order = ids.argsort(dim=-1, stable=True)  # (B, H, S): keys cluster by cluster
    counts = torch.zeros(b, h, clusters + 1, dtype=torch.long, device=ids.device).scatter_add_(
        -1, ids, torch.ones_like(ids)
    )
    width = max(1, int(counts[..., :clusters].max()))
    start = (counts.cumsum(-1) - counts)[..., :clusters, None]  # (B, H, C, 1)
    ar = torch.arange(width, device=ids.device)
    pos = order.gather(-1, (start + ar).clamp(max=s - 1).flatten(2)).view(b, h, clusters, width)
    rows = pos + (torch.arange(b * h, device=ids.device) * s).view(b, h, 1, 1)
    sizes = counts[..., :clusters].reshape(b * h * clusters)
    return rows.reshape(b * h * clusters, width), ar < sizes[:, None], sizes


def _cluster_block_attention(q, k, v, key_mask, groups, scale, config, dropout) -> torch.Tensor:
    """The fast path of ``grouping="kmeans"`` with ``top_clusters=1``: (B, H, N, dv).

    Every query of a cluster attends to the same group of keys, so queries are sorted by cluster into blocks
    of L rows that share it: the group's scores are one (L, d) x (d, W) product per block, its keys gathered once
    per block instead of once per query. The few window and global keys outside the group are gathered per
    query. entmax / softmax then runs over both parts together, as on the gathered path.
    """
    b, h, n, d = q.shape
    s, dv, clusters = k.shape[2], v.shape[-1], config.clusters
    bh = b * h
    q_ids, k_ids = groups[0], groups[1]
    krows, kvalid, sizes = _cluster_lists(k_ids, key_mask, clusters)  # (B*H*C, W), (B*H*C, W), (B*H*C,)
    erows, evalid = _extra_entries(q_ids, k_ids, key_mask, n, s, config)  # (B*H*N, E)
    extra = erows.shape[1]
    block = block_size(n, clusters)
    dest, used, bc = block_rows(q_ids[..., 0], clusters, block)
    # blocks by the size of their cluster, largest first: a chunk's width is that of its first block's cluster,
    # so the padding up to the largest cluster (often several times the mean) is not scored
    used = used[sizes[bc[used]].argsort(descending=True, stable=True)]
    flat_q, flat_k, flat_v = q.reshape(bh * n, d), k.reshape(bh * s, d), v.reshape(bh * s, dv)
    out = q.new_empty(bh * n + 1, dv)  # every query's output, and a spare row that padding rows are written to
    start = 0
    while start < used.numel():
        width = max(1, int(sizes[bc[used[start]]]))  # the largest cluster of this chunk
        per = max(1, _BLOCK_ELEMENTS // (block * (width + extra) + 2 * width * max(d, dv)))  # blocks per chunk
        blocks, start = used[start : start + per], start + per
        rows = dest.index_select(0, blocks).view(-1)  # (R,) = b_ * L query rows
        qrows = rows.remainder(bh * n)  # padding rows read query 0 (their output goes to the spare row)
        qb = flat_q.index_select(0, qrows) * scale  # (R, d)
        clus = bc.index_select(0, blocks)
        kr = krows[:, :width].index_select(0, clus).view(-1)  # (b_ * W,) the chunk's group keys
        group = qb.view(-1, block, d) @ flat_k.index_select(0, kr).view(-1, width, d).transpose(1, 2)
        er = erows.index_select(0, qrows).view(-1)  # (R * E,)
        ke = flat_k.index_select(0, er).view(rows.numel(), extra, d)
        scores = torch.cat([group.view(-1, width), torch.bmm(ke, qb[..., None]).view(rows.numel(), extra)], dim=-1)
        gvalid = kvalid[:, :width].index_select(0, clus)[:, None, :].expand(-1, block, -1).reshape(-1, width)
        valid = torch.cat([gvalid, evalid.index_select(0, qrows)], dim=-1)
        p = _normalize(scores, valid, config, target=config.target)  # (R, W + E)
        if dropout > 0.0:
            p = F.dropout(p, dropout)
        vg = flat_v.index_select(0, kr).view(-1, width, dv)
        o = (p[:, :width].reshape(-1, block, width) @ vg).view(-1, 1, dv)  # (R, 1, dv)
        if extra:  # + the window and global keys' share
            o = torch.baddbmm(o, p[:, None, width:], flat_v.index_select(0, er).view(rows.numel(), extra, dv))
        out.index_copy_(0, rows, o.view(-1, dv))
    return out[: bh * n].view(b, h, n, dv)


@register(
    "sparsefinder",
    SparsefinderConfig,
    cost=cost,
    init_state=init_state,
    weights=simulated_weights,
    fit=fit,
    stats=graph_stats,
    teacher=teacher,
    fit_config=SparsefinderFitConfig,
    test_options={"clusters": 8},
    # a window covering every pair: softmax over all real keys, whatever the fitted graph predicts
    exact_limit=ExactLimit(options=lambda n: {"window": n, "target": "softmax"}),
)
def sparsefinder_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    scale: float,
    config: SparsefinderConfig,
    state: dict[str, torch.Tensor],
    dropout: float = 0.0,
) -> torch.Tensor:
    """Attention on a graph predicted by learned low-dimensional projections (needs fitting)."""
    _check_padding(config, key_mask)
    return _fallback.with_fallback(
        lambda: _sparsefinder(q, k, v, key_mask, scale, config, state, dropout)
    )  # no fallback


def _sparsefinder(q, k, v, key_mask, scale, config, state, dropout) -> torch.Tensor:
    dt = compute_dtype(q.dtype)
    key_mask = safe_key_mask(key_mask)
    qp, kp = _projected(q, k, state, dt, config)
    q, k = q.to(dt), k.to(dt)
    v_real = zero_padded_values(v.to(dt), key_mask)  # (B, H, S, dv)
    b, h, n, d = q.shape
    s = k.shape[2]
    groups = None if config.grouping == "distance" else group_ids(qp, kp, key_mask, config, state)
    # entries per query: group slots * largest group, window, global keys (an estimate for the block size)
    est = s if config.grouping == "distance" else min(s, 2 * s // max(1, min(config.buckets, config.clusters)))
    rows_per_block = max(
        1, _CHUNK_ELEMENTS // max(1, b * h * (est + min(s, 2 * config.window + 1) + 1) * max(d, v.shape[-1]))
    )
    if config.grouping == "kmeans" and config.top_clusters == 1:  # queries of a cluster share their keys
        out = _cluster_block_attention(q, k, v_real, key_mask, groups, scale, config, dropout)
    else:
        outs = []
        for start in range(0, n, rows_per_block):
            rows = slice(start, min(n, start + rows_per_block))
            pos, valid = entries(qp, kp, key_mask, rows, config, state, groups)  # (B, H, r, E)
            scores = torch.einsum("bhrd,bhred->bhre", q[:, :, rows], _gather(k, pos)) * scale
            p = _normalize(scores, valid, config, target=config.target)
            if dropout > 0.0:
                p = F.dropout(p, dropout)
            outs.append(torch.einsum("bhre,bhred->bhrd", p, _gather(v_real, pos)))
        out = torch.cat(outs, dim=2)  # (B, H, N, dv)
    # global queries attend to every key: their few rows are computed densely
    glob = global_rows(key_mask, n, s, config, q.device)[:, :n].expand(b, n)  # (B, N)
    if bool(glob.any()):
        bi, ni = glob.nonzero(as_tuple=True)
        qg = q[bi, :, ni]  # (G, H, d)
        sc = torch.einsum("ghd,ghsd->ghs", qg, k[bi]) * scale
        kv = torch.ones(len(bi), 1, s, dtype=torch.bool, device=q.device) if key_mask is None else key_mask[bi, None]
        pg = _normalize(sc, kv.expand_as(sc), config, target=config.target)
        if dropout > 0.0:
            pg = F.dropout(pg, dropout)
        out[bi, :, ni] = torch.einsum("ghs,ghsd->ghd", pg, v_real[bi])  # (G, H, dv)
    return out.to(v.dtype)
