"""Command-line flags generated from config dataclasses: method options (``approx eval`` / ``finetune``),
fine-tuning settings and fit settings. Nothing here restates a default: unset flags stay None and the
dataclass decides."""

from __future__ import annotations

import argparse
import functools

from .. import methods
from ..config import MethodConfig
from ..registry import get_method
from .argcheck import Once
from .spec import check_not_a_folder, option_types, parse_setup, parse_value, saved_folder, spec_options

__all__ = ["config_flags", "config_values", "eval_setups", "method_flags", "method_option_args", "split_method_args"]

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
    every method that has the option, unless the method's spec sets it (``--clusters 50 --method
    clustered:clusters=25`` runs 25 clusters); a flag after a ``--method`` whose spec sets the same option is an
    error (:func:`eval_setups`). Returns (other args, [(method spec, {option: raw value})], shared).
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
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
                i += 1
            else:
                raise ValueError(f"{flag} expects a value")
            if flag == "--method":
                groups.append((value, {}))
            else:
                name, target = flags[flag][0], groups[-1][1] if groups else shared
                if name in target:
                    where = f"after --method {groups[-1][0]}" if groups else "before every --method"
                    raise ValueError(f"{flag} given twice {where} ({target[name]} and {value}); give it once")
                target[name] = value
        else:
            rest.append(arg)
        i += 1
    return rest, groups, shared


def eval_setups(groups: list[tuple[str, dict[str, str]]], shared: dict[str, str]) -> list:
    """Typed :class:`~approx.harness.spec.Setup` objects (or saved-setting folders) from the raw ``--method``
    groups; ``shared`` options go to every named method that has them."""

    if not groups:
        raise ValueError(f"name at least one --method to compare with full attention; methods: {', '.join(methods())}")
    setups: list = []
    used_shared: set[str] = set()
    for spec, raw in groups:
        if saved_folder(spec):  # a folder written by `approx fit` / approx.save: its own layers and options
            if raw:
                raise ValueError(
                    f"--method {spec} is a saved setting with its own options; drop the option flags after it"
                )
            setups.append(spec)
            continue
        check_not_a_folder(spec)
        method = get_method(spec.partition(":")[0].strip())
        kinds = option_types(method.config_class)
        for name in raw:
            if name not in kinds:
                raise ValueError(
                    f"method {method.name!r} has no option --{name.replace('_', '-')}; its options: "
                    + (", ".join("--" + k.replace("_", "-") for k in kinds) or "none")
                )
        inline = spec_options(spec)
        twice = sorted(set(raw) & set(inline))
        if twice:
            raise ValueError(
                f"--method {spec}: {', '.join(twice)} given twice, in the spec and as a flag after it; give it once"
            )
        # an option before every --method is a default for each method that has it: a value in the spec wins
        used_shared |= {name for name in shared if name in kinds}
        mine = {name: value for name, value in shared.items() if name in kinds and name not in inline}
        try:
            setups.append(parse_setup(spec, {**mine, **raw}))
        except ValueError as e:  # a shared flag meant for another named method with an option of the same name
            others = {n for g, _ in groups if g != spec and not saved_folder(g) for n in _option_names(g)}
            wrong = [name for name in mine if f"'{name}'" in str(e) and name in others]
            if not wrong:
                raise
            flag = f"--{wrong[0].replace('_', '-')} {mine[wrong[0]]}"
            raise ValueError(
                f"{e}; {flag}, given before every --method, goes to each method with that option: to set it for one "
                f"method only, give it after that method's --method (--method NAME {flag})"
            ) from None
    unused = set(shared) - used_shared
    if unused:
        raise ValueError(
            f"option(s) {', '.join('--' + u.replace('_', '-') for u in sorted(unused))} belong to none of the methods "
            f"named ({', '.join(s if isinstance(s, str) else s.method for s in setups)})"
        )
    return setups


def _option_names(spec: str) -> set[str]:
    """The option names of the method a ``--method`` spec names (none for a name that is not a method's)."""
    try:
        return set(option_types(get_method(spec.partition(":")[0].strip()).config_class))
    except ValueError:
        return set()


def method_option_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("method options (generated from the methods' configs; see `approx methods`)")
    for flag, (_name, kind, owners) in method_flags().items():
        g.add_argument(flag, metavar=kind.upper(), help=", ".join(owners))


def config_flags(p, config_class: type[MethodConfig], *, owner: str | None = None) -> None:
    """One ``--flag`` per field of ``config_class`` (type, help and default read from the dataclass; unset
    flags stay None, so the dataclass's defaults are the only ones)."""
    actions = getattr(p, "_option_string_actions", {})
    for opt in config_class.describe():
        flag = "--" + opt["name"].replace("_", "-")
        kind = opt["type"].replace(" | None", "")
        default = "" if opt["default"] is None else f" (default {opt['default']})"
        if flag in actions:  # a name several configs share: one flag, each owner's meaning and default listed
            actions[flag].help += f"; {owner or config_class.method}: {opt['help']}{default}"
            continue
        if owner:
            default += f" [{owner}]"
        p.add_argument(
            flag,
            dest=opt["name"],
            action=Once,  # a repeat is refused, not silently the last value
            metavar=kind.upper(),
            type=functools.partial(_flag_value, kind=kind, name=opt["name"], owner=owner or config_class.method),
            help=f"{opt['help']}{default}",
        )


def _flag_value(value: str, *, kind: str, name: str, owner: str):
    """A flag's value parsed as a spec's is, its error said as written (argparse reads a ValueError from ``type`` as
    "invalid <lambda> value" and drops the message)."""
    try:
        return parse_value(value, kind, name, owner)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def config_values(args: argparse.Namespace, config_class: type[MethodConfig]) -> dict:
    """The fields of ``config_class`` given on the command line."""
    return {n: getattr(args, n) for n in config_class.option_names() if getattr(args, n, None) is not None}
