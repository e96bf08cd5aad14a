"""Where a warning should point: the first frame outside approx (and, for warnings raised inside a model's forward
pass, outside torch and transformers too), however deep the calls between go."""

from __future__ import annotations

import sys

__all__ = ["caller_level"]


def caller_level(*outside: str) -> int:
    """The ``stacklevel`` for ``warnings.warn`` called by the caller of this function that points at the first frame
    not in approx, contextlib or the packages ``outside`` (e.g. ``"torch", "transformers"``): the user's
    ``approx.save`` or ``model(**inputs)``."""
    packages = ("approx", "contextlib", *outside)

    def ours(frame) -> bool:
        name = frame.f_globals.get("__name__", "")
        return any(name == p or name.startswith(p + ".") for p in packages)

    # level 1 is the function that warns (our caller): count from there
    level, frame = 1, sys._getframe(1)
    while frame is not None and ours(frame):
        frame, level = frame.f_back, level + 1
    return level
