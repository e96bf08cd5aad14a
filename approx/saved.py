"""The saved-folder format of a patched model, beside its Hugging Face checkpoint (no transformers here).

``approx_config.json`` records what every patched layer runs (``{"format": 1, "approx_version",
"original_attn_implementation", "layers": [{"layer", "method", "config"}, ...]}``, with ``"heads"`` on a layer whose
method runs on some of its heads only) and
``approx_state.safetensors`` (its SHA-256 recorded as ``"state_sha256"``, the layers' as ``"layers_sha256"``) the methods' state as ``layer.<i>.<name>`` tensors (hash planes, random features,
fitted projections), written only when some layer has state. ``"weights_sha256"`` (:func:`weights_digest`) is that
of the checkpoint's weight files as ``approx.save`` wrote them. :mod:`approx.integration` writes and reads the
checkpoint around them (``approx.save``, ``approx.load``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from . import _json
from .layer import ApproxAttention, check_heads, select_layers
from .registry import get_method

__all__ = [
    "SETTINGS_FILE",
    "STATE_FILE",
    "build_layers",
    "check_tokenizer_folder",
    "check_vocabulary",
    "is_saved_setting",
    "layer_record",
    "read_settings",
    "read_state",
    "saved_settings",
]

SETTINGS_FILE = "approx_config.json"
# what `approx fit` and `approx autotune` write beside a saved model (the fit's data and losses, the tuning's
# measurements): approx.save removes them, as they describe the method state saved before
FIT_RECORD = "approx_fit.json"
AUTOTUNE_RECORD = "approx_autotune.json"
TOOL_RECORDS = (FIT_RECORD, AUTOTUNE_RECORD)
STATE_FILE = "approx_state.safetensors"
FORMAT = 1


def layer_record(i: int, layer: ApproxAttention) -> dict[str, Any]:
    """One patched layer as ``approx_config.json`` lists it: ``{"layer", "method", "config"}``, and ``"heads"`` when
    its method runs on some heads only."""
    record = {"layer": i, "method": layer.method.name, "config": layer.config.to_dict()}
    if getattr(layer, "heads", None) is not None:
        record["heads"] = list(layer.heads)
    return record


def write_settings(folder: str | os.PathLike, meta: dict[str, Any]) -> Path:
    """Write ``meta`` (without ``format``, which is added) to ``folder/approx_config.json``, with the SHA-256 of its
    ``layers`` as ``"layers_sha256"`` (:func:`layers_digest`)."""
    file = Path(folder) / SETTINGS_FILE
    layers = json.loads(_json.dumps(meta["layers"]))  # as they will be read back
    file.write_text(_json.dumps({"format": FORMAT, **meta, "layers_sha256": layers_digest(layers)}))
    return file


def layers_digest(layers: list[dict[str, Any]]) -> str:
    """SHA-256 of the ``layers`` list of ``approx_config.json`` (keys sorted, compact JSON): a setting edited by hand
    after saving (a seed that drew the saved state, a budget) is refused rather than run as if saved."""
    return hashlib.sha256(json.dumps(layers, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_settings(folder: str | os.PathLike) -> dict[str, Any]:
    """The whole ``approx_config.json`` of ``folder``, its shape checked; ``FileNotFoundError`` when ``folder``
    was not written by ``approx.save``, ``ValueError`` naming the file on invalid JSON, an unknown format or a
    malformed ``layers`` list (the options themselves are checked by :func:`build_layers`)."""
    file = Path(folder) / SETTINGS_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: {folder} was not written by approx.save")
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(meta).__name__}")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{file}: unknown format {meta.get('format')!r} (this approx reads format {FORMAT})")
    layers = meta.get("layers")
    if not isinstance(layers, list) or not layers:
        raise ValueError(f"{file}: 'layers' must be a non-empty list of {{layer, method, config}}, got {layers!r}")
    for n, entry in enumerate(layers):
        ok = isinstance(entry, dict) and set(entry) - {"heads"} == {"layer", "method", "config"}
        if not (ok and isinstance(entry["method"], str) and isinstance(entry["config"], dict)):
            raise ValueError(
                f"{file}: layers[{n}] must be {{'layer': int, 'method': str, 'config': {{...}}}} (and 'heads': "
                f"[int, ...] when the method runs on some heads only), got {entry!r}"
            )
        if "heads" in entry:
            if not isinstance(entry["heads"], list):
                raise ValueError(
                    f"{file}: layers[{n}]['heads'] must be a list of head indices (leave the key out for every head), "
                    f"got {entry['heads']!r}"
                )
            try:  # indices the model may lack are checked where its heads are known (build_layers, fine-tuning)
                check_heads(entry["heads"])
            except ValueError as e:
                raise ValueError(f"{file}: layers[{n}]: {e}") from None
    for key in ("original_attn_implementation", "state_sha256", "layers_sha256", "weights_sha256"):
        if not isinstance(meta.get(key), (str, type(None))):
            raise ValueError(f"{file}: {key!r} must be a string, got {meta[key]!r}")
    # folders saved before 2026-11-29 have no layers_sha256: read as they are
    if meta.get("layers_sha256") is not None and layers_digest(layers) != meta["layers_sha256"]:
        raise ValueError(
            f"{file}: its layers were changed after it was saved (their SHA-256 differs from 'layers_sha256'); undo "
            "the edit, or to run other settings load the checkpoint without approx (AutoModel.from_pretrained), "
            "patch it with them and save it again"
        )
    return meta


def build_layers(
    folder: str | os.PathLike, head_dims: list[int], *, heads: int | None = None
) -> tuple[dict[str, Any], dict[int, ApproxAttention]]:
    """The settings of ``folder`` and the layers they describe, state loaded, for a model whose attention layers
    have ``head_dims`` (and ``heads`` heads each, when known): everything checked before any model is touched.
    ``ValueError`` (or ``FileNotFoundError``) naming the file on anything wrong: a method, option, layer or head
    index the model does not have, a layer given twice, state that is missing, unreadable, of another shape or not
    finite."""
    meta = read_settings(folder)
    file = Path(folder) / SETTINGS_FILE
    layers: dict[int, ApproxAttention] = {}
    for entry in meta["layers"]:
        try:
            (i,) = select_layers(entry["layer"], len(head_dims), name="layer")
            spec = get_method(entry["method"])
            config = spec.config_class.from_record(entry["config"])  # options it predates: as it was saved
            chosen = check_heads(entry.get("heads"), heads)
            if i in layers:
                raise ValueError(f"layer {entry['layer']} is given twice")
            layers[i] = ApproxAttention(spec.name, config, head_dim=head_dims[i], layer_index=i, heads=chosen)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{file}: {e}") from None
    # a folder that records its layers' digest was saved with its state's digest too (older ones have neither)
    if (
        meta.get("layers_sha256") is not None
        and meta.get("state_sha256") is None
        and (Path(folder) / STATE_FILE).is_file()
    ):
        raise ValueError(
            f"{Path(folder) / STATE_FILE}: {SETTINGS_FILE} has no SHA-256 of it ('state_sha256', which approx.save "
            "writes with every state file), so it cannot be told from a state file changed or added after saving"
        )
    read_state(layers, folder, meta.get("state_sha256"))
    return meta, layers


def is_saved_setting(path: Any) -> bool:
    """Is ``path`` a folder written by ``approx.save`` (or ``approx fit``), i.e. does it hold
    ``approx_config.json``?"""
    return isinstance(path, (str, os.PathLike)) and (Path(path) / SETTINGS_FILE).is_file()


def saved_settings(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The per-layer settings recorded in ``path`` (``[{"layer", "method", "config"}, ...]``, with ``"heads"`` where a
    method runs on some heads only)."""
    return read_settings(path)["layers"]


def write_state(layers: dict[int, ApproxAttention], folder: str | os.PathLike) -> Path | None:
    """Write the state of ``layers`` (layer index -> layer) to ``folder/approx_state.safetensors``; returns the
    file, or None (and no file left) when no layer has state."""
    from safetensors.torch import save_file

    state = {
        f"layer.{i}.{name}": t.detach().cpu().contiguous()
        for i, layer in layers.items()
        for name, t in layer.state().items()
    }
    file = Path(folder) / STATE_FILE
    if not state:
        file.unlink(missing_ok=True)  # a stale one of an earlier save must not be read back
        return None
    save_file(state, str(file))
    return file


# the files of a Hugging Face checkpoint that hold its weights: one file or shards and their index, of any variant
# (model.safetensors, model-00001-of-00003.safetensors, model.fp16.safetensors, model.safetensors.index.json, and
# pytorch_model's twins), as transformers names them
WEIGHT_FILE = re.compile(
    r"^(model|pytorch_model)(\.[A-Za-z0-9_-]+)?(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?$"
)


def weight_files(folder: str | os.PathLike) -> list[str]:
    """The names of the weight files in ``folder`` (:data:`WEIGHT_FILE`), sorted."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(f.name for f in folder.iterdir() if WEIGHT_FILE.match(f.name) and f.is_file())


@contextlib.contextmanager
def fresh_weights(folder: str | os.PathLike):
    """Around a save into ``folder``: its weight files are moved aside first (hidden names), and after the save
    removed, those the save did not write again with a warning naming them; if the save fails they are put back.
    transformers removes an earlier save's shards only: a ``model.safetensors`` left beside new shards, or an earlier
    variant, would be read by ``from_pretrained`` (which prefers the single file to an index) or by a variant's load,
    while ``approx_config.json`` describes the model saved now, not them."""
    folder = Path(folder)
    old = weight_files(folder)
    aside = {name: folder / f".approx-replaced-{name}" for name in old}
    for name, hidden in aside.items():
        (folder / name).replace(hidden)
    try:
        yield
    except BaseException:  # the earlier save's files back, and none that the failed save began
        for name in set(weight_files(folder)) - set(old):
            (folder / name).unlink()
        for name, hidden in aside.items():
            hidden.replace(folder / name)
        raise
    for hidden in aside.values():
        hidden.unlink(missing_ok=True)
    stale = sorted(set(old) - set(weight_files(folder)))
    if stale:
        warnings.warn(
            f"approx.save: removed {', '.join(stale)} from {folder}, left by an earlier save (this save wrote other "
            f"weight files, and the folder's {SETTINGS_FILE} describes the model saved now); save models you want to "
            "keep to folders of their own",
            stacklevel=4,
        )


def weights_digest(folder: str | os.PathLike) -> str | None:
    """SHA-256 over the checkpoint's weight files in ``folder`` (:data:`WEIGHT_FILE`: each file's name and SHA-256,
    in name order; None without any): ``approx.save`` records it, so that weights written over the folder later (a
    plain ``save_pretrained`` of another model) are refused by ``approx.load`` rather than patched with settings that
    were saved for other weights."""
    files = [Path(folder) / name for name in weight_files(folder)]
    if not files:
        return None
    total = hashlib.sha256()
    for file in files:
        one = hashlib.sha256()
        with open(file, "rb") as f:
            while chunk := f.read(1 << 22):
                one.update(chunk)
        total.update(f"{file.name}\0{one.hexdigest()}\n".encode())
    return total.hexdigest()


def check_weights(folder: str | os.PathLike, meta: dict[str, Any]) -> None:
    """``ValueError`` when the weights in ``folder`` are not those ``approx.save`` wrote beside ``meta`` (its
    ``"weights_sha256"``; folders saved before 2026-11-30 have none and are read as they are)."""
    recorded = meta.get("weights_sha256")
    if recorded is not None and weights_digest(folder) != recorded:
        raise ValueError(
            f"{Path(folder)}: its weights are not those approx.save wrote beside {SETTINGS_FILE} (their SHA-256 "
            "differs from 'weights_sha256'; a plain save_pretrained into this folder, say), so its settings may not "
            "describe them. To load the weights as they are, use AutoModel.from_pretrained (and approx.restore(model, "
            f"folder) to patch them with these settings anyway); to keep them as a plain checkpoint, delete "
            f"{SETTINGS_FILE}; or save the patched model again with approx.save"
        )


def state_digest(folder: str | os.PathLike) -> str | None:
    """SHA-256 of ``folder/approx_state.safetensors`` (None without one): ``approx.save`` records it in the
    settings, so a state file changed after saving is refused rather than loaded as some other state."""
    file = Path(folder) / STATE_FILE
    return hashlib.sha256(file.read_bytes()).hexdigest() if file.is_file() else None


def read_state(layers: dict[int, ApproxAttention], folder: str | os.PathLike, digest: str | None = None) -> None:
    """Load ``folder/approx_state.safetensors`` into ``layers``, all or nothing. Every layer gets exactly its saved
    tensors; ``FileNotFoundError`` when a layer has state and the file is missing, ``ValueError`` naming the file
    when it cannot be read, differs from ``digest`` (its SHA-256 when saved), names a layer that is not in ``layers``, or holds state of other names or shapes, or
    values that are not finite."""
    from safetensors.torch import load_file

    file = Path(folder) / STATE_FILE
    if not file.is_file():
        if any(layer.state() for layer in layers.values()) or digest is not None:
            raise FileNotFoundError(f"{file} not found: the layers saved in {SETTINGS_FILE} have state")
        return
    if digest is not None and state_digest(folder) != digest:
        raise ValueError(f"{file} was changed after it was saved (its SHA-256 differs from {SETTINGS_FILE}'s)")
    try:
        state = load_file(str(file))
    except Exception as e:  # safetensors raises its own error types on truncated or corrupted files
        raise ValueError(f"{file}: cannot read it ({type(e).__name__}: {e})") from None
    keys = {key: key.split(".", 2) for key in state}
    bad = [k for k, parts in keys.items() if len(parts) != 3 or parts[0] != "layer" or not parts[1].isdigit()]
    if bad:
        raise ValueError(f"{file}: unexpected tensor names {bad} (expected layer.<index>.<name>)")
    unknown = sorted({int(parts[1]) for parts in keys.values()} - set(layers))
    if unknown:
        raise ValueError(f"{file} holds state of layers {', '.join(map(str, unknown))}, which are not patched")
    for key, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{file}: {key} holds values that are not finite (NaN or infinity)")
    old = {i: layer.state() for i, layer in layers.items()}
    for i, layer in layers.items():
        try:
            layer.load_state({parts[2]: state[key] for key, parts in keys.items() if parts[1] == str(i)})
        except ValueError as e:
            for j, done in layers.items():  # all or nothing
                done.load_state(old[j])
            raise ValueError(f"{file}: layer {i}: {e}") from None


def check_tokenizer_folder(folder: str | os.PathLike) -> None:
    """``ValueError`` when a local model ``folder`` holds no tokenizer files (transformers would then build an
    empty tokenizer that maps every word to the unknown token, and every score would be garbage)."""
    folder = Path(folder)
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model")
    if not any((folder / n).is_file() for n in names) and not any(folder.glob("*.model")):
        raise ValueError(
            f"{folder} has no tokenizer files ({', '.join(names)}): save the tokenizer there "
            f"(approx.save(model, folder, tokenizer=tokenizer), or tokenizer.save_pretrained(folder))"
        )


def check_vocabulary(name: str, tokenizer_size: int, embeddings: int) -> None:
    """``ValueError`` when a tokenizer of ``tokenizer_size`` tokens cannot be the model's own, whose embedding
    matrix has ``embeddings`` rows: ids beyond the embeddings, or fewer than 90 % of the rows covered (a default
    or another model's tokenizer; models pad their embeddings by a few rows at most)."""
    if tokenizer_size > embeddings or tokenizer_size < 0.9 * embeddings:
        raise ValueError(
            f"the tokenizer of {name} has {tokenizer_size} tokens but the model has {embeddings} token embeddings: "
            "it is not the model's tokenizer; save the model's own tokenizer into the folder "
            "(approx.save(model, folder, tokenizer=tokenizer), or tokenizer.save_pretrained(folder))"
        )
