"""FlexAttention against approx's block-sparse kernels, on the same pattern and inputs (issue #17's choice).

Usage::

    python benchmarks/flex_vs_gather.py --threads 2                      # N = 1024 ... 16384 (~5 min on 2 cores)
    python benchmarks/flex_vs_gather.py --lengths 4096 --block 128
    python benchmarks/flex_vs_gather.py --device cuda                     # a GPU, when one is lent

The pattern is the ``window`` method's (one-sided window 256, the CLS token global; ``--window``,
``--global-tokens``), run these ways: ``band`` (``kernel="band"``: the banded kernel, every query block's keys a
strided view of one buffer, plain torch), ``gather`` (``approx.ApproxAttention("window", kernel="gather")``: key
blocks gathered per query block, plain torch), ``approx-flex`` (the same layer with ``kernel="flex"``: approx's generic
translation of a pattern to FlexAttention, table look-ups in its ``mask_mod``; the pattern and its block mask kept
after the first call, the global queries' rows where ``_flex.GLOBAL_ROWS`` puts them), ``approx-flex-unkept`` (the
same with nothing kept: pattern and block mask built at every call), ``approx-flex-rows-apart`` and
``approx-flex-rows-in-mask`` (the global queries' rows computed after the kernel, or inside the block mask, their
query block visiting every key block) and ``flex`` (raw ``torch.nn.attention.flex_attention`` compiled, on the
same block lists with a hand-written ``mask_mod``: ``|i - j| <= w`` or a global token, the global rows in the
mask). Inputs (1, 12, N, 64)
in ``--dtype`` (float32 by default), no padding, forward. Times interleave SDPA and the others in one process (one
warm-up each, ``--repeats`` timed calls, median); flex's first call (its compilation) is timed apart. The outputs
are compared (max absolute difference). Whether flex has a backward pass on the device is tried and recorded.
Results: stdout (markdown) and ``--output`` (JSON, with provenance).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from approx import ApproxAttention
from approx.attention import _blocksparse, _flex
from approx.attention import window as window_mod
from approx.attention.window import WindowConfig
from approx.harness.argcheck import at_least, device_checked, run_script
from approx.harness.provenance import mark_start, provenance

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=at_least(1), nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--window", type=at_least(1), default=256, help="one-sided window (Longformer's 512 two-sided)")
    p.add_argument("--global-tokens", type=at_least(0), default=1)
    p.add_argument("--block", type=at_least(1), default=64, help="block size of both kernels")
    p.add_argument("--repeats", type=at_least(1), default=3)
    p.add_argument("--threads", type=at_least(0), default=None, help="torch threads (CPU); default: torch's")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--seed", type=at_least(0), default=0)
    p.add_argument(
        "--output", type=Path, default=None, help="default: benchmarks/out/flex_vs_gather_<device type>.json"
    )
    args = device_checked(p, p.parse_args(argv))
    if args.output is None:  # (benchmarks/out is not committed: a trial run replaces no committed result)
        args.output = ROOT / "benchmarks" / "out" / f"flex_vs_gather_{torch.device(args.device).type}.json"
    return args


def flex_block_mask(config: WindowConfig, n: int, device: str):
    """The window pattern's block lists as a FlexAttention BlockMask (global query blocks attend every block)."""
    from torch.nn.attention.flex_attention import BlockMask

    pat = window_mod.pattern(config, b=1, n=n, s=n, device=device)
    blk, tk = config.block, -(-n // config.block)
    lists = []
    for t in range(pat.kv_blocks.shape[2]):
        ids = set(pat.kv_blocks[0, 0, t][pat.kv_valid[0, 0, t]].tolist())
        if config.global_tokens:
            ids |= set(range(-(-config.global_tokens // blk)))  # the blocks holding the global keys
            if t * blk < config.global_tokens:
                ids = set(range(tk))  # a global query's block attends everything
        lists.append(sorted(ids))
    indices = torch.zeros(1, 1, len(lists), tk, dtype=torch.int32)
    counts = torch.zeros(1, 1, len(lists), dtype=torch.int32)
    for t, ids in enumerate(lists):
        indices[0, 0, t, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        counts[0, 0, t] = len(ids)
    w, g = config.window, config.global_tokens

    def mask_mod(b, h, i, j):
        return ((i - j).abs() <= w) | (i < g) | (j < g)

    return BlockMask.from_kv_blocks(
        counts.to(device), indices.to(device), BLOCK_SIZE=blk, mask_mod=mask_mod, seq_lengths=(n, n)
    )


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def interleaved(fns: dict, repeats: int, device: str, label: str) -> tuple[dict, dict]:
    """One untimed call of every contender, then ``repeats`` rounds timing each in turn (so that a load change
    hits them alike): the medians and every time, per contender; the medians printed to stderr."""
    for f in fns.values():
        f()
    times = {c: [] for c in fns}
    for _ in range(repeats):
        for c, f in fns.items():
            times[c].append(timed(f, device))
    med = {c: statistics.median(t) for c, t in times.items()}
    print(f"[time] {label}: " + ", ".join(f"{c} {m * 1e3:.0f} ms" for c, m in med.items()), file=sys.stderr)
    return med, times


def flex_backward(config: WindowConfig, device: str) -> str:
    """'yes', or the error flex raises for a backward pass on this device."""
    n = 256
    q, k, v = (torch.randn(1, 2, n, 64, device=device, requires_grad=True) for _ in range(3))
    try:
        mask = flex_block_mask(config, n, device)  # through approx's call: its GPU tiles divide the blocks
        _flex._call(q, k, v, None, mask, 64**-0.5, False, config.block).sum().backward()
        return "yes"
    except Exception as err:  # noqa: BLE001 - recorded, not raised: the answer is the point
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"


def _unkept(call):
    """``call()`` with nothing kept between calls (pattern and block mask built anew, as before they were kept)."""
    kept, _blocksparse._CACHE = _blocksparse._CACHE, collections.OrderedDict()  # the others' entries stay
    try:
        return call()
    finally:
        _blocksparse._CACHE = kept


def _rows(where: str, call):
    """``call()`` with the global queries' rows ``where`` (``_flex.GLOBAL_ROWS``: "apart" or "mask")."""
    rows, _flex.GLOBAL_ROWS = _flex.GLOBAL_ROWS, where
    try:
        return call()
    finally:
        _flex.GLOBAL_ROWS = rows


def measure(n: int, args: argparse.Namespace, layers: dict, config: WindowConfig) -> dict:
    """One length: SDPA, approx's three kernels and raw flex interleaved (medians), flex's first call, the outputs'
    largest difference."""
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    q, k, v = (torch.randn(1, 12, n, 64, generator=g).to(args.device, dtype) for _ in range(3))
    with torch.no_grad():
        mask = flex_block_mask(config, n, args.device)
        compile_s = timed(lambda: layers["flex"](q, k, v), args.device)  # approx's first: see _flex.py
        fns = {
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
            "band": lambda: layers["band"](q, k, v),
            "gather": lambda: layers["gather"](q, k, v),
            "approx-flex": lambda: layers["flex"](q, k, v),
            "approx-flex-unkept": lambda: _unkept(lambda: layers["flex"](q, k, v)),
            "approx-flex-rows-apart": lambda: _rows("apart", lambda: layers["flex"](q, k, v)),
            "approx-flex-rows-in-mask": lambda: _rows("mask", lambda: layers["flex"](q, k, v)),
            "flex": lambda: _flex._call(q, k, v, None, mask, 64**-0.5, False, config.block),  # approx's tiles
        }
        med, times = interleaved(fns, args.repeats, args.device, f"N={n}")
        ref = layers["gather"](q, k, v).float()
        others = [f() for c, f in fns.items() if c not in ("sdpa", "gather")]
        diff = max(float((ref - o.float()).abs().max()) for o in others)
    return {
        "n": n,
        "median_s": med,
        "times_s": times,
        "ratio_to_sdpa": {c: med["sdpa"] / med[c] for c in fns if c != "sdpa"},
        "flex_over_gather": med["gather"] / med["approx-flex"],
        "flex_first_call_s": compile_s,
        "max_abs_diff": diff,
    }


def main(argv=None) -> None:
    mark_start()  # the code as the run starts (a commit made while it runs is said in its record)
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = WindowConfig(window=args.window, global_tokens=args.global_tokens, block=args.block)
    layers = {
        kernel: ApproxAttention("window", dataclasses.replace(config, kernel=kernel), head_dim=64).to(args.device)
        for kernel in ("band", "gather", "flex")
    }
    # the raw flex calls compile per length too: the same raised recompile limit as approx's own calls
    with torch._dynamo.config.patch(recompile_limit=_flex.MAX_SHAPES):
        rows = [measure(n, args, layers, config) for n in args.lengths]
    backward = flex_backward(config, args.device)
    result = {
        "benchmark": "flex_vs_gather",
        "pattern": {"method": "window", **config.to_dict()},
        "shape": [1, 12, "N", 64],
        "dtype": args.dtype,
        "repeats": args.repeats,
        "flex_backward": backward,
        "rows": rows,
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "provenance": provenance(seed=args.seed, device=args.device),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


def markdown(result: dict) -> str:
    rows = result["rows"]
    names = [c for c in rows[0]["median_s"] if c != "sdpa"] if rows else []
    lines = [
        f"approx's band and gather kernels vs FlexAttention, window pattern {result['pattern']['window']} one-sided, "
        f"block {result['pattern']['block']}, {result.get('dtype', 'float32')}, "
        f"{result['provenance']['torch_threads']} threads, {result['provenance']['device']}; "
        f"flex backward: {result['flex_backward']}",
        "",
        "| N | SDPA ms | " + " | ".join(f"{c} ms (x SDPA)" for c in names) + " | flex vs gather | flex first call s "
        "| max diff |",
        "|---|---|" + "---|" * len(names) + "---|---|---|",
    ]
    for r in rows:
        m, x = r["median_s"], r["ratio_to_sdpa"]
        cells = [f"{_ms(m[c])} ({x[c]:.2f}×)" for c in names]
        lines.append(
            f"| {r['n']} | {_ms(m['sdpa'])} | " + " | ".join(cells) + f" | {r['flex_over_gather']:.2f}× | "
            f"{r['flex_first_call_s']:.1f} | {r['max_abs_diff']:.1e} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    run_script(main)
