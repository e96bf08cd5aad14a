"""Locality-sensitive hashing of queries and integer hashing, the front half of clustered attention
(``clustered.py``, ``iclustered.py``; plain torch).

Bit b of the code of query q is ``[q . a_b >= beta_b]``: random planes a_b ~ N(0, I) with the bias
``beta_b = mean_b + std_b * u_b``, u_b ~ N(0, 1), where mean_b and std_b are the mean and standard deviation
of ``q . a_b`` over the real queries of that sequence and head. Each hyperplane cuts through the query cloud
at a random place, so Hamming distance between codes tracks Euclidean distance between queries (a fixed bias
of unknown scale would leave most bits constant). :func:`hash_ints` gives pseudo-random values that depend on
integer coordinates only, never on the padded length of a batch.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def hash_signs(
    q: torch.Tensor, planes: torch.Tensor, offsets: torch.Tensor, query_mask: torch.Tensor | None
) -> torch.Tensor:
    """The LSH code of every query as +-1 values with a trailing +1: (B, H, N, d) -> (B, H, N, bits + 1) float32.

    Bit b is +1 where ``q . a_b - beta_b >= 0``. The mean and variance of ``q . a_b`` over the real queries
    come from the mean and covariance of the queries (a (d, d) product per head), so the codes take a single
    (N, d) x (d, bits + 1) product with the thresholds as its bias, and one sign pass in place. The trailing
    column (a zero plane with threshold -1) is the one that K-means needs next to the code.
    """
    qf = q.detach().float()  # codes carry no gradient
    nbits = planes.shape[0]
    if query_mask is None:
        count = torch.full((), qf.shape[2], dtype=torch.float32, device=q.device)
        real = qf
    else:  # padded queries (whatever their values) out of the statistics
        count = query_mask.sum(-1).clamp_min(1).float()[:, None, None]  # (B, 1, 1)
        real = qf.masked_fill(~query_mask[:, None, :, None], 0.0)
    mean = real.sum(2) / count  # (B, H, d)
    # E[q q^T] - mean mean^T: float32 loses about eps * |mean|^2 / var of the variance, far below what moves
    # a random threshold
    cov = (real.transpose(-1, -2) @ real) / count[..., None] - mean[..., :, None] * mean[..., None, :]
    a = planes.float()
    proj_mean = mean @ a.t()  # (B, H, bits)
    proj_std = ((a @ cov) * a).sum(-1).clamp_min(0.0).sqrt()  # sqrt(a_b^T cov a_b), (B, H, bits)
    threshold = proj_mean + proj_std * offsets.float()
    bias = torch.cat([-threshold, threshold.new_ones(*threshold.shape[:-1], 1)], dim=-1)  # (B, H, bits + 1)
    a = torch.cat([a, a.new_zeros(1, a.shape[1])])  # (bits + 1, d)
    batch, heads, n, d = qf.shape
    proj = torch.baddbmm(
        bias.reshape(batch * heads, 1, nbits + 1),
        qf.reshape(batch * heads, n, d),
        a.t().expand(batch * heads, d, nbits + 1),
    )
    return torch.copysign(torch.ones((), device=q.device), proj, out=proj).view(batch, heads, n, nbits + 1)


def hash_queries(
    q: torch.Tensor, planes: torch.Tensor, offsets: torch.Tensor, query_mask: torch.Tensor | None
) -> torch.Tensor:
    """Bits of the LSH code of every query: (B, H, N, d) -> (B, H, N, bits) bool (see :func:`hash_signs`)."""
    return hash_signs(q, planes, offsets, query_mask)[..., :-1] > 0


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """(..., B) bool -> (...,) int64 code, B <= 63: eight bits to a byte, eight bytes viewed as one int64.

    Only equality of codes is used, so the byte order does not matter; working in uint8 moves an eighth of
    the memory that int64 shifts would.
    """
    lead, nbits = bits.shape[:-1], bits.shape[-1]
    padded = torch.nn.functional.pad(bits.to(torch.uint8), (0, 64 - nbits))  # (..., 64)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=bits.device)
    packed = (padded.view(*lead, 8, 8) * weights).sum(-1, dtype=torch.uint8)  # (..., 8) bytes
    return packed.view(torch.int64).view(lead)


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
