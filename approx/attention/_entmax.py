"""The alpha-entmax mapping used by entmax attention, Sparsefinder and its gold graph (plain torch + the
``entmax`` package).

Peters, Niculae, Martins, "Sparse Sequence-to-Sequence Models", ACL 2019: the exact sort-based ``entmax15``
when alpha is exactly 1.5, bisection on the threshold tau for any other alpha > 1.

The bisection is the package's ``entmax_bisect`` (same steps, same backward pass) with one change: its
bracket for tau is [max - 1, max - (1/d)^(alpha - 1)] with d the number of *real* (finite) scores of the row,
not the row length. With the row length, padded keys widen the bracket, so after a few steps the output of
real tokens depended on the amount of padding. Close to alpha = 1 the weights are y^(1 / (alpha - 1)), which
float32 cannot resolve (alpha itself rounds to 1 below 1 + 6e-8): for alpha - 1 < ``FLOAT64_BELOW`` the
mapping is computed in float64.
"""

from __future__ import annotations

import torch
from entmax import entmax15

# alpha - 1 below this: the bisection runs in float64 (float32's relative error ~1e-7 / (alpha - 1) > 1e-4)
FLOAT64_BELOW = 1e-3
# alpha - 1 below this is refused by configs: even float64 loses the weights (error ~1e-16 / (alpha - 1))
MIN_ALPHA_GAP = 1e-9
# alpha = 1.5: sort the largest PARTIAL_SORT scores of a row first (exact: the package solves a row again with
# twice as many when its support fills them). On MiniLM-L6's attention at 512 tokens the support is 6 keys at the
# median and 54 at the 99th percentile, and this is 4.7x faster than sorting every score, with the same output
# (benchmarks/entmax_partial_sort.py)
PARTIAL_SORT = 64
# alpha above this is refused: the bisection works on (alpha - 1) * scores within a bracket of width 1, which
# rounding swamps for large alpha (alpha = 1e30 gives 0 / 0 = NaN); alpha = 100 is already nearly argmax
MAX_ALPHA = 100.0


class _Bisect(torch.autograd.Function):
    """alpha-entmax over the last dimension by bisection on tau, bracketed by the real scores of each row."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, alpha: float, n_iter: int) -> torch.Tensor:
        # alpha as a (..., 1) tensor, as the package has it (a 0-d exponent takes another pow kernel)
        a = torch.tensor(alpha, dtype=scores.dtype, device=scores.device).expand(*scores.shape[:-1], 1)
        real = (scores > float("-inf")).sum(-1, keepdim=True).to(scores.dtype)  # (..., 1) real scores per row
        x = scores * (a - 1)
        top = scores.amax(-1, keepdim=True) * (a - 1)
        tau_lo = top - 1.0  # p(tau_lo) sums to >= 1
        tau_hi = top - (1.0 / real) ** (a - 1)  # p(tau_hi) sums to <= 1
        width = tau_hi - tau_lo
        p = None
        for _ in range(n_iter):
            width = width / 2
            tau = tau_lo + width
            p = torch.clamp(x - tau, min=0) ** (1 / (a - 1))
            tau_lo = torch.where((p.sum(-1, keepdim=True) - 1) >= 0, tau, tau_lo)
        p = p / p.sum(-1, keepdim=True)
        ctx.save_for_backward(p, a)
        return p

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        p, a = ctx.saved_tensors
        g = torch.where(p > 0, p ** (2 - a), p.new_zeros(()))  # (..., S)
        dx = grad * g
        dx = dx - g * (dx.sum(-1, keepdim=True) / g.sum(-1, keepdim=True))
        return dx, None, None


def entmax(
    scores: torch.Tensor, alpha: float, *, n_iter: int | None = None, partial_sort: int | None = PARTIAL_SORT
) -> torch.Tensor:
    """alpha-entmax over the last dimension of ``scores`` (-inf entries get exactly zero weight).

    ``n_iter``: bisection steps for alpha != 1.5 (None: the package's default, 50). ``partial_sort``: for
    alpha = 1.5, sort only the largest ``partial_sort`` scores of a row first (exact: the package widens the
    sort for rows whose support fills them; default :data:`PARTIAL_SORT`); None, or a row no longer than that,
    sorts everything. Every row needs at least one finite score.
    """
    if alpha == 1.5:
        k = partial_sort if partial_sort is not None and scores.shape[-1] > partial_sort else None
        return entmax15(scores, dim=-1, k=k)
    n_iter = 50 if n_iter is None else n_iter
    if alpha - 1 < FLOAT64_BELOW and scores.dtype != torch.float64:
        return _Bisect.apply(scores.double(), alpha, n_iter).to(scores.dtype)
    return _Bisect.apply(scores, alpha, n_iter)
