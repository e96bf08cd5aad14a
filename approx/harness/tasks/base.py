"""What a task is, where its data comes from, and the task registry.

A task turns raw examples into model inputs (*features*; SQuAD makes several per long example), reads the
model's outputs back into per-example predictions and scores them. The harness
(:mod:`approx.harness.evaluation`) does the rest: batching, running the unpatched model and every method on the
same batches, fidelity, cost, time, memory and provenance.

Data comes from a local folder in the GLUE download layout (``--data-dir`` / ``$APPROX_DATA_DIR``) or from
the Hugging Face hub through ``datasets`` (``--source hub`` / ``$APPROX_DATA_SOURCE``). ``auto`` (the
default) takes the local file when it is there and the hub otherwise, failing at once, with what was looked
for, when neither can be had.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from ...config import as_integer
from ...registry import Registry
from ..data import ENV_VAR, MAX_FIELD, DataError, find_data_dir, read_text

__all__ = [
    "SOURCE_ENV_VAR",
    "DataError",
    "DataSource",
    "Feature",
    "Task",
    "collate",
    "get_task",
    "read_tsv",
    "read_tsv_lines",
    "register_task",
    "tasks",
]

SOURCE_ENV_VAR = "APPROX_DATA_SOURCE"
SOURCES = ("auto", "local", "hub")


@dataclasses.dataclass
class Feature:
    """One model input row. ``example`` is the index of the example it belongs to."""

    example: int
    input_ids: list[int]
    token_type_ids: list[int] | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def collate(features: list[Feature], pad_id: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """One batch of model inputs from ``features``: ids padded with ``pad_id`` to the longest, the attention mask,
    token types where the features have them; on ``device``."""
    n = max(len(f.input_ids) for f in features)
    ids = torch.full((len(features), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(features), n), dtype=torch.long)
    types = torch.zeros((len(features), n), dtype=torch.long) if features[0].token_type_ids is not None else None
    for i, f in enumerate(features):
        ids[i, : len(f.input_ids)] = torch.tensor(f.input_ids)
        mask[i, : len(f.input_ids)] = 1
        if types is not None:
            types[i, : len(f.input_ids)] = torch.tensor(f.token_type_ids)
    inputs = {"input_ids": ids, "attention_mask": mask}
    if types is not None:
        inputs["token_type_ids"] = types
    return {k: v.to(device) for k, v in inputs.items()}


@dataclasses.dataclass(frozen=True)
class DataSource:
    """Where examples come from: ``kind`` is ``"local"`` (``folder``) or ``"hub"``."""

    kind: str
    folder: Path | None = None

    def describe(self) -> str:
        return f"local folder {self.folder}" if self.kind == "local" else "Hugging Face hub (datasets)"


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes") or os.environ.get("HF_DATASETS_OFFLINE"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def read_tsv_lines(
    path: Path,
    columns: int | None = None,
    *,
    header: bool,
    min_columns: int | None = None,
    is_data: Callable[[list[str]], bool] | None = None,
) -> list[tuple[int, list[str]]]:
    """``(line, fields)`` of every data row of a GLUE TSV file: fields split on tabs with quoting disabled (GLUE
    sentences contain stray quotes), BOM dropped, empty lines skipped; ``line`` as an editor counts it.

    ``columns``: the exact number of fields every row must have (``min_columns``: at least that many).
    ``header``: the first line is the file's header, skipped; ``is_data`` (fields -> bool) tells a data row, so that
    a file whose header is missing is refused rather than read without its first example.
    Bytes that are not UTF-8, a row that does not fit or a field longer than :data:`MAX_FIELD` characters
    (a broken line) raise :class:`DataError` naming the file and line.
    """
    rows = []
    for lineno, line in enumerate(read_text(path).split("\n"), start=1):
        line = line.removesuffix("\r")
        if header and lineno == 1:
            if is_data is not None and is_data(line.split("\t")):
                raise DataError(
                    f"{path}, line 1: a data row where the file's header line belongs ({line[:60]!r}...); the "
                    "first line is skipped as the header, so a file without it would lose its first example"
                )
            continue
        if not line:
            continue
        row = line.split("\t")
        if (columns is not None and len(row) != columns) or (min_columns is not None and len(row) < min_columns):
            want = columns if columns is not None else f"at least {min_columns}"
            raise DataError(f"{path}, line {lineno}: expected {want} tab-separated fields, found {len(row)}")
        longest = max(range(len(row)), key=lambda i: len(row[i]))
        if len(row[longest]) > MAX_FIELD:
            raise DataError(
                f"{path}, line {lineno}: field {longest + 1} is {len(row[longest])} characters long (at most "
                f"{MAX_FIELD}); is a line break missing?"
            )
        rows.append((lineno, row))
    if not rows:
        raise DataError(f"{path}: no data rows")
    return rows


def read_tsv(
    path: Path, columns: int | None = None, *, header: bool, min_columns: int | None = None
) -> list[list[str]]:
    """The fields of every data row of a GLUE TSV file (see :func:`read_tsv_lines`)."""
    return [row for _, row in read_tsv_lines(path, columns, header=header, min_columns=min_columns)]


def parse_split(split: str) -> tuple[str, int | None]:
    """``"dev"`` -> ("dev", None); ``"dev/1"`` -> ("dev", 1): one half of the split (2-fold cross-fitting)."""
    name, slash, half = split.partition("/")
    if not slash:
        return name, None
    if half not in ("0", "1"):
        raise ValueError(f"split {split!r}: a cross-fitting half is written {name}/0 or {name}/1")
    return name, int(half)


def splits_overlap(a: str, b: str) -> bool:
    """Whether two splits share examples: the same split, or a half and its whole (``dev/0`` and ``dev``); the two
    halves of a split do not."""
    (name_a, half_a), (name_b, half_b) = parse_split(a), parse_split(b)
    return name_a == name_b and (half_a is None or half_b is None or half_a == half_b)


CROSS_FIT_SEED = 20_201_122


def cross_fit_half(examples: list[dict[str, Any]], half: int) -> list[dict[str, Any]]:
    """One of two fixed, disjoint halves of ``examples`` (original order kept), for 2-fold cross-fitting:
    fine-tune on one half, evaluate on the other, then swap. Examples with a ``title`` (SQuAD articles) are
    split by title, so no article is on both sides; others by a fixed random permutation of their indices."""
    g = torch.Generator().manual_seed(CROSS_FIT_SEED)
    if examples and "title" in examples[0]:
        titles = sorted({ex["title"] for ex in examples})
        order = torch.randperm(len(titles), generator=g).tolist()
        chosen = {titles[j] for j in order[half::2]}
        return [ex for ex in examples if ex["title"] in chosen]
    order = torch.randperm(len(examples), generator=g).tolist()
    cut = (len(examples) + 1) // 2
    keep = set(order[:cut] if half == 0 else order[cut:])
    return [ex for i, ex in enumerate(examples) if i in keep]


class Task:
    """Base class of a task. Subclasses set the class attributes and implement the methods below."""

    name: ClassVar[str]
    version: ClassVar[int]
    metrics: ClassVar[tuple[str, ...]]
    # the metric one number reports (default: the first of ``metrics``), and the metrics where lower is better
    primary: ClassVar[str | None] = None
    lower_is_better: ClassVar[frozenset[str]] = frozenset()
    default_max_length: ClassVar[int]
    # checkpoint heads the task can use, best first, with the mode each one runs; "base" is any encoder
    modes: ClassVar[dict[str, str]]
    splits: ClassVar[tuple[str, ...]] = ("dev",)
    default_split: ClassVar[str] = "dev"

    @property
    def primary_metric(self) -> str:
        """The metric a single number reports (what a ``score`` target of ``approx.autotune`` keeps)."""
        return self.primary or self.metrics[0]

    # ------------------------------------------------------------------------------------------ data
    def local_files(self, split: str) -> list[str | tuple[str, ...]]:
        """Files (relative to the data folder) that hold ``split``; a tuple lists alternatives."""
        raise NotImplementedError

    def read_local(self, folder: Path, split: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def read_hub(self, split: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def resolve_source(self, split: str, *, source: str | None = None, data_dir: str | None = None):
        """The :class:`DataSource` to read ``split`` from; fails at once when there is none."""
        split = parse_split(split)[0]
        source = source or os.environ.get(SOURCE_ENV_VAR) or "auto"
        if source not in SOURCES:
            raise ValueError(f"unknown data source {source!r}; choose one of {', '.join(SOURCES)}")
        self.check_split(split)
        files = self.local_files(split)
        looked = []
        if source in ("auto", "local"):
            try:
                folder = find_data_dir(data_dir)
                alternatives = [(f,) if isinstance(f, str) else f for f in files]
                missing = [alt for alt in alternatives if not any((folder / f).is_file() for f in alt)]
                if not missing:
                    return DataSource("local", folder)
                wanted = " and ".join(" or ".join(str(folder / f) for f in alt) for alt in missing)
                looked.append(f"local files: {wanted} (missing)")
            except FileNotFoundError as e:
                looked.append(f"local folder: {e}")
        if source in ("auto", "hub"):
            if _hub_reachable():
                return DataSource("hub")
            looked.append("the Hugging Face hub: unreachable, or HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set")
        places = "".join(f"\n  - {entry}" for entry in looked)
        raise FileNotFoundError(
            f"no data for task {self.name!r} ({split}, source {source!r}). Looked at:{places}\n"
            f"Provide the files in a folder with the GLUE layout and pass --data-dir (or set ${ENV_VAR}), "
            "or read them from the hub on a machine with a network (--source hub of approx eval, finetune and "
            "autotune; source='hub' in Python)."
        )

    def check_split(self, split: str) -> None:
        if split not in self.splits:
            raise ValueError(f"task {self.name!r} has no split {split!r}; splits: {', '.join(self.splits)}")

    def load(
        self,
        split: str | None = None,
        *,
        source: str | None = None,
        data_dir: str | None = None,
        limit: int | None = None,
    ) -> tuple[list[dict[str, Any]], DataSource]:
        """``(examples, source)``: the first ``limit`` examples of ``split`` (all when None).

        ``split`` may name one half of a split for 2-fold cross-fitting, ``"dev/0"`` or ``"dev/1"`` (see
        :func:`cross_fit_half`)."""
        split, half = parse_split(split or self.default_split)
        where = self.resolve_source(split, source=source, data_dir=data_dir)
        examples = self.read_local(where.folder, split) if where.kind == "local" else self.read_hub(split)
        if half is not None:
            examples = cross_fit_half(examples, half)
        if limit is not None:
            self._say_if_short(examples, limit, split if half is None else f"{split}/{half}")
            examples = [examples[i] for i in self.pick(examples, limit)]
        return examples, where

    def _say_if_short(self, examples: list[dict[str, Any]], limit, split: str) -> None:
        """A warning when ``limit`` asks for more examples than ``examples`` holds: all are read, and a result that
        says ``limit`` would otherwise suggest more than it measured."""
        count = as_integer(limit)
        if count is not None and count > len(examples):
            warnings.warn(
                f"approx: {self.name} {split} holds {len(examples)} examples; a limit of {count} reads all of them",
                stacklevel=3,
            )

    def pick(self, examples: list[dict[str, Any]], limit: int) -> list[int]:
        """The positions, in ``examples``' order, of the examples a ``limit`` reads: the first ``limit``. A task that
        spreads a subset otherwise overrides this (``squad-doc``); :meth:`load` and :meth:`load_after` both use it."""
        count = as_integer(limit)
        if count is None or count < 1:
            raise ValueError(f"limit must be an integer, at least 1, got {limit!r}")
        return list(range(min(count, len(examples))))

    def spread(self, examples: list[dict[str, Any]], limit: int, key: str) -> list[int]:
        """:meth:`pick` spread over the values of ``examples``' ``key``: ``limit`` examples taken round-robin (each
        value's first example in file order, then each value's second, ...), in ``examples``' order. A larger
        ``limit`` reads every example a smaller one reads (which :meth:`load_after` needs)."""
        count = len(Task.pick(self, examples, limit))  # the same checks of limit
        rank, seen = [], {}
        for i, ex in enumerate(examples):
            seen[ex[key]] = seen.get(ex[key], -1) + 1
            rank.append((seen[ex[key]], i))
        return sorted(i for _, i in sorted(rank)[:count])

    def load_after(
        self,
        split: str | None,
        skip: int,
        *,
        limit: int | None = None,
        source: str | None = None,
        data_dir: str | None = None,
    ) -> tuple[list[dict[str, Any]], DataSource]:
        """``(examples, source)``: the examples that ``load(split, limit=skip + limit)`` reads and ``load(split,
        limit=skip)`` does not (every example ``load(split)`` holds past those when ``limit`` is None), in the split's
        order: labelled examples that never overlap a calibration that read ``skip`` of the same split."""
        examples, where = self.load(split, source=source, data_dir=data_dir)
        taken = set(self.pick(examples, skip)) if skip else set()
        chosen = range(len(examples)) if limit is None else self.pick(examples, skip + limit)
        return [examples[i] for i in sorted(set(chosen) - taken)], where

    # -------------------------------------------------------------------------------------- protocol
    def mode_for(self, head: str) -> str:
        """The mode this task runs with a checkpoint whose head is ``head``; ``ValueError`` if none."""
        if head in self.modes:
            return self.modes[head]
        if "base" in self.modes:  # any checkpoint has the encoder
            return self.modes["base"]
        need = " or ".join(h for h in self.modes)
        raise ValueError(
            f"task {self.name!r} needs a checkpoint with a {need} head, but the model has "
            f"{'no task head' if head == 'base' else f'a {head} head'}. Pass a checkpoint fine-tuned for "
            f"{self.name}."
        )

    def head_for(self, checkpoint_heads: Sequence[str]) -> str:
        """Which head to load, given the heads a checkpoint has (``"base"`` is always possible)."""
        for head in self.modes:
            if head in checkpoint_heads or head == "base":
                return head
        return checkpoint_heads[0] if checkpoint_heads else "base"

    def prepare(self, model: torch.nn.Module, mode: str) -> dict[str, Any]:
        """Check the model fits the task in ``mode``; returns what the result should record (label map...)."""
        return {}

    def features(self, examples: list[dict[str, Any]], tokenizer: Any, *, max_length: int, mode: str) -> list[Feature]:
        raise NotImplementedError

    def train_features(self, examples: list[dict[str, Any]], tokenizer: Any, *, max_length: int) -> list[Feature]:
        """Features with their training targets in ``extra["labels"]`` (a dict of model keyword arguments)."""
        raise ValueError(f"task {self.name!r} cannot be fine-tuned (it has no training targets)")

    def train_batch(self, features: list[Feature], tokenizer: Any, *, epoch: int, seed: int) -> list[Feature]:
        """The features of one training batch in ``epoch`` (default: as :meth:`train_features` made them). A task
        whose training inputs are drawn at random (masked-LM's dynamic masking) draws them here from (``seed``,
        ``epoch``, feature) alone, so that a resumed run sees the batches an uninterrupted one would have."""
        return features

    def train_protocol(self, max_length: int) -> str | None:
        """How :meth:`train_features` / :meth:`train_batch` make training inputs, for the fine-tuning record
        (None: as the evaluation protocol, with the task's labels)."""
        return None

    def outputs(self, model_output: Any, inputs: dict[str, torch.Tensor], features: list[Feature], mode: str) -> list:
        """Per-feature outputs (CPU tensors) from the model's output on one batch."""
        raise NotImplementedError

    def predict(self, examples: list[dict[str, Any]], features: list[Feature], outputs: list, mode: str) -> list:
        """Per-example predictions from all features' outputs."""
        raise NotImplementedError

    def score(self, examples: list[dict[str, Any]], predictions: list, mode: str) -> dict[str, float]:
        raise NotImplementedError

    def example_values(
        self, examples: list[dict[str, Any]], predictions: list, mode: str
    ) -> dict[str, Sequence[float]] | None:
        """Per-example values whose mean is the metric, for the metrics that are means over examples (accuracy,
        SQuAD's F1 and exact match), or None (the default): what lets :mod:`approx.harness.resampling` resample a
        metric without scoring each resample again. A value is NaN for an example its metric does not count (MNLI's
        matched accuracy on a mismatched example), and the metric is the mean of the others: for each metric named,
        that mean must equal :meth:`score`'s value (``tests/test_resampling.py`` checks every task that has them)."""
        return None

    def resample_scores(
        self, examples: list[dict[str, Any]], predictions: list, mode: str, idx: Any
    ) -> dict[str, Any] | None:
        """:meth:`score` on every resample at once: ``idx`` a (B, n) integer array, each row a resample's example
        indices; the metrics as arrays of B values. None (the default) where the task has no such shortcut (each
        resample is then scored by :meth:`score`); for every metric it gives, each row must equal :meth:`score` of that
        resample (``tests/test_resampling.py`` checks it for every task that has one)."""
        return None

    def resampling_examples(self, examples: list[dict[str, Any]], predictions: list, mode: str) -> list[dict[str, Any]]:
        """What a bootstrap draws again: one entry per prediction, the example :meth:`score` reads with it (default:
        the examples, one prediction each; WikiText scores one prediction per window of its single example)."""
        return examples

    def resampling_unit(self, mode: str) -> str:
        """What one of :meth:`score`'s examples is, for a bootstrap interval's record (default: ``"example"``)."""
        return "example"

    def divergence(self, reference: Any, output: Any, mode: str) -> float | None:
        """Distance between the unpatched and the patched output of one feature, computed as soon as both
        exist (default: KL(unpatched || patched) of the softmax over the last dimension); None if undefined."""
        return self.kl(reference, output)

    def compact(self, output: Any, feature: Feature, mode: str) -> Any:
        """What of a feature's output to keep for :meth:`predict` (the harness keeps it for every feature)."""
        return output

    def fidelity(self, divergences: list, ref_predictions: list, predictions: list, mode: str) -> dict[str, float]:
        """How close the patched model's predictions are to the unpatched model's, on the same examples.

        Default (classification-like tasks): ``agreement``, the share of examples with identical predictions,
        and ``kl_divergence``, the mean per-feature KL(unpatched || patched) of the output distributions.
        """
        same = [a == b for a, b in zip(ref_predictions, predictions, strict=True)]
        kl = [d for d in divergences if d is not None]
        result = {"agreement": sum(same) / len(same)}
        if kl:
            result["kl_divergence"] = sum(kl) / len(kl)
        return result

    @staticmethod
    def kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
        """KL(softmax(reference) || softmax(logits)) over the last dimension, averaged over leading ones."""
        p = torch.log_softmax(reference_logits.double(), -1)
        q = torch.log_softmax(logits.double(), -1)
        return float((p.exp() * (p - q)).sum(-1).mean())

    def protocol(self, mode: str, max_length: int) -> str:
        return (self.__doc__ or "").strip()

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "metrics": list(self.metrics),
            "primary_metric": self.primary_metric,
            "lower_is_better": sorted(self.lower_is_better),
            "default_max_length": self.default_max_length,
            "modes": dict(self.modes),
            "splits": list(self.splits),
            "default_split": self.default_split,
            "summary": (self.__doc__ or "").strip().splitlines()[0],
        }


_TASKS: Registry[Task] = Registry("task", "approx.harness.tasks")


def register_task(cls: type[Task]) -> type[Task]:
    """Class decorator: register one instance of the task under ``cls.name`` (any module of
    ``approx/harness/tasks/`` is discovered; nothing to edit elsewhere)."""
    task = cls()
    unknown = sorted(({task.primary_metric} | set(task.lower_is_better)) - set(task.metrics))
    if unknown:
        raise ValueError(
            f"task {cls.name!r}: primary / lower_is_better name {', '.join(unknown)}, not among its metrics "
            f"({', '.join(task.metrics)})"
        )
    _TASKS.add(cls.name, task)
    return cls


def tasks() -> list[str]:
    """Names of the registered tasks."""
    return _TASKS.names()


def get_task(name: str) -> Task:
    """The task ``name``; ``ValueError`` listing the available ones otherwise."""
    return _TASKS.get(name)
