"""What the dense sliding-window mask cost a ``local="band"`` model, which no longer builds it.

ModernBERT's sliding-window layers ask transformers for their mask. Until cecbdf5 approx's mask function built the
dense (B, 1, N, N) mask transformers' SDPA path builds, and ``local="band"`` read the band's keys off it; it now
hands those layers the keys alone, (B, 1, 1, N), and builds the dense mask only for a layer that runs its own
attention. This times ModernBERT-base (random weights, float32 inference, batch 1) with ``local="band"`` and a
method on its full-attention layers, as it runs now and made to build the dense mask in every forward as before
(a wrapper around the mask function's ``_band_keys`` asks for it), the calls interleaved, then measures the CPU
allocator's peak of one call of each (``approx.harness.memory.allocation_peak``):

    python benchmarks/band_mask.py --threads 2 --lengths 4096 8192 16384 --output benchmarks/results/band_mask_cpu.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import approx
from approx import integration
from approx.harness.argcheck import at_least, run_script
from approx.harness.memory import allocation_peak
from approx.harness.provenance import mark_start

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lsh_split import write_record  # noqa: E402

CONTENDERS = ("keys", "dense")  # as approx runs now; made to build the dense mask too


def modernbert_config():
    """ModernBERT-base's architecture: transformers' ``ModernBertConfig`` defaults (the tests put a tiny one here)."""
    from transformers import ModernBertConfig

    return ModernBertConfig()


def forcing_the_dense_mask(switch: dict[str, bool]):
    """A stand-in for ``integration._band_keys`` that builds the dense mask at once while ``switch["dense"]``."""
    band_keys = integration._band_keys

    def wrapped(*args, **kwargs):
        keys = band_keys(*args, **kwargs)
        if switch["dense"]:
            integration._dense_mask(keys)
        return keys

    return wrapped


def measure(model, n: int, *, repeats: int, switch: dict[str, bool], seed: int) -> dict:
    """Median seconds of ``repeats`` interleaved forwards of each contender at N = ``n``, and each one's peak."""
    g = torch.Generator().manual_seed(seed + n)
    vocab = model.config.vocab_size
    ids = torch.randint(min(1000, vocab // 2), vocab, (1, n), generator=g)  # (past the special tokens)
    times: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    peaks: dict[str, float] = {}
    with torch.inference_mode():
        for c in CONTENDERS:  # warm-up
            switch["dense"] = c == "dense"
            model(input_ids=ids)
        for _ in range(repeats):
            for c in CONTENDERS:
                switch["dense"] = c == "dense"
                start = time.perf_counter()
                model(input_ids=ids)
                times[c].append(time.perf_counter() - start)
        for c in CONTENDERS:
            switch["dense"] = c == "dense"
            peaks[c] = allocation_peak(lambda: model(input_ids=ids))[1]
    medians = {c: statistics.median(t) for c, t in times.items()}
    return {"n": n, "seconds": medians, "peak_mib": peaks, "times": times,
            "dense_over_keys": medians["dense"] / medians["keys"]}  # fmt: skip


def markdown(rows: list[dict]) -> str:
    """The table of ``rows`` (a record's ``results``), as docs/speed.md shows it."""
    lines = ["| N | band's keys | dense mask built too | ratio | peak, keys | peak, dense |", "|" + " --- |" * 6]
    for r in rows:
        s, p = r["seconds"], r["peak_mib"]
        lines.append(f"| {r['n']} | {s['keys'] * 1e3:.0f} ms | {s['dense'] * 1e3:.0f} ms | {r['dense_over_keys']:.2f}× | "
                     f"{p['keys']:.0f} MiB | {p['dense']:.0f} MiB |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> None:
    mark_start()  # the code as the run starts (a commit made while it runs is said in its record)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=at_least(1), default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--lengths", type=at_least(128), nargs="+", default=[4096, 8192])
    parser.add_argument("--method", default="window", help="the full-attention layers' method (default: window)")
    parser.add_argument("--window", type=at_least(1), default=256, help="its window (default 256, as whole_model.py)")
    parser.add_argument("--repeats", type=at_least(1), default=2, help="interleaved calls per contender (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="JSON path for the results and their provenance")
    args = parser.parse_args(argv)
    from transformers import ModernBertModel

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = ModernBertModel(modernbert_config()).eval()
    options = {"window": args.window} if args.method == "window" else {}
    approx.patch(model, args.method, local="band", **options)
    load = os.getloadavg()
    switch, band_keys = {"dense": False}, integration._band_keys
    integration._band_keys = forcing_the_dense_mask(switch)
    try:
        rows = [measure(model, n, repeats=args.repeats, switch=switch, seed=args.seed) for n in args.lengths]
    finally:
        integration._band_keys = band_keys
    print(f"ModernBERT-base (random weights), {args.method} + local='band', float32 inference, batch 1, "
          f"{args.threads} threads, medians of {args.repeats} interleaved calls; load average {load[0]:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")  # fmt: skip
    print(markdown(rows))
    if args.output:
        write_record("band_mask", args, rows, load)


if __name__ == "__main__":
    run_script(main)
