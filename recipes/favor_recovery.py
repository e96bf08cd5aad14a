"""Recipe: the Performer claim on a fine-tuned model: FAVOR+ zero-shot drops, a short fine-tuning recovers.

Choromanski et al. (2021) swap softmax attention for FAVOR+ in a pretrained model and fine-tune briefly after the
swap. Here: the SST-2 checkpoint of ``recipes/clustered_table.py`` fine-tuned on dev half 0 (cross-fitting; taken
from the cache, or fine-tuned now with the same settings) is evaluated on dev half 1 under full attention and
FAVOR+ (zero-shot). The FAVOR+-patched model is then fine-tuned on half 0 with ``approx.harness.finetune(...,
method=FavorConfig(...))`` (accelerate; random features fixed, not redrawn) and evaluated on half 1 every
``--eval-every`` steps. Reported: the zero-shot drop, the accuracy curve, and the first step at which the
FAVOR+ model is within 1 point (accuracy) of the full-attention checkpoint it started from.

    python recipes/favor_recovery.py                       # SST-2, 60 steps (CPU time: see the README)
    python recipes/favor_recovery.py --steps 300 --eval-every 20

Writes ``recipes/results/favor_recovery_<task>.json``. The evaluation half is never trained on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

import approx
from approx.attention.favor import FavorConfig
from approx.harness.finetune import FinetuneConfig, finetune
from approx.harness.provenance import provenance
from approx.integration import attach

sys.path.insert(0, str(Path(__file__).resolve().parent))
import clustered_table  # noqa: E402
from _shared import RESULTS, Timer, checkpoint_summary, ensure_checkpoint, write_json  # noqa: E402

METHOD = FavorConfig(features=256)
TRAIN_SPLIT, EVAL_SPLIT = "dev/0", "dev/1"
PRIMARY = {"sst2": "accuracy", "qnli": "accuracy", "stsb": "pearson", "rte": "accuracy", "mrpc": "accuracy"}


def _evaluate(model, tokenizer, task: str, limit: int | None, options: dict[str, Any]) -> dict[str, Any]:
    """The patched model's own metric on the evaluation half (its layers evaluated as the method)."""
    layers = approx.patched_layers(model)
    approx.unpatch(model)
    rng = torch.get_rng_state()  # evaluation must not change the training run's random stream
    try:
        (result,) = approx.evaluate(
            model, task, [layers], tokenizer=tokenizer, split=EVAL_SPLIT, limit=limit, progress=False, **options
        )
    finally:
        torch.set_rng_state(rng)
        attach(model, layers)
        model.train()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="sst2", choices=sorted(PRIMARY))
    p.add_argument("--model", help="base model (default: MiniLM-L6)")
    p.add_argument("--steps", type=int, default=60, help="fine-tuning steps of the FAVOR+ model")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--learning-rate", type=float, help="default: FinetuneConfig's")
    p.add_argument("--batch-size", type=int, help="default: FinetuneConfig's")
    p.add_argument("--limit", type=int, help="first N examples of each half (smoke runs)")
    p.add_argument("--base-steps", type=int, help="cap the steps of the base checkpoint's fine-tuning (smoke)")
    p.add_argument("--data-dir")
    p.add_argument("--source", choices=["auto", "local", "hub"])
    p.add_argument("--checkpoints", type=Path, default=clustered_table.CHECKPOINTS)
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--work-dir", type=Path, help="where the FAVOR+ fine-tuning writes (default: under --checkpoints)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    defaults = FinetuneConfig()  # the fine-tuning defaults live in the config dataclass
    args.learning_rate = defaults.learning_rate if args.learning_rate is None else args.learning_rate
    args.batch_size = defaults.batch_size if args.batch_size is None else args.batch_size
    task, metric = args.task, PRIMARY[args.task]
    data = dict(data_dir=args.data_dir, source=args.source)
    base = args.model or clustered_table.default_model()

    # 1. the full-attention checkpoint (shared with the clustered table), and the zero-shot swap
    settings = clustered_table.base_settings(task, max_steps=args.base_steps, limit=args.limit)
    with Timer() as t_base:
        folder, record, reused = ensure_checkpoint(
            base, task, TRAIN_SPLIT, settings, root=args.checkpoints, progress=not args.quiet, **data
        )
    with Timer() as t_zero:
        (zero,) = approx.evaluate(
            str(folder),
            task,
            [METHOD],
            split=EVAL_SPLIT,
            limit=args.limit,
            batch_size=args.batch_size,
            seed=args.seed,
            progress=False,
            **data,
        )
    full, zero_shot = zero["reference_metrics"][metric], zero["metrics"][metric]
    print(f"{task} {EVAL_SPLIT}: full {full:.2f}, FAVOR+ zero-shot {zero_shot:.2f} ({zero_shot - full:+.2f})")

    # 2. fine-tune the FAVOR+-patched checkpoint, evaluating every --eval-every steps
    curve = [{"step": 0, metric: zero_shot}]
    tokenizer = approx.integration.load_pretrained(str(folder), task=None, progress=False)[1]
    options = dict(batch_size=args.batch_size, seed=args.seed, **data)

    def every(step: int, model) -> None:
        if step % args.eval_every == 0 or step == args.steps:
            value = _evaluate(model, tokenizer, task, args.limit, options)["metrics"][metric]
            curve.append({"step": step, metric: value})
            if not args.quiet:
                print(f"  step {step}: {metric} {value:.2f}", flush=True)

    work = args.work_dir or args.checkpoints / f"{folder.name}-favor-recovery"
    with Timer() as t_ft:
        rec = finetune(
            str(folder),
            task,
            output_dir=work,
            method=METHOD,
            train_split=TRAIN_SPLIT,
            max_steps=args.steps,
            learning_rate=args.learning_rate,
            batch_size=args.batch_size,
            limit=args.limit,
            seed=args.seed,
            progress=not args.quiet,
            callback=every,
            **data,
        )
    within = next((c["step"] for c in curve if c[metric] >= full - 1.0), None)
    result = {
        "recipe": "recipes/favor_recovery.py",
        "task": task,
        "metric": metric,
        "protocol": (
            f"checkpoint fine-tuned with full attention on {task} {TRAIN_SPLIT} (cross-fitting half), evaluated on "
            f"{EVAL_SPLIT}; FAVOR+ swapped in zero-shot, then the patched model fine-tuned on {TRAIN_SPLIT} "
            f"({args.steps} steps, AdamW lr {args.learning_rate}, linear warm-up 10 % and decay, features fixed) "
            f"and evaluated on {EVAL_SPLIT} every {args.eval_every} steps"
            + (f"; first {args.limit} examples of each half" if args.limit else "")
        ),
        "method": {"name": METHOD.method, **METHOD.to_dict()},
        "base_checkpoint": checkpoint_summary(folder, record, reused),
        "full": full,
        "zero_shot": zero_shot,
        "zero_shot_drop": full - zero_shot,
        "curve": curve,
        "final": curve[-1][metric],
        "steps_to_within_1_point": within,
        "examples": zero["examples"],
        "losses": rec["losses"],
        "zero_shot_result": zero,
        "wall_seconds": {
            "base_finetune": record.get("provenance", {}).get("wall_seconds"),
            "base_this_run": t_base.seconds,
            "zero_shot_evaluation": t_zero.seconds,
            "favor_finetune_with_evaluations": t_ft.seconds,
        },
        "provenance": provenance(seed=args.seed),
    }
    out = args.results_dir / f"favor_recovery_{task}.json"
    write_json(out, result)
    print(
        f"full {full:.2f}; FAVOR+ zero-shot {zero_shot:.2f}; after {args.steps} steps {result['final']:.2f}; "
        f"within 1 point of full after {within if within is not None else 'more than ' + str(args.steps)} steps; "
        f"wrote {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
