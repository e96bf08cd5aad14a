"""Recipe (issue 20, step 3): models tuned per layer by ``approx.autotune`` against every uniform method.

For each task, a fine-tuned checkpoint (cached under ``runs/checkpoints/``; made when absent):

* GLUE: the clustered table's checkpoints (``recipes/clustered_table.py``, the same ``--profile``), evaluated on
  the clustered table's data; their uniform rows (every method of the table, one setting on every layer) are read
  from ``--uniform-dir``'s ``clustered_table_<task>.json``, which were measured on the same checkpoints, examples
  and batches (the reference metric is checked equal; a mismatch stops the recipe), or, with ``--uniform here``,
  evaluated in this run beside the tuned models (a checkpoint fine-tuned again on another machine can differ);
* SQuAD: the MonarchAttention protocol's reader (``recipes/monarch_protocol.py``: the clustered table's SQuAD
  fine-tuning on every question of dev half 0; the cpu profile's own SQuAD checkpoints, trained on 480 questions,
  score F1 10 and cannot show a 1 % loss), reading the first 400 questions of dev half 1; the uniform rows are
  evaluated here, side by side with the tuned models.
* squad-doc (issue 20's long-input target): the long reader of ``recipes/long_inputs.py --reader squad-doc``
  (that SQuAD reader fine-tuned again on squad-doc windows of dev half 0 at 4096 tokens; trained on a CUDA device,
  then read from the cache) at :data:`DOC` ``["length"]`` tokens, reading the first questions of dev half 1 (100
  on the cpu profile); the candidates are the long-input methods that save time at that length
  (:data:`DOC_CANDIDATES`), tuned with approx's full cost model only, and the uniform rows are evaluated in the
  same run, so that the target, *at least 99 % of exact F1 at a lower whole-model time than the best uniform method
  reaching 99 %*, compares seconds per example measured side by side (:func:`doc_target`).

Calibration uses each checkpoint's own training data only (the train split, or the dev half it was trained on):
the first :data:`CALIBRATION` examples, labels unused, shuffled and halved by ``approx.autotune`` into the inputs
measured per layer and the held-out inputs its choice is verified on. One :class:`approx.harness.autotune.Search`
per checkpoint measures every candidate (:data:`CANDIDATES`: the clustered table's methods plus
i-clustered with 50 clusters) on every layer, with the KL divergence of the head's outputs (STS-B's regression head:
the cosine of the last hidden states, :data:`MEASURE`); then for targets at
each of :data:`FRACTIONS` (SQuAD: :data:`TASK_FRACTIONS`) of the cheapest assignment's loss and both cost conventions
(``flops``: approx's full cost model; ``matmul``: the literature's attention matmul count) a model is chosen (the
search path's point, or a uniform setting meeting the target for less: ``approx.autotune``'s step 4; the tables mark
such rows, and :func:`dominance` also counts without them), saved (``runs/autotune/``, identical choices once) and
evaluated with ``approx.evaluate`` on data no calibration saw. Cross-fitted tasks (SST-2, QNLI) tune each half's checkpoint on its own training half and merge
the halves' predictions as the clustered table does.

    python recipes/autotune_pareto.py --threads 2                 # every task (CPU: about 40 minutes)
    python recipes/autotune_pareto.py --tasks squad rte           # some tasks (the others kept from the JSON)
    python recipes/autotune_pareto.py --tasks squad --clustering default --output OTHER.json --figure OTHER.png
                                                                  # SQuAD with today's clustering (refine=1)
    python recipes/autotune_pareto.py --tasks squad --question-global --output OTHER.json --figure OTHER.png
                                                                  # SQuAD with the question-global windows too
    python recipes/autotune_pareto.py --tasks squad --score --output OTHER.json --figure OTHER.png
                                                                  # SQuAD tuned to keep a share of its F1 (score
                                                                  # targets, scored on labelled training questions)
    python recipes/autotune_pareto.py --tasks squad --head-counts 3 6 9 --output OTHER.json --figure OTHER.png
                                                                  # each candidate also on 3, 6 and 9 of a layer's
                                                                  # heads (the others exact)
    python recipes/autotune_pareto.py --tasks squad-doc --threads 2 --output recipes/results/autotune_pareto_squad_doc.json
        --figure recipes/results/figures/autotune_pareto_squad_doc.png --tuned-dir runs/autotune_doc
                                                                  # the long reader at 4096 tokens, in its own files
                                                                  # (CPU: about an hour; needs its cached reader)
    python recipes/autotune_pareto.py --report                    # tables and figure from the committed JSON

Writes ``recipes/results/autotune_pareto.json`` and ``recipes/results/figures/autotune_pareto.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

import approx
from approx.harness.argcheck import at_least, run_script
from approx.harness.autotune import Search, task_batches
from approx.harness.crossfit import merge_halves
from approx.harness.provenance import provenance
from approx.harness.scoring import task_scorer
from approx.harness.spec import PER_LAYER, short_label
from approx.harness.tasks import get_task
from approx.integration import checkpoint_heads, load_pretrained

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shared import CHECKPOINTS, CROSS_FIT, RESULTS, ROOT, ensure_checkpoint, figure_beside, read_results, write_json  # noqa: E402
from clustered_table import METHODS, TASKS, base_settings, default_model  # noqa: E402
from long_inputs import FOLDS, MIN_EXACT_F1, squad_checkpoints  # noqa: E402
from long_inputs import methods as long_methods  # noqa: E402
from paper_table import PRIMARY_METRIC  # noqa: E402

OUTPUT = RESULTS / "autotune_pareto.json"
FIGURE = RESULTS / "figures" / "autotune_pareto.png"
TUNED = ROOT / "runs" / "autotune"
# the paper's clustering (refine=0), as the clustered table's uniform rows were measured
CANDIDATES = [*METHODS, approx.get_method("i-clustered").make_config(clusters=50, topk=32, refine=0)]
# --clustering: "paper" (CANDIDATES) or "default" (clustered and improved clustered at today's defaults: one Euclidean
# step, issue #20 step 0); only SQuAD, whose uniform rows are evaluated in the same run, can take "default"
CLUSTERING = ("paper", "default")
# --question-global (squad only): Longformer's QA setting among the candidates, the window with the question's tokens
# global (the MonarchAttention protocol's 63.0 and 64.7 F1 at w = 32 and 64 with the outer thirds replaced)
QUESTION_WINDOWS = [approx.get_method("window").make_config(window=w, question_global=True) for w in (32, 64)]


def candidates(clustering: str = "paper", task: str | None = None, question_global: bool = False) -> list:
    """:data:`CANDIDATES` (squad-doc: :data:`DOC_CANDIDATES`), with the clustering methods at today's default
    ``refine`` for ``"default"``, and :data:`QUESTION_WINDOWS` after them with ``question_global``."""
    given = DOC_CANDIDATES if task == "squad-doc" else CANDIDATES
    if clustering != "paper":
        given = [dataclasses.replace(c, refine=type(c)().refine) if hasattr(c, "refine") else c for c in given]
    return [*given, *(QUESTION_WINDOWS if question_global else [])]


def conventions(task: str) -> dict[str, str]:
    """The cost conventions ``task`` is tuned for (convention -> the result's cost field)."""
    return {c: CONVENTIONS[c] for c in TASK_CONVENTIONS.get(task, CONVENTIONS)}


def fractions(task: str, score: bool = False) -> tuple[float, ...]:
    """The target fractions: of the cheapest assignment's loss, or with ``score`` of the unpatched model's score."""
    return SCORE_FRACTIONS if score else TASK_FRACTIONS.get(task, FRACTIONS)


# Targets as fractions of the KL divergence of the cheapest assignment (every layer at its cheapest candidate),
# measured per checkpoint: a weakly trained classifier's outputs barely move (RTE's checkpoint: KL 3e-5 with every
# layer approximated) while SQuAD's start and end distributions move a lot, so fixed KL values would waste most
# targets on either. Eight halvings span 1/2 to 1/256 of the cheapest point's divergence; the two ends of the
# search path are tuned points too: 1 (the cheapest assignment itself) and 0 (exact attention on every layer, the
# only assignment without loss).
FRACTIONS = (1.0, *(0.5**k for k in range(1, 9)), 0.0)
# STS-B's head is a regression (one score, no distribution): its targets are cosines of the last hidden states
MEASURE = {"stsb": "cosine"}
CONVENTIONS = {"flops": "flops_vs_full", "matmul": "matmul_vs_softmax_model"}  # tuning cost -> result's cost field
METRIC = {**PRIMARY_METRIC, "squad-doc": "f1"}
CALIBRATION = 64  # examples of the training data per checkpoint (halved: measured / held out)
# examples of the training data whose lengths the costs are taken at (the model does not run on them): 32 held-out
# inputs are a small sample of lengths, and costs that fall or rise steeply with the length (MonarchAttention's blocks
# on CoLA's short sentences, a window as wide as most inputs) then ranked the candidates otherwise than the evaluation
COST_EXAMPLES = 1024
EVAL_BATCH = 32  # inputs per evaluation batch (squad-doc: 1)
SQUAD = {"reader": {"cpu": {"limit": None}, "gpu": {}}, "questions": {"cpu": 400, "gpu": None}}
TASK_ORDER = ("squad", "squad-doc", "rte", "mrpc", "stsb", "cola", "sst2", "qnli")
# squad-doc at a long length: one input is 4096 tokens, so fewer calibration examples (each candidate on each layer
# is a whole forward pass over them) and questions; batches of 2 for the calibration, 1 for the timed evaluation
DOC = {"length": 4096, "calibration": 16, "calibration_batch": 2, "questions": {"cpu": 100, "gpu": 400},
       "floor": 0.99}  # fmt: skip
# the long-input methods that run faster than exact attention at 4096 tokens on the CPU (long_inputs_doc_reader.json:
# 1.9-2.9x) and keep some of the long reader's F1; the window with the question global, as long_inputs.py reads it
DOC_CANDIDATES = [
    c for c in long_methods("squad-doc", ["window", "bigbird", "monarch", "linear", "linformer"])
    if not (c.method == "linformer" and c.projections != 64)
]  # fmt: skip
# --score (squad only): targets that keep these fractions of the unpatched reader's F1, verified by a scorer on
# SCORE_EXAMPLES labelled questions of its training half past the calibration's (never the evaluation's data); the
# search path is still the KL one. Below 0.8 they reach down to the cheap uniform settings (the kernels and
# MonarchAttention keep 14-20 % of the reader's F1, the 32-token window and clustering with 25 clusters about 32 %),
# which the autotuner's uniform step scores beside the path's points
SCORE_FRACTIONS = (0.99, 0.98, 0.97, 0.95, 0.9, 0.8, 0.6, 0.4, 0.3, 0.25, 0.2, 0.15)
SCORE_EXAMPLES = 400
# per task: the cost conventions tuned for (default both) and the target fractions (default FRACTIONS)
TASK_CONVENTIONS = {"squad-doc": ("flops",)}
# SQuAD: four more between the cheapest point and its half (the reader's F1 climbs from 10 to 35 there, where cheap
# uniform settings score 11-14) and three more halvings (the path's 1/256 point costs 0.46 of softmax's matmuls,
# improved clustering with 100 clusters 0.70)
TASK_FRACTIONS = {
    "squad-doc": (1.0, *(0.5**k for k in range(1, 6))),
    "squad": (1.0, 0.9, 0.8, 0.7, 0.6, *(0.5**k for k in range(1, 12)), 0.0),
}


def _checkpoints(task: str, args) -> list[tuple[Path, str, str]]:
    """(folder, training split, evaluation split) of the task's checkpoint(s), made when absent (squad-doc's long
    reader: read from the cache, or trained on a CUDA device, by ``long_inputs.squad_checkpoints``)."""
    if task == "squad-doc":
        pairs, _ = squad_checkpoints(args.profile, not args.quiet, args.data_dir, reader="squad-doc")
        return [
            (Path(folder), train, split) for (folder, split), (train, _) in zip(pairs, FOLDS[args.profile], strict=True)
        ]
    settings = base_settings(task, args.profile, max_steps=args.max_steps, limit=args.train_limit)
    if task == "squad":
        settings.update(SQUAD["reader"][args.profile])
        if args.train_limit is not None:  # smoke runs
            settings["limit"] = args.train_limit
        plan = CROSS_FIT[:1] if args.profile == "cpu" else CROSS_FIT
    else:
        plan = CROSS_FIT if TASKS[task]["cross_fit"] else (("train", "dev"),)
    data = {"data_dir": args.data_dir, "source": args.source, "progress": not args.quiet}
    out = []
    for train_split, eval_split in plan:
        folder, _, _ = ensure_checkpoint(
            args.model or default_model(), task, train_split, settings, root=args.checkpoints, **data
        )
        out.append((folder, train_split, eval_split))
    return out


def _limit(task: str, args, halves: int) -> int | None:
    if args.limit is not None:
        return args.limit
    if task in ("squad", "squad-doc"):
        questions = (SQUAD if task == "squad" else DOC)["questions"][args.profile]
        return None if questions is None else questions // halves
    return TASKS[task].get("eval_limit") if args.profile == "cpu" else None


def tune_checkpoint(
    task: str, folder: Path, train_split: str, args, methods: list
) -> tuple[list[Path], dict[str, Any]]:
    """Measure once on the checkpoint's training data, then choose and save a model per target and convention
    (identical choices saved once: the returned folders repeat)."""
    import warnings

    head = checkpoint_heads(str(folder))[0]
    model, tokenizer = load_pretrained(str(folder), task=head, progress=False)
    long = task == "squad-doc"
    calibration = _calibration(task, args)
    batch = DOC["calibration_batch"] if long else 8
    batches = task_batches(model.eval(), tokenizer, task, split=train_split, limit=calibration, batch_size=batch,
                           max_length=args.doc_length if long else None, seed=args.seed, data_dir=args.data_dir,
                           source=args.source)  # fmt: skip
    measure = MEASURE.get(task, "kl")
    # the costs at the lengths of more of the same training data (batching does not change a cost; squad-doc: every
    # input is as long as the calibration's already)
    cost_examples = None if long else _cost_examples(args)
    cost_data = None
    if cost_examples:
        cost_data = task_batches(model, tokenizer, task, split=train_split, limit=cost_examples,
                                 batch_size=EVAL_BATCH, seed=args.seed, data_dir=args.data_dir, source=args.source)  # fmt: skip
    search = Search(
        model,
        batches,
        measure=measure,
        methods=methods,
        cost_data=cost_data,
        head_counts=getattr(args, "head_counts", None) or (),
        batch_size=batch,
        seed=args.seed,
        progress=not args.quiet,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cheapest point misses a zero budget's target by construction
        cheapest = search.choose(None, budget=1e-12, uniform=False, progress=False).fidelity  # the path's end
    score = getattr(args, "score", False)
    scorer = None
    if score:  # labelled questions of the training half past the calibration's
        scorer = task_scorer(model, tokenizer, task, split=train_split, skip=calibration, limit=SCORE_EXAMPLES,
                             batch_size=EVAL_BATCH, data_dir=args.data_dir, source=args.source,
                             progress=not args.quiet)  # fmt: skip
    folders, tunings, saved = [], [], {}
    for convention in conventions(task):
        for fraction in fractions(task, score):
            target = f"score>={fraction}" if score else _target(measure, cheapest, fraction)
            tuning = search.choose(target, cost=convention, score=scorer, progress=False)
            key = tuple(tuning.choices)
            if key not in saved:
                saved[key] = args.tuned_dir / task / folder.name / f"{convention}-{len(saved)}"
                approx.save(model, saved[key], tokenizer=tokenizer)
            folders.append(saved[key])
            record = tuning.to_dict()
            record.pop("table")
            tunings.append({"folder": _relative(saved[key]), "fraction": fraction, **record})
            print(f"{task} {folder.name} {convention} {target}: {tuning.choices} cost {tuning.cost:.3f} "
                  f"fidelity {tuning.fidelity:.4g}", flush=True)  # fmt: skip
    return folders, {
        "checkpoint": _relative(folder),
        "calibration_split": train_split,
        "calibration_examples": calibration,
        "cost_examples": cost_examples,
        "cost_inputs": search.cost_inputs,
        **({"max_length": args.doc_length} if long else {}),
        "measure": measure,
        "head_counts": list(search.head_counts),
        "cheapest_fidelity": cheapest,
        **({"scorer": scorer.describe(), "reference_score": tunings[0]["score"]["reference"]} if score else {}),
        "measure_seconds": search.seconds,
        "table": search.table,
        "tunings": tunings,
    }


def _cost_examples(args) -> int | None:
    """Training examples whose lengths the costs are taken at: ``--cost-examples`` (0: the held-out calibration
    inputs, as before it existed), else :data:`COST_EXAMPLES`."""
    n = COST_EXAMPLES if getattr(args, "cost_examples", None) is None else args.cost_examples
    return n or None


def _calibration(task: str, args) -> int:
    """Calibration examples per checkpoint: ``--calibration``, else the task's default."""
    if args.calibration is not None:
        return args.calibration
    return DOC["calibration"] if task == "squad-doc" else CALIBRATION


def _target(measure: str, cheapest: float, fraction: float) -> str:
    """The target at ``fraction`` of the cheapest assignment's loss (KL, or 1 - cosine), to 3 significant digits
    (the cheapest point's own value as measured: rounding must not put it out of its own reach)."""
    if fraction == 1.0:
        return f"{'kl<=' if measure == 'kl' else 'cosine>='}{cheapest!r}"
    if measure == "kl":
        return f"kl<={float(f'{cheapest * fraction:.3g}')}"
    return f"cosine>={1 - float(f'{(1 - cheapest) * fraction:.3g}')}"


def _fraction_text(fraction: float) -> str:
    """1/2, 1/256 for a halving; 0.9 for another fraction; 0 and 1."""
    if 0 < fraction < 1:
        whole = round(1 / fraction)
        return f"1/{whole}" if abs(1 / fraction - whole) < 1e-9 else f"{fraction:g}"
    return str(int(fraction))


def _labels(task: str, score: bool = False) -> list[tuple[str, float]]:
    return [(c, f) for c in conventions(task) for f in fractions(task, score)]


def _relabel(results: list[dict[str, Any]], task: str, score: bool = False) -> None:
    """One name per target fraction and convention, the same in both halves (their layers differ: kept per half)."""
    for r, (convention, fraction) in zip(results, _labels(task, score), strict=False):
        r["tuned_layers"] = r["method"]["layers"]
        what = f"score>={fraction:g}" if score else f"{_fraction_text(fraction)} of the cheapest loss"
        r["method"] = {"name": PER_LAYER, "label": f"autotune {what}, {convention} cost"}


def _evaluate_once(folder: Path, task: str, folders: list[Path], extra: list, **options) -> list[dict[str, Any]]:
    """``approx.evaluate`` on each distinct folder once (and ``extra`` methods), the results repeated in order."""
    import copy

    unique = list(dict.fromkeys(folders))
    results = approx.evaluate(str(folder), task, [str(f) for f in unique] + extra, **options)
    by_folder = dict(zip(unique, results, strict=False))
    return [copy.deepcopy(by_folder[f]) for f in folders] + results[len(unique) :]


def refuse_variants(
    tasks: list[str],
    clustering: str,
    question_global: bool,
    output: Path | None = None,
    score: bool = False,
    head_counts: list[int] | None = None,
) -> None:
    """Exit, before anything runs, on a variant of the candidates or targets that a task cannot take, or that would
    overwrite the main run's results (``output`` is :data:`OUTPUT`)."""
    for task in tasks:
        if score and task != "squad":
            raise SystemExit(
                f"--score keeps a share of SQuAD's F1 on labelled questions of its training half; {task} is not "
                "supported by this recipe's score variant (approx.autotune's score targets take any task)"
            )
        if clustering != "paper" and task not in ("squad", "squad-doc"):
            raise SystemExit(
                f"--clustering {clustering}: {task}'s uniform rows come from the clustered table, measured with the "
                "paper's clustering; only squad and squad-doc (uniform rows evaluated in the same run) can take another"
            )
        if question_global and task != "squad":
            raise SystemExit(
                f"--question-global adds the question-global windows to squad's candidates; {task} takes none "
                "(squad-doc's candidates have windows of 64-256 with the question global; GLUE inputs have no question)"
            )
    variant = clustering != "paper" or question_global or score or bool(head_counts)
    if variant and output is not None and output.resolve() == OUTPUT.resolve():
        raise SystemExit(
            f"{_relative(OUTPUT)} holds the run with the default candidates; write this variant to its own --output "
            "(and --figure, --tuned-dir)"
        )


def run_task(task: str, args) -> dict[str, Any]:
    start = time.perf_counter()
    clustering = getattr(args, "clustering", "paper")
    question_global = getattr(args, "question_global", False)
    score = getattr(args, "score", False)
    side_by_side = (
        task in ("squad", "squad-doc") or getattr(args, "uniform", "table") == "here"
    )  # uniform rows evaluated in this run
    refuse_variants([task], clustering, question_global, score=score)
    methods = candidates(clustering, task, question_global)
    checkpoints = _checkpoints(task, args)
    limit = _limit(task, args, len(checkpoints))
    common = dict(
        batch_size=EVAL_BATCH, seed=args.seed, data_dir=args.data_dir, source=args.source, progress=not args.quiet
    )
    if task == "squad-doc":  # one 4096-token input at a time, as long_inputs.py times it
        common.update(batch_size=1, max_length=args.doc_length)
    halves, examples, calibrations = [], [], []
    for folder, train_split, eval_split in checkpoints:
        folders, calibration = tune_checkpoint(task, folder, train_split, args, methods)
        calibrations.append(calibration)
        results = _evaluate_once(folder, task, folders, methods if side_by_side else [], split=eval_split,
                                 limit=limit, predictions=len(checkpoints) > 1, **common)  # fmt: skip
        _relabel(results, task, score)
        halves.append(results)
        examples.append(get_task(task).load(eval_split, source=args.source, data_dir=args.data_dir, limit=limit)[0])
    results = halves[0] if len(halves) == 1 else merge_halves(halves, examples)
    tuned = results[: len(_labels(task, score))]
    for k, (r, (convention, fraction)) in enumerate(zip(tuned, _labels(task, score), strict=True)):
        targets = [c["tunings"][k]["target"] for c in calibrations]
        origins = [c["tunings"][k].get("origin", "path") for c in calibrations]  # per checkpoint (cross-fit: two)
        r.update(autotune={"fraction": fraction, "cost": convention, "targets": targets, "origins": origins})
    if side_by_side:
        uniform, source = results[len(tuned) :], "evaluated in this run, side by side with the tuned models"
    else:
        uniform, source = _uniform_rows(task, args, results[0])
    return {
        "task": task,
        "metric": METRIC[task],
        "evaluation": {
            "splits": [e for _, _, e in checkpoints],
            "limit_per_split": limit,
            **({"max_length": args.doc_length, "batch_size": 1} if task == "squad-doc" else {}),
        },
        "calibration": calibrations,
        "tuned": tuned,
        "uniform": uniform,
        "uniform_source": source,
        "clustering": clustering,
        "question_global": question_global,
        "score_targets": score,
        "candidates": [short_label({"name": c.method, **c.to_dict()}) for c in methods],
        "target_fractions": list(fractions(task, score)),
        "seconds": time.perf_counter() - start,
    }


def _uniform_rows(task: str, args, one: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    path = args.uniform_dir / f"clustered_table_{task}.json"
    record = json.loads(path.read_text())
    metric = PRIMARY_METRIC[task]
    theirs, ours = record["results"][0]["reference_metrics"][metric], one["reference_metrics"][metric]
    if abs(theirs - ours) > 1e-9 or record["results"][0]["examples"] != one["examples"]:
        raise SystemExit(
            f"{path}: full attention scores {theirs} on {record['results'][0]['examples']} examples there and "
            f"{ours} on {one['examples']} here: not the same checkpoint or data (a checkpoint fine-tuned again on "
            "another machine can differ in its last bits); re-run recipes/clustered_table.py, or evaluate the "
            "uniform settings in this run with --uniform here"
        )
    return record[
        "results"
    ], f"{_relative(path)} (same checkpoints, examples and batches; full attention's {metric} equal)"


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# ---------------------------------------------------------------------------------------------------- analysis


def _point(r: dict[str, Any], metric: str, field: str) -> tuple[float, float]:
    return r["fidelity"]["cost"][field], r["metrics"][metric]


def _fill_origins(task_record: dict[str, Any]) -> None:
    """Give each tuned row ``autotune.origins`` (per checkpoint, "path" or "uniform") from the calibration's tunings
    where it lacks them (records written before the rows carried them; before approx.autotune's step 4: "path")."""
    for k, r in enumerate(task_record["tuned"]):
        tunings = [c["tunings"][k] for c in task_record.get("calibration", []) if k < len(c.get("tunings", []))]
        r["autotune"].setdefault("origins", [x.get("origin", "path") for x in tunings] or ["path"])


def _from_path(r: dict[str, Any]) -> bool:
    """Whether a tuned row is a point of the search path in every checkpoint (not a uniform setting that
    ``approx.autotune``'s step 4 took instead; records from before that step: always)."""
    return all(o == "path" for o in r["autotune"].get("origins", ["path"]))


def _origin_text(r: dict[str, Any]) -> str:
    """For the table: whether a tuned row is a uniform setting that ``approx.autotune`` took instead of the path's
    point, in every checkpoint or in some."""
    origins = r["autotune"].get("origins", ["path"])
    some = sum(o == "uniform" for o in origins)
    if not some:
        return ""
    return (
        " (a uniform setting)" if some == len(origins) else f" (a uniform setting on {some} of {len(origins)} halves)"
    )


def dominance(task_record: dict[str, Any]) -> dict[str, Any]:
    """Per convention: which uniform settings some tuned model of that convention's search dominates (cost no
    higher, metric no lower), and for each the best metric of those tuned models that cost no more
    (``best_tuned_at_cost``; None when none does). ``dominated_by_any_search``: the same count with every tuned model
    of the task, the other convention's search's too, placed at this convention's cost (each is a tuned model with a
    cost in both conventions; the strict count above is the one the recipe judges by). ``dominated_by_path_points``:
    the strict count with the convention's tuned models that are points of the search path only: a tuned model that
    is a uniform setting (``approx.autotune`` takes one that meets the target for less) dominates that setting by
    being it, and this count leaves such models out."""
    _fill_origins(task_record)
    metric, out = task_record["metric"], {}
    for convention, field in conventions(task_record["task"]).items():
        mine = [r for r in task_record["tuned"] if r["autotune"]["cost"] == convention]
        own = [_point(r, metric, field) for r in mine]
        path = [_point(r, metric, field) for r in mine if _from_path(r)]
        every = [_point(r, metric, field) for r in task_record["tuned"]]
        rows = []
        for u in task_record["uniform"]:
            cost, value = _point(u, metric, field)
            cheaper = [m for c, m in own if c <= cost + 1e-12]
            rows.append({"setting": short_label(u["method"]), "cost": cost, "metric": value,
                         "dominated": any(m >= value - 1e-9 for m in cheaper),
                         "dominated_by_any_search": any(c <= cost + 1e-12 and m >= value - 1e-9 for c, m in every),
                         "dominated_by_path_points": any(c <= cost + 1e-12 and m >= value - 1e-9 for c, m in path),
                         "best_tuned_at_cost": max(cheaper, default=None)})  # fmt: skip
        out[convention] = {
            "dominated": sum(r["dominated"] for r in rows),
            "dominated_by_any_search": sum(r["dominated_by_any_search"] for r in rows),
            "dominated_by_path_points": sum(r["dominated_by_path_points"] for r in rows),
            "uniform_tuned": sum(not _from_path(r) for r in mine),
            "uniform": len(rows),
            "not_dominated": [r for r in rows if not r["dominated"]],
        }
    return out


def _best_below(row: dict[str, Any]) -> str:
    """How near the tuned models come to an undominated uniform setting, for the report."""
    best = row["best_tuned_at_cost"]
    if best is None:
        return "no tuned model of this search costs as little"
    gap = row["metric"] - best
    return f"this search's best tuned model at no more cost: {best:.2f}, " + (
        f"{gap:.2f} below" if gap >= 0.005 else f"{gap:.4f} below")  # fmt: skip


def _same(method: dict[str, Any], config) -> bool:
    """Whether a result's ``"method"`` record is ``config`` (a record from before an option means what it did then)."""
    spec = approx.get_method(method["name"])
    return (
        spec.name == config.method
        and spec.config_class.from_record({k: v for k, v in method.items() if k != "name"}) == config
    )


def squad_targets(task_record: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's two SQuAD targets, judged on this run's numbers (the first needs i-clustered-25's row)."""
    full = task_record["tuned"][0]["reference_metrics"]["f1"]
    floor = 0.99 * full
    icl25_config = candidates(task_record.get("clustering", "paper"))[1]  # i-clustered-25 of the run's clustering
    icl25 = next((u for u in task_record["uniform"] if _same(u["method"], icl25_config)), None)
    icl_cost = None if icl25 is None else icl25["fidelity"]["cost"]["flops_vs_full"]
    below = "i-clustered-25's (not measured)" if icl_cost is None else f"i-clustered-25's ({icl_cost:.3f})"
    checks = []
    for convention, field, limit, what in (
        ("flops", "flops_vs_full", icl_cost, f"approx's full cost model below {below}"),
        ("matmul", "matmul_vs_softmax_model", 0.5, "at most 0.5 of full attention's matmul MACs"),
    ):
        fits = [r for r in task_record["tuned"] if r["autotune"]["cost"] == convention and r["metrics"]["f1"] >= floor]
        best = min(fits, key=lambda r: r["fidelity"]["cost"][field], default=None)
        cost = None if best is None else best["fidelity"]["cost"][field]
        if cost is None or limit is None:
            met = False if limit is not None else None
        else:
            met = cost < limit if convention == "flops" else cost <= limit
        checks.append({
            "target": f"F1 within 1 % of full ({full:.2f}, so at least {floor:.2f}) at {what}",
            "cheapest_within_1pct": None if best is None else {
                "target": " / ".join(best["autotune"]["targets"]), "f1": best["metrics"]["f1"], "cost": cost,
                "exact": _all_exact(best),
            },
            "met": met,
        })  # fmt: skip
    return checks


def _all_exact(r: dict[str, Any]) -> bool:
    """Whether a tuned row is exact attention on every layer (of every half)."""
    layers = [r["tuned_layers"]] if "tuned_layers" in r else [h["tuned_layers"] for h in r.get("halves", [])]
    return bool(layers) and all(x["method"] == "full" for half in layers for x in half)


def doc_target(task_record: dict[str, Any]) -> dict[str, Any]:
    """Issue 20's squad-doc target, judged on this run's numbers: some tuned model keeps at least :data:`DOC`
    ``["floor"]`` (99 %) of exact attention's F1 at a lower whole-model time per example than the fastest uniform
    setting that keeps as much, both timed in this run. Not judged (``met`` None) when exact attention scores under
    long_inputs' ``MIN_EXACT_F1`` (a reader that answers too little for a 99 % share to mean anything); not met when
    no tuned model keeps 99 %; met when one does and no uniform setting does."""
    full = task_record["tuned"][0]["reference_metrics"]["f1"]
    floor = DOC["floor"] * full

    def fastest(rows):
        fits = [r for r in rows if r["metrics"]["f1"] >= floor]
        return min(fits, key=lambda r: r["fidelity"]["seconds_per_example"], default=None)

    def point(r, label):
        if r is None:
            return None
        f = r["fidelity"]
        return {"setting": label, "f1": r["metrics"]["f1"], "seconds_per_example": f["seconds_per_example"],
                "speedup": f.get("speedup")}  # fmt: skip

    tuned, uniform = fastest(task_record["tuned"]), fastest(task_record["uniform"])
    tuned_point = point(tuned, tuned and " / ".join(tuned["autotune"]["targets"]))
    uniform_point = point(uniform, uniform and short_label(uniform["method"]))
    if full < MIN_EXACT_F1:
        met = None
    elif tuned_point is None:
        met = False
    else:
        met = uniform_point is None or tuned_point["seconds_per_example"] < uniform_point["seconds_per_example"]
    return {
        "target": f"F1 at least {DOC['floor']:.0%} of exact attention's ({full:.2f}, so {floor:.2f}) at a lower "
        "whole-model time per example than the fastest uniform setting reaching it (same run)",
        "exact_seconds_per_example": task_record["tuned"][0]["fidelity"]["reference_seconds_per_example"],
        "fastest_tuned": tuned_point,
        "fastest_uniform": uniform_point,
        "met": met,
    }


def _counts(counts: list[int]) -> str:
    """``[3, 6, 9]`` -> ``"3, 6 and 9"``."""
    words = [str(k) for k in counts]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def markdown(record: dict[str, Any]) -> str:
    lines = []
    for task in [t for t in TASK_ORDER if t in record["tasks"]]:
        t = record["tasks"][task]
        _fill_origins(t)
        metric = t["metric"]
        full = t["tuned"][0]["reference_metrics"][metric]
        lines += [f"**{task}** ({metric}; full attention {full:.2f}; uniform rows: {t['uniform_source']})", ""]
        for c in t["calibration"]:
            first = c["tunings"][0]["calibration"]
            lines.append(
                f"Calibration of `{Path(c['checkpoint']).name}` on {c['calibration_split']}: {first['fit_inputs']} inputs "
                f"measured, {first['check_inputs']} held out"
                + (f"; costs at the lengths of {c['cost_inputs']} training inputs" if c.get("cost_examples") else "")
                + (
                    f"; each candidate also on {_counts(c['head_counts'])} heads a layer"
                    if c.get("head_counts")
                    else ""
                )
                + f"; every candidate on every layer measured in {c['measure_seconds']:.0f} s; the cheapest "
                f"assignment's {c.get('measure', 'kl')} "
                f"{c.get('cheapest_fidelity', c.get('cheapest_kl')):.4g}"
                + (
                    f"; score targets verified on {c['scorer']['count']} labelled examples of {c['scorer']['split']} "
                    f"(examples {c['scorer']['examples'].split(' (')[0]}), where the unpatched model's "
                    f"{c['scorer']['metric']} is {c['reference_score']:.2f}"
                    if c.get("scorer")
                    else ""
                )
                + "."
            )
        lines.append("")
        timed = task == "squad-doc"  # its target is a time: seconds per example in the tables
        extra = " s/example | speed-up |" if timed else ""
        lines += ["| target | cost convention | " + metric + " | flops vs full | matmul vs softmax |" + extra + " layers |",
                  "| --- | --- | ---: | ---: | ---: |" + (" ---: | ---: |" if timed else "") + " --- |"]  # fmt: skip
        for r in t["tuned"]:
            c = r["fidelity"]["cost"]
            layers = _layers_text(r) + _origin_text(r)
            lines.append(
                f"| {' / '.join(r['autotune']['targets'])} | {r['autotune']['cost']} | {r['metrics'][metric]:.2f} | "
                f"{c['flops_vs_full']:.3f} | {c['matmul_vs_softmax_model']:.3f} |{_time_cells(r) if timed else ''} "
                f"{layers} |"
            )
        if timed:
            lines += ["", "| uniform setting | " + metric + " | flops vs full | s/example | speed-up |",
                      "| --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
            for u in t["uniform"]:
                lines.append(
                    f"| {short_label(u['method'])} | {u['metrics'][metric]:.2f} | "
                    f"{u['fidelity']['cost']['flops_vs_full']:.3f} |{_time_cells(u)}"
                )
        d = dominance(t)  # from the rows (records written before ``best_tuned_at_cost`` get it too)
        for convention in d:
            missed = ", ".join(
                f"{x['setting']} ({x['metric']:.2f} at {x['cost']:.3f}; {_best_below(x)})"
                for x in d[convention]["not_dominated"]
            )
            pooled = d[convention]["dominated_by_any_search"]
            both = "" if len(d) < 2 or pooled == d[convention]["dominated"] else (
                f" ({pooled} with every tuned model of both searches at its {convention} cost)")  # fmt: skip
            if d[convention]["uniform_tuned"]:  # tuned models that are uniform settings (approx.autotune's step 4)
                both += (f"; tuned models that are uniform settings: {d[convention]['uniform_tuned']}, and without them "
                         f"the tuned models dominate {d[convention]['dominated_by_path_points']}")  # fmt: skip
            lines.append(
                f"\n{convention}: the tuned models dominate {d[convention]['dominated']} of {d[convention]['uniform']} "
                f"uniform settings{both}" + (f"; not: {missed}" if missed else "")
            )
        for check, convention in zip(t.get("targets", []), ("flops", "matmul"), strict=False):  # squad_targets' order
            best = check["cheapest_within_1pct"]
            got = "no tuned model within 1 %" if best is None else (
                f"cheapest within 1 %: {best['target']}, F1 {best['f1']:.2f} at {best['cost']:.3f}")  # fmt: skip
            verdict = {True: "met", False: "not met", None: "not judged"}[check["met"]]
            exact = best is not None and best.get("exact", any(  # records from before the field: from the rows
                _all_exact(r) for r in t["tuned"]
                if r["autotune"]["cost"] == convention and " / ".join(r["autotune"]["targets"]) == best["target"]
            ))  # fmt: skip
            if check["met"] and exact:  # no approximate assignment within 1 %: exact attention meets it
                verdict = "met only by exact attention on every layer"
            lines.append(f"\n- {check['target']}: **{verdict}** ({got})")
        if "doc_target" in t:
            check = t["doc_target"]
            verdict = {True: "met", False: "not met", None: "not judged"}[check["met"]]
            got = "; ".join(
                f"fastest {who}: " + ("none" if p is None else
                                      f"{p['setting']}, F1 {p['f1']:.2f} at {p['seconds_per_example']:.3f} s")
                for who, p in (("tuned", check["fastest_tuned"]), ("uniform", check["fastest_uniform"]))
            )  # fmt: skip
            lines.append(
                f"\n- {check['target']}: **{verdict}** ({got}; exact attention "
                f"{check['exact_seconds_per_example']:.3f} s)"
            )
        lines.append("")
    return "\n".join(lines)


def _time_cells(r: dict[str, Any]) -> str:
    f = r["fidelity"]
    return f" {f['seconds_per_example']:.3f} | {f['speedup']:.2f}x |"


def _layers_text(r: dict[str, Any]) -> str:
    if "tuned_layers" in r:
        return short_label({"name": PER_LAYER, "layers": r["tuned_layers"]})
    halves = [h.get("tuned_layers") for h in r.get("halves", [])]
    return " / ".join(short_label({"name": PER_LAYER, "layers": h}) for h in halves if h) or "-"


def figure(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    tasks = [t for t in TASK_ORDER if t in record["tasks"]]
    fig, axes = plt.subplots(len(tasks), 2, figsize=(10, 3.0 * len(tasks)), squeeze=False)
    for row, task in zip(axes, tasks, strict=True):
        t = record["tasks"][task]
        metric = t["metric"]
        # squad-doc is tuned with one convention and judged on time: its second panel is seconds per example
        panels = [(c, f, c) for c, f in conventions(task).items()]
        if len(panels) == 1:
            panels.append(("seconds", "seconds_per_example", panels[0][0]))
        for ax, (axis, field, convention) in zip(row, panels, strict=True):
            timed = axis == "seconds"

            def xy(r, field=field, timed=timed, metric=metric):
                return (r["fidelity"][field], r["metrics"][metric]) if timed else _point(r, metric, field)

            for u in t["uniform"]:
                x, y = xy(u)
                ax.plot([x], [y], "o", color="0.6", ms=4)
                ax.annotate(short_label(u["method"]).split(":")[0], (x, y), fontsize=5, color="0.4",
                            xytext=(2, 2), textcoords="offset points")  # fmt: skip
            mine = sorted(xy(r) for r in t["tuned"] if r["autotune"]["cost"] == convention)
            ax.plot([p[0] for p in mine], [p[1] for p in mine], "D-", color="C3", ms=4, label="autotune (targets)")
            full_x = t["tuned"][0]["fidelity"]["reference_seconds_per_example"] if timed else 1.0
            ax.plot([full_x], [t["tuned"][0]["reference_metrics"][metric]], "k*", ms=10, label="full attention")
            if timed:
                ax.set_title(f"{task}: tuned with the {convention} cost, timed", fontsize=8)
                ax.set_xlabel("whole-model seconds per example (this run)", fontsize=7)
            else:
                ax.set_xscale("log")
                ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
                ax.set_title(f"{task}: tuned with the {convention} cost", fontsize=8)
                ax.set_xlabel(f"attention cost vs full ({field})", fontsize=7)
            ax.set_ylabel(metric, fontsize=7)
            ax.tick_params(labelsize=6)
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=6, loc="lower right")
    fig.suptitle("Per-layer autotuned models (red) against every uniform setting (grey), zero-shot", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cost_examples_arg(text: str) -> int:
    """``--cost-examples``: 0 (the held-out calibration inputs) or at least 2 (lengths to take costs at)."""
    value = at_least(0)(text)
    if value == 1:
        raise argparse.ArgumentTypeError("0 (the held-out calibration inputs) or at least 2, got 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", choices=TASK_ORDER, default=[t for t in TASK_ORDER if t != "squad-doc"],
                   help="default: every task but squad-doc (it needs the cached long reader; name it)")  # fmt: skip
    p.add_argument("--doc-length", type=at_least(3), default=DOC["length"], help="squad-doc's tokens per input")
    p.add_argument("--profile", choices=["cpu", "gpu"], default="gpu" if torch.cuda.is_available() else "cpu")
    p.add_argument("--uniform-dir", type=Path, help="clustered_table_<task>.json (default: the profile's results)")
    p.add_argument("--uniform", choices=["table", "here"], default="table", help="GLUE's uniform rows: from the "
                   "clustered table's results (checked to be the same checkpoint), or evaluated in this run, side by "
                   "side with the tuned models (as squad's always are)")  # fmt: skip
    p.add_argument("--clustering", choices=CLUSTERING, default="paper", help="the clustering methods' refine: the "
                   "paper's (0, as the clustered table) or today's default; 'default' for squad and squad-doc only")  # fmt: skip
    p.add_argument("--question-global", action="store_true", help="squad only: the window with the question's "
                   "tokens global (w = 32, 64) among the candidates, Longformer's setting for QA")  # fmt: skip
    p.add_argument("--score", action="store_true", help="squad only: targets that keep a share of the reader's F1 "
                   f"({', '.join(map(str, SCORE_FRACTIONS))}), scored on {SCORE_EXAMPLES} labelled questions of its "
                   "training half, instead of KL targets")  # fmt: skip
    p.add_argument("--head-counts", type=at_least(1), nargs="+", metavar="K", help="also try each candidate on only K heads "
                   "of each layer (approx.autotune's head_counts), for each K given")  # fmt: skip
    p.add_argument("--seed", type=at_least(0), default=0)
    p.add_argument("--threads", type=at_least(1), help="torch CPU threads")
    p.add_argument("--data-dir", help="default: $APPROX_DATA_DIR, then ../shared/data")
    p.add_argument("--source", choices=["auto", "local", "hub"])
    p.add_argument("--model", help="base model of the checkpoints (default: MiniLM-L6; squad-doc: long_inputs.py's)")
    p.add_argument("--checkpoints", type=Path, default=CHECKPOINTS,
                   help="the checkpoint cache (squad-doc reads long_inputs.py's, runs/checkpoints)")  # fmt: skip
    p.add_argument("--tuned-dir", type=Path, default=TUNED, help="where the tuned models are saved")
    p.add_argument("--calibration", type=at_least(2), help=f"calibration examples per checkpoint (default {CALIBRATION}; "
                   f"squad-doc {DOC['calibration']})")  # fmt: skip
    p.add_argument("--cost-examples", type=_cost_examples_arg, help=f"training examples whose lengths the costs are taken at "
                   f"(default {COST_EXAMPLES}; 0: the held-out calibration inputs')")  # fmt: skip
    p.add_argument("--limit", type=at_least(1), help="smoke runs: evaluate the first N examples of each split")
    p.add_argument("--max-steps", type=at_least(1), help="smoke runs: cap the checkpoints' fine-tuning steps")
    p.add_argument("--train-limit", type=at_least(1), help="smoke runs: first N training examples")
    p.add_argument("--output", type=Path, default=OUTPUT)
    p.add_argument(
        "--figure", type=Path, default=FIGURE,
        help=f"default: {FIGURE.name}; beside --output (as .png) when that is not the default",
    )  # fmt: skip
    p.add_argument("--report", action="store_true", help="only print the tables and redraw the figure")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.figure = figure_beside(parser, args.figure, args.output)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.uniform_dir = args.uniform_dir or (RESULTS / "cpu" if args.profile == "cpu" else RESULTS)
    record = read_results(args.output) if args.report or args.output.is_file() else {"tasks": {}}
    if not args.report:
        refuse_variants(args.tasks, args.clustering, args.question_global, args.output, args.score, args.head_counts)
        for task in args.tasks:
            for kept in record["tasks"].values():  # tasks of an earlier run keep that run's provenance
                kept.setdefault("provenance", record.get("provenance"))
            made = provenance(seed=args.seed)  # as the task starts; a commit made since the run began is flagged
            t = run_task(task, args)
            t["provenance"] = made
            t["dominance"] = dominance(t)
            if task == "squad":
                t["targets"] = squad_targets(t)
            if task == "squad-doc":
                t["doc_target"] = doc_target(t)
            record["tasks"][task] = t
            for stale in ("candidates", "target_fractions"):  # once for every task; now in each task's record
                record.pop(stale, None)
            record.update(
                recipe="recipes/autotune_pareto.py",
                profile=args.profile,
                provenance=made,
            )
            write_json(args.output, record)  # after every task: an interrupted run keeps what it measured
            print(markdown({"tasks": {task: t}}), flush=True)
    figure(record, args.figure)
    print(markdown(record))
    print(f"wrote {args.figure}" + ("" if args.report else f" and {args.output}"))
    return 0


if __name__ == "__main__":
    run_script(main)
