"""``ApproxAttention``: the module attached to each patched attention layer.

It holds the method, its config and the method's state as buffers. The state is part of what the model
computes, so it is in ``state_dict()`` (under ``...approx_attention.<name>``): ``load_state_dict`` between two
models patched alike carries fitted and drawn state over, and loading a patched model's ``state_dict`` into an
unpatched one fails with "unexpected keys" instead of dropping the state silently. The Hugging Face checkpoint
that ``approx.save`` (or ``save_pretrained`` on a patched model) writes leaves these entries out, so it stays
a plain one; the state goes to ``approx_state.safetensors`` beside it. It is plain torch and can be used
without any model, e.g. by the benchmarks::

    layer = ApproxAttention("i-clustered", IClusteredConfig(clusters=100), head_dim=64)
    out = layer(q, k, v, key_mask=mask)   # q, k, v: (B, H, N, d); mask: (B, S) bool, True = real token

``heads`` restricts the method to some of a layer's heads; the others get exact attention (``approx.patch(...,
on_heads=[0, 3])``, and :func:`approx.autotune` when it tunes heads). The method is called with its heads alone, inside
:func:`approx.attention._context.heads`, so that what it draws or assigns per head (BigBird's random blocks, the
clustering's random starts, the Sparse Transformer's even and odd heads) follows the head's index in the layer: a head
computes the same alone as beside the others.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import warnings
from typing import Any

import torch
from torch import nn

from .attention import _context, _fallback
from .config import MethodConfig, as_integer
from .registry import Cost, get_method

__all__ = [
    "ApproxAttention",
    "attention_probe",
    "check_heads",
    "key_mask_of",
    "layer_seed",
    "select_layers",
    "warn_seed_record",
]

# Head index tensors of the layers on some heads, per (heads, device): made once (index_select with a kept index
# took the heads of q, k and v several times faster than indexing with a list, which builds its index every call)
_HEAD_INDEX: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _head_index(heads: list[int], device: torch.device) -> torch.Tensor:
    key = (tuple(heads), device)
    index = _HEAD_INDEX.get(key)
    if index is None:
        with torch.inference_mode(False):  # an ordinary tensor even when first made under inference mode: autograd
            index = _HEAD_INDEX[key] = torch.tensor(key[0], dtype=torch.long, device=device)  # saves it for backward
    return index


def _ordinary(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it that is an ordinary tensor where ``t`` was made under inference mode (which autograd
    refuses to save for backward: a layer holding one could not be trained)."""
    if not t.is_inference():
        return t
    with torch.inference_mode(False):
        return t.clone()


def _pick(x: torch.Tensor, heads: list[int]) -> torch.Tensor:
    """``x[:, heads]`` (a copy, in the order given)."""
    return x.index_select(1, _head_index(heads, x.device))


# Called after an ApproxAttention is unpickled (``torch.load`` of a patched model): approx.integration puts
# the registration of its attention function here, so a model pickled while patched runs in a fresh process.
ON_UNPICKLE: list = []


def _items(value, refusal: str) -> list:
    """An integer as a list of one, an iterable (not a string) as a list; ``ValueError(refusal)`` otherwise."""
    if as_integer(value) is not None:
        return [value]
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(refusal)
    return list(value)


def select_layers(layers, count: int, *, name: str = "layers") -> list[int]:
    """Indices of attention layers, as ``approx.patch`` and ``approx.redraw`` take them: an int or integers
    (negative ones count from the end), or None for all ``count``; sorted. ``ValueError`` naming ``name`` on
    anything else, on an index the model does not have, and on a layer given twice (``[0, 0]``, or ``[5, -1]`` of
    six layers: most likely a slip for another layer, so not merged silently)."""
    if layers is None:
        return list(range(count))
    chosen: dict[int, int] = {}  # layer -> as given
    for item in _items(layers, f"{name} must be an integer, a list of integers or None, got {layers!r}"):
        i = as_integer(item)
        if i is None:
            raise ValueError(f"{name} must be integers, got {item!r}")
        j = i + count if i < 0 else i
        if not 0 <= j < count:
            raise ValueError(f"layer {i} does not exist: the model has {count} attention layers (0..{count - 1})")
        if j in chosen:
            given = f"{i}" if chosen[j] == i else f"{chosen[j]} and {i}"
            raise ValueError(f"{name}: layer {j} is given twice ({given}); give each layer once")
        chosen[j] = i
    if not chosen:
        raise ValueError(f"{name} is empty: name at least one layer, or pass None for all")
    return sorted(chosen)


def check_heads(heads, count: int | None = None) -> tuple[int, ...] | None:
    """The heads a method runs on, as a sorted tuple (None: every head). ``ValueError`` on anything but a non-empty
    list of distinct head indices; with ``count`` (the layer's heads) a negative index counts from the end, as
    ``layers`` does, and a head the layer does not have is refused, naming those it has."""
    if heads is None:
        return None
    chosen: dict[int, Any] = {}
    for item in _items(heads, f"heads must be a list of head indices or None (every head), got {heads!r}"):
        h = as_integer(item)
        if h is None or (h < 0 and count is None):
            raise ValueError(f"heads must be head indices (integers from 0), got {item!r}")
        j = h + count if h < 0 else h
        if count is not None and not 0 <= j < count:
            raise ValueError(f"head {h} does not exist: the layer has {count} heads (0..{count - 1})")
        if j in chosen:
            given = f"{h}" if chosen[j] == h else f"{chosen[j]} and {h}"
            raise ValueError(f"heads: head {j} is given twice ({given}); give each head once")
        chosen[j] = h
    if not chosen:
        raise ValueError("heads is empty: name at least one head, or pass None for every head")
    return tuple(sorted(chosen))


def layer_seed(seed: int, layer_index: int) -> int:
    """Seed of one layer's state: different per layer, independent of which other layers are patched."""
    return (seed * 1_000_003 + layer_index * 7_919 + 17) % (2**63 - 1)


# an additive mask's value at most this is a masked key: its weight exp(score + value) is 0 beside an unmasked key's
# (transformers uses the dtype's minimum; BERT's original "extended" masks -10000)
MASKED_AT = -1000.0


def _additive_allowed(m: torch.Tensor) -> torch.Tensor:
    """An additive float mask (0: attend; at most :data:`MASKED_AT`, -inf included: masked) as booleans; any other
    value is a soft bias on the scores, which no approximation here can add, and is refused."""
    allowed = m == 0
    if not bool((allowed | (m <= MASKED_AT)).all()):
        other = m[~(allowed | (m <= MASKED_AT))].flatten()[0].item()
        raise ValueError(
            "approx attention supports key-padding masks only; this additive mask holds "
            f"{other:g}, neither 0 (attend) nor a masking value (at most {MASKED_AT:g}: -10000, the dtype's minimum, "
            "-inf): a bias on the scores, which the approximations cannot add"
        )
    return allowed


def checked_key_mask(key_mask: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor | None:
    """A key-padding mask given to a layer: (B, S) bool, True at a real key, as it is (a (1, S) mask, one for the whole
    batch, expanded to (B, S): the block-sparse, LSH and Monarch methods read a mask per batch row, and had failed
    inside on it or, the Sparse Transformer, returned wrong rows); a tokenizer's 0/1 integer ``attention_mask`` as
    bool; anything else refused, saying what it is (a float mask may be additive, 0 at a real key, and read as 0/1 it
    would turn padding into keys)."""
    if key_mask is None:
        return None
    want = (k.shape[0], k.shape[-2])
    if tuple(key_mask.shape) not in (want, (1, want[1])):
        raise ValueError(
            f"key_mask: a (B, S) = {want} mask (or (1, S), shared by the batch), True at the real keys, got shape "
            f"{tuple(key_mask.shape)}"
        )
    if key_mask.shape[0] != want[0]:  # (1, S) for a batch: (B, S), as the methods read a mask
        key_mask = key_mask.expand(want).contiguous()
    if key_mask.dtype == torch.bool:
        return key_mask
    if key_mask.is_floating_point() or key_mask.is_complex():
        raise TypeError(
            f"key_mask: a bool mask, True at the real keys (or a tokenizer's 0/1 attention_mask), got {key_mask.dtype}: "
            "a float mask may be additive (0 at a real key, -inf at padding); give mask.bool() of a 0/1 one"
        )
    if not bool(((key_mask == 0) | (key_mask == 1)).all()):
        raise ValueError("key_mask: an integer mask holds 0 (padding) and 1 (a real key) only")
    return key_mask.to(torch.bool)


def finite_padding(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``x`` (B, H, S, d) with its non-finite entries at padded positions (``mask`` (B, S) or (1, S) False) set to 0;
    ``x`` itself where it is all finite (on the CPU: checked by its sum, one pass, as there a check costs no
    synchronisation; a sum that overflows only takes the longer way). What a model leaves at padding reaches no real
    row through any method this way, in the backward pass as well: a padded query's NaN score row had crashed
    entmax's sort, and an inf padded key or query, whose masked product is 0 in the forward, gave 0 * inf = NaN
    gradients to the real tokens. Finite padding is left as it is, to the bit."""
    if mask is None:
        return x
    if x.device.type == "cpu" and bool(torch.isfinite(x.sum())):  # (one pass, nothing allocated: all finite)
        return x
    bad = ~torch.isfinite(x)
    bad &= ~mask[:, None, :, None]
    return x.masked_fill(bad, 0.0)


def _fit_sample(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float, *rest: Any) -> tuple:
    """A fit's sample (q, k, key mask, scale, and Linformer's values) as the forward reads its inputs: the mask checked
    and made (B, S) bool (:func:`checked_key_mask`), and what a model leaves at padding, inf and NaN included, set
    to 0 (:func:`finite_padding`), so that it fits as finite padding does."""
    mask = checked_key_mask(mask, k)
    rest = tuple(finite_padding(x, mask) if isinstance(x, torch.Tensor) and x.dim() == 4 else x for x in rest)
    return finite_padding(q, mask if q.shape[-2] == k.shape[-2] else None), finite_padding(k, mask), mask, scale, *rest


def key_mask_of(attention_mask: torch.Tensor | None, batch: int, s: int) -> torch.Tensor | None:
    """Whatever mask an attention function is passed (2-D, or a boolean or additive 4-D mask) -> (B, S) bool key-padding
    mask, or None (no padding). A 4-D mask is padding when every query row allows the same keys, or none at all on a
    padded query (``m[:, None, :, None] & m[:, None, None, :]``, the "3-D" padding mask of the original BERT): the
    keys are those the rows allow. A padded query's output is then what a 2-D mask gives it (the real keys'
    attention), not the zeros or uniform weights of a row with nothing to attend; no real query is affected."""
    if attention_mask is None:
        return None
    m = attention_mask
    if m.dim() == 2:
        return m.to(torch.bool)
    if m.dim() != 4:
        raise ValueError(f"approx attention: unexpected attention mask of shape {tuple(m.shape)}")
    if m.dtype == torch.bool or not m.is_floating_point():  # an integer mask is 0/1, as a 2-D one is read
        allowed = m.to(torch.bool)
    else:
        allowed = _additive_allowed(m)
    key = allowed[:, :1, :1, :]  # (B, 1, 1, S)
    if allowed.shape[1] > 1 or allowed.shape[2] > 1:
        if not bool((allowed == key).all()):
            key = allowed.any(2, keepdim=True)[:, :1]  # the keys some query row allows
            rows = allowed.any(-1)  # (B, H, N): query rows that allow a key
            padding = bool(((allowed == key) | ~rows[..., None]).all()) and bool((allowed.any(2) == key[:, :, 0]).all())
            if padding:  # a query row with no key: a padded position's (cross-attention: none can be told padded)
                same = allowed.shape[2] == allowed.shape[3]
                padding = bool((rows | ~key[:, :, 0]).all()) if same else bool(rows.all())
            if not padding:
                raise ValueError(
                    "approx attention supports key-padding masks only; this (B, H, N, S) mask differs between "
                    "queries or heads beyond padding (a causal or custom attention pattern), which the approximations "
                    "cannot honour"
                )
    return key[:, 0, 0, :].expand(batch, s)


def _same_draw(drawn: torch.Tensor, held: torch.Tensor) -> bool:
    """Whether ``held`` is the state ``drawn`` anew from the same seed: integers exactly; floats to a relative 1e-4,
    since a draw through a QR factorisation (FAVOR+'s orthogonal features) differs in its last bits between BLAS
    builds, CPUs and thread counts (another seed draws other numbers altogether)."""
    drawn = drawn.to(held.device)
    if drawn.shape != held.shape:
        return False
    if not held.is_floating_point():
        return torch.equal(drawn.to(held.dtype), held)
    return torch.allclose(drawn.double(), held.double(), rtol=1e-4, atol=1e-6)


def warn_seed_record(layers: list[ApproxAttention]) -> None:
    """Warn when state loaded into ``layers`` (``load_state_dict``, :func:`approx.load_method_state`) was not drawn
    from their ``seed`` option, which :func:`approx.settings` and :func:`approx.save` go on recording."""
    wrong = [layer for layer in layers if not layer.seed_draws_state()]
    if not wrong:
        return
    seeds = sorted({layer.config.seed for layer in wrong})
    said = ", ".join(map(str, seeds))
    where = ", ".join(str(layer.layer_index) for layer in wrong)
    warnings.warn(
        f"approx: the {', '.join(sorted({layer.method.name for layer in wrong}))} state loaded into "
        f"layer{'s' if len(wrong) > 1 else ''} {where} was not drawn from its seed "
        f"option ({said}); approx.settings and approx.save go on recording seed {said}, from which approx.patch would "
        "draw other state (the loaded state is kept and saved). If approx.redraw(model, seed=S) drew it (a "
        "RedrawSchedule draws seed + k), calling approx.redraw(model, seed=S) again records S and draws the same state",
        UserWarning,
        stacklevel=3,
    )


class ApproxAttention(nn.Module):
    def __init__(
        self,
        method: str,
        config: MethodConfig | None = None,
        *,
        head_dim: int,
        layer_index: int = 0,
        heads=None,
    ) -> None:
        super().__init__()
        self.method = get_method(method)
        if config is None:
            config = self.method.config_class()
        if not isinstance(config, self.method.config_class):
            raise TypeError(f"{method!r} expects a {self.method.config_class.__name__}, got {type(config).__name__}")
        self.config = config
        self.head_dim = head_dim
        self.layer_index = layer_index
        self.heads = self._checked_heads(heads)
        if self.method.init_state is not None:
            seed = layer_seed(getattr(config, "seed", 0), layer_index)
            with torch.inference_mode(False):  # ordinary tensors, even when made under inference mode: a layer made
                drawn = self.method.init_state(config, head_dim=head_dim, seed=seed)  # there (autotune's) still trains
            for name, tensor in drawn.items():
                self.register_buffer(name, tensor)

    def _apply(self, fn, recurse: bool = True):
        """``model.to(...)``, ``.half()``, ``.bfloat16()``: the method's state moves with the model but is not rounded to
        half precision (a model patched in float32 and then cast kept bfloat16 features and planes, while the same
        model patched after the cast keeps them in float32, the precision they are drawn and fitted in; the methods
        compute in float32 for half inputs anyway). Casts to float64 apply."""
        before = {name: t for name, t in self._buffers.items() if t is not None and t.is_floating_point()}
        with torch.inference_mode(False):  # moved under inference mode (approx.patch onto a GPU there): still ordinary
            super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new.dtype in (torch.float16, torch.bfloat16) and old.dtype not in (torch.float16, torch.bfloat16):
                self._buffers[name] = old.to(device=new.device)
        return self

    def __getstate__(self) -> dict:
        return {**self.__dict__, "method": self.method.name}  # pickled by name: the registry holds the functions

    def __setstate__(self, state: dict) -> None:
        # pickled before heads existed: every head
        super().__setstate__({"heads": None, **state, "method": get_method(state["method"])})
        for hook in ON_UNPICKLE:
            hook()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
        # through load_state, not in-place copies: fitted state replaces its empty placeholders (shapes differ)
        mine = self.state()
        given = {n: state_dict[prefix + n] for n in mine if prefix + n in state_dict}
        missing.extend(prefix + n for n in mine if n not in given)
        unexpected.extend(k for k in state_dict if k.startswith(prefix) and k[len(prefix) :] not in mine)
        if len(given) == len(mine):
            try:
                self.load_state({n: t.detach() for n, t in given.items()})
            except ValueError as e:
                errors.append(f"{prefix[:-1]}: {e}")
            else:
                warn_seed_record([self])

    def state(self) -> dict[str, torch.Tensor]:
        """The method's state tensors (random planes, features, fitted projections...)."""
        return dict(self.named_buffers(recurse=False, remove_duplicate=False))  # two names may share a tensor

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the state tensors (e.g. from a saved model); names and shapes must match."""
        mine = self.state()
        if set(state) != set(mine):
            raise ValueError(f"state of {self.method.name!r} has {sorted(mine)}, got {sorted(state)}")
        for name, tensor in state.items():
            want = mine[name]
            if want.numel() == 0 and want.dim() > 0 and want.shape[0] == 0:
                # a placeholder of fitted state, (0, ...): one entry per head once fitted, the rest as the options say
                # (Linformer's projections and length, Sparsefinder's projection size and clusters)
                if tensor.dim() != want.dim() or tensor.shape[1:] != want.shape[1:]:
                    raise ValueError(
                        f"state {name!r}: expected shape (heads, {', '.join(map(str, want.shape[1:]))}) for these "
                        f"options ({self.config}), got {tuple(tensor.shape)}"
                    )
            elif tensor.shape != want.shape:
                raise ValueError(f"state {name!r}: expected shape {tuple(want.shape)}, got {tuple(tensor.shape)}")
        made: dict[int, torch.Tensor] = {}  # a tensor two names share stays shared
        for name, tensor in state.items():
            if id(tensor) not in made:
                made[id(tensor)] = _ordinary(tensor.to(mine[name].device))
            setattr(self, name, made[id(tensor)])

    @property
    def seeded(self) -> bool:
        """Whether the config's ``seed`` option draws the state: drawn state, a ``seed`` option, and one the other
        options read (not BigBird's without random blocks, nor Linformer's segment means: ``MethodConfig.unused``)."""
        names = self.config.option_names()
        return self.drawn_state and "seed" in names and "seed" not in self.config.unused()

    def seed_draws_state(self) -> bool:
        """Whether the state is what the config's ``seed`` option draws for this layer (:meth:`redraw`); True where
        no seed option draws it (no state, fitted state, no seed option, a seed the other options leave unused)."""
        if not self.seeded:
            return True
        seed = layer_seed(self.config.seed, self.layer_index)
        mine = self.state()
        drawn = self.method.init_state(self.config, head_dim=self.head_dim, seed=seed)
        return all(_same_draw(t, mine[n]) for n, t in drawn.items())

    @property
    def drawn_state(self) -> bool:
        """Whether the method's state is drawn from a seed (what :meth:`redraw` draws anew), not fitted or absent."""
        return self.method.init_state is not None and not self.method.requires_fit(self.config)

    def redraw(self, seed: int) -> None:
        """Draw the method's random state anew from ``seed`` (e.g. FAVOR+ features during fine-tuning).
        Fitted state (``approx.fit``) is learned, not random, and is kept."""
        if not self.drawn_state:
            return
        old = self.state()
        with torch.inference_mode(False):  # ordinary tensors (see __init__)
            drawn = self.method.init_state(self.config, head_dim=self.head_dim, seed=seed)
            for name, t in drawn.items():
                setattr(self, name, t.to(device=old[name].device, dtype=old[name].dtype))

    def fit(self, samples: list, **options) -> None:
        """Learn the method's state from ``samples`` = [(q, k, key_mask, scale), ...] of this layer (the model's
        own queries and keys, see ``approx.fit``); ``options`` go to the method's fit function. A config of a fitted
        method whose state is not learned (``Method.requires_fit`` false, e.g. Linformer's ``mean``) has nothing to
        fit: it warns and changes nothing."""
        if not self.method.needs_fit:
            raise ValueError(f"method {self.method.name!r} has no fitted state")
        if not self.method.requires_fit(self.config):
            warnings.warn(
                f"{self.method.name}: nothing to fit with these options ({self.config}): its state is not learned",
                UserWarning,
                stacklevel=2,
            )
            return
        old = self.state()
        samples = [_fit_sample(*sample) for sample in samples]
        for name, t in self.method.fit(self.config, old, samples, **options).items():
            setattr(self, name, t.to(device=old[name].device))

    def with_heads(self, heads) -> ApproxAttention:
        """This layer (the same config and state tensors, shared) with its method on ``heads`` only (None: every
        head), the other heads exact."""
        chosen = self._checked_heads(heads)
        other = ApproxAttention.__new__(ApproxAttention)
        nn.Module.__init__(other)
        other.method, other.config, other.head_dim, other.layer_index = (
            self.method, self.config, self.head_dim, self.layer_index,
        )  # fmt: skip
        other.heads = chosen
        for name, tensor in self.state().items():
            other.register_buffer(name, tensor)
        return other

    def _checked_heads(self, heads) -> tuple[int, ...] | None:
        """``heads`` as :func:`check_heads` gives them, refused for a method with fitted state (learned for every
        head of the layer)."""
        chosen = check_heads(heads)
        if chosen is not None and self.method.needs_fit and self.method.requires_fit(self.config):
            raise ValueError(
                f"{self.method.name}: a method on some heads only is not available with fitted state (learned for all "
                "the layer's heads); use a method without fitted state, or every head"
            )
        return chosen

    def _split(self, count: int) -> tuple[list[int], list[int]] | None:
        """The method's heads and the exact ones of a call with ``count`` heads; None when the method has them all."""
        if self.heads is None:
            return None
        if self.heads[-1] >= count:
            raise ValueError(
                f"layer {self.layer_index}: the method is set on heads {list(self.heads)}, and this call has {count} "
                f"heads (0..{count - 1})"
            )
        if len(self.heads) == count:
            return None
        return list(self.heads), [h for h in range(count) if h not in self.heads]

    @staticmethod
    def _join(mine: torch.Tensor, exact: torch.Tensor, split: tuple[list[int], list[int]]) -> torch.Tensor:
        """The method's heads and the exact heads back in the layer's head order (dim 1)."""
        both = split[0] + split[1]
        return _pick(torch.cat([mine, exact], dim=1), sorted(range(len(both)), key=both.__getitem__))

    def graph_stats(self, q, k, key_mask=None, *, scale=None) -> dict[str, torch.Tensor] | None:
        """Counts of the method's predicted attention graph against its gold graph, per head (None if it has none).
        With ``heads``, a head left exact predicts every real pair: its recall is 1 and every query exact."""
        if self.method.stats is None:
            return None
        if scale is None:
            scale = q.shape[-1] ** -0.5
        key_mask = checked_key_mask(key_mask, k)
        query_mask = key_mask if key_mask is not None and q.shape[-2] == k.shape[-2] else None
        q, k = finite_padding(q, query_mask), finite_padding(k, key_mask)

        def stats(heads):
            with _context.heads(None if isinstance(heads, slice) else heads):
                return self.method.stats(
                    q[:, heads], k[:, heads], key_mask=key_mask, query_mask=query_mask, scale=scale,
                    config=self.config, state=self.state(),
                )  # fmt: skip

        split = self._split(q.shape[1])
        if split is None:
            return stats(slice(None))
        mine, exact = stats(split[0]), stats(split[1])  # the exact heads' gold graph and real pairs
        exact = {**exact, "predicted": exact["valid"], "hit": exact["gold"], "exact": exact["queries"]}
        order = torch.tensor(split[0] + split[1]).argsort()
        return {
            name: torch.cat([mine[name], exact[name]]).index_select(0, order.to(mine[name].device)) for name in mine
        }

    def costs(self, *, b: int, n: int, key_mask: torch.Tensor | None, d: int, dv: int, heads: int) -> list[Cost]:
        """The cost of one self-attention call with ``heads`` heads, per batch row, summed over the heads: the
        method's cost model on its heads, exact attention's on the others (``matmul_macs`` None where the method
        does not count it). Call it where the forward's context is set, as :meth:`Method.costs`."""
        split = self._split(heads)
        at = dict(b=b, n=n, key_mask=key_mask, d=d, dv=dv)
        mine = self.method.head_costs(self.config, heads=range(heads) if split is None else split[0], **at)
        if split is None:
            return mine
        full = get_method("full")
        exact = full.costs(full.config_class(), **at)
        return [c + f.scaled(len(split[1])) for c, f in zip(mine, exact, strict=True)]

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

        Queries are the same positions as keys, so the key-padding mask is also the query mask. With ``heads``,
        the method runs on those heads and exact attention on the others.
        """
        if torch.is_autocast_enabled(q.device.type):
            # the methods choose their own precision (half inputs computed in float32, in place into buffers of
            # that dtype); autocast would recast their products behind them and fail on those buffers
            with torch.autocast(q.device.type, enabled=False):
                return self.forward(q, k, v, key_mask, scale=scale, dropout=dropout)
        if scale is None:
            scale = q.shape[-1] ** -0.5
        key_mask = checked_key_mask(key_mask, k)
        _fallback.start_call()  # (the rows a breakdown gives exact attention: this call's alone)
        query_mask = key_mask if key_mask is not None and q.shape[-2] == k.shape[-2] else None
        q, k, v = finite_padding(q, query_mask), finite_padding(k, key_mask), finite_padding(v, key_mask)
        split = self._split(q.shape[1])
        if split is None:
            return self.method.attend(
                q, k, v, key_mask=key_mask, query_mask=query_mask, scale=scale, config=self.config,
                state=self.state(), dropout=dropout,
            )  # fmt: skip
        mine, rest = split
        with _context.heads(mine):  # what the method draws per head follows the layer's head index
            out = self.method.attend(
                _pick(q, mine), _pick(k, mine), _pick(v, mine), key_mask=key_mask, query_mask=query_mask,
                scale=scale, config=self.config, state=self.state(), dropout=dropout,
            )  # fmt: skip
        full = get_method("full")
        exact = full.attend(
            _pick(q, rest), _pick(k, rest), _pick(v, rest), key_mask=key_mask, query_mask=query_mask, scale=scale,
            config=full.config_class(), state={}, dropout=dropout,
        )  # fmt: skip
        return self._join(out, exact, split)

    def weights(self, q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None = None, *, scale=None):
        """The dense (B, H, N, S) attention matrix this layer implies (analysis only: O(N * S))."""
        if self.method.weights is None:
            raise NotImplementedError(
                f"method {self.method.name!r} does not expose its attention weights (needed by output_attentions=True)"
            )
        if torch.is_autocast_enabled(q.device.type):  # as in forward: the methods choose their own precision
            with torch.autocast(q.device.type, enabled=False):
                return self.weights(q, k, key_mask, scale=scale)
        if scale is None:
            scale = q.shape[-1] ** -0.5
        key_mask = checked_key_mask(key_mask, k)
        query_mask = key_mask if key_mask is not None and q.shape[-2] == k.shape[-2] else None
        q, k = finite_padding(q, query_mask), finite_padding(k, key_mask)
        split = self._split(q.shape[1])
        heads = split[0] if split is not None else slice(None)
        with _context.heads(split[0] if split is not None else None):
            mine = self.method.weights(
                q[:, heads], k[:, heads], key_mask=key_mask, query_mask=query_mask, scale=scale, config=self.config,
                state=self.state(),
            )  # fmt: skip
        if split is None:
            return mine
        full = get_method("full")
        exact = full.weights(
            q[:, split[1]], k[:, split[1]], key_mask=key_mask, query_mask=query_mask, scale=scale,
            config=full.config_class(), state={},
        )  # fmt: skip
        return self._join(mine, exact, split)

    def extra_repr(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.config.to_dict().items())
        heads = "" if self.heads is None else f", heads={list(self.heads)}"
        return f"method={self.method.name!r}, layer={self.layer_index}{heads}" + (f", {opts}" if opts else "")


class _ProbeEntry:
    """One open block of an :class:`attention_probe` (``source``), closed where the block closes."""

    __slots__ = ("closed", "source")

    def __init__(self, source: attention_probe) -> None:
        self.closed = False
        self.source = source


def _owner() -> tuple[int, int | None]:
    """The thread, and the asyncio task within it, running now: who may open and close an instance's blocks."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no event loop running in this thread
        task = None
    return threading.get_ident(), None if task is None else id(task)


# Callables run after every patched layer of this thread's (context's) forwards: probe(layer, q, k, v, key_mask,
# scale, out); see attention_probe. A context variable, not a list for the process: a probe opened in one thread had
# seen the forwards other threads ran meanwhile (another model's queries and keys in approx.fit's samples).
# An entry is closed where its block closes, so a block closed in another thread than the one that opened it (a
# generator resumed there) is closed in the opening thread too, whose context the closing thread cannot change.
_PROBES: contextvars.ContextVar[tuple[tuple[_ProbeEntry, Any], ...]] = contextvars.ContextVar(
    "approx_probes", default=()
)


def probes() -> tuple[Any, ...]:
    """The probes open in this thread (context), innermost last; an instance open in nested blocks once."""
    out: list[tuple[attention_probe, Any]] = []
    for entry, probe in _PROBES.get():
        if not entry.closed and not any(entry.source is source for source, _ in out):
            out.append((entry.source, probe))
    return tuple(probe for _, probe in out)


class attention_probe:  # noqa: N801 (used as a context manager, like torch.no_grad)
    """Within the block, call ``probe(layer, q, k, v, key_mask, scale, out)`` after every patched layer's
    attention run in this thread (or asyncio context): q/k/v are (B, H, N, d), ``key_mask`` (B, S) bool or None,
    ``out`` the layer's (B, H, N, dv) output. Forwards other threads run meanwhile are not seen; blocks may close in
    any order (each takes out its own probe), and in another thread than the one that opened them (a generator
    resumed there): the probe then stops in the opening thread too. One instance is open in one thread (or asyncio
    task) at a time, nested blocks included (the probe is then called once per layer); entering it from another
    thread or task, even one whose context was copied from it, is refused: make one per block. For measuring
    (attention error, graph statistics), not for changing the output."""

    def __init__(self, probe: Any) -> None:
        self.probe = probe
        self._entries: list[_ProbeEntry] = []  # its open blocks, all of one owner (a stack: it may be nested)
        self._owner: tuple[int, int | None] | None = None

    def __enter__(self) -> Any:
        if self._entries and self._owner != _owner():  # its exit could not tell which owner's block closes
            raise RuntimeError(
                "this attention_probe is open in another thread or task: make one attention_probe(probe) per block"
            )
        self._owner = _owner()
        entry = _ProbeEntry(self)
        self._entries.append(entry)
        _PROBES.set((*_PROBES.get(), (entry, self.probe)))
        return self.probe

    def __exit__(self, *exc: Any) -> None:
        # one of its blocks closes: its blocks are all of one owner, so any of its open entries will do (the last);
        # the other probes' entries are left in their order (blocks of different instances may close out of order:
        # two generators each probing their own forwards). In another thread (a generator resumed there) the entry
        # is marked closed, which the opening thread's context sees, though this thread cannot change it.
        entry = self._entries.pop()
        entry.closed = True
        _PROBES.set(tuple(e for e in _PROBES.get() if e[0] is not entry and not e[0].closed))
