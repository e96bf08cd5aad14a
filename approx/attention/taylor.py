"""Taylor attention: the first-order Taylor expansion of exp(q.k) on l2-normalised queries and keys.

Li, Su, Duan, Zheng, "Linear Attention Mechanism: An Efficient Attention for Semantic Segmentation" (arXiv
2007.14902), eqs. 9-12.

exp(q.k) ~ 1 + q.k; with q^ = q / |q| and k^ = k / |k| the weights 1 + q^.k^ lie in [0, 2], never negative:
O_i = (sum_j v_j + q^_i^T sum_j k^_j v_j^T) / (n + q^_i^T sum_j k^_j), sums over the n real keys. It is the
kernel phi(q) . phi(k) of the features phi(x) = [1, x / |x|] (d + 1 of them), so O(N d dv) time, no N x S
matrix.

Choices made here:

* The attention scale is not used: the normalisation removes every magnitude of q and k, s among them (the
  paper's formula has none). So it is another kernel than softmax, not an approximation of it (exp(s q.k) is
  not 1 + cos(q, k)); its exact reference is its own dense formula (``ExactLimit(kernel="taylor")``,
  ``tests/reference.py``). ``scale`` is used only by the exact fallback (``exact_below``).
* A zero vector is normalised to zero (x / max(|x|, 1e-12), as ``torch.nn.functional.normalize``): its
  weights are all 1.
* Computed by the kernelised helper (:mod:`._kernelized`): chunks of keys and queries, the feature rows of
  padded keys zeroed (the constant feature too, so n counts the real keys only), half precision computed and
  summed in float32, in place without gradients. The normaliser is at least 0 (every weight is): it is
  floored at a tiny value only so that a query whose every key points exactly the other way (all weights 0)
  gives no 0 / 0.
* ``weights``: the implied matrix (1 + q^_i.k^_j) / normaliser is non-negative with rows summing to 1: exposed
  for analysis.
* ``exact_below``: batch rows with fewer real tokens get exact *softmax* attention (the pretrained model's), 0
  (the default) never.
* Attention dropout is not applied (the matrix it would drop entries of is never formed): a call with
  ``dropout > 0`` (training) warns instead of ignoring it silently.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..config import MethodConfig, option
from ..registry import Cost, ExactLimit, register
from . import _kernelized
from ._kernelized import FeatureMap, Scratch

_NORM_EPS = 1e-12  # torch.nn.functional.normalize's: x / max(|x|, eps)
_FLOOR = 1e-30  # the normaliser is a sum of weights >= 0: a floor against 0 / 0 only


@dataclasses.dataclass(frozen=True)
class TaylorConfig(MethodConfig):
    """Options of Taylor attention (it has no budget: its cost is fixed by d)."""

    method = "taylor"

    exact_below: int = option(0, "sequences with fewer real tokens get exact softmax attention (0 = never)")

    def check(self) -> None:
        self.require(self.exact_below >= 0, "exact_below", "a length: 0 (off) or more")


class TaylorFeatures(FeatureMap):
    """phi(x) = [1, x / |x|]: (B, H, n, d) -> (B, H, n, d + 1), so that phi(q) . phi(k) = 1 + q^.k^."""

    def __init__(self, d: int) -> None:
        self.features = d + 1

    def queries(self, x: torch.Tensor, scratch: Scratch) -> torch.Tensor:
        shape = (*x.shape[:-1], self.features)
        buf = scratch("phi", x[..., 0].numel() * self.features)
        if buf is None:
            return torch.cat([x.new_ones(*x.shape[:-1], 1), F.normalize(x, dim=-1, eps=_NORM_EPS)], dim=-1)
        phi = buf.view(shape)
        phi[..., 0] = 1.0
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min_(_NORM_EPS)  # (B, H, n, 1)
        torch.div(x, norm, out=phi[..., 1:])
        return phi

    keys = queries


def cost(config: TaylorConfig, *, n: int, s: int, d: int, dv: int) -> Cost:
    # normalisation: a square-and-add and a division per element
    return _kernelized.cost(n=n, s=s, d=d, dv=dv, features=d + 1, feature_flops=3, exact_below=config.exact_below)


def taylor_weights(q, k, *, key_mask, query_mask, scale, config, state) -> torch.Tensor:
    """The dense (B, H, N, S) matrix (1 + q^_i.k^_j) / normaliser (analysis only)."""
    return _kernelized.weights(
        q,
        k,
        key_mask=key_mask,
        query_mask=query_mask,
        scale=scale,
        fmap=TaylorFeatures(q.shape[-1]),
        floor=_FLOOR,
        exact_below=config.exact_below,
    )


@register(
    "taylor",
    TaylorConfig,
    cost=cost,
    weights=taylor_weights,
    test_options={},  # another kernel: it differs from softmax at any setting
    exact_limit=ExactLimit(kernel="taylor"),
)
def taylor_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    scale: float,
    config: TaylorConfig,
    state: dict[str, torch.Tensor],
    dropout: float = 0.0,
) -> torch.Tensor:
    """Taylor attention (Li et al.): weights 1 + cos(q, k), the first-order expansion of exp on unit vectors."""
    return _kernelized.attend(
        q,
        k,
        v,
        key_mask=key_mask,
        query_mask=query_mask,
        scale=scale,
        fmap=TaylorFeatures(q.shape[-1]),
        floor=_FLOOR,
        exact_below=config.exact_below,
        method="taylor",
        dropout=dropout,
    )  # (B, H, N, dv)
