"""Efficient Attention: softmax over the channels of each query and over the positions of each key channel.

Shen, Zhang, Zhao, Yi, Li, "Efficient Attention: Attention with Linear Complexities", WACV 2021 (arXiv
1812.01243), eq. 4 and its softmax normalisation.

E(Q, K, V) = rho_q(Q) (rho_k(K)^T V): rho_q is a softmax over the d channels of each query, rho_k a softmax of
each key channel over the key positions. The key channels act as d "global context" templates (each a
distribution over positions, summarising V into one row of rho_k(K)^T V) that each query mixes with its own
channel distribution. O(N d dv) time, no N x S matrix.

Choices made here:

* No attention scale: the paper's formulation has none, and s belongs to softmax's exp(s q.k), a product of
  query and key that this method never forms (its two softmaxes act on q and on k separately, so there is no
  single place the scale of the pretrained product maps to). So it is another kernel than softmax, not an
  approximation of it; its exact reference is its own dense formula (``ExactLimit(kernel="efficient")``,
  ``tests/reference.py``). ``scale`` is used only by the exact fallback (``exact_below``). Putting sqrt(s) on
  both q and k instead did worse on MiniLM-L6 zero-shot STS-B in a check during development (not a committed
  result; the committed one, without a scale, is in the docs' Results).
* rho_k is a softmax over the *real* key positions: padded keys get no mass, the maximum subtracted for
  stability and the sum are taken over real keys only (the maximum per channel is tracked online over chunks
  of keys by the shared helper, and each channel's sum divides it once every key is in).
* Computed by the kernelised helper (:mod:`._kernelized`) with features phi(q) = exp(q - max_c q_c) (softmax
  over channels up to its per-row sum) and phi(k) = rho_k(k): the implied matrix rho_q(Q) rho_k(K)^T already
  has rows summing to 1 (sum_j rho_k(K)_jc = 1 for every channel c), so the helper's normaliser phi(q)^T 1 is
  exactly rho_q's softmax sum (at least 1: nothing to floor), and the output is the paper's formula.
  Chunks of keys and queries, padded keys out of every sum, half precision in float32, in place without
  gradients.
* ``weights``: rho_q(Q) rho_k(K)^T is non-negative with rows summing to 1: exposed for analysis.
* ``exact_below``: batch rows with fewer real tokens get exact *softmax* attention (the pretrained model's), 0
  (the default) never.
* Attention dropout is not applied (the matrix it would drop entries of is never formed): a call with
  ``dropout > 0`` (training) warns instead of ignoring it silently.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import MethodConfig, option
from ..registry import Cost, ExactLimit, register
from . import _kernelized
from ._kernelized import FeatureMap, Scratch

_INF = float("inf")
# the normaliser phi(q)^T 1 is at least 1 (the largest channel gives exp(0)): a floor that never acts
_FLOOR = 1e-30


@dataclasses.dataclass(frozen=True)
class EfficientConfig(MethodConfig):
    """Options of Efficient Attention (it has no budget: its cost is fixed by d)."""

    method = "efficient"

    exact_below: int = option(0, "sequences with fewer real tokens get exact softmax attention (0 = never)")

    def check(self) -> None:
        self.require(self.exact_below >= 0, "exact_below", "a length: 0 (off) or more")


class ChannelSoftmaxFeatures(FeatureMap):
    """Queries: exp(q - max_c q_c), (B, H, n, d) (rho_q up to its row sum, which cancels). Keys: exp(k_jc - M_c)
    with M_c the running maximum of channel c over the real keys (padded keys: 0), divided by each channel's sum
    over the real keys once every key is in: rho_k."""

    def __init__(self, d: int) -> None:
        self.features = d

    def queries(self, x: torch.Tensor, scratch: Scratch) -> torch.Tensor:
        top = x.detach().amax(-1, keepdim=True)  # (B, H, n, 1)
        buf = scratch("phi", x.numel())
        if buf is None:
            return (x - top).exp()
        return torch.sub(x, top, out=buf.view(x.shape)).exp_()

    def key_logits(self, x, real, scratch):
        logits = x
        if real is not None:  # padded keys: -inf, out of the maximum and (as exp(-inf) = 0) of every sum
            buf = scratch("phi", x.numel())
            pad = ~real[..., None]  # (B, 1, n, 1)
            logits = x.masked_fill(pad, -_INF) if buf is None else buf.view(x.shape).copy_(x).masked_fill_(pad, -_INF)
        return logits, logits.detach().amax(2)  # (B, H, d): the chunk's maximum of each channel

    def key_features(self, logits, shift, real, scratch):
        buf = scratch("phi", logits.numel())
        if buf is None:
            return (logits - shift[:, :, None, :]).exp()
        return torch.sub(logits, shift[:, :, None, :], out=buf.view(logits.shape)).exp_()

    def key_scale(self, sums: torch.Tensor) -> torch.Tensor:
        return sums.reciprocal()  # each channel's softmax over key positions (sums >= 1: the maximum's exp(0))


def cost(config: EfficientConfig, *, n: int, s: int, d: int, dv: int) -> Cost:
    # softmax features: maximum, subtraction, exp (and the keys' sums): about 4 operations per element
    return _kernelized.cost(n=n, s=s, d=d, dv=dv, features=d, feature_flops=4, exact_below=config.exact_below)


def efficient_weights(q, k, *, key_mask, query_mask, scale, config, state) -> torch.Tensor:
    """The dense (B, H, N, S) matrix rho_q(Q) rho_k(K)^T (analysis only)."""
    return _kernelized.weights(
        q,
        k,
        key_mask=key_mask,
        query_mask=query_mask,
        scale=scale,
        fmap=ChannelSoftmaxFeatures(q.shape[-1]),
        floor=_FLOOR,
        exact_below=config.exact_below,
    )


@register(
    "efficient",
    EfficientConfig,
    cost=cost,
    weights=efficient_weights,
    test_options={},  # another kernel: it differs from softmax at any setting
    exact_limit=ExactLimit(kernel="efficient"),
)
def efficient_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    scale: float,
    config: EfficientConfig,
    state: dict[str, torch.Tensor],
    dropout: float = 0.0,
) -> torch.Tensor:
    """Efficient Attention (Shen et al.): softmax over query channels times softmax over key positions."""
    return _kernelized.attend(
        q,
        k,
        v,
        key_mask=key_mask,
        query_mask=query_mask,
        scale=scale,
        fmap=ChannelSoftmaxFeatures(q.shape[-1]),
        floor=_FLOOR,
        exact_below=config.exact_below,
        method="efficient",
        dropout=dropout,
    )  # (B, H, N, dv)
