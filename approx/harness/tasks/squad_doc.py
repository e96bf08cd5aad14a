"""SQuAD v1.1 dev questions answered from a long window of their whole Wikipedia article; exact match and F1.

Two tasks on the same questions and the same article windows, so that their results pair up at every
``max_length``:

* ``squad-doc`` reads the question and an N-token window of the article in one pass (N = ``max_length``,
  default 4096: a long input for the attention under test).
* ``squad-doc-sliding`` reads the same window as ``squad`` reads a context (the baseline users have today):
  windows of :attr:`SquadDocSliding.read_length` = 384 tokens with a document stride of 128, best span over
  the windows. ``max_length`` is still the article window's length N.

Protocol (version 1):

* **Article.** A question's context is its article: the article's paragraphs (the distinct contexts of its
  questions, in the file's order; every paragraph of the dev file has questions) joined by a blank line
  (``"\\n\\n"``). Articles are built from all the split's questions before ``--limit`` or a cross-fitting half
  applies; ``--limit`` takes questions round-robin over the articles (each article's first question in file
  order, then each one's second, ...), so a subset spans as many articles as it can; halves (``dev/0``, ``dev/1``) split by article title exactly as ``squad``'s do. Answer offsets
  are shifted into the article; ``paragraph_start``/``paragraph_end`` give the gold paragraph's characters.
* **Window.** Each article is tokenised once, without special tokens. For a question of Q tokens, the
  window holds B = N − Q − S article tokens (S: the tokenizer's special tokens for a pair, 3 for BERT, 4
  for RoBERTa). With P the gold paragraph's length in tokens and u = the first 8 bytes of
  SHA-256(``"<WINDOW_SEED>:<question id>"``) read as a big-endian integer over 2^64 (uniform in [0, 1),
  fixed per question), the window starts round(u · max(0, B − P)) tokens before the paragraph's first token
  (Python's ``round``); so the paragraph's position in the window is spread uniformly by u, and when P > B
  the window starts at the paragraph. The start is then moved, as little as possible, to keep the window
  inside the article: at the article's first or last tokens the paragraph lies nearer the window's edge than
  u says, and an article of at most B tokens is read whole. Each feature's ``extra`` records ``window`` and
  ``gold`` (article token ranges) and ``gold_position``, the paragraph's actual place in the window:
  (first paragraph token − window start) / (window length − P), 0 when the paragraph fills the window.
* **Input.** ``[CLS] question [SEP] window [SEP]`` as the tokenizer wraps a pair (token types as it gives
  them); the sliding baseline cuts the window's tokens as the tokenizer's ``only_second`` overflow does
  (384-token inputs, consecutive ones sharing 128 window tokens). The window is at least 64 tokens: a
  shorter ``max_length`` for the longest question is refused.
* **Answer and metrics** as ``squad``: the 20 best starts and ends in each input, end >= start, at most 30
  tokens, the span of highest start + end logit over the question's inputs, cut from the article by the
  token offsets; official v1.1 normalisation, EM and F1 best over the gold answers. Fidelity: agreement on
  the predicted text; KL of the start and end distributions over each input's tokens.

Training (``squad-doc`` only): the same windows, labelled with the first gold answer's token span
(:meth:`SquadDoc.train_features`), to fine-tune a reader at N tokens on one cross-fitting half.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from .base import Feature, register_task
from .squad import MAX_ANSWER_TOKENS, N_BEST, Squad, doc_stride

WINDOW_SEED = 20_240_516
PARAGRAPH_SEPARATOR = "\n\n"
MIN_WINDOW = 64


def with_articles(examples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``examples`` (SQuAD questions) with their whole article as ``context`` and the gold paragraph's
    characters in it (``paragraph_start``, ``paragraph_end``); ``answer_start`` shifted accordingly."""
    paragraphs: dict[str, dict[str, int]] = {}  # title -> {paragraph: its first character in the article}
    for ex in examples:
        paragraphs.setdefault(ex["title"], {}).setdefault(ex["context"], 0)
    articles = {}
    for title, paras in paragraphs.items():
        at = 0
        for text in paras:
            paras[text], at = at, at + len(text) + len(PARAGRAPH_SEPARATOR)
        articles[title] = PARAGRAPH_SEPARATOR.join(paras)
    out = []
    for ex in examples:
        start = paragraphs[ex["title"]][ex["context"]]
        out.append(
            {
                **ex,
                "context": articles[ex["title"]],
                "paragraph_start": start,
                "paragraph_end": start + len(ex["context"]),
                "answer_start": ex["answer_start"] + start,
            }
        )
    return out


def gold_draw(question_id: str) -> float:
    """u in [0, 1) for one question: SHA-256 of ``"<WINDOW_SEED>:<id>"``, first 8 bytes over 2^64."""
    digest = hashlib.sha256(f"{WINDOW_SEED}:{question_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def place_window(n_tokens: int, gold: tuple[int, int], budget: int, u: float) -> tuple[int, int]:
    """Article tokens ``[start, stop)`` of the window: the gold paragraph ``gold`` (token range) begins
    round(u · max(0, budget − its length)) tokens into it, then the window is moved inside the article."""
    room = max(0, budget - (gold[1] - gold[0]))
    start = max(0, min(gold[0] - round(u * room), n_tokens - budget))
    return start, min(n_tokens, start + budget)


def gold_position(window: tuple[int, int], gold: tuple[int, int]) -> float:
    """Where the gold paragraph lies in the window: 0 at its start, 1 at its end (0 when it fills it)."""
    room = (window[1] - window[0]) - (gold[1] - gold[0])
    return (gold[0] - window[0]) / room if room > 0 else 0.0


class _Offsets(Sequence):
    """Character offsets into the article of a feature's tokens (None for the question and special tokens):
    a view of the article's offsets, so that thousands of long features share one list."""

    def __init__(self, article: list[tuple[int, int]], lo: int, hi: int, first: int, length: int) -> None:
        self.article, self.lo, self.hi, self.first, self.length = article, lo, hi, first, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.length))]
        if not -self.length <= i < self.length:
            raise IndexError(i)
        k = (i % self.length) - self.first
        return self.article[self.lo + k] if 0 <= k < self.hi - self.lo else None

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


class _Pair:
    """How a tokenizer wraps a (question, context) pair, read once from its encoding of a probe pair."""

    def __init__(self, tokenizer: Any) -> None:
        enc = tokenizer("question", "context")
        types = enc.get("token_type_ids")
        self.parts: list[tuple[int | None, int | None, int | None]] = []  # (special id | None, type, sequence)
        for i, (tok, seq) in enumerate(zip(enc["input_ids"], enc.sequence_ids(0), strict=True)):
            if seq is None or not self.parts or self.parts[-1][2] != seq:
                self.parts.append((tok if seq is None else None, types[i] if types else None, seq))
        self.specials = sum(seq is None for _, _, seq in self.parts)
        self.has_types = types is not None

    def feature(self, example: int, question: list[int], ids: list[int], offsets, lo: int, hi: int, extra) -> Feature:
        """The input reading ``question`` and article tokens ``[lo, hi)``."""
        input_ids: list[int] = []
        types: list[int] = []
        first = 0
        for tok, kind, seq in self.parts:
            if seq == 1:
                first = len(input_ids)
            part = [tok] if seq is None else question if seq == 0 else ids[lo:hi]
            input_ids += part
            types += [kind] * len(part)
        view = _Offsets(offsets, lo, hi, first, len(input_ids))
        return Feature(example, input_ids, types if self.has_types else None, {"offsets": view, **extra})


@register_task
class SquadDoc(Squad):
    """SQuAD v1.1 dev questions read with an N-token window of their whole article in one pass; EM and F1."""

    name = "squad-doc"
    version = 1
    default_max_length = 4096
    splits = ("dev",)
    read_length: ClassVar[int | None] = None  # None: the whole window in one input

    def read_local(self, folder, split):
        return with_articles(super().read_local(folder, split))

    def pick(self, examples, limit):
        """``limit`` questions taken round-robin over the articles (every article's first question in file order,
        then every article's second, ...), so that a subset reads as many articles, and as many article lengths, as
        it can; the chosen questions keep the file's order (:meth:`Task.load` reads them)."""
        return self.spread(examples, limit, "title")

    def read_hub(self, split):
        return with_articles(super().read_hub(split))

    def features(self, examples, tokenizer, *, max_length, mode):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"{self.name} needs a fast tokenizer (token offsets); this model's tokenizer is not one")
        pair = _Pair(tokenizer)
        questions = tokenizer([ex["question"].lstrip() for ex in examples], add_special_tokens=False)["input_ids"]
        longest = max(map(len, questions), default=0)
        if max_length < longest + pair.specials + MIN_WINDOW:
            raise ValueError(
                f"{self.name}: max_length must be at least {longest + pair.specials + MIN_WINDOW} tokens here (the "
                f"longest question, {longest} tokens, {pair.specials} special tokens and a window of {MIN_WINDOW} "
                f"article tokens), got {max_length}"
            )
        if self.read_length is not None and self.read_length - longest - pair.specials <= doc_stride(self.read_length):
            raise ValueError(
                f"{self.name}: a question of {longest} tokens leaves no room for {self.read_length}-token reads"
            )
        texts = list(dict.fromkeys(ex["context"] for ex in examples))  # each article tokenised once
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        articles = {}
        for text, ids, offsets in zip(texts, enc["input_ids"], enc["offset_mapping"], strict=True):
            offsets = [tuple(o) for o in offsets]
            articles[text] = ids, offsets, [o[0] for o in offsets]
        feats = []
        for i, (ex, question) in enumerate(zip(examples, questions, strict=True)):
            ids, offsets, starts = articles[ex["context"]]
            gold = bisect_left(starts, ex["paragraph_start"]), bisect_left(starts, ex["paragraph_end"])
            budget = max_length - len(question) - pair.specials
            window = place_window(len(ids), gold, budget, gold_draw(ex["id"]))
            extra = {"window": window, "gold": gold, "gold_position": gold_position(window, gold)}
            feats += [
                pair.feature(i, question, ids, offsets, lo, hi, extra) for lo, hi in self.reads(window, question, pair)
            ]
        return feats

    def reads(self, window: tuple[int, int], question: list[int], pair: _Pair) -> list[tuple[int, int]]:
        """The article token ranges read, one input each: the whole window."""
        return [window]

    def train_features(self, examples, tokenizer, *, max_length):
        """The evaluation inputs (one N-token window per question, placed by the same seeded rule), each labelled
        with the token span of the first gold answer, or ``[CLS]`` when the window cuts it off (as ``squad``):
        a reader fine-tuned on ``squad`` at 384 tokens learns here to read N tokens in one pass, as Longformer's
        readers were fine-tuned at their full length. Train on one cross-fitting half (``dev/0``) and evaluate
        on the other: the halves split by article, so no window read in evaluation was seen in training."""
        if self.read_length is not None:
            raise ValueError(
                f"{self.name} cannot be fine-tuned: its {self.read_length}-token reads of a long window mostly hold "
                f"no answer; fine-tune 'squad' (384-token windows of the paragraph) or 'squad-doc' (the window in "
                f"one pass)"
            )
        return super().train_features(examples, tokenizer, max_length=max_length)

    def train_protocol(self, max_length):
        return (
            f"{self._window_rule(max_length)}; read in one pass; labels: the first gold answer's token span "
            f"([CLS] when the window cuts it off)"
        )

    def compact(self, output, feature, mode):
        """The 20 best start and end logits and their positions: all the span rule reads of a long input."""
        top = output.topk(min(N_BEST, output.shape[-1]), dim=-1)
        return top.values, top.indices, output.shape[-1]

    def predict(self, examples, features, outputs, mode):
        dense = [
            out if isinstance(out, torch.Tensor) else torch.full((2, out[2]), -torch.inf).scatter_(1, out[1], out[0])
            for out in outputs
        ]
        return super().predict(examples, features, dense, mode)

    def _window_rule(self, max_length: int) -> str:
        return (
            f"question + a {max_length}-token window of the whole article (paragraphs joined by a blank line): "
            f"B = {max_length} - question - special tokens; the gold paragraph (P tokens) starts round(u*max(0, "
            f"B-P)) tokens into the window, u = SHA-256('{WINDOW_SEED}:<question id>')[:8] / 2^64, window then "
            f"moved inside the article"
        )

    def protocol(self, mode, max_length):
        return (
            f"{self._window_rule(max_length)}; read in one pass; best span (start + end logit, top {N_BEST} each, "
            f"at most {MAX_ANSWER_TOKENS} tokens); official v1.1 EM/F1"
        )


@register_task
class SquadDocSliding(SquadDoc):
    """squad-doc's questions and article windows read as squad reads a context: 384-token windows, stride 128."""

    name = "squad-doc-sliding"
    read_length = 384

    def reads(self, window, question, pair):
        """Article token ranges of ``read_length``-token inputs over the window, cut as the tokenizer's
        ``only_second`` overflow cuts a context: each next one starts ``doc_stride`` tokens before the end of
        the previous one, the last one ends at the window's end."""
        budget = self.read_length - len(question) - pair.specials
        ranges = []
        for lo in range(window[0], window[1], budget - doc_stride(self.read_length)):
            ranges.append((lo, min(lo + budget, window[1])))
            if ranges[-1][1] == window[1]:
                break
        return ranges

    def protocol(self, mode, max_length):
        return (
            f"{self._window_rule(max_length)}; read as {self.read_length}-token windows with document stride "
            f"{doc_stride(self.read_length)}; best span (start + end logit, top {N_BEST} each, at most "
            f"{MAX_ANSWER_TOKENS} tokens) over all windows; official v1.1 EM/F1"
        )
