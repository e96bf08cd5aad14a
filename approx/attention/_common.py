"""Small tensor helpers shared by the method files (plain torch, no transformers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision inputs are computed in float32 and cast back; float32/float64 stay as they are."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def chunk_elements(cpu: int, device) -> int:
    """A kernel's chunk size in elements on ``device``: ``cpu``, sized for the CPU's caches, there; 16 times more on
    an accelerator, where every chunk is a round of kernel launches and no cache sets the size."""
    return cpu if torch.device(device).type == "cpu" else cpu << 4


def tracked(*tensors: torch.Tensor) -> bool:
    """Whether autograd records a computation on these tensors (a gradient is enabled and one of them needs it)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def safe_key_mask(key_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Rows with no real key at all attend to every key instead (their output is meaningless but finite)."""
    if key_mask is None:
        return None
    empty = ~key_mask.any(-1, keepdim=True)  # (B, 1)
    return key_mask | empty


NOTHING_REAL = "nothing to fit on: every row of the samples is padding (an attention mask of zeros only)"


def real_tokens(key_mask: torch.Tensor | None, b: int, s: int) -> torch.Tensor:
    """(B, S) bool on the CPU: the real tokens of each row, none in a row of padding alone. (The attention runs such
    a row as if every token were real, :func:`safe_key_mask`, to keep its output finite; a fit must not learn from
    it.)"""
    if key_mask is None:
        return torch.ones(b, s, dtype=torch.bool)
    return key_mask.detach().cpu().bool()


def refuse_left_padding(
    key_mask: torch.Tensor | None, method: str, option: str, first: int | None = None, takes: str | None = None
) -> None:
    """``ValueError`` when ``option`` would take a pad token for a real one: some row of ``key_mask`` (B, S) has a pad
    followed later by a real token (left padding, or a hole) within its ``first`` positions (the global tokens), or
    anywhere when ``first`` is None (an option that finds the last real token by counting them, or, as ``takes``
    says, one that places its pattern by absolute position)."""
    if key_mask is None or key_mask.shape[-1] < 2:
        return
    later = key_mask.flip(-1).long().cumsum(-1).flip(-1) > 0  # a real token at or after each position
    before_real = ~key_mask[:, :-1] & later[:, 1:]  # (B, S - 1): a pad with a real token after it
    if first is not None:
        before_real = before_real[:, :first]
    if not bool(before_real.any()):
        return
    where = "the first positions of each row" if first is not None else "the last real token of each row"
    takes = takes or f"takes {where} as global tokens"
    raise ValueError(
        f"{method}: {option} {takes}, so padding must come after the real tokens, and this "
        "batch has padding before real tokens (a left-padding tokenizer?); pad on the right (tokenizer.padding_side "
        f"= 'right') or turn {option} off"
    )


def exact_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """softmax(scale * q k^T + log m) v with torch's fused kernel. Shapes (B, H, N, d) -> (B, H, N, dv)."""
    key_mask = safe_key_mask(key_mask)
    attn_mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout, scale=scale)


def padded_exact_attention(q, k, v, key_mask: torch.Tensor | None, scale: float, dropout: float = 0.0):
    """:func:`exact_attention` with padded keys and values zeroed first, for a method's rows that fall back to exact
    attention: whatever a model leaves at padding (inf, NaN) then reaches no real row, as on the method's own path
    (SDPA's masked weight of 0 times an inf value, or a NaN score, is NaN). ``full`` runs :func:`exact_attention` on
    the inputs as they are, as the unpatched model does."""
    return exact_attention(
        q, zero_padded_values(k, key_mask), zero_padded_values(v, key_mask), key_mask, scale, dropout
    )


def exact_rows(q, k, v, key_mask: torch.Tensor | None, scale: float, dropout: float = 0.0):
    """``exact(rows)`` for :func:`._fallback.with_fallback` and ``replace_query_rows``: exact attention on the
    batch rows ``rows`` (a bool or index tensor over B; None: every row), (b, H, N, dv), padding zeroed first
    (:func:`padded_exact_attention`)."""

    def exact(rows: torch.Tensor | None) -> torch.Tensor:
        if rows is None:
            return padded_exact_attention(q, k, v, key_mask, scale, dropout)
        mask = None if key_mask is None else key_mask[rows]
        return padded_exact_attention(q[rows], k[rows], v[rows], mask, scale, dropout)

    return exact


def exact_weight_rows(q, k, key_mask: torch.Tensor | None, scale: float, dtype: torch.dtype | None = None):
    """``exact(rows)`` like :func:`exact_rows` for the dense weights paths: the softmax matrix (b, H, N, S) of the
    batch rows ``rows`` (None: every row), computed in ``dtype`` (default: the inputs', half precision in float32)."""
    dtype = dtype or compute_dtype(q.dtype)

    def exact(rows: torch.Tensor | None) -> torch.Tensor:
        qr, kr = (q, k) if rows is None else (q[rows], k[rows])
        mask = key_mask if rows is None or key_mask is None else key_mask[rows]
        return dense_softmax(qr.to(dtype or qr.dtype), kr.to(dtype or kr.dtype), mask, scale)

    return exact


def dense_softmax(q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """softmax(s Q K^T + log m) as a dense (B, H, N, S) matrix: for analysis and plots, never a fast path. Half
    precision is computed, and returned, in float32 as every method's weights are (scores rounded to bfloat16 had
    put exact attention's weights further from softmax than a method's)."""
    key_mask = safe_key_mask(key_mask)
    dtype = compute_dtype(q.dtype)
    scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return scores.softmax(-1)


def softmax_(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """softmax over ``dim``, written over ``x`` when no gradient is needed (``out=`` has no autograd): a large
    fresh output costs more than the softmax itself on the CPU (page faults)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return x.softmax(dim)
    return torch.softmax(x, dim, out=x)


def zero_padded_values(v: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """Set padded value rows to zero so that 0 * (huge or inf) can never leak into a real output."""
    if key_mask is None:
        return v
    return v.masked_fill(~key_mask[:, None, :, None], 0.0)


def block_size(n: int, clusters: int) -> int:
    """Queries per block: about half the mean cluster size, so padding wastes at most ~C * L rows."""
    return max(4, min(64, n // (2 * clusters)))


def cluster_blocks(assign: torch.Tensor, clusters: int, block: int):
    """Lay queries out cluster by cluster in blocks of ``block`` rows that all belong to one cluster.

    Returns ``order`` (B, H, N): query indices sorted by cluster; ``slot`` (B, H, N): the padded row of the
    i-th sorted query; ``block_cluster`` (B, H, nb): the cluster of every block; and nb. A cluster of c
    queries takes ceil(c / block) blocks, so nb <= N / block + C.
    """
    batch, heads, n = assign.shape
    order = assign.argsort(dim=-1, stable=True)
    sorted_cluster = assign.gather(-1, order)
    counts = torch.zeros(batch, heads, clusters, dtype=torch.long, device=assign.device)
    counts.scatter_add_(2, assign, torch.ones_like(assign))
    blocks = (counts + block - 1) // block
    first_block = blocks.cumsum(-1) - blocks  # (B, H, C)
    first_query = counts.cumsum(-1) - counts
    rank = torch.arange(n, device=assign.device) - first_query.gather(-1, sorted_cluster)
    slot = first_block.gather(-1, sorted_cluster) * block + rank  # (B, H, N)
    nb = (n + clusters * (block - 1) + block - 1) // block
    block_cluster = torch.zeros(batch, heads, nb, dtype=torch.long, device=assign.device)
    block_cluster.scatter_(-1, slot // block, sorted_cluster)
    return order, slot, block_cluster, nb


def block_rows(assign: torch.Tensor, clusters: int, block: int, *, used: bool = True):
    """The blocks of :func:`cluster_blocks` as rows of flat tables, for chunked ``index_select`` / ``index_copy_``.

    Returns ``dest`` (B*H*nb, block): the row of the (B*H*N) query table of every block row, B*H*N (one past
    the last query: a spare row) for padding rows; ``used`` (U,): the blocks that hold queries (None when not
    ``used``: a shape that depends on the data, which compiled code avoids); ``cluster`` (B*H*nb,): the row of
    every block's cluster in a (B*H*C) table.
    """
    batch, heads, n = assign.shape
    bh = batch * heads
    order, slot, block_cluster, nb = cluster_blocks(assign, clusters, block)
    head = torch.arange(bh, device=assign.device).view(batch, heads, 1)
    dest = torch.full((bh * nb, block), bh * n, dtype=torch.long, device=assign.device)
    dest.view(-1)[(slot + head * (nb * block)).reshape(-1)] = (order + head * n).reshape(-1)
    in_use = (dest[:, 0] < bh * n).nonzero().squeeze(1) if used else None  # its first row holds a query
    return dest, in_use, (block_cluster + head * clusters).reshape(-1)
