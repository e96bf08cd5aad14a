"""The saved-folder format of a patched model, beside its Hugging Face checkpoint (no transformers here).

``approx_config.json`` records what every patched layer runs (``{"format": 1, "approx_version",
"original_attn_implementation", "layers": [{"layer", "method", "config"}, ...]}``) and
``approx_state.safetensors`` the methods' state as ``layer.<i>.<name>`` tensors (hash planes, random features,
fitted projections), written only when some layer has state. :mod:`approx.integration` writes and reads the
checkpoint around them (``approx.save``, ``approx.load``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .layer import ApproxAttention

__all__ = ["SETTINGS_FILE", "STATE_FILE", "is_saved_setting", "read_settings", "read_state", "saved_settings"]

SETTINGS_FILE = "approx_config.json"
STATE_FILE = "approx_state.safetensors"
FORMAT = 1


def write_settings(folder: str | os.PathLike, meta: dict[str, Any]) -> Path:
    """Write ``meta`` (without ``format``, which is added) to ``folder/approx_config.json``."""
    file = Path(folder) / SETTINGS_FILE
    file.write_text(json.dumps({"format": FORMAT, **meta}, indent=2) + "\n")
    return file


def read_settings(folder: str | os.PathLike) -> dict[str, Any]:
    """The whole ``approx_config.json`` of ``folder``; ``FileNotFoundError`` when ``folder`` was not written by
    ``approx.save``, ``ValueError`` on an unknown format."""
    file = Path(folder) / SETTINGS_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: {folder} was not written by approx.save")
    meta = json.loads(file.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{file}: unknown format {meta.get('format')!r}")
    return meta


def is_saved_setting(path: Any) -> bool:
    """Is ``path`` a folder written by ``approx.save`` (or ``approx fit``), i.e. does it hold
    ``approx_config.json``?"""
    return isinstance(path, (str, os.PathLike)) and (Path(path) / SETTINGS_FILE).is_file()


def saved_settings(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The per-layer settings recorded in ``path`` (``[{"layer", "method", "config"}, ...]``)."""
    return read_settings(path)["layers"]


def write_state(layers: dict[int, ApproxAttention], folder: str | os.PathLike) -> Path | None:
    """Write the state of ``layers`` (layer index -> layer) to ``folder/approx_state.safetensors``; returns the
    file, or None (nothing written) when no layer has state."""
    from safetensors.torch import save_file

    state = {
        f"layer.{i}.{name}": t.detach().cpu().contiguous()
        for i, layer in layers.items()
        for name, t in layer.state().items()
    }
    if not state:
        return None
    file = Path(folder) / STATE_FILE
    save_file(state, str(file))
    return file


def read_state(layers: dict[int, ApproxAttention], folder: str | os.PathLike) -> None:
    """Load ``folder/approx_state.safetensors`` into ``layers``. Every layer gets exactly its saved tensors: a
    missing file counts as no state, and ``ValueError`` names a layer whose state names or shapes differ, or
    saved layers that are not in ``layers``."""
    from safetensors.torch import load_file

    file = Path(folder) / STATE_FILE
    state = load_file(str(file)) if file.is_file() else {}
    unknown = sorted({key.split(".")[1] for key in state} - {str(i) for i in layers}, key=int)
    if unknown:
        raise ValueError(f"{file} holds state of layers {', '.join(unknown)}, which are not patched")
    for i, layer in layers.items():
        prefix = f"layer.{i}."
        layer.load_state({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
