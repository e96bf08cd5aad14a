"""Kernelised attention: O = phi(Q) (phi(K)^T [V, 1]) / normaliser, shared by every method whose attention matrix
factors through non-negative features (FAVOR+, linear, Taylor, Efficient Attention). Plain torch.

A method supplies a :class:`FeatureMap` (how the features of a chunk of queries or keys are computed); this
module does the rest, once for all of them:

* The implied matrix A_ij = phi(q_i) . phi(k_j) is never formed: the keys are summarised in chunks into
  phi(K)^T [V, 1], (m, dv + 1) per batch item and head (the value sums, and in the last column the normaliser
  sums), then each chunk of queries reads O_i = phi(q_i)^T S / max(phi(q_i)^T z, floor). Memory beyond the
  inputs and the output: O(chunk * m + m * dv).
* Padded keys are removed: their feature rows are zeroed, so they enter neither the numerator nor the
  normaliser (their value rows too, so that 0 * inf cannot leak).
* Exponential features (FAVOR+'s positive features, Efficient Attention's softmax over keys) are shifted by a
  running maximum of their logits over the real keys, per batch item and head or per feature, tracked online
  across chunks: when a chunk raises it, the sums so far are rescaled by exp(old - new), which equals one
  global shift. A feature map may also rescale each feature's sums once all keys are in (``key_scale``:
  Efficient Attention's softmax over key positions divides each channel by its own sum).
* The normaliser is floored, never added to: rows whose normaliser is at least ``floor`` get the exact
  formula (the implied rows sum to 1), and the normaliser of every query row is returned so that a method can
  treat the rows that fell below it (FAVOR+ gives them exact attention).
* Half precision (float16/bfloat16) is computed, and summed over the sequence, in float32.
* Without gradients every chunk writes its features to scratch memory reused across chunks (fresh pages cost
  more than the arithmetic on them on a CPU), the key summary is accumulated in place and the output is
  written in place; with gradients the same arithmetic runs out of place. On the CPU a batch of short inputs
  then goes a slice of items at a time (``_SLICE_ELEMENTS``), each item's keys and queries being its own, so
  that a chunk's features stay in the cache: the same outputs (to the bit in float32 and half precision; in float64
  the matrix products round the last bit otherwise when the number of rows changes, within 2.2e-16).

:func:`kernel_weights` is the dense (N, S) matrix of the same features, for analysis on short inputs.
:func:`attend`, :func:`weights` and :func:`cost` are a method's attention, weights path and cost model around
them (the exact fallback, the dropout warning): what linear, Taylor and Efficient Attention register.
"""

from __future__ import annotations

import warnings

import torch

from ..registry import Cost
from . import _fallback
from ._common import compute_dtype, exact_rows, exact_weight_rows, safe_key_mask, zero_padded_values
from ._fallback import exact_for_length

__all__ = [
    "FeatureMap",
    "Scratch",
    "attend",
    "cost",
    "kernel_attention",
    "kernel_weights",
    "weights",
    "zero_rows",
]

# Keys and queries are processed in chunks of this many rows: the (rows, m) feature tensors stay small instead
# of (N, m) ones (200 MB each for FAVOR+ at N = 16384, m = 256). On a GPU, where every chunk costs a dozen kernel
# launches, chunks are far larger (512-row chunks make FAVOR+ launch-bound on a GPU).
_CHUNK = 512
_CHUNK_GPU = 16384


def _chunk_rows(x: torch.Tensor) -> int:
    return _CHUNK if x.device.type == "cpu" else _CHUNK_GPU


# Without gradients on the CPU, a batch goes through in slices of items whose chunks hold at most this many feature
# elements ((item, head, row) rows times m; 8 MB in float32), so that a chunk's features stay in the cache: a batch of
# short inputs is otherwise one chunk of every item and head (32 inputs of 128 tokens, 12 heads, FAVOR+'s 256
# features: 50 MB), and every elementwise pass over it goes to memory. Features as small as the head (linear, Taylor,
# Efficient Attention) take slices of many more items: the batches of the Speed page's figures are one slice for
# them (slicing those finer only added calls), larger ones are cut.
_SLICE_ELEMENTS = 1 << 21


def _slice_items(q: torch.Tensor, k: torch.Tensor, features: int) -> int:
    """Batch items per slice in CPU inference (see ``_SLICE_ELEMENTS``; on an accelerator, where a slice is one more
    round of kernel launches, the whole batch); at least one."""
    batch, heads = q.shape[:2]
    if q.device.type != "cpu":
        return max(batch, 1)
    per_item = heads * min(max(q.shape[2], k.shape[2]), _CHUNK) * features
    return max(1, min(batch, _SLICE_ELEMENTS // max(per_item, 1)))


class Scratch:
    """Flat memory lent to the feature maps by name, reused by every chunk of one call (no gradients only).

    ``scratch(name, numel)`` is a flat tensor of ``numel`` elements, or None when gradients are needed (the
    map then computes out of place). Chunks are at most as large as the first one, so each buffer is allocated
    about once per call."""

    def __init__(self, like: torch.Tensor, grad: bool) -> None:
        self.like, self.grad = like, grad
        self._buffers: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, numel: int) -> torch.Tensor | None:
        if self.grad:
            return None
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[name] = self.like.new_empty(numel)
        return buf[:numel]


def zero_rows(phi: torch.Tensor, real: torch.Tensor | None, grad: bool) -> torch.Tensor:
    """``phi`` (B, H, n, m) with the rows of padded keys set to zero; ``real`` (B, 1, n) bool or None."""
    if real is None:
        return phi
    pad = ~real[..., None]  # (B, 1, n, 1)
    return phi.masked_fill(pad, 0.0) if grad else phi.masked_fill_(pad, 0.0)


class FeatureMap:
    """The features phi of one method, computed for a chunk of rows (B, H, n, d) -> (B, H, n, m).

    Subclasses set ``features`` (m) and implement :meth:`queries` and either :meth:`keys` (features that need no
    shift) or :meth:`key_logits` and :meth:`key_features` (exponential features shifted by a running maximum).
    Query features may drop any positive factor constant along a row: it cancels in the normaliser. Where
    ``scratch(name, numel)`` gives memory (no gradients), a map may write its results there and work in place.
    """

    features: int = 0

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Tensors besides q, k, v that the features depend on (for the gradient decision)."""
        return ()

    def queries(self, x: torch.Tensor, scratch: Scratch) -> torch.Tensor:
        """phi(x) of a chunk of queries, (B, H, n, m), up to a positive factor per row."""
        raise NotImplementedError

    def keys(self, x: torch.Tensor, scratch: Scratch) -> torch.Tensor:
        """phi(x) of a chunk of keys, (B, H, n, m) (padded rows are zeroed by the caller)."""
        raise NotImplementedError

    def key_logits(
        self, x: torch.Tensor, real: torch.Tensor | None, scratch: Scratch
    ) -> tuple[object, torch.Tensor | None]:
        """The features of a chunk of keys, with the rows of padded keys (``real`` (B, 1, n) False) zero, and
        None; or, for shifted features, what :meth:`key_features` needs and the chunk's largest logit over its
        real keys, (B, H, G) with G = 1 (one shift per batch item and head) or G = m (one per feature); -inf
        where the chunk has no real key."""
        return zero_rows(self.keys(x, scratch), real, scratch.grad), None

    def key_features(
        self, pre: object, shift: torch.Tensor, real: torch.Tensor | None, scratch: Scratch
    ) -> torch.Tensor:
        """exp(logits - shift) of the chunk, (B, H, n, m), with padded rows zero; ``shift`` (B, H, G), finite."""
        raise NotImplementedError

    def key_scale(self, sums: torch.Tensor) -> torch.Tensor | None:
        """A factor per feature (B, H, m) applied to phi(K) once every key is in (``sums``: phi(K)^T 1, (B, H, m)),
        or None."""
        return None


def _key_summary(k, v, real_mask, fmap: FeatureMap, scratch: Scratch) -> torch.Tensor:
    """phi(K)^T [V, 1] over the real keys, (B*H, m, dv + 1), accumulated over chunks of keys.

    phi(K)^T V and phi(K)^T 1 are summed apart: a (m, n) x (n, dv) product is about 10 % faster on CPU than one
    with a column of ones appended (dv + 1 = 65 columns), more than the extra pass over phi costs."""
    batch, heads, s, _ = k.shape
    bh, dv, m, grad = batch * heads, v.shape[-1], fmap.features, scratch.grad
    values = k.new_zeros(bh, m, dv)  # phi(K)^T V
    norms = k.new_zeros(bh, m)  # phi(K)^T 1
    top = None  # running maximum of the key logits, (B, H, G); -inf until a real key comes
    rows = min(s, _chunk_rows(k))
    for start in range(0, s, rows):
        kc, vc = k[:, :, start : start + rows], v[:, :, start : start + rows]
        n = kc.shape[2]
        real = None if real_mask is None else real_mask[:, None, start : start + rows]  # (B, 1, n)
        pre, chunk_max = fmap.key_logits(kc, real, scratch)
        if chunk_max is None:
            phi = pre
        else:
            new_top = chunk_max if top is None else torch.maximum(top, chunk_max)
            shift = torch.where(torch.isinf(new_top), torch.zeros_like(new_top), new_top)  # finite
            if top is not None:  # exp(-inf - shift) = 0: no real key before, the sums are zero anyway
                rescale = torch.exp(top - shift).view(bh, -1)  # (B*H, G)
                values = values * rescale[..., None] if grad else values.mul_(rescale[..., None])
                norms = norms * rescale if grad else norms.mul_(rescale)
            top = new_top
            phi = fmap.key_features(pre, shift, real, scratch)
        if real is not None:  # padded values to zero too, so that 0 * (huge or inf) never leaks
            vc = vc.masked_fill(~real[..., None], 0.0)
        phi = phi.reshape(bh, n, m)
        vc = vc.reshape(bh, n, dv)
        if grad:
            values = torch.baddbmm(values, phi.transpose(1, 2), vc)
            norms = norms + phi.sum(1)
        else:
            values.baddbmm_(phi.transpose(1, 2), vc)
            norms += phi.sum(1)
    scale = fmap.key_scale(norms.view(batch, heads, m))
    if scale is not None:
        scale = scale.reshape(bh, m)
        values, norms = values * scale[..., None], norms * scale
    return torch.cat([values, norms[..., None]], dim=-1)  # (B*H, m, dv + 1)


def kernel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    fmap: FeatureMap,
    *,
    floor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """phi(Q) (phi(K)^T V) / max(phi(Q) (phi(K)^T 1), floor) over the real keys, chunked.

    q (B, H, N, d), k (B, H, S, d), v (B, H, S, dv), key_mask (B, S) bool (True = real) or None. ``fmap`` works
    in the compute dtype (float32 for half inputs). Returns the output (B, H, N, dv) in q's dtype and the
    normaliser phi(q_i)^T z of every query row (B, H, N) in the compute dtype, before the floor.
    """
    dt = compute_dtype(q.dtype)
    key_mask = safe_key_mask(key_mask)
    if key_mask is not None and key_mask.shape[0] != q.shape[0]:  # one (1, S) mask for the batch: a row per slice
        key_mask = key_mask.expand(q.shape[0], -1)
    out_dtype = q.dtype
    # padded keys zeroed: a feature map removes them with a -inf shift or a mask, which an inf (or a projection
    # that overflows) in a padded key would turn into NaN in every real row
    q, k, v = q.to(dt), zero_padded_values(k.to(dt), key_mask), v.to(dt)
    # without gradients the features and the output are written in place (out= has no autograd)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *fmap.tensors()))
    scratch = Scratch(q, grad)
    batch, heads, n_q, _ = q.shape
    dens = q.new_empty(batch, heads, n_q)  # (B, H, N)
    if grad:
        out = _attend_items(q, k, v, key_mask, fmap, floor, scratch, None, dens)
    else:  # in place, a slice of batch items at a time (each item's keys and queries are its own)
        out = q.new_empty(batch, heads, n_q, v.shape[-1])  # (B, H, N, dv)
        step = _slice_items(q, k, fmap.features)
        for b0 in range(0, batch, step):
            items = slice(b0, b0 + step)
            mask = None if key_mask is None else key_mask[items]
            _attend_items(q[items], k[items], v[items], mask, fmap, floor, scratch, out[items], dens[items])
    return out.to(out_dtype), dens


def _attend_items(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    fmap: FeatureMap,
    floor: float,
    scratch: Scratch,
    out: torch.Tensor | None,
    dens: torch.Tensor,
) -> torch.Tensor:
    """:func:`kernel_attention` of some batch items, in the compute dtype: the output (B, H, N, dv), written into
    ``out`` without gradients (None: a new tensor, with autograd), and the normaliser of every query row into
    ``dens`` (B, H, N)."""
    summary = _key_summary(k, v, key_mask, fmap, scratch)  # (B*H, m, dv + 1)
    batch, heads, n_q, _ = q.shape
    bh, m, dv = batch * heads, fmap.features, v.shape[-1]
    outs = []
    rows = min(n_q, _chunk_rows(q))
    for start in range(0, n_q, rows):  # chunks of queries: phi(Q) S / phi(Q) z
        phi = fmap.queries(q[:, :, start : start + rows], scratch)
        n = phi.shape[2]
        phi = phi.reshape(bh, n, m)
        buf = scratch("both", bh * n * (dv + 1))
        both = phi @ summary if buf is None else torch.bmm(phi, summary, out=buf.view(bh, n, dv + 1))
        both = both.view(batch, heads, n, dv + 1)  # numerator | normaliser
        dens[:, :, start : start + n] = both[..., dv].detach()
        den = both[..., dv:].clamp_min(floor)
        if out is None:
            outs.append(both[..., :dv] / den)
        else:
            torch.div(both[..., :dv], den, out=out[:, :, start : start + n])
    return torch.cat(outs, dim=2) if out is None else out


def kernel_weights(
    q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None, fmap: FeatureMap, *, floor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense matrix the features imply, A_ij / max(sum_j A_ij, floor) with A_ij = phi(q_i) . phi(k_j) over the
    real keys: (B, H, N, S) in the compute dtype, and the normaliser of every row (B, H, N). All keys are one
    chunk here (analysis on short inputs: O(N S) memory by construction)."""
    dt = compute_dtype(q.dtype)
    key_mask = safe_key_mask(key_mask)
    q, k = q.to(dt), k.to(dt)
    scratch = Scratch(q, grad=True)  # out of place: nothing is written over
    real = None if key_mask is None else key_mask[:, None, :]  # (B, 1, S)
    pre, top = fmap.key_logits(k, real, scratch)
    if top is None:
        phi_k = pre
    else:
        phi_k = fmap.key_features(pre, torch.where(torch.isinf(top), torch.zeros_like(top), top), real, scratch)
    scale = fmap.key_scale(phi_k.sum(-2))
    if scale is not None:
        phi_k = phi_k * scale[..., None, :]
    a = fmap.queries(q, scratch) @ phi_k.transpose(-1, -2)  # (B, H, N, S)
    den = a.sum(-1)
    return a / den[..., None].clamp_min(floor), den


# ------------------------------------------------------------------------------- a method's entry points


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    scale: float,
    fmap: FeatureMap,
    floor: float,
    exact_below: int,
    method: str,
    dropout: float = 0.0,
) -> torch.Tensor:
    """A kernelised method's attention (B, H, N, dv): :func:`kernel_attention` through the shared fallback
    (batch rows with fewer than ``exact_below`` real tokens get exact softmax attention at ``scale``).
    Attention dropout is not applied (the matrix it would drop entries of is never formed): ``dropout > 0``
    warns instead of being ignored silently."""
    if dropout > 0.0:
        warnings.warn(
            f"{method}: attention dropout is not applied (kernelised attention never forms the attention matrix "
            "to drop entries of); the model trains without it",
            RuntimeWarning,
            stacklevel=4,
        )

    exact = exact_rows(q, k, v, key_mask, scale)

    def approximate() -> torch.Tensor:
        return kernel_attention(q, k, v, key_mask, fmap, floor=floor)[0]

    return _fallback.with_fallback(
        approximate,
        exact,
        query_mask=query_mask,
        shape=(q.shape[0], q.shape[-2]),
        device=q.device,
        exact_below=exact_below,
    )


def weights(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    key_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    scale: float,
    fmap: FeatureMap,
    floor: float,
    exact_below: int,
) -> torch.Tensor:
    """The dense (B, H, N, S) matrix of :func:`attend`: the features' rows, exact softmax rows where it falls
    back."""
    dt = compute_dtype(q.dtype)

    exact = exact_weight_rows(q, k, key_mask, scale, dt)

    def approximate() -> torch.Tensor:
        return kernel_weights(q, k, key_mask, fmap, floor=floor)[0]

    return _fallback.with_fallback(
        approximate,
        exact,
        query_mask=query_mask,
        shape=(q.shape[0], q.shape[-2]),
        device=q.device,
        exact_below=exact_below,
    )


def cost(*, n: int, s: int, d: int, dv: int, features: int, feature_flops: int, exact_below: int) -> Cost:
    """Cost of :func:`attend` per batch item and head with m = ``features`` features costing ``feature_flops``
    per input element (q and k): approx's full count (features, phi(K)^T [V, 1], phi(Q) times it, the division)
    and the literature's matrix-product count phi(K)^T V and phi(Q) (phi(K)^T V), the normaliser's
    matrix-vector products excluded like softmax's row sums. Exact softmax where it falls back."""
    if exact_for_length(n, exact_below=exact_below):
        return Cost(flops=2 * n * s * (d + dv), qk_pairs=n * s, matmul_macs=n * s * (d + dv))
    m = features
    flops = feature_flops * (n + s) * d + 2 * (n + s) * m * (dv + 1) + n * dv
    return Cost(flops=flops, qk_pairs=0, matmul_macs=(n + s) * m * dv)
