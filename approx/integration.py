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

import inspect
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import __version__, saved
from .attention._common import exact_attention
from .layer import ApproxAttention, layer_seed
from .registry import get_method

__all__ = [
    "ATTENTION_NAME",
    "SUPPORTED_MODEL_TYPES",
    "UnsupportedModelError",
    "attach",
    "attention_modules",
    "attention_probe",
    "checkpoint_heads",
    "is_patched",
    "load",
    "load_method_state",
    "patch",
    "redraw",
    "RedrawSchedule",
    "restore",
    "save",
    "save_method_state",
    "settings",
    "unpatch",
]

ATTENTION_NAME = "approx"
_CHILD = "approx_attention"  # attribute name of the ApproxAttention attached to a patched attention module
_ORIGINAL = "_approx_original_attn_implementation"  # attribute on the model

# Families whose every attention layer is plain bidirectional self-attention routed through
# AttentionInterface in transformers 5 (checked by the test suite on tiny models of each).
SUPPORTED_MODEL_TYPES = ("bert", "roberta", "distilbert", "electra", "xlm-roberta", "albert", "camembert")


class UnsupportedModelError(ValueError):
    """The model cannot be patched; ``reasons`` lists why."""

    def __init__(self, model: Any, reasons: list[str]) -> None:
        self.reasons = reasons
        name = type(model).__name__
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
    if attention_mask is None:
        return None
    mask = attention_mask.to(torch.bool)
    if allow_is_bidirectional_skip and bool(mask.all()):
        return None
    return mask[:, None, None, -kv_length:]  # (B, 1, 1, S)


def _key_mask(attention_mask: torch.Tensor | None, batch: int, s: int) -> torch.Tensor | None:
    """Whatever mask transformers passes -> (B, S) bool key-padding mask, or None (no padding)."""
    if attention_mask is None:
        return None
    m = attention_mask
    if m.dim() == 2:
        return m.to(torch.bool)
    if m.dim() != 4:
        raise ValueError(f"approx attention: unexpected attention mask of shape {tuple(m.shape)}")
    allowed = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2  # additive float masks
    key = allowed[:, :1, :1, :]  # (B, 1, 1, S)
    if allowed.shape[1] > 1 or allowed.shape[2] > 1:
        if not bool((allowed == key).all()):
            raise ValueError(
                "approx attention supports key-padding masks only; this (B, H, N, S) mask differs between "
                "queries or heads (a causal or custom attention pattern), which the approximations cannot honour"
            )
    return key[:, 0, 0, :].expand(batch, s)


def _attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The function registered as ``"approx"``: (B, H, N, d) tensors in, (B, N, H, dv) out."""
    key_mask = _key_mask(attention_mask, query.shape[0], key.shape[-2])
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    layer = getattr(module, _CHILD, None)
    if layer is None:  # a layer left unpatched by `layers=`: exact attention
        out = exact_attention(query, key, value, key_mask, scale, dropout)
    else:
        out = layer(query, key, value, key_mask, scale=scale, dropout=dropout)
        for probe in _PROBES:
            probe(layer, query, key, value, key_mask, scale, out)
    return out.transpose(1, 2).contiguous(), None


# Callables run after every patched layer: probe(layer, q, k, v, key_mask, scale, out); see attention_probe.
_PROBES: list[Any] = []


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface, AttentionMaskInterface

        AttentionInterface.register(ATTENTION_NAME, _attention_forward)
        AttentionMaskInterface.register(ATTENTION_NAME, _key_padding_mask)
        _registered = True


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


def _select_layers(layers: int | Iterable[int] | None, count: int) -> list[int]:
    if layers is None:
        return list(range(count))
    if isinstance(layers, int):
        layers = [layers]
    chosen = []
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, int):
            raise ValueError(f"layers must be integers, got {i!r}")
        j = i + count if i < 0 else i
        if not 0 <= j < count:
            raise ValueError(f"layer {i} does not exist: the model has {count} attention layers (0..{count - 1})")
        chosen.append(j)
    if not chosen:
        raise ValueError("layers is empty: name at least one layer, or pass None for all")
    return sorted(set(chosen))


def _head_dim(module: nn.Module, model: nn.Module) -> int:
    size = getattr(module, "attention_head_size", None)
    if isinstance(size, int):
        return size
    return model.config.hidden_size // model.config.num_attention_heads


def _device(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


# ----------------------------------------------------------------------------------------------------------
# public API


def patch(model: nn.Module, method: str, *, layers: int | Iterable[int] | None = None, **options: Any) -> nn.Module:
    """Replace the self-attention of a loaded Hugging Face model by ``method``, in place; returns the model.

    ``layers`` selects attention layers by index (default: all); patch again with other ``layers`` to mix
    methods. ``options`` are the fields of the method's config class (see ``approx methods``). Raises
    ``ValueError`` on an unknown method or option and :class:`UnsupportedModelError` (a ``ValueError``)
    listing the reasons when the model cannot be patched; on any error the model is left as it was.
    """
    spec = get_method(method)
    config = spec.make_config(**options)
    modules = attention_modules(model)
    indices = _select_layers(layers, len(modules))
    new = {
        i: ApproxAttention(spec.name, config, head_dim=_head_dim(modules[i], model), layer_index=i).to(
            _device(modules[i])
        )
        for i in indices
    }
    return _install(model, modules, new)


def _install(model: nn.Module, modules: list[nn.Module], layers: dict[int, ApproxAttention]) -> nn.Module:
    """Attach ``layers`` (layer index -> module) to the attention ``modules`` of ``model`` and route its attention
    through ``"approx"``, remembering the original implementation the first time."""
    _register()
    if not is_patched(model):
        original = model.config._attn_implementation
        model.set_attn_implementation(ATTENTION_NAME)
        setattr(model, _ORIGINAL, original)
    for i, layer in layers.items():
        setattr(modules[i], _CHILD, layer)
    return model


def is_patched(model: nn.Module) -> bool:
    return hasattr(model, _ORIGINAL)


def unpatch(model: nn.Module) -> nn.Module:
    """Restore the original attention exactly (bit-identical outputs); returns the model."""
    if not is_patched(model):
        raise ValueError(f"{type(model).__name__} is not patched by approx")
    for module in model.modules():
        if hasattr(module, _CHILD):
            delattr(module, _CHILD)
    model.set_attn_implementation(getattr(model, _ORIGINAL))
    delattr(model, _ORIGINAL)
    return model


def patched_layers(model: nn.Module) -> dict[int, ApproxAttention]:
    """Layer index -> attached ApproxAttention, for the patched layers of a model."""
    if not is_patched(model):
        return {}
    return {i: getattr(m, _CHILD) for i, m in enumerate(attention_modules(model)) if hasattr(m, _CHILD)}


def redraw(model: nn.Module, *, seed: int | None = None, layers: Iterable[int] | None = None) -> None:
    """Draw the random state of patched layers anew (hash planes, random features), deterministically from
    ``seed`` (default: drawn from torch's global generator, so ``torch.manual_seed`` fixes it too)."""
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
    chosen = None if layers is None else set(layers)
    for i, layer in patched_layers(model).items():
        if chosen is None or i in chosen:
            layer.redraw(layer_seed(seed, i))


class RedrawSchedule:
    """Redraw the random state every ``every`` steps of a training loop: call :meth:`step` after each
    optimizer step. Draw ``k`` uses seed ``seed + k``, so a run is reproducible."""

    def __init__(self, model: nn.Module, every: int, *, seed: int = 0) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        self.model, self.every, self.seed, self.steps = model, every, seed, 0

    def step(self) -> bool:
        """Count one step; returns True when it redrew."""
        self.steps += 1
        if self.steps % self.every:
            return False
        redraw(self.model, seed=self.seed + self.steps // self.every)
        return True


def settings(model: nn.Module) -> list[dict[str, Any]]:
    """What each patched layer runs: ``[{"layer": i, "method": name, "config": {...}}, ...]``."""
    return [
        {"layer": i, "method": layer.method.name, "config": layer.config.to_dict()}
        for i, layer in patched_layers(model).items()
    ]


def save(model: nn.Module, path: str | os.PathLike, **save_pretrained_kwargs: Any) -> Path:
    """Save a patched model: a normal Hugging Face checkpoint plus ``approx_config.json`` (the settings of
    every patched layer) and ``approx_state.safetensors`` (the methods' state: planes, features, fitted
    projections; written only when some layer has state); see :mod:`approx.saved`. :func:`load` reads it back."""
    if not is_patched(model):
        raise ValueError("the model is not patched; use model.save_pretrained for a plain model")
    path = Path(path)
    model.save_pretrained(path, **save_pretrained_kwargs)
    meta = {"approx_version": __version__, "original_attn_implementation": getattr(model, _ORIGINAL)}
    saved.write_settings(path, {**meta, "layers": settings(model)})
    save_method_state(model, path)
    return path


def save_method_state(model: nn.Module, folder: str | os.PathLike) -> Path | None:
    """Write the state of the patched layers to ``folder/approx_state.safetensors``; returns the file, or None
    when no patched layer has state. :func:`load_method_state` reads it back."""
    return saved.write_state(patched_layers(model), folder)


def load_method_state(model: nn.Module, folder: str | os.PathLike) -> None:
    """Load ``folder/approx_state.safetensors`` into the patched layers of ``model`` (strictly: see
    :func:`approx.saved.read_state`)."""
    saved.read_state(patched_layers(model), folder)


def _patch_as_saved(model: nn.Module, path: str | os.PathLike) -> dict[str, Any]:
    """Patch ``model`` with the layers, options and state saved in ``path``; returns the saved settings."""
    meta = saved.read_settings(path)
    for entry in meta["layers"]:
        patch(model, entry["method"], layers=[entry["layer"]], **entry["config"])
    load_method_state(model, path)
    return meta


def restore(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Patch a loaded model as recorded in ``path`` by :func:`save`, state included."""
    meta = _patch_as_saved(model, path)
    setattr(model, _ORIGINAL, meta.get("original_attn_implementation", getattr(model, _ORIGINAL)))
    return model


def saved_layers(model: nn.Module, path: str | os.PathLike) -> dict[int, ApproxAttention]:
    """The :class:`ApproxAttention` layers saved in ``path`` (method, options and state, fitted or drawn), built
    for ``model`` without leaving it patched: e.g. a fitted Sparsefinder to evaluate on another checkpoint of
    the same architecture."""
    if is_patched(model):
        raise ValueError("the model is already patched; unpatch it first")
    _patch_as_saved(model, path)  # not restore: the model keeps its own original attention implementation
    layers = patched_layers(model)
    unpatch(model)
    return layers


def load(path: str | os.PathLike, model_class: Any = None, **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a model written by :func:`save` (``model_class`` defaults to ``AutoModel``) and re-patch it."""
    if model_class is None:
        from transformers import AutoModel as model_class
    model = model_class.from_pretrained(str(path), **from_pretrained_kwargs)
    return restore(model, path)


def load_pretrained(name_or_path: str, *, task: str | None = None, progress: bool = True, **kwargs: Any):
    """(model, tokenizer) from a local folder or a hub id. ``task``: None (bare encoder), ``"masked-lm"``,
    ``"sequence-classification"`` or ``"question-answering"``; ``progress=False`` hides the loading bar."""
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
    tokenizer = transformers.AutoTokenizer.from_pretrained(name_or_path)
    model = classes[task].from_pretrained(name_or_path, **kwargs)
    return model, tokenizer


# ----------------------------------------------------------------------------------------------------------
# used by the evaluation harness


def attach(model: nn.Module, layers: dict[int, ApproxAttention]) -> nn.Module:
    """Patch ``model`` with existing :class:`ApproxAttention` modules (e.g. taken from
    :func:`patched_layers` of an earlier patch), keeping their state (fitted or drawn) as it is."""
    modules = attention_modules(model)
    _select_layers(list(layers), len(modules))
    return _install(model, modules, layers)


class attention_probe:  # noqa: N801 (used as a context manager, like torch.no_grad)
    """Within the block, call ``probe(layer, q, k, v, key_mask, scale, out)`` after every patched layer's
    attention: q/k/v are (B, H, N, d), ``key_mask`` (B, S) bool or None, ``out`` the layer's (B, H, N, dv)
    output. For measuring (attention error, graph statistics), not for changing the output."""

    def __init__(self, probe: Any) -> None:
        self.probe = probe

    def __enter__(self) -> Any:
        _PROBES.append(self.probe)
        return self.probe

    def __exit__(self, *exc: Any) -> None:
        _PROBES.remove(self.probe)


def checkpoint_heads(name_or_path: str) -> list[str]:
    """The task heads a checkpoint was saved with, from its config's ``architectures`` (e.g.
    ``BertForSequenceClassification`` -> ``["sequence-classification"]``); ``[]`` for a bare encoder."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(name_or_path)
    return [h for h in map(model_head_from_name, config.architectures or []) if h != "base"]


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


def attention_shape(model: nn.Module) -> tuple[int, int, int]:
    """(attention layers, heads, head dimension) of a supported model."""
    modules = attention_modules(model)
    config = model.config
    heads = getattr(config, "num_attention_heads", None) or config.n_heads
    return len(modules), heads, _head_dim(modules[0], model)
