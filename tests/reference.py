"""Independent float64 references: plain textbook formulas, sharing no code with approx."""

import torch


def naive_attention(q, k, v, key_mask=None, scale=None):
    """softmax(scale * q k^T + log m) v in float64, shapes (B, H, N, d) -> (B, H, N, dv)."""
    q, k, v = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bhnd,bhsd->bhns", q, k) * scale
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return torch.einsum("bhns,bhsd->bhnd", torch.softmax(scores, dim=-1), v)


def naive_weights(q, k, key_mask=None, scale=None):
    q, k = q.double(), k.double()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bhnd,bhsd->bhns", q, k) * scale
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1)
