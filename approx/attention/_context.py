"""What an attention function cannot read from q, k and v: which positions are the question of a QA input
(plain torch; set by the model integration, or by hand for plain tensors).

Longformer makes the question tokens global on QA inputs ("every token before the first SEP"). A patched model
computes that mask from its inputs at every forward (``approx.integration`` registers the hook) and the
``window`` method reads it here; for plain tensors, wrap the call::

    with approx.tokens(question_mask=mask):   # (B, N) bool
        out = layer(q, k, v, key_mask)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

__all__ = ["question_mask", "question_of", "tokens"]

_QUESTION: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("approx_question_mask", default=None)


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
    input_ids: torch.Tensor | None, token_type_ids: torch.Tensor | None, sep_token_id: int | None
) -> torch.Tensor | None:
    """Every position before the first SEP, (B, N) bool: from ``input_ids`` when the SEP id is known, else from
    ``token_type_ids`` (the first SEP closes segment 0: it is the token just before the first token of segment 1).
    A row without a SEP (or without a second segment) has no question. None when neither input is given or when no
    row has a question (e.g. single-segment inputs): a method that needs one then says so instead of running
    without it."""
    if sep_token_id is not None and input_ids is not None:
        is_sep = input_ids == sep_token_id
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
