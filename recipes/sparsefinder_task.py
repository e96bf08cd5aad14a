"""Recipe: Sparsefinder on a fine-tuned task (SST-2): sparsity, recall and accuracy over the k-means budget, for
both targets of Treviso et al. (2022), with the 2-fold cross-fitting of ``recipes/_shared.py``.

* ``target="softmax"`` (zero-shot): the SST-2 checkpoints of ``recipes/clustered_table.py`` (fine-tuned with
  full attention on one dev half each; the same cached folders under ``runs/checkpoints/``). Sparsefinder is
  fitted on the model as it is; the gold graph G is the 1.5-entmax support of its softmax scores and the patched
  model computes softmax on the predicted graph Ĝ.
* ``target="entmax"`` (the paper's setting): MiniLM-L6 patched with 1.5-entmax attention is fine-tuned on each
  half with ``approx.harness.finetune`` and the same settings (cached as ``sst2-entmax-dev*``); G is the entmax support of
  its own scores and the patched model computes entmax on Ĝ (exactly the dense entmax output wherever Ĝ holds G).

For each half's checkpoint, ``approx.fit`` learns the projections (r = 4, margin loss) and k-means centroids on the
sentences of the half it was fine-tuned on (never on the half it scores); the centroids are refitted there for
every number of clusters B (projections kept). Each budget point (B clusters, a query joining its
``top_clusters`` nearest; always window 1 and global CLS) is then evaluated with ``approx.evaluate`` on the other
half, next to the dense model on the same batches, and the halves are merged (``approx.harness.crossfit``): accuracy over
all dev examples, and sparsity, recall and exact fraction of Ĝ summed over both halves (the graph counts the
harness takes with ``layer.graph_stats``, as ``approx.graph_stats`` does, on the queries and keys each patched
layer sees while scoring). B = 1 is the exact limit (Ĝ = every pair).

    python recipes/sparsefinder_task.py      # CPU time: see the README (1 torch thread)

Writes ``recipes/results/sparsefinder_task_sst2.json`` (with provenance) and ``sparsefinder_task_sst2.png``
(accuracy and recall against sparsity). ``--limit N --max-steps S --fit-steps F`` makes a smoke run (write it
elsewhere with ``--results-dir`` and ``--checkpoints``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

import approx
from approx.attention.entmax import EntmaxConfig
from approx.attention.sparsefinder import SparsefinderConfig
from approx.harness.argcheck import at_least, run_script
from approx.harness.crossfit import merge_halves
from approx.harness.fitting import as_batches
from approx.harness.provenance import provenance
from approx.harness.tasks import get_task
from approx.integration import attach, load_pretrained
from approx.layer import ApproxAttention

sys.path.insert(0, str(Path(__file__).resolve().parent))
import clustered_table  # noqa: E402
from _shared import (  # noqa: E402
    CHECKPOINTS,
    CROSS_FIT,
    CROSS_FIT_PROTOCOL,
    RESULTS,
    Timer,
    checkpoint_summary,
    ensure_checkpoint,
    write_json,
)

TASK, METRIC = "sst2", "accuracy"
# The attention each target's checkpoints are fine-tuned with (None: full softmax, the clustered table's).
TARGETS: dict[str, EntmaxConfig | None] = {"softmax": None, "entmax": EntmaxConfig()}
FIT_CLUSTERS = 8  # B of the fit (projections and centroids); other B refit only the centroids
# Budget points: B with top_clusters 1, then the top_clusters a query joins at B = 8. SST-2 dev sentences have
# 26 tokens on average (at most 55), so B = 4..8 is about sqrt(N).
BUDGETS: list[dict[str, int]] = [
    {"clusters": 1},
    {"clusters": 2},
    {"clusters": 4},
    {"clusters": 8},
    {"clusters": 8, "top_clusters": 2},
    {"clusters": 8, "top_clusters": 4},
    {"clusters": 8, "top_clusters": 6},
]


def label(config: SparsefinderConfig) -> str:
    return f"B={config.clusters}" + (f", top {config.top_clusters}" if config.top_clusters > 1 else "")


def sentence_batches(tokenizer, split: str, args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    """The sentences of ``split`` as padded model inputs (labels left out): what ``approx.fit`` runs on."""
    task = get_task(TASK)
    examples, _ = task.load(split, source=args.source, data_dir=args.data_dir, limit=args.limit)
    features = task.train_features(examples, tokenizer, max_length=task.default_max_length)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return as_batches([f.input_ids for f in features], args.fit_batch_size, pad_id=pad)


def fit_budgets(folder: Path, target: str, train_split: str, args: argparse.Namespace) -> tuple[list, dict]:
    """Fitted Sparsefinder layers of every budget point for the checkpoint in ``folder``, all fitted on
    ``train_split``; returns ``([layers per budget], fit record)``."""
    model, tokenizer = load_pretrained(str(folder), task="sequence-classification", progress=False)
    model.eval()
    data = sentence_batches(tokenizer, train_split, args)
    config = SparsefinderConfig(target=target, grouping="kmeans", clusters=FIT_CLUSTERS)
    approx.patch(model, "sparsefinder", **config.to_dict())
    report = approx.fit(model, data, steps=args.fit_steps, progress=not args.quiet)
    fitted = approx.patched_layers(model)
    approx.unpatch(model)
    refit: dict[int, dict] = {}  # B -> layers with the fitted projections and centroids refitted for B
    refit_seconds: dict[str, float] = {}
    points = []
    for budget in BUDGETS:
        cfg = dataclasses.replace(config, **budget)
        if cfg.clusters not in refit and cfg.clusters != config.clusters:
            with Timer() as t:
                attach(model, _with_projections(fitted, cfg))
                approx.fit(model, data, progress=False, fit_projections_too=False)
                refit[cfg.clusters] = approx.patched_layers(model)
                approx.unpatch(model)
            refit_seconds[str(cfg.clusters)] = t.seconds
        source = fitted if cfg.clusters == config.clusters else refit[cfg.clusters]
        layers = {}
        for i, lyr in source.items():
            layers[i] = ApproxAttention("sparsefinder", cfg, head_dim=lyr.head_dim, layer_index=i)
            layers[i].load_state(lyr.state())
        points.append(layers)
    record = {
        "split": train_split,
        "sentences": report["inputs"],
        "clusters": config.clusters,
        "steps": args.fit_steps,
        "seconds": report["seconds"],
        "collect_seconds": report["collect_seconds"],
        "refit_centroids_seconds": refit_seconds,
    }
    return points, record


def _with_projections(fitted: dict, config: SparsefinderConfig) -> dict:
    """Layers of ``config`` holding the fitted projections and unfitted centroids of its B (to refit)."""
    layers = {}
    for i, lyr in fitted.items():
        layers[i] = ApproxAttention("sparsefinder", config, head_dim=lyr.head_dim, layer_index=i)
        empty = torch.zeros(0, config.clusters, config.projection_dim)
        layers[i].load_state({**lyr.state(), "centroids": empty})
    return layers


def _graph(halves: list[dict]) -> dict[str, float]:
    """Sparsity, recall and exact fraction from the graph counts of both halves."""
    c = {k: sum(h["fidelity"]["graph"]["counts"][k] for h in halves) for k in halves[0]["fidelity"]["graph"]["counts"]}
    return {
        "sparsity": 1.0 - c["predicted"] / max(c["valid"], 1.0),
        "recall": c["hit"] / c["gold"] if c["gold"] else 1.0,
        "exact_fraction": c["exact"] / max(c["queries"], 1.0),
        "counts": c,
    }


def run_target(target: str, args: argparse.Namespace) -> dict[str, Any]:
    """Checkpoints (cached or fine-tuned now), fits and cross-fitted evaluation of one target."""
    data = dict(data_dir=args.data_dir, source=args.source)
    base = args.model or clustered_table.default_model()
    settings = clustered_table.base_settings(TASK, max_steps=args.max_steps, limit=args.limit)
    method = TARGETS[target]
    dense = [method] if method is not None else []  # the dense entmax model is evaluated as a method
    summaries, fits, halves, examples = [], [], [], []
    seconds = {"finetune_this_run": 0.0, "fit": 0.0, "evaluate": 0.0}
    for train_split, eval_split in CROSS_FIT:
        with Timer() as t:
            folder, record, reused = ensure_checkpoint(
                base, TASK, train_split, settings, root=args.checkpoints, progress=not args.quiet, method=method, **data
            )
        seconds["finetune_this_run"] += t.seconds
        summaries.append({**checkpoint_summary(folder, record, reused), "method": record.get("method")})
        with Timer() as t:
            points, fit = fit_budgets(folder, target, train_split, args)
        seconds["fit"] += t.seconds
        fits.append(fit)
        with Timer() as t:
            halves.append(
                approx.evaluate(
                    str(folder),
                    TASK,
                    [*dense, *points],
                    split=eval_split,
                    limit=args.limit,
                    batch_size=args.batch_size,
                    seed=args.seed,
                    progress=not args.quiet,
                    predictions=True,
                    **data,
                )
            )
        seconds["evaluate"] += t.seconds
        examples.append(get_task(TASK).load(eval_split, limit=args.limit, **data)[0])
    # predictions of the dense model the points approximate: full softmax, or the entmax model
    dense_preds = [h[0]["predictions"] if dense else h[0]["reference_predictions"] for h in halves]
    merged = merge_halves(halves, examples, protocol=CROSS_FIT_PROTOCOL)
    rows = []
    for j, result in enumerate(merged[len(dense) :], start=len(dense)):
        config = SparsefinderConfig(**{k: v for k, v in result["method"].items() if k != "name"})
        same = [
            a == b
            for h, ref in zip(halves, dense_preds, strict=True)
            for a, b in zip(h[j]["predictions"], ref, strict=True)
        ]
        rows.append(
            {
                "label": label(config),
                "clusters": config.clusters,
                "top_clusters": config.top_clusters,
                METRIC: result["metrics"][METRIC],
                "agreement_with_dense": sum(same) / len(same),
                **_graph(result["halves"]),
                "seconds": result["fidelity"]["seconds"],
                "reference_seconds": result["fidelity"]["reference_seconds"],
            }
        )
        if not args.quiet:
            r = rows[-1]
            print(
                f"{target:7s} {r['label']:14s} sparsity {r['sparsity']:.3f} recall {r['recall']:.3f} "
                f"exact {r['exact_fraction']:.3f} {METRIC} {r[METRIC]:.2f}",
                flush=True,
            )
    first = merged[0]
    dense_metric = first["metrics"][METRIC] if dense else first["reference_metrics"][METRIC]
    seconds["finetune"] = sum(s["finetune_wall_seconds"] or 0.0 for s in summaries)
    return {
        "target": target,
        "setting": (
            "zero-shot: softmax checkpoints (the clustered table's), softmax on the predicted graph; G = 1.5-entmax "
            "support of their softmax scores"
            if method is None
            else "checkpoints fine-tuned with 1.5-entmax attention (approx.harness.finetune, method=entmax), entmax on the "
            "predicted graph; G = the entmax support of their own scores"
        ),
        "dense": {"attention": "full softmax" if method is None else "1.5-entmax (dense)", METRIC: dense_metric},
        **({"softmax_on_entmax_weights": {METRIC: first["reference_metrics"][METRIC]}} if dense else {}),
        "checkpoints": summaries,
        "fits": fits,
        "points": rows,
        "examples": first["examples"],
        "results": merged,
        "wall_seconds": seconds,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, rec) = plt.subplots(1, 2, figsize=(10, 4.2))
    for (target, res), color in zip(result["targets"].items(), ("tab:blue", "tab:orange"), strict=False):
        pts = sorted(res["points"], key=lambda r: r["sparsity"])
        xs = [r["sparsity"] for r in pts]
        acc.plot(xs, [r[METRIC] for r in pts], marker="o", color=color, label=f"target {target}")
        acc.axhline(res["dense"][METRIC], color=color, lw=0.8, ls="--", label=f"dense ({res['dense']['attention']})")
        rec.plot(xs, [r["recall"] for r in pts], marker="o", color=color, label=f"target {target}")
        for r in pts:
            for ax, y in ((acc, r[METRIC]), (rec, r["recall"])):
                ax.annotate(r["label"], (r["sparsity"], y), textcoords="offset points", xytext=(3, 3), fontsize=6)
    acc.set_ylabel(f"{METRIC} (%), cross-fitted over all dev examples")
    rec.set_ylabel("recall  |G ∩ Ĝ| / |G|")
    for ax in (acc, rec):
        ax.set_xlabel("sparsity  1 - |Ĝ| / pairs")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    fig.suptitle(f"Sparsefinder (k-means) on MiniLM-L6 fine-tuned for {TASK.upper()}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", nargs="+", choices=list(TARGETS), default=list(TARGETS), help="default: both")
    p.add_argument("--model", help="base model to fine-tune (default: MiniLM-L6 from the wheel)")
    p.add_argument(
        "--limit", type=at_least(1), help="first N examples of each half, for fine-tuning, fitting and scoring"
    )
    p.add_argument("--max-steps", type=at_least(1), help="cap the steps of each fine-tuning (smoke runs)")
    p.add_argument(
        "--fit-steps",
        type=at_least(1),
        help="optimizer steps of the projections per layer (default: the method's fit_config)",
    )
    p.add_argument("--fit-batch-size", type=at_least(1), default=16)
    p.add_argument("--batch-size", type=at_least(1), default=32, help="evaluation batch size")
    p.add_argument("--seed", type=at_least(0), default=0)
    p.add_argument("--threads", type=at_least(1), default=1, help="torch threads (default 1: the 2 cores are shared)")
    p.add_argument("--data-dir", help="default: $APPROX_DATA_DIR, then ../shared/data")
    p.add_argument("--source", choices=["auto", "local", "hub"], help="data source")
    p.add_argument("--checkpoints", type=Path, default=CHECKPOINTS, help="cache of fine-tuned checkpoints")
    p.add_argument("--results-dir", type=Path, default=RESULTS, help="where the result JSON and PNG go")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.fit_steps is None:  # the default lives in the method's fit settings
        args.fit_steps = approx.get_method("sparsefinder").fit_config().steps
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    with Timer() as wall:
        targets = {t: run_target(t, args) for t in args.targets}
    result = {
        "recipe": "recipes/sparsefinder_task.py",
        "task": TASK,
        "metric": METRIC,
        "protocol": (
            CROSS_FIT_PROTOCOL
            + "; per half: the checkpoint fine-tuned on the train half, Sparsefinder (k-means, r = 4, window 1, "
            f"global CLS) fitted on the train half's sentences ({args.fit_steps} steps per layer, B = "
            f"{FIT_CLUSTERS}; centroids refitted there for every other B), the other half scored under every "
            "budget point and the dense model on the same batches; sparsity, recall and exact fraction over real "
            "query-key pairs of every layer and head on the scored half, measured on the queries and keys each "
            "patched layer sees; B = 1 is the exact limit"
            + (f"; first {args.limit} examples of each half" if args.limit else "")
        ),
        "evaluation_limit": args.limit,
        "method": {"name": "sparsefinder", **SparsefinderConfig(grouping="kmeans", clusters=FIT_CLUSTERS).to_dict()},
        "budgets": BUDGETS,
        "targets": targets,
        "wall_seconds": {
            "total": wall.seconds,
            **{f"{t}_{k}": v for t, r in targets.items() for k, v in r["wall_seconds"].items()},
        },
        "provenance": provenance(seed=args.seed, torch_threads_requested=args.threads),
    }
    out = args.results_dir / f"sparsefinder_task_{TASK}.json"
    write_json(out, result)
    plot(result, out.with_suffix(".png"))
    for t, r in targets.items():
        print(
            f"{t}: dense {r['dense'][METRIC]:.2f}; " + ", ".join(f"{p['label']} {p[METRIC]:.2f}" for p in r["points"])
        )
    print(f"wall {wall.seconds:.0f} s; wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    run_script(main)
