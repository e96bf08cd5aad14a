"""approx.harness.memory: the CPU allocation peak against allocations whose sizes are known in advance."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from approx.harness.memory import _without_profiler_notices, allocation_peak


def test_allocation_peak_follows_what_is_held_at_once():
    """8 MiB, then 16 MiB while the 8 are held, then the 8 freed and 8 more allocated: at most 24 MiB held at
    once; a buffer held from before the call is not counted; the call's result comes back."""
    mib = 2**20
    before = torch.empty(32 * mib, dtype=torch.uint8)  # held before the call: not counted

    def work():
        a = torch.empty(8 * mib, dtype=torch.uint8)
        b = torch.empty(16 * mib, dtype=torch.uint8)
        del a
        c = torch.empty(8 * mib, dtype=torch.uint8)
        return b.numel() + c.numel()

    out, peak = allocation_peak(work)
    assert out == 24 * mib and peak == 24.0
    del before


def test_freeing_memory_from_before_the_call_lowers_nothing():
    """Blocks allocated before the call (even at an address an earlier profiled call used for a larger block) and
    freed in it do not offset what the call allocates: 10 MiB allocated, 10 MiB peak."""
    mib = 2**20
    allocation_peak(lambda: torch.empty(24 * mib, dtype=torch.uint8))  # a profiled block, freed outside
    holder = [torch.empty(2 * mib, dtype=torch.uint8)]  # allocated outside any profiler

    def work():
        holder.clear()  # frees the 2 MiB from before the call
        return torch.empty(10 * mib, dtype=torch.uint8)

    assert 10.0 <= allocation_peak(work)[1] < 10.5  # not 8 (10 - the 2 freed), nor 34 (the earlier block)


def test_inside_another_profiler_the_call_runs_unmeasured():
    """A profiler already running (a user profiling an evaluation) keeps its session: the call runs, its peak is
    None, a warning says why, and the outer profile still records the call's allocations."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as outer:
        with pytest.warns(RuntimeWarning, match="already running"):
            out, peak = allocation_peak(lambda: torch.empty(2**20, dtype=torch.uint8).numel())
    assert out == 2**20 and peak is None
    assert any(e.cpu_memory_usage > 0 for e in outer.events())


def test_allocation_peak_grows_with_the_attention_matrix():
    """Eager attention allocates its (H, N, N) scores: doubling N quadruples the peak above the inputs, within the
    size of the (H, N, d) output; SDPA's peak stays linear in N."""
    h, d = 4, 16
    peaks = {}
    with torch.inference_mode():
        for n in (256, 512):
            q = torch.randn(1, h, n, d)
            peaks["eager", n] = allocation_peak(lambda q=q: (q @ q.transpose(-1, -2)).softmax(-1) @ q)[1]
            peaks["sdpa", n] = allocation_peak(lambda q=q: torch.nn.functional.scaled_dot_product_attention(q, q, q))[1]
    scores = {n: h * n * n * 4 / 2**20 for n in (256, 512)}
    for n in (256, 512):
        assert 2 * scores[n] <= peaks["eager", n] <= 2 * scores[n] + 1  # scores and their softmax, then the output
    assert peaks["sdpa", 512] < 4 * h * 512 * d * 4 / 2**20 + 1  # a few (H, N, d) tensors, no (N, N) one


def test_whole_model_memory_benchmark(tmp_path, benchmark_script):
    """benchmarks/whole_model.py --memory-only on MiniLM's architecture (random weights): every contender's
    allocation peak per N, eager attention's growing faster than the others' (its N x N scores), the report's
    exponents and target line, and the JSON."""
    import json

    bench = benchmark_script("whole_model")
    out = tmp_path / "wm.json"
    argv = ["--memory-only", "--random-weights", "--no-fallback", "--lengths", "256", "512", "1024"]
    bench.main([*argv, "--methods", "linear", "--threads", "1", "--output", str(out)])
    res = json.loads(out.read_text())
    peaks = {int(n): p for n, p in res["memory_mib"].items()}
    assert set(peaks[256]) == {"sdpa", "linear", "no-attention", "eager"}
    assert all(p > 0 for by in peaks.values() for p in by.values())
    b = {c: bench.growth(peaks, c) for c in peaks[256]}
    assert b["eager"] > b["sdpa"] + 0.4 and b["eager"] > b["linear"] + 0.4
    assert 0.8 < b["linear"] < 1.2
    text = "\n".join(bench.memory_report(res))
    assert "Target (issue 16)" in text and "eager b =" in text
    # the methods at the model-without-attention's peak are named; one not measured is not counted among them
    at_floor = 1.0 * peaks[1024]["no-attention"]
    made_up = {
        **res,
        "memory_mib": {n: {**p, "favor": None, "lsh": 3 * p["sdpa"]} for n, p in res["memory_mib"].items()},
    }
    made_up["memory_mib"]["1024"]["linear"] = at_floor
    text = "\n".join(bench.memory_report(made_up))
    assert "At N=1024, 1 of 3 methods peak within 5% of no-attention's" in text and text.count(": linear.") == 1


def test_the_profilers_notices_stay_off_standard_error(capfd):
    """torch's profiler library writes a ``USDT:`` line at every start and stop on descriptor 2, which would break
    the harness's progress bars: allocation_peak leaves them out, and keeps every other line written there."""
    allocation_peak(lambda: torch.empty(2**20, dtype=torch.uint8))
    assert "USDT" not in capfd.readouterr().err
    with _without_profiler_notices():
        os.write(2, b"USDT:2026-01-01 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a real error\n")
    err = capfd.readouterr().err
    assert err == "a real error\n"


def test_calls_from_several_threads_run_one_at_a_time(capfd):
    """torch's profiler is one session per process: calls from four threads at once each get their own block's
    peak (none ends another's session), and standard error is whole afterwards."""
    peaks = {}

    def hold(i):
        block = torch.empty((2 + i) * 2**20, dtype=torch.uint8)
        time.sleep(0.2)  # the calls would overlap if nothing kept them apart
        return block

    def work(i):
        peaks[i] = allocation_peak(hold, i)[1]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peaks == {i: pytest.approx(2.0 + i, abs=0.1) for i in range(4)}
    os.write(2, b"still here\n")
    assert capfd.readouterr().err.endswith("still here\n")


def _touched(mib: int) -> torch.Tensor:
    """``mib`` MiB allocated and written (resident, not only reserved)."""
    return torch.ones(mib * 2**20, dtype=torch.uint8)


def test_an_excluded_block_is_left_out_of_the_peak_and_the_peak_before_it_is_kept():
    from approx.harness.memory import PeakMemory, excluded

    with PeakMemory("cpu") as m:
        with excluded():  # 256 MiB of the harness's own work: not counted
            big = _touched(256)
            del big
        small = _touched(32)
        del small
    if m.mib is None:
        pytest.skip("peak RSS not readable here (Linux /proc/self/clear_refs)")
    assert 24 <= m.mib < 128
    with PeakMemory("cpu") as m:
        before = _touched(96)  # before an excluded block: kept
        del before
        with excluded():
            pass
    assert m.mib >= 80


def test_the_fidelity_probe_does_not_count_in_a_methods_peak_memory():
    """A window on 1024 tokens: the probe's attention graph (an entmax over every score, O(N^2)) in the same pass
    must not count as the method's memory. The peak with the probe is within a few MiB of the peak without it."""
    from conftest import tiny_model

    from approx.harness import evaluation
    from approx.harness import fidelity as fid
    from approx.integration import patch, patched_layers, unpatch

    model = tiny_model("bert", num_attention_heads=4, hidden_size=32, max_position_embeddings=1024).eval()
    patch(model, "window", window=16)
    layers = evaluation._MethodLayers(patched_layers(model))
    unpatch(model)
    run = evaluation._Run(model, "tiny", None, "", "", [], None, [], torch.device("cpu"), 0, {})
    inputs = {"input_ids": torch.randint(5, 99, (2, 1024)), "attention_mask": torch.ones(2, 1024, dtype=torch.long)}
    with torch.no_grad():
        evaluation._method_forward(run, inputs, layers)  # the allocator's first growth, outside both figures
        peaks = []
        for probe in (None, fid.AttentionProbe(total_layers=2), None, fid.AttentionProbe(total_layers=2)):
            _, mem = evaluation._method_forward(run, inputs, layers, probe)
            peaks.append(mem.mib)
            if probe is not None:
                assert probe.graph.counts  # the graph was measured in the pass
    if peaks[0] is None:
        pytest.skip("peak RSS not readable here (Linux /proc/self/clear_refs)")
    without, probed = max(peaks[0], peaks[2]), max(peaks[1], peaks[3])
    assert probed < without + 16, peaks


def test_nested_excluded_blocks_pause_a_measurement_once():
    from approx.harness.memory import PeakMemory, excluded

    with PeakMemory("cpu") as m:
        with excluded():
            outer = _touched(192)  # the outer block's own work, before an inner block
            del outer
            with excluded():  # the inner block must not read the outer block's peak as the measurement's
                inner = _touched(64)
                del inner
        small = _touched(16)
        del small
    if m.mib is None:
        pytest.skip("peak RSS not readable here (Linux /proc/self/clear_refs)")
    assert m.mib < 96


def test_the_harness_times_and_measures_a_method_without_the_probe(base_model, fixture_dir, monkeypatch):
    """The fidelity probe (exact attention and the O(N^2) graph on the same inputs) runs in a pass of its own: never
    while a time or memory measurement is open, whose figures would then carry its work."""
    import approx
    from approx.harness import fidelity, memory

    calls, inside = [], []
    real = fidelity.AttentionProbe.__call__

    def spy(self, *args, **kwargs):
        calls.append(1)
        inside.append(bool(memory._OPEN))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(fidelity.AttentionProbe, "__call__", spy)
    results = approx.evaluate(base_model, "wikitext2", ["window:window=4", "efficient"], data_dir=str(fixture_dir),
                              source="local", limit=2, max_length=24, progress=False)  # fmt: skip
    assert calls and not any(inside)
    assert all(r["fidelity"]["attention_relative_error"]["mean"] > 0 for r in results)  # the probe did measure


def test_the_cpu_peak_is_the_high_water_mark_above_the_start_in_mib_kept_across_excluded_blocks(monkeypatch):
    """The resident set's figures scripted (KiB, as /proc/self/status gives them): 3 MiB above the start, then an
    excluded block (not counted), 1 MiB, a second excluded block, half a MiB: the peak is 3.0 MiB (KiB / 1024, and
    the peak before the first excluded block kept through the second)."""
    from approx.harness import memory

    kib = {"VmRSS": 1024, "VmHWM": 1024}

    def reset() -> bool:
        kib["VmHWM"] = kib["VmRSS"]
        return True

    monkeypatch.setattr(memory, "_status_kib", lambda field: kib[field])
    monkeypatch.setattr(memory, "_reset_cpu_peak", reset)
    monkeypatch.setattr(memory, "_trim", lambda: None)
    with memory.PeakMemory("cpu") as m:
        kib["VmHWM"] = 1024 + 3 * 1024
        with memory.excluded():
            kib["VmHWM"] = 10**6
        kib["VmHWM"] = 1024 + 1024
        with memory.excluded():
            kib["VmHWM"] = 10**6
        kib["VmHWM"] = 1024 + 512
    assert m.mib == 3.0
