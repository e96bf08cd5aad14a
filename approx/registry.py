"""Registries: the generic :class:`Registry` (methods here, evaluation tasks in the harness) and the method
registry, one ``register`` call per method file, nothing to edit elsewhere.

A method is a pure attention function over already-projected, per-head tensors plus its config class, an
optional state initialiser (random planes, features, learned projections: tensors kept as buffers on the
patched layer) and a cost model (and a per-row one where the cost depends on more than the lengths). Its
registration also carries what generic code needs to know about it: the attention it predicts while being fitted
(``teacher``), the options at which the generic tests see it approximate (``test_options``) and how it reaches
exact attention (``exact_limit``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import torch

from .config import MethodConfig, did_you_mean

__all__ = ["Cost", "ExactLimit", "Method", "Registry", "discover", "register", "get_method", "methods"]

T = TypeVar("T")


def discover(package: str) -> None:
    """Import every module of ``package`` whose name does not start with ``_``: each registers what it defines."""
    module = importlib.import_module(package)
    for info in pkgutil.iter_modules(module.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package}.{info.name}")


class Registry(Generic[T]):
    """Named entries of one kind (attention methods, evaluation tasks), filled by the modules of ``package``
    as they are imported (:func:`discover`): adding an entry is adding a file. Unknown names get the list of
    what exists and a "did you mean"."""

    def __init__(self, kind: str, package: str, *, plural: str | None = None) -> None:
        self.kind, self.package, self.plural = kind, package, plural or f"{kind}s"
        self._entries: dict[str, T] = {}
        self._loaded = False

    def add(self, name: str, entry: T) -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._entries[name] = entry

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True  # set first: a module may look a name up while it registers
            try:
                discover(self.package)
            except BaseException:
                self._loaded = False  # a failed import is retried, not left as a partial registry
                raise

    def names(self) -> list[str]:
        """The names in the package's module order (then as each module registers them), whichever module a
        program happened to import first."""
        self._load()
        modules = importlib.import_module(self.package).__path__
        rank = {f"{self.package}.{m.name}": i for i, m in enumerate(pkgutil.iter_modules(modules))}
        order = {name: i for i, name in enumerate(self._entries)}
        return sorted(self._entries, key=lambda n: (rank.get(_module_of(self._entries[n]), -1), order[n]))

    def get(self, name: str) -> T:
        self._load()
        if not isinstance(name, str) or name not in self._entries:
            hint = did_you_mean(str(name), self._entries)
            raise ValueError(f"unknown {self.kind} {name!r}{hint}; available {self.plural}: {', '.join(self.names())}")
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


@dataclasses.dataclass(frozen=True)
class Cost:
    """Attention cost of one call, per batch item and head.

    ``flops``: multiply-adds counted as 2 flops, for the score and value products and the method's own
    overhead (hashing, clustering): approx's full cost model. ``qk_pairs``: query-key dot products evaluated.
    ``matmul_macs``: the literature's convention (the MonarchAttention paper's axis): multiply-accumulates of
    the attention's matrix products only (softmax: N S d for Q K^T plus N S dv for A V), the method's
    elementwise work, softmax, hashing and clustering excluded. None only where a method has not said yet.
    """

    flops: int
    qk_pairs: int
    matmul_macs: int | None = None

    def scaled(self, k: int) -> Cost:
        """This cost ``k`` times (over ``k`` heads, say)."""
        return Cost(self.flops * k, self.qk_pairs * k, None if self.matmul_macs is None else self.matmul_macs * k)

    def __add__(self, other: Cost) -> Cost:
        macs = None if self.matmul_macs is None or other.matmul_macs is None else self.matmul_macs + other.matmul_macs
        return Cost(self.flops + other.flops, self.qk_pairs + other.qk_pairs, macs)

    @staticmethod
    def total(costs: Iterable[Cost]) -> Cost:
        """The sum of ``costs`` (``matmul_macs`` None when any of them lacks it)."""
        return sum(costs, Cost(0, 0, 0))


# attend(q, k, v, *, key_mask, query_mask, scale, config, state) -> output
#   q: (B, H, N, d), k: (B, H, S, d), v: (B, H, S, dv); key_mask: (B, S) bool, True = real token, or None;
#   query_mask: (B, N) bool or None; returns (B, H, N, dv) in q's dtype.
AttendFn = Callable[..., torch.Tensor]
# init_state(config, *, head_dim, seed) -> {name: tensor}
InitStateFn = Callable[..., dict[str, torch.Tensor]]
# cost(config, *, n, s, d, dv) -> Cost
CostFn = Callable[..., Cost]
# batch_cost(config, *, b, n, key_mask, d, dv) -> [Cost] * b: the cost of one self-attention call per batch row, for
#   a method whose cost depends on the data beyond the lengths (window's global question tokens, read from
#   ``attention._context``, which the forward sets); key_mask: (B, N) bool, True = real token, or None.
BatchCostFn = Callable[..., list[Cost]]
# head_cost(config, *, n, s, d, dv, head) -> Cost: one head's cost when the heads of a layer differ (the Sparse
#   Transformer's "split" heads: even heads attend one half of the pattern, odd heads the other); ``head`` is the
#   head's index in its layer.
HeadCostFn = Callable[..., Cost]
# weights(q, k, *, key_mask, query_mask, scale, config, state) -> (B, H, N, S): the dense attention matrix the
# method implies, for analysis and plots on short inputs (it is O(N * S) by construction).
WeightsFn = Callable[..., torch.Tensor]
# fit(config, state, samples, **options) -> {name: tensor}: state learned from the model's own queries and keys,
#   samples = [(q, k, key_mask, scale), ...]; a config for which ``Method.requires_fit`` is true must be fitted
#   before it runs.
FitFn = Callable[..., dict[str, torch.Tensor]]
# stats(q, k, *, key_mask, query_mask, scale, config, state) -> {name: (H,) tensor}: counts summed over the batch
#   that the evaluation harness adds up per layer (e.g. Sparsefinder's predicted and gold graph sizes).
StatsFn = Callable[..., dict[str, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class ExactLimit:
    """How a method reaches exact softmax attention *while its approximation code runs*; the generic test
    (``tests/test_methods.py``) checks every registered method against a float64 reference this way.

    ``options(n)``: the options (beyond the test budget) that make the method exact on ``n`` tokens, to float64
    rounding, without its exact fallback (e.g. i-clustered with ``topk >= n``). ``distinct_queries``: the limit
    holds when the queries take at most this many distinct values (clustered attention: each cluster is one
    value). ``approaches``: instead of one exact setting, options along which the method converges to it (FAVOR+'s
    Monte-Carlo estimate with more and more features; entmax with alpha -> 1): the error against the reference
    must fall at every step, to at most ``ratio`` of the first. Every step runs the approximation, not a fallback.
    ``kernel``: for a method that is not an approximation of softmax but attention with another kernel (the
    linear transformer's elu + 1, Efficient Attention, Taylor attention), the name of that kernel: its exact
    reference is then the kernel's own dense float64 formula (``tests/reference.py``'s ``KERNEL_ATTENTION``),
    not softmax, and ``options``/``approaches`` lead to it.
    """

    options: Callable[[int], dict[str, Any]] = lambda n: {}  # noqa: E731
    distinct_queries: int | None = None
    approaches: Callable[[int], list[dict[str, Any]]] | None = None
    ratio: float = 0.15
    kernel: str | None = None


def _module_of(entry: Any) -> str:
    """The module that registered ``entry``: a method's attention function's (a :class:`Method` is a dataclass of
    this module), else the entry's class's (a task)."""
    attend = getattr(entry, "attend", None)
    return getattr(attend, "__module__", None) or type(entry).__module__


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    config_class: type[MethodConfig]
    attend: AttendFn
    cost: CostFn
    init_state: InitStateFn | None = None
    weights: WeightsFn | None = None
    summary: str = ""
    fit: FitFn | None = None
    stats: StatsFn | None = None
    # the attention to run while this method's state is fitted (``approx.fit``): (method name, options)
    teacher: Callable[[MethodConfig], tuple[str, dict[str, Any]]] | None = None
    # options at which the generic tests (n = 120 tokens) see the method approximate, not fall back to exact
    test_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    # how the method reaches exact attention while its approximation code runs; None only for ``full``
    exact_limit: ExactLimit | None = None
    # the settings of ``fit`` (a MethodConfig subclass: options with defaults and help), for the CLI and docs
    fit_config: type[MethodConfig] | None = None
    # which configs have learned state: the options that give it ({"mode": "fitted"}, Linformer's; errors can then name
    # them) or a test of a config; None: every config of a method with ``fit``
    fit_when: dict[str, Any] | Callable[[MethodConfig], bool] | None = None
    # the per-row cost of a call when it depends on the data, not only the lengths (see ``costs``); None: ``cost``
    batch_cost: BatchCostFn | None = None
    # one head's cost by its index in the layer, when heads differ (see ``head_costs``); None: ``cost`` on every head
    head_cost: HeadCostFn | None = None

    @property
    def needs_fit(self) -> bool:
        """True when the method has state learned by ``approx.fit`` for some of its configs (all of them, unless
        ``fit_when`` says which): such a method may need a fit; :meth:`requires_fit` says for one config."""
        return self.fit is not None

    def requires_fit(self, config: MethodConfig) -> bool:
        """True when ``config``'s state is learned (``approx.fit``) and must be fitted before the method runs;
        False for a method without ``fit`` and for the configs that ``fit_when`` leaves out (e.g. Linformer's
        ``mean`` and ``random`` modes)."""
        if self.fit is None or self.fit_when is None:
            return self.fit is not None
        if isinstance(self.fit_when, dict):
            return all(getattr(config, k) == v for k, v in self.fit_when.items())
        return bool(self.fit_when(config))

    def fit_options(self) -> str:
        """The options with which the method has learned state, as a spec writes them (``"mode=fitted"``); "" when
        every config has it, or ``fit_when`` is a test that does not say."""
        if not isinstance(self.fit_when, dict):
            return ""
        return ",".join(f"{k}={v}" for k, v in self.fit_when.items())

    def make_config(self, **options: Any) -> MethodConfig:
        return self.config_class.from_options(**options)

    def costs(
        self, config: MethodConfig, *, b: int, n: int, key_mask: torch.Tensor | None, d: int, dv: int
    ) -> list[Cost]:
        """The cost of one self-attention call on a batch, per row (``key_mask``: (B, N) bool, True = real token,
        padding at the end, or None): ``batch_cost`` when the method has one (its cost depends on the data, e.g.
        window's global question tokens; call it where the forward's context is set), else ``cost`` at each row's
        real length."""
        if self.batch_cost is not None:
            return list(self.batch_cost(config, b=b, n=n, key_mask=key_mask, d=d, dv=dv))
        lengths = _row_lengths(b, n, key_mask)
        at = {m: self.cost(config, n=m, s=m, d=d, dv=dv) for m in set(lengths)}
        return [at[m] for m in lengths]

    def head_costs(
        self, config: MethodConfig, *, heads: Sequence[int], b: int, n: int, key_mask: torch.Tensor | None, d: int,
        dv: int,
    ) -> list[Cost]:  # fmt: skip
        """The cost of one self-attention call on a batch, per row, summed over ``heads`` (the heads' indices in
        their layer): each head's own cost where the method's heads differ (``head_cost``), else :meth:`costs`
        times the number of heads."""
        if self.head_cost is None:
            return [c.scaled(len(heads)) for c in self.costs(config, b=b, n=n, key_mask=key_mask, d=d, dv=dv)]
        lengths = _row_lengths(b, n, key_mask)
        at = {m: Cost.total(self.head_cost(config, n=m, s=m, d=d, dv=dv, head=h) for h in heads) for m in set(lengths)}
        return [at[m] for m in lengths]


def _row_lengths(b: int, n: int, key_mask: torch.Tensor | None) -> list[int]:
    """Each batch row's real length (``key_mask``: (B, N) bool, padding at the end, or None: every row n)."""
    return [n] * b if key_mask is None else [int(m) for m in key_mask.sum(-1).tolist()]


_METHODS: Registry[Method] = Registry("attention method", "approx.attention", plural="methods")


def _empty_safe(attend: AttendFn) -> AttendFn:
    """``attend`` that gives an input without any query or key (B, N or S = 0) an output of zeros (B, H, N, dv) without
    calling the method: a softmax over no key is 0, as torch's SDPA gives, and a method's arithmetic (chunk sizes,
    block counts, maxima over the keys) need not expect empty tensors. The zeros stay attached to the inputs' graph."""

    @functools.wraps(attend)
    def guarded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if q.shape[0] and q.shape[-2] and k.shape[-2]:
            return attend(q, k, v, **kwargs)
        zeros = q.new_zeros(*q.shape[:-1], v.shape[-1])
        return zeros + 0 * (q.sum() + k.sum() + v.sum()) if torch.is_grad_enabled() else zeros

    return guarded


def _empty_safe_weights(weights: WeightsFn | None) -> WeightsFn | None:
    """``weights`` that gives an input without any query or key an empty (B, H, N, S) matrix (see :func:`_empty_safe`)."""
    if weights is None:
        return None

    @functools.wraps(weights)
    def guarded(q: torch.Tensor, k: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if q.shape[0] and q.shape[-2] and k.shape[-2]:
            return weights(q, k, **kwargs)
        return q.new_zeros(*q.shape[:-1], k.shape[-2])

    return guarded


def _empty_safe_cost(cost: CostFn) -> CostFn:
    """``cost`` that is 0 where there is no query or no key (nothing to attend), whatever the method's formula counts
    for the other side (a kernel method's feature maps of the queries, a hash of the keys)."""

    @functools.wraps(cost)
    def guarded(config: MethodConfig, *, n: int, s: int, **kwargs: Any) -> Cost:
        if n <= 0 or s <= 0:
            return Cost(0, 0, 0)
        return cost(config, n=n, s=s, **kwargs)

    return guarded


def register(
    name: str,
    config_class: type[MethodConfig],
    *,
    cost: CostFn,
    init_state: InitStateFn | None = None,
    weights: WeightsFn | None = None,
    fit: FitFn | None = None,
    stats: StatsFn | None = None,
    teacher: Callable[[MethodConfig], tuple[str, dict[str, Any]]] | None = None,
    test_options: dict[str, Any] | None = None,
    exact_limit: ExactLimit | None = None,
    fit_config: type[MethodConfig] | None = None,
    fit_when: dict[str, Any] | Callable[[MethodConfig], bool] | None = None,
    batch_cost: BatchCostFn | None = None,
    head_cost: HeadCostFn | None = None,
) -> Callable[[AttendFn], AttendFn]:
    """Decorator registering an attend function as method ``name`` (see :class:`Method` for the fields)."""

    if head_cost is not None and batch_cost is not None:  # Method.head_costs reads one or the other, not both
        raise ValueError(
            f"method {name!r}: a cost depends on the data (batch_cost) or on the head (head_cost), not both"
        )

    def deco(attend: AttendFn) -> AttendFn:
        if config_class.method != name:
            raise ValueError(f"{config_class.__name__}.method is {config_class.method!r}, expected {name!r}")
        summary = (attend.__doc__ or "").strip().splitlines()[0] if attend.__doc__ else ""
        _METHODS.add(
            name,
            Method(
                name,
                config_class,
                _empty_safe(attend),
                _empty_safe_cost(cost),
                init_state,
                _empty_safe_weights(weights),
                summary,
                fit=fit,
                stats=stats,
                teacher=teacher,
                test_options=dict(test_options or {}),
                exact_limit=exact_limit,
                fit_config=fit_config,
                fit_when=fit_when,
                batch_cost=batch_cost,
                head_cost=None if head_cost is None else _empty_safe_cost(head_cost),
            ),
        )
        return attend

    return deco


def methods() -> list[str]:
    """Names of the registered attention methods."""
    return _METHODS.names()


def get_method(name: str) -> Method:
    """The registered method ``name``; ``ValueError`` listing the available ones otherwise."""
    base = name.partition(":")[0].strip() if isinstance(name, str) and ":" in name else None
    if base is not None and base in _METHODS.names():  # a spec where a name goes (approx.patch, ApproxAttention)
        raise ValueError(
            f"unknown attention method {name!r}: a spec 'name:opt=val,...' is read by approx.evaluate, "
            f"approx.autotune, approx.finetune and the approx command; here give the name and its options apart: "
            f"approx.patch(model, {base!r}, option=value), or get_method({base!r}).make_config(option=value)"
        )
    return _METHODS.get(name)
