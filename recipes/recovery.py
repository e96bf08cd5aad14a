"""Recipe: how many fine-tuning steps a method needs after the swap to recover full attention's quality.

The Performer claim (Choromanski et al. 2021), generalised to any method: swap softmax attention for the method
in a fine-tuned model and fine-tune briefly after the swap. Here: the SST-2 checkpoint of
``recipes/clustered_table.py`` fine-tuned on dev half 0 (cross-fitting; taken from the cache, or fine-tuned now
with the same settings) is evaluated on dev half 1 under full attention and under each ``--method`` (zero-shot).
Each patched model is then fine-tuned on half 0 with ``approx.harness.finetune(..., method=...)`` (accelerate;
random state fixed, not redrawn) and evaluated on half 1 every ``--eval-every`` steps. Reported per method: the
zero-shot drop, the metric curve, and the first step at which the patched model is within 1 point of the
full-attention checkpoint it started from.

    python recipes/recovery.py                                       # FAVOR+ (256 features), SST-2, 60 steps
    python recipes/recovery.py --method linear efficient taylor      # the linear-cost kernels, one after another
    python recipes/recovery.py --method favor:features=128 --steps 300 --eval-every 20

Writes ``recipes/results/recovery_<task>_<method>.json`` per method (the FAVOR+ run made before this recipe
was generalised, by ``favor_recovery.py``, is ``recovery_sst2_favor.json``, same format). The evaluation half is never trained on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

import approx
from approx.config import MethodConfig
from approx.harness.argcheck import at_least, run_script
from approx.harness.finetune import FinetuneConfig, finetune
from approx.harness.provenance import provenance
from approx.harness.spec import parse_setup
from approx.integration import attach

sys.path.insert(0, str(Path(__file__).resolve().parent))
import clustered_table  # noqa: E402
from _shared import RESULTS, Timer, checkpoint_summary, ensure_checkpoint, write_json  # noqa: E402

DEFAULT_METHODS = ["favor:features=256"]
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


def steps_to_stay_within(curve: list[dict[str, Any]], metric: str, full: float, points: float = 1.0) -> int | None:
    """The first evaluated step from which every later evaluation is within ``points`` of ``full`` (None: the
    last one is not): a curve that touches the line once and falls back does not count as recovered."""
    stays = None
    for c in curve:
        if c[metric] >= full - points:
            stays = c["step"] if stays is None else stays
        else:
            stays = None
    return stays


def method_config(spec: str) -> MethodConfig:
    """A method spec (``name[:opt=val,...]``, as ``approx eval --method`` takes it) as its config object."""
    setup = parse_setup(spec)
    return approx.get_method(setup.method).make_config(**setup.options)


def file_label(config: MethodConfig) -> str:
    """The method and the options that differ from its defaults, safe in a file name: ``favor-features-128``."""
    defaults = type(config)().to_dict()
    changed = [f"{k}-{v}" for k, v in config.to_dict().items() if defaults.get(k) != v]
    return "-".join([config.method, *changed]).replace("/", "_").replace(" ", "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="sst2", choices=sorted(PRIMARY))
    p.add_argument("--model", help="base model (default: MiniLM-L6)")
    p.add_argument(
        "--method",
        nargs="+",
        default=DEFAULT_METHODS,
        help="methods to swap in, each name[:opt=val,...] (default: %(default)s); run one after another",
    )
    p.add_argument("--steps", type=at_least(1), default=60, help="fine-tuning steps of each patched model")
    p.add_argument("--eval-every", type=at_least(1), default=10)
    p.add_argument("--learning-rate", type=float, help="default: FinetuneConfig's")
    p.add_argument("--batch-size", type=at_least(1), help="default: FinetuneConfig's")
    p.add_argument("--limit", type=at_least(1), help="first N examples of each half (smoke runs)")
    p.add_argument("--base-steps", type=at_least(1), help="cap the steps of the base checkpoint's fine-tuning (smoke)")
    p.add_argument("--data-dir")
    p.add_argument("--source", choices=["auto", "local", "hub"])
    p.add_argument("--checkpoints", type=Path, default=clustered_table.CHECKPOINTS)
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--work-dir", type=Path, help="where the patched fine-tunings write (default: under --checkpoints)")
    p.add_argument("--seed", type=at_least(0), default=0)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    try:
        configs = [method_config(spec) for spec in args.method]  # every spec checked before anything runs
    except ValueError as e:
        p.error(str(e))
    for config in configs:
        if approx.get_method(config.method).requires_fit(config):
            p.error(f"{config.method} must be fitted before it runs; this recipe swaps in methods that need no fit")
    defaults = FinetuneConfig()  # the fine-tuning defaults live in the config dataclass
    args.learning_rate = defaults.learning_rate if args.learning_rate is None else args.learning_rate
    args.batch_size = defaults.batch_size if args.batch_size is None else args.batch_size
    task = args.task
    data = dict(data_dir=args.data_dir, source=args.source)
    base = args.model or clustered_table.default_model()

    # 1. the full-attention checkpoint (shared with the clustered table)
    settings = clustered_table.base_settings(task, max_steps=args.base_steps, limit=args.limit)
    with Timer() as t_base:
        folder, record, reused = ensure_checkpoint(
            base, task, TRAIN_SPLIT, settings, root=args.checkpoints, progress=not args.quiet, **data
        )
    for config in configs:
        recover(config, args, folder, record, reused, t_base.seconds)
    return 0


def recover(config: MethodConfig, args, folder: Path, record: dict[str, Any], reused: bool, base_seconds: float):
    """The zero-shot swap of one method, then its fine-tuning with evaluations; writes its result."""
    task, metric = args.task, PRIMARY[args.task]
    data = dict(data_dir=args.data_dir, source=args.source)
    label = file_label(config)
    with Timer() as t_zero:
        (zero,) = approx.evaluate(
            str(folder),
            task,
            [config],
            split=EVAL_SPLIT,
            limit=args.limit,
            batch_size=args.batch_size,
            seed=args.seed,
            progress=False,
            **data,
        )
    full, zero_shot = zero["reference_metrics"][metric], zero["metrics"][metric]
    print(f"{task} {EVAL_SPLIT}: full {full:.2f}, {label} zero-shot {zero_shot:.2f} ({zero_shot - full:+.2f})")

    # 2. fine-tune the patched checkpoint, evaluating every --eval-every steps
    curve = [{"step": 0, metric: zero_shot}]
    tokenizer = approx.integration.load_pretrained(str(folder), task=None, progress=False)[1]
    options = dict(batch_size=args.batch_size, seed=args.seed, **data)

    def every(step: int, model) -> None:
        if step % args.eval_every == 0 or step == args.steps:
            value = _evaluate(model, tokenizer, task, args.limit, options)["metrics"][metric]
            curve.append({"step": step, metric: value})
            if not args.quiet:
                print(f"  step {step}: {metric} {value:.2f}", flush=True)

    work = (args.work_dir or args.checkpoints) / f"{folder.name}-recovery-{label}"
    with Timer() as t_ft:
        rec = finetune(
            str(folder),
            task,
            output_dir=work,
            method=config,
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
    stays = steps_to_stay_within(curve, metric, full)
    result = {
        "recipe": "recipes/recovery.py",
        "task": task,
        "metric": metric,
        "protocol": (
            f"checkpoint fine-tuned with full attention on {task} {TRAIN_SPLIT} (cross-fitting half), evaluated on "
            f"{EVAL_SPLIT}; {label} swapped in zero-shot, then the patched model fine-tuned on {TRAIN_SPLIT} "
            f"({args.steps} steps, AdamW lr {args.learning_rate}, linear warm-up 10 % and decay, random state "
            "fixed) "
            f"and evaluated on {EVAL_SPLIT} every {args.eval_every} steps"
            + (f"; first {args.limit} examples of each half" if args.limit else "")
        ),
        "method": {"name": config.method, **config.to_dict()},
        "base_checkpoint": checkpoint_summary(folder, record, reused),
        "full": full,
        "zero_shot": zero_shot,
        "zero_shot_drop": full - zero_shot,
        "curve": curve,
        "final": curve[-1][metric],
        "steps_to_within_1_point": within,  # the first evaluation within 1 point
        "steps_to_stay_within_1_point": stays,  # from this evaluation on, every one is within 1 point
        "examples": zero["examples"],
        "losses": rec["losses"],
        "zero_shot_result": zero,
        "wall_seconds": {
            "base_finetune": record.get("provenance", {}).get("wall_seconds"),
            "base_this_run": base_seconds,
            "zero_shot_evaluation": t_zero.seconds,
            "patched_finetune_with_evaluations": t_ft.seconds,
        },
        "provenance": provenance(seed=args.seed),
    }
    out = args.results_dir / f"recovery_{task}_{label}.json"
    write_json(out, result)
    print(
        f"full {full:.2f}; {label} zero-shot {zero_shot:.2f}; after {args.steps} steps {result['final']:.2f}; "
        f"within 1 point of full after {within if within is not None else 'more than ' + str(args.steps)} steps; "
        f"wrote {out}"
    )


if __name__ == "__main__":
    run_script(main)
