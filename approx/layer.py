"""``ApproxAttention``: the module attached to each patched attention layer.

It holds the method, its config and the method's state as buffers (non-persistent, so a patched model's
``state_dict`` stays a plain Hugging Face one; ``approx.save`` writes the state separately). It is plain
torch and can be used without any model, e.g. by the benchmarks::

    layer = ApproxAttention("i-clustered", IClusteredConfig(clusters=100), head_dim=64)
    out = layer(q, k, v, key_mask=mask)   # q, k, v: (B, H, N, d); mask: (B, S) bool, True = real token
"""

from __future__ import annotations

import torch
from torch import nn

from .config import MethodConfig
from .registry import get_method

__all__ = ["ApproxAttention", "layer_seed"]


def layer_seed(seed: int, layer_index: int) -> int:
    """Seed of one layer's state: different per layer, independent of which other layers are patched."""
    return (seed * 1_000_003 + layer_index * 7_919 + 17) % (2**63 - 1)


class ApproxAttention(nn.Module):
    def __init__(self, method: str, config: MethodConfig | None = None, *, head_dim: int, layer_index: int = 0) -> None:
        super().__init__()
        self.method = get_method(method)
        if config is None:
            config = self.method.config_class()
        if not isinstance(config, self.method.config_class):
            raise TypeError(f"{method!r} expects a {self.method.config_class.__name__}, got {type(config).__name__}")
        self.config = config
        self.head_dim = head_dim
        self.layer_index = layer_index
        if self.method.init_state is not None:
            seed = layer_seed(getattr(config, "seed", 0), layer_index)
            for name, tensor in self.method.init_state(config, head_dim=head_dim, seed=seed).items():
                self.register_buffer(name, tensor, persistent=False)

    def state(self) -> dict[str, torch.Tensor]:
        """The method's state tensors (random planes, features, fitted projections...)."""
        return dict(self.named_buffers(recurse=False, remove_duplicate=False))  # two names may share a tensor

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the state tensors (e.g. from a saved model); names and shapes must match."""
        mine = self.state()
        if set(state) != set(mine):
            raise ValueError(f"state of {self.method.name!r} has {sorted(mine)}, got {sorted(state)}")
        for name, tensor in state.items():
            # an empty tensor is a placeholder of fitted state whose shape is known only once fitted
            if tensor.shape != mine[name].shape and mine[name].numel() > 0:
                raise ValueError(f"state {name!r}: expected shape {tuple(mine[name].shape)}, got {tuple(tensor.shape)}")
            setattr(self, name, tensor.to(mine[name].device))

    def redraw(self, seed: int) -> None:
        """Draw the method's random state anew from ``seed`` (e.g. FAVOR+ features during fine-tuning).
        Fitted state (``approx.fit``) is learned, not random, and is kept."""
        if self.method.init_state is None or self.method.needs_fit:
            return
        old = self.state()
        for name, t in self.method.init_state(self.config, head_dim=self.head_dim, seed=seed).items():
            setattr(self, name, t.to(device=old[name].device, dtype=old[name].dtype))

    def fit(self, samples: list, **options) -> None:
        """Learn the method's state from ``samples`` = [(q, k, key_mask, scale), ...] of this layer (the model's
        own queries and keys, see ``approx.fit``); ``options`` go to the method's fit function."""
        if not self.method.needs_fit:
            raise ValueError(f"method {self.method.name!r} has no fitted state")
        old = self.state()
        for name, t in self.method.fit(self.config, old, samples, **options).items():
            setattr(self, name, t.to(device=old[name].device))

    def graph_stats(self, q, k, key_mask=None, *, scale=None) -> dict[str, torch.Tensor] | None:
        """Counts of the method's predicted attention graph against its gold graph (None if it has none)."""
        if self.method.stats is None:
            return None
        if scale is None:
            scale = q.shape[-1] ** -0.5
        query_mask = key_mask if key_mask is not None and q.shape[-2] == k.shape[-2] else None
        return self.method.stats(
            q, k, key_mask=key_mask, query_mask=query_mask, scale=scale, config=self.config, state=self.state()
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        *,
        scale: float | None = None,
        dropout: float = 0.0,
    ) -> torch.Tensor:
        """Self-attention over (B, H, N, d) tensors with a (B, S) key-padding mask; returns (B, H, N, dv).

        Queries are the same positions as keys, so the key-padding mask is also the query mask.
        """
        if scale is None:
            scale = q.shape[-1] ** -0.5
        query_mask = key_mask if key_mask is not None and q.shape[-2] == k.shape[-2] else None
        return self.method.attend(
            q,
            k,
            v,
            key_mask=key_mask,
            query_mask=query_mask,
            scale=scale,
            config=self.config,
            state=self.state(),
            dropout=dropout,
        )

    def weights(self, q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None = None, *, scale=None):
        """The dense (B, H, N, S) attention matrix this layer implies (analysis only: O(N * S))."""
        if self.method.weights is None:
            raise NotImplementedError(f"method {self.method.name!r} does not expose its attention weights")
        if scale is None:
            scale = q.shape[-1] ** -0.5
        query_mask = key_mask if key_mask is not None and q.shape[-2] == k.shape[-2] else None
        return self.method.weights(
            q, k, key_mask=key_mask, query_mask=query_mask, scale=scale, config=self.config, state=self.state()
        )

    def extra_repr(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.config.to_dict().items())
        return f"method={self.method.name!r}, layer={self.layer_index}" + (f", {opts}" if opts else "")
