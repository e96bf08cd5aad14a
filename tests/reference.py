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


def favor_estimate(q, k, v, omega, key_mask=None, scale=None, hyperbolic=True):
    """The FAVOR+ estimate in float64, from its definition and in log space (nothing underflows):
    A_ij = sum_f phi_f(q_i) phi_f(k_j), phi_f(x) = exp(+-w_f.x~ - |x~|^2 / 2) / sqrt(m), x~ = sqrt(scale) x;
    out = A V / A 1 over the real keys. (B, H, N, d) -> (B, H, N, dv); keep N * S * m small."""
    q, k, v, omega = q.double(), k.double(), v.double(), omega.double()
    scale = q.shape[-1] ** -0.5 if scale is None else scale

    def log_features(x):
        x = x * scale**0.5
        proj = torch.einsum("bhnd,md->bhnm", x, omega)
        if hyperbolic:
            proj = torch.cat([proj, -proj], dim=-1)
        return proj - 0.5 * (x * x).sum(-1, keepdim=True) - 0.5 * torch.log(torch.tensor(float(proj.shape[-1])))

    lq, lk = log_features(q), log_features(k)
    log_a = torch.logsumexp(lq[:, :, :, None, :] + lk[:, :, None, :, :], dim=-1)  # (B, H, N, S)
    if key_mask is not None:
        log_a = log_a.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return torch.einsum("bhns,bhsd->bhnd", torch.softmax(log_a, dim=-1), v)


# Float64 formulas of the attention kernels that are not softmax (``ExactLimit.kernel``): name ->
# f(q, k, v, key_mask, scale) -> (B, H, N, dv). Each is the paper's formula written out densely.
KERNEL_ATTENTION = {}
