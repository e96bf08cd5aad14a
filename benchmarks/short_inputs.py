"""Methods on short, padded batches, each against what it would run otherwise, and SDPA.

Three comparisons, each of what approx does by default in CPU inference on such batches:

* the sparse patterns: ``kernel="auto"`` (SDPA over the pattern's dense mask up to each method's limit) against the
  block kernel it would run otherwise (``band`` for window and bigbird, ``gather`` for sparse-transformer);
* the kernel family's shared helper, which takes a batch in slices of items
  (``approx.attention._kernelized._slice_items``) so that FAVOR+'s features over every (item, head, row) stay in the
  cache: the default against the whole batch at once (``whole``: the slice budget made unlimited). Linear attention
  is the control: its features are small enough to stay one slice at these sizes;
* improved clustered attention, which recomputes its top-k scores from every query's row of keys on short inputs
  (``approx.attention.iclustered._ROWS_UP_TO``): the default against its blocks of queries
  (``blocks``: that route off).

Usage::

    python benchmarks/short_inputs.py --threads 2          # 128 ... 1024 tokens (~5 min on 2 cores)
    python benchmarks/short_inputs.py --lengths 128 384 --repeats 9 --setups favor linear

Inputs: batches of 4096 tokens (B = 4096 / N rows of N tokens, at least one), 12 heads of 32 (MiniLM-L6's shape),
float32, forward without gradients. With ``--padding`` (the default) the rows' real lengths run evenly from N / 2 to
N with the padding at the end, as a dynamically padded batch has it; ``--no-padding``: every token real. The
contenders per setup: ``auto`` (the method as it runs by default), ``kernel`` (the alternative named in the row's
``kernel`` field: the block kernel, ``whole`` or ``blocks``) and ``sdpa`` (plain SDPA over the key padding, exact
attention), timed side by side in one process: one warm-up call each, then ``--repeats`` rounds of one timed call each,
medians. Ratios: kernel / auto (> 1: the default is faster than the alternative) and auto / sdpa. Memory: the CPU
allocator's peak during one more call of each (``approx.harness.memory.allocation_peak``, under torch's profiler,
apart from the timed calls; ``--no-memory`` skips it). The largest difference between the ``auto`` and ``kernel``
outputs on real queries is printed too. Results: stdout (markdown), ``--output`` (JSON, with provenance and the load
average before and after) and a PNG next to it (``--replot JSON`` draws it again from a result).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from approx import ApproxAttention, get_method
from approx.attention import _kernelized, iclustered
from approx.harness.argcheck import at_least, run_script
from approx.harness.memory import allocation_peak
from approx.harness.provenance import mark_start, provenance

ROOT = Path(__file__).resolve().parents[1]
HEADS, HEAD_DIM, TOKENS = 12, 32, 4096

WHOLE = "whole"  # the alternative of a method that slices a batch: the whole batch at once
BLOCKS = "blocks"  # improved clustered attention's alternative: its blocks of queries, the dense route off
# what each of those alternatives sets during its calls: (module, name, value)
ALTERNATIVES = {WHOLE: (_kernelized, "_SLICE_ELEMENTS", 1 << 62), BLOCKS: (iclustered, "_ROWS_UP_TO", 0)}

# (label, method, options, what it runs otherwise: a block kernel, WHOLE or BLOCKS): the methods' defaults (BigBird
# without its fallback to full attention, which would make short rows exact) and the clustered table's matched budgets
SETUPS = [
    ("window", "window", {}, "band"),
    ("window-32", "window", {"window": 32}, "band"),
    ("bigbird", "bigbird", {"full_fallback": False}, "band"),
    ("bigbird-16", "bigbird", {"block": 16, "random_blocks": 1, "full_fallback": False}, "band"),
    ("sparse-transformer", "sparse-transformer", {}, "gather"),
    ("sparse-transformer-fixed", "sparse-transformer", {"pattern": "fixed"}, "gather"),
    ("sparse-transformer-32", "sparse-transformer", {"stride": 32, "heads": "union"}, "gather"),
    ("favor", "favor", {}, WHOLE),
    ("linear", "linear", {}, WHOLE),
    ("i-clustered", "i-clustered", {}, BLOCKS),
]


LABELS = [label for label, *_ in SETUPS]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--lengths", type=at_least(1), nargs="+", default=[128, 256, 384, 512, 768, 1024], help="tokens per row N"
    )
    p.add_argument("--repeats", type=at_least(1), default=7, help="timed calls per contender (median reported)")
    p.add_argument("--threads", type=at_least(1), default=2, help="torch.set_num_threads")
    p.add_argument("--padding", action=argparse.BooleanOptionalAction, default=True, help="rows of N/2 ... N tokens")
    p.add_argument("--setups", nargs="+", default=None, help=f"labels to run (default all: {', '.join(LABELS)})")
    p.add_argument("--seed", type=at_least(0), default=0)
    p.add_argument("--no-memory", action="store_true", help="skip the allocation peaks")
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks/out/short_inputs.json", help="JSON path")
    p.add_argument("--replot", type=Path, default=None, help="only draw the PNG of a result JSON again")
    args = p.parse_args(argv)
    unknown = sorted(set(args.setups or ()) - set(LABELS))
    if unknown:
        p.error(f"unknown setup {', '.join(unknown)}; choose from {', '.join(LABELS)}")
    return args


def inputs(n: int, padding: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    b = max(1, TOKENS // n)
    q, k, v = (torch.randn(b, HEADS, n, HEAD_DIM, generator=g) for _ in range(3))
    lengths = torch.linspace(n // 2, n, b).round().long() if padding and b > 1 else torch.full((b,), n)
    return q, k, v, torch.arange(n)[None] < lengths[:, None]


def timed(fns: dict, repeats: int) -> dict[str, float]:
    """Median milliseconds of each function, interleaved: a warm-up call each, then rounds of one call each."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def contenders(auto, block, q, k, v, mask) -> dict:
    return {
        "auto": lambda: auto(q, k, v, mask),
        "kernel": lambda: block(q, k, v, mask),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :]),
    }


def alternative(layer: ApproxAttention, kind: str):
    """``layer`` run the ``kind`` way (:data:`ALTERNATIVES`): the setting changed during its calls only."""
    module, name, value = ALTERNATIVES[kind]

    def call(*args, **kwargs):
        default = getattr(module, name)
        setattr(module, name, value)
        try:
            return layer(*args, **kwargs)
        finally:
            setattr(module, name, default)

    return call


def measure(args: argparse.Namespace) -> list[dict]:
    rows = []
    for n in args.lengths:
        q, k, v, mask = inputs(n, args.padding, args.seed)
        for label, method, options, kernel in SETUPS:
            if args.setups and label not in args.setups:
                continue
            config = get_method(method).make_config(**options)
            auto = ApproxAttention(method, config, head_dim=HEAD_DIM)
            if kernel in ALTERNATIVES:
                block = alternative(auto, kernel)
            else:
                block = ApproxAttention(
                    method, get_method(method).make_config(**options, kernel=kernel), head_dim=HEAD_DIM
                )
                block.load_state_dict(auto.state_dict())  # the same random state (BigBird's random blocks)
            with torch.inference_mode():
                fns = contenders(auto, block, q, k, v, mask)
                ms = timed(fns, args.repeats)
                real = mask[:, None, :, None]
                diff = float(((fns["auto"]() - fns["kernel"]()) * real).abs().max())
                peaks = {} if args.no_memory else {f"{c}_peak_mib": allocation_peak(fn)[1] for c, fn in fns.items()}
            row = {"setup": label, "method": method, "options": options, "kernel": kernel, "n": n, "b": q.shape[0]}
            row.update({f"{name}_ms": round(t, 2) for name, t in ms.items()}, max_abs_diff=diff, **peaks)
            row["kernel_over_auto"] = round(ms["kernel"] / ms["auto"], 2)
            row["auto_over_sdpa"] = round(ms["auto"] / ms["sdpa"], 2)
            rows.append(row)
            memory = (
                " | ".join(f"{row[f'{c}_peak_mib']:.0f}" for c in ("auto", "kernel", "sdpa")) if peaks else "- | - | -"
            )
            print(
                f"| {label} | {q.shape[0]} x {n} | {ms['auto']:.1f} | {ms['kernel']:.1f} | {ms['sdpa']:.1f} | "
                f"{row['kernel_over_auto']:.2f}x | {row['auto_over_sdpa']:.2f}x | {diff:.1e} | {memory} |",
                flush=True,
            )
    return rows


def plot(result: dict, path: Path) -> None:
    """Left: each setup's time per call by default (solid) and on its alternative (dashed: the block kernel, the whole
    batch at once, or i-clustered's blocks), SDPA in black; right: alternative / default, the default's speed-up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    setups = list(dict.fromkeys(r["setup"] for r in rows))
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(13, 5))
    for i, setup in enumerate(setups):
        mine = [r for r in rows if r["setup"] == setup]
        ns = [r["n"] for r in mine]
        ax_t.plot(ns, [r["auto_ms"] for r in mine], color=f"C{i}", marker="o", label=f"{setup} (auto)")
        ax_t.plot(ns, [r["kernel_ms"] for r in mine], color=f"C{i}", linestyle="--", marker="x")
        ax_r.plot(ns, [r["kernel_over_auto"] for r in mine], color=f"C{i}", marker="o", label=setup)
    sdpa = {r["n"]: r["sdpa_ms"] for r in rows if r["setup"] == setups[0]}
    ax_t.plot(list(sdpa), list(sdpa.values()), color="black", marker="s", label="SDPA (exact)")
    ax_t.set(xlabel="tokens per row N (batches of 4096 tokens)", ylabel="median ms per call (dashed: alternative)")
    ax_t.set_yscale("log")
    ax_t.set_title(f"Short padded batches, {result['settings']['threads']} threads, CPU")
    ax_r.axhline(1.0, color="grey", linewidth=0.8)
    ax_r.set(xlabel="tokens per row N", ylabel="alternative's time / default time", yscale="log")
    ax_r.set_title("Speed-up of the default: dense route, or batch slices")
    for ax in (ax_t, ax_r):
        ax.set_xticks(sorted(sdpa), [str(n) for n in sorted(sdpa)])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    mark_start()  # the code as the run starts (a commit made while it runs is said in its record)
    args = parse_args(argv)
    if args.replot is not None:
        plot(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    print(f"threads {args.threads}, load average {load_before[0]:.2f}, padding {args.padding}\n")
    print(
        "| setup | B x N | auto ms | kernel ms | sdpa ms | kernel / auto | auto / sdpa | max diff "
        "| auto MiB | kernel MiB | sdpa MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = measure(args)
    result = {
        "benchmark": "short_inputs",
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "shape": {"tokens_per_batch": TOKENS, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float32"},
        "load_average": {"before": load_before[0], "after": os.getloadavg()[0]},
        "rows": rows,
        "provenance": provenance(seed=args.seed, device="cpu", threads=args.threads),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.output.with_suffix(".png"))
    print(f"\nload average after {result['load_average']['after']:.2f}; wrote {args.output}")


if __name__ == "__main__":
    run_script(main)
