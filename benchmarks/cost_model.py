"""The cost model: attention FLOPs and query-key pairs per method against N, from each method's ``cost``.

Usage::

    python benchmarks/cost_model.py                           # N = 512 ... 65536, the benchmark settings
    python benchmarks/cost_model.py --lengths 128 512 2048

Nothing is timed: the figures come from each registered method's cost model (``approx.get_method(m).cost``),
per batch item and head, d = dv = 64, with the attention-op benchmark's settings (C = 100 clusters, k = 32,
m = 256 features, sparsefinder with k-means grouping and about sqrt(N) clusters) and every other method at its
defaults (LSH too: clusters of 64 keys, where the attention-op and whole-model benchmarks time clusters of 128). ``full`` is exact attention (N^2 pairs). A log-log plot shows the asymptotics: O(N^2) for exact and
entmax attention; O(N) for clustered, improved clustered, FAVOR+, the linear kernels (linear, efficient,
taylor), Linformer, Nystrom, LSH, BigBird and the window (fixed clusters, features, projections, landmarks,
buckets, blocks or width); O(N sqrt(N)) for Sparsefinder with sqrt(N) balanced clusters and MonarchAttention with
blocks of about sqrt(N); O(N^2 / stride) for the strided Sparse Transformer at its fixed stride. Line styles group
the families: exact solid, clustering and hashing dashed, sparse patterns dash-dotted, kernel and low-rank
dotted. Results: markdown on stdout, JSON (with provenance) and a PNG next to it (``--output``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import approx
from approx import get_method
from approx.harness.argcheck import at_least, run_script
from approx.harness.provenance import mark_start, provenance

ROOT = Path(__file__).resolve().parent.parent
D = 64
# the plot's line style per family (a method in none: solid, with the exact ones)
STYLES = (
    ("--", ("clustered", "i-clustered", "lsh", "sparsefinder")),
    ("-.", ("window", "bigbird", "sparse-transformer")),
    (":", ("favor", "linear", "efficient", "taylor", "linformer", "nystrom", "monarch")),
)
OPTIONS: dict[str, dict[str, Any]] = {
    "clustered": {"clusters": 100},
    "i-clustered": {"clusters": 100, "topk": 32},
    "sparsefinder": {"grouping": "kmeans"},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--lengths", type=at_least(1), nargs="+", default=[2**i for i in range(9, 17)], help="sequence lengths"
    )
    p.add_argument(
        "--methods", nargs="+", default=None, choices=approx.methods(), metavar="METHOD",
        help="methods (default: all registered)",
    )  # fmt: skip
    p.add_argument(
        "--output", type=Path, default=ROOT / "benchmarks/out/cost_model.json", help="JSON path (PNG next to it)"
    )
    args = p.parse_args(argv)
    args.methods = args.methods or approx.methods()
    return args


def config_at(method: str, n: int):
    cfg = get_method(method).make_config(**OPTIONS.get(method, {}))
    if method == "sparsefinder":
        cfg = dataclasses.replace(cfg, clusters=max(2, round(math.sqrt(n))))
    return cfg


def costs(args: argparse.Namespace) -> dict[str, dict[int, dict[str, int]]]:
    out: dict[str, dict[int, dict[str, int]]] = {}
    for m in args.methods:
        out[m] = {}
        for n in args.lengths:
            c = get_method(m).cost(config_at(m, n), n=n, s=n, d=D, dv=D)
            out[m][n] = {"flops": int(c.flops), "qk_pairs": int(c.qk_pairs)}
    return out


def report(res: dict[str, Any]) -> str:
    ms, ns = res["methods"], res["lengths"]
    out = ["## Attention cost per batch item and head (GFLOP; in brackets: FLOPs relative to full)", ""]
    out += ["| N | " + " | ".join(ms) + " |", "|" + "---|" * (len(ms) + 1)]
    for n in ns:
        full = res["cost"]["full"][n]["flops"] if "full" in res["cost"] else None
        cells = []
        for m in ms:
            f = res["cost"][m][n]["flops"]
            cells.append(f"{f / 1e9:.3g}" + (f" ({f / full:.3g})" if full else ""))
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    out += ["", "## Query-key pairs scored per batch item and head", ""]
    out += ["| N | " + " | ".join(ms) + " |", "|" + "---|" * (len(ms) + 1)]
    for n in ns:
        out.append(f"| {n} | " + " | ".join(f"{res['cost'][m][n]['qk_pairs']:,}" for m in ms) + " |")
    out += [
        "",
        f"d = dv = {D}. Settings (at N = {ns[-1]}): " + "; ".join(f"{m}: {res['configs'][m]}" for m in ms) + ".",
    ]
    if "sparsefinder" in ms:  # (its clusters follow the length: config_at)
        clusters = ", ".join(f"{config_at('sparsefinder', n).clusters} at N = {n}" for n in ns)
        out.append(f"Sparsefinder's clusters follow the length, about sqrt(N): {clusters}.")
    return "\n".join(out)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_f, ax_p) = plt.subplots(1, 2, figsize=(14, 5.5))
    ns = res["lengths"]
    colours = plt.get_cmap("tab20").colors
    none = []  # methods that score no query-key pair (kernel methods)
    for i, m in enumerate(res["methods"]):
        style = next((ls for ls, members in STYLES if m in members), "-")
        line = {"linestyle": style, "marker": "o", "markersize": 3, "color": colours[i % len(colours)], "label": m}
        ax_f.plot(ns, [res["cost"][m][n]["flops"] for n in ns], **line)
        pairs = [res["cost"][m][n]["qk_pairs"] for n in ns]
        if any(pairs):
            ax_p.plot(ns, [max(p, 1) for p in pairs], **line)
        else:
            none.append(m)
    for ax, what in ((ax_f, "attention FLOPs"), (ax_p, "query-key pairs scored")):
        ax.set(xscale="log", yscale="log", xlabel="sequence length N", ylabel=f"{what} per batch item and head")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.minorticks_off()
        ax.grid(True, which="major", alpha=0.3)
    ax_f.set_title("Cost model: FLOPs (log-log; slope 2 = quadratic)")
    ax_p.set_title("Cost model: q-k pairs" + (f" (none scored by {', '.join(none)})" if none else ""), fontsize=9)
    handles, labels = ax_f.get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    mark_start()  # the code as the run starts (a commit made while it runs is said in its record)
    args = parse_args(argv)
    res: dict[str, Any] = {
        "provenance": provenance(),
        "d": D,
        "lengths": args.lengths,
        "methods": args.methods,
        "configs": {m: config_at(m, args.lengths[-1]).to_dict() for m in args.methods},
        "cost": costs(args),
    }
    print(report(res))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(res, indent=1) + "\n")
    png = args.output.with_suffix(".png")
    plot(res, png)
    print(f"\nwrote {args.output} and {png}")


if __name__ == "__main__":
    run_script(main)
