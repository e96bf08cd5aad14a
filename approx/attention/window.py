"""Sliding-window attention with global tokens (Longformer).

Beltagy, Peters, Cohan, "Longformer: The Long-Document Transformer", arXiv 2004.05150.

Query i attends key j when ``|i - j| <= window * dilation`` and ``(i - j)`` is a multiple of ``dilation``:
``window`` is **one-sided** here, 2 * window + 1 keys per query. Longformer's ``attention_window`` is the
two-sided total (its users confused the two, allenai/longformer #194): its ``attention_window=512`` is
``window=256`` here. Global tokens attend every key and every query attends them: the first ``global_tokens``
positions (CLS, the classification choice), and with ``question_global`` every token before the first SEP (the
question of a QA input, Longformer's choice; a patched model finds it from its ``input_ids`` or
``token_type_ids``, see :mod:`._context`). Longformer trains separate projections for global attention; a
pretrained encoder has none, so global tokens use the layer's own Q, K and V (zero-shot).

Runs on the block-sparse kernel (:mod:`._blocksparse`): query blocks of ``block`` rows attend the key blocks
their window touches, the element mask keeps the exact window; global keys are a shared strip and global queries
dense rows. Positions are those of the padded sequence (padding at the end leaves the real tokens' pairs
unchanged). With ``window >= N - 1`` (and dilation 1) every pair is in: exact attention, computed by the same
code (the exact-limit test). The cost is the pattern's pairs among each input's real tokens; the question's length
is data, so :func:`batch_cost` counts each input with its own global tokens (the harness uses it).
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import MethodConfig, option
from ..registry import Cost, ExactLimit, register
from . import _blocksparse, _fallback
from ._blocksparse import Pattern
from ._common import exact_rows, exact_weight_rows, refuse_left_padding
from ._context import question_mask

NO_QUESTION = (
    "window: question_global=True needs the question's positions and none were found: run the patched model on "
    "question-context pairs with input_ids (and a config with sep_token_id or eos_token_id) or token_type_ids, or "
    "wrap the call in approx.tokens(question_mask=...)"
)


@dataclasses.dataclass(frozen=True)
class WindowConfig(MethodConfig):
    """Options of sliding-window (Longformer) attention."""

    method = "window"

    window: int = option(
        256,
        "one-sided: query i attends keys j with |i - j| <= window (times dilation); Longformer's two-sided "
        "attention_window is 2 * window",
    )
    dilation: int = option(1, "attend every dilation-th key inside a window of window * dilation on each side")
    global_tokens: int = option(
        1,
        "the first global_tokens positions (CLS; padding must come after the real tokens: left padding is refused) "
        "attend to and are attended by every token",
    )
    question_global: bool = option(
        False, "every token before the first SEP (the question of a QA input) is global too (Longformer's QA choice)"
    )
    block: int = option(64, "rows per query block of the kernel (speed only: the output does not depend on it)")
    exact_below: int = option(0, "sequences with fewer real tokens get exact attention (0 = never)")
    kernel: str = _blocksparse.kernel_option(
        band="approx's banded kernel (strided views of K and V, no gathered copy; inference only, no dilation)"
    )

    def unused(self) -> dict[str, str]:
        return {} if self.window else {"dilation": "window >= 1"}

    def check(self) -> None:
        self.require(self.window >= 0, "window", "a one-sided width: 0 (only i = j) or more")
        self.require(self.dilation >= 1, "dilation", "1 (contiguous) or more")
        self.require(self.global_tokens >= 0, "global_tokens", "cannot be negative")
        self.require(self.block >= 1, "block", "at least one row per block")
        self.require(self.exact_below >= 0, "exact_below", "a length: 0 (off) or more")
        _blocksparse.check_kernel(self, band=True)
        self.require(self.kernel != "band" or self.dilation == 1, "kernel", "'band' runs contiguous windows only")
        self.require(self.kernel != "band" or self.block >= 2, "kernel", "'band' needs blocks of two rows or more")


def window_pairs(n: int, s: int, window: int, dilation: int) -> int:
    """Pairs (i < n, j < s) with |i - j| = dilation * t, t <= window: sum over the offsets of the rows they fit."""
    total = 0
    # only offsets shorter than the sequences fit a row (a window of 10**6 must not loop 2 * 10**6 times)
    for t in range(-min(window, (n - 1) // dilation), min(window, (s - 1) // dilation) + 1):
        off = dilation * t
        total += max(0, min(n, s - off) - max(0, -off))
    return total


def _pair_cost(pairs: int, d: int, dv: int) -> Cost:
    return Cost(flops=2 * pairs * (d + dv), qk_pairs=pairs, matmul_macs=pairs * (d + dv))


def cost(config: WindowConfig, *, n: int, s: int, d: int, dv: int) -> Cost:
    """The window's pairs plus the first ``global_tokens`` positions' rows and columns (taken once). A question made
    global (``question_global``) adds its rows and columns, whose length is data: :func:`batch_cost` counts them
    (the harness uses it); this count without the data leaves them out."""
    if _fallback.exact_for_length(n, exact_below=config.exact_below):
        return _pair_cost(n * s, d, dv)
    g = min(config.global_tokens, n, s)
    local = window_pairs(n - g, s - g, config.window, config.dilation)  # pairs between non-global tokens
    return _pair_cost(min(n * s, local + g * s + (n - g) * g), d, dv)


def covered_pairs(m: int, globals_: torch.Tensor, window: int, dilation: int) -> int:
    """Pairs among ``m`` real tokens (positions 0..m-1) that the pattern covers, each once: the window's, and every
    row and column of the global positions ``globals_`` (1-D, distinct, below m). Window pairs with a global end are
    those of the globals' rows and columns (as many: the window is symmetric), less the pairs of two globals."""
    reach, g = window * dilation, int(globals_.numel())
    t = globals_.long()
    # each global's window row: offsets u in [-window, window] with 0 <= t + dilation * u < m
    rows = (torch.clamp((m - 1 - t) // dilation, max=window) - torch.clamp(-(t // dilation), min=-window) + 1).sum()
    diff = t[:, None] - t[None, :]
    both = ((diff.abs() <= reach) & (diff.remainder(dilation) == 0)).sum()  # window pairs of two globals
    return window_pairs(m, m, window, dilation) + 2 * g * m - g * g - (2 * int(rows) - int(both))


def _check_padding(config: WindowConfig, key_mask: torch.Tensor | None) -> None:
    """The first ``global_tokens`` positions must be real tokens wherever a real token follows (no left padding)."""
    if config.global_tokens:
        refuse_left_padding(key_mask, "window", "global_tokens", first=config.global_tokens)


def batch_cost(config: WindowConfig, *, b: int, n: int, key_mask: torch.Tensor | None, d: int, dv: int) -> list[Cost]:
    """Per batch row (real tokens first, padding at the end): the pairs among its real tokens that the pattern covers,
    with its own global positions, the first ``global_tokens`` and with ``question_global`` the question's tokens
    that the forward's context holds (:func:`global_positions`; call it where that context is set, as the harness's
    probe is). A row below ``exact_below`` costs full attention."""
    _check_padding(config, key_mask)
    lengths = [n] * b if key_mask is None else [int(m) for m in key_mask.sum(-1).tolist()]
    glob = global_positions(config, b, n, "cpu")
    costs = []
    for row, m in enumerate(lengths):
        if _fallback.exact_for_length(m, exact_below=config.exact_below):
            pairs = m * m
        else:
            at = torch.zeros(0, dtype=torch.long) if glob is None else glob[row, :m].nonzero()[:, 0]
            pairs = covered_pairs(m, at, config.window, config.dilation)
        costs.append(_pair_cost(pairs, d, dv))
    return costs


def global_positions(config: WindowConfig, b: int, n: int, device) -> torch.Tensor | None:
    """(B, N) bool: the first ``global_tokens`` positions, and the question when ``question_global``."""
    glob = (torch.arange(n, device=device) < config.global_tokens).expand(b, n)
    if config.question_global:
        question = question_mask()
        if question is None:
            raise RuntimeError(NO_QUESTION)
        if tuple(question.shape) != (b, n):
            raise ValueError(f"window: the question mask has shape {tuple(question.shape)}, the inputs ({b}, {n})")
        glob = glob | question.to(device=device, dtype=torch.bool)
    return glob if bool(glob.any()) else None


def pattern(config: WindowConfig, *, b: int, n: int, s: int, device) -> Pattern:
    """Query block t attends the key blocks that [t * block - reach, (t + 1) * block - 1 + reach] touches."""
    # at window 0 only i = j is in, whatever the dilation (:meth:`WindowConfig.unused`): the contiguous pattern, so
    # that the kernel chosen and its rounding do not depend on it either
    blk, reach, dil = config.block, config.window * config.dilation, config.dilation if config.window else 1
    tq, tk = -(-n // blk), -(-s // blk)
    starts = torch.arange(tq, device=device) * blk
    kv, valid = _blocksparse.range_blocks(starts - reach, starts + blk + reach, blk, tk)

    def allow(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        diff = i - j
        ok = diff.abs() <= reach
        return ok if dil == 1 else ok & (diff.remainder(dil) == 0)

    # blocks every pair of which is within the window (contiguous windows only): the largest distance fits
    q_first, k_first = starts[:, None], kv * blk
    far = torch.maximum((q_first - (k_first + blk - 1)).abs(), (q_first + blk - 1 - k_first).abs())
    full = (far <= reach) & (dil == 1)
    glob = global_positions(config, b, n, device)
    shared = None if glob is None else torch.nn.functional.pad(glob, (0, max(0, s - n)))[:, :s]
    return Pattern(
        blk,
        kv[None, None],
        valid[None, None],
        allow=allow,
        shared_keys=shared,
        global_queries=glob,
        kv_full=full[None, None],
        allow_implies_blocks=dil == 1,  # the listed blocks are all those within reach
        band=reach if dil == 1 else None,
        # the first global_tokens positions, when they are the only global ones (no question)
        plain=None
        if config.question_global
        else (lambda i, j: (i < config.global_tokens) | (j < config.global_tokens)),
    )


def weights(q, k, *, key_mask, query_mask, scale, config, state) -> torch.Tensor:
    """The dense (B, H, N, S) matrix of the window pattern (measuring only)."""
    _check_padding(config, key_mask)
    b, _, n, _ = q.shape
    pat = pattern(config, b=b, n=n, s=k.shape[2], device=q.device)
    return _fallback.with_fallback(
        lambda: _blocksparse.dense_weights(q, k, pat, key_mask=key_mask, scale=scale),
        exact_weight_rows(q, k, key_mask, scale),
        query_mask=query_mask,
        shape=(b, n),
        device=q.device,
        exact_below=config.exact_below,
    )


def graph_stats(q, k, *, key_mask, query_mask, scale, config, state) -> dict[str, torch.Tensor]:
    """Sparsity and recall of the window pattern against the entmax (alpha 1.5) gold graph, as Sparsefinder."""
    _check_padding(config, key_mask)
    b, _, n, _ = q.shape
    pat = pattern(config, b=b, n=n, s=k.shape[2], device=q.device)
    exact = _fallback.exact_rows(query_mask, n, b, q.device, exact_below=config.exact_below)
    return _blocksparse.pattern_stats(q, k, pat, key_mask=key_mask, scale=scale, exact_rows=exact)


@register(
    "window",
    WindowConfig,
    cost=cost,
    batch_cost=batch_cost,
    weights=weights,
    stats=graph_stats,
    test_options={"window": 5, "block": 8},
    # a window reaching every key: each pair in, through the pattern code
    exact_limit=ExactLimit(options=lambda n: {"window": n}),
)
def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    scale: float,
    config: WindowConfig,
    state: dict[str, torch.Tensor],
    dropout: float = 0.0,
) -> torch.Tensor:
    """Sliding-window attention with global tokens (Longformer), O(N window)."""
    b, _, n, _ = q.shape
    s = k.shape[2]
    key_mask = _blocksparse.no_padding(key_mask)
    _check_padding(config, key_mask)

    def approximate() -> torch.Tensor:
        # the pattern is a function of the shapes and options, unless the question's tokens are global (data)
        key = None if config.question_global else ("window", config, b, n, s, q.device)
        pat = _blocksparse.cached(key, lambda: pattern(config, b=b, n=n, s=s, device=q.device))
        return _blocksparse.attend(q, k, v, pat, key_mask=key_mask, scale=scale, dropout=dropout, kernel=config.kernel)

    return _fallback.with_fallback(
        approximate,
        exact_rows(q, k, v, key_mask, scale, dropout),
        query_mask=query_mask,
        shape=(b, n),
        device=q.device,
        exact_below=config.exact_below,
    )
