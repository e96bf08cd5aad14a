"""What an attention function cannot read from q, k and v: which positions are the question of a QA input
(plain torch; set by the model integration, or by hand for plain tensors), and which of the layer's heads the call
holds.

Longformer makes the question tokens global on QA inputs ("every token before the first SEP"). A patched model
computes that mask from its inputs at every forward (``approx.integration`` registers the hook) and the
``window`` method reads it here; for plain tensors, wrap the call::

    with approx.tokens(question_mask=mask):   # (B, N) bool
        out = layer(q, k, v, key_mask)

A method run on some heads of a layer only (``approx.patch(..., on_heads=...)``) is called with those heads alone;
``ApproxAttention`` sets :func:`heads` around the call, so that whatever a method draws or assigns per head (BigBird's
random blocks, the clustering's random starts, the Sparse Transformer's two patterns) follows the head's index in the
layer (:func:`head_indices`), and a head computes the same alone as beside the others.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

__all__ = ["given_head_indices", "head_indices", "head_key", "heads", "question_mask", "question_of", "tokens"]

_QUESTION: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("approx_question_mask", default=None)
_HEADS: contextvars.ContextVar[tuple[int, ...] | None] = contextvars.ContextVar("approx_heads", default=None)


@contextlib.contextmanager
def heads(indices: tuple[int, ...] | None) -> Iterator[None]:
    """Within the block, attention calls hold the layer's heads ``indices`` (in order), not heads 0, 1, ...; None:
    the call holds every head of its layer."""
    token = _HEADS.set(None if indices is None else tuple(int(h) for h in indices))
    try:
        yield
    finally:
        _HEADS.reset(token)


def head_key() -> tuple[int, ...] | None:
    """The layer's heads the current call holds, for a cache key (None: heads 0, 1, ... of the call)."""
    return _HEADS.get()


def given_head_indices(count: int, device=None) -> torch.Tensor | None:
    """:func:`head_indices` when :func:`heads` set them, else None (read it outside compiled code, and pass it in:
    a context variable read inside a compiled function breaks its graph)."""
    return None if _HEADS.get() is None else head_indices(count, device)


def head_indices(count: int, device=None) -> torch.Tensor:
    """The layer's index of each of a call's ``count`` heads, (count,) int64: ``arange(count)`` unless :func:`heads`
    says otherwise. ``ValueError`` when the heads set do not number ``count``."""
    given = _HEADS.get()
    if given is None:
        return torch.arange(count, device=device)
    if len(given) != count:
        raise ValueError(f"the call holds {count} heads, and the layer's heads set for it are {list(given)}")
    return torch.tensor(given, dtype=torch.int64, device=device)


@contextlib.contextmanager
def tokens(*, question_mask: torch.Tensor | None) -> Iterator[None]:
    """Within the block, attention calls see ``question_mask`` (B, N) bool: True at the question's positions."""
    token = _QUESTION.set(question_mask)
    try:
        yield
    finally:
        _QUESTION.reset(token)


def question_mask() -> torch.Tensor | None:
    """The question mask of the current forward, or None when nobody set one."""
    return _QUESTION.get()


def question_of(
    input_ids: torch.Tensor | None,
    token_type_ids: torch.Tensor | None,
    sep_token_id: int | None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Every position before the first SEP, (B, N) bool: from ``input_ids`` when the SEP id is known, else from
    ``token_type_ids`` (the first SEP closes segment 0: it is the token just before the first token of segment 1).
    A row without a SEP (or without a second segment) has no question. None when neither input is given or when no
    row has a question (e.g. single-segment inputs): a method that needs one then says so instead of running
    without it. Inputs that are not (B, N) (one text's ids unbatched) have none: the model's own check refuses them
    as it would unpatched. ``attention_mask`` (B, N), when given: only real tokens count as SEPs (models whose padding
    id is their SEP id, as EuroBERT's eos, would otherwise see a second segment in every padded row)."""
    if (input_ids is not None and input_ids.dim() != 2) or (token_type_ids is not None and token_type_ids.dim() != 2):
        return None
    if sep_token_id is not None and input_ids is not None:
        is_sep = input_ids == sep_token_id
        if attention_mask is not None and attention_mask.shape == input_ids.shape:
            is_sep &= attention_mask.to(torch.bool)
        # a second segment: a SEP after the first (BERT's [SEP] q [SEP] c [SEP], RoBERTa's </s></s>); a single
        # segment ends with its only SEP, and everything before it is no question
        has = is_sep.sum(-1, keepdim=True) >= 2
    elif token_type_ids is not None:
        second = token_type_ids != 0
        is_sep = ~second & torch.cat([second[:, 1:], torch.zeros_like(second[:, :1])], 1)
        has = is_sep.any(-1, keepdim=True)
    else:
        return None
    if not bool(has.any()):
        return None
    first = is_sep.to(torch.uint8).argmax(-1, keepdim=True)
    return (torch.arange(is_sep.shape[-1], device=is_sep.device) < first) & has
