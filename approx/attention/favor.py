"""FAVOR+: Fast Attention Via positive Orthogonal Random features (Performer).

Choromanski et al., "Rethinking Attention with Performers", ICLR 2021 (arXiv 2009.14794).

The softmax kernel is an expectation over random features: with x~ = sqrt(s) x (s the attention scale),
exp(s q.k) = E_w[phi(q~) . phi(k~)] for the positive features
phi(x) = exp(-|x|^2 / 2) / sqrt(m) [exp(w_1.x), ..., exp(w_m.x)], w_i ~ N(0, I). Attention then needs no
N x S matrix: O = D^-1 phi(Q) (phi(K)^T V), D = diag(phi(Q) phi(K)^T 1), O(N m d) time and memory.

Choices made here:

* The directions w are state: drawn once per layer from the seed, kept as a buffer (saved with the model),
  redrawn only on request (``approx.redraw``). ``orthogonal=True`` stacks blocks of d exactly orthogonal
  directions (Q factors of Gaussian matrices) with chi_d-distributed norms, which lowers the variance.
* ``hyperbolic=True`` uses m/2 directions and their negatives, phi(x) ~ [exp(w.x), exp(-w.x)] (the
  "FAVOR+ with hyperbolic cosine" estimator), so the cost is the same m features. It is the default because
  it gives the lower error where the estimator is in its useful range, on random inputs with |x~|^2 ~ 1
  (``tests/test_favor.py::test_hyperbolic_default_is_the_more_accurate`` checks it).
* Stability: the query factor exp(-|q~|^2/2) and a per-query maximum of w.q~ are constants of each output
  row, so they cancel in D^-1 and are dropped / subtracted before exp; for keys one maximum over all real
  keys of a (batch, head) is subtracted, tracked online while keys are summed in chunks (so no (N, m)
  feature tensor is ever held whole: memory O(chunk * m + m * dv) beyond inputs). Nothing overflows in
  float16/bfloat16 (computed in float32). Where D still falls below ``stabilizer`` (large-norm inputs,
  where one key's features dwarf the others'), the row's estimate is lost to underflow: such query rows get
  exact attention (:func:`._fallback.replace_query_rows`, counted in ``_fallback.counts()`` and warned
  about), never the zeros a floored D would give.
* Speed: every head of a layer shares the directions, so the feature projections of a chunk are one plain
  (B*H*n, d) x (d, m') product (about twice as fast on CPU as a batched one). Hyperbolic features project on
  the m/2 directions only and get the -w half from an elementwise pass; the key norm, the stabilising maximum
  and padding (-inf) are one per-row shift; without gradients the projections and features of every chunk go
  to one scratch buffer per call, phi(K)^T V is accumulated in place and the output is written in place.
* Padding: the feature rows of padded keys are zeroed, so they enter neither the numerator nor the
  normaliser D (both reference implementations only zero the values, so padding changed real outputs).
* ``exact_below``: batch rows with fewer real tokens than this get exact attention (0, the default, never:
  measurements at short lengths then measure the approximation, not the fallback; see :mod:`._fallback`).
* ``kernel="relu"``: the generalised kernel phi(x) = ReLU(w.x) + relu_eps of the Performer paper.
* Attention dropout is not applied: dropping entries of the implicit N x S matrix needs that matrix, and
  dropping keys or features instead is a different regulariser. A call with ``dropout > 0`` (training)
  warns once instead of ignoring it silently.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch

from ..config import MethodConfig, option
from ..registry import Cost, ExactLimit, register
from . import _fallback
from ._common import compute_dtype, dense_softmax, exact_attention, safe_key_mask, zero_padded_values
from ._fallback import exact_for_length

KERNELS = ("softmax", "relu")
_MAX_RELU_EPS = 1e6


@dataclasses.dataclass(frozen=True)
class FavorConfig(MethodConfig):
    """Options of FAVOR+ attention."""

    method = "favor"

    features: int = option(256, "random features m (Google's default 256; d ln d = 266 for d = 64)")
    kernel: str = option("softmax", "'softmax': positive features estimating exp(s q.k); 'relu': ReLU(w.x) + eps")
    orthogonal: bool = option(True, "draw the directions in exactly orthogonal blocks (lower variance than i.i.d.)")
    hyperbolic: bool = option(True, "use m/2 directions and their negatives (+-w): lower error at the same cost")
    stabilizer: float = option(1e-12, "floor of the normaliser D; acts only if every feature of a row underflows")
    relu_eps: float = option(1e-3, "eps added to the relu kernel's features (the Performer code's default)")
    seed: int = option(0, "seed of the random directions")
    exact_below: int = option(
        0,
        "sequences with fewer real tokens get exact attention (0 = never; set it to the measured crossover for "
        "speed: see the docs' Speed page)",
    )

    def check(self) -> None:
        self.require(self.features >= 1, "features", "need at least one random feature")
        self.require(self.kernel in KERNELS, "kernel", f"unknown kernel; choose one of {', '.join(map(repr, KERNELS))}")
        self.require(
            not (self.hyperbolic and self.kernel == "softmax" and self.features % 2),
            "features",
            "hyperbolic features come in +-w pairs, so features must be even (or set hyperbolic=False)",
        )
        for name in ("stabilizer", "relu_eps"):
            value = getattr(self, name)
            self.require(value >= 0 and math.isfinite(value), name, "must be a finite non-negative number")
        self.require(self.stabilizer > 0, "stabilizer", "D is divided by max(D, stabilizer): 0 gives 0 / 0 = NaN")
        if self.kernel == "relu":
            self.require(
                self.relu_eps > 0,
                "relu_eps",
                "the relu kernel needs eps > 0: a query with every ReLU(w.x) = 0 has D = 0 (0 / 0 = NaN)",
            )
            self.require(
                self.relu_eps <= _MAX_RELU_EPS,
                "relu_eps",
                f"at most {_MAX_RELU_EPS:g}: D sums m * S products of features >= eps, which overflow float32 "
                "(inf / inf = NaN)",
            )
        self.require(self.seed >= 0, "seed", "seeds are non-negative integers")
        self.require(self.exact_below >= 0, "exact_below", "a length: 0 (off) or more")

    @property
    def directions(self) -> int:
        """Number of random directions w drawn (half the features for hyperbolic softmax features)."""
        return self.features // 2 if self.hyperbolic and self.kernel == "softmax" else self.features


def random_directions(m: int, d: int, *, orthogonal: bool, generator: torch.Generator) -> torch.Tensor:
    """(m, d) directions: i.i.d. N(0, I) rows, or blocks of d orthogonal rows with chi_d-distributed norms."""
    if not orthogonal:
        return torch.randn(m, d, generator=generator)
    blocks = []
    for _ in range(-(-m // d)):  # ceil(m / d) blocks of d orthonormal rows
        q, _ = torch.linalg.qr(torch.randn(d, d, generator=generator))
        blocks.append(q.t())
    norms = torch.randn(m, d, generator=generator).norm(dim=-1, keepdim=True)  # chi_d
    return torch.cat(blocks)[:m] * norms


def init_state(config: FavorConfig, *, head_dim: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"omega": random_directions(config.directions, head_dim, orthogonal=config.orthogonal, generator=g)}


def cost(config: FavorConfig, *, n: int, s: int, d: int, dv: int) -> Cost:
    if exact_for_length(n, exact_below=config.exact_below):
        return Cost(flops=2 * n * s * (d + dv), qk_pairs=n * s, matmul_macs=n * s * (d + dv))
    m = config.features
    features = 2 * (n + s) * config.directions * d
    # matrix products: the feature projections (w.x for every query and key) and phi(Q) (phi(K)^T V)
    macs = (n + s) * config.directions * d + (n + s) * m * dv
    return Cost(flops=features + 2 * s * m * (dv + 1) + 2 * n * m * (dv + 1), qk_pairs=0, matmul_macs=macs)


def softmax_features(
    x: torch.Tensor,
    omega: torch.Tensor,
    scale: float,
    *,
    hyperbolic: bool,
    stabilize: str | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Positive random features of the softmax kernel, (B, H, N, d) -> (B, H, N, m).

    Without ``stabilize`` they are the unbiased estimator: E[phi(q) . phi(k)] = exp(scale q.k).
    ``stabilize="query"`` drops the per-row constant exp(-|x|^2/2) / sqrt(m) and subtracts the row maximum;
    ``stabilize="key"`` subtracts one maximum over the real rows (``mask``) of each (batch, head). Both
    are constant factors that cancel in the attention normaliser, so they carry no gradient.
    """
    if stabilize == "query":
        proj = x @ (omega * math.sqrt(scale)).t()  # (B, H, N, m'): w . x~ with x~ = sqrt(s) x
        if hyperbolic:
            proj = torch.cat([proj, -proj], dim=-1)
        return proj.sub_(proj.detach().amax(-1, keepdim=True)).exp_()
    logits = _softmax_logits(x, omega, scale, hyperbolic)  # (B, H, N, m)
    shift = 0.5 * math.log(logits.shape[-1])  # the 1 / sqrt(m)
    if stabilize == "key":
        row_max = logits.detach().amax(-1)  # (B, H, N)
        if mask is not None:
            row_max = row_max.masked_fill(~mask[:, None, :], float("-inf"))
        shift = shift + row_max.amax(-1)[..., None, None]
    elif stabilize is not None:
        raise ValueError(f"stabilize must be None, 'query' or 'key', got {stabilize!r}")
    return logits.sub_(shift).exp_()


def relu_features(x: torch.Tensor, omega: torch.Tensor, scale: float, eps: float) -> torch.Tensor:
    """Generalised-kernel features ReLU(w.x~) + eps, (B, H, N, d) -> (B, H, N, m)."""
    return torch.relu(x @ (omega * math.sqrt(scale)).t()) + eps


def _features(q, k, key_mask, scale, config, omega):
    if config.kernel == "relu":
        phi_q, phi_k = (relu_features(x, omega, scale, config.relu_eps) for x in (q, k))
    else:
        phi_q = softmax_features(q, omega, scale, hyperbolic=config.hyperbolic, stabilize="query")
        phi_k = softmax_features(k, omega, scale, hyperbolic=config.hyperbolic, stabilize="key", mask=key_mask)
    if key_mask is not None:
        phi_k = phi_k * key_mask[:, None, :, None]  # padded keys: out of the numerator and of D
    return phi_q, phi_k


# Keys and queries are processed in chunks of this many rows: the (rows, m) feature tensors stay small and
# hot in cache instead of two (N, m) tensors (200 MB each at N = 16384, m = 256). On a GPU, where every chunk
# costs a dozen kernel launches, chunks are far larger (512-row chunks make FAVOR+ launch-bound on a GPU).
_CHUNK = 512
_CHUNK_GPU = 16384


def _chunk_rows(x: torch.Tensor) -> int:
    return _CHUNK if x.device.type == "cpu" else _CHUNK_GPU


def _projections(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """w.x~ for every row of a (B, H, n, d) chunk: (B, H, n, m'). Every head shares the directions, so this is
    one plain (B*H*n, d) x (d, m') product, about twice as fast on CPU as a batched one. ``out``: flat scratch
    memory to write it to (at least B*H*n*m' elements)."""
    batch, heads, n, d = x.shape
    if out is None:
        return torch.mm(x.reshape(-1, d), w).view(batch, heads, n, -1)
    size = batch * heads * n * w.shape[1]
    return torch.mm(x.reshape(-1, d), w, out=out[:size].view(-1, w.shape[1])).view(batch, heads, n, -1)


def _exp_features(
    raw: torch.Tensor, shift: torch.Tensor, hyperbolic: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """exp(raw + shift) and, when ``hyperbolic``, exp(-raw + shift) next to it: (B, H, n, m).

    ``shift`` (B, H, n, 1) carries every per-row term (the key norm, the stabilising maximum; -inf removes a
    row). The -w half costs an elementwise pass instead of half the projection product. ``out``: flat scratch
    memory to write the features to (none: a new tensor, with autograd)."""
    if out is None:
        return torch.cat([raw + shift, shift - raw], dim=-1).exp_() if hyperbolic else (raw + shift).exp()
    if not hyperbolic:
        return raw.add_(shift).exp_()
    half = raw.shape[-1]
    phi = out[: raw.numel() * 2].view(*raw.shape[:-1], 2 * half)
    torch.add(raw, shift, out=phi[..., :half])
    torch.sub(shift, raw, out=phi[..., half:])
    return phi.exp_()


def _row_max(raw: torch.Tensor, hyperbolic: bool) -> torch.Tensor:
    """Largest feature logit of each row before the per-row shift: max over +-w.x~ (hyperbolic) or w.x~.
    (``amax`` and ``amin`` apart: ``aminmax`` is about eight times slower on CPU.)"""
    raw = raw.detach()
    if not hyperbolic:
        return raw.amax(-1)
    return torch.maximum(raw.amax(-1), raw.amin(-1).neg_())


class _Scratch:
    """Flat memory that every chunk of one call writes its projections and features to (no gradients).

    Fresh pages cost more than the arithmetic on them on the CPU (first-touch page faults of a new tensor for
    every chunk), so one buffer is reused."""

    def __init__(self, like: torch.Tensor, rows: int, directions: int, features: int, grad: bool) -> None:
        self.raw: torch.Tensor | None = None
        self.phi: torch.Tensor | None = None
        if not grad:
            self.raw = like.new_empty(rows * directions)
            self.phi = like.new_empty(rows * features)


def _key_summary(k, v, key_mask, scale, config, w, grad) -> torch.Tensor:
    """phi(K)^T [V, 1], (B, H, m, dv + 1): the value sums and, in the last column, the normaliser sums,
    accumulated over chunks of keys.

    Softmax features: log(sqrt(m) phi(k)) = +-w.k~ - s |k|^2 / 2. The maximum subtracted for stability is
    tracked online: when a chunk raises it, the running sums are rescaled by exp(old - new), so the result
    equals one global subtraction. Padded keys get a shift of -inf: their features are exactly zero, so they
    enter neither the numerator nor D.
    """
    batch, heads, s, _ = k.shape
    bh, dv = batch * heads, v.shape[-1]
    hyperbolic = config.kernel == "softmax" and config.hyperbolic
    m = config.features
    values = k.new_zeros(bh, m, dv)  # phi(K)^T V
    norms = k.new_zeros(batch, heads, m)  # phi(K)^T 1
    top = k.new_full((batch, heads), float("-inf"))  # running maximum of the key log-features
    rows = min(s, _chunk_rows(k))
    scratch = _Scratch(k, bh * rows, w.shape[1], m, grad)
    for start in range(0, s, rows):
        kc = k[:, :, start : start + rows]
        vc = v[:, :, start : start + rows]
        n = kc.shape[2]
        mc = None if key_mask is None else key_mask[:, None, start : start + rows]  # (B, 1, n)
        raw = _projections(kc, w, scratch.raw)  # (B, H, n, m')
        if config.kernel == "relu":
            phi = torch.relu(raw) + config.relu_eps
            if mc is not None:
                phi = phi * mc[..., None]  # padded keys: out of the numerator and of D
        else:
            # -s |k|^2 / 2, (B, H, n); vector_norm is several times faster than square().sum() on CPU
            norm = kc.square().sum(-1) if grad else torch.linalg.vector_norm(kc, dim=-1).square_()
            norm = norm * (-scale / 2)
            row_max = _row_max(raw, hyperbolic) + norm.detach()
            if mc is not None:
                row_max = row_max.masked_fill(~mc, float("-inf"))
            # ``top`` stays -inf until a real key comes (a chunk of padding alone must not set it)
            new_top = torch.maximum(top, row_max.amax(-1))
            finite_top = torch.where(torch.isinf(new_top), torch.zeros_like(new_top), new_top)
            if start:
                rescale = torch.exp(top - finite_top)  # exp(-inf) = 0: no real key before (the sums are 0)
                values = values * rescale.view(bh, 1, 1) if grad else values.mul_(rescale.view(bh, 1, 1))
                norms = norms * rescale[..., None] if grad else norms.mul_(rescale[..., None])
            top = new_top
            shift = norm - finite_top[..., None]
            if mc is not None:
                shift = shift.masked_fill(~mc, float("-inf"))
            phi = _exp_features(raw, shift[..., None], hyperbolic, scratch.phi)
        phi_t = phi.view(bh, n, m).transpose(1, 2)  # (B*H, m, n)
        if grad:
            values = torch.baddbmm(values, phi_t, vc.reshape(bh, n, dv))
            norms = norms + phi.sum(-2)
        else:
            values.baddbmm_(phi_t, vc.reshape(bh, n, dv))
            norms += phi.sum(-2)
    return torch.cat([values.view(batch, heads, m, dv), norms[..., None]], dim=-1)


def _softmax_logits(x, omega, scale, hyperbolic):
    """log(sqrt(m) phi(x)) = w.x~ - |x~|^2 / 2 for every feature (+-w with hyperbolic): (B, H, N, m)."""
    proj = x @ (omega * math.sqrt(scale)).t()
    if hyperbolic:
        proj = torch.cat([proj, -proj], dim=-1)
    return proj.sub_(x.square().sum(-1, keepdim=True) * (scale / 2))


def favor_weights(q, k, *, key_mask, query_mask, scale, config, state) -> torch.Tensor:
    """Dense (B, H, N, S) attention implied by the random features (analysis only)."""
    dt = compute_dtype(q.dtype)
    key_mask = safe_key_mask(key_mask)
    phi_q, phi_k = _features(q.to(dt), k.to(dt), key_mask, scale, config, state["omega"].to(dt))

    def exact(r: torch.Tensor | None) -> torch.Tensor:
        if r is None:
            return dense_softmax(q.to(dt), k.to(dt), key_mask, scale)
        return dense_softmax(q[r].to(dt), k[r].to(dt), _rows(key_mask, r), scale)

    def approximate() -> torch.Tensor:
        a = phi_q @ phi_k.transpose(-1, -2)  # (B, H, N, S)
        den = a.sum(-1, keepdim=True)
        out = a / den.clamp_min(config.stabilizer)
        low = _underflow(den[..., 0], query_mask, config, dt)
        return _fallback.replace_query_rows(out, low, exact, method="favor", why=_UNDERFLOW, count=False)

    return _with_fallback(approximate, exact, q, query_mask, config)


_UNDERFLOW = "the normaliser D of some query rows underflowed (large-norm queries or keys)"


def _underflow(den: torch.Tensor, query_mask: torch.Tensor | None, config: FavorConfig, dt) -> torch.Tensor:
    """Real query rows whose normaliser D (B, H, N) is below ``stabilizer`` (or the smallest normal number of
    ``dt``), or not finite: their estimate is lost to underflow. (B, H, N) bool."""
    floor = max(config.stabilizer, torch.finfo(dt).tiny)
    low = ~((den >= floor) & (den < math.inf))
    return low if query_mask is None else low & query_mask[:, None, :]


def _rows(mask: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if mask is None else mask[rows]


def _with_fallback(approximate, exact, q: torch.Tensor, query_mask: torch.Tensor | None, config: FavorConfig):
    """Batch rows with fewer than ``exact_below`` real tokens get ``exact(rows)`` (see :mod:`._fallback`)."""
    shape = (q.shape[0], q.shape[-2])
    return _fallback.with_fallback(
        approximate, exact, query_mask=query_mask, shape=shape, device=q.device, exact_below=config.exact_below
    )


@register(
    "favor",
    FavorConfig,
    cost=cost,
    init_state=init_state,
    weights=favor_weights,
    test_options={},  # the default 256 features
    # a Monte-Carlo estimate: its error falls like 1 / sqrt(m), so 8192 features are about 23x closer than 16
    exact_limit=ExactLimit(approaches=lambda n: [{"features": m} for m in (16, 256, 8192)], ratio=0.15),
)
def favor_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    scale: float,
    config: FavorConfig,
    state: dict[str, torch.Tensor],
    dropout: float = 0.0,
) -> torch.Tensor:
    """FAVOR+ (Performer): linear attention with positive orthogonal random features."""
    if dropout > 0.0:
        warnings.warn(
            "favor: attention dropout is not applied (FAVOR+ never forms the attention matrix to drop entries "
            "of); the model trains without it",
            RuntimeWarning,
            stacklevel=3,
        )

    def exact(r: torch.Tensor | None) -> torch.Tensor:
        if r is None:
            return exact_attention(q, k, v, key_mask, scale)
        return exact_attention(q[r], k[r], v[r], _rows(key_mask, r), scale)

    def approximate() -> torch.Tensor:
        out, den = _favor(q, k, v, key_mask, scale, config, state)
        low = _underflow(den, query_mask, config, compute_dtype(q.dtype))
        return _fallback.replace_query_rows(out, low, exact, method="favor", why=_UNDERFLOW)

    return _with_fallback(approximate, exact, q, query_mask, config)


def _favor(q, k, v, key_mask, scale, config, state) -> tuple[torch.Tensor, torch.Tensor]:
    """The output (B, H, N, dv) in the input dtype and the normaliser D of every query row (B, H, N)."""
    dt = compute_dtype(q.dtype)
    key_mask = safe_key_mask(key_mask)
    q, k = q.to(dt), k.to(dt)
    hyperbolic = config.kernel == "softmax" and config.hyperbolic
    w = (state["omega"].to(dt) * math.sqrt(scale)).t()  # (d, m'): w.x~ = (sqrt(s) w).x
    # without gradients the features and the output are written in place (out= has no autograd)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, w))
    summary = _key_summary(k, zero_padded_values(v.to(dt), key_mask), key_mask, scale, config, w, grad)
    batch, heads, n_q, _ = q.shape
    bh, m, dv = batch * heads, config.features, summary.shape[-1] - 1
    summary = summary.view(bh, m, dv + 1)
    out = summary.new_empty(batch, heads, n_q, dv)  # (B, H, N, dv)
    outs = []
    dens = summary.new_empty(batch, heads, n_q)  # (B, H, N)
    rows = min(n_q, _chunk_rows(q))
    scratch = _Scratch(q, bh * rows, w.shape[1], m, grad)
    both_store = None if grad else summary.new_empty(bh * rows * (dv + 1))
    for start in range(0, n_q, rows):  # chunks of queries: D^-1 phi(Q) (phi(K)^T V)
        raw = _projections(q[:, :, start : start + rows], w, scratch.raw)  # (B, H, n, m')
        n = raw.shape[2]
        if config.kernel == "relu":
            phi = torch.relu(raw) + config.relu_eps
        else:  # exp(-|q~|^2 / 2) / sqrt(m) and the row maximum are per-row factors: they cancel in D^-1
            phi = _exp_features(raw, -_row_max(raw, hyperbolic)[..., None], hyperbolic, scratch.phi)
        phi = phi.view(bh, n, m)
        if grad:
            both = phi @ summary  # (B*H, n, dv + 1): numerator | D
        else:
            both = torch.bmm(phi, summary, out=both_store[: bh * n * (dv + 1)].view(bh, n, dv + 1))
        both = both.view(batch, heads, n, dv + 1)
        dens[:, :, start : start + n] = both[..., -1].detach()
        den = both[..., -1:].clamp_min(config.stabilizer)
        if grad:
            outs.append(both[..., :-1] / den)
        else:
            torch.div(both[..., :-1], den, out=out[:, :, start : start + n])
    return (torch.cat(outs, dim=2) if grad else out).to(v.dtype), dens  # (B, H, N, dv), (B, H, N)
