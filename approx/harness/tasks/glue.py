"""The nine GLUE tasks (Wang et al. 2019), read from the GLUE download layout or the hub (``nyu-mll/glue``).

Common protocol (version 1): each example is tokenised as one sequence or a pair with the model's own
tokenizer, special tokens added, truncated to ``max_length`` tokens (default 128, as in the
clustered-attention paper; pairs truncated longest-first). A checkpoint fine-tuned for sequence
classification predicts the argmax of its logits (STS-B: its single regression output). The checkpoint's
labels are matched to the task's by name when its config names them (``id2label``; case, spaces and dashes
aside), by index in the hub's label order when it only numbers them (``LABEL_0``, ...) or names them its own way
(``neg``, ``pos``, none of them the task's: with a warning), and refused when they are another GLUE task's (an RTE
classifier run as SST-2) or name only some of the task's; the mapping used is recorded in the result.

STS-B also runs zero-shot on an encoder without a task head (e.g. a sentence-embedding model such as
MiniLM-L6): each sentence is encoded alone, hidden states are mean-pooled over real tokens and the
prediction is the cosine of the two embeddings; metrics are Pearson and Spearman against the gold score.
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from .. import metrics as M
from .base import DataError, Feature, Task, get_task, read_tsv_lines, register_task, tasks

FINE_TUNED = "fine-tuned"
ZERO_SHOT = "zero-shot-cosine"
_GENERIC_LABEL = re.compile(r"(label_)?\d+", re.ASCII)  # id2label names that say nothing (matched by index)


def _label_name(name: Any) -> str:
    """A label as the tasks spell theirs: ``"Not-Entailment "`` -> ``"not_entailment"``."""
    return re.sub(r"[\s\-]+", "_", str(name).strip().lower())


def _task_with_labels(names: list[str], but: str) -> str | None:
    """The GLUE tasks other than ``but`` whose labels ``names`` are (an RTE classifier's, run as SST-2), if any."""
    own = sorted(get_task(but).labels)
    found = [t for t in tasks() if sorted(getattr(get_task(t), "labels", ())) == sorted(names)]
    return ", ".join(found) if found and sorted(names) != own else None


_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", re.ASCII)


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, N, D) hidden states, (B, N) mask -> (B, D) mean over real tokens."""
    m = mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)


def _too_short(task: str, tokenizer: Any, max_length: int, pair: bool) -> None:
    """Refuse a ``max_length`` below the special tokens the tokenizer adds: it cannot truncate to it and returns the
    whole input, which a result would then record as truncated to ``max_length``."""
    specials = tokenizer.num_special_tokens_to_add(pair=pair)
    what = "a sentence pair" if pair else "a sentence"
    raise ValueError(
        f"{task}: max_length={max_length} is shorter than the {specials} special tokens this tokenizer adds to {what}, "
        f"so the inputs cannot be truncated to it; give at least {specials + 1}"
    )


class GlueTask(Task):
    """Base of the GLUE tasks; subclasses give the files, columns and labels."""

    version = 1
    default_max_length = 128
    modes: ClassVar[dict[str, str]] = {"sequence-classification": FINE_TUNED}
    splits = ("dev", "train")
    folder: ClassVar[str]  # e.g. "SST-2"
    hub_config: ClassVar[str]  # e.g. "sst2"
    hub_fields: ClassVar[tuple[str, ...]]  # text (and pair) fields of the hub rows
    labels: ClassVar[tuple[str, ...]] = ()  # label names in the hub's order; () = regression
    score_range: ClassVar[tuple[float, float]] = (-math.inf, math.inf)  # a regression task's scale
    groups: ClassVar[dict[str, str]] = {"": "dev"}  # result group -> local file stem (MNLI has two)

    def pick(self, examples, limit):
        """The first ``limit`` examples; of a dev set in several groups (MNLI's matched and mismatched), ``limit``
        taken round-robin over the groups (:meth:`~approx.harness.tasks.base.Task.spread`), so that each group's
        metric is measured rather than the first group's alone."""
        if len({ex["group"] for ex in examples}) > 1:
            return self.spread(examples, limit, "group")
        return super().pick(examples, limit)

    def local_files(self, split: str) -> list[str]:
        stems = list(self.groups.values()) if split == "dev" else ["train"]
        return [f"glue/{self.folder}/{stem}.tsv" for stem in stems]

    def parse_row(self, row: list[str]) -> tuple[str, str | None, str]:
        """(text, text_pair, raw label) of one TSV row."""
        raise NotImplementedError

    tsv_header: ClassVar[bool] = True
    tsv_columns: ClassVar[int | None] = None
    tsv_min_columns: ClassVar[int | None] = None

    def label_value(self, raw: str, where: str) -> float | int:
        """A TSV label as the task's label index (or score), accepting the index or the name."""
        raw = raw.strip()
        if not self.labels:
            if not _NUMBER.fullmatch(raw) or not math.isfinite(float(raw)):
                raise DataError(f"{where}: score {raw!r} is not a finite number")
            low, high = self.score_range
            if not low <= float(raw) <= high:
                raise DataError(f"{where}: score {raw!r} lies outside the task's scale, {low:g} to {high:g}")
            return float(raw)
        if raw in self.labels:
            return self.labels.index(raw)
        if raw.isascii() and raw.isdigit() and int(raw) < len(self.labels):
            return int(raw)
        raise DataError(
            f"{where}: label {raw!r} is not one of {', '.join(self.labels)} (or their indices 0 to {len(self.labels) - 1})"
        )

    def _is_data(self, row: list[str]) -> bool:
        """Whether a TSV row is an example (its label field reads as a label), not the file's header."""
        try:
            self.label_value(self.parse_row(row)[2], "")
        except (DataError, IndexError, ValueError):
            return False
        return True

    def read_local(self, folder: Path, split: str) -> list[dict[str, Any]]:
        examples = []
        stems = self.groups if split == "dev" else {"": "train"}
        for group, stem in stems.items():
            path = folder / f"glue/{self.folder}/{stem}.tsv"
            rows = read_tsv_lines(
                path, self.tsv_columns, header=self.tsv_header, min_columns=self.tsv_min_columns, is_data=self._is_data
            )
            for lineno, row in rows:
                text, pair, raw = self.parse_row(row)
                label = self.label_value(raw, f"{path}, line {lineno}")
                examples.append({"text": text, "text_pair": pair, "label": label, "group": group})
        return examples

    def read_hub(self, split: str) -> list[dict[str, Any]]:
        import datasets

        examples = []
        for group in self.groups if split == "dev" else {"": "train"}:
            hub_split = "train" if split == "train" else ("validation" + (f"_{group}" if group else ""))
            for row in datasets.load_dataset("nyu-mll/glue", self.hub_config, split=hub_split):
                text = row[self.hub_fields[0]]
                pair = row[self.hub_fields[1]] if len(self.hub_fields) > 1 else None
                label = float(row["label"]) if not self.labels else int(row["label"])
                examples.append({"text": text, "text_pair": pair, "label": label, "group": group})
        return examples

    # ---------------------------------------------------------------------------------------- protocol
    def prepare(self, model: torch.nn.Module, mode: str) -> dict[str, Any]:
        if mode != FINE_TUNED:
            return {}
        config = model.config
        n = config.num_labels
        if not self.labels:
            if n != 1:
                raise ValueError(f"{self.name}: a regression task needs a checkpoint with one output, it has {n}")
            self._label_map = None
            return {"label_mapping": "regression output"}
        if n != len(self.labels):
            raise ValueError(
                f"{self.name}: the checkpoint has {n} labels ({list(config.id2label.values())}), the task has "
                f"{len(self.labels)} ({', '.join(self.labels)}); it was not fine-tuned for {self.name}"
            )
        names = [_label_name(config.id2label[i]) for i in range(n)]
        if sorted(names) == sorted(self.labels):
            self._label_map = [self.labels.index(name) for name in names]
            how = "by name from the checkpoint's id2label"
        elif all(_GENERIC_LABEL.fullmatch(name) for name in names):  # transformers' LABEL_0, ... or bare numbers
            self._label_map = list(range(n))
            how = f"by index in the hub's label order ({', '.join(self.labels)})"
        else:
            other = _task_with_labels(names, self.name)
            if other is not None:  # another task's classifier, which would be scored here without a word
                raise ValueError(
                    f"{self.name}: the checkpoint's labels ({', '.join(names)}) are those of {other}, not the "
                    f"task's ({', '.join(self.labels)}): it was fine-tuned for another task"
                )
            shared = sorted(set(names) & set(self.labels))
            if (
                shared
            ):  # some named as the task's, the others not: read by index, a named one could be scored as another
                raise ValueError(
                    f"{self.name}: the checkpoint's labels ({', '.join(names)}) name some of the task's "
                    f"({', '.join(shared)}) but not all ({', '.join(self.labels)}): name every one as the task does "
                    f"in config.id2label, or number them (LABEL_0, ...) in the task's order"
                )
            self._label_map = list(range(n))  # names of its own (neg/pos): read in the task's order, and said so
            how = (
                f"by index in the hub's label order ({', '.join(self.labels)}): the checkpoint names its labels "
                f"{', '.join(names)}, which are not the task's"
            )
            warnings.warn(
                f"{self.name}: labels matched {how}; check that it was fine-tuned for {self.name}", stacklevel=2
            )
        return {"label_mapping": how, "label_map": self._label_map}

    def features(self, examples, tokenizer, *, max_length, mode):
        feats = []
        for i, ex in enumerate(examples):
            sides = (
                [(ex["text"], None), (ex["text_pair"], None)] if mode == ZERO_SHOT else [(ex["text"], ex["text_pair"])]
            )
            for side, (text, pair) in enumerate(sides):
                enc = tokenizer(text, pair, truncation=True, max_length=max_length)
                if len(enc["input_ids"]) > max_length:  # the tokenizer cannot cut below its special tokens: it warns
                    _too_short(self.name, tokenizer, max_length, pair is not None)
                feats.append(Feature(i, enc["input_ids"], enc.get("token_type_ids"), {"side": side}))
        return feats

    def train_features(self, examples, tokenizer, *, max_length):
        feats = self.features(examples, tokenizer, max_length=max_length, mode=FINE_TUNED)
        for f in feats:
            f.extra["labels"] = {"labels": examples[f.example]["label"]}
        return feats

    def head_options(self) -> dict[str, Any]:
        """Keyword arguments for a fresh classification head: label count and names."""
        if not self.labels:
            return {"num_labels": 1, "problem_type": "regression"}
        return {
            "num_labels": len(self.labels),
            "id2label": dict(enumerate(self.labels)),
            "label2id": {name: i for i, name in enumerate(self.labels)},
        }

    def outputs(self, model_output, inputs, features, mode):
        if mode == ZERO_SHOT:
            pooled = mean_pool(model_output.last_hidden_state.float(), inputs["attention_mask"])
            return list(pooled.cpu())
        return list(model_output.logits.float().cpu())

    def predict(self, examples, features, outputs, mode):
        if mode == ZERO_SHOT:
            emb: dict[int, list] = {}
            for f, out in zip(features, outputs, strict=True):
                emb.setdefault(f.example, [None, None])[f.extra["side"]] = out
            return [float(F.cosine_similarity(emb[i][0], emb[i][1], dim=0)) for i in range(len(examples))]
        preds = [None] * len(examples)
        for f, out in zip(features, outputs, strict=True):
            preds[f.example] = float(out[0]) if not self.labels else self._label_map[int(out.argmax())]
        return preds

    def score(self, examples, predictions, mode):
        result = {}
        for group in self.groups:
            idx = [i for i, ex in enumerate(examples) if ex["group"] == group]
            if not idx:
                continue
            preds, gold = [predictions[i] for i in idx], [examples[i]["label"] for i in idx]
            for name, value in self.group_metrics(preds, gold).items():
                result[f"{name}_{group}" if group else name] = value
        return result

    def group_metrics(self, preds, gold) -> dict[str, float]:
        return {"accuracy": M.accuracy(preds, gold)}

    def group_metric_rows(self, preds: np.ndarray, gold: np.ndarray) -> dict[str, np.ndarray] | None:
        """:meth:`group_metrics` of every row of (B, n) arrays at once (None where it cannot be: labels other than 0
        and 1 for the confusion-count metrics)."""
        return {"accuracy": M.rows_accuracy(preds, gold)}

    def resample_scores(self, examples, predictions, mode, idx):
        if len(self.groups) != 1:
            return None  # MNLI: its accuracies go through example_values
        gold, preds = np.asarray([ex["label"] for ex in examples]), np.asarray(predictions)
        if gold.dtype == object or preds.dtype == object:
            return None
        return self.group_metric_rows(preds[idx], gold[idx])

    def example_values(self, examples, predictions, mode):
        if type(self).group_metrics is not GlueTask.group_metrics:
            return None  # Matthews, F1 and correlations are not means over examples
        values = {}
        for group in self.groups:  # each group's accuracy: the mean over its own examples (NaN elsewhere)
            values[f"accuracy_{group}" if group else "accuracy"] = [
                (100.0 * (p == ex["label"])) if ex["group"] == group else math.nan
                for p, ex in zip(predictions, examples, strict=True)
            ]
        return values

    def divergence(self, reference, output, mode):
        if mode == ZERO_SHOT or not self.labels:
            return None  # regression: compared through the predictions (fidelity below)
        return self.kl(reference, output)

    def fidelity(self, divergences, ref_predictions, predictions, mode):
        if self.labels and mode == FINE_TUNED:
            return super().fidelity(divergences, ref_predictions, predictions, mode)
        diff = [abs(a - b) for a, b in zip(ref_predictions, predictions, strict=True)]
        return {"mean_abs_difference": sum(diff) / len(diff), "max_abs_difference": max(diff)}

    def protocol(self, mode: str, max_length: int) -> str:
        if mode == ZERO_SHOT:
            return (
                f"zero-shot: each sentence encoded alone (max {max_length} tokens), hidden states mean-pooled "
                "over real tokens, prediction = cosine of the two embeddings"
            )
        pair = "pair" if len(self.hub_fields) > 1 else "single sentence"
        return (
            f"fine-tuned head: {pair} tokenised with special tokens, truncated to {max_length} tokens "
            f"(longest first); prediction = {'argmax of the logits' if self.labels else 'the regression output'}"
        )


@register_task
class CoLA(GlueTask):
    """CoLA: grammatical acceptability of a sentence; Matthews correlation."""

    name, folder, hub_config, hub_fields = "cola", "CoLA", "cola", ("sentence",)
    metrics = ("matthews_correlation",)
    labels = ("unacceptable", "acceptable")
    tsv_header, tsv_columns = False, 4

    def parse_row(self, row):
        return row[3], None, row[1]

    def group_metrics(self, preds, gold):
        return {"matthews_correlation": M.matthews(preds, gold)}

    def group_metric_rows(self, preds, gold):
        return {"matthews_correlation": M.rows_matthews(preds, gold)} if M._binary(preds, gold) else None


@register_task
class SST2(GlueTask):
    """SST-2: sentiment of a movie-review sentence; accuracy."""

    name, folder, hub_config, hub_fields = "sst2", "SST-2", "sst2", ("sentence",)
    metrics = ("accuracy",)
    labels = ("negative", "positive")
    tsv_columns = 2

    def parse_row(self, row):
        return row[0], None, row[1]


class _F1AndAccuracy(GlueTask):
    metrics = ("f1", "accuracy")
    primary = "accuracy"  # as the clustered-attention paper's GLUE table reports MRPC and QQP

    def group_metrics(self, preds, gold):
        return {"f1": M.binary_f1(preds, gold), "accuracy": M.accuracy(preds, gold)}

    def group_metric_rows(self, preds, gold):
        if not M._binary(preds, gold):
            return None
        return {"f1": M.rows_binary_f1(preds, gold), "accuracy": M.rows_accuracy(preds, gold)}


@register_task
class MRPC(_F1AndAccuracy):
    """MRPC: are two sentences paraphrases; F1 of the paraphrase class and accuracy."""

    name, folder, hub_config, hub_fields = "mrpc", "MRPC", "mrpc", ("sentence1", "sentence2")
    labels = ("not_equivalent", "equivalent")
    tsv_columns = 5

    def parse_row(self, row):
        return row[3], row[4], row[0]


@register_task
class QQP(_F1AndAccuracy):
    """QQP: are two Quora questions duplicates; F1 of the duplicate class and accuracy."""

    name, folder, hub_config, hub_fields = "qqp", "QQP", "qqp", ("question1", "question2")
    labels = ("not_duplicate", "duplicate")
    tsv_columns = 6

    def parse_row(self, row):
        return row[3], row[4], row[5]


@register_task
class STSB(GlueTask):
    """STS-B: semantic similarity of two sentences (0-5); Pearson and Spearman correlation."""

    name, folder, hub_config, hub_fields = "stsb", "STS-B", "stsb", ("sentence1", "sentence2")
    metrics = ("pearson", "spearman")
    modes: ClassVar[dict[str, str]] = {"sequence-classification": FINE_TUNED, "base": ZERO_SHOT}
    tsv_columns = 10
    score_range = (0.0, 5.0)

    def parse_row(self, row):
        return row[7], row[8], row[9]

    def group_metrics(self, preds, gold):
        return {"pearson": M.pearson(preds, gold), "spearman": M.spearman(preds, gold)}

    def group_metric_rows(self, preds, gold):
        preds, gold = preds.astype(np.float64), gold.astype(np.float64)
        return {"pearson": M.rows_pearson(preds, gold), "spearman": M.rows_spearman(preds, gold)}


@register_task
class MNLI(GlueTask):
    """MNLI: entailment / neutral / contradiction; accuracy on the matched and mismatched dev sets."""

    name, folder, hub_config, hub_fields = "mnli", "MNLI", "mnli", ("premise", "hypothesis")
    metrics = ("accuracy_matched", "accuracy_mismatched")
    labels = ("entailment", "neutral", "contradiction")
    groups: ClassVar[dict[str, str]] = {"matched": "dev_matched", "mismatched": "dev_mismatched"}
    tsv_min_columns = 12
    # 2 (2026-11-30): a limit takes the matched and mismatched sets round-robin (version 1 read the matched set first)
    version = 2

    def parse_row(self, row):
        return row[8], row[9], row[-1]


@register_task
class QNLI(GlueTask):
    """QNLI: does a sentence answer the question; accuracy."""

    name, folder, hub_config, hub_fields = "qnli", "QNLI", "qnli", ("question", "sentence")
    metrics = ("accuracy",)
    labels = ("entailment", "not_entailment")
    tsv_columns = 4

    def parse_row(self, row):
        return row[1], row[2], row[3]


@register_task
class RTE(GlueTask):
    """RTE: does the first sentence entail the second; accuracy."""

    name, folder, hub_config, hub_fields = "rte", "RTE", "rte", ("sentence1", "sentence2")
    metrics = ("accuracy",)
    labels = ("entailment", "not_entailment")
    tsv_columns = 4

    def parse_row(self, row):
        return row[1], row[2], row[3]

    def local_files(self, split):
        if split == "train":  # the Hugging Face export (labels 0 = entailment) stands in for train.tsv
            return [("glue/RTE/train.tsv", "glue/RTE/train-hf.parquet")]
        return super().local_files(split)

    def read_local(self, folder, split):
        parquet = folder / "glue/RTE/train-hf.parquet"
        if split == "train" and not (folder / "glue/RTE/train.tsv").is_file() and parquet.is_file():
            import pyarrow.parquet as pq

            table = pq.read_table(parquet).to_pylist()
            return [
                {"text": r["sentence1"], "text_pair": r["sentence2"], "label": int(r["label"]), "group": ""}
                for r in table
            ]
        return super().read_local(folder, split)


@register_task
class WNLI(GlueTask):
    """WNLI: Winograd pronoun resolution as entailment; accuracy."""

    name, folder, hub_config, hub_fields = "wnli", "WNLI", "wnli", ("sentence1", "sentence2")
    metrics = ("accuracy",)
    labels = ("not_entailment", "entailment")
    tsv_columns = 4

    def parse_row(self, row):
        return row[1], row[2], row[3]
