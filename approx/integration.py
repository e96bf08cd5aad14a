"""All the transformers glue: patching, unpatching, saving and loading Hugging Face models.

transformers (>= 5) picks each layer's attention function from ``AttentionInterface`` by
``config._attn_implementation``. We register one function, ``"approx"``, together with a mask function of
the same name that hands it an O(N) key-padding mask of shape (B, 1, 1, S) (a custom name without a mask
function would silently receive ``attention_mask=None``). Patching attaches an :class:`ApproxAttention`
module to every selected attention module; the registered function dispatches on it, and runs exact
attention for layers without one. Nothing here is needed by the method files, and no other module of the
package imports transformers.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import os
import sys
import threading
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import saved
from ._caller import caller_level
from ._version import __version__
from .attention import _blocksparse, _context
from .attention._common import dense_softmax, exact_attention
from .config import MethodConfig
from .layer import (
    ON_UNPICKLE,
    ApproxAttention,
    attention_probe,
    check_heads,
    layer_seed,
    probes,
    select_layers,
    warn_seed_record,
)
from .layer import key_mask_of as _key_mask
from .registry import get_method

__all__ = [
    "attach",
    "attention_modules",
    "ATTENTION_NAME",
    "attention_probe",
    "checkpoint_heads",
    "check_local",
    "check_local_name",
    "is_patched",
    "load",
    "load_method_state",
    "patch",
    "patched_elsewhere",
    "patched_within",
    "question_positions",
    "redraw",
    "RedrawSchedule",
    "restore",
    "save",
    "save_method_state",
    "settings",
    "set_tuning",
    "SUPPORTED_MODEL_TYPES",
    "tuning",
    "unpatch",
    "UnsupportedModelError",
    "load_pretrained",
    "local_layers",
    "local_mode",
    "LOCAL_MODES",
    "saved_layers",
    "saved_local",
]

ATTENTION_NAME = "approx"
_CHILD = "approx_attention"  # attribute name of the ApproxAttention attached to a patched attention module
_ORIGINAL = "_approx_original_attn_implementation"  # attribute on the model
_HOOKS = "_approx_token_hooks"  # attribute on the model: the handles of its hooks (question mask, an outer save)
_TUNING = "_approx_tuning"  # attribute on the model: how approx.autotune chose its layers (written by save)
# attribute on a patched model: the config object it was loaded with, which other models may share (two models made
# from one config, AutoModel.from_config(model.config)); the patched model runs on its own copy (see `_own_config`)
_SHARED_CONFIG = "_approx_shared_config"
# attribute on a patched model: [(config, its copy, the config as it was when patched)] for each config its modules
# hold that is not its own `config` (a composite model's parts: see `_own_stale_configs`)
_STALE_CONFIGS = "_approx_stale_configs"
# attribute on every attention module of a model patched from eager attention: its family's eager function, which a
# layer left unpatched runs again (eager attention's arithmetic differs from SDPA's in the last bits)
_MODULE_ORIGINAL = "_approx_eager_attention"
# attribute on every sliding-window module of a model patched with ``local="band"``: its window computed by approx's
# banded kernel (see `patch`); absent: the model's own attention
_LOCAL = "_approx_local"
LOCAL_MODES = ("model", "band")  # how a patched model's sliding-window layers run (`patch`'s ``local``)
_BAND_BLOCK = 64  # query rows per block of the banded kernel for a local layer (speed only)
# attributes of the mask the mask function hands a sliding-window layer for its band (`_band_keys`): the band's reach,
# and the function that gives the dense (B, 1, N, N) mask transformers' SDPA path builds (built once, when first asked)
_BAND_REACH = "_approx_band_reach"
_BAND_DENSE = "_approx_band_dense"

# Families whose every attention layer is plain bidirectional self-attention routed through
# AttentionInterface in transformers 5 (checked by the test suite on tiny models of each, with every task head the
# family has): no bias added to the scores, no window or other mask pattern beside the key padding. ESM-2, EuroBERT,
# NomicBERT and Jina v3 rotate q and k by their positions (RoPE) before the attention function: the methods see the
# rotated ones, as softmax does. ModernBERT (RoPE too) interleaves sliding-window layers with its full-attention ones:
# approx patches the full-attention layers; the sliding-window ones always run the model's own attention (see
# `local_layers`). Not here, and refused: DeBERTa-v2 and MPNet (relative-position terms in the scores, not routed
# through the interface), and every model type not verified here.
SUPPORTED_MODEL_TYPES = (
    "bert",
    "roberta",
    "distilbert",
    "electra",
    "xlm-roberta",
    "albert",
    "camembert",
    "data2vec-text",
    "ernie",
    "esm",
    "eurobert",
    "jina_embeddings_v3",
    "layoutlm",
    "markuplm",
    "mobilebert",
    "modernbert",
    "nomic_bert",
    "roberta-prelayernorm",
    "roc_bert",
    "splinter",
    "xlm-roberta-xl",
    "xmod",
)


class UnsupportedModelError(ValueError):
    """The model cannot be patched; ``reasons`` lists why."""

    def __init__(self, model: Any, reasons: list[str]) -> None:
        self.reasons = reasons
        name = model if isinstance(model, str) else type(model).__name__  # (a checkpoint, by its path or hub id)
        lines = "\n".join(f"  - {r}" for r in reasons)
        super().__init__(f"cannot patch {name}:\n{lines}")


# ----------------------------------------------------------------------------------------------------------
# the registered attention and mask functions


def _key_padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    **kwargs: Any,
) -> torch.Tensor | None:
    """Mask function for ``AttentionMaskInterface``: (B, S) padding -> (B, 1, 1, S) bool, True = attend."""
    if use_vmap:  # transformers sets it when a model adds its own mask pattern on top of padding
        raise NotImplementedError("approx attention supports key-padding masks only, not custom mask functions")
    if q_offset or kv_offset:
        raise NotImplementedError("approx attention does not support key/value caches")
    from transformers.masking_utils import bidirectional_mask_function, sdpa_mask

    if kwargs.get("local_size") is not None and _symmetric(mask_function):
        # a bidirectional sliding-window layer's mask (ModernBERT's local layers; causal and chunked windows, which
        # transformers asks for with a local size too, are refused below): the band's keys (`_band_keys`), from which
        # `local="band"` computes the window in O(N w) and the layer's own attention gets the dense (B, 1, N, S) mask
        # transformers' SDPA path builds for it, built at its first use (O(N^2): for one sequence of 16k tokens
        # 256 MiB, its build peaking near 4 GiB, about 2 s on 2 threads); that mask itself where the window is
        # another pattern, or None
        args = (batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask)
        dense = functools.partial(
            sdpa_mask, *args, allow_is_bidirectional_skip=allow_is_bidirectional_skip, use_vmap=use_vmap, **kwargs
        )
        reach, built = kwargs["local_size"], None
        if kv_length < reach:  # the window may cover every pair: transformers decides whether the mask is needed
            built = dense()
            if built is None:
                return None
        if q_length != kv_length or not _is_window(mask_function, reach):
            return dense() if built is None else built  # (a mask that is not the band: the layer's own attention)
        return _band_keys(attention_mask, batch_size, kv_length, reach, dense, built, kwargs.get("device"))
    if mask_function is not None and mask_function is not bidirectional_mask_function:
        # a causal, sliding-window or chunked mask: returning the padding alone would drop that pattern silently
        name = getattr(mask_function, "__qualname__", type(mask_function).__name__)
        raise NotImplementedError(
            f"approx attention supports plain bidirectional attention with a key-padding mask only; this model asked "
            f"for another mask pattern ({name}: causal, sliding-window or chunked attention)"
        )
    if attention_mask is None:
        return None
    mask = attention_mask.to(torch.bool)
    if allow_is_bidirectional_skip and bool(mask.all()):
        return None
    return mask[:, None, None, -kv_length:]  # (B, 1, 1, S)


# attention-function arguments of transformers' models that change what softmax is taken over (a sliding window, a
# cap on the scores, attention sinks, causal attention): refused when set (0 included), never ignored
# (and packed sequences' boundaries, which flash attention reads from cu_seq_lens_*: softmax would cross them)
_SCORE_CHANGES = ("sliding_window", "softcap", "s_aux", "sinks", "is_causal", "cu_seq_lens_q", "cu_seq_lens_k")


def _score_changes(kwargs: dict[str, Any], but: tuple[str, ...] = ()) -> list[str]:
    """The arguments of :data:`_SCORE_CHANGES` set in ``kwargs`` (0 included), ``but`` those."""
    return [n for n in _SCORE_CHANGES if n not in but and kwargs.get(n) is not None and kwargs.get(n) is not False]


def _attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The function registered as ``"approx"``: (B, H, N, d) tensors in, (B, N, H, dv) out, and the layer's
    dense (B, H, N, S) attention weights when the caller asked for ``output_attentions`` (else None)."""
    if _is_local(module):  # a sliding-window layer: never patched, it runs the model's own attention
        return _own_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    changed = _score_changes(kwargs)
    if changed:  # a window, a cap on the scores, sink logits: softmax over the padded keys would silently drop them
        raise NotImplementedError(
            f"approx attention computes softmax over the real keys only; this layer also passes "
            f"{', '.join(changed)}, which no method here takes into account"
        )
    key_mask = _key_mask(attention_mask, query.shape[0], key.shape[-2])
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    layer = getattr(module, _CHILD, None)
    eager = getattr(module, _MODULE_ORIGINAL, None)
    if layer is None and eager is not None:  # left unpatched in a model loaded with eager attention: as it ran
        additive = None if key_mask is None else _additive(key_mask, query.dtype)[:, None, None, :]
        return eager(module, query, key, value, additive, dropout=dropout, scaling=scale, **kwargs)
    if key.shape[1] != query.shape[1]:  # grouped-query attention (EuroBERT's option): as transformers' repeat_kv,
        groups = query.shape[1] // max(key.shape[1], 1)  # query head h reads key/value head h // groups
        if groups * key.shape[1] != query.shape[1]:
            raise ValueError(f"{query.shape[1]} query heads cannot share {key.shape[1]} key/value heads evenly")
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if layer is None:  # a layer left unpatched by `layers=`: exact attention (SDPA, as an sdpa model ran it)
        out = exact_attention(query, key, value, key_mask, scale, dropout)
    else:
        out = layer(query, key, value, key_mask, scale=scale, dropout=dropout)
        for probe in probes():
            probe(layer, query, key, value, key_mask, scale, out)
    weights = None
    if _attentions_requested():  # O(N * S), as eager attention: only when asked for
        exact = layer is None
        weights = (
            dense_softmax(query, key, key_mask, scale) if exact else layer.weights(query, key, key_mask, scale=scale)
        ).to(query.dtype)  # (methods compute float16/bfloat16 weights in float32: the model's dtype, as eager gives)
    return out.transpose(1, 2).contiguous(), weights


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as the additive one eager attention adds to its scores: 0 or the dtype's
    most negative number."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def _symmetric(mask_function: Any, size: int = 12) -> bool:
    """Whether a transformers mask function (batch, head, query, key) -> bool is the same with query and key swapped
    on a few positions: a bidirectional window is, a causal or chunked causal one is not."""
    if mask_function is None:
        return False
    zero, idx = torch.zeros((), dtype=torch.long), torch.arange(size)
    grid = torch.as_tensor(mask_function(zero, zero, idx[:, None], idx[None, :])).expand(size, size)
    return bool(torch.equal(grid, grid.T))


def _is_window(mask_function: Any, reach: Any) -> bool:
    """Whether a transformers mask function (batch, head, query, key) -> bool is the band |i - j| <= ``reach`` (the
    pattern `local="band"` computes): it must be transformers' own bidirectional sliding-window function for that
    reach, built as transformers builds it (:func:`_same_function`: a window of any other shape, or one a caller
    wrote, gets its dense mask and the layer's own attention), and that function must read as that band
    (:func:`_window_convention`, checked once per reach: a transformers release that moved its convention by one
    would be seen)."""
    from transformers.masking_utils import sliding_window_bidirectional_mask_function

    if not isinstance(reach, int) or isinstance(reach, bool) or reach < 0:
        return False
    transformers_window = sliding_window_bidirectional_mask_function(reach)
    return _same_function(mask_function, transformers_window) and _window_convention(reach)


def _same_function(a: Any, b: Any) -> bool:
    """Whether two functions are the same code over the same captured values (closures compared the same way, at
    any depth; other values by type and equality): two calls of one factory with one argument are."""
    if a is b:
        return True
    code = getattr(a, "__code__", None)
    if code is None or code is not getattr(b, "__code__", None) or a.__defaults__ != b.__defaults__:
        return False
    cells_a, cells_b = a.__closure__ or (), b.__closure__ or ()
    return len(cells_a) == len(cells_b) and all(
        _same_value(x.cell_contents, y.cell_contents) for x, y in zip(cells_a, cells_b, strict=True)
    )


def _same_value(x: Any, y: Any) -> bool:
    if callable(x) or callable(y):
        return _same_function(x, y)
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return len(x) == len(y) and all(_same_value(u, v) for u, v in zip(x, y, strict=True))
    return type(x) is type(y) and bool(x == y)


@functools.cache
def _window_convention(reach: int) -> bool:
    """Whether transformers' bidirectional sliding-window function for ``reach`` allows exactly the pairs with
    |i - j| <= reach, on every pair of max(2 reach + 3, 512) positions (each offset up to past the band's reach on
    every side, and far from it), for two batch and head indices: computed once per reach, 64 rows at a time (a
    reach of 4096 takes about a second and a few MiB; ModernBERT-base's 64, milliseconds)."""
    from transformers.masking_utils import sliding_window_bidirectional_mask_function

    window = sliding_window_bidirectional_mask_function(reach)
    size = max(2 * reach + 3, 512)
    idx = torch.arange(size)
    for start in range(0, size, 64):
        rows = idx[start : start + 64, None]
        want = (rows - idx[None, :]).abs() <= reach
        for b, h in ((0, 0), (1, 3)):
            got = torch.as_tensor(window(torch.tensor(b), torch.tensor(h), rows, idx[None, :]))
            if not torch.equal(got.expand_as(want), want):
                return False
    return True


def _band_keys(padding, batch_size, n, reach, dense, built, device) -> torch.Tensor:
    """What the mask function hands a sliding-window layer whose window is the band |i - j| <= ``reach``: its keys
    (B, 1, 1, N) bool, True = real, marked with the reach (`local="band"` computes the band from them, and only from
    a mask so marked: a mask the caller made, which transformers passes through as it is, is not), and with the
    dense mask transformers' SDPA path builds, ``built`` or built by ``dense()`` when first asked for
    (:func:`_dense_mask`)."""
    if padding is None:
        keys = torch.ones(batch_size, 1, 1, n, dtype=torch.bool, device=device)
    else:
        keys = padding.to(torch.bool)[:, None, None, -n:].expand(batch_size, 1, 1, n)
    setattr(keys, _BAND_REACH, reach)
    setattr(keys, _BAND_DENSE, (lambda: built) if built is not None else functools.cache(dense))
    return keys


def _dense_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The mask as the layer's own attention takes it: a sliding-window layer's band keys (:func:`_band_keys`) as
    the dense mask transformers' SDPA path builds (built once, then kept with the keys: the model's sliding-window
    layers share them), any other mask as it is."""
    dense = getattr(mask, _BAND_DENSE, None)
    return mask if dense is None else dense()


def _is_local(module: nn.Module) -> bool:
    """Whether an attention module attends within a sliding window (ModernBERT's local layers set ``sliding_window``;
    its full-attention layers and every other supported family leave it None or unset)."""
    return getattr(module, "sliding_window", None) is not None


def _own_attention(module, query, key, value, attention_mask, *, dropout, scaling, **kwargs):
    """A sliding-window layer as the model ran it before it was patched: its family's eager function on the additive
    mask eager attention takes, for a model loaded with eager attention; else transformers' SDPA function on the
    boolean mask its SDPA path builds (:func:`_dense_mask` builds it from the band's keys the mask function hands
    such a layer), so the same numbers. With ``local="band"`` (`patch`), the same window by approx's banded kernel
    from the keys where it can run the call (the dense mask then built only for the attention weights, if asked
    for)."""
    band = _band_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if band is not None:
        weights = _window_weights(query, key, _dense_mask(attention_mask), scaling) if _attentions_requested() else None
        return band, weights
    attention_mask = _dense_mask(attention_mask)
    eager = getattr(module, _MODULE_ORIGINAL, None)
    if eager is not None:
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            attention_mask = _additive(attention_mask, query.dtype)
        return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, weights = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    if weights is None and _attentions_requested():  # every layer's weights, as the patched layers give theirs
        weights = _window_weights(query, key, attention_mask, scaling)
    return out, weights


def _window_weights(query, key, attention_mask, scaling) -> torch.Tensor:
    """A sliding-window layer's dense attention weights (B, H, N, S), from its mask (``output_attentions``). Masked
    pairs get the most negative number, as eager attention's additive mask gives them: a padded query whose window
    holds no real key gets weights spread over every key, as eager attention's, rather than NaN."""
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * (scaling or query.shape[-1] ** -0.5)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    elif attention_mask is not None:  # an additive mask the caller made
        scores = scores + attention_mask.float()
    return torch.softmax(scores, dim=-1).to(query.dtype)


def _window_reach(module: nn.Module) -> int | None:
    """How far a sliding-window layer's queries reach on each side (the mask's |i - j| <= reach): the ``sliding_window``
    of its config, which transformers' bidirectional sliding-window mask reads (ModernBERT: ``local_attention // 2``;
    the module's own ``sliding_window`` is one more, flash attention's convention). None: not readable."""
    reach = getattr(getattr(module, "config", None), "sliding_window", None)
    return reach if isinstance(reach, int) and not isinstance(reach, bool) and reach >= 0 else None


def _band_attention(module, query, key, value, attention_mask, *, dropout, scaling, **kwargs) -> torch.Tensor | None:
    """A ``local="band"`` layer's output (B, N, H, dv) in O(N w) rather than the O(N^2) of SDPA on the dense band
    mask, the same softmax over the same keys (equal to rounding): in inference by approx's banded kernel
    (:mod:`approx.attention._band`); in training mode, with gradients tracked or with attention dropout (which the
    banded kernel does not do) by its training form (:func:`approx.attention._band.attend_with_gradients`:
    differentiable, attention dropout applied as transformers' functions apply it, its chunks checkpointed so that
    autograd keeps O(N d)).
    None where neither runs and the model's own attention does: a layer not set to ``band``, a call on a GPU (not
    measured there: transformers' kernels stay; a warning says so), a mask other than the band's keys (B, 1, 1, N)
    the mask function marked with its reach (:func:`_band_keys`; a mask the caller made, which transformers hands
    such a layer as it is; no mask, where the window covers every pair), or an argument that changes the scores beside
    the window (a cap, sinks: the model's own function takes them into account)."""
    if module.__dict__.get(_LOCAL) != "band" or attention_mask is None:
        return None  # (no mask: transformers skipped it, the window covering every pair; SDPA's own path is fast)
    if query.device.type != "cpu":
        warnings.warn(
            f"approx: local='band' runs approx's banded kernel on the CPU only; the sliding-window layers on "
            f"{query.device} run their own attention",
            stacklevel=caller_level("torch", "transformers"),
        )
        return None
    from .attention import _band

    b, h, n, _ = query.shape
    reach = getattr(attention_mask, _BAND_REACH, None)  # None: not the mask function's band (a caller's own mask)
    if reach is None or key.shape[1] != h or key.shape[2] != n or _score_changes(kwargs, but=("sliding_window",)):
        return None
    if tuple(attention_mask.shape) != (b, 1, 1, n):  # (the band's keys: this batch's?)
        return None
    key_mask = attention_mask[:, 0, 0]
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    # training mode even without gradients: reentrant checkpointing runs the forward so, then again with them
    if module.training or _band.unusable(query, key, value, reach=reach, block=_BAND_BLOCK, shared=0, dropout=dropout):
        out = _band.attend_with_gradients(
            query, key, value, reach=reach, block=_BAND_BLOCK, key_mask=key_mask, scale=scale, dropout=dropout
        )
    else:
        out = _band.attend(
            query, key, value, reach=reach, block=_BAND_BLOCK, key_mask=key_mask, shared_keys=None, scale=scale
        )
    return out.transpose(1, 2).to(query.dtype)


def local_mode(model: nn.Module) -> str:
    """How the sliding-window layers of ``model`` run (one of :data:`LOCAL_MODES`): ``"band"`` after
    ``patch(..., local="band")``, else ``"model"`` (their own attention; a model without such layers too). For a
    model that holds a patched one (a task model whose encoder was patched), the patched one's."""
    model = _patched_view(model)
    modules = attention_modules(model) if is_patched(model) else []
    return "band" if any(m.__dict__.get(_LOCAL) == "band" for m in modules) else "model"


def check_local_name(local: Any, where: str = "local") -> None:
    """Refuse a ``local`` that is neither None nor one of :data:`LOCAL_MODES`, listing them (``where``: what it is)."""
    if local is not None and local not in LOCAL_MODES:
        raise ValueError(f"{where}={local!r}: choose one of {', '.join(map(repr, LOCAL_MODES))}")


def check_local(model: nn.Module, modules: list[nn.Module], local: str | None, where: str = "local") -> None:
    """Refuse a ``local`` that is not one of :data:`LOCAL_MODES`, or ``"band"`` for a model without sliding-window
    layers whose window approx can read."""
    check_local_name(local, where)
    if local != "band":
        return
    windows = [m for m in modules if _is_local(m)]
    if not windows:
        raise ValueError(
            f"{where}='band': {type(model).__name__} has no sliding-window layers (approx.local_layers(model) is "
            "empty); 'band' computes those layers' windows (ModernBERT's local layers)"
        )
    unread = sorted(i for i, m in enumerate(modules) if _is_local(m) and _window_reach(m) is None)
    if unread:
        raise ValueError(
            f"{where}='band': the window of layers {unread} of {type(model).__name__} cannot be read (their config "
            "has no integer sliding_window)"
        )


def check_checkpoint_local(name_or_path: str | os.PathLike, local: str | None, where: str = "local") -> None:
    """Refuse ``local="band"`` for a checkpoint whose config has no sliding window before its weights are loaded
    (:func:`check_local` refuses it again, and any other model it cannot run on, once the model is loaded): a
    model without an integer ``sliding_window`` in its config has no window approx can read. A config that cannot be
    read is left to the loading to report."""
    check_local_name(local, where)
    if local != "band":
        return
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError):
        return
    reach = getattr(config, "sliding_window", None)
    if not isinstance(reach, int) or isinstance(reach, bool):
        raise ValueError(
            f"{where}='band': {name_or_path} ({config.model_type}) has no sliding-window layers (its config has no "
            "sliding_window); 'band' computes those layers' windows (ModernBERT's local layers)"
        )


def _set_local(modules: list[nn.Module], local: str | None) -> None:
    """Set ``local`` on the sliding-window modules (None: leave them); warn when ``band`` is set on layers that are
    not on the CPU, where the kernel does not run."""
    if local is None:
        return
    windows = [m for m in modules if _is_local(m)]
    for m in windows:
        if local == "band":
            m.__dict__[_LOCAL] = "band"
        else:
            m.__dict__.pop(_LOCAL, None)
    elsewhere = sorted({str(_device(m)) for m in windows if _device(m).type != "cpu"})
    if local == "band" and elsewhere:
        warnings.warn(
            f"approx: local='band' runs approx's banded kernel on the CPU only; the sliding-window layers on "
            f"{', '.join(elsewhere)} run their own attention there (move the model to the CPU to use it)",
            stacklevel=3,
        )


def local_layers(model: nn.Module) -> list[int]:
    """The attention layers of ``model`` that attend within a sliding window (ModernBERT's local layers): approx
    never patches them (its methods approximate attention over the whole input); they run the model's own windowed
    attention, and ``layers=None`` means every other layer."""
    return [i for i, m in enumerate(attention_modules(model)) if _is_local(m)]


_QUESTION_TOKENS = threading.local()  # per thread: the context tokens of the forwards in progress (a stack)


def question_positions(
    model: nn.Module,
    input_ids: torch.Tensor | None,
    token_type_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The question's positions in a batch for ``model`` (every token before the first SEP, from ``input_ids`` and
    ``config.sep_token_id`` or from ``token_type_ids``; SEPs among the real tokens of ``attention_mask`` only, when
    given), as a patched forward finds them; else what the caller set with ``approx.tokens(question_mask=...)``; None
    when neither has one. See ``approx.attention._context``."""
    config = getattr(model, "config", None)
    sep = getattr(config, "sep_token_id", None)
    if sep is None:  # RoBERTa-style configs name their separator </s> only as eos
        sep = getattr(config, "eos_token_id", None)
    if isinstance(sep, (list, tuple)):  # a config listing several end tokens: none of them is a separator to trust
        sep = None
    question = _context.question_of(input_ids, token_type_ids, sep, attention_mask)
    return _context.question_mask() if question is None else question


def _checkpointing(model: nn.Module) -> bool:
    """Whether ``model`` recomputes its layers in the backward pass (transformers 5 renamed the property; the old
    name warns on every call)."""
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else None
    return bool(getattr(model, name or "is_gradient_checkpointing", False))


def _set_question(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a patched model: :func:`question_positions` of this batch, for the methods that make the
    question global (``window`` with ``question_global``)."""
    _check_routed(model)  # (a string compare: the config changed behind the patch, e.g. through an inner model)
    if model.training and _checkpointing(model) and _context.question_mask() is None:
        wanting = [i for i, x in patched_layers(model).items() if getattr(x.config, "question_global", False)]
        if wanting and torch.is_grad_enabled():
            raise ValueError(
                f"layers {wanting} make the question global (question_global=True), and gradient checkpointing "
                "recomputes them during the backward pass, after this forward has ended and its question with it: "
                "train without it (model.gradient_checkpointing_disable()), or with question_global=False"
            )
    given = _forward_arguments(model, args, kwargs)
    padding = _padding_of(given.get("attention_mask"))
    question = question_positions(model, given.get("input_ids"), given.get("token_type_ids"), padding)
    stack = getattr(_QUESTION_TOKENS, "stack", None)
    if stack is None:
        stack = _QUESTION_TOKENS.stack = []
    stack.append(_context._QUESTION.set(question))


def _forward_arguments(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of a call of ``model`` by name, whether given by name or by position (``model(ids, mask,
    token_type_ids)``): the names of its ``forward``'s parameters; by name only where they cannot be bound."""
    if not args:
        return kwargs
    try:
        return dict(_forward_signature(type(model)).bind_partial(model, *args, **kwargs).arguments)
    except (TypeError, ValueError):  # (a forward without a signature to read, or a call it would refuse anyway)
        return kwargs


@functools.lru_cache(maxsize=64)
def _forward_signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)


def _padding_of(mask: Any) -> torch.Tensor | None:
    """The real tokens (B, N) of a forward's ``attention_mask``: the mask itself when it is (B, N); from a caller's own
    4D mask, or transformers 5's dict of them per layer type, the key padding the patched layers read from it
    (:func:`approx.layer.key_mask_of`; the first mask that is padding alone); None otherwise (the question is then
    found without it, so padding that shares the SEP id could pass for a separator)."""
    for m in mask.values() if isinstance(mask, dict) else [mask]:
        if isinstance(m, torch.Tensor) and m.dim() == 2:
            return m
        if isinstance(m, torch.Tensor) and m.dim() == 4:
            try:
                return _key_mask(m, m.shape[0], m.shape[-1])
            except ValueError:  # differs between queries (a window, a custom pattern): not padding alone
                continue
    return None


def _reset_question(model: nn.Module, args: tuple, output: Any) -> None:
    stack = getattr(_QUESTION_TOKENS, "stack", None)
    if stack:
        _context._QUESTION.reset(stack.pop())


def _outer_save(model: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict hook of a patched model: warn when transformers saves a model holding it (a task model whose encoder
    was patched, ``model.bert``) and takes its state: that model's ``save_pretrained``, or a Trainer's ``_save``, which
    takes the state dict before it calls ``save_pretrained`` (a compiled model, FSDP). That folder gets the method
    state among its weights but no ``approx_config.json``: it loads with exact attention, and ``approx.load`` cannot
    restore the patch. (A state dict taken by the caller and handed to ``save_pretrained(state_dict=...)`` is not
    seen.)"""
    if not prefix:  # the patched model's own state dict (its own save writes a complete folder: `save`)
        return
    from transformers import PreTrainedModel

    trainer = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)  # (none imported: no Trainer saving)
    frame = sys._getframe(1)
    while frame is not None:
        called = frame.f_code.co_name
        outer = frame.f_locals.get("self") if called in ("save_pretrained", "_save") else None
        if called == "_save":  # a Trainer's: the model it saves (a compiled one's own)
            is_trainer = trainer is not None and isinstance(outer, trainer)
            outer = outer.accelerator.unwrap_model(outer.model, keep_torch_compile=False) if is_trainer else None
        if isinstance(outer, PreTrainedModel) and outer is not model:
            name = next((n for n, m in outer.named_modules() if m is model), prefix.rstrip("."))
            methods = sorted({saved.layer_record(i, layer)["method"] for i, layer in patched_layers(model).items()})
            warnings.warn(
                f"approx: {type(outer).__name__}.save_pretrained saves a model whose {name!r} is patched "
                f"({', '.join(methods)}), but transformers writes no approx_config.json: the folder loads with "
                f"exact attention, and approx.load cannot restore the patch. Patch the model you save "
                f"(approx.patch(model, ...)), or save the patched part with approx.save(model.{name}, folder)",
                UserWarning,
                stacklevel=caller_level("torch", "transformers"),
            )
            return
        frame = frame.f_back


def _attentions_requested() -> bool:
    """Is the model's forward collecting attention weights (``output_attentions=True``)? transformers 5 does not
    tell the attention function; its output collector (private) holds an ``"attentions"`` list while it does.
    Looked up once; if a transformers release moves it, this says no (every forward still runs) and
    ``tests/test_saving.py``'s output_attentions test fails, pointing here."""
    global _collector
    if _collector is None:
        try:
            from transformers.utils.output_capturing import _active_collector as _collector
        except ImportError:
            _collector = False
    collected = _collector.get() if _collector else None
    return collected is not None and "attentions" in collected


_collector: Any = None


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface, AttentionMaskInterface

        AttentionInterface.register(ATTENTION_NAME, _attention_forward)
        AttentionMaskInterface.register(ATTENTION_NAME, _key_padding_mask)
        _registered = True


ON_UNPICKLE.append(_register)  # a patched model unpickled in a fresh process (torch.load) finds "approx"


# ----------------------------------------------------------------------------------------------------------
# finding and checking attention modules

_ROUTING: dict[type, bool] = {}


def _routes_through_registry(cls: type) -> bool:
    """Does this module class pick its attention function from transformers' registry?"""
    if cls not in _ROUTING:
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            source = ""
        _ROUTING[cls] = "ALL_ATTENTION_FUNCTIONS" in source
    return _ROUTING[cls]


def _support_problems(model: nn.Module) -> list[str]:
    import transformers

    reasons = []
    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        reasons.append(
            f"transformers {transformers.__version__} is installed; BERT-family models route attention through "
            "AttentionInterface only from transformers 5"
        )
    if not isinstance(model, transformers.PreTrainedModel):
        return reasons + [f"{type(model).__name__} is not a transformers PreTrainedModel"]
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        reasons.append(f"model type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if not model._can_set_attn_implementation():
        reasons.append(f"{type(model).__name__} does not route its attention through transformers' AttentionInterface")
    if getattr(config, "is_decoder", False):
        reasons.append("the model is a decoder (causal attention), and the methods are for bidirectional attention")
    if getattr(config, "add_cross_attention", False):
        reasons.append("the model has cross-attention layers, which the methods cannot handle")
    return reasons


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's self-attention modules in layer order; ``UnsupportedModelError`` if it cannot be patched.

    ALBERT shares one attention module between all its layers, so it has a single patchable "layer".
    """
    reasons = _support_problems(model)
    if not isinstance(model, nn.Module):  # a name or a path, say: load the model first
        hint = (
            " (a name or a folder: load it first, e.g. AutoModel.from_pretrained(...))"
            if isinstance(model, str)
            else ""
        )
        raise UnsupportedModelError(model, [*reasons[:-1], f"{type(model).__name__} is not a torch module{hint}"])
    found = []
    for name, module in model.named_modules():
        if not _routes_through_registry(type(module)):
            continue
        if getattr(module, "is_causal", False):
            reasons.append(f"{name} ({type(module).__name__}) is causal attention")
        elif "cross" in type(module).__name__.lower():
            reasons.append(f"{name} ({type(module).__name__}) is cross-attention")
        else:
            found.append(module)
    if not found and not reasons:
        reasons.append("no attention module routed through AttentionInterface was found")
    if reasons:
        raise UnsupportedModelError(model, reasons)
    return found


def _head_dim(module: nn.Module, model: nn.Module) -> int:
    for name in ("attention_head_size", "head_dim"):  # BERT's modules name it the first way, Llama-style the second
        size = getattr(module, name, None)
        if isinstance(size, int):
            return size
    return model.config.hidden_size // model.config.num_attention_heads


def _num_heads(model: nn.Module) -> int | None:
    """The attention heads per layer of ``model`` (None where its config does not say)."""
    count = getattr(model.config, "num_attention_heads", None) or getattr(model.config, "n_heads", None)
    return count if isinstance(count, int) else None


def _device(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


# ----------------------------------------------------------------------------------------------------------
# public API


def patch(
    model: nn.Module,
    method: str | MethodConfig,
    *,
    layers: int | Iterable[int] | None = None,
    on_heads: int | Iterable[int] | None = None,
    local: str | None = None,
    **options: Any,
) -> nn.Module:
    """Replace the self-attention of a loaded Hugging Face model by ``method``, in place; returns the model.

    ``layers`` selects attention layers by index (default: all, but a model's sliding-window layers, which keep its
    own attention: see :func:`local_layers`); patch again with other ``layers`` to mix methods. ``on_heads`` runs
    the method on those heads of each selected layer only (default: every head), the other heads keeping exact
    attention (not with fitted state; ``heads`` is an option of some methods, e.g. the
    Sparse Transformer's). ``options`` are the fields of the method's
    config class (see ``approx methods``).

    ``method`` is a method's name, or a config object (``approx.get_method("favor").make_config(features=64)``, as
    :func:`approx.evaluate` takes), whose options ``options`` may override.

    ``local`` says how a model's sliding-window layers run (ModernBERT's local layers; see :func:`local_mode`):
    ``"model"``, their own attention as transformers runs it (bit for bit), or ``"band"``, the same window computed
    by approx's banded kernel in O(N w) time and memory rather than SDPA's O(N^2) on a dense band mask, which is then
    not built (equal to rounding, not to the bit; on the CPU; in training mode, with gradients or with attention
    dropout by the band's training form, :func:`approx.attention._band.attend_with_gradients`; on a GPU, or on a mask
    the caller made, they run their own attention). None (the default) keeps what the model had (``"model"`` at first).

    Raises ``ValueError`` on an unknown method, option, layer or head and
    :class:`UnsupportedModelError` (a ``ValueError``) listing the reasons when the model cannot be patched; on
    any error the model is left as it was.
    """
    if isinstance(method, MethodConfig):  # its options that differ from the defaults, checked as if named
        spec = get_method(method.method)
        if type(method) is not spec.config_class:
            raise TypeError(f"{type(method).__name__} is not {method.method}'s config ({spec.config_class.__name__})")
        config = method.as_given(**options)
    else:
        spec = get_method(method)
        config = spec.make_config(**options)
    modules = attention_modules(model)
    check_local(model, modules, local)
    indices = select_layers(layers, len(modules))
    if layers is None:  # every layer approx can patch: a sliding-window layer keeps the model's own attention
        indices = [i for i in indices if not _is_local(modules[i])]
    chosen = check_heads(on_heads, _num_heads(model))
    new = {
        i: ApproxAttention(spec.name, config, head_dim=_head_dim(modules[i], model), layer_index=i, heads=chosen).to(
            _device(modules[i])
        )
        for i in indices
    }
    _install(model, modules, new)
    _set_local(modules, local)
    return model


def _install(model: nn.Module, modules: list[nn.Module], layers: dict[int, ApproxAttention]) -> nn.Module:
    """Attach ``layers`` (layer index -> module) to the attention ``modules`` of ``model`` and route its attention
    through ``"approx"``, remembering the original implementation the first time."""
    local = sorted(i for i in layers if _is_local(modules[i]))
    if local:  # (every path that attaches layers comes here: patch, restore, load, the harness's layer sets)
        others = [i for i in range(len(modules)) if not _is_local(modules[i])]
        raise ValueError(
            f"layers {local} of {type(model).__name__} attend within a sliding window and keep the model's own "
            f"attention (approx's methods approximate attention over the whole input); the layers approx patches: "
            f"{others} (layers=None selects them all)"
        )
    if not is_patched(model):
        _check_nesting(model, modules)
    _register()
    model.__dict__.pop(_TUNING, None)  # layers changed: a tuning record no longer describes them
    if not is_patched(model):
        _check_stale_configs(model)  # (before anything changes)
        _own_config(model)
        original = model.config._attn_implementation
        model.set_attn_implementation(ATTENTION_NAME)
        _own_stale_configs(model)
        setattr(model, _ORIGINAL, original)
        if original == "eager":
            _keep_eager(modules)
        # instance attributes: `model.save_pretrained` writes a complete approx folder (see `save`), and another
        # attention implementation is refused while patched (it would route around the patched layers, silently)
        model.save_pretrained = functools.partial(_save_pretrained, model)
        model.set_attn_implementation = functools.partial(_set_attn_implementation, model)
        setattr(
            model,
            _HOOKS,
            (
                model.register_forward_pre_hook(_set_question, with_kwargs=True),
                model.register_forward_hook(_reset_question, always_call=True),
                model.register_state_dict_post_hook(_outer_save),
            ),
        )
    for i, layer in layers.items():
        setattr(modules[i], _CHILD, layer)
    return model


def _check_nesting(model: nn.Module, modules: list[nn.Module]) -> None:
    """Refuse to patch ``model`` when a model inside it is patched (``model.bert`` of a task model), or a model
    holding it is (its attention modules carry layers): the two would route one set of attention modules through two
    configs, and ``unpatch`` of either would restore neither."""
    name = patched_within(model)
    if name is not None:
        sub = model.get_submodule(name)
        raise ValueError(
            f"{type(model).__name__}.{name} ({type(sub).__name__}) is already patched by approx: patch one model, "
            f"either it or the {type(model).__name__} that holds it; approx.unpatch(model.{name}) first"
        )
    held = [i for i, m in enumerate(modules) if hasattr(m, _CHILD)]
    if held:
        raise ValueError(
            f"attention layers {held} of {type(model).__name__} are patched through a model that holds it (the "
            "task model around this encoder, say, or one it was copied out of): patch one model, either that one or "
            "this; approx.unpatch that one first, or copy the model before patching it"
        )


def patched_within(model: nn.Module) -> str | None:
    """The name of a patched model inside ``model`` (``"bert"`` of a task model whose encoder was patched), or None."""
    return next((name for name, m in model.named_modules() if m is not model and is_patched(m)), None)


def _patched_view(model: nn.Module) -> nn.Module:
    """``model``, or the patched model inside it when only that one is patched: what the read-only views
    (:func:`settings`, :func:`local_mode`) describe."""
    inner = None if is_patched(model) else patched_within(model)
    return model if inner is None else model.get_submodule(inner)


def patched_elsewhere(model: nn.Module) -> str:
    """For the errors about a model that is not patched: which model around or inside it is (``""``: none; else a
    clause to append, starting with ``"; "``)."""
    inner = patched_within(model)
    if inner is not None:
        return f"; its {inner} is (approx.unpatch(model.{inner}), or approx.save(model.{inner}, ...) to save it)"
    if any(hasattr(m, _CHILD) for m in model.modules()):
        return (
            "; its attention layers are patched through a model that holds it (or that it was copied out of): "
            "unpatch that one, or copy the model before patching it"
        )
    return ""


def _configs(config: Any) -> list[Any]:
    """A transformers config and its sub-configs (``sub_configs``, at any depth), in a fixed order."""
    found, queue = [], [config]
    while queue:
        c = queue.pop(0)
        found.append(c)
        queue.extend(sub for key in getattr(c, "sub_configs", {}) if (sub := getattr(c, key, None)) is not None)
    return found


def _repoint(model: nn.Module, pairs: list[tuple[Any, Any]]) -> None:
    """Every attribute of ``model``'s modules that is the first config of a pair becomes the second."""
    swap = {id(old): new for old, new in pairs}
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if id(value) in swap:
                module.__dict__[name] = swap[id(value)]


def _own_config(model: nn.Module) -> None:
    """Give the model (all its modules) a copy of its config before its attention implementation is set: the config
    object may be shared with other models (transformers makes models from a config without copying it), which would
    then run through approx too, and record it as their own implementation if patched (their `unpatch` could not give
    theirs back). :func:`unpatch` puts the shared object back, with what was set on the copy meanwhile
    (:func:`_carry_back`). While patched, a reference to the config taken before patching no longer steers the
    model: ``model.config`` does."""
    shared = model.config
    own = copy.deepcopy(shared)
    _repoint(model, list(zip(_configs(shared), _configs(own), strict=True)))
    model.__dict__[_SHARED_CONFIG] = (shared, copy.deepcopy(shared))  # (the object, as it was when patched)


def _stale_configs(model: nn.Module) -> list[Any]:
    """The configs that modules of ``model`` hold and that are neither ``model.config`` nor one of its sub-configs, in
    module order. A composite model (``EncoderDecoderModel``, ``VisionTextDualEncoderModel``) sets its own sub-config
    as its parts' ``config`` after they were built: their modules keep the config they were built with, and it is the
    one their attention reads."""
    from transformers import PretrainedConfig

    known, stale = {id(c) for c in _configs(model.config)}, []
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, PretrainedConfig) and id(value) not in known:
                stale.append(value)
                known.update(id(c) for c in _configs(value))
    return stale


def _check_stale_configs(model: nn.Module) -> None:
    """Refuse a model whose modules hold a config (:func:`_stale_configs`) set to another attention implementation than
    ``model.config``: which one its unpatched layers run, and :func:`unpatch` gives back, would be a guess.
    transformers' ``set_attn_implementation`` on a composite model sets its sub-configs, not the configs its parts'
    modules hold, so this is how such a model gets there."""
    original = model.config._attn_implementation
    for config in _stale_configs(model):
        if config._attn_implementation != original:
            raise ValueError(
                f"modules of {type(model).__name__} hold a config other than model.config (a part of a composite "
                f"model, whose modules keep the config they were built with: set_attn_implementation on the "
                f"composite does not reach it), and it runs {config._attn_implementation!r} attention where "
                f"model.config says {original!r}: approx cannot tell which the layers it leaves unpatched should "
                f"run; model.set_attn_implementation({config._attn_implementation!r}) makes them agree again (or "
                "load the model with the implementation you want)"
            )


def _own_stale_configs(model: nn.Module) -> None:
    """Give the modules of ``model`` that hold a config other than its own (:func:`_stale_configs`) a copy of it, set
    to approx's attention: otherwise they go on running their own attention while the model reads as patched (and is
    reported, saved and evaluated as such). :func:`unpatch` puts the objects back, with what was set on the copies
    meanwhile. (:func:`_check_stale_configs` has checked that they run the model's own implementation.)"""
    pairs = []
    for config in _stale_configs(model):
        own = copy.deepcopy(config)
        _repoint(model, list(zip(_configs(config), _configs(own), strict=True)))
        own._attn_implementation = ATTENTION_NAME
        pairs.append((config, own, copy.deepcopy(config)))
    if pairs:
        model.__dict__[_STALE_CONFIGS] = pairs


def _carry_back(own: Any, then: Any, shared: Any) -> None:
    """Set on ``shared`` each attribute that its copy ``own`` (:func:`_own_config`) changed since ``then`` (the config
    as it was when patched), but the attention implementation approx set there; what changed on ``shared`` itself
    meanwhile (through another model sharing it) is kept."""
    before, theirs = vars(then), vars(shared)
    for key, value in vars(own).items():
        if key == "_attn_implementation_internal":
            continue
        try:
            changed = key not in before or not bool(before[key] == value)
        except Exception:  # a value without a plain equality: taken as changed
            changed = True
        if changed:
            theirs[key] = value


def _keep_eager(modules: list[nn.Module]) -> None:
    """Give each attention module of a model loaded with eager attention its own eager function (the module-level
    ``eager_attention_forward`` of its family), which the layers left unpatched run; warn where a family has none
    (those layers then run SDPA: the same softmax, other rounding)."""
    missing = set()
    for module in modules:
        eager = getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)
        if eager is None:
            missing.add(type(module).__name__)
        module.__dict__[_MODULE_ORIGINAL] = eager
    if missing:
        warnings.warn(
            f"approx: {', '.join(sorted(missing))} has no eager_attention_forward to call: its layers left unpatched "
            "run torch's SDPA (the same softmax, rounded otherwise than eager attention)",
            stacklevel=4,
        )


def _set_attn_implementation(model: nn.Module, implementation: Any, allow_all_kernels: bool = False) -> None:
    """A patched model's ``set_attn_implementation``: approx's own is kept; another is refused (it would route the
    attention around the patched layers while the model still reads as patched and saves as such)."""
    wanted = set(implementation.values()) if isinstance(implementation, dict) else {implementation}
    if wanted <= {ATTENTION_NAME}:
        return
    raise ValueError(
        f"{type(model).__name__} is patched by approx: its attention runs through the patched layers, and "
        f"set_attn_implementation({implementation!r}) would route around them; approx.unpatch(model) first (it "
        f"restores {getattr(model, _ORIGINAL)!r}), then set another implementation"
    )


def _check_routed(model: nn.Module) -> None:
    """Refuse a patched model whose attention no longer runs through approx (its config's implementation was changed
    behind the patch): its layers would be reported, saved and evaluated without running."""
    current = model.config._attn_implementation
    if current == ATTENTION_NAME:  # and the copies its modules hold besides (a composite model's part)
        owns = [own._attn_implementation for _, own, _ in model.__dict__.get(_STALE_CONFIGS, ())]
        current = next((c for c in owns if c != ATTENTION_NAME), current)
    if current != ATTENTION_NAME:
        raise ValueError(
            f"{type(model).__name__} was patched by approx, but its attention implementation is now {current!r}, so "
            "the patched layers no longer run: approx.unpatch(model) and patch it again (unpatching restores "
            f"{getattr(model, _ORIGINAL)!r}, the implementation it was patched from: to run {current!r}, set it "
            "after unpatching)"
        )


def is_patched(model: nn.Module) -> bool:
    return hasattr(model, _ORIGINAL)


def unpatch(model: nn.Module) -> nn.Module:
    """Restore the original attention exactly (bit-identical outputs); returns the model."""
    if not is_patched(model):
        raise ValueError(f"{type(model).__name__} is not patched by approx{patched_elsewhere(model)}")
    for module in model.modules():
        if hasattr(module, _CHILD):
            delattr(module, _CHILD)
        module.__dict__.pop(_MODULE_ORIGINAL, None)
        module.__dict__.pop(_LOCAL, None)
    model.__dict__.pop("set_attn_implementation", None)
    kept = model.__dict__.pop(_SHARED_CONFIG, None)
    if kept is not None:  # the config it was loaded with (a copy ran while patched: `_own_config`)
        shared, then = kept
        pairs = list(zip(_configs(model.config), _configs(shared), strict=True))
        for (own, theirs), before in zip(pairs, _configs(then), strict=True):  # what was set on the copy meanwhile
            _carry_back(own, before, theirs)  # (approx.extend_positions' length, say), but the implementation
        _repoint(model, pairs)
    for theirs, own, before in model.__dict__.pop(_STALE_CONFIGS, ()):  # a composite model's part: its modules' own
        _carry_back(own, before, theirs)
        _repoint(model, list(zip(_configs(own), _configs(theirs), strict=True)))
    model.set_attn_implementation(getattr(model, _ORIGINAL))
    delattr(model, _ORIGINAL)
    for handle in getattr(model, _HOOKS, ()):
        handle.remove()
    model.__dict__.pop(_HOOKS, None)
    model.__dict__.pop("save_pretrained", None)
    model.__dict__.pop(_TUNING, None)
    _blocksparse.clear_cache()  # the sparse patterns kept for unpadded inputs (their block masks: MiB to GiB on a GPU)
    return model


def set_tuning(model: nn.Module, record: dict[str, Any]) -> None:
    """Record how the patched layers were chosen (``approx.autotune``); :func:`save` writes it as ``"tuning"``
    in ``approx_config.json``. Patching or unpatching again drops it, and so does :func:`redraw` of a layer whose
    random state it draws (with a warning: the recorded fidelity was measured on the state drawn before)."""
    if not is_patched(model):
        raise ValueError("the model is not patched: nothing to record a tuning for")
    model.__dict__[_TUNING] = record


def tuning(model: nn.Module) -> dict[str, Any] | None:
    """How the patched layers of ``model`` were chosen by ``approx.autotune`` (None when they were not)."""
    return model.__dict__.get(_TUNING)


def patched_layers(model: nn.Module) -> dict[int, ApproxAttention]:
    """Layer index -> attached ApproxAttention, for the patched layers of a model."""
    if not is_patched(model):
        return {}
    return {i: getattr(m, _CHILD) for i, m in enumerate(attention_modules(model)) if hasattr(m, _CHILD)}


def redraw(model: nn.Module, *, seed: int | None = None, layers: Iterable[int] | None = None) -> None:
    """Draw the random state of patched layers anew (hash planes, random features), deterministically from
    ``seed`` (default: drawn from torch's global generator, so ``torch.manual_seed`` fixes it too). ``layers``
    (default: every patched layer) follows the index rules of :func:`patch` and must name patched layers. A redrawn
    layer's ``seed`` option then records ``seed`` (:func:`settings`, :func:`save`): its state is the one
    ``patch(model, method, seed=seed)`` draws."""
    patched = patched_layers(model)
    if not patched:
        raise ValueError(
            f"{type(model).__name__} is not patched by approx: nothing to redraw{patched_elsewhere(model)}"
        )
    chosen = sorted(patched) if layers is None else select_layers(layers, len(attention_modules(model)))
    unpatched = [i for i in chosen if i not in patched]
    if unpatched:
        raise ValueError(f"layers {unpatched} are not patched (patched layers: {sorted(patched)})")
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
    seeded = _seeded_configs({i: patched[i] for i in chosen}, seed)  # a bad seed refused before any state moves
    before = {i: {k: t.clone() for k, t in patched[i].state().items()} for i in seeded} if tuning(model) else {}
    for i in chosen:
        patched[i].redraw(layer_seed(seed, i))
        if i in seeded:
            patched[i].config = seeded[i]
    moved = sorted(i for i, state in before.items() if not _same_state(state, patched[i].state()))
    if moved and model.__dict__.pop(_TUNING, None) is not None:  # its fidelity was measured on the state drawn before
        warnings.warn(
            f"approx.redraw: layers {moved} drew new random state, so approx.autotune's record of this model "
            "(its fidelity, whether the target was met) no longer describes it and is dropped; approx.save writes "
            "none. Tune again to measure the new state",
            UserWarning,
            stacklevel=caller_level(),
        )


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _seeded_configs(layers: dict[int, ApproxAttention], seed: int) -> dict[int, MethodConfig]:
    """The configs with ``seed`` of the layers whose random state :meth:`ApproxAttention.redraw` draws from a seed
    option the other options read (:attr:`ApproxAttention.seeded`; validated: ``ValueError`` naming the option for an
    impossible seed)."""
    return {i: layer.config.replaced(seed=seed) for i, layer in layers.items() if layer.seeded}


def record_redraw_seed(model: nn.Module, seed: int) -> None:
    """Record ``seed`` as the seed of every patched layer whose random state it drew (:func:`redraw`), without
    drawing: for a model whose redrawn state was loaded from a checkpoint (a resumed fine-tuning run)."""
    patched = patched_layers(model)
    for i, config in _seeded_configs(patched, seed).items():
        patched[i].config = config


class RedrawSchedule:
    """Redraw the random state every ``every`` steps of a training loop: call :meth:`step` after each
    optimizer step. Draw ``k`` uses seed ``seed + k``, so a run is reproducible."""

    def __init__(self, model: nn.Module, every: int, *, seed: int = 0) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        if not is_patched(model):  # now, not at the first redraw, after a training step
            raise ValueError(
                f"{type(model).__name__} is not patched by approx: nothing to redraw{patched_elsewhere(model)}"
            )
        self.model, self.every, self.seed, self.steps = model, every, seed, 0

    def step(self) -> bool:
        """Count one step; returns True when it redrew."""
        self.steps += 1
        if self.steps % self.every:
            return False
        redraw(self.model, seed=self.seed + self.steps // self.every)
        return True


def settings(model: nn.Module) -> list[dict[str, Any]]:
    """What each patched layer runs: ``[{"layer": i, "method": name, "config": {...}}, ...]``, with ``"heads"`` on a
    layer whose method runs on some heads only (``[]``: nothing is patched). For a model that holds a patched one
    (a task model whose encoder was patched), the patched one's layers."""
    model = _patched_view(model)
    if is_patched(model):
        _check_routed(model)
    return [saved.layer_record(i, layer) for i, layer in patched_layers(model).items()]


def _saved_digests(path: Path) -> tuple[str | None, str | None] | None:
    """The state and settings digests of the approx folder at ``path`` (None: there is none, or it cannot be read)."""
    try:
        meta = saved.read_settings(path)
    except (FileNotFoundError, ValueError):
        return None
    return meta.get("state_sha256"), meta.get("layers_sha256")


def save(model: nn.Module, path: str | os.PathLike, *, tokenizer: Any = None, **save_pretrained_kwargs: Any) -> Path:
    """Save a patched model: a plain Hugging Face checkpoint (its ``state_dict`` without the methods' state),
    ``approx_config.json`` (the settings of every patched layer), ``approx_state.safetensors`` (the methods'
    state: planes, features, fitted projections; written only when some layer has state; see
    :mod:`approx.saved`) and the ``tokenizer`` when given (``approx eval`` needs it). :func:`load` reads it back.

    ``model.save_pretrained(path)`` on a patched model does the same (Trainer checkpoints included): writing the
    checkpoint alone would drop the patch silently, and refusing would break every tool that saves through it.
    """
    if not is_patched(model):
        elsewhere = patched_elsewhere(model)
        raise ValueError(
            f"the model is not patched{elsewhere}"
            if elsewhere
            else "the model is not patched; use model.save_pretrained for a plain model"
        )
    if save_pretrained_kwargs.get("push_to_hub"):  # transformers would upload before the method's files are written
        raise ValueError(
            "push_to_hub: save the patched model to a folder first, then upload the folder whole "
            "(huggingface_hub.upload_folder(folder_path=..., repo_id=...)): transformers uploads as it saves, "
            "before approx_config.json and the methods' state are written"
        )
    _check_routed(model)  # before anything is written
    if tokenizer is not None:
        saved.check_vocabulary("the tokenizer passed", len(tokenizer), model.get_input_embeddings().num_embeddings)
    path = Path(path)
    before = _saved_digests(path)
    state_dict = save_pretrained_kwargs.pop("state_dict", None)
    state_dict = {k: v for k, v in (model.state_dict() if state_dict is None else state_dict).items()
                  if f".{_CHILD}." not in f".{k}"}  # fmt: skip
    if not save_pretrained_kwargs.get("is_main_process", True):  # (another process writes the folder)
        type(model).save_pretrained(model, path, state_dict=state_dict, **save_pretrained_kwargs)
        return path
    with saved.fresh_weights(path, save_pretrained_kwargs.get("variant")):  # none of an earlier save's weights left
        type(model).save_pretrained(model, path, state_dict=state_dict, **save_pretrained_kwargs)
    saved.write_state(patched_layers(model), path)
    meta = {"approx_version": __version__, "original_attn_implementation": getattr(model, _ORIGINAL)}
    # the model its layer indices count in (restore and saved_layers check it on another model)
    meta.update(model_type=getattr(model.config, "model_type", None), attention_layers=len(attention_modules(model)))
    meta.update(state_sha256=saved.state_digest(path), checkpoint_sha256=saved.checkpoint_digest(path))
    meta["layers"] = settings(model)
    if local_mode(model) != "model":  # how its sliding-window layers run (absent: their own attention)
        meta["local"] = local_mode(model)
    if tuning(model) is not None:
        meta["tuning"] = tuning(model)
    saved.write_settings(path, meta)
    if _saved_digests(path) != before:  # what approx fit / autotune wrote of the state saved here before
        for record in saved.TOOL_RECORDS:
            (path / record).unlink(missing_ok=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def _save_pretrained(model: nn.Module, save_directory: str | os.PathLike, **kwargs: Any) -> None:
    save(model, save_directory, **kwargs)  # `model.save_pretrained` of a patched model


def save_method_state(model: nn.Module, folder: str | os.PathLike) -> Path | None:
    """Write the state of the patched layers to ``folder/approx_state.safetensors``; returns the file, or None
    (and no state file left) when no patched layer has state. :func:`load_method_state` reads it back. A folder
    written by :func:`save` is refused (``ValueError``): its settings record the SHA-256 of its state file, which
    this would change or remove; :func:`save` the model there instead."""
    if saved.is_saved_setting(folder):
        raise ValueError(
            f"{folder} was written by approx.save: its {saved.SETTINGS_FILE} records the SHA-256 of its state file, "
            "which this would change or remove, and approx.load would then refuse the folder; save the whole "
            "model there with approx.save(model, folder), or write the state to another folder"
        )
    return saved.write_state(patched_layers(model), folder)


def load_method_state(model: nn.Module, folder: str | os.PathLike) -> None:
    """Load ``folder/approx_state.safetensors`` into the patched layers of ``model`` (strictly: see
    :func:`approx.saved.read_state`)."""
    layers = patched_layers(model)
    saved.read_state(layers, folder)
    warn_seed_record(list(layers.values()))


def restore(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Patch a loaded model as recorded in ``path`` by :func:`save`, state included. Everything in ``path`` is
    checked before the model is touched: on any error (``ValueError`` or ``FileNotFoundError`` naming the file)
    the model is left exactly as it was. :func:`unpatch` then gives back the implementation the model was
    loaded with (not the one of the model that was saved). A model already patched is refused (``ValueError``):
    its other layers would keep their methods and the result would not be the saved model; :func:`unpatch` it
    first."""
    modules = attention_modules(model)
    layers = _saved_layers(model, modules, path)
    meta = saved.read_settings(path)
    local = meta.get("local")
    check_local(model, modules, local, where=f"{Path(path) / saved.SETTINGS_FILE}: local")
    if is_patched(model):
        mine = ", ".join(f"{e['layer']} {e['method']}" for e in settings(model))
        raise ValueError(
            f"cannot restore {path} onto a model already patched (layers {mine}): the result would not be the "
            "saved model; approx.unpatch(model) first, or approx.load(path) for a fresh copy"
        )
    _install(model, modules, layers)
    _set_local(modules, local)
    record = meta.get("tuning")
    if record is not None:
        set_tuning(model, record)
    return model


def _saved_layers(model: nn.Module, modules: list[nn.Module], path: str | os.PathLike) -> dict[int, ApproxAttention]:
    check_saved_model(model, path, modules=modules)
    _, layers = saved.build_layers(path, [_head_dim(m, model) for m in modules], heads=_num_heads(model))
    return {i: layer.to(_device(modules[i])) for i, layer in layers.items()}


def check_saved_model(model: nn.Module, path: str | os.PathLike, *, modules: list[nn.Module] | None = None) -> None:
    """Refuse a folder saved from a model with another number of attention layers (its layer indices would name
    other layers, and a deeper model would be patched in part, silently); warn where it was saved from another model
    type (the same number of layers and shapes: taken, as a choice). Folders saved before 2026-12-01 record
    neither."""
    modules = attention_modules(model) if modules is None else modules
    meta = saved.read_settings(path)
    file, count, kind = Path(path) / saved.SETTINGS_FILE, meta.get("attention_layers"), meta.get("model_type")
    if count is not None and count != len(modules):
        raise ValueError(
            f"{file}: saved from a model of {count} attention layers ({kind or 'model type not recorded'}), and "
            f"{type(model).__name__} has {len(modules)}: its layer indices would name other layers; patch this model "
            "with approx.patch(model, method, layers=...) instead"
        )
    mine = getattr(getattr(model, "config", None), "model_type", None)
    if kind is not None and mine is not None and kind != mine:
        warnings.warn(
            f"approx: {file} was saved from a {kind!r} model and {type(model).__name__} is {mine!r}: its layers "
            "are patched by index, with their saved state",
            stacklevel=caller_level("torch", "transformers"),
        )


def saved_layers(model: nn.Module, path: str | os.PathLike) -> dict[int, ApproxAttention]:
    """The :class:`ApproxAttention` layers saved in ``path`` (method, options and state, fitted or drawn), built
    for ``model`` without patching it: e.g. a fitted Sparsefinder to evaluate on another checkpoint of the same
    architecture."""
    return _saved_layers(model, attention_modules(model), path)


def load(path: str | os.PathLike, model_class: Any = None, **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a model written by :func:`save` (``model_class`` defaults to ``AutoModel``) and re-patch it. ``path``
    is a local folder; its settings are checked before any weight is read (``FileNotFoundError`` for a missing
    folder or one not written by :func:`save`, ``ValueError`` naming the file for a malformed one).

    Unless ``attn_implementation`` is given, the model is loaded with the implementation the saved model had before
    it was patched, where that is ``eager`` or ``sdpa`` (transformers would otherwise pick its default, sdpa): the
    layers left unpatched then compute as they did in the saved model, to the bit, and :func:`unpatch` gives that
    implementation back."""
    if not Path(path).is_dir():
        raise FileNotFoundError(f"{path}: no such folder (approx.load reads a folder written by approx.save)")
    meta = saved.read_settings(path)
    saved.check_checkpoint(path, meta)
    original = meta.get("original_attn_implementation")
    if original in ("eager", "sdpa") and "attn_implementation" not in from_pretrained_kwargs:
        from_pretrained_kwargs = {**from_pretrained_kwargs, "attn_implementation": original}
    if model_class is None:
        from transformers import AutoModel as model_class
    model = model_class.from_pretrained(str(path), **from_pretrained_kwargs)
    return restore(model, path)


@contextlib.contextmanager
def _loading(name_or_path: str | os.PathLike):
    """transformers' failures to load ``name_or_path`` (``OSError``: no such hub id, the hub unreachable, a folder
    without weights) as one line naming it and where it was looked for; approx's own refusals pass as they are."""
    try:
        yield
    except OSError as e:
        if isinstance(e, FileNotFoundError) and str(name_or_path) in str(e):
            raise
        text = os.fspath(name_or_path)
        if not os.path.exists(text) and (os.path.isabs(text) or text.startswith((".", "~"))):  # a path, not an id
            raise OSError(f"{text}: no such folder") from e
        where = "its folder" if os.path.isdir(text) else "the Hugging Face hub (it is not a folder here)"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].removeprefix("Error ")
        raise OSError(f"{name_or_path}: cannot load it from {where}: {first}") from e


def load_pretrained(
    name_or_path: str | os.PathLike, *, task: str | None = None, progress: bool = True, tokenizer: Any = None, **kwargs
):
    """(model, tokenizer) from a local folder or a hub id. ``task``: None (bare encoder), ``"masked-lm"``,
    ``"sequence-classification"`` or ``"question-answering"``; ``progress=False`` hides the loading bar.
    ``tokenizer``: use this one instead of the folder's. ``ValueError`` when the folder has no tokenizer files
    or the tokenizer's vocabulary does not fit the model's embeddings (never an empty default tokenizer)."""
    import transformers

    if not progress:
        transformers.utils.logging.disable_progress_bar()

    classes = {
        None: transformers.AutoModel,
        "masked-lm": transformers.AutoModelForMaskedLM,
        "sequence-classification": transformers.AutoModelForSequenceClassification,
        "question-answering": transformers.AutoModelForQuestionAnswering,
    }
    if task not in classes:
        raise ValueError(f"unknown task head {task!r}; choose one of {', '.join(map(str, classes))}")
    try:
        with _loading(name_or_path):
            if tokenizer is None:
                if os.path.isdir(name_or_path):
                    saved.check_tokenizer_folder(name_or_path)
                tokenizer = transformers.AutoTokenizer.from_pretrained(name_or_path)
            model = classes[task].from_pretrained(name_or_path, **kwargs)
    except RuntimeError as e:  # transformers' refusal of a head of other sizes: one line, naming what was asked
        if "ignore_mismatched_sizes" not in str(e):
            raise
        asked = ", ".join(f"{k}={v}" for k, v in kwargs.items() if k == "num_labels") or "the task's"
        raise ValueError(
            f"{name_or_path}: its {task or 'encoder'} weights have other sizes than the model asked for ({asked}, e.g. "
            "another number of labels); use it on a task its head fits, or start from a checkpoint without that head "
            "(its encoder: AutoModel.from_pretrained(...).save_pretrained(folder))"
        ) from None
    saved.check_vocabulary(str(name_or_path), len(tokenizer), model.get_input_embeddings().num_embeddings)
    return model, tokenizer


# ----------------------------------------------------------------------------------------------------------
# used by the evaluation harness


def attach(model: nn.Module, layers: dict[int, ApproxAttention], *, local: str | None = None) -> nn.Module:
    """Patch ``model`` with existing :class:`ApproxAttention` modules (e.g. taken from
    :func:`patched_layers` of an earlier patch), keeping their state (fitted or drawn) as it is; ``local`` as in
    :func:`patch`. Each module takes the index of the layer it is attached to as its ``layer_index`` (what
    :func:`approx.fit` and the harness's per-layer statistics file it under, and what its seed draws from in
    :meth:`~approx.layer.ApproxAttention.redraw`); one module attached to two layers is refused."""
    modules = attention_modules(model)
    check_local(model, modules, local)
    select_layers(list(layers), len(modules))
    layers = {(i + len(modules) if i < 0 else i): layer for i, layer in layers.items()}  # (-1: the last layer)
    count = _num_heads(model)
    # one module on two layers, in this call or with a layer it leaves attached, would file both under one index
    seen = {id(layer): i for i, layer in patched_layers(model).items() if i not in layers}
    for i, layer in layers.items():
        if id(layer) in seen:
            raise ValueError(
                f"one ApproxAttention attached to layers {seen[id(layer)]} and {i}: each layer needs its own (its "
                "state and its statistics are per layer); make one per layer (copy.deepcopy(layer) keeps its state)"
            )
        seen[id(layer)] = i
        if getattr(layer, "heads", None) is not None:
            try:
                check_heads(layer.heads, count)
            except ValueError as e:
                raise ValueError(f"layer {i}: {e}") from None
    _install(model, modules, layers)
    for i, layer in layers.items():
        layer.layer_index = i
    _set_local(modules, local)
    return model


def saved_local(path: str | os.PathLike) -> str:
    """How the model saved in ``path`` ran its sliding-window layers (``"local"`` of its ``approx_config.json``;
    ``"model"`` when absent), one of :data:`LOCAL_MODES`: ``ValueError`` naming the file otherwise."""
    local = saved.read_settings(path).get("local", "model")
    check_local_name(local, where=f"{Path(path) / saved.SETTINGS_FILE}: local")
    return local


def checkpoint_heads(name_or_path: str) -> list[str]:
    """The task heads a checkpoint was saved with, from its config's ``architectures`` (e.g.
    ``BertForSequenceClassification`` -> ``["sequence-classification"]``); ``[]`` for a bare encoder."""
    from transformers import AutoConfig

    with _loading(name_or_path):
        config = AutoConfig.from_pretrained(name_or_path)
    return [h for h in map(model_head_from_name, config.architectures or []) if h != "base"]


def check_checkpoint_supported(name_or_path: str) -> None:
    """Refuse a checkpoint of a model type approx cannot patch from its config, before its weights load (and before
    its head is judged: a GPT-2 language model is unsupported, not a model without a task head)."""
    from transformers import AutoConfig

    with _loading(name_or_path):
        config = AutoConfig.from_pretrained(name_or_path)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            name_or_path,
            [f"model type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"],
        )


def model_head_from_name(class_name: str) -> str:
    """``"BertForQuestionAnswering"`` -> ``"question-answering"``; a bare ``...Model`` -> ``"base"``."""
    for suffix, head in _HEADS.items():
        if class_name.endswith(suffix):
            return head
    return "base"


_HEADS = {
    "ForSequenceClassification": "sequence-classification",
    "ForQuestionAnswering": "question-answering",
    "ForMaskedLM": "masked-lm",
}


# config keys of the dropout on attention probabilities: BERT, RoBERTa, ELECTRA, XLM-R, CamemBERT and ALBERT name it
# the first way, DistilBERT the second
ATTENTION_DROPOUT_KEYS = ("attention_probs_dropout_prob", "attention_dropout")


def attention_dropout_key(config: Any) -> str:
    """The name of ``config``'s attention-probability dropout (one of :data:`ATTENTION_DROPOUT_KEYS`); ValueError
    naming what is looked for when it has none."""
    for key in ATTENTION_DROPOUT_KEYS:
        if isinstance(getattr(config, key, None), (int, float)):
            return key
    raise ValueError(
        f"{type(config).__name__} has no attention dropout setting (looked for {', '.join(ATTENTION_DROPOUT_KEYS)}); "
        f"its attention dropout cannot be overridden"
    )


def own_attention_dropout(name_or_path: str | os.PathLike) -> tuple[str, float]:
    """(config key, value) of the attention-probability dropout a checkpoint's config sets (see
    :func:`attention_dropout_key`): what a load with ``**{key: p}`` overrides, and what a saved copy should keep."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(name_or_path)
    key = attention_dropout_key(config)
    return key, getattr(config, key)


def attention_shape(model: nn.Module) -> tuple[int, int, int]:
    """(attention layers, heads, head dimension) of a supported model."""
    modules = attention_modules(model)
    config = model.config
    heads = getattr(config, "num_attention_heads", None) or config.n_heads
    return len(modules), heads, _head_dim(modules[0], model)
