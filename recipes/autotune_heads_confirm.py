"""Confirmation of recipes/autotune_pareto.py's SQuAD points tuned with heads (``--head-counts 3 6 9``, approx's full
cost model, KL <= 0.0401, 0.02 and 0.01: the points around issue #20's floor) on questions of dev/1 that the recipe
never read: questions 400..1999 (the recipe reads the first 400). Needs the recipe's tuned folders under
runs/autotune_heads. Writes recipes/results/autotune_pareto_squad_heads_confirm.json.

    python recipes/autotune_heads_confirm.py      # CPU, 2 threads: about 20 minutes
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from _shared import CHECKPOINTS, RESULTS, ROOT, write_json

import approx
from approx.harness import metrics as M
from approx.harness.argcheck import at_least, run_script
from approx.harness.provenance import provenance
from approx.harness.tasks import get_task

READER = "squad-dev0-c4efe02158"  # autotune_pareto.py's SQuAD reader (the clustered table's cpu profile)
FOLDERS = ("flops-6", "flops-7", "flops-8")  # its tuned points with heads around the floor
N, SKIP = 2000, 400  # dev/1 questions read; the first SKIP are those the recipe read


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoints", type=Path, default=CHECKPOINTS, help="where the SQuAD reader is")
    p.add_argument(
        "--tuned", type=Path, default=ROOT / "runs" / "autotune_heads",
        help="autotune_pareto.py --head-counts's output folder (its squad/READER/flops-N subfolders)",
    )  # fmt: skip
    p.add_argument("--output", type=Path, default=RESULTS / "autotune_pareto_squad_heads_confirm.json")
    p.add_argument("--data-dir", help="local data folder (default: $APPROX_DATA_DIR, then ../shared/data)")
    p.add_argument("--threads", type=at_least(1), default=2, help="torch CPU threads (default 2)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    ckpt = args.checkpoints / READER
    folders = [args.tuned / "squad" / READER / name for name in FOLDERS]
    missing = [str(f) for f in (ckpt, *folders) if not f.is_dir()]
    if missing:
        print(
            f"missing (run recipes/autotune_pareto.py --head-counts 3 6 9 first): {', '.join(missing)}", file=sys.stderr
        )
        return 2
    t0 = time.time()
    results = approx.evaluate(
        str(ckpt), "squad", [str(f) for f in folders], split="dev/1", limit=N, predictions=True, progress=False,
        data_dir=args.data_dir,
    )  # fmt: skip
    examples, _ = get_task("squad").load("dev/1", limit=N, data_dir=args.data_dir)
    answers = [ex["answers"] for ex in examples]
    out = {
        "command": "python recipes/autotune_heads_confirm.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "questions": f"dev/1 {SKIP}..{N - 1}",
        "threads": args.threads,
        "rows": [],
        "provenance": provenance(),
        "wall_seconds": None,
    }
    ref = results[0]["reference_predictions"]
    full_f1 = M.squad_f1(ref[SKIP:], answers[SKIP:])
    out["full"] = {"f1_new": full_f1, "f1_first400": M.squad_f1(ref[:SKIP], answers[:SKIP])}
    for folder, r in zip(folders, results, strict=True):
        p = r["predictions"]
        row = {
            "folder": str(folder.relative_to(ROOT)) if folder.is_relative_to(ROOT) else str(folder),
            "f1_new": M.squad_f1(p[SKIP:], answers[SKIP:]),
            "f1_first400": M.squad_f1(p[:SKIP], answers[:SKIP]),
            "flops_vs_full": r["fidelity"]["cost"]["flops_vs_full"],
            "speedup": r["fidelity"].get("speedup"),
        }
        row["share_new"] = row["f1_new"] / full_f1
        out["rows"].append(row)
        print(row, flush=True)
    print(out["full"])
    out["wall_seconds"] = time.time() - t0
    write_json(args.output, out)
    return 0


if __name__ == "__main__":
    run_script(main)
