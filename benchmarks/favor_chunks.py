"""FAVOR+ on the CPU: rows per chunk against operator calls and time (issue #19's trade-off).

Usage::

    python benchmarks/favor_chunks.py --threads 2                        # N = 4096 and 16384, 512 ... 8192 rows

FAVOR+ (and every kernelised method) computes the features of its keys and queries a chunk of rows at a time
(``approx.attention._kernelized._CHUNK`` rows on the CPU), so that no (N, m) feature tensor is held whole. Each
chunk is a few dozen operator calls, so the calls per attention call grow with N / chunk, and fewer, larger chunks
would issue fewer. This script sets the chunk size to each of ``--rows`` in turn and measures, on inputs
(1, 12, N, 64) float32, forward, m = 256: the operator calls of one call (torch.profiler events) and the time
(interleaved, one warm-up, median of ``--repeats``), quiet and, with ``--background-load JOBS``, again beside that
many single-threaded CPU jobs (``attention_op.py``'s). Results: stdout (markdown) and ``--output`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from attention_op import background_load
from torch.profiler import ProfilerActivity, profile

from approx import ApproxAttention, get_method
from approx.attention import _kernelized
from approx.harness.argcheck import at_least, run_script
from approx.harness.provenance import mark_start, provenance

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> None:
    mark_start()  # the code as the run starts (a commit made while it runs is said in its record)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=at_least(1), nargs="+", default=[4096, 16384])
    p.add_argument("--rows", type=at_least(1), nargs="+", default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--repeats", type=at_least(1), default=5)
    p.add_argument("--threads", type=at_least(1), default=2)
    p.add_argument("--background-load", type=at_least(0), default=0, metavar="JOBS", help="a second, loaded pass")
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "out" / "favor_chunks_cpu.json")
    args = p.parse_args(argv)
    if _kernelized._CHUNK not in args.rows:  # every row's ratio is to the default chunk's time, measured beside it
        p.error(f"--rows must include the default chunk size, {_kernelized._CHUNK} (the ratios are to its time)")
    torch.set_num_threads(args.threads)
    res = {"provenance": provenance(seed=0, loadavg_before=os.getloadavg()), "rows": args.rows, "results": {}}
    res["background_load"] = args.background_load
    config = get_method("favor").make_config()
    res["config"] = config.to_dict()
    layer = ApproxAttention("favor", config, head_dim=64)
    default = _kernelized._CHUNK
    heads = ["quiet ms (× default chunk)"] + (["loaded ms (× default chunk)"] if args.background_load else [])
    lines = ["| N | rows per chunk | operator calls | " + " | ".join(heads) + " |", "|---" * (3 + len(heads)) + "|"]
    try:
        for n in args.lengths:
            g = torch.Generator().manual_seed(n)
            q, k, v = (torch.randn(1, 12, n, 64, generator=g) for _ in range(3))
            ops, passes = {}, {"quiet": {r: [] for r in args.rows}}
            if args.background_load:
                passes["loaded"] = {r: [] for r in args.rows}
            with torch.no_grad():
                for r in args.rows:
                    _kernelized._CHUNK = r
                    layer(q, k, v, None)  # warm-up
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        layer(q, k, v, None)
                    ops[r] = len(prof.events())
                for name, times in passes.items():
                    with background_load(args.background_load if name == "loaded" else 0):
                        for _ in range(args.repeats):
                            for r in args.rows:
                                _kernelized._CHUNK = r
                                t0 = time.perf_counter()
                                layer(q, k, v, None)
                                times[r].append(time.perf_counter() - t0)
            res["results"][n] = {"ops": ops, "times_s": passes["quiet"], "times_loaded_s": passes.get("loaded")}
            for r in args.rows:
                cells = []
                for times in passes.values():
                    base, ms = statistics.median(times[default]) * 1e3, statistics.median(times[r]) * 1e3
                    cells.append(f"{ms:.1f} ({base / ms:.2f}×)")
                lines.append(f"| {n} | {r} | {ops[r]} | " + " | ".join(cells) + " |")
    finally:
        _kernelized._CHUNK = default
    res["provenance"]["loadavg_after"] = os.getloadavg()
    load = f"; loaded: {args.background_load} single-threaded job(s) beside" if args.background_load else ""
    print(
        f"FAVOR+ (m = 256), (1, 12, N, 64) float32 forward, {args.threads} threads, default chunk {default} rows{load}\n"
    )
    print("\n".join(lines))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(res, indent=1) + "\n")
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    run_script(main)
