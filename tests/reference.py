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


# The kernels' formulas take ``dtype`` (float64 unless told): the same textbook computation in float32 is the
# "plain float32" error that tolerances of other precisions are measured against.


def _normalised_kernel_attention(sim, v, key_mask):
    """sum_j sim_ij v_j / sum_j sim_ij over the real keys, for a non-negative kernel matrix sim (B, H, N, S)."""
    if key_mask is not None:
        sim = sim * key_mask[:, None, None, :].to(sim.dtype)
    return torch.einsum("bhns,bhsd->bhnd", sim, v.to(sim.dtype)) / sim.sum(-1, keepdim=True)


def linear_kernel_attention(q, k, v, key_mask=None, scale=None, dtype=torch.float64):
    """Katharopoulos et al. 2020 (arXiv 2006.16236), eqs. 4-7: sim(q, k) = phi(q)^T phi(k) with
    phi(x) = elu(x) + 1, i.e. x + 1 for x > 0 and exp(x) otherwise; no scale. (B, H, N, d) -> (B, H, N, dv)."""
    q, k = q.to(dtype), k.to(dtype)

    def phi(x):
        return torch.where(x > 0, x + 1.0, torch.exp(x))

    return _normalised_kernel_attention(torch.einsum("bhnc,bhsc->bhns", phi(q), phi(k)), v, key_mask)


def efficient_kernel_attention(q, k, v, key_mask=None, scale=None, dtype=torch.float64):
    """Shen et al. (arXiv 1812.01243), eq. 4 with softmax normalisation: E = rho_q(Q) (rho_k(K)^T V), rho_q a
    softmax over each query's channels, rho_k a softmax of each key channel over the real key positions; no scale."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    rho_q = torch.exp(q) / torch.exp(q).sum(-1, keepdim=True)  # (B, H, N, d)
    if key_mask is not None:
        k = k.masked_fill(~key_mask[:, None, :, None], float("-inf"))  # exp(-inf) = 0: padded keys get no mass
    ek = torch.exp(k - k.amax(dim=-2, keepdim=True))  # (B, H, S, d); a common factor per channel cancels
    rho_k = ek / ek.sum(-2, keepdim=True)
    context = torch.einsum("bhsc,bhse->bhce", rho_k, v)  # (B, H, d, dv): rho_k(K)^T V
    return torch.einsum("bhnc,bhce->bhne", rho_q, context)


def taylor_kernel_attention(q, k, v, key_mask=None, scale=None, dtype=torch.float64):
    """Li et al. (arXiv 2007.14902), eqs. 9-12: exp(q.k) ~ 1 + q^.k^ with q^ = q / |q|, k^ = k / |k|, normalised
    over the real keys: O_i = (sum_j v_j + q^_i^T sum_j k^_j v_j^T) / (n + q^_i^T sum_j k^_j); no scale."""
    q, k = q.to(dtype), k.to(dtype)
    qh = q / torch.sqrt((q * q).sum(-1, keepdim=True))
    kh = k / torch.sqrt((k * k).sum(-1, keepdim=True))
    return _normalised_kernel_attention(1.0 + torch.einsum("bhnc,bhsc->bhns", qh, kh), v, key_mask)


# Float64 formulas of the attention kernels that are not softmax (``ExactLimit.kernel``): name ->
# f(q, k, v, key_mask, scale) -> (B, H, N, dv). Each is the paper's formula written out densely.
KERNEL_ATTENTION = {
    "linear": linear_kernel_attention,
    "efficient": efficient_kernel_attention,
    "taylor": taylor_kernel_attention,
}
