"""SQuAD v1.1 (Rajpurkar et al. 2016): extractive question answering; exact match and F1.

Protocol (version 1): question and context are tokenised as a pair with the model's fast tokenizer, the
context truncated (``only_second``) to windows of at most ``max_length`` tokens (default 384) that overlap
by a document stride of 128 tokens (a third of the window when it is shorter than 384), as in transformers'
``run_qa`` example. For every window the 20 best
start and end positions are taken over its tokens, padding left out, and those outside the context dropped, as
``run_qa`` does (so question and special tokens can crowd context tokens out of the lists; padding cannot); the
remaining starts and ends are combined (end >= start, at most 30 tokens); the answer is
the span of highest start + end logit over all windows of the question, cut from the context by the token
offsets. Exact match and F1 use the official v1.1 normalisation and take the best over the gold answers.
Fidelity: agreement is the share of questions with the same predicted text; the KL divergence is the mean
of the start and end distributions' KL over each window's tokens.
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
from pathlib import Path
from typing import Any, ClassVar

import torch

from .. import metrics as M
from ..data import DataError, line_of, read_text
from .base import Feature, Task, register_task

DOC_STRIDE = 128
N_BEST = 20
MAX_ANSWER_TOKENS = 30


class _Bad(Exception):
    """A structural error at ``where`` (the keys and indices from the top of the JSON document)."""

    def __init__(self, where: tuple, message: str) -> None:
        super().__init__(message)
        self.where, self.message = where, message


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def _need(value: Any, kind: type | tuple[type, ...], where: tuple, what: str, context: str = "") -> Any:
    if isinstance(value, bool) or not isinstance(value, kind):  # JSON true/false are not numbers
        names = {dict: "an object", list: "a list", str: "a string", int: "an integer"}
        want = " or ".join(names[k] for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise _Bad(where, f"{context}{what} must be {want}, found {_kind(value)}")
    return value


def _field(obj: dict, key: str, kind, where: tuple, context: str) -> Any:
    if key not in obj:
        raise _Bad(where, f"{context}missing field {key!r}")
    return _need(obj[key], kind, (*where, key), repr(key), context)


def _squad_examples(data: Any) -> list[dict[str, Any]]:
    """The questions of a parsed SQuAD v1.1 document; :class:`_Bad` at the first thing that is not as it must be."""
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise _Bad((), "expected a SQuAD file: an object with a top-level 'data' list")
    examples = []
    for a, article in enumerate(data["data"]):
        w = ("data", a)
        _need(article, dict, w, f"article {a}")
        title = _need(article.get("title", f"article {a}"), str, (*w, "title"), f"article {a}: 'title'")
        for p, para in enumerate(_need(article.get("paragraphs", []), list, (*w, "paragraphs"), "'paragraphs'")):
            wp = (*w, "paragraphs", p)
            where = f"article {a} ({title!r}), paragraph {p}: "
            _need(para, dict, wp, "the paragraph", where)
            context = _field(para, "context", str, wp, where)
            for q, qa in enumerate(_field(para, "qas", list, wp, where)):
                wq, at = (*wp, "qas", q), f"{where[:-2]}, question {q}: "
                _need(qa, dict, wq, "the question", at)
                qid = _field(qa, "id", (str, int), wq, at)
                question = _field(qa, "question", str, wq, at)
                answers = _field(qa, "answers", list, wq, at)
                if not answers:
                    raise _Bad((*wq, "answers"), f"{at}'answers' is empty")
                for n, ans in enumerate(answers):
                    wa = (*wq, "answers", n)
                    _need(ans, dict, wa, f"answer {n}", at)
                    _field(ans, "text", str, wa, f"{at}answer {n}: ")
                    if _field(ans, "answer_start", int, wa, f"{at}answer {n}: ") < 0:
                        raise _Bad((*wa, "answer_start"), f"{at}answer {n}: 'answer_start' is negative")
                examples.append(
                    {
                        "id": str(qid),
                        "question": question,
                        "context": context,
                        "answers": [ans["text"] for ans in answers],
                        "answer_start": answers[0]["answer_start"],
                        "title": title,
                    }
                )
    return examples


def _tracked(text: str) -> Any:
    """``text`` parsed with the position of every value: objects and lists come back as subclasses whose
    ``at`` maps each key (index) to the character where its value starts. Pure Python (slow): only used to
    find the line of an error."""

    class Obj(dict):
        at: dict

    class Arr(list):
        at: list

    decoder = json.JSONDecoder()

    def recording(scan_once, starts):
        def scan(s, i):
            starts.append(i)
            return scan_once(s, i)

        return scan

    def parse_object(s_and_end, strict, scan_once, *rest):
        starts: list[int] = []
        pairs, end = json.decoder.JSONObject(s_and_end, strict, recording(scan_once, starts), None, list, *rest[2:])
        obj = Obj(pairs)
        obj.at = {k: i for (k, _), i in zip(pairs, starts, strict=True)}
        return obj, end

    def parse_array(s_and_end, scan_once, *rest):
        starts: list[int] = []
        values, end = json.decoder.JSONArray(s_and_end, recording(scan_once, starts), *rest)
        arr = Arr(values)
        arr.at = starts
        return arr, end

    decoder.parse_object, decoder.parse_array = parse_object, parse_array
    decoder.scan_once = json.scanner.py_make_scanner(decoder)
    return decoder.decode(text)


def _locate(text: str, where: tuple) -> int:
    """The line of the value at ``where`` (the innermost one that can be found)."""
    index = len(text) - len(text.lstrip())
    try:
        node = _tracked(text)
        for key in where:
            index, node = node.at[key], node[key]
    except (AttributeError, KeyError, IndexError, RecursionError, ValueError):
        pass
    return line_of(text, index)


def read_squad_json(path: Path) -> list[dict[str, Any]]:
    """Questions of a SQuAD v1.1 JSON file; malformed files raise :class:`DataError` naming file and line."""
    text = read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}, line {e.lineno}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise DataError(f"{path}: not valid JSON (nested too deeply)") from None
    try:
        examples = _squad_examples(data)
    except _Bad as bad:
        raise DataError(f"{path}, line {_locate(text, bad.where)}: {bad.message}") from None
    if not examples:
        raise DataError(f"{path}: no questions")
    return examples


def doc_stride(max_length: int) -> int:
    """Overlap of consecutive windows: 128 tokens (a third of a window for max lengths below 384)."""
    return min(DOC_STRIDE, max_length // 3)


def _check_room(examples, tokenizer, max_length: int) -> None:
    """Refuse a ``max_length`` that leaves a question whose input must be cut into windows no more context than their
    overlap (the tokenizer would panic, an error no ``except Exception`` catches), naming the length that is enough."""
    if not examples:
        return
    specials = tokenizer.num_special_tokens_to_add(pair=True)
    questions = tokenizer([ex["question"].lstrip() for ex in examples], add_special_tokens=False)["input_ids"]
    tight = [i for i, q in enumerate(questions) if max_length - len(q) - specials <= doc_stride(max_length)]
    if not tight:
        return
    contexts = tokenizer([examples[i]["context"] for i in tight], add_special_tokens=False)["input_ids"]
    cut = [i for i, c in zip(tight, contexts, strict=True) if len(questions[i]) + len(c) + specials > max_length]
    if not cut:  # each fits in one window: nothing to cut, nothing to overlap
        return
    longest = max(cut, key=lambda i: len(questions[i]))
    q = len(questions[longest])
    # the least length whose room exceeds its stride (the stride grows with the length up to DOC_STRIDE)
    need = next(n for n in range(max_length + 1, 10**6) if n - q - specials > doc_stride(n))
    raise ValueError(
        f"squad: max_length {max_length} leaves question {examples[longest].get('id', longest)!r} ({q} tokens) "
        f"{max_length - q - specials} tokens of context per window, not more than the {doc_stride(max_length)} that "
        f"consecutive windows share; use max_length {need} or more, or fewer examples (--limit)"
    )


@register_task
class Squad(Task):
    """SQuAD v1.1: extractive question answering; exact match and F1 (official normalisation)."""

    name = "squad"
    version = 1
    metrics = ("exact_match", "f1")
    primary = "f1"
    default_max_length = 384
    modes: ClassVar[dict[str, str]] = {"question-answering": "fine-tuned"}
    splits = ("dev", "train")

    def local_files(self, split):
        return ["squad/dev-v1.1.json" if split == "dev" else "squad/train-v1.1.json"]

    def read_local(self, folder, split):
        return read_squad_json(folder / self.local_files(split)[0])

    def read_hub(self, split):
        import datasets

        rows = datasets.load_dataset("rajpurkar/squad", split="validation" if split == "dev" else "train")
        return [
            {
                "id": r["id"],
                "question": r["question"],
                "context": r["context"],
                "answers": list(r["answers"]["text"]),
                "answer_start": int(r["answers"]["answer_start"][0]),
                "title": r["title"],
            }
            for r in rows
        ]

    def features(self, examples, tokenizer, *, max_length, mode):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("squad needs a fast tokenizer (token offsets); this model's tokenizer is not one")
        if max_length < 32:
            raise ValueError(f"squad: max_length must be at least 32 tokens, got {max_length}")
        _check_room(examples, tokenizer, max_length)
        feats = []
        chunk = 256
        for start in range(0, len(examples), chunk):
            part = examples[start : start + chunk]
            enc = tokenizer(
                [ex["question"].lstrip() for ex in part],
                [ex["context"] for ex in part],
                truncation="only_second",
                max_length=max_length,
                stride=doc_stride(max_length),
                return_overflowing_tokens=True,
                return_offsets_mapping=True,
            )
            for j, sample in enumerate(enc["overflow_to_sample_mapping"]):
                seq = enc.sequence_ids(j)
                offsets = [tuple(o) if s == 1 else None for o, s in zip(enc["offset_mapping"][j], seq, strict=True)]
                types = enc["token_type_ids"][j] if "token_type_ids" in enc else None
                feats.append(Feature(start + sample, enc["input_ids"][j], types, {"offsets": offsets}))
        return feats

    def train_features(self, examples, tokenizer, *, max_length):
        """Windows as in evaluation, each labelled with the token span of the first gold answer, or with the
        first token (``[CLS]``) when the answer is not inside the window (as in transformers' ``run_qa``)."""
        feats = self.features(examples, tokenizer, max_length=max_length, mode="fine-tuned")
        for f in feats:
            ex = examples[f.example]
            start_char = ex.get("answer_start")
            if start_char is None:
                raise ValueError(f"squad example {ex.get('id')!r} has no answer_start: it cannot be used for training")
            end_char = start_char + len(ex["answers"][0])
            offsets = f.extra["offsets"]
            inside = [i for i, o in enumerate(offsets) if o is not None]
            start = end = 0
            if inside and offsets[inside[0]][0] <= start_char and offsets[inside[-1]][1] >= end_char:
                start = next(i for i in inside if offsets[i][1] > start_char)
                end = next(i for i in reversed(inside) if offsets[i][0] < end_char)
            f.extra["labels"] = {"start_positions": start, "end_positions": end}
        return feats

    def head_options(self) -> dict[str, Any]:
        # a span head: start and end. Said, as the config's num_labels would otherwise size a fresh head (a
        # 3-label classification checkpoint's gave 3 outputs, and training failed on unpacking them)
        return {"num_labels": 2}

    def outputs(self, model_output, inputs, features, mode):
        start, end = model_output.start_logits.float().cpu(), model_output.end_logits.float().cpu()
        return [torch.stack([start[i, : len(f.input_ids)], end[i, : len(f.input_ids)]]) for i, f in enumerate(features)]

    def predict(self, examples, features, outputs, mode):
        best: list[tuple[float, str]] = [(-float("inf"), "")] * len(examples)
        for f, out in zip(features, outputs, strict=True):
            offsets = f.extra["offsets"]
            start_logits, end_logits = out[0], out[1]
            context = examples[f.example]["context"]
            starts = start_logits.topk(min(N_BEST, len(offsets))).indices.tolist()
            ends = end_logits.topk(min(N_BEST, len(offsets))).indices.tolist()
            for s in starts:
                for e in ends:
                    if offsets[s] is None or offsets[e] is None or e < s or e - s + 1 > MAX_ANSWER_TOKENS:
                        continue
                    score = float(start_logits[s] + end_logits[e])
                    if score > best[f.example][0]:
                        best[f.example] = (score, context[offsets[s][0] : offsets[e][1]])
        return [text for _, text in best]

    def score(self, examples, predictions, mode):
        answers = [ex["answers"] for ex in examples]
        return {"exact_match": M.squad_exact_match(predictions, answers), "f1": M.squad_f1(predictions, answers)}

    def example_values(self, examples, predictions, mode):
        pairs = list(zip(predictions, (ex["answers"] for ex in examples), strict=True))  # each question scored alone
        return {
            "exact_match": [M.squad_exact_match([p], [a]) for p, a in pairs],
            "f1": [M.squad_f1([p], [a]) for p, a in pairs],
        }

    def resampling_unit(self, mode):
        return "question (its windows together)"

    def protocol(self, mode, max_length):
        return (
            f"question + context windows of {max_length} tokens, document stride {doc_stride(max_length)}; best span (start + end "
            f"logit, top {N_BEST} each, at most {MAX_ANSWER_TOKENS} tokens) over all windows; official v1.1 EM/F1"
        )
