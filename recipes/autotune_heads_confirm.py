"""Confirmation of recipes/autotune_pareto.py's SQuAD points tuned with heads (``--head-counts 3 6 9``, approx's full
cost model, KL <= 0.0401, 0.02 and 0.01: the points around issue #20's floor) on questions of dev/1 that the recipe
never read: questions 400..1999 (the recipe reads the first 400). Needs the recipe's tuned folders under
runs/autotune_heads. Writes recipes/results/autotune_pareto_squad_heads_confirm.json.

    python recipes/autotune_heads_confirm.py      # CPU, 2 threads: about 20 minutes
"""

import json
import time

import torch

import approx
from approx.harness import metrics as M
from approx.harness.provenance import provenance
from approx.harness.tasks import get_task

torch.set_num_threads(2)
ckpt = "runs/checkpoints/squad-dev0-c4efe02158"
base = "runs/autotune_heads/squad/squad-dev0-c4efe02158/"
folders = [base + "flops-6", base + "flops-7", base + "flops-8"]
N, SKIP = 2000, 400
t0 = time.time()
results = approx.evaluate(ckpt, "squad", folders, split="dev/1", limit=N, predictions=True, progress=False)
examples, _ = get_task("squad").load("dev/1", limit=N, data_dir=None)  # $APPROX_DATA_DIR, then ../shared/data
answers = [ex["answers"] for ex in examples]
out = {
    "command": "python recipes/autotune_heads_confirm.py",
    "questions": f"dev/1 {SKIP}..{N - 1}",
    "rows": [],
    "provenance": provenance(),
    "wall_seconds": None,
}
ref = results[0]["reference_predictions"]
full_f1 = M.squad_f1(ref[SKIP:], answers[SKIP:])
full_first = M.squad_f1(ref[:SKIP], answers[:SKIP])
out["full"] = {"f1_new": full_f1, "f1_first400": full_first}
for folder, r in zip(folders, results, strict=True):
    p = r["predictions"]
    row = {
        "folder": folder,
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
json.dump(out, open("recipes/results/autotune_pareto_squad_heads_confirm.json", "w"), indent=1)
