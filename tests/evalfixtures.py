"""Synthetic evaluation data in the GLUE / SQuAD / WikiText layouts, and tiny checkpoints with a matching
word-level tokenizer, for end-to-end tests of the harness. Everything is generated here from a fixed
seed (no real data is copied)."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "the a cat dog bird man woman child house tree river city car road book song game film story day night "
    "red blue green small big old new happy sad quick slow runs sits sees finds likes reads sings plays "
    "walks opens near under over with and but not very good bad"
).split()
PUNCT = list(".,?!'\"-=:;()")
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def sentence(rng: random.Random, lo: int = 4, hi: int = 14) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) + " ."


def vocab() -> dict[str, int]:
    return {w: i for i, w in enumerate(SPECIAL + WORDS + PUNCT)}


def _tsv(path: Path, rows: list[list[str]], header: list[str] | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = (["\t".join(header)] if header else []) + ["\t".join(map(str, r)) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_data(root: Path, n: int = 12, seed: int = 0) -> Path:
    """A data folder with every GLUE task's dev file (train too for a few), SQuAD and WikiText-2."""
    rng = random.Random(seed)
    s = lambda: sentence(rng)  # noqa: E731
    g = root / "glue"
    _tsv(g / "CoLA/dev.tsv", [["src", i % 2, "", s()] for i in range(n)], None)
    _tsv(g / "CoLA/train.tsv", [["src", i % 2, "", s()] for i in range(n)], None)
    _tsv(g / "SST-2/dev.tsv", [[s(), i % 2] for i in range(n)], ["sentence", "label"])
    for split in ("dev", "train"):
        _tsv(
            g / f"MRPC/{split}.tsv",
            [[i % 2, i, i + 1, s(), s()] for i in range(n)],
            ["\ufeffQuality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
        )
    _tsv(
        g / "QQP/dev.tsv",
        [[i, i, i + 1, s(), s(), i % 2] for i in range(n)],
        ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
    )
    _tsv(
        g / "STS-B/dev.tsv",
        [[i, "g", "f", "y", i, "n", "n", s(), s(), f"{rng.uniform(0, 5):.3f}"] for i in range(n)],
        ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2", "score"],
    )
    labels3 = ["entailment", "neutral", "contradiction"]
    mnli_head = [
        "index",
        "promptID",
        "pairID",
        "genre",
        "s1b",
        "s2b",
        "s1p",
        "s2p",
        "sentence1",
        "sentence2",
        "label1",
        "gold_label",
    ]
    for stem in ("dev_matched", "dev_mismatched"):
        _tsv(
            g / f"MNLI/{stem}.tsv",
            [[i, 0, 0, "g", "", "", "", "", s(), s(), labels3[i % 3], labels3[i % 3]] for i in range(n)],
            mnli_head,
        )
    for task, labels in (
        ("QNLI", ["entailment", "not_entailment"]),
        ("RTE", ["entailment", "not_entailment"]),
        ("WNLI", ["0", "1"]),
    ):
        _tsv(
            g / f"{task}/dev.tsv",
            [[i, s(), s(), labels[i % 2]] for i in range(n)],
            ["index", "sentence1", "sentence2", "label"],
        )
    # SQuAD: contexts long enough to need several windows at a small max length
    articles = []
    for a in range(2):
        paragraphs = []
        for _ in range(2):
            words = [rng.choice(WORDS) for _ in range(60)]
            context = " ".join(words) + " ."
            qas = []
            for q in range(3):
                start = rng.randint(0, 50)
                answer = " ".join(words[start : start + rng.randint(1, 4)])
                char = len(" ".join(words[:start])) + (1 if start else 0)
                qas.append(
                    {
                        "id": f"{a}-{len(paragraphs)}-{q}",
                        "question": sentence(rng, 3, 6).replace(" .", " ?"),
                        "answers": [{"text": answer, "answer_start": char}],
                    }
                )
            paragraphs.append({"context": context, "qas": qas})
        articles.append({"title": f"Article_{a}", "paragraphs": paragraphs})
    (root / "squad").mkdir(parents=True, exist_ok=True)
    (root / "squad/dev-v1.1.json").write_text(json.dumps({"version": "1.1", "data": articles}))
    lines = []
    for h in range(6):
        lines += ["", f" = Heading {h} = ", ""] + [
            " " + " ".join(sentence(rng, 8, 20) for _ in range(4)) for _ in range(3)
        ]
    (root / "wikitext-2").mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + "\n"
    for split in ("test", "valid"):
        (root / f"wikitext-2/wiki.{split}.tokens").write_text(text, encoding="utf-8")
    return root


def write_checkpoint(path: Path, head: str, *, num_labels: int = 2, family: str = "bert", seed: int = 0) -> Path:
    """A tiny model of ``family`` with ``head`` and a word-level BERT tokenizer over the fixture words."""
    from conftest import tiny_model
    from transformers import BertTokenizer

    v = vocab()
    extra = {"num_labels": num_labels} if head == "sequence-classification" else {}
    model = tiny_model(family, head, seed=seed, vocab_size=len(v), max_position_embeddings=512, **extra)
    model.save_pretrained(path)
    BertTokenizer(vocab=v).save_pretrained(path)
    return path
