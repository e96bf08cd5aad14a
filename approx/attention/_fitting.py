"""Fitting the state of Sparsefinder from a model's own queries and keys (plain torch, no transformers).

Treviso et al. 2022 (arXiv 2109.12188), section 3: per head, projections q' = W^Q_h q and k' = W^K_h k to r
dimensions are trained with the margin loss

    relu(margin + ||q'_i - k'_pos||^2 - ||q'_i - k'_neg||^2)

where (i, pos) is a pair of the gold graph G_h (the support of alpha-entmax of the head's scores) and
(i, neg) a real pair outside it, one negative per positive; then B centroids are learned by k-means on the
projected queries and keys. ``samples`` are lists of (q, k, key_mask, scale) with q, k of shape (B, H, N, d).
The settings of the fit, with their defaults, are :class:`SparsefinderFitConfig`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from tqdm.auto import tqdm

from ..config import MethodConfig, option
from ._common import NOTHING_REAL, real_tokens, safe_key_mask
from ._entmax import entmax


@dataclasses.dataclass(frozen=True)
class SparsefinderFitConfig(MethodConfig):
    """Settings of Sparsefinder's fit (``approx.fit(model, data, **settings)``, ``approx fit``); the seed is the
    method's own ``seed`` option."""

    method = "sparsefinder"

    steps: int = option(300, "optimizer steps (Adam) of the projections, per layer")
    lr: float = option(0.02, "Adam learning rate of the projections")
    queries: int = option(512, "gold pairs (each with one negative) drawn per step and head")
    margin: float = option(1.0, "margin of the loss relu(margin + ||q' - k'_pos||^2 - ||q' - k'_neg||^2)")
    kmeans_iterations: int = option(20, "Lloyd iterations of the k-means on the projected queries and keys")
    kmeans_points: int = option(10000, "projected points per head the k-means is fitted on (a random subset)")
    fit_projections_too: bool = option(True, "fit the projections, then the centroids; false: only the centroids")

    def check(self) -> None:
        self.require(self.steps >= 0, "steps", "cannot be negative")
        self.require(math.isfinite(self.lr) and self.lr > 0, "lr", "a learning rate is a positive number")
        self.require(self.queries >= 1, "queries", "need at least one pair per step")
        self.require(math.isfinite(self.margin) and self.margin >= 0, "margin", "a margin is at least 0")
        self.require(self.kmeans_iterations >= 0, "kmeans_iterations", "cannot be negative")
        self.require(self.kmeans_points >= 1, "kmeans_points", "need at least one point")


def gold_graph(q, k, key_mask, scale: float, alpha: float) -> torch.Tensor:
    """The support of alpha-entmax(scale q k^T + log m): (B, H, n, S) bool."""
    key_mask = safe_key_mask(key_mask)
    scores = (q @ k.transpose(-1, -2)) * scale
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return entmax(scores, alpha) > 0


def random_projections(heads: int, d: int, r: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The starting point of the fit (and the baseline it must beat): N(0, 1/d) entries, (H, d, r) each."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(heads, d, r, generator=g) * d**-0.5, torch.randn(heads, d, r, generator=g) * d**-0.5


class _PairSampler:
    """Draws, per head, gold pairs (i, pos) uniformly among the real pairs of G, and for each a negative
    (i, neg): a real key drawn uniformly, redrawn while it falls in G (a few times; pairs left without a
    negative get weight 0)."""

    def __init__(self, samples, alpha: float) -> None:
        self.items = []
        for q, k, key_mask, scale in samples:
            q, k = q.detach().float().cpu(), k.detach().float().cpu()
            mask = safe_key_mask(None if key_mask is None else key_mask.detach().cpu())
            gold = gold_graph(q, k, mask, scale, alpha)  # (B, H, N, S)
            real = real_tokens(key_mask, q.shape[0], k.shape[2])
            for b in range(q.shape[0]):
                if not bool(real[b].any()):  # a row of padding alone: nothing of it is a pair
                    continue
                g = gold[b] & real[b][None, :, None]  # real queries only (keys are masked already)
                flat = g.flatten(1)  # (H, N * S)
                counts = flat.sum(-1)  # (H,)
                pairs = flat.nonzero()[:, 1]  # pair indices i * S + j, grouped by head
                self.items.append((q[b], k[b], g, real[b].nonzero().squeeze(-1), pairs, counts))
        if not self.items:
            raise ValueError(NOTHING_REAL)
        self.heads, _, self.d = self.items[0][0].shape

    def draw(self, count: int, g: torch.Generator, retries: int = 4):
        """q (H, M, d), k_pos (H, M, d), k_neg (H, M, d), weight (H, M)."""
        q, k, gold, real_idx, pairs, counts = self.items[int(torch.randint(len(self.items), (1,), generator=g))]
        h, s = gold.shape[0], gold.shape[2]
        starts = counts.cumsum(0) - counts
        pick = starts[:, None] + (torch.rand(h, count, generator=g) * counts[:, None]).long()
        pair = pairs[pick.clamp(max=max(len(pairs) - 1, 0))]  # (H, M)
        qi, pos = pair // s, pair % s
        hh = torch.arange(h)[:, None]
        neg = real_idx[torch.randint(len(real_idx), (h, count), generator=g)]
        for _ in range(retries):
            bad = gold[hh, qi, neg]
            if not bool(bad.any()):
                break
            neg = torch.where(bad, real_idx[torch.randint(len(real_idx), (h, count), generator=g)], neg)
        weight = (~gold[hh, qi, neg] & (counts[:, None] > 0)).float()
        return q[hh, qi], k[hh, pos], k[hh, neg], weight


def margin_loss(qs, kp, kn, w, proj_q, proj_k, margin: float) -> torch.Tensor:
    """Mean of relu(margin + ||q' - k'_pos||^2 - ||q' - k'_neg||^2) over the weighted pairs, all heads."""
    qq = torch.einsum("hmd,hdr->hmr", qs, proj_q)
    dp = (qq - torch.einsum("hmd,hdr->hmr", kp, proj_k)).pow(2).sum(-1)
    dn = (qq - torch.einsum("hmd,hdr->hmr", kn, proj_k)).pow(2).sum(-1)
    return ((margin + dp - dn).clamp(min=0) * w).sum() / w.sum().clamp(min=1)


def evaluate_loss(
    samples, proj_q, proj_k, alpha: float, *, margin: float | None = None, draws: int = 20, seed: int = 1
):
    """Margin loss of given projections on fresh pairs of ``samples`` (e.g. held-out windows); ``margin``
    defaults to the fit's (:class:`SparsefinderFitConfig`)."""
    margin = SparsefinderFitConfig().margin if margin is None else margin
    sampler, g = _PairSampler(samples, alpha), torch.Generator().manual_seed(seed)
    with torch.no_grad():
        losses = [margin_loss(*sampler.draw(512, g), proj_q, proj_k, margin) for _ in range(draws)]
    return float(torch.stack(losses).mean())


def fit_projections(
    samples,
    alpha: float,
    r: int,
    settings: SparsefinderFitConfig,
    *,
    seed: int,
    progress: bool = False,
    description: str = "projections",
):
    """Per-head projections (H, d, r) for queries and keys, trained with Adam on the margin loss (``settings``:
    steps, lr, queries, margin); returns them and the mean loss of the first and last tenth of the steps."""
    steps = settings.steps
    sampler = _PairSampler(samples, alpha)
    g = torch.Generator().manual_seed(seed)
    init_q, init_k = random_projections(sampler.heads, sampler.d, r, seed)
    proj_q, proj_k = init_q.requires_grad_(), init_k.requires_grad_()
    opt = torch.optim.Adam([proj_q, proj_k], lr=settings.lr)
    losses = []
    with torch.enable_grad():
        for _ in tqdm(range(steps), disable=not progress, desc=description, unit="step", leave=False):
            loss = margin_loss(*sampler.draw(settings.queries, g), proj_q, proj_k, settings.margin)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    tenth = max(1, steps // 10)
    info = {"first_loss": sum(losses[:tenth]) / tenth, "last_loss": sum(losses[-tenth:]) / tenth, "steps": steps}
    return proj_q.detach(), proj_k.detach(), info


def fit_kmeans(samples, proj_q, proj_k, clusters: int, *, seed: int, iterations: int, points: int):
    """Centroids (H, B, r) by Lloyd's k-means on the projected real queries and keys of ``samples`` (at most
    ``points`` per head, drawn with ``seed``); starts from distinct random points, empty clusters stay put."""
    xs = []
    for q, k, key_mask, _ in samples:
        q, k = q.detach().float().cpu(), k.detach().float().cpu()
        qp = torch.einsum("bhnd,hdr->bhnr", q, proj_q)
        kp = torch.einsum("bhsd,hdr->bhsr", k, proj_k)
        real = real_tokens(key_mask, q.shape[0], k.shape[2])
        for b in range(q.shape[0]):
            # queries are real where keys are (self-attention); cross-attention has no query mask: every query
            xs += [qp[b][:, real[b]] if q.shape[2] == k.shape[2] else qp[b], kp[b][:, real[b]]]
    x = torch.cat(xs, dim=1)  # (H, P, r)
    if x.shape[1] == 0:
        raise ValueError(NOTHING_REAL)
    g = torch.Generator().manual_seed(seed)
    if x.shape[1] > points:
        x = x[:, torch.randperm(x.shape[1], generator=g)[:points]]
    h, p, r = x.shape
    init = torch.randperm(p, generator=g)[: min(clusters, p)]
    c = x[:, init]
    if c.shape[1] < clusters:  # fewer points than clusters: repeat some (their clusters stay empty)
        c = torch.cat([c, c[:, torch.arange(clusters - c.shape[1]) % max(1, c.shape[1])]], dim=1)
    for _ in range(iterations):
        assign = torch.cdist(x, c).argmin(-1)  # (H, P)
        sums = torch.zeros(h, clusters, r).scatter_add_(1, assign[..., None].expand(-1, -1, r), x)
        counts = torch.zeros(h, clusters).scatter_add_(1, assign, torch.ones(h, p))
        c = torch.where(counts[..., None] > 0, sums / counts.clamp(min=1)[..., None], c)
    return c
