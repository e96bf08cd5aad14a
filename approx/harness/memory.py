"""Peak memory of a block of code, on CUDA (allocator statistics) or on Linux CPUs (peak resident set).

On CUDA the figure is ``torch.cuda.max_memory_allocated`` above what was allocated at the start. On a
Linux CPU the kernel's peak-RSS mark is reset (``/proc/self/clear_refs``) and ``VmHWM`` read afterwards:
the figure is the peak resident set above the resident set at the start. That counts everything the
process touched, allocator caches included, so it is a peak-RSS delta rather than an allocator count. The C
allocator is first asked to return the memory it keeps from earlier work (glibc's ``malloc_trim``), which would
otherwise be reused unseen.
Elsewhere the figure is None.

Work inside :func:`excluded` is left out of the figure: the peak reached before the block is kept, and the mark
is reset after it, so the figure is the larger of the peaks outside such blocks. The fidelity probe runs its exact
attention and attention graph (O(N²) where the method is not) in one, for a caller who measures a pass the probe
runs in; the harness itself times and measures each method in a pass without the probe.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

__all__ = ["PeakMemory", "allocation_peak", "excluded"]

_STATUS = Path("/proc/self/status")
_CLEAR = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _trim() -> None:
    """Hand the C allocator's free memory back to the system (glibc's ``malloc_trim``), so that memory freed is no
    longer resident; nothing where the C library has no such call."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None  # the C library, once loaded (False: none with malloc_trim)


def _reset_cpu_peak() -> bool:
    try:
        _CLEAR.write_text("5")
        return True
    except OSError:
        return False


# the PeakMemory blocks open in this process, innermost last (excluded() pauses them all)
_OPEN: list[PeakMemory] = []


class PeakMemory:
    """``with PeakMemory(device) as m: ...`` then ``m.mib`` (peak extra MiB, or None) and ``m.seconds``; work in
    an :func:`excluded` block within it is not counted."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.mib: float | None = None
        self.seconds = 0.0
        self.method = "cuda max_memory_allocated" if self.device.type == "cuda" else "peak RSS delta (VmHWM, Linux)"

    def __enter__(self) -> PeakMemory:
        self._kept: float | None = None  # the largest peak of the parts before an excluded block
        self._paused = 0  # excluded blocks open within this measurement (nested ones pause it once)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
        else:  # from the resident set without memory the C allocator kept from earlier work
            _trim()
            self._ok = _reset_cpu_peak()
            self._before = _status_kib("VmRSS")
        _OPEN.append(self)
        self._start = time.perf_counter()
        return self

    def _peak(self) -> float | None:
        """The peak above the start since the mark was last reset, in MiB (None where it cannot be read)."""
        if self.device.type == "cuda":
            return (torch.cuda.max_memory_allocated(self.device) - self._before) / 2**20
        peak = _status_kib("VmHWM")
        if self._ok and peak is not None and self._before is not None:
            return max(peak - self._before, 0) / 1024
        return None

    def _pause(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        peak = self._peak()
        self._kept = peak if self._kept is None else max(self._kept, peak or 0.0)

    def _resume(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)  # the mark restarts at what is allocated now
        else:  # what the block freed, given back, and the mark restarted at the resident set now
            _trim()
            self._ok = self._ok and _reset_cpu_peak()

    def __exit__(self, *exc) -> None:
        if self in _OPEN:
            _OPEN.remove(self)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds = time.perf_counter() - self._start
        peak = self._peak()
        self.mib = peak if self._kept is None or peak is None else max(peak, self._kept)


@contextlib.contextmanager
def excluded():
    """A block whose memory the open :class:`PeakMemory` measurements leave out (the harness's own work inside a
    measured forward pass). What the block leaves allocated counts from then on. On a CPU the figure is the resident
    set's, and the C allocator keeps memory it was given back: after the block it is asked to return it (glibc's
    ``malloc_trim``), and what it still keeps counts."""
    open_ = list(_OPEN)
    for m in open_:
        if m._paused == 0:
            m._pause()
        m._paused += 1
    try:
        yield
    finally:
        for m in open_:
            m._paused -= 1
            if m._paused == 0:
                m._resume()


def _allocations(prof) -> list[tuple[int, int, int]]:
    """(time, address, bytes) of every CPU allocation (bytes > 0) and free (< 0) the profiler recorded, in time
    order (a stable sort: the recorded order where times tie)."""

    def walk(nodes):
        for node in nodes:
            yield node
            yield from walk(node.children)

    events = []
    for node in walk(prof.profiler.kineto_results.experimental_event_tree()):
        if "Allocation" in str(node.tag) and str(node.extra_fields.device) == "cpu":
            events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
    return sorted(events, key=lambda e: e[0])


@contextlib.contextmanager
def _without_profiler_notices():
    """Standard error (file descriptor 2, where torch's C++ profiler library writes) held in a temporary file for
    the block, then written back without the library's ``USDT:`` notices (``profiler_start`` and
    ``profiler_stop``, two lines per profiled call that would break every progress bar). Anything else it or the
    block wrote comes through; where descriptor 2 cannot be redirected the block runs as it is."""
    try:
        if sys.stderr is not None:  # None under pythonw and some daemons
            sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no descriptor 2 (a detached process): nothing to filter
        saved = None
    if saved is None:
        yield
        return
    try:
        with tempfile.TemporaryFile() as held:
            os.dup2(held.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
                held.seek(0)
                kept = b"".join(line for line in held.read().splitlines(keepends=True) if not line.startswith(b"USDT:"))
                while kept:  # os.write may write part of it
                    kept = kept[os.write(2, kept) :]
    finally:
        os.close(saved)


# one profiled call at a time in this process: torch's profiler is one session per process, and a second
# thread's start or stop would end the first's (and descriptor 2's redirection must not nest)
_PROFILING = threading.RLock()


def allocation_peak(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), peak MiB)``: the most bytes that torch's CPU allocator had handed out during the call
    and not yet taken back, at any moment of it (the CPU counterpart of CUDA's ``max_memory_allocated``, which a
    peak-RSS delta is not: the C allocator keeps freed memory and reuses it).

    Read from ``torch.profiler``'s allocation events (every allocation and free with its address and size, in
    order), so the call runs under the profiler: slower, never to be timed. Only blocks allocated during the call
    count: freeing memory allocated before it lowers nothing (the figure stays an upper bound of the growth above
    the start). Allocations made on other threads than the caller's (intra-op worker scratch) are not seen. The
    peak is None when a profiler is already running on the calling thread (the call runs unmeasured rather than
    end that session: a warning says so) or when this torch records no allocation events. Calls from several
    threads run one at a time; a profiler that the user started on *another* thread is not detected (torch
    reports only the calling thread's), and the call would end its session: do not mix the two. The profiler
    library's start and stop notices on standard error are left out (:func:`_without_profiler_notices`)."""
    if torch._C._autograd._profiler_enabled():
        warnings.warn(
            "allocation_peak: a torch profiler is already running; the call runs without an allocation peak",
            RuntimeWarning,
            stacklevel=2,
        )
        return fn(*args, **kwargs), None
    from torch.profiler import ProfilerActivity, profile

    with _PROFILING:
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _without_profiler_notices():  # the profiler's own start and stop notices only: fn writes as usual
            prof.start()
        try:
            out = fn(*args, **kwargs)
        finally:
            with _without_profiler_notices():
                prof.stop()
    try:
        events = _allocations(prof)
    except (AttributeError, RuntimeError):  # pragma: no cover - a torch without these profiler results
        return out, None
    if not events:
        return out, None
    live: dict[int, int] = {}  # address -> bytes, the blocks allocated in the call and not yet freed
    held = peak = 0
    for _, ptr, nbytes in events:
        if nbytes > 0:
            live[ptr] = nbytes
            held += nbytes
            peak = max(peak, held)
        elif ptr in live:
            held -= live.pop(ptr)
    return out, peak / 2**20
