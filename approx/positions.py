"""Position extension: let an encoder with learned absolute positions read longer inputs.

Beltagy, Peters and Cohan, "Longformer: The Long-Document Transformer" (2020), section 5: a pretrained
model's position embeddings are copied block after block into a larger table, so that every new position
starts from a trained row instead of a random one. For BERT-like tables (no offset) rows 0..L-1 are tiled;
for RoBERTa-like tables (XLM-R, CamemBERT), whose positions start at ``padding_idx + 1``, the offset rows
0..padding_idx stay in place and only the trained rows after them are tiled.

This is transformers glue (it reads the model's embeddings module and its config), kept apart from
:mod:`approx.integration`; it imports nothing from transformers itself.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .config import as_integer

__all__ = ["extend_positions", "extended_positions", "position_limit", "trained_positions"]

log = logging.getLogger(__name__)
_ABSENT = object()


def _embeddings(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(qualified name, module) of the model's embeddings module holding a ``position_embeddings`` table."""
    found = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(getattr(m, "position_embeddings", None), nn.Embedding)
    ]
    return found[0] if len(found) == 1 else None


def _offset(table: nn.Embedding) -> int:
    """Rows before the first real position: ``padding_idx + 1`` for RoBERTa-like tables, else 0."""
    return 0 if table.padding_idx is None else table.padding_idx + 1


def position_limit(model: nn.Module) -> int | None:
    """The number of tokens the model's learned position table covers (512 for BERT and RoBERTa), or None
    when no single learned absolute position table is found."""
    found = _embeddings(model)
    if found is None:
        return None
    table = found[1].position_embeddings
    return table.num_embeddings - _offset(table)


def limit_for(model: nn.Module, length: int, tokenizer: Any = None) -> int | None:
    """:func:`position_limit`, after refusing a model without a learned position table (rotary positions, fixed
    sinusoids: nothing to extend) asked to read more than its ``config.max_position_embeddings``, with
    :func:`extend_positions`'s list of what was found; positions that are relative only (DeBERTa-v3) read any length
    and are let through. The check every entry point that reads long inputs makes."""
    limit = position_limit(model)
    config = getattr(model, "config", None)
    if limit is None and not _relative_only(model):  # (relative positions alone read any length: DeBERTa-v3)
        configured = getattr(config, "max_position_embeddings", None)
        if isinstance(configured, int) and length > configured:
            extend_positions(model, length, tokenizer=tokenizer)  # raises, listing what was found
    return limit


def _relative_only(model: nn.Module) -> bool:
    """Positions that are relative only (DeBERTa's ``relative_attention`` without an absolute table): no length
    limit to extend or to refuse."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "relative_attention", False)) and _embeddings(model) is None


def _length(max_length: Any) -> Any:
    """``max_length`` as an ``int`` when it is an integer scalar (NumPy, 0-d torch), else as given (refused later)."""
    value = as_integer(max_length)
    return max_length if value is None else value


def _problems(model: nn.Module, max_length: Any, tokenizer: Any) -> tuple[list[str], list[str]]:
    """(problems, what was found): everything that stops the extension, checked before any change."""
    config = getattr(model, "config", None)
    found: list[str] = [f"model type {getattr(config, 'model_type', None)!r}"]
    problems: list[str] = []
    if isinstance(max_length, bool) or not isinstance(max_length, int):
        problems.append(f"max_length must be an int, got {type(max_length).__name__} {max_length!r}")
    if config is None:
        problems.append("the model has no `config`")
    else:
        kind = getattr(config, "position_embedding_type", None)
        found.append(f"config.position_embedding_type = {kind!r}")
        if kind not in (None, "absolute"):
            problems.append(f"positions are {kind!r}, not learned absolute positions ('absolute')")
        if getattr(config, "sinusoidal_pos_embds", False):
            problems.append("positions are fixed sinusoids (config.sinusoidal_pos_embds), not learned")
        found.append(f"config.max_position_embeddings = {getattr(config, 'max_position_embeddings', None)!r}")
        if not isinstance(getattr(config, "max_position_embeddings", None), int):
            problems.append("the config has no integer `max_position_embeddings`")
    tables = [n for n, m in model.named_modules() if isinstance(getattr(m, "position_embeddings", None), nn.Embedding)]
    rotary = sorted({type(m).__name__ for m in model.modules() if "rotary" in type(m).__name__.lower()})
    if rotary and not tables:  # RoPE (ESM-2, EuroBERT, NomicBERT, Jina v3): positions rotate q and k, no table to grow
        found.append(f"rotary position modules: {rotary}")
        problems.append(
            "positions are rotary (RoPE): there is no table to extend; the model reads inputs up to "
            f"config.max_position_embeddings ({getattr(config, 'max_position_embeddings', None)!r}) as it is"
        )
        return problems, found
    if not tables and getattr(config, "relative_attention", False):  # DeBERTa-v3: relative positions only
        problems.append(
            "positions are relative only (config.relative_attention, no position table): the model reads any length "
            "as it is; there is nothing to extend"
        )
        return problems, found
    if len(tables) != 1:
        found.append(f"position tables: {[f'{n}.position_embeddings' for n in tables]}")
        problems.append(
            f"expected one learned position table (an nn.Embedding `position_embeddings`), found {len(tables)}"
        )
        return problems, found
    name, emb = _embeddings(model)
    table = emb.position_embeddings
    offset = _offset(table)
    limit = table.num_embeddings - offset
    found.append(
        f"table {name}.position_embeddings: {table.num_embeddings} rows, offset {offset} (padding_idx "
        f"{table.padding_idx}), so {limit} tokens"
    )
    if getattr(config, "relative_attention", False):  # DeBERTa: relative buckets sized by the same number
        problems.append(
            "the model also has relative attention (config.relative_attention), whose relative-position "
            "embeddings are sized by config.max_position_embeddings: the saved model would not load again"
        )
    if config is not None and getattr(config, "max_position_embeddings", None) != table.num_embeddings:
        problems.append(
            f"the table has {table.num_embeddings} rows but config.max_position_embeddings is "
            f"{getattr(config, 'max_position_embeddings', None)!r}"
        )
    if limit < 1:
        problems.append(f"the table has no trained position rows after its offset of {offset}")
    for buf in ("position_ids", "token_type_ids"):
        b = getattr(emb, buf, None)
        if isinstance(b, torch.Tensor) and (b.dim() != 2 or b.shape[-1] != table.num_embeddings):
            problems.append(f"buffer {name}.{buf} has shape {tuple(b.shape)}, not (1, {table.num_embeddings})")
    if isinstance(max_length, int) and not isinstance(max_length, bool) and max_length <= limit:
        problems.append(f"max_length {max_length} is not larger than the current limit of {limit} tokens")
    if tokenizer is not None and not hasattr(tokenizer, "model_max_length"):
        problems.append(f"the tokenizer ({type(tokenizer).__name__}) has no `model_max_length`")
    return problems, found


# the config attribute recording how many position rows a model was pretrained with, written at its first extension
# (and saved with its config): a later extension copies those rows again, not the table the first one made
TRAINED_POSITIONS = "approx_trained_positions"


def _tiled(weight: torch.Tensor, offset: int, max_length: int, period: int) -> torch.Tensor:
    """(offset + max_length, D): the rows the table has, then for each new position p the trained row
    offset + p % period (the first extension: every position's row is its trained row, block after block)."""
    have = weight.shape[0] - offset
    new = offset + torch.arange(have, max_length, device=weight.device) % period
    return torch.cat([weight, weight[new]])


def _period(config: Any, rows: torch.Tensor) -> int:
    """The trained rows a new position copies, of the (L, D) table ``rows`` (after its offset rows): the count
    :data:`TRAINED_POSITIONS` recorded at the first extension; without one (a model never extended, or extended before
    the count was recorded) the table's own period (:func:`_table_period`). A recorded value that is not a count of
    rows the table has (edited by hand) is ignored, with a warning."""
    limit, recorded = rows.shape[0], getattr(config, TRAINED_POSITIONS, None)
    if recorded is not None:
        period = as_integer(recorded)
        if period is not None and 1 <= period <= limit:
            return period
        warnings.warn(
            f"approx: config.{TRAINED_POSITIONS} = {recorded!r} is not a number of rows the position table has "
            f"({limit}): ignored; the table's own period is taken as its trained rows",
            stacklevel=3,
        )
    return _table_period(rows)


# rows a period must be seen to repeat: fewer could be rows that happen to be equal at both ends (zeroed ones)
_MIN_REPEAT = 8


def _table_period(rows: torch.Tensor) -> int:
    """The smallest p such that row i + p equals row i for every i, over at least :data:`_MIN_REPEAT` rows (a table
    extended by older code repeats its trained rows exactly, block after block; a pretrained or fine-tuned table has
    no such p below its length); the length for a table without values (meta tensors: a model built to be loaded)."""
    length = rows.shape[0]
    if rows.is_meta or length <= _MIN_REPEAT:
        return length
    for p in (rows == rows[0]).all(-1).nonzero()[:, 0].tolist():  # (rows equal to the first: few)
        if 0 < p <= length - _MIN_REPEAT and torch.equal(rows[p:], rows[: length - p]):
            return p
    return length


def trained_positions(model: nn.Module) -> int | None:
    """How many trained position rows :func:`extend_positions` copies block after block for a new position: the count
    recorded at the model's first extension, else its table's period (its length for a table never extended). None
    for a model without one learned absolute position table."""
    found = _embeddings(model)
    if found is None:
        return None
    table = found[1].position_embeddings
    return _period(getattr(model, "config", None), table.weight.detach()[_offset(table) :])


def extend_positions(model: nn.Module, max_length: int, *, tokenizer: Any = None) -> nn.Module:
    """Make ``model`` accept inputs of ``max_length`` tokens by copying its trained position embeddings block
    after block into a larger table (Longformer's initialisation); returns the same model, changed in place.

    Works for learned absolute positions (BERT, RoBERTa, XLM-R, CamemBERT, DistilBERT, ELECTRA, ALBERT), before
    or after :func:`approx.patch`. The number of rows the model was pretrained with is recorded in its config
    (``approx_trained_positions``, saved with it) at the first extension: extending again keeps the rows the table
    has and gives each new position p the trained row p mod that number, so extending to 1300 and then to 2000 gives
    the model that extending to 2000 at once gives (rows trained since, by fine-tuning, are kept). A model extended
    before the count was recorded is recognised by its table, whose rows repeat with the trained count's period.
    For RoBERTa-like tables the offset rows (``padding_idx + 1`` of them) stay in place and the table grows to
    ``max_length + offset`` rows. The first positions keep their rows
    bit-for-bit, so inputs within the old limit give exactly the old outputs. ``config.max_position_embeddings``,
    the embeddings' ``position_ids`` and ``token_type_ids`` buffers and ``tokenizer.model_max_length`` (when a
    tokenizer is given) follow, so ``save_pretrained`` and a plain ``from_pretrained`` keep the new length.

    Raises ``ValueError``, listing what was found, for a model without one learned absolute position table, or
    a ``max_length`` not larger than the current limit; everything is checked first, so the model (and the
    tokenizer) are then left untouched.
    """
    max_length = _length(max_length)
    problems, found = _problems(model, max_length, tokenizer)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(
            f"cannot extend the positions of {type(model).__name__} to {max_length!r} tokens:\n{lines}\n"
            f"found: {'; '.join(found)}"
        )
    name, emb = _embeddings(model)
    table = emb.position_embeddings
    offset, old_rows = _offset(table), table.num_embeddings
    rows = offset + max_length
    period = _period(model.config, table.weight.detach()[offset:])
    with torch.no_grad():
        weight = _tiled(table.weight.detach(), offset, max_length, period)
    table.weight = nn.Parameter(weight, requires_grad=table.weight.requires_grad)
    table.num_embeddings = rows
    for buf in ("position_ids", "token_type_ids"):
        old = getattr(emb, buf, None)
        if not isinstance(old, torch.Tensor):
            continue
        if buf == "position_ids":
            new = torch.arange(rows, dtype=old.dtype, device=old.device).expand(old.shape[0], -1)
        else:  # the old values (zeros), then zeros
            new = torch.zeros(old.shape[0], rows, dtype=old.dtype, device=old.device)
            new[:, :old_rows] = old
        setattr(emb, buf, new.contiguous())  # a registered buffer stays registered, persistence unchanged
    model.config.max_position_embeddings = rows
    setattr(model.config, TRAINED_POSITIONS, period)
    if tokenizer is not None:
        tokenizer.model_max_length = max_length
        if isinstance(getattr(tokenizer, "init_kwargs", None), dict):
            tokenizer.init_kwargs["model_max_length"] = max_length  # what save_pretrained writes
    log.info("extended %s.position_embeddings from %d to %d tokens", name, old_rows - offset, max_length)
    return model


@contextlib.contextmanager
def extended_positions(model: nn.Module, max_length: int, *, tokenizer: Any = None) -> Iterator[nn.Module]:
    """``with extended_positions(model, n, tokenizer=tok): ...``: :func:`extend_positions` for the block only.

    On exit the model gets back its own position table (the same parameter object), buffers and
    ``config.max_position_embeddings``, and the tokenizer its ``model_max_length``: the evaluation harness
    reads long inputs with a model the caller passed in without changing it for good. Raises as
    :func:`extend_positions` does, before any change."""
    max_length = _length(max_length)
    problems, _ = _problems(model, max_length, tokenizer)
    if problems:
        extend_positions(model, max_length, tokenizer=tokenizer)  # raises with the full message
    _, emb = _embeddings(model)
    table = emb.position_embeddings
    saved = {
        "weight": table.weight,
        "rows": table.num_embeddings,
        "buffers": {b: getattr(emb, b) for b in ("position_ids", "token_type_ids") if hasattr(emb, b)},
        "config": model.config.max_position_embeddings,
        "trained": model.config.__dict__.get(TRAINED_POSITIONS, _ABSENT),
    }
    tok_saved = None
    if tokenizer is not None:
        kwargs = getattr(tokenizer, "init_kwargs", None)
        tok_saved = (tokenizer.model_max_length, dict(kwargs) if isinstance(kwargs, dict) else None)
    try:
        extend_positions(model, max_length, tokenizer=tokenizer)
        yield model
    finally:
        weight = saved["weight"]
        with torch.no_grad():  # the block may have moved or cast the model: follow it, same parameter object
            weight.data = weight.data.to(table.weight.device, table.weight.dtype)
        table.weight = weight
        table.num_embeddings = saved["rows"]
        for b, value in saved["buffers"].items():
            current = getattr(emb, b, None)
            setattr(emb, b, value.to(current.device) if isinstance(current, torch.Tensor) else value)
        model.config.max_position_embeddings = saved["config"]
        if saved["trained"] is _ABSENT:
            model.config.__dict__.pop(TRAINED_POSITIONS, None)
        else:
            setattr(model.config, TRAINED_POSITIONS, saved["trained"])
        if tok_saved is not None:
            tokenizer.model_max_length = tok_saved[0]
            if tok_saved[1] is not None:
                tokenizer.init_kwargs.clear()
                tokenizer.init_kwargs.update(tok_saved[1])
