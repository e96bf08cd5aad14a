"""How a result was produced: code and library versions, hardware, seed, time. Attached to every result."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from .._version import __version__

# What "dirty" means: uncommitted changes to the package itself (what produces a number), not to recipes,
# results or docs.
_CODE = ["approx", "pyproject.toml"]


def git_commit() -> str | None:
    """The commit of the approx checkout (``+dirty`` when the package has uncommitted changes); None when approx
    is installed from a wheel (no checkout around it)."""
    root = Path(__file__).resolve().parents[2]
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


def provenance(seed: int | None = None, device: str | torch.device | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "approx_version": __version__,
        "git_commit": git_commit(),
        "libraries": {n: _version(n) for n in ("torch", "transformers", "entmax", "datasets", "accelerate")},
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device) if device is not None else "cpu",
        "accelerator": accelerator(device),
        "seed": seed,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        **extra,
    }
