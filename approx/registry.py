"""The method registry: one ``register`` call per method file, nothing to edit elsewhere.

A method is a pure attention function over already-projected, per-head tensors plus its config class, an
optional state initialiser (random planes, features, learned projections: tensors kept as buffers on the
patched layer) and a cost model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from .config import MethodConfig, did_you_mean

__all__ = ["Cost", "Method", "register", "get_method", "methods"]


@dataclasses.dataclass(frozen=True)
class Cost:
    """Attention cost of one call, per batch item and head.

    ``flops``: multiply-adds counted as 2 flops, for the score and value products and the method's own
    overhead (hashing, clustering). ``qk_pairs``: query-key dot products evaluated.
    """

    flops: int
    qk_pairs: int


# attend(q, k, v, *, key_mask, query_mask, scale, config, state) -> output
#   q: (B, H, N, d), k: (B, H, S, d), v: (B, H, S, dv); key_mask: (B, S) bool, True = real token, or None;
#   query_mask: (B, N) bool or None; returns (B, H, N, dv) in q's dtype.
AttendFn = Callable[..., torch.Tensor]
# init_state(config, *, head_dim, seed) -> {name: tensor}
InitStateFn = Callable[..., dict[str, torch.Tensor]]
# cost(config, *, n, s, d, dv) -> Cost
CostFn = Callable[..., Cost]
# weights(q, k, *, key_mask, query_mask, scale, config, state) -> (B, H, N, S): the dense attention matrix the
# method implies, for analysis and plots on short inputs (it is O(N * S) by construction).
WeightsFn = Callable[..., torch.Tensor]
# fit(config, state, samples, **options) -> {name: tensor}: state learned from the model's own queries and keys,
#   samples = [(q, k, key_mask, scale), ...]; a method with ``fit`` must be fitted before it runs.
FitFn = Callable[..., dict[str, torch.Tensor]]
# stats(q, k, *, key_mask, query_mask, scale, config, state) -> {name: (H,) tensor}: counts summed over the batch
#   that the evaluation harness adds up per layer (e.g. Sparsefinder's predicted and gold graph sizes).
StatsFn = Callable[..., dict[str, torch.Tensor]]


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

    @property
    def needs_fit(self) -> bool:
        """True when the method's state is learned (``approx.fit``) rather than drawn."""
        return self.fit is not None

    def make_config(self, **options: Any) -> MethodConfig:
        return self.config_class.from_options(**options)


_METHODS: dict[str, Method] = {}


def register(
    name: str,
    config_class: type[MethodConfig],
    *,
    cost: CostFn,
    init_state: InitStateFn | None = None,
    weights: WeightsFn | None = None,
    fit: FitFn | None = None,
    stats: StatsFn | None = None,
) -> Callable[[AttendFn], AttendFn]:
    """Decorator registering an attend function as method ``name``."""

    def deco(attend: AttendFn) -> AttendFn:
        if name in _METHODS:
            raise ValueError(f"attention method {name!r} is registered twice")
        if config_class.method != name:
            raise ValueError(f"{config_class.__name__}.method is {config_class.method!r}, expected {name!r}")
        summary = (attend.__doc__ or "").strip().splitlines()[0] if attend.__doc__ else ""
        _METHODS[name] = Method(name, config_class, attend, cost, init_state, weights, summary, fit=fit, stats=stats)
        return attend

    return deco


def _load_builtin() -> None:
    from . import attention as _  # noqa: F401  (importing the package registers every method file)


def methods() -> list[str]:
    """Names of the registered attention methods."""
    _load_builtin()
    return list(_METHODS)


def get_method(name: str) -> Method:
    """The registered method ``name``; ``ValueError`` listing the available ones otherwise."""
    _load_builtin()
    if not isinstance(name, str) or name not in _METHODS:
        hint = did_you_mean(str(name), _METHODS)
        raise ValueError(f"unknown attention method {name!r}{hint}; available methods: {', '.join(_METHODS)}")
    return _METHODS[name]
