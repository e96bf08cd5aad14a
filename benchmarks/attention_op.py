"""Benchmark one attention op: every registered ``approx`` method against torch's SDPA, on CPU.

Usage::

    python benchmarks/attention_op.py                                   # full run (~10 min on 2 cores)
    python benchmarks/attention_op.py --lengths 512 1024 --repeats 1    # smoke run
    python benchmarks/attention_op.py --option i-clustered.clusters=25 --methods i-clustered

What is measured, for q, k, v of shape (B=1, H=12, N, d=64), float32, forward only, no mask:

* time: all contenders (``sdpa`` = ``F.scaled_dot_product_attention``, ``eager`` = softmax(QK^T/sqrt(d))V up
  to ``--eager-max``, and each method through ``approx.ApproxAttention``) run side by side in this process,
  interleaved: one warm-up call each, then per repeat one timed call (``time.perf_counter``) of each. The
  median is reported; ratio = median(sdpa) / median(method), > 1 means faster than SDPA.
* peak memory: each (contender, N) runs once in a fresh subprocess; the first call's peak RSS minus the RSS
  before it (inputs already made, everything imported). On Linux the peak is ``VmHWM`` of /proc/self/status,
  reset through /proc/self/clear_refs, because ``ru_maxrss`` of a child inherits the parent's high-water
  mark across exec; elsewhere ``ru_maxrss`` is used. It is a peak-RSS delta, not an allocator count.
* cost model: ``qk_pairs`` and ``flops`` from each method's ``spec.cost`` (N*N pairs for sdpa and eager).
* dense methods: a method whose cost model evaluates every query-key pair (``qk_pairs == N*N``) computes an
  N x N score matrix like the eager baseline, so it runs only up to ``--eager-max`` too; the skipped lengths
  are listed in the report and in the JSON (``skipped``). ``full`` is exempt: it calls the fused SDPA kernel.

Results go to stdout (markdown), a JSON file (``--output``) and a PNG plot next to it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import approx
from approx import ApproxAttention, MethodConfig, get_method
from approx.provenance import provenance

B, H, D = 1, 12, 64
BASELINES = ("sdpa", "eager")
# the paper's speed setting; any other registered method runs with its defaults
METHOD_OPTIONS: dict[str, dict[str, Any]] = {
    "clustered": {"clusters": 100},
    "i-clustered": {"clusters": 100, "topk": 32},
}
# dense by their cost model but computed by the fused SDPA kernel (no N x N matrix): never skipped
FUSED = ("full",)
ROOT = Path(__file__).resolve().parent.parent

Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384], help="sequence lengths N"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed calls per contender and N (median reported)")
    p.add_argument("--methods", nargs="+", default=None, help="approx methods to run (default: all registered)")
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="METHOD.KEY=VALUE",
        help="override a method option (repeatable)",
    )
    p.add_argument(
        "--eager-max", type=int, default=4096, help="largest N for the eager baseline and dense methods (N^2 memory)"
    )
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument(
        "--output", type=Path, default=ROOT / "benchmarks/out/attention_op.json", help="JSON path (PNG next to it)"
    )
    p.add_argument("--_memory-probe", nargs=2, metavar=("CONTENDER", "N"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    registered = approx.methods()
    args.methods = args.methods or registered
    unknown = [m for m in args.methods if m not in registered]
    if unknown:
        p.error(f"unknown method(s) {unknown}; registered: {registered}")
    return args


def _value(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def build_configs(methods: list[str], overrides: list[str]) -> dict[str, MethodConfig]:
    options = {m: dict(METHOD_OPTIONS.get(m, {})) for m in methods}
    for item in overrides:
        key, sep, value = item.partition("=")
        method, dot, name = key.rpartition(".")
        if not (sep and dot) or method not in options:
            raise SystemExit(f"--option {item!r}: expected METHOD.KEY=VALUE with METHOD in {methods}")
        options[method][name] = _value(value)
    return {m: get_method(m).make_config(**opts) for m, opts in options.items()}


def contender_fn(name: str, configs: dict[str, MethodConfig]) -> Fn:
    if name == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v)
    if name == "eager":
        return lambda q, k, v: torch.softmax((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5, dim=-1) @ v
    layer = ApproxAttention(name, configs[name], head_dim=D)
    return lambda q, k, v: layer(q, k, v, None)


def is_dense(name: str, configs: dict[str, MethodConfig], n: int) -> bool:
    """True for a method that scores every query-key pair (an N x N matrix), other than the fused ``full``."""
    return name not in FUSED and cost_of(name, configs, n)["qk_pairs"] >= n * n


def skipped_dense(args: argparse.Namespace, configs: dict[str, MethodConfig]) -> dict[str, list[int]]:
    """{method: [N, ...]}: the lengths above ``--eager-max`` at which a dense method is not run."""
    skipped = {m: [n for n in args.lengths if n > args.eager_max and is_dense(m, configs, n)] for m in args.methods}
    return {m: ns for m, ns in skipped.items() if ns}


def contenders_at(n: int, args: argparse.Namespace, configs: dict[str, MethodConfig]) -> list[str]:
    methods = [m for m in args.methods if n <= args.eager_max or not is_dense(m, configs, n)]
    return ["sdpa"] + (["eager"] if n <= args.eager_max else []) + methods


def make_inputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + n)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for _ in range(3))
    return q, k, v


def cost_of(name: str, configs: dict[str, MethodConfig], n: int) -> dict[str, int]:
    if name in BASELINES:
        return {"qk_pairs": n * n, "flops": 2 * n * n * (D + D)}
    c = get_method(name).cost(configs[name], n=n, s=n, d=D, dv=D)
    return {"qk_pairs": int(c.qk_pairs), "flops": int(c.flops)}


# ---------------------------------------------------------------------------------------------- timing


def time_all(args: argparse.Namespace, configs: dict[str, MethodConfig]) -> dict[int, dict[str, list[float]]]:
    """{N: {contender: [seconds per repeat]}}, contenders interleaved within each repeat."""
    fns = {c: contender_fn(c, configs) for c in ["sdpa", "eager", *args.methods]}
    times: dict[int, dict[str, list[float]]] = {}
    for n in args.lengths:
        q, k, v = make_inputs(n, args.seed)
        names = contenders_at(n, args, configs)
        times[n] = {c: [] for c in names}
        with torch.inference_mode():
            for c in names:
                fns[c](q, k, v)  # warm-up
            for _ in range(args.repeats):
                for c in names:
                    t0 = time.perf_counter()
                    fns[c](q, k, v)
                    times[n][c].append(time.perf_counter() - t0)
        med = {c: f"{statistics.median(t) * 1e3:.0f}" for c, t in times[n].items()}
        print(f"[time] N={n}: " + ", ".join(f"{c} {m} ms" for c, m in med.items()), file=sys.stderr, flush=True)
    return times


# ---------------------------------------------------------------------------------------------- memory


def _proc_status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        return False
    return _proc_status_kib("VmHWM") is not None


def memory_probe(contender: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """Runs inside the fresh subprocess: peak extra RSS of the first call."""
    torch.set_num_threads(args.threads)
    fn = contender_fn(contender, build_configs(args.methods, args.option))
    q, k, v = make_inputs(n, args.seed)
    if _reset_peak():
        counter, read = "VmHWM", lambda: _proc_status_kib("VmHWM") or 0
    else:
        counter, read = "ru_maxrss", lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    before = read()
    with torch.inference_mode():
        out = fn(q, k, v)
    after = read()
    del out
    return {"peak_extra_mib": (after - before) / 1024, "rss_before_mib": before / 1024, "counter": counter}


def measure_memory(args: argparse.Namespace, configs: dict[str, MethodConfig]) -> dict[int, dict[str, dict[str, Any]]]:
    passthrough = ["--threads", str(args.threads), "--seed", str(args.seed), "--methods", *args.methods]
    passthrough += [f"--option={o}" for o in args.option]
    mem: dict[int, dict[str, dict[str, Any]]] = {}
    for n in args.lengths:
        mem[n] = {}
        for c in contenders_at(n, args, configs):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--_memory-probe", c, str(n), *passthrough]
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if res.returncode != 0:
                print(f"[memory] {c} N={n} failed:\n{res.stderr[-2000:]}", file=sys.stderr)
                continue
            mem[n][c] = json.loads(res.stdout.strip().splitlines()[-1])
        print(
            f"[memory] N={n}: " + ", ".join(f"{c} {m['peak_extra_mib']:.1f} MiB" for c, m in mem[n].items()),
            file=sys.stderr,
            flush=True,
        )
    return mem


# ---------------------------------------------------------------------------------------------- report


def _label(name: str, configs: dict[str, MethodConfig]) -> str:
    cfg = configs.get(name)
    if cfg is None:
        return name
    short = {"clusters": "C", "topk": "k"}
    opts = [f"{short[k]}={v}" for k, v in cfg.to_dict().items() if k in short]
    return f"{name} ({', '.join(opts)})" if opts else name


def report(res: dict[str, Any], configs: dict[str, MethodConfig]) -> str:
    names = ["sdpa", "eager", *res["methods"]]
    ns = [int(n) for n in res["lengths"]]
    time_ms = {n: {c: statistics.median(t) * 1e3 for c, t in res["times_s"][n].items()} for n in ns}
    mem = res["memory"]
    head = ["N", "inputs MiB"]
    for c in names:
        ratio_cols = [] if c == "sdpa" else [f"{c} x SDPA"] + ([f"{c} mem/SDPA"] if mem else [])
        head += [f"{c} ms"] + ([f"{c} MiB"] if mem else []) + ratio_cols
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in ns:
        row = [str(n), f"{3 * B * H * n * D * 4 / 2**20:.1f}"]
        for c in names:
            t, m, ms = time_ms[n].get(c), mem.get(n, {}).get(c), mem.get(n, {}).get("sdpa")
            row += [f"{t:.1f}" if t else "-"] + ([f"{m['peak_extra_mib']:.1f}" if m else "-"] if mem else [])
            if c != "sdpa":
                row.append(f"{time_ms[n]['sdpa'] / t:.2f}" if t else "-")
                ok = m and ms and ms["peak_extra_mib"] > 0
                row += [f"{m['peak_extra_mib'] / ms['peak_extra_mib']:.2f}" if ok else "-"] if mem else []
        lines.append("| " + " | ".join(row) + " |")
    out = ["## Time (median ms), speed-up vs SDPA (>1 = faster)" + (" and peak memory" if mem else ""), "", *lines, ""]
    out.append(f"Time: median of {res['repeats']} interleaved calls after one warm-up; {res['threads']} threads; ")
    out[-1] += f"B={B}, H={H}, d={D}, float32, forward only; ratio = median(sdpa) / median(contender)."
    if mem:
        counter = next(iter(next(iter(mem.values())).values()))["counter"]
        out.append(
            f"Memory: peak-RSS delta ({counter}) of the first call in a fresh process, MiB; 'inputs' = q+k+v size."
        )
    for m, skipped in res.get("skipped", {}).items():
        out.append(
            f"Not run: {m} at N = {', '.join(map(str, skipped))}: it is dense (qk_pairs = N*N in its cost model, an"
            f" N x N score matrix like eager), so like eager it runs only up to --eager-max = {res['eager_max']}."
        )
    out += ["", "## Cost model per batch item and head (qk_pairs / GFLOP)", ""]
    out += ["| N | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for n in ns:
        cells = [f"{res['cost'][n][c]['qk_pairs']:,} / {res['cost'][n][c]['flops'] / 1e9:.3g}" for c in names]
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    out += ["", "## Targets", ""]
    if "i-clustered" in res["methods"]:
        big = [n for n in ns if n >= 4096]
        ratios = [time_ms[n]["sdpa"] / time_ms[n]["i-clustered"] for n in big]
        detail = ", ".join(f"N={n}: {r:.2f}x" for n, r in zip(big, ratios, strict=True))
        verdict = (
            f"{'met' if min(ratios) > 1 else 'not met'} (ratios {detail})" if big else "not evaluated (no N >= 4096)"
        )
        out.append(f"{_label('i-clustered', configs)} faster than SDPA from N=4096 up: {verdict}")
    big2 = sorted(n for n in ns if n in mem)[-2:]
    for c in names:
        if len(big2) < 2 or not all(c in mem[n] for n in big2):
            continue
        (n0, n1), (m0, m1) = big2, (mem[n][c]["peak_extra_mib"] for n in big2)
        growth, limit = (m1 / m0 if m0 > 0 else float("inf")), 1.3 * n1 / n0
        verdict = "met" if growth <= limit else "not met"
        out.append(
            f"memory linear in N ({_label(c, configs)}): {verdict} (peak {m0:.1f} MiB at N={n0} -> {m1:.1f} MiB at"
            f" N={n1}: x{growth:.2f} for N x{n1 / n0:.2f}; linear if <= 1.3 x {n1 / n0:.2f} = {limit:.2f})"
        )
    return "\n".join(out)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 5))
    for c in ["sdpa", "eager", *res["methods"]]:
        ns = [n for n in res["lengths"] if c in res["times_s"][n]]
        ax_t.plot(ns, [statistics.median(res["times_s"][n][c]) * 1e3 for n in ns], "o-", label=c)
        mn = [n for n in ns if c in res["memory"].get(n, {})]
        if mn:
            ax_m.plot(mn, [max(res["memory"][n][c]["peak_extra_mib"], 1e-2) for n in mn], "o-", label=c)
    ax_t.set(xscale="log", yscale="log", xlabel="sequence length N", ylabel="median time per call (ms)")
    ax_t.set_title(f"Forward time, B={B} H={H} d={D}, {res['threads']} threads")
    ax_m.set(xscale="log", yscale="log", xlabel="sequence length N", ylabel="peak extra RSS (MiB)")
    ax_m.set_title("Peak memory of the first call (peak-RSS delta)")
    for ax in (ax_t, ax_m):
        ax.set_xticks(res["lengths"], [str(n) for n in res["lengths"]])
        ax.minorticks_off()
        ax.grid(True, which="major", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args._memory_probe is not None:
        contender, n = args._memory_probe
        print(json.dumps(memory_probe(contender, int(n), args)))
        return
    torch.set_num_threads(args.threads)
    configs = build_configs(args.methods, args.option)
    started = dt.datetime.now(dt.timezone.utc)
    res: dict[str, Any] = {
        "provenance": provenance(seed=args.seed, loadavg_before=os.getloadavg()),
        "shape": {"B": B, "H": H, "d": D, "dtype": "float32"},
        "lengths": args.lengths,
        "repeats": args.repeats,
        "threads": args.threads,
        "eager_max": args.eager_max,
        "methods": args.methods,
        "configs": {m: cfg.to_dict() for m, cfg in configs.items()},
        "cost": {n: {c: cost_of(c, configs, n) for c in ["sdpa", "eager", *args.methods]} for n in args.lengths},
    }
    res["skipped"] = skipped_dense(args, configs)
    for m, ns in res["skipped"].items():
        print(f"[skip] {m} at N={ns}: dense (N x N scores) above --eager-max={args.eager_max}", file=sys.stderr)
    res["memory"] = {} if args.no_memory else measure_memory(args, configs)
    res["times_s"] = time_all(args, configs)
    res["provenance"]["loadavg_after"] = os.getloadavg()
    res["provenance"]["wall_s"] = (dt.datetime.now(dt.timezone.utc) - started).total_seconds()
    print(report(res, configs))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(res, indent=1) + "\n")
    png = args.output.with_suffix(".png")
    plot(res, png)
    print(f"\nwrote {args.output} and {png}")


if __name__ == "__main__":
    main()
