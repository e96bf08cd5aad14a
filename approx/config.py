"""Base class of every method's config dataclass.

Each method declares one frozen dataclass deriving from :class:`MethodConfig`. Its fields are the method's
options, its defaults are the only defaults (the CLI, the docs and ``approx methods`` read them from here),
and each field carries its help text in ``metadata["help"]``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import operator
import typing
from typing import Any, ClassVar

__all__ = ["MethodConfig", "as_integer", "option", "did_you_mean"]


_UNSET = object()


def option(default: Any, help: str, *, absent: Any = _UNSET) -> Any:  # noqa: A002 - mirrors argparse's name
    """A config field with its help text. ``absent``: what a *recorded* config without this option meant, when that
    differs from ``default`` (the option came later, with a default that changes the method): a folder saved or a
    result written before keeps its meaning (:meth:`MethodConfig.from_record`)."""
    metadata = {"help": help} if absent is _UNSET else {"help": help, "absent": absent}
    return dataclasses.field(default=default, metadata=metadata)


def as_integer(value: Any) -> int | None:
    """``value`` as an ``int`` when it is an integer scalar (a Python, NumPy or 0-d torch integer: what
    ``operator.index`` takes), None otherwise (a bool, a float, an array, anything else): options and layer indices
    accept the integers a sweep over ``numpy.arange`` or a tensor gives."""
    if isinstance(value, bool) or "bool" in type(value).__name__ or "bool" in str(getattr(value, "dtype", "")):
        return None
    if getattr(value, "ndim", 0) != 0:  # an array or tensor of one element is not a scalar
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def did_you_mean(name: str, choices: typing.Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` when a close match exists, else an empty string."""
    choices = list(choices)

    def plain(x: str) -> str:  # "FAVOR", "Window", "SST-2" (GLUE's folder), "top-k": the case or a dash alone differs
        return x.lower().replace("-", "").replace("_", "")

    same = [c for c in choices if plain(c) == plain(name)]
    close = same or difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


@dataclasses.dataclass(frozen=True)
class MethodConfig:
    """Options of an attention method. Subclasses add fields with :func:`option` and override ``check``."""

    method: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            expected = hints[f.name]
            if expected is int:
                integer = as_integer(value)
                if integer is None:
                    raise ValueError(f"{self.method}: option {f.name!r} must be an integer, got {value!r}")
                object.__setattr__(self, f.name, integer)  # a NumPy integer, say, as a Python int
            if expected is float:
                object.__setattr__(self, f.name, self._number(f.name, value))  # alpha=2 recorded as 2.0, as typed
            if expected is bool and not isinstance(value, bool):
                raise ValueError(f"{self.method}: option {f.name!r} must be True or False, got {value!r}")
            if expected is str and not isinstance(value, str):
                raise ValueError(f"{self.method}: option {f.name!r} must be a string, got {value!r}")
        self.check()

    def _number(self, name: str, value: Any) -> float:
        """A float option's value as a Python float: an int, a float or a NumPy / 0-d torch number; not a bool, and
        finite (NaN or infinity is refused: a saved model records its options in JSON, which has neither)."""
        scalar = isinstance(value, numbers.Real) or (hasattr(value, "dtype") and getattr(value, "ndim", 1) == 0)
        if scalar and not isinstance(value, bool) and "bool" not in str(getattr(value, "dtype", type(value).__name__)):
            try:
                number = float(value)
            except (TypeError, ValueError, OverflowError):
                pass
            else:
                if math.isfinite(number):
                    return number
                raise ValueError(f"{self.method}: option {name!r} must be a finite number, got {value!r}")
        raise ValueError(f"{self.method}: option {name!r} must be a number, got {value!r}")

    def check(self) -> None:
        """Raise ``ValueError`` naming the option when a value is impossible."""

    def unused(self) -> dict[str, str]:
        """The options these settings never read, each with the setting that would read it (Nystrom's
        ``{"pinv_iterations": "pinv='iterative'"}`` under ``pinv='exact'``): :meth:`from_options` refuses a value
        given for one, which would otherwise be recorded as if it had mattered."""
        return {}

    def require(self, ok: bool, name: str, why: str) -> None:
        if not ok:
            raise ValueError(f"{self.method}: option {name!r} = {getattr(self, name)!r} is invalid: {why}")

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def _check_names(cls, options: dict[str, Any]) -> None:
        """Refuse option names the method does not have, listing those it has."""
        names = cls.option_names()
        unknown = [k for k in options if k not in names]
        if unknown:
            hints = "".join(did_you_mean(k, names) for k in unknown)
            valid = ", ".join(names) or "none"
            raise ValueError(
                f"{cls.method}: unknown option(s) {', '.join(map(repr, unknown))}{hints}; "
                f"options of {cls.method!r}: {valid}"
            )

    @classmethod
    def from_options(cls, **options: Any) -> MethodConfig:
        """Build the config from keyword options, refusing names the method does not have, and a value given for an
        option the other options leave unused (:meth:`unused`). Every option given (``to_dict`` of a config: a
        saved folder's layer, a result's method) is a record, taken as written."""
        cls._check_names(options)
        config = cls(**options)
        if set(options) != set(cls.option_names()):
            config._refuse_unused(options)
        return config

    def _refuse_unused(self, given: dict[str, Any]) -> None:
        """Refuse a value of ``given`` that differs from the default for an option the others leave unused."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, reader in self.unused().items():
            if name in given and getattr(self, name) != defaults[name]:
                raise ValueError(
                    f"{self.method}: option {name!r} = {given[name]!r} has no effect here (only with {reader}); "
                    "leave it out"
                )

    def as_given(self, **overrides: Any) -> MethodConfig:
        """This config with ``overrides``, read as options a caller named rather than as a record (``approx.patch``,
        ``approx.evaluate``, ``approx.autotune``, ``approx.finetune`` given a config object): the options that differ
        from the defaults, and the overrides, are checked as :meth:`from_options` checks options given by name, even
        when every option differs (a value for an option the others leave unused is refused). A config that
        :meth:`from_record` read is taken as written, as the record it came from, and only its overrides are
        checked."""
        type(self)._check_names(overrides)
        if self.recorded:  # the record's values as written; the overrides checked as named
            if not overrides:
                return self
            config = self.replaced(**overrides)
            config._refuse_unused(overrides)
            return config
        given = {**self.changed(), **overrides}
        config = type(self)(**given)
        config._refuse_unused(given)
        return config

    def changed(self) -> dict[str, Any]:
        """The options whose values differ from the defaults: what a caller who built this config chose."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return {k: v for k, v in self.to_dict().items() if v != defaults[k]}

    @property
    def recorded(self) -> bool:
        """Whether :meth:`from_record` read this config from a record (kept by :meth:`replaced` and by copies)."""
        return bool(self.__dict__.get("_recorded", False))

    def replaced(self, **changes: Any) -> MethodConfig:
        """``dataclasses.replace(self, **changes)`` (options checked as the constructor checks them) that stays
        :attr:`recorded` when this config is: ``approx.redraw`` records a new seed in a config read from a record."""
        config = dataclasses.replace(self, **changes)
        if self.recorded:
            object.__setattr__(config, "_recorded", True)
        return config

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def recorded_options(cls, record: dict[str, Any]) -> dict[str, Any]:
        """The options of a recorded config (``to_dict`` of an earlier version: a saved folder's layer, a result's
        ``"method"`` entry without its ``"name"``), each option it lacks that has an ``absent`` value set to it, so
        that the record means what it meant when it was written."""
        out = dict(record)
        for f in dataclasses.fields(cls):
            if f.name not in out and "absent" in f.metadata:
                out[f.name] = f.metadata["absent"]
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling (``torch.save`` of a patched model, ``copy``): an option the pickle predates takes its
        ``absent`` value, as in :meth:`recorded_options`, not today's default."""
        self.__dict__.update(type(self).recorded_options(state))

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> MethodConfig:
        """The config a saved or reported record describes (:meth:`recorded_options`), names checked as
        :meth:`from_options` checks them; an unused option's value (see :meth:`unused`) is kept as recorded."""
        options = cls.recorded_options(record)
        cls._check_names(options)
        config = cls(**options)  # (a record may hold an unused option's value: it loads as written)
        object.__setattr__(config, "_recorded", True)  # (not a field: equality, to_dict and replace ignore it)
        return config

    @classmethod
    def describe(cls) -> list[dict[str, Any]]:
        """Name, type, default and help of every option (used by the CLI and the docs)."""
        hints = typing.get_type_hints(cls)
        return [
            {
                "name": f.name,
                "type": getattr(hints[f.name], "__name__", str(hints[f.name])),
                "default": f.default,
                "help": f.metadata.get("help", ""),
            }
            for f in dataclasses.fields(cls)
        ]
