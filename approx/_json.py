"""Strict JSON for the files approx writes (results, records, saved folders): a number that is not finite (an
undefined metric such as a Pearson correlation of constant predictions, NaN) is written as ``null``, where Python's
``json`` would write the bare ``NaN`` or ``Infinity`` that other JSON readers refuse."""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["dumps"]


def dumps(obj: Any, *, indent: int | None = 2) -> str:
    """``obj`` as strict JSON (non-finite floats as ``null``), with a final newline."""
    return json.dumps(_finite(obj), indent=indent, allow_nan=False) + "\n"


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj
