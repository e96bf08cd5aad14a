"""How LSH's fused kernel splits its work between threads: by (batch, head) row, or by each round's query clusters.

``lsh`` with ``engine="fused"`` (approx/attention/csrc/lsh_rounds.cpp) makes each (batch, head) row one task,
its rounds one after the other, so that the row's queries, keys and values stay in cache; with fewer rows than
threads (one sequence of 12 heads on a machine of 16 cores) the rest of the threads would idle, so it then makes each
round's query clusters the tasks instead (``_lshfused.SPLIT = "auto"``). Both give the same output to the bit. This
times the two side by side on the same inputs, interleaved, for shapes (1, H, N, 64), and prints the ratio and
which one ``auto`` takes:

    python benchmarks/lsh_split.py --threads 2 --heads 1 12 --lengths 4096 16384
    python benchmarks/lsh_split.py --threads 2 --output benchmarks/results/lsh_split_cpu.json

The time is the whole attention call (hashing and sorts included, which are plain torch and the same for both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import approx
from approx.attention import _lshfused
from approx.harness.argcheck import at_least, run_script
from approx.harness.provenance import mark_start, provenance


def _time(layer, q, k, v, split: str) -> float:
    _lshfused.SPLIT = split
    start = time.perf_counter()
    layer(q, k, v, None, scale=q.shape[-1] ** -0.5)
    return time.perf_counter() - start


def measure(heads: int, n: int, *, repeats: int, cluster_size: int, rounds: int, seed: int) -> dict:
    """Median seconds of each split over ``repeats`` interleaved calls at (1, heads, n, 64), float32."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, n, 64, generator=g) for _ in range(3))
    config = approx.get_method("lsh").make_config(cluster_size=cluster_size, rounds=rounds, engine="fused")
    layer = approx.ApproxAttention("lsh", config, head_dim=64)
    times: dict[str, list[float]] = {"rows": [], "clusters": []}
    with torch.inference_mode():
        for split in times:  # warm-up (the build, on the first call of the process)
            _time(layer, q, k, v, split)
        for _ in range(repeats):
            for split in times:
                times[split].append(_time(layer, q, k, v, split))
    _lshfused.SPLIT = "auto"
    rows, clusters = statistics.median(times["rows"]), statistics.median(times["clusters"])
    # the kernel's rule: fewer (batch, head) rows than threads, and more than one query cluster
    auto = "clusters" if heads < torch.get_num_threads() and n > cluster_size else "rows"
    return {"heads": heads, "n": n, "rows_s": rows, "clusters_s": clusters, "rows_over_clusters": rows / clusters,
            "auto": auto, "times": times}  # fmt: skip


def main(argv=None) -> None:
    mark_start()  # the code as the run starts (a commit made while it runs is said in its record)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=at_least(1), default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--heads", type=at_least(1), nargs="+", default=[1, 2, 12])
    parser.add_argument("--lengths", type=at_least(256), nargs="+", default=[4096, 16384])
    parser.add_argument("--cluster-size", type=at_least(1), default=128)
    parser.add_argument("--rounds", type=at_least(1), default=4)
    parser.add_argument("--repeats", type=at_least(1), default=7, help="interleaved calls per split (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="JSON path for the results and their provenance")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    rows = [
        measure(h, n, repeats=args.repeats, cluster_size=args.cluster_size, rounds=args.rounds, seed=args.seed)
        for h in args.heads
        for n in args.lengths
    ]
    print(f"LSH fused, {args.rounds} rounds of {args.cluster_size}, float32, {args.threads} threads, medians of "
          f"{args.repeats} interleaved calls; load average {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after")  # fmt: skip
    print(markdown(rows))
    if args.output:
        write_record("lsh_split", args, rows, load)


def markdown(rows: list[dict]) -> str:
    """The table of ``rows`` (a record's ``results``), as docs/speed.md shows it."""
    lines = ["| shape | by row | by cluster | row / cluster | `auto` takes |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| (1, {r['heads']}, {r['n']}, 64) | {r['rows_s'] * 1e3:.1f} ms | {r['clusters_s'] * 1e3:.1f} ms | "
                     f"{r['rows_over_clusters']:.2f}× | {r['auto']} |")  # fmt: skip
    return "\n".join(lines)


def write_record(benchmark: str, args: argparse.Namespace, rows: list[dict], load: tuple[float, ...]) -> None:
    """Write ``rows`` to ``args.output`` as JSON, with the settings (``args``), the load average before and after, and
    the provenance (``args.seed``)."""
    record = {"benchmark": benchmark, "settings": {k: str(v) if isinstance(v, Path) else v
                                                   for k, v in vars(args).items()},
              "results": rows, "load_average_before": load, "load_average_after": os.getloadavg(),
              "provenance": provenance(seed=args.seed)}  # fmt: skip
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    run_script(main)
