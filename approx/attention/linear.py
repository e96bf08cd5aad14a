"""Linear attention with the elu + 1 feature map (the linear transformer).

Katharopoulos, Vyas, Pappas, Fleuret, "Transformers are RNNs: Fast Autoregressive Transformers with Linear
Attention", ICML 2020 (arXiv 2006.16236), eqs. 4-7.

Attention with the kernel sim(q, k) = phi(q) . phi(k), phi(x) = elu(x) + 1 (positive, so every weight is too):
O_i = phi(q_i)^T S / phi(q_i)^T z, S = sum_j phi(k_j) v_j^T, z = sum_j phi(k_j), sums over the real keys only.
O(N d dv) time, no N x S matrix.

Choices made here:

* This is another kernel than softmax, not an approximation of it: phi is applied to q and k as they come,
  without the attention scale s (the paper's definition; the scale belongs to softmax's exp(s q.k), and
  putting it into phi would change this kernel, not bring it closer to softmax). A pretrained softmax model
  therefore changes behaviour when patched (zero-shot it collapses: 5.5 SQuAD F1 in the MonarchAttention
  paper's figure); fine-tuning adapts it. Its exact reference is this kernel's own dense formula
  (``ExactLimit(kernel="linear")``, ``tests/reference.py``), not softmax.
* ``eps`` floors the normaliser, max(phi(q_i)^T z, eps), where the paper's code adds it (phi(q_i)^T z + eps):
  wherever the normaliser is at least eps the output is the paper's formula exactly and the implied rows sum
  to 1 (the sum differs from the additive form by a relative eps / (phi(q_i)^T z), negligible). As phi > 0
  the normaliser only falls below eps when every channel of a query is very negative (elu(x) + 1 = e^x, which
  underflows in float32 below x = -87): such rows get a small output instead of 0 / 0.
* The computation is the one shared by every kernelised method (:mod:`._kernelized`): chunks of keys and of
  queries, the feature rows of padded keys zeroed (out of S and z), half precision computed and summed in
  float32, in place without gradients.
* ``weights``: the implied matrix phi(q_i) . phi(k_j) / normaliser is non-negative with rows summing to 1:
  exposed for analysis.
* ``exact_below``: batch rows with fewer real tokens get exact *softmax* attention (the pretrained model's), 0
  (the default) never.
* Attention dropout is not applied (the matrix it would drop entries of is never formed): a call with
  ``dropout > 0`` (training) warns instead of ignoring it silently.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..config import MethodConfig, option
from ..registry import Cost, ExactLimit, register
from . import _kernelized
from ._kernelized import FeatureMap, Scratch


@dataclasses.dataclass(frozen=True)
class LinearConfig(MethodConfig):
    """Options of linear attention (elu + 1 features)."""

    method = "linear"

    eps: float = option(1e-6, "floor of the normaliser phi(q)^T z (the paper's code adds 1e-6 to it instead)")
    exact_below: int = option(0, "sequences with fewer real tokens get exact softmax attention (0 = never)")

    def check(self) -> None:
        self.require(self.eps > 0 and math.isfinite(self.eps), "eps", "a positive finite floor (0 gives 0 / 0)")
        self.require(self.exact_below >= 0, "exact_below", "a length: 0 (off) or more")


class EluFeatures(FeatureMap):
    """phi(x) = elu(x) + 1, elementwise: (B, H, n, d) -> (B, H, n, d)."""

    def __init__(self, d: int) -> None:
        self.features = d

    def queries(self, x: torch.Tensor, scratch: Scratch) -> torch.Tensor:
        # elu(x) + 1 = exp(min(x, 0)) + max(x, 0): about 25 % faster on CPU than elu_ then add_, and exact where
        # elu(x) + 1 cancels (x = -30: -1 + 9e-14 in float64 keeps 3 digits; below about -17 float32 gives 0)
        buf = scratch("phi", x.numel())
        if buf is None:  # out of place (gradients, the dense weights)
            return torch.clamp(x, max=0.0).exp() + x.relu()
        return torch.clamp(x, max=0.0, out=buf.view(x.shape)).exp_().add_(x.relu())

    keys = queries


def cost(config: LinearConfig, *, n: int, s: int, d: int, dv: int) -> Cost:
    # elu + 1: about 3 operations per element (compare, exp, add)
    return _kernelized.cost(n=n, s=s, d=d, dv=dv, features=d, feature_flops=3, exact_below=config.exact_below)


def linear_weights(q, k, *, key_mask, query_mask, scale, config, state) -> torch.Tensor:
    """The dense (B, H, N, S) matrix phi(q_i) . phi(k_j) / normaliser (analysis only)."""
    fmap = EluFeatures(q.shape[-1])
    return _kernelized.weights(
        q,
        k,
        key_mask=key_mask,
        query_mask=query_mask,
        scale=scale,
        fmap=fmap,
        floor=config.eps,
        exact_below=config.exact_below,
    )


@register(
    "linear",
    LinearConfig,
    cost=cost,
    weights=linear_weights,
    test_options={},  # another kernel: it differs from softmax at any setting
    exact_limit=ExactLimit(kernel="linear"),
)
def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    scale: float,
    config: LinearConfig,
    state: dict[str, torch.Tensor],
    dropout: float = 0.0,
) -> torch.Tensor:
    """Linear attention (linear transformer): the kernel (elu(q) + 1) . (elu(k) + 1) instead of softmax."""
    return _kernelized.attend(
        q,
        k,
        v,
        key_mask=key_mask,
        query_mask=query_mask,
        scale=scale,
        fmap=EluFeatures(q.shape[-1]),
        floor=config.eps,
        exact_below=config.exact_below,
        method="linear",
        dropout=dropout,
    )  # (B, H, N, dv)
