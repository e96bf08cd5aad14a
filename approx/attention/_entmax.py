"""The alpha-entmax mapping used by entmax attention, Sparsefinder and its gold graph (plain torch + the
``entmax`` package).

Peters, Niculae, Martins, "Sparse Sequence-to-Sequence Models", ACL 2019: the exact sort-based ``entmax15``
when alpha is exactly 1.5, bisection on the threshold tau (``entmax_bisect``) for any other alpha > 1.
"""

from __future__ import annotations

import torch
from entmax import entmax15, entmax_bisect


def entmax(
    scores: torch.Tensor, alpha: float, *, n_iter: int | None = None, partial_sort: int | None = None
) -> torch.Tensor:
    """alpha-entmax over the last dimension of ``scores`` (-inf entries get exactly zero weight).

    ``n_iter``: bisection steps for alpha != 1.5 (None: the package's default). ``partial_sort``: for alpha =
    1.5, sort only the largest ``partial_sort`` scores of a row first (exact: the package widens the sort for
    rows whose support fills them); None, or a row no longer than that, sorts everything.
    """
    if alpha == 1.5:
        k = partial_sort if partial_sort is not None and scores.shape[-1] > partial_sort else None
        return entmax15(scores, dim=-1, k=k)
    if n_iter is None:
        return entmax_bisect(scores, alpha=alpha, dim=-1)
    return entmax_bisect(scores, alpha=alpha, dim=-1, n_iter=n_iter)
