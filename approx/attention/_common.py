"""Small tensor helpers shared by the method files (plain torch, no transformers)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

_MASK32 = 0xFFFFFFFF


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision inputs are computed in float32 and cast back; float32/float64 stay as they are."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def safe_key_mask(key_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Rows with no real key at all attend to every key instead (their output is meaningless but finite)."""
    if key_mask is None:
        return None
    empty = ~key_mask.any(-1, keepdim=True)  # (B, 1)
    return key_mask | empty


def exact_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """softmax(scale * q k^T + log m) v with torch's fused kernel. Shapes (B, H, N, d) -> (B, H, N, dv)."""
    key_mask = safe_key_mask(key_mask)
    attn_mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout, scale=scale)


def dense_softmax(q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """softmax(s Q K^T + log m) as a dense (B, H, N, S) matrix: for analysis and plots, never a fast path."""
    key_mask = safe_key_mask(key_mask)
    scores = (q @ k.transpose(-1, -2)) * scale
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return scores.softmax(-1)


def exact_for_rows(
    out: torch.Tensor, rows_mask: torch.Tensor, compute: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Replace the batch rows flagged in ``rows_mask`` (B,) by ``compute(row_indices)``."""
    if not bool(rows_mask.any()):
        return out
    rows = rows_mask.nonzero().squeeze(-1)
    return out.index_put((rows,), compute(rows).to(out.dtype))


def zero_padded_values(v: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """Set padded value rows to zero so that 0 * (huge or inf) can never leak into a real output."""
    if key_mask is None:
        return v
    return v.masked_fill(~key_mask[:, None, :, None], 0.0)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32-style) on int64 tensors; every product stays below 2**63."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    x = x ^ (x >> 16)
    return x


def hash_ints(*parts: torch.Tensor | int) -> torch.Tensor:
    """Deterministic pseudo-random 32-bit values from integer coordinates (broadcast together).

    Used where randomness must not depend on the padded length of a batch: the value for
    (salt, head, position) is the same whatever else is in the tensor.
    """
    acc: torch.Tensor | None = None
    for p in parts:
        t = p if isinstance(p, torch.Tensor) else torch.tensor(p, dtype=torch.int64)
        t = t.to(torch.int64)
        acc = mix32(t) if acc is None else mix32(acc * 0x01000193 + mix32(t))
    assert acc is not None
    return acc
