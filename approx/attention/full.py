"""Exact softmax attention: the reference every approximation is measured against.

O = softmax(s Q K^T + log m) V, computed with torch's ``scaled_dot_product_attention`` (a fused kernel with
O(N) memory on CPU), so a model patched with ``full`` reproduces the unpatched sdpa model.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import MethodConfig
from ..registry import Cost, register
from ._common import dense_softmax, exact_attention


@dataclasses.dataclass(frozen=True)
class FullConfig(MethodConfig):
    """Exact attention has no options."""

    method = "full"


def cost(config: FullConfig, *, n: int, s: int, d: int, dv: int) -> Cost:
    return Cost(flops=2 * n * s * (d + dv), qk_pairs=n * s, matmul_macs=n * s * (d + dv))


def full_weights(q, k, *, key_mask, query_mask, scale, config, state) -> torch.Tensor:
    """The exact attention matrix (B, H, N, S)."""
    return dense_softmax(q, k, key_mask, scale)


@register("full", FullConfig, cost=cost, weights=full_weights)
def full_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    scale: float,
    config: FullConfig,
    state: dict[str, torch.Tensor],
    dropout: float = 0.0,
) -> torch.Tensor:
    """Exact softmax attention (the reference)."""
    return exact_attention(q, k, v, key_mask, scale, dropout)  # (B, H, N, dv)
