"""Checks of the command line's arguments that argparse cannot make: paths that must exist, devices that must
be available, positive counts and flags that may be given only once. Each failure is one line (exit 2)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch

__all__ = [
    "Once",
    "at_least",
    "check_device",
    "looks_like_path",
    "method_variant",
    "option_value",
    "run_script",
    "set_threads",
]


def looks_like_path(name: str) -> bool:
    """A local path rather than a hub id (``org/name``)."""
    return name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1 or name.endswith("/")


def at_least(least: int):
    """An argparse ``type`` for an integer of at least ``least`` (the benchmarks' ``--repeats 1``, ``--lengths``): a
    count of 0 had crashed after the setup (the median of no timings), a length of 0 or below written a plot."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    parse.__name__ = f"integer >= {least}"  # how argparse names the type in its errors
    return parse


def method_variant(item: str, methods: list[str]) -> tuple[str, dict]:
    """A benchmark's ``--variant METHOD[KEY=VALUE,...]`` (a method run again with other options, e.g.
    ``lsh[engine=fused]``): (method, options), values read as booleans, integers, floats or else strings (a value may
    hold ``=``, not brackets or commas). ``ValueError`` naming the expected form and the methods when it is not that
    (an empty key or item, a bracket inside, a key given twice), or names another method. Whether the method takes
    the options is the caller's to check (``approx.get_method(method).make_config``)."""
    method, bracket, rest = item.partition("[")
    body = rest[:-1] if rest.endswith("]") else None
    pairs = [] if body is None or "[" in body or "]" in body else [kv.partition("=") for kv in body.split(",")]
    keys = [key.strip() for key, _, _ in pairs]
    well_formed = bool(pairs) and all(eq and key for (_, eq, _), key in zip(pairs, keys, strict=True))
    if method not in methods or not bracket or not well_formed or len(set(keys)) != len(keys):
        raise ValueError(f"--variant {item!r}: expected METHOD[KEY=VALUE,...] with METHOD in {methods}")
    return method, {key: option_value(text.strip()) for key, (_, _, text) in zip(keys, pairs, strict=True)}


def option_value(text: str):
    """A command line's option value: a boolean (true, false), an integer, a float, or else the string."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def set_threads(threads: int | None) -> None:
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be at least 1, got {threads} (leave it out for torch's choice)")
    torch.set_num_threads(threads)


def check_device(device: str | torch.device | None, name: str = "--device") -> None:
    """Refuse a device that is unknown or not available on this machine, before anything is loaded (``name``: the
    flag, or a Python argument's name, that the message says)."""
    if device is None:
        return
    given = f"{name} {device}" if name.startswith("--") else f"{name}={str(device)!r}"
    cpu = "--device cpu" if name.startswith("--") else f"{name}='cpu'"
    try:
        kind = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{given}: unknown device; use cpu, cuda, cuda:N or mps") from None
    if kind.type == "cpu":
        if kind.index not in (None, 0):  # torch takes cpu:1 and runs on the one CPU device: not what was asked
            raise ValueError(f"{given}: there is one CPU device (its threads: --threads); use {cpu}")
        return
    if kind.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA device found"
            raise ValueError(f"{given}: CUDA is not available here ({build}); use {cpu}")
        if kind.index is not None and kind.index >= torch.cuda.device_count():
            raise ValueError(f"{given}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return
    if kind.type == "mps" and torch.backends.mps.is_available():
        return
    raise ValueError(f"{given}: {kind.type} is not available here; use cpu, cuda, cuda:N or mps")


def device_checked(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` once :func:`check_device` accepts ``args.device``; else the parser's one-line error (a script's
    ``--device``: the benchmarks)."""
    try:
        check_device(args.device)
    except ValueError as e:
        parser.error(str(e))
    return args


# the flags an argument list has given so far (kept on the namespace while it is parsed; see `Once`)
_GIVEN = "_approx_flags_given"


class Once(argparse.Action):
    """A flag that may be given once: a repeat is an error, not a silent override (a default does not count)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault(_GIVEN, set())
        if self.dest in given:
            before = getattr(namespace, self.dest, None)
            hint = " (a method's own seed: --method NAME:seed=N)" if self.dest == "seed" else ""
            raise ValueError(f"{option_string} given twice ({before!r} and {values!r}); give it once{hint}")
        given.add(self.dest)
        setattr(namespace, self.dest, values)


def once_each(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make every flag of ``parser`` and of its subcommands that stores one value a :class:`Once` flag: given twice,
    an error, where argparse keeps the last value without a word (``--seed 1 ... --seed 2``, ``--limit``).
    Repeatable flags (``append``) and switches are left as they are."""
    for action in parser._actions:
        if type(action) is argparse._StoreAction and action.option_strings:
            action.__class__ = Once
        elif isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                once_each(sub)
    return parser


def without_bookkeeping(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` without what :class:`Once` kept on it while parsing."""
    args.__dict__.pop(_GIVEN, None)
    return args


def run_script(main: Callable[[], int | None]) -> NoReturn:
    """Run a recipe's or a benchmark's ``main`` and exit with its status. What the user can put right (data or a
    file that is not there, data that cannot be read: ``FileNotFoundError``, the harness's ``DataError``) is said in
    one line, exit status 2, as the ``approx`` command says it, rather than as a traceback; other errors keep theirs
    (a lab script's bug is to be read)."""
    from .data import DataError

    try:
        code = main()
    except (FileNotFoundError, DataError) as err:
        print(f"{Path(sys.argv[0]).name}: error: {str(err).strip() or type(err).__name__}", file=sys.stderr)
        sys.exit(2)
    if code is not None and (isinstance(code, bool) or not isinstance(code, int)):  # sys.exit would print it, status 1
        raise TypeError(f"{Path(sys.argv[0]).name}: main returned {type(code).__name__}, not an exit status")
    sys.exit(code)
