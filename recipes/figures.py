"""Recipe: the project's figures, as PNG files, from committed results and one real SQuAD example.

* ``quality_vs_cost.png``: per task of ``recipes/results/clustered_table_<task>.json``, the task metric against
  the attention FLOPs relative to full attention; each method is a curve over its budget knob (clusters,
  features), full attention the dashed line.
* ``speed.png``: the attention-op benchmark (``benchmarks/results/attention_op_cpu.json``): milliseconds per
  call against sequence length, per method.
* ``squad_attention.png``: the clustered-attention paper's qualitative figure: attention of the question tokens
  over a SQuAD context (the paper's Super Bowl 50 paragraph, Peyton Manning's 2015 season) under full, clustered
  and improved-clustered attention with 25 clusters (k = 32), computed with each method's ``weights()``
  function on the same queries and keys (one layer and head; by default the last layer and the head whose full
  attention from the question is sharpest). The model is the SQuAD checkpoint of ``recipes/clustered_table.py``
  that never saw this article (cross-fitting); without one (and without ``--model``) the figure is not drawn,
  rather than redrawn from another model (``--model`` draws it from the one given, the plain MiniLM-L6 encoder say).

    python recipes/figures.py                # a few seconds; writes recipes/results/figures/*.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from approx.harness.argcheck import looks_like_path, run_script
from approx.harness.provenance import provenance, weights_digest  # noqa: E402
from approx.layer import ApproxAttention  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shared import CHECKPOINTS, RESULTS, ROOT  # noqa: E402
from paper_table import PRIMARY_METRIC, TASK_NAMES, TASK_ORDER, load_results  # noqa: E402

BENCHMARK = ROOT / "benchmarks" / "results" / "attention_op_cpu.json"
QUESTION_ID = "56beb57b3aeaaa14008c9279"  # "What was Peyton Manning's passer rating for the season?"
KNOBS = {"clustered": "clusters", "i-clustered": "clusters", "favor": "features"}


def quality_vs_cost(results: dict[str, dict[str, Any]], out: Path) -> Path | None:
    tasks = [t for t in TASK_ORDER if t in results]
    if not tasks:
        return None
    cols = min(4, len(tasks))
    rows = (len(tasks) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.0 * rows), squeeze=False)
    for ax, task in zip(axes.flat, tasks, strict=False):
        record = results[task]
        metric = PRIMARY_METRIC[task]
        curves: dict[str, list[tuple[float, float, int]]] = {}
        for r in record["results"]:
            name = r["method"]["name"]
            knob = r["method"].get(KNOBS.get(name, ""), 0)
            cost = r["fidelity"]["cost"]["flops_vs_full"]
            curves.setdefault(name, []).append((cost, r["metrics"][metric], knob))
        full = record["results"][0]["reference_metrics"][metric]
        ax.axhline(full, color="k", ls="--", lw=1, label="full")
        for name, points in curves.items():
            points.sort(key=lambda p: p[2])
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
            for x, y, knob in points:
                ax.annotate(str(knob), (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(f"{TASK_NAMES[task]} ({record['results'][0]['examples']} dev examples)", fontsize=9)
        ax.set_xlabel("attention FLOPs / full", fontsize=8)
        ax.set_ylabel(metric, fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(tasks) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Quality vs attention cost, fine-tuned MiniLM-L6, attention swapped at inference", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def speed(benchmark: Path, out: Path) -> Path | None:
    if not benchmark.is_file():
        return None
    res = json.loads(benchmark.read_text())
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for method in ["sdpa", *[m for m in res["methods"] if m != "full"]]:
        points = [
            (n, sorted(res["times_s"][str(n)][method])[len(res["times_s"][str(n)][method]) // 2] * 1000)
            for n in res["lengths"]
            if res["times_s"][str(n)].get(method)
        ]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label="full (SDPA)" if method == "sdpa" else method)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("ms per call, (1, 12, N, 64), float32")
    ax.set_title(f"Attention op on CPU, {res['provenance']['torch_threads']} threads", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def _squad_model(args: argparse.Namespace, example: dict[str, Any]) -> str | None:
    if args.model:
        return args.model
    from approx.harness.tasks.base import cross_fit_half

    # the checkpoint trained on the half that does not hold this article
    for half in (0, 1):
        titles = {e["title"] for e in cross_fit_half(args._examples, half)}
        if example["title"] not in titles:
            found = sorted(args.checkpoints.glob(f"squad-dev{half}-*/finetune.json"))
            if found:
                return str(found[-1].parent)
    return None


def squad_inputs(args: argparse.Namespace) -> tuple[dict[str, Any], str] | str:
    """The heatmap's question and reader, or why it cannot be drawn (read before any figure is)."""
    from approx.harness.tasks import get_task

    examples, _ = get_task("squad").load("dev", source=args.source, data_dir=args.data_dir)
    args._examples = examples
    wanted = args.question_id or QUESTION_ID
    example = next((e for e in examples if e["id"] == wanted), None)
    if example is None and args.question_id:  # (the first question had been drawn in the place of a mistyped one)
        return f"squad_attention.png: no question {args.question_id!r} in SQuAD dev"
    if example is None:  # the default question is not in this file (a smaller one): its first, said
        example = examples[0]
        print(
            f"squad_attention.png: question {QUESTION_ID} is not in this SQuAD dev file: {example['id']}",
            file=sys.stderr,
        )
    if args.model and looks_like_path(args.model) and not Path(args.model).expanduser().is_dir():
        return f"squad_attention.png: --model {args.model}: no such folder"
    model_name = _squad_model(args, example)
    if model_name is None:  # (the plain encoder had been drawn in its place, over the reader's figure, in silence)
        return (
            f"squad_attention.png: no SQuAD reader fine-tuned on the half without this article in {args.checkpoints} "
            "(recipes/clustered_table.py makes it; --model draws it from another model, --skip-squad leaves it out)"
        )
    return example, model_name


def squad_attention(args: argparse.Namespace, out: Path, example: dict[str, Any], model_name: str) -> Path:
    from approx.integration import attention_probe, load_pretrained, patch, patched_layers, unpatch

    model, tokenizer = load_pretrained(model_name, progress=False)
    enc = tokenizer(example["question"], example["context"], truncation="only_second", max_length=384)
    inputs = {k: torch.tensor([v]) for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    layer = args.layer % len(patched_layers(patch(model, "full")) or [0])
    unpatch(model)
    patch(model, "full", layers=[layer])
    captured = {}

    def probe(lyr, q, k, v, key_mask, scale, o):
        captured.update(q=q.float(), k=k.float(), key_mask=key_mask, scale=scale)

    with torch.no_grad(), attention_probe(probe):
        model(**inputs)
    unpatch(model)
    q, k, key_mask, scale = captured["q"], captured["k"], captured["key_mask"], captured["scale"]
    head_dim = q.shape[-1]
    setups = [
        ("full", "full", {}),
        # the paper's clustering (no Euclidean step), as in the paper's figure
        ("clustered-25", "clustered", {"clusters": 25, "refine": 0}),
        ("i-clustered-25 (k = 32)", "i-clustered", {"clusters": 25, "topk": 32, "refine": 0}),
    ]
    weights = {}
    for label, name, options in setups:
        lyr = ApproxAttention(name, None, head_dim=head_dim, layer_index=layer)
        lyr = ApproxAttention(name, lyr.method.make_config(**options), head_dim=head_dim, layer_index=layer)
        with torch.no_grad():
            weights[label] = lyr.method.weights(
                q, k, key_mask=key_mask, query_mask=key_mask, scale=scale, config=lyr.config, state=lyr.state()
            )[0]  # (H, N, S)
    seq = enc.sequence_ids() if hasattr(enc, "sequence_ids") else None
    tokens = tokenizer.convert_ids_to_tokens(enc["input_ids"])
    question = [i for i, s in enumerate(seq) if s == 0] if seq else list(range(1, 12))
    rows = [0, *question]  # [CLS] and the question tokens, as in the paper
    context = [i for i, s in enumerate(seq) if s == 1] if seq else list(range(len(tokens)))
    full = weights["full"][:, rows][:, :, context]  # (H, R, C)
    if args.head is None:  # the head whose full attention from the question is sharpest (lowest entropy)
        entropy = -(full.clamp_min(1e-12).log() * full).sum(-1).mean(-1)
        head = int(entropy.argmin())
    else:
        head = args.head
    fig, axes = plt.subplots(len(setups), 1, figsize=(16, 2.2 * len(setups) + 1), sharex=True)
    for ax, (label, _, _) in zip(axes, setups, strict=True):
        w = weights[label][head][rows][:, context]
        w = w / w.sum(-1, keepdim=True).clamp_min(1e-12)  # over the context only, as in the paper's figure
        ax.imshow(w.numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_yticks(range(len(rows)), [tokens[i] for i in rows], fontsize=6)
        ax.set_title(label, fontsize=9, loc="left")
    axes[-1].set_xticks(range(len(context)), [tokens[i] for i in context], fontsize=4.5, rotation=90)
    fig.suptitle(
        f"Attention of the question tokens over the context (layer {layer}, head {head}; rows renormalised over "
        f"the context); {Path(model_name).name}; SQuAD {example['id']}: {example['question']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)
    shown = Path(model_name)
    shown = str(shown.relative_to(ROOT)) if shown.is_absolute() and shown.is_relative_to(ROOT) else model_name
    meta = {"model": shown, "example": example["id"], "question": example["question"], "layer": layer, "head": head}
    made = provenance(seed=0, model_weights_sha256=weights_digest(model))  # (seed: the methods' default, 0)
    (out.with_suffix(".json")).write_text(json.dumps({**meta, "provenance": made}, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--out-dir", type=Path, help="default: RESULTS_DIR/figures")
    p.add_argument("--benchmark", type=Path, default=BENCHMARK)
    p.add_argument("--checkpoints", type=Path, default=CHECKPOINTS, help="where the SQuAD checkpoints are cached")
    p.add_argument("--model", help="model for the attention heatmap (default: see above)")
    p.add_argument("--question-id", help=f"default {QUESTION_ID}, or the file's first question when it lacks that one")
    p.add_argument("--layer", type=int, default=-1)
    p.add_argument("--head", type=int, help="default: the sharpest head")
    p.add_argument("--data-dir")
    p.add_argument("--source", choices=["auto", "local", "hub"])
    p.add_argument("--skip-squad", action="store_true", help="no SQuAD heatmap (needs the SQuAD dev file)")
    args = p.parse_args(argv)
    results = load_results(args.results_dir)
    missing = []  # (a mistyped folder or file had read as success, its figure left out without a word)
    if not results:
        missing.append(f"quality_vs_cost.png: no clustered_table_*.json in {args.results_dir} (clustered_table.py)")
    if not args.benchmark.is_file():
        missing.append(f"speed.png: no {args.benchmark} (benchmarks/attention_op.py makes it)")
    squad = None if args.skip_squad else squad_inputs(args)
    if isinstance(squad, str):
        missing.append(squad)
    if missing:  # said before anything is drawn or a folder made
        print("not drawn: " + "; ".join(missing), file=sys.stderr)
        return 1
    out_dir = args.out_dir or args.results_dir / "figures"
    out_dir.mkdir(parents=True, exist_ok=True)
    made = [
        quality_vs_cost(results, out_dir / "quality_vs_cost.png"),
        speed(args.benchmark, out_dir / "speed.png"),
    ]
    if squad is not None:
        made.append(squad_attention(args, out_dir / "squad_attention.png", *squad))
    for path in made:
        if path is not None:
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    run_script(main)
