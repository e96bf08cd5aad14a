"""alpha-entmax attention: softmax replaced by a sparse mapping that gives exact zeros.

Peters, Niculae, Martins, "Sparse Sequence-to-Sequence Models", ACL 2019 (alpha-entmax); Treviso et al.,
"Predicting Attention Sparsity in Transformers", SPNLP 2022 (arXiv 2109.12188), which converts softmax
transformers to 1.5-entmax attention and then predicts its sparsity pattern (Sparsefinder).

O = alpha-entmax(s Q K^T + log m) V, where alpha-entmax(z) = argmax_p <p, z> + H^T_alpha(p) over the
simplex (H^T_alpha the Tsallis entropy) has the closed form p_i = [(alpha - 1) z_i - tau]_+^(1 / (alpha - 1))
with tau chosen so that sum(p) = 1. Scores below the threshold get exactly zero weight; alpha -> 1 recovers
softmax, alpha = 2 is sparsemax.

This is *not* an efficient approximation: it is dense, O(N S) time and scores like exact attention, and the
mapping itself is slower than a softmax (a sort per row for alpha = 1.5, ``n_iter`` passes for bisection).
Patching a softmax-pretrained model with it changes the model (a different attention, not an estimate of the
same one), which then needs fine-tuning to recover; it is the exact target that Sparsefinder predicts, where
the speed comes from.

Choices made here:

* The mapping comes from the ``entmax`` package: the exact sort-based ``entmax15`` when alpha is exactly 1.5,
  ``entmax_bisect`` (bisection on tau, ``n_iter`` steps) for any other alpha > 1. Bisection resolves tau to
  about 2^-n_iter within a bracket set by the real keys only, so the output of real tokens does not depend
  on the amount of padding at any ``n_iter``. Close to alpha = 1 the weights are p = y^(1 / (alpha - 1)),
  so a rounding error in y is amplified by 1 / (alpha - 1): for alpha - 1 < 1e-3 the mapping runs in
  float64, and alpha - 1 < 1e-9 is refused (use ``full`` for softmax itself).
* Padded keys get the score -inf, hence exactly zero weight; their values are zeroed as well, so a huge or
  infinite padded value cannot leak through 0 * inf. A row with no real key at all would make the package
  fail (entmax15 raises on an empty support, the bisection returns NaN), so such rows attend to every key
  instead (``safe_key_mask``): their output is meaningless but finite. Inside entmax15 the -inf scores give
  NaN partial sums past the real keys; they are never selected (a NaN threshold compares false), and only
  the output enters the backward pass.
* float16 / bfloat16 inputs are computed in float32 and cast back. Attention dropout (training only) is
  applied to the entmax weights, as transformers does to softmax weights.
* Queries are processed in blocks so that one block's (rows, S) score matrix holds at most
  ``_CHUNK_ELEMENTS`` numbers per (batch, head) set: the sort-based mapping keeps about ten temporaries of that
  size, which for a whole (B, H, N, S) batch would be many times the memory of the scores.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from ..config import MethodConfig, option
from ..registry import Cost, ExactLimit, register
from . import _fallback
from ._common import compute_dtype, safe_key_mask, zero_padded_values
from ._entmax import MAX_ALPHA, MIN_ALPHA_GAP, entmax


@dataclasses.dataclass(frozen=True)
class EntmaxConfig(MethodConfig):
    """Options of alpha-entmax attention."""

    method = "entmax"

    alpha: float = option(
        1.5,
        "alpha-entmax; 1.5 uses the exact sort-based entmax15, other values bisection; alpha -> 1 approaches softmax",
    )
    n_iter: int = option(50, "bisection steps for alpha != 1.5 (tau to about 2^-n_iter; the entmax package's default)")

    def unused(self) -> dict[str, str]:
        return {"n_iter": "alpha != 1.5, which bisects"} if self.exact_sort else {}

    def check(self) -> None:
        self.require(math.isfinite(self.alpha), "alpha", "must be a finite number greater than 1")
        self.require(
            self.alpha > 1,
            "alpha",
            "alpha-entmax needs alpha > 1 (alpha = 1 is softmax: use method 'full'; alpha = 2 is sparsemax)",
        )
        self.require(
            self.alpha - 1 >= MIN_ALPHA_GAP,
            "alpha",
            f"alpha - 1 below {MIN_ALPHA_GAP:g} cannot be resolved even in float64 (the weights are "
            "y^(1 / (alpha - 1))); use method 'full' for softmax",
        )
        self.require(
            self.alpha <= MAX_ALPHA,
            "alpha",
            f"at most {MAX_ALPHA:g}: the bisection works on (alpha - 1) * scores in a bracket of width 1, which "
            "rounding swamps for large alpha (NaN)",
        )
        self.require(self.n_iter >= 1, "n_iter", "need at least one bisection step")

    @property
    def exact_sort(self) -> bool:
        """True when the sort-based entmax15 is used (alpha exactly 1.5), False for bisection."""
        return self.alpha == 1.5


def cost(config: EntmaxConfig, *, n: int, s: int, d: int, dv: int) -> Cost:
    """Score and value products as for exact attention, plus an estimate of the mapping, counting one flop per
    comparison or elementwise operation: entmax15 sorts each row (about log2(S) comparisons per score) and
    makes about 10 passes over it; bisection makes about 4 passes per step."""
    if config.exact_sort:
        mapping = n * s * (math.ceil(math.log2(max(s, 2))) + 10)
    else:
        mapping = n * s * 4 * config.n_iter
    return Cost(flops=2 * n * s * (d + dv) + mapping, qk_pairs=n * s, matmul_macs=n * s * (d + dv))


def _entmax_probs(
    q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None, scale: float, config: EntmaxConfig
) -> torch.Tensor:
    """alpha-entmax(scale q k^T + log m) over the keys: (B, H, n, d), (B, H, S, d) -> (B, H, n, S).

    ``key_mask`` must already be safe (every batch row has a real key), else the package returns NaN.
    """
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, H, n, S)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return entmax(scores, config.alpha, n_iter=config.n_iter)


def entmax_weights(q, k, *, key_mask, query_mask, scale, config, state) -> torch.Tensor:
    """The dense (B, H, N, S) alpha-entmax attention matrix, in one pass (analysis and tests)."""
    dt = compute_dtype(q.dtype)
    return _fallback.with_fallback(lambda: _entmax_probs(q.to(dt), k.to(dt), safe_key_mask(key_mask), scale, config))


# Largest number of scores of one query block: B * H * rows * S <= _CHUNK_ELEMENTS (16 MiB in float32).
_CHUNK_ELEMENTS = 1 << 22


@register(
    "entmax",
    EntmaxConfig,
    cost=cost,
    weights=entmax_weights,
    test_options={},  # alpha = 1.5
    # alpha -> 1 is softmax: the distance falls about linearly in alpha - 1 (bisection; float64 keeps it exact
    # enough down to alpha - 1 = 1e-4)
    exact_limit=ExactLimit(approaches=lambda n: [{"alpha": a} for a in (1.5, 1.1, 1.01, 1.001, 1.0001)], ratio=1e-3),
)
def entmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    scale: float,
    config: EntmaxConfig,
    state: dict[str, torch.Tensor],
    dropout: float = 0.0,
) -> torch.Tensor:
    """alpha-entmax attention (sparse weights with exact zeros; dense O(N^2) computation)."""
    return _fallback.with_fallback(lambda: _entmax_attention(q, k, v, key_mask, scale, config, dropout))  # no fallback


def _entmax_attention(q, k, v, key_mask, scale, config, dropout) -> torch.Tensor:
    dt = compute_dtype(q.dtype)
    key_mask = safe_key_mask(key_mask)
    q, k = q.to(dt), k.to(dt)
    v_real = zero_padded_values(v.to(dt), key_mask)  # (B, H, S, dv)
    batch, heads, n, _ = q.shape
    rows = max(1, _CHUNK_ELEMENTS // max(1, batch * heads * k.shape[-2]))
    outs = []
    for start in range(0, n, rows):
        p = _entmax_probs(q[:, :, start : start + rows], k, key_mask, scale, config)  # (B, H, rows, S)
        if dropout > 0.0:
            p = F.dropout(p, dropout)
        outs.append(p @ v_real)  # (B, H, rows, dv)
    return torch.cat(outs, dim=2).to(v.dtype)  # (B, H, N, dv)
