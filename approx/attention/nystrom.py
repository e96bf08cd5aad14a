"""Nystrom attention: softmax attention through m landmarks and a pseudo-inverse (Nystromformer).

Xiong, Zeng, Chakraborty, Tan, Fung, Li, Singh, "Nystromformer: A Nystrom-Based Algorithm for Approximating
Self-Attention", AAAI 2021 (arXiv 2102.03902).

With landmark queries Q~ and keys K~ (m of each), the N x S softmax matrix is approximated by the Nystrom
form of its three blocks:

    O = softmax(s Q K~^T) pinv(softmax(s Q~ K~^T)) softmax(s Q~ K^T + log m) V,

computed right to left, O(N m d + m^3) time and memory, never an N x S matrix.

Choices made here:

* Landmarks are segment means of the *real* tokens (:mod:`._segments`): each row's real queries (keys) are cut
  into m contiguous segments of near-equal size, whatever the row's length and wherever its padding is. The
  paper's code (and the published zero-shot baseline) averages fixed segments of the padded sequence, zeroed
  padding included, so a short row's last landmarks are shrunk towards 0: a bug not repeated here. Padded keys
  are out of the third factor's softmax too.
* ``pinv="iterative"`` (default): the paper's iteration Z <- 1/4 Z (13 I - A Z (15 I - A Z (7 I - A Z))) for
  ``pinv_iterations`` steps (6 in the paper), from Z_0 = A^T / (||A||_1 ||A||_inf), the largest column sum times
  the largest row sum of each (batch, head)'s own matrix (the paper's code takes one maximum over the whole
  batch and every head, which slows the convergence of all but the largest). ``pinv="exact"``:
  ``torch.linalg.pinv`` (an SVD, in float64), the limit of the iteration; with it and at least as many
  landmarks as real tokens every token is its own landmark and the formula is exact attention (A A^+ A = A):
  the exact limit the tests check.
* Short rows: a row with at most ``landmarks`` real queries gets exact attention (rows shorter than the
  budget, rule 5 of the method rules), counted in the cost. Not with ``pinv="exact"``, where the formula
  itself is exact there (each real token is its own landmark; an empty landmark, possible only when a row is
  shorter than m, is left out of every softmax and gets zero rows and columns in the matrix inverted). A call
  of fewer tokens than ``landmarks`` (queries or keys, padding included) computes, and is counted at, that many.
* No ``weights``: the matrix Nystrom implies is not a distribution (the pseudo-inverse makes entries negative).
  ``exact_below`` is the generic fallback, as for every method; the "at most m real tokens" rule above covers the
  rows where Nystrom cannot pay.
* Left out: the paper's depthwise convolution of V added to the output (a skip connection with trained
  weights, which pretrained encoders do not have).
* Half precision: computed in float32 (the landmark sums, the softmaxes and the iteration); float64 stays
  float64. ``pinv="exact"`` computes the whole formula in float64, whatever the input dtype: the kernel matrix
  of nearby landmarks is ill-conditioned, and its pseudo-inverse amplifies the rounding of float32 factors (with
  every token its own landmark, MiniLM-L6's outputs at 400 tokens were 0.36 off exact attention in float32, 1e-9
  in float64); it is the measuring mode, the iteration the fast one.
* Attention dropout is not applied (the implied matrix is never formed; dropping entries of one factor is a
  different regulariser): a call with ``dropout > 0`` warns.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from ..config import MethodConfig, option
from ..registry import Cost, ExactLimit, register
from . import _fallback
from ._common import compute_dtype, exact_rows, safe_key_mask, zero_padded_values
from ._fallback import exact_for_length
from ._segments import attend_summaries, empty_bias, longest, segment_means

PINVS = ("iterative", "exact")


@dataclasses.dataclass(frozen=True)
class NystromConfig(MethodConfig):
    """Options of Nystrom attention."""

    method = "nystrom"

    landmarks: int = option(
        64,
        "m: landmark queries and keys, segment means of the real tokens (the paper's 64); rows of at most m "
        "real tokens get exact attention (with pinv='exact' the formula itself is exact there)",
    )
    pinv: str = option(
        "iterative",
        "'iterative': the paper's pseudo-inverse iteration; 'exact': torch.linalg.pinv (an SVD), its limit, with the "
        "whole formula in float64 (a measuring mode: exact attention when every token is a landmark)",
    )
    pinv_iterations: int = option(6, "steps of the iterative pseudo-inverse (the paper's 6)")
    exact_below: int = option(
        0,
        "sequences with fewer real tokens get exact attention (0 = never; with 64 landmarks the pseudo-inverse's "
        "fixed cost makes Nystrom slower than SDPA on short sequences: see the docs' Speed page)",
    )

    def unused(self) -> dict[str, str]:
        return {"pinv_iterations": "pinv='iterative'"} if self.pinv == "exact" else {}

    def check(self) -> None:
        self.require(self.landmarks >= 1, "landmarks", "need at least one landmark")
        self.require(self.pinv in PINVS, "pinv", f"choose one of {', '.join(map(repr, PINVS))}")
        self.require(self.pinv_iterations >= 0, "pinv_iterations", "a number of steps: 0 or more")
        self.require(self.exact_below >= 0, "exact_below", "a length: 0 (off) or more")


def _budget(config: NystromConfig) -> int | None:
    """Rows with at most this many real queries get exact attention (None: none, with the exact pinv)."""
    return config.landmarks if config.pinv == "iterative" else None


def _landmarks(config: NystromConfig, n: int, s: int) -> int:
    """Landmarks computed on a call of ``n`` queries and ``s`` keys: no more than tokens (more would be empty: with the
    exact pseudo-inverse, a short call paid the SVD of every one); a padded call passes its longest row's real tokens
    (:func:`._segments.longest`)."""
    return min(config.landmarks, max(n, s))


def cost(config: NystromConfig, *, n: int, s: int, d: int, dv: int) -> Cost:
    m = _landmarks(config, n, s)
    if exact_for_length(n, exact_below=config.exact_below, at_most=_budget(config)):
        return Cost(flops=2 * n * s * (d + dv), qk_pairs=n * s, matmul_macs=n * s * (d + dv))
    # the three factors' scores and value products, right to left; Z (m x m) times softmax(Q~ K^T) V
    macs = n * m * (d + dv) + m * m * d + m * s * (d + dv) + m * m * dv
    if config.pinv == "iterative":  # four (m x m) products per step
        macs += 4 * config.pinv_iterations * m**3
    else:  # the SVD (about 10 m^3 multiply-adds, a rough count) and V S^+ U^T
        macs += 11 * m**3
    means = (n + s) * d  # the landmark sums
    return Cost(flops=2 * macs + means, qk_pairs=n * m + m * m + m * s, matmul_macs=macs)


def iterative_pinv(a: torch.Tensor, iterations: int) -> torch.Tensor:
    """The paper's approximate Moore-Penrose pseudo-inverse of every (m, m) matrix of ``a`` (..., m, m):
    Z_0 = A^T / (||A||_1 ||A||_inf), then Z <- 1/4 Z (13 I - A Z (15 I - A Z (7 I - A Z))). Zero rows and
    columns of A (empty landmarks) stay zero columns and rows of Z."""
    tiny = torch.finfo(a.dtype).tiny
    norm_1 = a.abs().sum(-2).amax(-1)  # (...,): the largest column sum
    norm_inf = a.abs().sum(-1).amax(-1)  # the largest row sum
    z = a.transpose(-1, -2) / (norm_1 * norm_inf).clamp(min=tiny)[..., None, None]
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def _pinv(a: torch.Tensor, config: NystromConfig) -> torch.Tensor:
    if config.pinv == "exact":  # float64 (the whole formula is, see _nystrom)
        return torch.linalg.pinv(a)
    return iterative_pinv(a, config.pinv_iterations)


def _nystrom(q, k, v, key_mask, query_mask, scale, config) -> torch.Tensor:
    """The Nystrom estimate (B, H, N, dv) in the input dtype (computed in float64 with ``pinv="exact"``)."""
    dt = torch.float64 if config.pinv == "exact" else compute_dtype(q.dtype)
    key_mask = safe_key_mask(key_mask)
    m = _landmarks(config, longest(safe_key_mask(query_mask), q.shape[-2]), longest(key_mask, k.shape[-2]))
    # padded keys zeroed too: their scores get a -inf bias, which an inf in a padded key would turn into NaN
    q, k, v = q.to(dt), zero_padded_values(k.to(dt), key_mask), zero_padded_values(v.to(dt), key_mask)
    q_land, q_sizes = segment_means(q, safe_key_mask(query_mask), m)  # (B, H, m, d), (B, m)
    k_land, k_sizes = segment_means(k, key_mask, m)
    real_q = (q_sizes > 0)[:, None, :, None].to(dt)  # (B, 1, m, 1): landmark queries with real tokens
    land_bias = empty_bias(k_sizes, dt)  # (B, 1, 1, m): empty landmark keys out of every softmax
    # softmax(s Q~ K^T + log m) V: (B, H, m, dv), the landmark queries attending to every real key
    key_bias = None if key_mask is None else empty_bias(key_mask.long(), dt)  # (B, 1, 1, S)
    summary = attend_summaries(q_land, k, v, key_bias, scale) * real_q
    # softmax(s Q~ K~^T): (B, H, m, m), empty landmarks as zero rows and columns
    kernel = ((q_land @ k_land.transpose(-1, -2)) * scale + land_bias).softmax(-1) * real_q
    middle = _pinv(kernel, config) @ summary  # (B, H, m, dv)
    return attend_summaries(q, k_land, middle, land_bias, scale)  # (B, H, N, dv)


@register(
    "nystrom",
    NystromConfig,
    cost=cost,
    test_options={"landmarks": 8},
    # every real token its own landmark (m >= the longest row) and the exact pseudo-inverse: A A^+ A = A
    exact_limit=ExactLimit(options=lambda n: {"landmarks": n, "pinv": "exact"}),
)
def nystrom_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    scale: float,
    config: NystromConfig,
    state: dict[str, torch.Tensor],
    dropout: float = 0.0,
) -> torch.Tensor:
    """Nystrom attention: segment-mean landmarks and a pseudo-inverse, O(N m d)."""
    if dropout > 0.0:
        warnings.warn(
            "nystrom: attention dropout is not applied (the attention matrix is never formed); the model trains "
            "without it",
            RuntimeWarning,
            stacklevel=3,
        )
    out_dtype = v.dtype

    exact = exact_rows(q, k, v, key_mask, scale)

    def approximate() -> torch.Tensor:
        return _nystrom(q, k, v, key_mask, query_mask, scale, config).to(out_dtype)

    shape = (q.shape[0], q.shape[-2])
    return _fallback.with_fallback(
        approximate,
        exact,
        query_mask=query_mask,
        shape=shape,
        device=q.device,
        at_most=_budget(config),
        exact_below=config.exact_below,
    )
