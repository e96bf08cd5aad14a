"""Linformer: softmax attention over k keys and values projected along the sequence.

Wang, Li, Khabsa, Fang, Ma, "Linformer: Self-Attention with Linear Complexity", arXiv 2006.04768 (2020).

O = softmax(s Q (E K)^T) (F V), with E, F in R^{k x N} mapping the N keys and values to k: O(N k d) time and
memory. The paper trains E and F with the model; pretrained encoders have none, so three ways to get them
(``mode``):

* ``mean`` (default, zero-shot): E = F = means over k contiguous segments of the *real* keys (near-equal
  sizes, :mod:`._segments`), and log(segment size) is added to each pooled score, so that a pooled key carries
  the softmax mass of its segment's members (size exp(s q.k_mean), about their sum exp(s q.k_j)); a segment of
  one token is then that token exactly, so k >= the number of real keys is exact attention (the exact limit
  the tests check) and a row shorter than k is exact without a fallback. The implied attention matrix is row
  stochastic (each segment's weight shared equally by its members): exposed as ``weights``.
* ``random``: E, F with i.i.d. N(0, 1/k) entries (the Johnson-Lindenstrauss projection of the paper's
  analysis), drawn once per layer from the seed, shared by the heads of a layer (the paper's headwise
  sharing), kept as state (saved with the model, redrawn only on request).
* ``fitted``: E, F (and a per-slot score bias generalising mean's log size) learned per layer and head on
  calibration text through ``approx.fit`` (like Sparsefinder's fit), starting from ``mean`` pooling and
  minimising the error of the attention output against exact attention with Adam
  (:class:`LinformerFitConfig`). The harness's samples carry the queries and keys a layer sees, not its values,
  so the output error is taken over values with independent unit entries: the squared error of the implied
  attention matrix, ||P F R - A||^2 (its expectation over such values), on random query rows of each window. A
  sample that also carries the values, (q, k, key_mask, scale, v), is fitted on its own output error
  ||P F V - A V||^2 instead (on MiniLM-L6 that fits the calibration windows and does worse on others). F's rows
  are kept summing to 1, so the implied attention rows sum to 1 like exact attention's and a constant value
  passes unchanged: the matrix error barely sees a row-sum drift (n entries of 1/n each), the outputs do.

Length rule (``random`` and ``fitted``): E and F are k x L for a fixed ``length`` L. A row of n real tokens is
first resampled to L positions (:func:`._segments.resample`: when n >= L, the means of L contiguous near-equal
segments of the real tokens; when n < L, each position takes the real token under its centre, so each token
is repeated about L / n times), then projected: E K = E (R_n K), a weighting that does not grow with n. The fit
uses the same rule, so windows of any length can be fitted on and a layer fitted at one length runs at
another. Padded tokens take no part in the resampling (nor in ``mean``'s segments).

Choices made here:

* ``random`` and ``fitted`` rows with at most k real tokens get exact attention (the budget covers them, rule 5
  of the method rules); ``mean`` needs no such rule (exact there by construction). ``exact_below`` as for
  every method. Both are counted in the cost.
* ``weights``: ``mean`` only. E and F of ``random`` and ``fitted`` are signed, so their implied matrix is not a
  distribution: asking for it raises ``NotImplementedError`` saying so.
* Attention dropout is applied where the paper's model applies it, on the (N, k) softmax weights.
* Half precision: computed in float32 (segment sums, projections, softmax); float64 stays float64.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from tqdm.auto import tqdm

from ..config import MethodConfig, option
from ..registry import Cost, ExactLimit, register
from . import _fallback
from ._common import (
    NOTHING_REAL,
    compute_dtype,
    dense_softmax,
    exact_rows,
    exact_weight_rows,
    real_tokens,
    safe_key_mask,
    zero_padded_values,
)
from ._fallback import exact_for_length
from ._segments import attend_summaries, log_sizes, longest, resample, segment_ids, segment_means, segment_sums

MODES = ("mean", "random", "fitted")
NOT_FITTED = (
    "linformer: mode='fitted' has no fitted projections yet; fit first with approx.fit(model, data) or "
    "`approx fit --method linformer:mode=fitted --model M --output-dir OUT`, then run or save the model "
    "(mode='mean' and mode='random' need no fit)"
)


@dataclasses.dataclass(frozen=True)
class LinformerConfig(MethodConfig):
    """Options of Linformer attention."""

    method = "linformer"

    mode: str = option(
        "mean",
        "'mean': segment means of the real keys and values (zero-shot); 'random': seeded Gaussian E, F; "
        "'fitted': E, F learned with approx.fit",
    )
    projections: int = option(
        64,
        "k, keys and values after projection: 64 = Nystrom's 64 landmarks, 1/8 of the cost at N = 512 (the "
        "paper's trained models used 128-256 there)",
    )
    length: int = option(
        512,
        "random/fitted: L, the length E and F (k x L) act on; each row's real tokens are resampled to L "
        "positions (the usual encoder maximum 512)",
    )
    seed: int = option(0, "seed of the random projections")
    exact_below: int = option(
        0, "sequences with fewer real tokens get exact attention (0 = never; set it to the measured crossover)"
    )

    def unused(self) -> dict[str, str]:
        # (segment means need neither a length nor a seed: the fitted mode's seed orders the fit's samples)
        return {name: "mode='random' or mode='fitted'" for name in ("length", "seed")} if self.mode == "mean" else {}

    def check(self) -> None:
        self.require(self.mode in MODES, "mode", f"choose one of {', '.join(map(repr, MODES))}")
        self.require(self.projections >= 1, "projections", "need at least one projected key")
        self.require(self.length >= 1, "length", "E and F need at least one position")
        self.require(self.seed >= 0, "seed", "seeds are non-negative integers")
        self.require(self.exact_below >= 0, "exact_below", "a length: 0 (off) or more")


@dataclasses.dataclass(frozen=True)
class LinformerFitConfig(MethodConfig):
    """Settings of Linformer's fit (``approx.fit(model, data, **settings)`` with ``mode="fitted"``); the seed is the
    method's own ``seed`` option (the order in which samples are drawn)."""

    method = "linformer"

    steps: int = option(200, "optimizer steps (Adam) per layer, one sample (batch of windows) per step")
    lr: float = option(
        0.001,
        "Adam learning rate of E, F and the score bias (0.001: the best of the few rates tried on MiniLM-L6's hidden "
        "states on held-out WikiText-2 windows; larger rates fit the calibration windows and lose on others)",
    )
    rows: int = option(128, "query rows per window drawn at random for each step's error (all when fewer)")

    def check(self) -> None:
        self.require(self.steps >= 0, "steps", "cannot be negative")
        self.require(self.rows >= 1, "rows", "need at least one query row per step")
        self.require(math.isfinite(self.lr) and self.lr > 0, "lr", "a learning rate is a positive number")


# ---------------------------------------------------------------------------------------------- state


def mean_projection(k: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """E averaging k contiguous near-equal segments of ``length`` positions, (k, L), and the log of their sizes
    (k,): ``mean`` pooling written as a projection, the starting point of the fit."""
    ids, sizes = segment_ids(None, length, k, batch=1, device="cpu")
    e = (torch.arange(k)[:, None] == ids).float() / sizes[0].clamp(min=1)[:, None]
    return e, sizes[0].float().log()


def init_state(config: LinformerConfig, *, head_dim: int, seed: int) -> dict[str, torch.Tensor]:
    """``random``: E, F (k, L) with N(0, 1/k) entries; ``fitted``: empty placeholders (the number of heads is known
    when fitting) and ``fitted`` = 0; ``mean``: no state."""
    k, length = config.projections, config.length
    if config.mode == "random":
        g = torch.Generator().manual_seed(seed)
        return {
            "proj_e": torch.randn(k, length, generator=g) / k**0.5,
            "proj_f": torch.randn(k, length, generator=g) / k**0.5,
        }
    if config.mode == "fitted":
        return {
            "proj_e": torch.zeros(0, k, length),
            "proj_f": torch.zeros(0, k, length),
            "bias": torch.zeros(0, k),
            "fitted": torch.zeros((), dtype=torch.uint8),
        }
    return {}


def _budget(config: LinformerConfig) -> int | None:
    """Rows with at most this many real queries get exact attention (``random``/``fitted``); ``mean``: none."""
    return None if config.mode == "mean" else config.projections


def _segments(config: LinformerConfig, s: int) -> int:
    """``mean``'s segments for S real keys: ``projections``, or one per key where there are fewer keys (more would
    be empty, and scored for nothing; a padded call passes its longest row's real keys: :func:`longest`)."""
    return min(config.projections, s)


def cost(config: LinformerConfig, *, n: int, s: int, d: int, dv: int) -> Cost:
    k = config.projections
    if exact_for_length(n, exact_below=config.exact_below, at_most=_budget(config)):
        return Cost(flops=2 * n * s * (d + dv), qk_pairs=n * s, matmul_macs=n * s * (d + dv))
    if config.mode == "mean":
        k = _segments(config, s)
    # pooling (mean) or resampling to L positions: a product with a matrix of about one nonzero per token
    macs = s * (d + dv)
    if config.mode != "mean":
        macs += k * config.length * (d + dv)  # E and F on the L positions
    macs += n * k * (d + dv)  # scores against the k projected keys, weights times the k projected values
    return Cost(flops=2 * macs, qk_pairs=n * k, matmul_macs=macs)


# ---------------------------------------------------------------------------------------------- attention


def _require_fitted(state) -> None:
    if int(state["fitted"]) != 1:
        raise RuntimeError(NOT_FITTED)


def _projected(k, v, key_mask, config, state, dt):
    """Keys (B, H, k, d) and values (B, H, k, dv) after projection, and the score bias (broadcastable to
    (B, H, 1, k)) or None."""
    if config.mode == "mean":
        m = _segments(config, longest(key_mask, k.shape[2]))
        keys, sizes = segment_means(k, key_mask, m)
        values, _ = segment_means(v, key_mask, m)
        return keys, values, log_sizes(sizes, dt)
    e, f = state["proj_e"].to(dt), state["proj_f"].to(dt)  # (k, L) or (H, k, L)
    if e.dim() == 3 and e.shape[0] != k.shape[1]:
        raise ValueError(f"linformer: the projections were fitted for {e.shape[0]} heads, the layer has {k.shape[1]}")
    keys = e @ resample(k, key_mask, config.length)  # (B, H, k, d)
    values = f @ resample(v, key_mask, config.length)
    bias = state["bias"].to(dt)[None, :, None, :] if config.mode == "fitted" else None  # (1, H, 1, k)
    return keys, values, bias


def _linformer(q, k, v, key_mask, scale, config, state, dropout) -> torch.Tensor:
    dt = compute_dtype(q.dtype)
    key_mask = safe_key_mask(key_mask)
    q, k, v = q.to(dt), k.to(dt), zero_padded_values(v.to(dt), key_mask)
    keys, values, bias = _projected(k, v, key_mask, config, state, dt)
    return attend_summaries(q, keys, values, bias, scale, dropout)  # (B, H, N, dv)


def linformer_weights(q, k, *, key_mask, query_mask, scale, config, state) -> torch.Tensor:
    """The dense (B, H, N, S) attention ``mean`` implies: a segment's softmax weight shared equally by its real
    keys (analysis only). ``random`` and ``fitted`` project with signed E, F: no distribution to show."""
    if config.mode != "mean":
        raise NotImplementedError(
            f"linformer: mode={config.mode!r} projects keys and values with signed matrices E, F, so the attention "
            "it implies is not a distribution; attention weights exist for mode='mean' only"
        )
    dt = compute_dtype(q.dtype)
    key_mask = safe_key_mask(key_mask)
    q, k = q.to(dt), k.to(dt)
    batch, heads, n, _ = q.shape
    s = k.shape[2]
    m = _segments(config, longest(key_mask, s))

    exact = exact_weight_rows(q, k, key_mask, scale)

    def approximate() -> torch.Tensor:
        ids, sizes = segment_ids(key_mask, s, m, batch=batch, device=q.device)  # (B, S), (B, m)
        keys = segment_sums(k, ids, m) / sizes.clamp(min=1)[:, None, :, None].to(dt)  # (B, H, m, d)
        scores = (q @ keys.transpose(-1, -2)) * scale + log_sizes(sizes, dt)  # (B, H, N, m)
        per_key = scores.softmax(-1) / sizes.clamp(min=1)[:, None, None, :].to(dt)  # each member's share
        per_key = torch.cat([per_key, per_key.new_zeros(batch, heads, n, 1)], dim=-1)  # column m: padding
        return per_key.gather(-1, ids[:, None, None, :].expand(batch, heads, n, s))  # (B, H, N, S)

    return _fallback.with_fallback(
        approximate,
        exact,
        query_mask=query_mask,
        shape=(batch, n),
        device=q.device,
        exact_below=config.exact_below,
        at_most=_budget(config),
    )


# ---------------------------------------------------------------------------------------------- fitting


def _fit_item(sample, length: int) -> dict:
    """What the fit needs of one sample (q, k, key_mask, scale[, v]): the scaled queries, the keys resampled to L
    positions, the real query rows, and the target: the exact output when v is given, else the exact attention
    matrix with the resampling R (L x S, one or a few nonzeros per row and column) as its nonzeros."""
    q, k, key_mask, scale, *rest = sample
    q, k = q.detach().float().cpu(), k.detach().float().cpu()
    mask = safe_key_mask(None if key_mask is None else key_mask.detach().cpu())
    batch, _, n, _ = q.shape
    s = k.shape[2]
    # the real query rows (none in a row of padding alone, which the attention runs as if all real)
    real = real_tokens(key_mask, batch, n) if n == s else torch.ones(batch, n, dtype=torch.bool)
    weights = dense_softmax(q, k, mask, scale)  # (B, H, N, S)
    item = {"q": q * scale, "keys": resample(k, mask, length), "real": real}
    if rest:  # the values: fit the real output error
        v = zero_padded_values(rest[0].detach().float().cpu(), mask)
        item.update(values=resample(v, mask, length), target=weights @ v)
    else:  # no values: the implied matrix P F R against A
        r = resample(torch.eye(s).expand(batch, 1, s, s), mask, length)[:, 0]  # (B, L, S)
        nonzero = r.nonzero(as_tuple=True)  # (b, l, j)
        item.update(resampling=(*nonzero, r[nonzero]), keys_count=s, target=weights)
    return item


def _rows_sum_to_one(f: torch.Tensor) -> torch.Tensor:
    """F (H, k, L) shifted so that every row sums to 1: each projected value is an affine combination of values,
    so the implied attention rows sum to 1 and a constant value passes exactly (as in exact attention)."""
    return f + (1 - f.sum(-1, keepdim=True)) / f.shape[-1]


def _fit_loss(item, proj_e, proj_f, bias, rows: int | None = None, generator=None) -> torch.Tensor:
    """Squared error of the fitted attention's output (or implied matrix) over the real queries (``rows`` of
    them drawn at random when given), relative to the target's squared norm."""
    q, target, real = item["q"], item["target"], item["real"]
    if rows is not None and rows < q.shape[2]:
        pick = torch.randperm(q.shape[2], generator=generator)[:rows]
        q, target, real = q[:, :, pick], target[:, :, pick], real[:, pick]
    keys = proj_e @ item["keys"]  # (B, H, k, d)
    weights = (q @ keys.transpose(-1, -2) + bias[None, :, None, :]).softmax(-1)  # (B, H, n, k)
    if "values" in item:
        out = weights @ (proj_f @ item["values"])  # (B, H, n, dv)
    else:  # the implied matrix P (F R): F R gathered from F's columns (R's nonzeros), not a dense product
        b, pos, key, w = item["resampling"]
        f_r = proj_f.new_zeros(q.shape[0], item["keys_count"], *proj_f.shape[:2])  # (B, S, H, k)
        f_r = f_r.index_put((b, key), proj_f.permute(2, 0, 1)[pos] * w[:, None, None], accumulate=True)
        out = weights @ f_r.permute(0, 2, 3, 1)  # (B, H, n, S)
    real = real[:, None, :, None].to(out.dtype)
    return ((out - target).square() * real).sum() / (target.square() * real).sum().clamp(min=1e-30)


def fit(config: LinformerConfig, state, samples, *, progress: bool = False, **settings) -> dict[str, torch.Tensor]:
    """E, F (H, k, L) and the score bias (H, k) of ``mode="fitted"`` from ``samples``, a list of
    (q, k, key_mask, scale) or (q, k, key_mask, scale, v) with q, k, v (B, H, N, d) of one layer: Adam from
    ``mean`` pooling, one sample and ``rows`` random query rows per step, drawn with the config's seed (settings:
    :class:`LinformerFitConfig`); F's rows are kept summing to 1 (:func:`_rows_sum_to_one`)."""
    fit_settings = LinformerFitConfig.from_options(**settings)
    if config.mode != "fitted":
        return {}
    if not samples:
        raise ValueError("linformer: nothing to fit on (no samples)")
    items = [item for item in (_fit_item(sample, config.length) for sample in samples) if bool(item["real"].any())]
    if not items:
        raise ValueError(f"linformer: {NOTHING_REAL}")
    heads = items[0]["q"].shape[1]
    start, log_size = mean_projection(config.projections, config.length)
    proj_e = start.repeat(heads, 1, 1).requires_grad_()  # (H, k, L)
    proj_f = start.repeat(heads, 1, 1).requires_grad_()
    bias = log_size.repeat(heads, 1).requires_grad_()  # (H, k)
    opt = torch.optim.Adam([proj_e, proj_f, bias], lr=fit_settings.lr)
    g = torch.Generator().manual_seed(config.seed)
    with torch.enable_grad():
        for _ in tqdm(range(fit_settings.steps), disable=not progress, desc="linformer E, F", unit="step", leave=False):
            item = items[int(torch.randint(len(items), (1,), generator=g))]
            loss = _fit_loss(item, proj_e, _rows_sum_to_one(proj_f), bias, fit_settings.rows, g)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {
        "proj_e": proj_e.detach(),
        "proj_f": _rows_sum_to_one(proj_f.detach()),
        "bias": bias.detach(),
        "fitted": torch.ones((), dtype=torch.uint8),
    }


def fit_error(config: LinformerConfig, state, samples) -> float:
    """The fit's objective (relative squared error of the output, or of the implied matrix without values) of a
    layer's current projections on ``samples``; ``mean`` and ``random`` are measured as the projections they
    are at length L (``mean``: its pooling at L, which equals ``mean`` on rows of exactly L real tokens)."""
    items = [item for item in (_fit_item(sample, config.length) for sample in samples) if bool(item["real"].any())]
    if not items:
        raise ValueError(f"linformer: {NOTHING_REAL}")
    heads = items[0]["q"].shape[1]
    if config.mode == "fitted":
        _require_fitted(state)
        e, f, bias = state["proj_e"].float(), state["proj_f"].float(), state["bias"].float()
    elif config.mode == "random":
        e, f = state["proj_e"].float().expand(heads, -1, -1), state["proj_f"].float().expand(heads, -1, -1)
        bias = torch.zeros(heads, config.projections)
    else:
        start, log_size = mean_projection(config.projections, config.length)
        e = f = start.expand(heads, -1, -1)
        bias = log_size.expand(heads, -1)
    with torch.no_grad():
        return sum(float(_fit_loss(item, e, f, bias)) for item in items) / len(items)


@register(
    "linformer",
    LinformerConfig,
    cost=cost,
    init_state=init_state,
    weights=linformer_weights,
    fit=fit,
    fit_when={"mode": "fitted"},
    fit_config=LinformerFitConfig,
    test_options={"projections": 16},
    # mean pooling with a segment per real token (k >= the longest row): every pooled key is one key
    exact_limit=ExactLimit(options=lambda n: {"mode": "mean", "projections": n}),
)
def linformer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    scale: float,
    config: LinformerConfig,
    state: dict[str, torch.Tensor],
    dropout: float = 0.0,
) -> torch.Tensor:
    """Linformer: attention to k keys and values pooled or projected along the sequence, O(N k d)."""
    if config.mode == "fitted":
        _require_fitted(state)
    out_dtype = v.dtype

    exact = exact_rows(q, k, v, key_mask, scale, dropout)

    def approximate() -> torch.Tensor:
        return _linformer(q, k, v, key_mask, scale, config, state, dropout).to(out_dtype)

    return _fallback.with_fallback(
        approximate,
        exact,
        query_mask=query_mask,
        shape=(q.shape[0], q.shape[-2]),
        device=q.device,
        exact_below=config.exact_below,
        at_most=_budget(config),
    )
