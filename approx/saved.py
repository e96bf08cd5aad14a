"""The saved-folder format of a patched model, beside its Hugging Face checkpoint (no transformers here).

``approx_config.json`` records what every patched layer runs (``{"format": 1, "approx_version",
"original_attn_implementation", "model_type", "attention_layers", "layers": [{"layer", "method", "config"}, ...]}``,
with ``"heads"`` on a layer whose method runs on some of its heads only; ``model_type`` and ``attention_layers`` name
the model the layer indices count in, since 2026-12-01) and
``approx_state.safetensors`` (its SHA-256 recorded as ``"state_sha256"``, the layers' as ``"layers_sha256"``) the methods' state as ``layer.<i>.<name>`` tensors (hash planes, random features,
fitted projections), written only when some layer has state. ``"checkpoint_sha256"`` (:func:`checkpoint_digest`)
is that of the checkpoint's config and weight files as ``approx.save`` wrote them. :mod:`approx.integration` writes and reads the
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
from ._caller import caller_level
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
    for key in ("original_attn_implementation", "state_sha256", "layers_sha256", "checkpoint_sha256", "model_type"):
        if not isinstance(meta.get(key), (str, type(None))):
            raise ValueError(f"{file}: {key!r} must be a string, got {meta[key]!r}")
    count = meta.get("attention_layers")
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 1):
        raise ValueError(f"{file}: 'attention_layers' must be a positive integer, got {count!r}")
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


# the files transformers reads a checkpoint's weights from, as it names them: one file, or shards and their index, of
# the default variant or any other (``model.fp16.safetensors``, ``model.fp16-00001-of-00002.safetensors``,
# ``model.safetensors.index.fp16.json``), safetensors (what transformers 5 writes) or the older ``pytorch_model*.bin``
# (which it still reads, with ``use_safetensors=False`` or where no safetensors file is found). A user's file named so
# (``model.backup.safetensors``) cannot be told from a variant's.
WEIGHT_FILE = re.compile(
    r"^(model(\..*?)?(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index(\..*?)?\.json"
    r"|pytorch_model(\..*?)?(-\d{5}-of-\d{5})?\.bin|pytorch_model\.bin\.index(\..*?)?\.json)$"
)
# what the checkpoint digest covers beside the weight files: the model's config (settings saved for a model of one
# shape, activation or head are not those of another)
CONFIG_FILE = "config.json"


def weight_files(folder: str | os.PathLike) -> dict[str, tuple[int, int, int]]:
    """The weight files in ``folder`` (:data:`WEIGHT_FILE`), by name, each with its (inode, size, modification time in
    ns): what a save leaves unchanged it did not write (safetensors writes a new file and renames it over the old)."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    found = {}
    for f in sorted(folder.iterdir()):
        if WEIGHT_FILE.fullmatch(f.name) and f.is_file():
            st = f.stat()
            found[f.name] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return found


def _variant_names(variant: str | None) -> tuple[str, str]:
    """The single file and the index that a save of ``variant`` writes (as transformers' ``_add_variant`` names them)."""
    if variant is None:
        return "model.safetensors", "model.safetensors.index.json"
    return f"model.{variant}.safetensors", f"model.safetensors.index.{variant}.json"


@contextlib.contextmanager
def fresh_weights(folder: str | os.PathLike, variant: str | None = None):
    """Around a save into ``folder``: once the save has succeeded, the weight files it did not write are removed, with
    a warning naming them. transformers removes an earlier save's shards only, and a ``model.safetensors`` left beside
    new shards (which ``from_pretrained`` reads before the index), an index left beside a new single file, or another
    variant's files would be read as this checkpoint while ``approx_config.json`` describes the model saved now. A save
    that fails removes nothing. What the save wrote is told from what it left unchanged (the same inode, size and
    modification time); where neither its single file nor its index changed, nothing is removed (a filesystem whose
    times are too coarse to tell)."""
    folder = Path(folder)
    before = weight_files(folder)
    yield
    after = weight_files(folder)
    single, index = _variant_names(variant)
    written = {name for name, stat in after.items() if before.get(name) != stat}
    if single in written:
        keep = {single}
    elif index in written:
        keep = {index, *_index_shards(folder / index)}
    else:
        return
    stale = sorted(name for name in after if name not in written and name not in keep)
    for name in stale:
        (folder / name).unlink()
    if stale:
        warnings.warn(
            f"approx.save: removed {', '.join(stale)} from {folder}, weight files this save did not write (an earlier "
            f"save's, say): from_pretrained would read them as this checkpoint, and the folder's {SETTINGS_FILE} "
            "describes the model saved now; save models you want to keep to folders of their own",
            stacklevel=caller_level(),
        )


def _index_shards(index: Path) -> set[str]:
    """The shard files an index names (none when it cannot be read)."""
    try:
        return set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values())
    except (OSError, ValueError, AttributeError):
        return set()


def checkpoint_digest(folder: str | os.PathLike) -> str | None:
    """SHA-256 over the checkpoint's ``config.json`` and weight files in ``folder`` (:data:`WEIGHT_FILE`: each file's
    name and SHA-256, in name order; None without any weight file): ``approx.save`` records it, so that a checkpoint
    written over the folder later (a plain ``save_pretrained`` of another model, or a save that failed halfway) is
    refused by ``approx.load`` rather than patched with settings that were saved for another."""
    names = list(weight_files(folder))
    if not names:
        return None
    if (Path(folder) / CONFIG_FILE).is_file():
        names.append(CONFIG_FILE)
    total = hashlib.sha256()
    for name in sorted(names):
        one = hashlib.sha256()
        with open(Path(folder) / name, "rb") as f:
            while chunk := f.read(1 << 22):
                one.update(chunk)
        total.update(f"{name}\0{one.hexdigest()}\n".encode())
    return total.hexdigest()


def check_checkpoint(folder: str | os.PathLike, meta: dict[str, Any]) -> None:
    """``ValueError`` when the checkpoint in ``folder`` (config and weights) is not the one ``approx.save`` wrote beside
    ``meta`` (its ``"checkpoint_sha256"``; folders saved before 2026-11-30 have none and are read as they are)."""
    recorded = meta.get("checkpoint_sha256")
    if recorded is not None and checkpoint_digest(folder) != recorded:
        raise ValueError(
            f"{Path(folder)}: its checkpoint (config.json and weight files) is not the one approx.save wrote beside "
            f"{SETTINGS_FILE} (their SHA-256 differs from 'checkpoint_sha256'; a plain save_pretrained into this "
            "folder, a save that failed halfway or an edit, say), so its settings may not describe it. To load the "
            "model as it is, use AutoModel.from_pretrained (and approx.restore(model, folder) to patch it with these "
            f"settings anyway); to keep it as a plain checkpoint, delete {SETTINGS_FILE}; or save the patched model "
            "again with approx.save"
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
