"""FAVOR+: Fast Attention Via positive Orthogonal Random features (Performer).

Choromanski et al., "Rethinking Attention with Performers", ICLR 2021 (arXiv 2009.14794).

The softmax kernel is an expectation over random features: with x~ = sqrt(s) x (s the attention scale),
exp(s q.k) = E_w[phi(q~) . phi(k~)] for the positive features
phi(x) = exp(-|x|^2 / 2) / sqrt(m) [exp(w_1.x), ..., exp(w_m.x)], w_i ~ N(0, I). Attention then needs no
N x S matrix: O = D^-1 phi(Q) (phi(K)^T V), D = diag(phi(Q) phi(K)^T 1), O(N m d) time and memory. That
computation (chunks of keys and queries, padding, half precision, in-place work) is the one shared by every
kernelised method, :mod:`._kernelized`; this file supplies the feature maps.

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
  keys of a (batch, head) is subtracted, tracked online by the shared helper while keys are summed in chunks
  (so no (N, m) feature tensor is ever held whole: memory O(chunk * m + m * dv) beyond inputs). Nothing overflows in
  float16/bfloat16 (computed in float32). Where D still falls below ``stabilizer`` (large-norm inputs,
  where one key's features dwarf the others'), the row's estimate is lost to underflow: such query rows get
  exact attention (:func:`._fallback.replace_query_rows`, counted in ``_fallback.counts()`` and warned
  about), never the zeros a floored D would give.
* Speed: every head of a layer shares the directions, so the feature projections of a chunk are one plain
  (B*H*n, d) x (d, m') product (about twice as fast on CPU as a batched one). Hyperbolic features project on
  the m/2 directions only and get the -w half from an elementwise pass; the key norm, the stabilising maximum
  and padding (-inf) are one per-row shift; without gradients the projections and features of every chunk go
  to scratch memory reused by every chunk of a call (:class:`._kernelized.Scratch`), phi(K)^T V is
  accumulated in place and the output is written in place.
* Padding: the feature rows of padded keys are zeroed, so they enter neither the numerator nor the
  normaliser D (both reference implementations only zero the values, so padding changed real outputs).
* ``exact_below``: batch rows with fewer real tokens than this get exact attention (0, the default, never:
  measurements at short lengths then measure the approximation, not the fallback; see :mod:`._fallback`).
* ``kernel="relu"``: the generalised kernel phi(x) = ReLU(w.x~) + relu_eps of the Performer paper, another
  feature map through the same computation (no softmax estimate: no maximum to track, no underflow).
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
from ._common import compute_dtype, exact_rows, exact_weight_rows
from ._fallback import exact_for_length
from ._kernelized import FeatureMap, Scratch, kernel_attention, kernel_weights

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
    stabilizer: float = option(
        1e-12,
        "threshold of the normaliser D: a real query row whose D falls below it (its features underflowed: "
        "large-norm inputs) gets exact attention, counted and warned about",
    )
    relu_eps: float = option(1e-3, "eps added to the relu kernel's features (the Performer code's default)")
    seed: int = option(0, "seed of the random directions")
    exact_below: int = option(
        0,
        "sequences with fewer real tokens get exact attention (0 = never; set it to the measured crossover for "
        "speed: see the docs' Speed page)",
    )

    def unused(self) -> dict[str, str]:
        if self.kernel == "relu":  # the relu kernel's features are relu(w.x): no negated directions
            return {"hyperbolic": "kernel='softmax'"}
        return {"relu_eps": "kernel='relu'"}

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
    """(m, d) directions: i.i.d. N(0, I) rows, or blocks of d orthogonal rows with chi_d-distributed norms. A block
    is the Q factor of a Gaussian matrix with each column's sign set by R's diagonal (Mezzadri 2007): the Q that
    LAPACK returns ties column i's sign to the input's diagonal, so row i leaned towards its own axis (w_i[i] < 0 in
    78 % of draws at d = 64) and the softmax kernel's estimate was biased (0.90 against 1.10 for x and -x, |x| = 1.5)
    unless the features came in +-w pairs (``hyperbolic``)."""
    if not orthogonal:
        return torch.randn(m, d, generator=generator)
    blocks = []
    for _ in range(-(-m // d)):  # ceil(m / d) blocks of d orthonormal rows
        q, r = torch.linalg.qr(torch.randn(d, d, generator=generator))
        signs = torch.diagonal(r).sign()
        blocks.append((q * torch.where(signs == 0, 1.0, signs)).t())
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
    """Positive random features of the softmax kernel, (B, H, N, d) -> (B, H, N, m), written out densely (the
    attention itself computes them chunk by chunk through :class:`_PositiveFeatures`).

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


class _PositiveFeatures(FeatureMap):
    """The softmax kernel's positive features, exp(+-w.x~ - |x~|^2 / 2) / sqrt(m), up to factors that cancel.

    Queries: exp(-|q~|^2 / 2) / sqrt(m) and the row maximum of +-w.q~ are per-row factors, dropped / subtracted.
    Keys: log(sqrt(m) phi(k)) = +-w.k~ - s |k|^2 / 2; one maximum of it over the real keys of a (batch, head) is
    subtracted, tracked online over chunks by the shared helper (:mod:`._kernelized`); padded keys get a shift
    of -inf, so their features are exactly zero."""

    def __init__(self, w: torch.Tensor, scale: float, hyperbolic: bool, features: int) -> None:
        self.w, self.scale, self.hyperbolic, self.features = w, scale, hyperbolic, features

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.w,)

    def _raw(self, x: torch.Tensor, scratch: Scratch) -> torch.Tensor:
        return _projections(x, self.w, scratch("raw", x[..., 0].numel() * self.w.shape[1]))  # (B, H, n, m')

    def _exp(self, raw: torch.Tensor, shift: torch.Tensor, scratch: Scratch) -> torch.Tensor:
        return _exp_features(
            raw, shift[..., None], self.hyperbolic, scratch("phi", raw[..., 0].numel() * self.features)
        )

    def queries(self, x: torch.Tensor, scratch: Scratch) -> torch.Tensor:
        raw = self._raw(x, scratch)
        return self._exp(raw, -_row_max(raw, self.hyperbolic), scratch)

    def key_logits(self, x, real, scratch):
        raw = self._raw(x, scratch)
        # -s |k|^2 / 2, (B, H, n); vector_norm is several times faster than square().sum() on CPU
        norm = x.square().sum(-1) if scratch.grad else torch.linalg.vector_norm(x, dim=-1).square_()
        norm = norm * (-self.scale / 2)
        row_max = _row_max(raw, self.hyperbolic) + norm.detach()  # (B, H, n)
        if real is not None:
            row_max = row_max.masked_fill(~real, float("-inf"))  # a chunk of padding alone sets no maximum
        return (raw, norm), row_max.amax(-1, keepdim=True)  # (B, H, 1)

    def key_features(self, pre, shift, real, scratch):
        raw, norm = pre
        row_shift = norm - shift  # (B, H, n)
        if real is not None:
            row_shift = row_shift.masked_fill(~real, float("-inf"))  # padded keys: out of the numerator and of D
        return self._exp(raw, row_shift, scratch)


class _ReluFeatures(FeatureMap):
    """The generalised kernel's features ReLU(w.x~) + eps, (B, H, n, d) -> (B, H, n, m)."""

    def __init__(self, w: torch.Tensor, eps: float, features: int) -> None:
        self.w, self.eps, self.features = w, eps, features

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.w,)

    def queries(self, x: torch.Tensor, scratch: Scratch) -> torch.Tensor:
        raw = _projections(x, self.w, scratch("raw", x[..., 0].numel() * self.w.shape[1]))
        return torch.relu(raw) + self.eps if scratch.grad else raw.relu_().add_(self.eps)

    keys = queries


def _feature_map(config: FavorConfig, state: dict[str, torch.Tensor], scale: float, dt: torch.dtype) -> FeatureMap:
    w = (state["omega"].to(dt) * math.sqrt(scale)).t()  # (d, m'): w.x~ = (sqrt(s) w).x
    if config.kernel == "relu":
        return _ReluFeatures(w, config.relu_eps, config.features)
    return _PositiveFeatures(w, scale, config.hyperbolic, config.features)


def _softmax_logits(x, omega, scale, hyperbolic):
    """log(sqrt(m) phi(x)) = w.x~ - |x~|^2 / 2 for every feature (+-w with hyperbolic): (B, H, N, m)."""
    proj = x @ (omega * math.sqrt(scale)).t()
    if hyperbolic:
        proj = torch.cat([proj, -proj], dim=-1)
    return proj.sub_(x.square().sum(-1, keepdim=True) * (scale / 2))


def favor_weights(q, k, *, key_mask, query_mask, scale, config, state) -> torch.Tensor:
    """Dense (B, H, N, S) attention implied by the random features (analysis only)."""
    dt = compute_dtype(q.dtype)

    exact = exact_weight_rows(q, k, key_mask, scale, dt)

    def approximate() -> torch.Tensor:
        fmap = _feature_map(config, state, scale, dt)
        w, den = kernel_weights(q, k, key_mask, fmap, floor=config.stabilizer)
        low = _underflow(den, query_mask, config, dt)
        return _fallback.replace_query_rows(w, low, exact, method="favor", why=_UNDERFLOW, count=False)

    return _with_fallback(approximate, exact, q, query_mask, config)


_UNDERFLOW = "the normaliser D of some query rows underflowed (large-norm queries or keys)"


def _underflow(den: torch.Tensor, query_mask: torch.Tensor | None, config: FavorConfig, dt) -> torch.Tensor:
    """Real query rows whose normaliser D (B, H, N) is below ``stabilizer`` (or the smallest normal number of
    ``dt``), or not finite: their estimate is lost to underflow. (B, H, N) bool."""
    floor = max(config.stabilizer, torch.finfo(dt).tiny)
    low = ~((den >= floor) & (den < math.inf))
    return low if query_mask is None else low & query_mask[:, None, :]


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

    exact = exact_rows(q, k, v, key_mask, scale)

    def approximate() -> torch.Tensor:
        out, den = _favor(q, k, v, key_mask, scale, config, state)
        low = _underflow(den, query_mask, config, compute_dtype(q.dtype))
        if config.exact_below > 0 and query_mask is not None:  # rows exact anyway (below exact_below): no breakdown
            short = _fallback.exact_rows(query_mask, q.shape[-2], q.shape[0], q.device, exact_below=config.exact_below)
            low = low & ~short[:, None, None]
        return _fallback.replace_query_rows(out, low, exact, method="favor", why=_UNDERFLOW)

    return _with_fallback(approximate, exact, q, query_mask, config)


def _favor(q, k, v, key_mask, scale, config, state) -> tuple[torch.Tensor, torch.Tensor]:
    """The output (B, H, N, dv) in the input dtype and the normaliser D of every query row (B, H, N)."""
    fmap = _feature_map(config, state, scale, compute_dtype(q.dtype))
    return kernel_attention(q, k, v, key_mask, fmap, floor=config.stabilizer)
