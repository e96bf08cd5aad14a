"""Method specs: which attention method, with which options, as every entry point of the harness takes it.

A spec is written ``name`` or ``name:option=value,option=value`` (e.g. ``i-clustered:clusters=25,topk=32``);
values are typed from the method's config class. :func:`as_setup` also takes a config object, a
:class:`Setup`, the patched layers of a model or a folder written by :func:`approx.save`, so
:func:`approx.evaluate`, :func:`approx.harness.finetune.finetune`, the command line and the recipes all
read methods the same way.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..config import MethodConfig, as_integer, did_you_mean
from ..registry import get_method, methods
from ..saved import SETTINGS_FILE, is_saved_setting, layer_record, read_settings

__all__ = [
    "PER_LAYER",
    "Setup",
    "as_setup",
    "check_not_a_folder",
    "heads_label",
    "option_types",
    "parse_setup",
    "parse_value",
    "short_label",
    "spec_options",
]

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

# The name under which a result records a saved model whose layers run different methods or options (e.g. one
# tuned by approx.autotune): its options are ``layers``, the saved ``[{"layer", "method", "config"}, ...]`` (and
# ``"heads"`` on a layer whose method runs on some heads only).
PER_LAYER = "per-layer"


@dataclasses.dataclass(frozen=True)
class Setup:
    """A method name and the options set explicitly (the others keep the config class's defaults)."""

    method: str
    options: dict[str, Any]

    @property
    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.method}:{opts}" if opts else self.method

    @classmethod
    def from_config(cls, config: MethodConfig) -> Setup:
        """A setup from a config object, e.g. ``Setup.from_config(IClusteredConfig(clusters=100))``."""
        return cls(config.method, config.to_dict())

    def config(self) -> dict[str, Any]:
        """All options of the method, defaults included (a per-layer setup: its ``layers`` as saved)."""
        if self.method == PER_LAYER:
            return dict(self.options)
        return get_method(self.method).make_config(**self.options).to_dict()


def option_types(config_class: type[MethodConfig]) -> dict[str, str]:
    """Option name -> type name (``int``, ``float``, ``bool``, ``str``; ``int | None`` for optional ones)."""
    return {o["name"]: o["type"] for o in config_class.describe()}


def parse_value(value: str, kind: str, name: str, owner: str) -> Any:
    """A command-line or spec string as the option's type (``kind`` as in :func:`option_types`)."""
    kind = kind.replace(" | None", "")
    try:
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        if kind == "bool":
            if value.lower() in _TRUE + _FALSE:
                return value.lower() in _TRUE
            raise ValueError(value)
    except ValueError:
        what = {"int": "an integer", "float": "a number", "bool": "true or false"}.get(kind, f"a {kind}")
        raise ValueError(f"{owner}: option {name!r} expects {what}, got {value!r}") from None
    return value


def names_a_method(spec: Any) -> bool:
    """Whether ``spec`` is a registered method's name, with or without options (``"window"``,
    ``"favor:features=64"``): that method, even where a folder of that name exists (write ``./window`` for the
    folder)."""
    return type(spec) is str and "/" not in spec and "\\" not in spec and spec.partition(":")[0].strip() in methods()


def saved_folder(method: Any) -> bool:
    """Whether a method as given is a folder written by :func:`approx.save` or ``approx fit`` (not a method's name;
    never an empty string, which a path would read as the current folder)."""
    if isinstance(method, str) and not method.strip():
        return False
    return not names_a_method(method) and is_saved_setting(method)


def check_not_a_folder(spec: str) -> None:
    """Refuse a method spec that names a folder (a path, or an existing folder) which is not a saved setting,
    saying what is wrong with it, rather than calling it an unknown method."""
    if names_a_method(spec):
        return
    if not spec.partition(":")[0].strip():  # (a path would read "" as the current folder)
        raise ValueError(f"no method named in {spec!r}: name one of {', '.join(methods())}")
    looks_like_path = "/" in spec or "\\" in spec or spec.startswith((".", "~"))
    folder = Path(spec).expanduser()
    if folder.is_dir():
        if is_saved_setting(folder):  # a saved model's settings, where only a method by name is taken
            raise ValueError(
                f"method folder {spec} holds a saved model's settings (approx.save or `approx fit`); here a method is "
                "given by name, one of: " + ", ".join(methods())
            )
        raise FileNotFoundError(
            f"method folder {spec} holds no {SETTINGS_FILE}: it was not written by approx.save or `approx fit`"
        )
    if looks_like_path:
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise FileNotFoundError(
            f"method folder {spec} {what} (a method given as a path is a folder written by approx.save or "
            "`approx fit`; a method by name is one of: " + ", ".join(methods()) + ")"
        )


def spec_options(spec: str) -> dict[str, str]:
    """The options written in ``"name:opt=val,..."``, as raw strings (``ValueError`` for an item without ``=``)."""
    given: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in spec.partition(":")[2].split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{spec!r}: expected option=value, got {item!r}")
        if key.strip() in given:
            raise ValueError(f"{spec!r}: option {key.strip()!r} given twice")
        given[key.strip()] = value.strip()
    return given


def parse_setup(spec: str, raw: Mapping[str, str] | None = None) -> Setup:
    """``"i-clustered:clusters=25,topk=32"`` -> Setup, validated against the method's config class.

    ``raw``: more options as strings (e.g. from command-line flags), overriding those of ``spec``."""
    check_not_a_folder(spec)
    method = get_method(spec.partition(":")[0].strip())
    kinds = option_types(method.config_class)
    given = {**spec_options(spec), **(raw or {})}
    options: dict[str, Any] = {}
    for key, value in given.items():
        if key not in kinds:
            raise ValueError(
                f"{method.name}: unknown option {key!r}{did_you_mean(key, kinds)}; options: {', '.join(kinds) or 'none'}"
            )
        options[key] = parse_value(value, kinds[key], key, method.name)
    method.make_config(**options)  # validate now, not halfway through a run
    return Setup(method.name, options)


def as_setup(method: str | Setup | MethodConfig | dict, seed: int | None = None) -> Setup:
    """A method given as ``"name[:opt=val,...]"``, a :class:`Setup`, a config object, the patched layers of a
    model (``approx.patched_layers(model)``) or a folder written by :func:`approx.save`; a method with a
    ``seed`` option not set explicitly takes ``seed``."""
    entries = layer_entries(method)
    if entries is not None:
        return _layers_setup(entries, tuned=saved_folder(method) and "tuning" in read_settings(method))
    if isinstance(method, os.PathLike):  # not a saved folder: said so as a path, never read as a method's name
        check_not_a_folder(os.path.join(".", os.fspath(method)))
    if isinstance(method, MethodConfig):  # its options checked as if named, as approx.patch reads them; a config
        # built by the caller is the options it changes (so the run's seed reaches it, as it reaches the same spec),
        # one read from a record is the record (its seed as recorded)
        config = method.as_given()
        setup = Setup(config.method, config.to_dict() if config.recorded else config.changed())
    elif isinstance(method, Setup):
        setup = method
    elif isinstance(method, str):
        setup = parse_setup(method)
    else:
        raise TypeError(f"a method is a name, a Setup or a config object, got {type(method).__name__}")
    if seed is not None and "seed" not in setup.options and reads_option(setup.method, setup.options, "seed"):
        setup = Setup(setup.method, {**setup.options, "seed": seed})
    return setup


def reads_option(method: str, options: dict[str, Any], name: str) -> bool:
    """Whether ``method`` with ``options`` has option ``name`` and reads it: not one its other options leave unused
    (Linformer's ``seed`` under ``mode="mean"``), so that a run's seed goes only where it matters. (A method option
    given before every ``--method`` on the command line is the user's own value: refused where unused, with the hint
    to give it after one method.) Impossible options answer True: they are refused where the setup is checked, with
    their own message."""
    config_class = get_method(method).config_class
    if name not in config_class.option_names():
        return False
    try:
        return name not in config_class(**options).unused()
    except (TypeError, ValueError):
        return True


def layer_entries(method: Any) -> list[dict[str, Any]] | None:
    """Patched layers (``approx.patched_layers(model)``) or a folder written by :func:`approx.save` as their entries,
    ``{"layer", "method", "config"}`` per patched layer (and ``"heads"`` where its method runs on some heads only;
    only those layers: a folder may hold some); None for a method given by name, setup or config."""
    if isinstance(method, dict):  # existing layers: their own method and options, state as it is
        if not method:
            raise ValueError("no patched layers given (approx.patched_layers of an unpatched model is empty)")
        from ..layer import ApproxAttention

        if not all(as_integer(i) is not None and isinstance(x, ApproxAttention) for i, x in method.items()):
            kinds = ", ".join(sorted({f"{type(i).__name__} -> {type(x).__name__}" for i, x in method.items()}))
            raise TypeError(
                f"a dict is read as patched layers (approx.patched_layers(model): layer index -> its layer), and "
                f"this one maps {kinds}; a method with options is a spec ('favor:features=16'), a Setup, or a config "
                "(approx.get_method('favor').make_config(features=16))"
            )
        return [layer_record(as_integer(i), x) for i, x in sorted(method.items())]
    if saved_folder(method):  # a folder written by approx.save / `approx fit`
        return [  # every option, as the folder means it (one it predates: as it was saved), so read as a record
            {**x, "config": get_method(x["method"]).config_class.from_record(x["config"]).to_dict()}
            for x in read_settings(method)["layers"]
        ]
    return None


def _layers_setup(entries: list[dict[str, Any]], *, tuned: bool) -> Setup:
    """Patched layers as one setup: their method when every layer runs the same method and options (and they
    were not tuned per layer), else a :data:`PER_LAYER` setup listing them."""
    first = entries[0]
    same = all((x["method"], x["config"], x.get("heads")) == (first["method"], first["config"], None) for x in entries)
    if not tuned and same:
        return Setup(first["method"], dict(first["config"]))
    return Setup(PER_LAYER, {"layers": [dict(x) for x in entries]})


def heads_label(heads) -> str:
    """``"[heads 0,3,5]"`` for a method on some heads only; empty for every head (None)."""
    return "" if heads is None else "[heads " + ",".join(str(h) for h in heads) + "]"


def span_text(run: Sequence[int]) -> str:
    """A run of consecutive layers as a label writes it: ``"3"``, ``"4-5"``."""
    return f"{run[0]}" if len(run) == 1 else f"{run[0]}-{run[-1]}"


def layer_spans(indices: Iterable[int]) -> str:
    """Layer indices as runs of consecutive layers: ``[0, 1, 4]`` -> ``"0-1,4"``."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(span_text(r) for r in runs)


def short_label(method: dict[str, Any]) -> str:
    """``name:opt=value`` from a result's ``"method"`` entry (a full record: every option the method had when it was
    written), with only the options that differ from the method's defaults and that the others read (a record made
    before an unused value was refused may hold one); an option the record predates counts at its ``absent`` value
    (``i-clustered:refine=0`` for a result from before ``refine``)."""
    name = method["name"]
    if name == PER_LAYER and "layers" not in method:  # a per-layer result that names itself (e.g. merged halves)
        return f"{PER_LAYER}[{method.get('label', '')}]"
    if name == PER_LAYER:  # "per-layer[0-1 i-clustered:clusters=25; 2 full; ...]", runs of layers merged
        runs: list[tuple[list[int], str]] = []
        for x in sorted(method["layers"], key=lambda x: x["layer"]):
            label = short_label({"name": x["method"], **x["config"]}) + heads_label(x.get("heads"))
            if runs and runs[-1][1] == label and runs[-1][0][-1] == x["layer"] - 1:
                runs[-1][0].append(x["layer"])
            else:
                runs.append(([x["layer"]], label))
        return f"{PER_LAYER}[" + "; ".join(f"{span_text(r)} {label}" for r, label in runs) + "]"
    config_class = get_method(name).config_class
    defaults = config_class().to_dict()
    recorded = config_class.recorded_options({k: v for k, v in method.items() if k != "name"})  # as it was run
    try:  # an option the others left unused changed nothing: left out, so that the label runs as a spec
        unused = config_class(**recorded).unused()
    except (TypeError, ValueError):
        unused = {}
    opts = ",".join(f"{k}={v}" for k, v in recorded.items() if defaults.get(k) != v and k not in unused)
    return f"{name}:{opts}" if opts else name
