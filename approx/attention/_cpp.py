"""approx's C++ kernels (``csrc/``), built on first use by :func:`torch.utils.cpp_extension.load`.

Two CPU inference paths are C++ rather than plain torch, each behind an option whose plain-torch path stays the
default and the reference: LSH's ``engine="fused"`` (``csrc/lsh_rounds.cpp``, :mod:`._lshfused`) and BigBird's
``kernel="fused"`` (``csrc/block_band.cpp``, :mod:`._blockband`). Both make the passes through memory that surround
their BLAS products with one block's data in cache. A kernel is built the first time it is asked for (a C++ compiler
and ``ninja``; about half a minute, said on stderr), for the vector instructions torch uses on this CPU
(``torch.backends.cpu.get_cpu_capability()``), with ``-fopenmp`` (``at::parallel_for`` needs it to run on more than
one thread), and cached on disk under ``TORCH_EXTENSIONS_DIR`` (by default ``~/.cache/torch_extensions``), one build
per source text, torch version and capability. A build that fails raises an error naming the option, the cause (the
compiler's first error, or the command not found) and the plain-torch way out, and the same error again for the rest
of the process (torch's loader would not build the same source twice in one process). The products call the Fortran BLAS that libtorch_cpu exports (``sgemm_``, ``dgemm_``: MKL in
torch's x86 wheels; inside a parallel region MKL runs on the calling thread).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["CSRC", "load"]

CSRC = Path(__file__).with_name("csrc")

# The vector instructions at::vec is compiled for, per torch's CPU capability (the flags torch builds its own kernels
# with); a capability not listed gets at::vec's portable code
_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


def _capability() -> str:
    cap = torch.backends.cpu.get_cpu_capability()
    return cap if cap in _CAPABILITY_FLAGS else "DEFAULT"


# A kernel whose build failed in this process: its error message, raised again (as a new error, holding no earlier
# call's frames) rather than built again (torch's loader would not build the same source twice in one process, and
# would report the missing library instead)
_FAILED: dict[str, str] = {}


def load(stem: str, *, asked: str, instead: str) -> ModuleType:
    """The kernel ``csrc/{stem}.cpp``, built if it is not on disk yet (callers keep the module: torch loads it once
    per process anyway). ``RuntimeError`` when it cannot be built, naming ``asked`` (the option that asked for it),
    the cause and ``instead`` (what computes the same); once failed, the same error for the rest of the process."""
    from torch.utils import cpp_extension

    if stem in _FAILED:
        raise RuntimeError(_FAILED[stem])
    source = CSRC / f"{stem}.cpp"
    cap = _capability()
    digest = hashlib.sha256(source.read_bytes() + (CSRC / "approx_cpu.h").read_bytes()).hexdigest()[:10]
    flags = ["-O3", "-fopenmp", f"-DCPU_CAPABILITY={cap}", f"-DCPU_CAPABILITY_{cap}", *_CAPABILITY_FLAGS.get(cap, [])]
    name = f"approx_{stem}_{cap.lower()}_{digest}"
    if not _built(name):
        print(
            f"approx: building the C++ kernel of {asked} for {cap} (once per machine and torch version, about half a "
            "minute)",
            file=sys.stderr,
        )
    try:
        return cpp_extension.load(
            name=name, sources=[str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False
        )
    except Exception as err:  # a missing compiler or ninja, a failed compilation, link or import
        _FAILED[stem] = (
            f"{asked} could not build or load its C++ kernel ({type(err).__name__}: {_cause(err)}); it needs a C++ "
            "compiler, ninja (pip install ninja) and a torch whose library exports the Fortran BLAS (sgemm_, as "
            f"torch's x86 wheels do). {instead} computes the same in plain torch. The build is tried again in a new "
            "process"
        )
        raise RuntimeError(_FAILED[stem]) from err


def _cause(err: Exception) -> str:
    """The line of a failed build that says why: the compiler's first error, a command or library not found, or else
    the first line (torch's own message starts with the whole compile command). The linker's closing summary
    (``collect2: error: ld returned 1``) says less than the line before it, so it comes last."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
    for marks in (
        ("error:",),
        ("not found", "No such file", "cannot open", "cannot find", "undefined symbol", "undefined reference"),
    ):
        found = next((line for line in lines if any(m in line for m in marks) and "collect2" not in line), None)
        if found is not None:
            return found
    return lines[0]


def _built(name: str) -> bool:
    """Whether torch's extension folder already holds the kernel (then loading it takes a moment, not a build)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory  # private: its absence only costs the notice

        return (Path(_get_build_directory(name, False)) / f"{name}.so").exists()
    except Exception:
        return False
