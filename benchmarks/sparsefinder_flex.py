"""Sparsefinder's k-means graph on FlexAttention against its own cluster-block kernel (issue #17's question).

Usage::

    python benchmarks/sparsefinder_flex.py --threads 2           # N = 1024 ... 16384 (~2 min on 2 cores)
    python benchmarks/sparsefinder_flex.py --device cuda          # a GPU, when one is lent

Sparsefinder with ``grouping="kmeans"`` and one cluster per query joins query i and key j when they fall in the
same cluster. Sorted by cluster, that graph is block-diagonal with ragged blocks, which FlexAttention can run:
queries and keys sorted by cluster id, a ``BlockMask`` visiting the key blocks whose cluster range meets the query
block's (blocks of one same cluster on both sides marked full), and ``mask_mod`` comparing the two sorted cluster
ids. Two things keep it from being Sparsefinder's kernel whatever the timing says: FlexAttention normalises with
softmax only (Sparsefinder's default target is entmax), and on the CPU it returns no log-sum-exp, so the window
and global keys, scattered across blocks once sorted, cannot be merged in from a second pass. So the comparison
is on the graph both can run: ``target="softmax"``, ``window=0``, ``global_tokens=0``, about sqrt(N) clusters.

Contenders, on the same fitted layer and the same (1, 12, N, 64) float32 inputs, forward, interleaved with SDPA
(one warm-up each, ``--repeats`` timed calls, median): ``cluster-block`` (``approx.ApproxAttention("sparsefinder")``:
queries of a cluster in blocks, one product against their cluster's keys per block) and ``flex`` (the graph on
compiled FlexAttention as above). Both times include the projections and the cluster assignment. The layer is
fitted on the benchmark's own random inputs (as ``benchmarks/attention_op.py`` does: the graph's size matters
here, not its quality). The outputs are compared (max absolute difference). Results: stdout (markdown) and
``--output`` (JSON, with provenance).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from approx import ApproxAttention
from approx.attention import _flex
from approx.attention import sparsefinder as sparsefinder_mod
from approx.attention._graph import group_ids
from approx.attention.sparsefinder import SparsefinderConfig
from approx.harness.argcheck import at_least, device_checked, run_script
from approx.harness.provenance import mark_start, provenance

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flex_vs_gather import interleaved, timed  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
D = 64


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=at_least(1), nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--block", type=at_least(1), default=64, help="FlexAttention's block size")
    p.add_argument("--repeats", type=at_least(1), default=3)
    p.add_argument("--threads", type=at_least(0), default=None, help="torch threads (CPU); default: torch's")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=at_least(0), default=0)
    p.add_argument("--output", type=Path, help="default: benchmarks/out/sparsefinder_flex_<device type>.json")
    args = device_checked(p, p.parse_args(argv))
    if args.output is None:
        args.output = ROOT / "benchmarks" / "out" / f"sparsefinder_flex_{torch.device(args.device).type}.json"
    return args


def config_at(n: int) -> SparsefinderConfig:
    """The graph both kernels can run: k-means (about sqrt(N) clusters, one per query), softmax, no window/global."""
    return SparsefinderConfig(
        grouping="kmeans", clusters=max(2, round(math.sqrt(n))), top_clusters=1, target="softmax", window=0,
        global_tokens=0,
    )  # fmt: skip


def fitted_layer(config: SparsefinderConfig, args: argparse.Namespace) -> ApproxAttention:
    layer = ApproxAttention("sparsefinder", config, head_dim=D).to(args.device)
    g = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    q, k = (torch.randn(1, 12, 512, D, generator=g).to(args.device) for _ in range(2))
    with torch.inference_mode(False):
        layer.fit([(q, k, None, D**-0.5)], steps=30, queries=128)
    return layer


def flex_sparsefinder(q, k, v, layer: ApproxAttention, blk: int) -> torch.Tensor:
    """The layer's graph (same projections and centroids) on FlexAttention: cluster-sorted slots, a segment mask."""
    from torch.nn.attention.flex_attention import BlockMask

    config, state = layer.config, dict(layer.named_buffers())
    qp, kp = sparsefinder_mod._projected(q, k, state, q.dtype, config)
    q_ids, k_ids, _, _ = group_ids(qp, kp, None, config, state)
    qc, kc = q_ids[..., 0], k_ids[..., 0]  # (B, H, N): one cluster each
    q_order, k_order = qc.argsort(dim=-1, stable=True), kc.argsort(dim=-1, stable=True)
    qcs, kcs = qc.gather(-1, q_order).contiguous(), kc.gather(-1, k_order).contiguous()

    def sort(x, order):
        return x.gather(2, order[..., None].expand_as(x))

    qs, ks, vs = sort(q, q_order), sort(k, k_order), sort(v, k_order)
    n, s = q.shape[2], k.shape[2]
    # each block's first and last cluster id (sorted: a range); blocks meet when their ranges overlap
    q_lo, q_hi = qcs[..., ::blk], qcs[..., blk - 1 :: blk]
    k_lo, k_hi = kcs[..., ::blk], kcs[..., blk - 1 :: blk]
    visit = (k_lo[..., None, :] <= q_hi[..., :, None]) & (k_hi[..., None, :] >= q_lo[..., :, None])
    full = (q_lo == q_hi)[..., :, None] & (k_lo == k_hi)[..., None, :] & (q_lo[..., :, None] == k_lo[..., None, :])

    def lists(m):
        idx = m.to(torch.uint8).argsort(dim=-1, descending=True, stable=True).to(torch.int32)
        return m.sum(-1, dtype=torch.int32), idx

    def mask_mod(b, h, i, j):
        return qcs[b, h, i] == kcs[b, h, j]

    mask = BlockMask.from_kv_blocks(
        *lists(visit & ~full), *lists(full), BLOCK_SIZE=blk, mask_mod=mask_mod, seq_lengths=(n, s)
    )
    out = _flex._call(qs, ks, vs, None, mask, D**-0.5, False, blk)  # approx's call: the GPU tile sizes it sets
    return torch.empty_like(out).scatter_(2, q_order[..., None].expand_as(out), out)


def measure(n: int, args: argparse.Namespace) -> dict:
    """One length: SDPA, the cluster-block kernel and flex interleaved (medians), flex's first call, the difference."""
    if n % args.block:
        raise SystemExit(f"--lengths: {n} is not a multiple of --block {args.block}")
    layer = fitted_layer(config_at(n), args)
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    q, k, v = (torch.randn(1, 12, n, D, generator=g).to(args.device) for _ in range(3))
    with torch.inference_mode():
        first_s = timed(lambda: flex_sparsefinder(q, k, v, layer, args.block), args.device)
        fns = {
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
            "cluster-block": lambda: layer(q, k, v, None),
            "flex": lambda: flex_sparsefinder(q, k, v, layer, args.block),
        }
        med, times = interleaved(fns, args.repeats, args.device, f"N={n}")
        diff = float((layer(q, k, v, None) - flex_sparsefinder(q, k, v, layer, args.block)).abs().max())
    return {
        "n": n,
        "clusters": layer.config.clusters,
        "median_s": med,
        "times_s": times,
        "ratio_to_sdpa": {c: med["sdpa"] / med[c] for c in ("cluster-block", "flex")},
        "flex_over_cluster_block": med["cluster-block"] / med["flex"],
        "flex_first_call_s": first_s,
        "max_abs_diff": diff,
    }


def main(argv=None) -> None:
    mark_start()  # the code as the run starts (a commit made while it runs is said in its record)
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # before the run: is the machine quiet?
    with torch._dynamo.config.patch(recompile_limit=_flex.MAX_SHAPES):
        rows = [measure(n, args) for n in args.lengths]
    result = {
        "benchmark": "sparsefinder_flex",
        "graph": {"method": "sparsefinder", **{k: v for k, v in config_at(1).to_dict().items() if k != "clusters"}},
        "clusters": "about sqrt(N)",
        "shape": [1, 12, "N", D],
        "dtype": "float32",
        "block": args.block,
        "repeats": args.repeats,
        "load_average_before": load,
        "rows": rows,
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "provenance": provenance(seed=args.seed, device=args.device),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))


def markdown(result: dict) -> str:
    prov, load = result["provenance"], result.get("load_average_before")
    lines = [
        f"Sparsefinder (k-means, about sqrt(N) clusters, softmax, no window or global tokens): its cluster-block "
        f"kernel vs FlexAttention on cluster-sorted slots (blocks of {result['block']}), (1, 12, N, 64) float32 "
        f"forward, median of {result['repeats']} interleaved calls, {prov['torch_threads']} threads, {prov['device']}; "
        f"commit `{(prov.get('git_commit') or 'unknown')[:12]}`, {prov.get('date_utc', '?')}, torch "
        f"{prov['libraries'].get('torch', '?')}"
        + ("" if load is None else f"; load average {load:.1f} before the run"),
        "",
        "| N | clusters | SDPA ms | cluster-block ms | flex ms | cluster-block vs SDPA | flex vs SDPA | "
        "flex vs cluster-block | flex first call s | max diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        m, x = r["median_s"], r["ratio_to_sdpa"]
        lines.append(
            f"| {r['n']} | {r['clusters']} | {m['sdpa'] * 1e3:.0f} | {m['cluster-block'] * 1e3:.0f} | "
            f"{m['flex'] * 1e3:.0f} | {x['cluster-block']:.2f}× | {x['flex']:.2f}× | "
            f"{r['flex_over_cluster_block']:.2f}× | {r['flex_first_call_s']:.1f} | {r['max_abs_diff']:.1e} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    run_script(main)
