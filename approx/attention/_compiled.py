"""torch.compile for the hot paths made of many small operations (the ``engine`` option; plain torch).

A method's eager code issues hundreds to thousands of operator calls per attention call: clustered attention's
Lloyd iterations, improved-clustered attention's block recomputation. On a GPU every call is a kernel launch (the
H100 measurement showed a floor of about 6 ms per call whatever N); on a CPU every call can open a parallel region,
which waits for any thread the operating system has descheduled. Compiled by ``torch.compile`` (inductor: Triton
kernels on a GPU, C++ loops on the CPU), the same functions run as a few dozen fused kernels: a clustered or
improved-clustered call is about 150 operator calls instead of thousands (docs' Speed page).

The functions compiled are the methods' own plain-torch functions, written so that nothing in them depends on the
data's values (no host synchronisation, no data-dependent shape): the K-means runs every iteration (the eager CPU
path stops at a fixed point and compares queries with the centroids that moved only) and every block of
recomputed rows is computed, the empty ones too. Tests check that both engines give the same clusters and
outputs in float64. In float32 they agree up to rounding, and rounding can decide a hash bit: a query whose
projection lies within rounding of its threshold may get the other bit under the fused code, and the K-means then
goes its own way (seen once on MiniLM-L6, two 256-token WikiText-2 inputs: one bit of one query in layer 3 moved
the last hidden states by up to 0.48). Compare the engines in float64, not bit for bit in float32.

Measured on the CPU (``benchmarks/attention_op.py``; docs' Speed page) the compiled clustering is *slower* than the
eager one at every length measured (1.5x at N = 1024, 3-4x from 4096), because the eager path's incremental
iterations skip most of the work the fixed ones do. So ``engine="eager"`` is the default; ``"compiled"`` is there for
GPUs, where launches and host synchronisations dominate, and is not measured on one yet. Its shapes are dynamic:
one compilation (tens of seconds on the CPU, then cached on disk by inductor) serves every length. LSH's compiled
round (``lsh.round_blocks``) is the other use: static shapes (``call(..., dynamic=False)``), made the same at every
length by the caller, because inductor's CPU loops over dynamic shapes ran slower than the eager code there. A
compilation that fails (no C++ compiler, say) raises an error that says so: the caller asked for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..config import option

__all__ = ["ENGINES", "call", "check_engine", "engine_option"]

ENGINES = ("eager", "compiled")
MAX_COMPILATIONS = 64
_COMPILED: dict[tuple[Callable, bool], Callable] = {}


def engine_option(meaning: str | None = None) -> Any:
    """The ``engine`` option ("eager" by default); ``meaning``: what the choice means for this method."""
    return option(
        "eager",
        meaning
        or "'eager': plain PyTorch, operator by operator (the measured fastest on the CPU); 'compiled': the same "
        "functions without host synchronisation through torch.compile, a few fused kernels (for GPUs; slower on "
        "the CPU: see the docs' Speed page; i-clustered's recomputation stays eager under attention dropout)",
        absent="eager",  # a record written before the option existed ran eagerly
    )


def check_engine(config, extra: tuple[str, ...] = ()) -> None:
    """The ``engine`` option is one of :data:`ENGINES` or of a method's ``extra`` engines (lsh's ``"fused"``)."""
    engines = ENGINES + extra
    config.require(config.engine in engines, "engine", f"one of {', '.join(map(repr, engines))}")


def compile_errors() -> tuple[type[BaseException], ...]:
    """The exceptions of a failed compilation (a missing or failing C++ compiler), not of the computation."""
    errors: list[type[BaseException]] = []
    try:
        from torch._dynamo.exc import BackendCompilerFailed

        errors.append(BackendCompilerFailed)
    except ImportError:
        pass
    try:
        from torch._inductor.exc import InductorError

        errors.append(InductorError)
    except ImportError:
        pass
    return tuple(errors) or (RuntimeError,)


_COMPILE_ERRORS = compile_errors()


def call(fn: Callable, *args: Any, method: str, dynamic: bool = True) -> Any:
    """``fn(*args)`` through ``torch.compile``, compiled once per function and kept: with dynamic shapes by default;
    ``dynamic`` False: compiled for each new shape (inductor's CPU loops over static shapes are vectorised, over
    dynamic ones they can be slower than eager code): for a caller that keeps to a few shapes."""
    compiled = _COMPILED.get((fn, dynamic))
    if compiled is None:
        compiled = _COMPILED[(fn, dynamic)] = torch.compile(fn, dynamic=dynamic)
    try:
        # dynamo's default of 8 compilations per function (integer options, dtypes, masks) would silently run the
        # uncompiled function past it
        with torch._dynamo.config.patch(recompile_limit=MAX_COMPILATIONS):
            return compiled(*args)
    except _COMPILE_ERRORS as err:
        why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        raise RuntimeError(
            f"{method}: engine='compiled' could not compile ({why}); use engine='eager' (the default)"
        ) from err
