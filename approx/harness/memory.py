"""Peak memory of a block of code, on CUDA (allocator statistics) or on Linux CPUs (peak resident set).

On CUDA the figure is ``torch.cuda.max_memory_allocated`` above what was allocated at the start. On a
Linux CPU the kernel's peak-RSS mark is reset (``/proc/self/clear_refs``) and ``VmHWM`` read afterwards:
the figure is the peak resident set above the resident set at the start. That counts everything the
process touched, allocator caches included, so it is a peak-RSS delta rather than an allocator count.
Elsewhere the figure is None.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

__all__ = ["PeakMemory", "allocation_peak"]

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


def _reset_cpu_peak() -> bool:
    try:
        _CLEAR.write_text("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """``with PeakMemory(device) as m: ...`` then ``m.mib`` (peak extra MiB, or None) and ``m.seconds``."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.mib: float | None = None
        self.seconds = 0.0
        self.method = "cuda max_memory_allocated" if self.device.type == "cuda" else "peak RSS delta (VmHWM, Linux)"

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
        else:
            self._ok = _reset_cpu_peak()
            self._before = _status_kib("VmRSS")
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.seconds = time.perf_counter() - self._start
            self.mib = (torch.cuda.max_memory_allocated(self.device) - self._before) / 2**20
            return
        self.seconds = time.perf_counter() - self._start
        peak = _status_kib("VmHWM")
        if self._ok and peak is not None and self._before is not None:
            self.mib = max(peak - self._before, 0) / 1024


def allocation_peak(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), peak MiB)``: the most bytes that torch's CPU allocator had handed out and not yet
    taken back at any moment of the call, above what it held when the call began (the CPU counterpart of CUDA's
    ``max_memory_allocated``, which a peak-RSS delta is not: the C allocator keeps freed memory and reuses it).

    Read from ``torch.profiler``'s memory events (every allocation and free with its size, in order), so the call
    runs under the profiler: slower, never to be timed. Allocations made on other threads than the caller's
    (intra-op worker scratch) are not seen, nor are frees of memory allocated before the call (torch warns of
    them), which therefore counts as still held: an upper bound then. The peak is None when the profiler reports
    no memory event."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn(*args, **kwargs)
    try:
        events = prof.profiler.kineto_results.events()
    except AttributeError:  # pragma: no cover - a torch without the raw results
        return out, None
    changes = sorted(
        (e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type().name == "CPU"
    )
    if not changes:
        return out, None
    held = peak = 0
    for _, nbytes in changes:
        held += nbytes
        peak = max(peak, held)
    return out, peak / 2**20
