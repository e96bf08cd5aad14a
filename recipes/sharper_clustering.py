"""Recipe (issue #20, step 0): the clustering choices of clustered and improved-clustered attention.

Bit b of a query's code is ``[q . a_b >= beta_b]`` with ``beta_b = mean_b + std_b * u_b`` over the real queries of
the sequence and head. ``thresholds="random"`` draws u_b ~ N(0, 1) (each hyperplane cuts the query cloud at a random
place; the default so far); ``thresholds="mean"`` sets u_b = 0 (every hyperplane through the queries' mean: balanced
bits). Side by side with fast-transformers, approx's error was measured 1-10 % above the reference implementation's
with random thresholds and below it with u = 0: this recipe measures the choice on approx alone, on

1. **attention-output error**: MiniLM-L6's own q, k, v on WikiText-2 test windows of 512 tokens, every layer and
   head, the relative error ``|out - exact| / |exact|`` of each layer's output, averaged over layers, for
   ``--seeds`` seeds of the planes and offsets;
2. **task metrics, zero-shot**: the SQuAD reader of the MonarchAttention protocol (MiniLM-L6 fine-tuned with full
   attention on dev half 0) reading the first ``--questions`` of dev half 1 at 384 tokens, and MRPC (the clustered
   table's cpu-profile checkpoint, fine-tuned on train) on every dev pair, every layer swapped.

for clustered (C = 25, 100) and improved clustered (C = 25, 100, k = 32), each choice of :data:`VARIANTS` (the
thresholds, the bits of the hash, the K-means iterations, Euclidean Lloyd steps after the Hamming K-means, and
improved clustering's top-k keys chosen by the clusters' spread instead of the centroid alone) changed alone from
the baseline (the defaults before issue #20: the paper's clustering, ``refine=0``). A choice becomes the default
only where it wins on both: lower error in every setting and no task metric lower (``refine=1`` did, and is the
default since). Writes ``recipes/results/sharper_clustering.json``.

    python recipes/sharper_clustering.py                  # CPU: about an hour on one thread (MRPC fine-tuning included)
    python recipes/sharper_clustering.py --variants refine=1 topk_by=spread --update   # add variants to the JSON
    python recipes/sharper_clustering.py --report         # the tables from the committed JSON
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

import approx
from approx.harness.argcheck import at_least, run_script
from approx.harness.data import default_model_path, wikitext_windows
from approx.harness.fitting import as_batches
from approx.harness.provenance import provenance
from approx.integration import attention_probe, load_pretrained

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shared import CHECKPOINTS, RESULTS, Timer, checkpoint_summary, ensure_checkpoint, evaluate_checkpoints, write_json  # noqa: E402
from clustered_table import base_settings  # noqa: E402
from monarch_protocol import FOLDS, READER  # noqa: E402

OUTPUT = RESULTS / "sharper_clustering.json"
BUDGETS = [("clustered", {"clusters": 25}), ("i-clustered", {"clusters": 25, "topk": 32})]
BUDGETS += [("clustered", {"clusters": 100}), ("i-clustered", {"clusters": 100, "topk": 32})]
# Each clustering choice changed alone from the baseline (thresholds "random", 63 bits, 10 iterations, no Euclidean
# steps, top-k keys by the centroid; the defaults before this recipe, and the committed rows' settings): the first
# variant is the baseline itself. Fewer bits hash cheaper and coarser; iterations are Lloyd steps of the Hamming
# K-means; refine adds Lloyd steps on the queries themselves; topk_by is improved clustering's only (clustered
# attention has no top-k keys).
BASELINE: dict[str, Any] = {"refine": 0}  # where the baseline differs from today's defaults
VARIANTS: list[dict[str, Any]] = [
    {},
    {"thresholds": "mean"},
    {"bits": 31},
    {"bits": 16},
    {"iterations": 5},
    {"iterations": 20},
    {"refine": 1},
    {"refine": 3},
    {"topk_by": "spread"},
]
KNOBS = ("thresholds", "bits", "iterations", "refine", "topk_by")  # what the variants change


def _label(variant: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in variant.items()) or "baseline"


def chosen_variants(labels: list[str] | None) -> list[dict[str, Any]]:
    """The variants named by ``labels`` (``baseline``, ``refine=1``...; every one when None), or an error listing them."""
    if labels is None:
        return VARIANTS
    known = {_label(v): v for v in VARIANTS}
    unknown = [x for x in labels if x not in known]
    if unknown:
        raise SystemExit(f"unknown variant(s) {', '.join(unknown)}; the variants are: {', '.join(known)}")
    return [known[x] for x in labels]


def configs(seed: int = 0, variants: list[dict[str, Any]] | None = None) -> list:
    """Every budget under every variant that its method has (topk_by: improved clustering only), each variant's
    other choices at the baseline."""
    out = []
    for method, options in BUDGETS:
        fields = approx.get_method(method).config_class().to_dict()
        base = {k: v for k, v in BASELINE.items() if k in fields}
        for v in VARIANTS if variants is None else variants:
            if all(k in fields for k in v):
                out.append(approx.get_method(method).make_config(**options, **{**base, **v}, seed=seed))
    return out


def variant_label(config: dict[str, Any]) -> str:
    """``baseline``, or the clustering choices a config (a result's record) changes from the baseline (``bits=31``);
    a record written before an option existed means what it meant then (``refine=0``)."""
    config_class = approx.get_method(config["name"]).config_class
    base = {**config_class().to_dict(), **BASELINE}
    recorded = config_class.recorded_options({k: v for k, v in config.items() if k != "name"})
    changed = [f"{k}={recorded[k]}" for k in KNOBS if k in recorded and recorded[k] != base[k]]
    return ", ".join(changed) or "baseline"


def output_errors(args) -> list[dict[str, Any]]:
    """Mean over layers of each layer's relative output error, per config and seed."""
    model, tokenizer = load_pretrained(args.model or default_model_path(), progress=False)
    approx.patch(model, "full")
    batches = as_batches(wikitext_windows(tokenizer, args.data_dir, length=args.length, count=args.windows), 4)
    captured: list[tuple] = []

    def probe(layer, q, k, v, key_mask, scale, out) -> None:
        captured.append((layer.layer_index, q, k, v, key_mask, scale, out))

    model.eval()
    with torch.no_grad(), attention_probe(probe):
        for inputs in batches:
            model(**inputs)
    rows = []
    for seed in range(args.seeds):
        for config in configs(seed, args.chosen):
            per_layer: dict[int, list[float]] = {}
            for index, q, k, v, key_mask, scale, exact in captured:
                layer = approx.ApproxAttention(config.method, config, head_dim=q.shape[-1], layer_index=index)
                with torch.no_grad():
                    out = layer(q, k, v, key_mask, scale=scale)
                per_layer.setdefault(index, []).append(float((out - exact).norm() / exact.norm()))
            errors = [statistics.fmean(e) for _, e in sorted(per_layer.items())]
            rows.append({"config": config.to_dict() | {"name": config.method}, "seed": seed, "per_layer": errors,
                         "mean": statistics.fmean(errors)})  # fmt: skip
    return rows


def task_metrics(args) -> dict[str, Any]:
    data = {"data_dir": args.data_dir, "source": args.source}
    squad_settings = {**base_settings("squad", "cpu"), **READER["cpu"]}
    mrpc_settings = base_settings("mrpc", "cpu")
    if args.max_steps is not None:  # smoke runs
        for settings in (squad_settings, mrpc_settings):
            settings.update(max_steps=args.max_steps, limit=args.train_limit)
    (train_split, eval_split) = FOLDS["cpu"][0]
    base = args.model or default_model_path()
    out = {}
    plans = [
        ("squad", squad_settings, train_split, eval_split, args.questions),
        ("mrpc", mrpc_settings, "train", "dev", args.pairs),
    ]
    for task, settings, train, split, limit in plans:
        folder, record, reused = ensure_checkpoint(
            base, task, train, settings, root=args.checkpoints, progress=not args.quiet, **data
        )
        results = evaluate_checkpoints(
            task, [(str(folder), split)], configs(0, args.chosen), limit=limit, batch_size=args.batch_size,
            progress=not args.quiet, **data,
        )  # fmt: skip
        out[task] = {"checkpoint": checkpoint_summary(folder, record, reused), "split": split, "results": results}
    return out


def run(args) -> dict[str, Any]:
    made = provenance(seed=0)  # the code as the run starts (a commit made during an hour's run is not its code)
    with Timer() as t_err:
        errors = output_errors(args)
    with Timer() as t_tasks:
        tasks = task_metrics(args)
    return {
        "recipe": "recipes/sharper_clustering.py",
        "protocol": (
            f"attention-output error: MiniLM-L6 q, k, v on {args.windows} WikiText-2 test windows of {args.length} tokens, "
            f"relative error of each layer's output against exact attention, mean over layers, {args.seeds} seeds; "
            f"tasks: zero-shot swap of every layer, SQuAD reader (dev/0) on the first {args.questions} questions of "
            f"dev/1, MRPC (train) on {'every dev pair' if args.pairs is None else f'the first {args.pairs} dev pairs'}"
        ),
        "errors": errors,
        "tasks": tasks,
        "wall_seconds": {"errors": t_err.seconds, "tasks": t_tasks.seconds},
        "provenance": made,
        "runs": [
            {
                "variants": [_label(v) for v in args.chosen],
                "wall_seconds": {"errors": t_err.seconds, "tasks": t_tasks.seconds},
                "provenance": made,
            }
        ],  # fmt: skip
    }


def merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new``'s rows added to ``old`` (a row of the same config and seed replaced), refused when the two were not
    measured the same way (protocol, checkpoints, evaluation splits); each run's variants and provenance kept in
    ``runs``."""
    for what, a, b in [
        ("protocol", old["protocol"], new["protocol"]),
        ("tasks", sorted(old["tasks"]), sorted(new["tasks"])),
        *[(f"{t} checkpoint", old["tasks"][t]["checkpoint"].get("folder"), new["tasks"][t]["checkpoint"].get("folder"))
          for t in new["tasks"] if t in old["tasks"]],
        *[(f"{t} split", old["tasks"][t]["split"], new["tasks"][t]["split"]) for t in new["tasks"] if t in old["tasks"]],
    ]:  # fmt: skip
        if a != b:
            raise SystemExit(
                f"cannot --update: the {what} differs ({a!r} in the file, {b!r} now); run without --update"
            )
    out = dict(old)

    def key(row: dict[str, Any]) -> str:
        config = row.get("config") or row["method"]
        return json.dumps(
            [config["name"], config["clusters"], config.get("topk"), variant_label(config), row.get("seed")]
        )

    def combined(rows_old: list, rows_new: list) -> list:
        fresh = {key(r): r for r in rows_new}
        kept = [fresh.pop(key(r), r) for r in rows_old]
        return kept + list(fresh.values())

    out["errors"] = combined(old["errors"], new["errors"])
    out["tasks"] = {
        t: {**old["tasks"][t], "results": combined(old["tasks"][t]["results"], new["tasks"][t]["results"])}
        for t in old["tasks"]
    }
    labels = list(dict.fromkeys(variant_label(r["config"]) for r in old["errors"]))  # what the first run measured
    first = {"variants": labels, "wall_seconds": old["wall_seconds"], "provenance": old["provenance"]}
    added = {label for run in new["runs"] for label in run["variants"]}
    # an earlier run whose every variant was measured again is no longer behind any row
    kept = [run for run in old.get("runs", [first]) if not set(run["variants"]) <= added]
    out["runs"] = kept + new["runs"]
    return out


def markdown(res: dict[str, Any]) -> str:
    metric = {"squad": "f1", "mrpc": "accuracy"}
    head = "| method | variant | output error (mean ± sd over seeds) | " + " | ".join(
        f"{t.upper() if t == 'mrpc' else 'SQuAD'} {metric[t]}" for t in res["tasks"]
    )
    lines = [head + " |", "|" + " --- |" * (3 + len(res["tasks"]))]
    full = {t: r["results"][0]["reference_metrics"][metric[t]] for t, r in res["tasks"].items()}
    rows = _rows(res)
    for (method, clusters, label), row in rows.items():
        cells = [f"{row['metrics'][task]:.2f}" for task in res["tasks"]]
        lines.append(
            f"| {method}-{clusters} | {label} | {row['error']:.4f} ± {row['sd']:.4f} | " + " | ".join(cells) + " |"
        )
    lines.append("| full | - | 0 | " + " | ".join(f"{full[t]:.2f}" for t in res["tasks"]) + " |")
    lines += ["", *verdicts(res)]
    return "\n".join(lines)


def _rows(res: dict[str, Any]) -> dict[tuple, dict[str, Any]]:
    """(method, clusters, variant label) -> mean and sd of the output error over seeds, and the task metrics; in the
    order of this module's BUDGETS and VARIANTS (rows of others last, in the JSON's order)."""
    metric = {"squad": "f1", "mrpc": "accuracy"}

    def key(config):
        return config["name"], config["clusters"], variant_label(config)

    out: dict[tuple, dict[str, Any]] = {}
    for r in res["errors"]:
        out.setdefault(key(r["config"]), {"errors": []})["errors"].append(r["mean"])
    for k, row in out.items():
        row["error"] = statistics.fmean(row["errors"])
        row["sd"] = statistics.stdev(row["errors"]) if len(row["errors"]) > 1 else 0.0
        row["metrics"] = {
            task: next(x["metrics"][metric[task]] for x in r["results"] if key(x["method"]) == k)
            for task, r in res["tasks"].items()
        }
    budgets = [(m, o["clusters"]) for m, o in BUDGETS]
    labels = [_label(v) for v in VARIANTS]

    def order(item):
        (method, clusters, label), _ = item
        where = (method, clusters)
        return (budgets.index(where) if where in budgets else len(budgets), labels.index(label) if label in labels
                else len(labels))  # fmt: skip

    return dict(sorted(out.items(), key=order))


def verdicts(res: dict[str, Any]) -> list[str]:
    """The rule set beforehand: a variant becomes the default only if it lowers the output error of every setting and
    lowers no task metric of any, against the baseline. Where several variants of one knob win (``refine=1`` and ``refine=3``), the same
    rule decides between them: a dearer one replaces a cheaper winner only if it wins on both against it."""
    rows = _rows(res)
    labels = list(dict.fromkeys(label for _, _, label in rows if label != "baseline"))
    out, winners = [], []
    for label in labels:
        line, wins = _compare(rows, "baseline", label)
        out.append(f"- `{label}`: {line}: " + ("**wins on both**" if wins else "not adopted"))
        if wins:
            winners.append(label)
    for i, cheap in enumerate(winners):  # variants in VARIANTS order: cheaper first within a knob
        for dear in winners[i + 1 :]:
            if cheap.split("=")[0] == dear.split("=")[0]:
                line, wins = _compare(rows, cheap, dear)
                verdict = f"**`{dear}` wins on both**" if wins else f"`{dear}` does not win on both: `{cheap}` stays"
                out.append(f"- `{dear}` against `{cheap}`: {line}: {verdict}")
    return out


def _compare(rows: dict[tuple, dict[str, Any]], base: str, label: str) -> tuple[str, bool]:
    """How variant ``label`` fares against variant ``base`` in every setting that has both: the sentence and whether
    it wins on both (lower output error everywhere, no task metric lower)."""
    pairs = [(rows[(m, c, base)], row) for (m, c, lab), row in rows.items() if lab == label and (m, c, base) in rows]
    if not pairs:  # e.g. --variants without the baseline, and without --update
        return f"no `{base}` row to compare with (run the baseline too, or add to its file with --update)", False
    lower = sum(v["error"] < d["error"] for d, v in pairs)
    moves = [v["metrics"][t] - d["metrics"][t] for d, v in pairs for t in v["metrics"]]
    worse = sum(x < 0 for x in moves)
    line = (
        f"lower output error in {lower} of {len(pairs)} settings; task metrics move {min(moves):+.2f} to "
        f"{max(moves):+.2f}, lower in {worse} of {len(moves)}"
    )
    return line, lower == len(pairs) and not worse


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: MiniLM-L6 from the wheel")
    p.add_argument("--data-dir", default=None, help="default: $APPROX_DATA_DIR, then ../shared/data")
    p.add_argument("--windows", type=at_least(1), default=4, help="WikiText-2 windows for the output error")
    p.add_argument("--seeds", type=at_least(1), default=3, help="seeds of the planes and offsets for the output error")
    p.add_argument("--length", type=at_least(3), default=512, help="tokens per WikiText-2 window")
    p.add_argument("--questions", type=at_least(1), default=400, help="SQuAD questions of dev half 1")
    p.add_argument("--pairs", type=at_least(1), default=None, help="MRPC dev pairs (default: every one)")
    p.add_argument("--source", choices=["auto", "local", "hub"], default=None, help="data source")
    p.add_argument("--checkpoints", type=Path, default=CHECKPOINTS, help="cache of fine-tuned checkpoints")
    p.add_argument("--max-steps", type=at_least(1), default=None, help="smoke runs: cap the fine-tuning steps")
    p.add_argument(
        "--train-limit", type=at_least(1), default=None, help="smoke runs: fine-tune on the first N examples"
    )
    p.add_argument("--batch-size", type=at_least(1), default=32)
    p.add_argument("--threads", type=at_least(0), default=0)
    p.add_argument("--output", type=Path, default=OUTPUT)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--report", action="store_true", help="print the table of --output, run nothing")
    p.add_argument("--variants", nargs="+", metavar="LABEL", help="run only these variants (baseline, refine=1, ...)")
    p.add_argument("--update", action="store_true", help="add the rows to --output's (same protocol) instead of "
                   "replacing it")  # fmt: skip
    args = p.parse_args(argv)
    args.chosen = chosen_variants(args.variants)
    if args.report:
        if not args.output.is_file():
            print(f"no {args.output}: run the recipe first", file=sys.stderr)
            return 2
        print(markdown(json.loads(args.output.read_text())))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.update and not args.output.is_file():
        print(f"no {args.output} to --update: run without it first", file=sys.stderr)
        return 2
    res = run(args)
    if args.update:
        res = merge(json.loads(args.output.read_text()), res)
    write_json(args.output, res)
    print(markdown(res))
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    run_script(main)
