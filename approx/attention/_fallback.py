"""Exact attention where an approximation does not pay or cannot approximate: the one place every method
decides it, for the whole batch and per batch row (plain torch).

A method with a fallback (``exact_below``, or clustered attention's "at most C real queries") computes its
output through :func:`with_fallback`: batch rows that must be exact get ``exact(rows)``, the others the
approximation. When the padded length alone decides that every row is exact, the approximation never runs.
Methods without a fallback call it too (with the defaults, it only runs the approximation). Every method calls
it as ``_fallback.with_fallback`` (the module attribute), so that the generic exact-limit test
(``tests/test_methods.py``) can spy on it and see that the approximation, not a fallback, ran.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable

import torch


class FallbackWarning(RuntimeWarning):
    """An approximation broke down on some query rows, which got exact attention instead."""


# Query rows that got exact attention because the approximation broke down on them (not the planned
# ``exact_below`` / "at most C" rows), per method name, summed over calls until :func:`reset_counts`. Read it
# with :func:`counts` around an evaluation to report how often a method was not what it claims to be.
COUNTS: collections.Counter[str] = collections.Counter()


# The batch rows that got exact attention after a breakdown in the current layer call, as an (R,) index tensor: set
# by the call's replacement (a method makes one per call: FAVOR+), cleared by ``ApproxAttention.forward`` as each
# call starts (so a call without a breakdown leaves it empty, and a method called directly holds one at most), read
# by the harness's probe after the call to add their exact attention to its cost.
BROKE_DOWN_ROWS: list[torch.Tensor] = []


def start_call() -> None:
    """Forget the rows of the previous layer call (:data:`BROKE_DOWN_ROWS`)."""
    BROKE_DOWN_ROWS.clear()


def counts() -> dict[str, int]:
    """Query rows per method that fell back to exact attention since the last :func:`reset_counts`."""
    return dict(COUNTS)


def reset_counts() -> None:
    COUNTS.clear()


# exact(rows) -> output of the rows ``rows`` (a (R,) index tensor), or of the whole batch for ``rows=None``
ExactFn = Callable[[torch.Tensor | None], torch.Tensor]


def exact_for_length(n: int, *, exact_below: int = 0, at_most: int | None = None) -> bool:
    """True when a sequence of ``n`` real tokens gets exact attention: fewer than ``exact_below``, or at most
    ``at_most`` (None: no such limit). Also what cost models use for a sequence of ``n`` tokens (the harness counts
    each row of a batch at its real length)."""
    return n < exact_below or (at_most is not None and n <= at_most)


def exact_rows(
    query_mask: torch.Tensor | None, n: int, batch: int, device, *, exact_below: int = 0, at_most: int | None = None
) -> torch.Tensor:
    """Batch rows whose count of real queries calls for exact attention (see :func:`exact_for_length`): (B,) bool."""
    real = torch.full((batch,), n, device=device) if query_mask is None else query_mask.sum(-1)
    short = real < exact_below
    return short if at_most is None else (real <= at_most) | short


def replace_rows(out: torch.Tensor, rows_mask: torch.Tensor, compute: ExactFn) -> torch.Tensor:
    """Replace the batch rows flagged in ``rows_mask`` (B,) by ``compute(row_indices)``."""
    if not bool(rows_mask.any()):
        return out
    rows = rows_mask.nonzero().squeeze(-1)
    return out.index_put((rows,), compute(rows).to(out.dtype))


def with_fallback(
    approximate: Callable[[], torch.Tensor],
    exact: ExactFn | None = None,
    *,
    query_mask: torch.Tensor | None = None,
    shape: tuple[int, int] | None = None,
    device=None,
    exact_below: int = 0,
    at_most: int | None = None,
) -> torch.Tensor:
    """``approximate()`` with the rows that must be exact replaced by ``exact(rows)``; ``exact(None)`` alone when
    every row must be (decided from the padded length first, without a host synchronisation).

    ``shape``: (B, N), the batch size and the padded number of queries; ``query_mask``: (B, N) bool or None.
    With ``exact_below <= 0`` and ``at_most=None`` (no fallback) it returns ``approximate()`` and needs nothing else.
    """
    if exact_below <= 0 and at_most is None:  # no fallback: nothing to look at
        return approximate()
    if exact is None or shape is None:
        raise ValueError("with_fallback: a fallback needs exact and shape")
    batch, n = shape
    if exact_for_length(n, exact_below=exact_below, at_most=at_most):
        return exact(None)
    # every row has the padded length's real tokens, which do not call for exact attention
    if query_mask is None and batch > 0:
        return approximate()
    short = exact_rows(query_mask, n, batch, device, exact_below=exact_below, at_most=at_most)
    if bool(short.all()):
        return exact(None)
    return replace_rows(approximate(), short, exact)


def replace_query_rows(
    out: torch.Tensor, bad: torch.Tensor, exact: ExactFn, *, method: str, why: str, count: bool = True
) -> torch.Tensor:
    """Replace the query rows flagged in ``bad`` (B, H, N) by those of ``exact(rows)``, computed for the batch
    rows holding one (``out``: (B, H, N, *F)). With ``count``, they are added to :data:`COUNTS` under ``method``
    and a :class:`FallbackWarning` says ``why`` (the message is constant, so Python shows it once per place)."""
    if not bool(bad.any()):
        return out
    if count:
        COUNTS[method] += int(bad.sum())
        warnings.warn(
            f"{method}: {why}; those rows got exact attention (counted in approx.attention._fallback.counts())",
            FallbackWarning,
            stacklevel=2,
        )
    rows = bad.flatten(1).any(-1).nonzero().squeeze(-1)  # (R,) batch rows with a flagged query
    if count:
        BROKE_DOWN_ROWS[:] = [rows]
    flags = bad[rows].view(*bad[rows].shape, *([1] * (out.dim() - 3)))  # (R, H, N, 1...)
    return out.index_put((rows,), torch.where(flags, exact(rows).to(out.dtype), out[rows]))
