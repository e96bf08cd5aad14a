"""Segment summaries of a sequence's real tokens, shared by the low-rank methods (plain torch).

* :func:`segment_means`: the real tokens of every batch row (its mask; rows of different lengths in one batch,
  padding anywhere) are cut, in order, into m contiguous segments of near-equal size: real token of rank r
  (0-based among the row's n real tokens) belongs to segment floor(r m / n), so sizes are floor or ceil of n / m
  and a segment is empty only when n < m. Padded tokens belong to no segment. Returns the per-segment means
  (B, H, m, d) and sizes (B, m) (an empty segment has mean 0 and size 0; :func:`log_sizes` gives it -inf).
  Nystrom's landmarks and Linformer's ``mean`` pooling.
* :func:`resample`: the real tokens resampled to a fixed number of positions L (Linformer's projections of
  length L): segment means when n >= L, and when n < L each position takes the real token under its centre.
* :func:`attend_summaries`: softmax attention of every query to m summaries (pooled keys, landmarks) with an
  additive per-summary bias, in slices of heads so that no (B, H, N, m) score tensor is held whole.

The sums are one ``index_add_`` over the flattened tokens (a segment index per token, padded tokens sent to a
spare segment that is dropped): no loop over batch rows and no cumulative sums (whose differences lose
precision on long sequences).
"""

from __future__ import annotations

import torch

from ._common import softmax_


def longest(mask: torch.Tensor | None, n: int) -> int:
    """The most real tokens of a batch row, (B, n) ``mask`` (True = real) or None (every one of the n): segments or
    landmarks beyond it would be empty in every row (a batch padded to a fixed length), and computed for nothing."""
    return n if mask is None or mask.numel() == 0 else int(mask.sum(-1).max())


def segment_ids(mask: torch.Tensor | None, n: int, m: int, *, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The segment of every position, (B, n) long in [0, m] (m: padded, no segment), and the sizes (B, m) long.

    ``mask``: (B, n) bool, True = real token, or None (every token real)."""
    if mask is None:
        rank = torch.arange(n, device=device).expand(batch, n)
        count = torch.full((batch, 1), n, device=device, dtype=torch.long)
    else:
        rank = mask.long().cumsum(-1) - 1  # (B, n): rank of each real token among its row's real tokens
        count = mask.sum(-1, keepdim=True)  # (B, 1)
    ids = (rank * m).div(count.clamp(min=1), rounding_mode="floor")  # (B, n)
    if mask is not None:
        ids = ids.masked_fill(~mask, m)
    # segment t holds the ranks r with t <= r m / n < t + 1, i.e. [ceil(t n / m), ceil((t + 1) n / m))
    t = torch.arange(m + 1, device=device)
    starts = -((-t * count).div(m, rounding_mode="floor"))  # (B, m + 1): ceil(t n / m)
    return ids, starts[:, 1:] - starts[:, :-1]


def segment_sums(x: torch.Tensor, ids: torch.Tensor, m: int) -> torch.Tensor:
    """Sums of ``x`` (B, H, n, d) over the segments ``ids`` (B, n) in [0, m]: (B, H, m, d); segment m (padding)
    is summed into a spare row and dropped."""
    batch, heads, n, d = x.shape
    row = torch.arange(batch * heads, device=x.device).view(batch, heads, 1) * (m + 1)
    index = (row + ids[:, None, :]).reshape(-1)  # (B * H * n,): the row of each token's segment in a flat table
    sums = x.new_zeros(batch * heads * (m + 1), d).index_add_(0, index, x.reshape(-1, d))
    return sums.view(batch, heads, m + 1, d)[:, :, :m]


def segment_means(x: torch.Tensor, mask: torch.Tensor | None, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Means of the real tokens of ``x`` (B, H, n, d) over m contiguous near-equal segments (see the module
    docstring): (B, H, m, d) in x's dtype, and the sizes (B, m) long (0 for an empty segment, whose mean is 0)."""
    batch, _, n, _ = x.shape
    ids, sizes = segment_ids(mask, n, m, batch=batch, device=x.device)
    sums = segment_sums(x, ids, m)
    return sums / sizes.clamp(min=1)[:, None, :, None].to(x.dtype), sizes


def log_sizes(sizes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """log(size) of every segment as an additive score bias, (B, 1, 1, m): -inf for an empty segment (out of the
    softmax), 0 for a segment of one token."""
    return sizes.to(dtype).log()[:, None, None, :]


def empty_bias(sizes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 for a segment with real tokens, -inf for an empty one: (B, 1, 1, m)."""
    zero = torch.zeros((), dtype=dtype, device=sizes.device)
    return torch.where(sizes > 0, zero, zero - float("inf"))[:, None, None, :]


def resample(x: torch.Tensor, mask: torch.Tensor | None, length: int) -> torch.Tensor:
    """The real tokens of ``x`` (B, H, n, d) resampled to ``length`` positions L: (B, H, L, d).

    A row of n >= L real tokens: the means of L contiguous near-equal segments (:func:`segment_means`); a row of
    n < L: position l takes the real token of rank floor((l + 1/2) n / L), the one under its centre (each real
    token is repeated about L / n times). n = L: the real tokens themselves. Padded tokens take no part."""
    batch, heads, n, d = x.shape
    means, _ = segment_means(x, mask, length)
    count = torch.full((batch,), n, device=x.device) if mask is None else mask.sum(-1)  # (B,)
    if bool((count >= length).all()):
        return means
    centre = (2 * torch.arange(length, device=x.device) + 1)[None, :] * count[:, None]  # (B, L)
    rank = centre.div(2 * length, rounding_mode="floor").clamp(max=n - 1)
    if mask is None:
        position = rank
    else:  # positions of the real tokens in order, then the one of each wanted rank
        order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)  # (B, n): real positions first
        position = order.gather(1, rank)
    nearest = x.gather(2, position[:, None, :, None].expand(batch, heads, length, d))  # (B, H, L, d)
    return torch.where((count >= length)[:, None, None, None], means, nearest)


# Queries of this many (batch, head) slices at a time in :func:`attend_summaries`: their (N, m) scores stay a few
# MB, reused from one slice to the next, instead of a (B, H, N, m) tensor (50 MB at N = 16384, m = 64, H = 12).
_SLICE_ELEMENTS = 1 << 20


def attend_summaries(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """softmax(scale q keys^T + bias) values for every query: q (B, H, N, d), keys (B, H, m, d), values
    (B, H, m, dv), bias broadcastable to (B, H, 1, m) or None; returns (B, H, N, dv).

    ``dropout``: attention dropout on the (N, m) softmax weights (scaled by 1 / (1 - p)). Without gradients and
    dropout the scores of a few heads at a time go to one reused buffer and the output is written in place."""
    batch, heads, n, _ = q.shape
    m, dv = keys.shape[-2], values.shape[-1]
    if keys.shape[-2] <= n:  # the scale goes on the smaller operand
        keys = keys * scale
    else:
        q = q * scale
    keys_t = keys.transpose(-1, -2)  # (B, H, d, m)
    if bias is not None:
        bias = bias.expand(batch, heads, 1, m)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, keys, values))
    if grad or dropout > 0.0:
        scores = q @ keys_t  # (B, H, N, m)
        weights = (scores if bias is None else scores + bias).softmax(-1)
        if dropout > 0.0:
            weights = torch.nn.functional.dropout(weights, dropout)
        return weights @ values
    bh = batch * heads
    q3, k3, v3 = q.reshape(bh, n, -1), keys_t.reshape(bh, -1, m), values.reshape(bh, m, dv)
    b3 = None if bias is None else bias.reshape(bh, 1, m)
    out = q.new_empty(bh, n, dv)
    step = max(1, min(bh, _SLICE_ELEMENTS // max(1, n * m)))
    scratch = q.new_empty(step, n, m)
    for start in range(0, bh, step):
        stop = min(bh, start + step)
        scores = torch.bmm(q3[start:stop], k3[start:stop], out=scratch[: stop - start])  # (h, N, m)
        if b3 is not None:
            scores += b3[start:stop]
        torch.bmm(softmax_(scores), v3[start:stop], out=out[start:stop])
    return out.view(batch, heads, n, dv)
