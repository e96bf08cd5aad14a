"""Attention over a block-sparse pattern (plain torch): the one kernel of the sparse-pattern methods
(``window``, ``bigbird``, ``sparse-transformer``, ``lsh``).

Every one of them is "each query block attends a set of key blocks", after putting queries and keys in an order
of the method's choosing (LSH sorts them by hash, the strided pattern by position modulo l). A
:class:`Pattern` says:

* ``block``: rows per query block and keys per key block, in the sorted order;
* ``kv_blocks`` (B|1, H|1, Tq, K) and ``kv_valid``: the key blocks each query block attends;
* ``q_order`` / ``k_order`` (B|1, H|1, N): the original position at every sorted slot (None: positions in order);
* ``allow(i, j)`` and ``bias(i, j)``: an element mask and an additive score bias inside the gathered blocks, as
  *elementwise* functions of the *original* positions, called on broadcastable tensors (the gather kernel passes
  i (B, H, *lead, r, 1) and j (B, H, *lead, 1, E), the dense path (B, H, N, 1) and (B, H, 1, S), FlexAttention
  single positions), e.g. the window's ``|i - j| <= w``;
* ``shared_keys`` (B, S): keys every query attends (global tokens; Sparse Transformer's summary columns), computed
  once as a dense (N, E) strip and left out of the blocks so that no pair is counted twice;
* ``global_queries`` (B, N): queries that attend every key (global tokens), computed as dense rows;
* ``flex`` and ``kv_full``: whether FlexAttention can call ``allow``/``bias`` one pair at a time, and which key
  blocks ``allow`` admits whole (a speed hint for FlexAttention only: see :mod:`._flex`).

:func:`attend` gathers, for a chunk of query blocks at a time, their key blocks into one (rows, K * block) score
matrix per block: no (N, S) tensor is formed, work and memory are O(N K block). Scores and sums run in float32
for half-precision inputs; gradients flow through every step (plain indexing and matrix products). It returns
the per-query log-sum-exp too, so that several patterns (LSH rounds) combine exactly (:func:`combine`).
:func:`dense_mask` builds the same pattern as a dense (B, H, N, S) mask and bias from the same block lists: for
``weights()``, graph statistics and tests only.

FlexAttention (``torch.nn.attention.flex_attention``, :mod:`._flex`) runs the same patterns, faster on long inputs
(the docs' Speed page has the measurement); on the CPU it has no backward pass, no float64 and no log-sum-exp, and it
compiles per shape, so ``kernel="auto"`` uses it for long inference calls only and this plain kernel for the rest.
On the CPU, inference on a contiguous band (``window``) runs the banded kernel (:mod:`._band`) and on neighbouring
blocks plus listed ones (``bigbird``) the block-band kernel (:mod:`._blockband`), both faster there; on short inputs
SDPA over the pattern's dense mask is faster still (:mod:`._dense`).
A pattern lists each key block of a query block at most once (the dense and flex paths de-duplicate, this one
would count a repeated block twice).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..config import option
from ._common import chunk_elements, compute_dtype, safe_key_mask, tracked, zero_padded_values

__all__ = [
    "Pattern",
    "account",
    "attend",
    "cached",
    "clear_cache",
    "combine",
    "dense_mask",
    "dense_weights",
    "global_rows",
    "no_padding",
    "range_blocks",
    "token_rows",
]

# the kernels that run a pattern (the sparse-pattern methods' ``kernel`` option): see :func:`attend`
KERNELS = ("auto", "gather", "flex")
BAND = "band"  # the banded kernels: contiguous windows (:mod:`._band`), neighbouring blocks (:mod:`._blockband`)
FUSED = "fused"  # "auto" with the block-band kernel's C++ form (neighbouring blocks: bigbird) in CPU inference


def kernel_option(*, band: str | None = None, fused: str | None = None) -> Any:
    """The ``kernel`` option of a sparse-pattern method's config (check it with :func:`check_kernel`); ``band``: what
    the banded kernel does for the method (its pattern is a contiguous band, ``window``, run by :mod:`._band`, or
    neighbouring blocks, ``bigbird``, run by :mod:`._blockband`), None: it has none; ``fused``: what ``"fused"``
    does for it (bigbird's), None: it has no such choice."""
    if band:
        return option(
            "auto",
            f"'band': {band}; 'gather': approx's plain-torch block kernel; 'flex': compiled FlexAttention (on the "
            "CPU: inference only, float32/16, blocks of a multiple of 16); 'auto': in CPU inference on short inputs SDPA over the pattern's "
            "dense mask, else band on the CPU where it can run the call, else flex on long inputs where it can, "
            "else gather (same output to rounding)" + (f"; 'fused': {fused}" if fused else ""),
        )
    return option(
        "auto",
        "'gather': approx's plain-torch block kernel; 'flex': compiled FlexAttention (on the CPU: inference only, "
        "float32/16, blocks of a multiple of 16); 'auto': in CPU inference on short inputs SDPA over the pattern's dense mask, else flex on long "
        "inputs where it can run the call, else gather (same output to rounding)",
    )


def check_kernel(config, *, band: bool = False, fused: bool = False) -> None:
    kernels = KERNELS + ((BAND,) if band else ()) + ((FUSED,) if fused else ())
    config.require(config.kernel in kernels, "kernel", f"choose one of {', '.join(kernels)}")


# Largest score tensor of one chunk of query blocks, in elements (B * H * c * block * keys), on the CPU (16 times more
# on an accelerator: ``_common.chunk_elements``).
_CHUNK_ELEMENTS = 1 << 22

PairFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass
class Pattern:
    """A block-sparse attention pattern (see the module docstring)."""

    block: int
    kv_blocks: torch.Tensor
    kv_valid: torch.Tensor | None = None
    q_order: torch.Tensor | None = None
    k_order: torch.Tensor | None = None
    allow: PairFn | None = None
    bias: PairFn | None = None
    shared_keys: torch.Tensor | None = None
    global_queries: torch.Tensor | None = None
    # allow / bias are functions of the positions alone (FlexAttention can call them one pair at a time)
    flex: bool = True
    # (B|1, H|1, Tq, K) bool: key blocks whose every pair ``allow`` admits (FlexAttention then skips the element
    # mask there); None: none known (every block when there is no ``allow``)
    kv_full: torch.Tensor | None = None
    # every pair ``allow`` admits lies in the listed key blocks (FlexAttention then need not look the blocks up)
    allow_implies_blocks: bool = False
    # plain(i, j): elementwise, True where j is a shared key or i a global query, when that depends on the positions
    # only (FlexAttention then computes it instead of looking the tables up); None: look-ups
    plain: PairFn | None = None
    # the pattern is the contiguous band |i - j| <= band (plus shared keys and global queries) in original order,
    # and ``allow`` says just that: the banded kernel (:mod:`._band`) can run it; None: it is not
    band: int | None = None
    # the first 2 * neighbours + 1 entries of every query block's ``kv_blocks`` are the key blocks t - neighbours, ...,
    # t + neighbours (in the sorted order; ``kv_valid`` may drop some): the block-band kernel (:mod:`._blockband`)
    # can run it, with the neighbours as views, when the order is one per batch row (or none) and puts each row's
    # real tokens first (``_blockband.unusable`` checks it); None: they are not
    neighbours: int | None = None
    # the key under which :func:`cached` keeps the pattern (a function of the shapes, the device and the method's
    # options and state alone), None when it is not kept: the kernels may then keep what they derive from it for
    # inputs without key padding (FlexAttention's block mask) in ``derived``
    cache_key: tuple | None = dataclasses.field(default=None, compare=False)
    derived: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def static(self) -> bool:
        return self.cache_key is not None


# Patterns kept by :func:`cached`, most recently used last, with the bytes their tensors take: at most
# :data:`CACHE_SIZE` entries and :data:`CACHE_BYTES` bytes (on every device together), the least recently used
# dropped first (the newest entry stays, even alone above the limits). FlexAttention's block mask at N = 65536,
# 12 heads, takes about 230 MiB, at 16384 about 20 MiB.
_CACHE: collections.OrderedDict = collections.OrderedDict()
CACHE_SIZE = 64
CACHE_BYTES = 1 << 30
# One model called from several threads (a server): every read and change of _CACHE holds this lock (trimming had
# walked the dict while another thread changed it: "OrderedDict mutated during iteration"); a build runs outside it,
# so two threads may build one pattern, and the first kept is the one both get after.
_LOCK = threading.RLock()


def cached(key: tuple | None, build: Callable[[], Any]) -> Any:
    """``build()`` (a :class:`Pattern`, or lists and tuples holding some), kept and returned again for the same
    ``key``: the pattern of inputs without key padding is a function of the shapes, the device and the method's
    options and state, so a model's layers and calls share it instead of rebuilding it (on a GPU, building it is
    many small kernel launches and host synchronisations, more time than a long call's attention). ``key``:
    hashable, every input of ``build`` (state by value, e.g. BigBird's random key: a redraw, ``load_state`` or an
    in-place change then builds anew); None: not kept (padding, data-dependent positions). Patterns built under
    ``torch.inference_mode`` are kept apart (autograd refuses them). The patterns found in the result get the key
    (``Pattern.cache_key``): :mod:`._flex` keeps its block mask on them (see :func:`account`)."""
    if key is None:
        return build()
    full = (key, torch.is_inference_mode_enabled())
    with _LOCK:
        hit = _CACHE.get(full)
        if hit is not None:
            _CACHE.move_to_end(full)
            return hit[0]
    made = build()
    _mark(made, full)
    size = _nbytes(made)
    with _LOCK:
        hit = _CACHE.get(full)  # (another thread built it meanwhile: theirs, kept, and not a second copy)
        if hit is not None:
            _CACHE.move_to_end(full)
            return hit[0]
        _CACHE[full] = [made, size]
        _trim()
    return made


def account(pattern: Pattern) -> None:
    """Count again the bytes of the entry that keeps ``pattern`` (a kernel added to its ``derived``), dropping the
    least recently used entries past the limits."""
    with _LOCK:
        entry = _CACHE.get(pattern.cache_key) if pattern.cache_key is not None else None
        if entry is not None:
            entry[1] = _nbytes(entry[0])
            _trim()


def clear_cache() -> None:
    """Forget the patterns kept by :func:`cached` and the block masks derived from them (``approx.unpatch`` does)."""
    with _LOCK:
        _CACHE.clear()


def _trim() -> None:
    """Drop the least recently used entries past the limits (the caller holds :data:`_LOCK`)."""
    total = sum(size for _, size in _CACHE.values())
    while len(_CACHE) > 1 and (len(_CACHE) > CACHE_SIZE or total > CACHE_BYTES):  # the newest entry stays
        _, (_, size) = _CACHE.popitem(last=False)
        total -= size


def _mark(obj, key) -> None:
    if isinstance(obj, Pattern):
        obj.cache_key = key
    elif isinstance(obj, list | tuple):
        for item in obj:
            _mark(item, key)


def _nbytes(obj, seen: set | None = None) -> int:
    """Bytes of the tensors in ``obj``: patterns' fields and what kernels derived from them (tuples, lists, dicts,
    objects with ``as_tuple``, functions' closures), each storage once."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        ptr = (obj.device, obj.untyped_storage().data_ptr())
        if ptr in seen:
            return 0
        seen.add(ptr)
        return obj.untyped_storage().nbytes()
    if id(obj) in seen:  # a cycle (a closure holding its pattern), or an object met before
        return 0
    seen.add(id(obj))
    if isinstance(obj, Pattern):
        fields = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
        return sum(_nbytes(x, seen) for x in fields)
    if isinstance(obj, dict):
        return sum(_nbytes(x, seen) for x in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_nbytes(x, seen) for x in obj)
    if hasattr(obj, "as_tuple"):  # FlexAttention's BlockMask
        return _nbytes(obj.as_tuple(), seen)
    if callable(obj) and getattr(obj, "__closure__", None):
        return sum(_nbytes(c.cell_contents, seen) for c in obj.__closure__ if _filled(c))
    return 0


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def no_padding(key_mask: torch.Tensor | None) -> torch.Tensor | None:
    """None for a key-padding mask with every key real (one host synchronisation), else the mask: such inputs
    take the pattern kept by :func:`cached`."""
    if key_mask is not None and bool(key_mask.all()):
        return None
    return key_mask


def _batch_index(b: int, device) -> torch.Tensor:
    """arange(B) shaped (B, 1, 1), to index (B, S) tables with (B, H, m) positions."""
    return torch.arange(b, device=device).view(b, 1, 1)


def range_blocks(lo: torch.Tensor, hi: torch.Tensor, block: int, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The key blocks covering the sorted key slots [lo, hi) of every query block: ``lo``, ``hi`` (..., Tq) long
    -> block ids (..., Tq, K) and which are real, K the most any query block needs."""
    first = lo.clamp(min=0).div(block, rounding_mode="floor")
    last = (hi.clamp(max=n_blocks * block) - 1).div(block, rounding_mode="floor")  # inclusive
    count = (last - first + 1).clamp(min=0)
    width = max(1, int(count.max()) if count.numel() else 1)
    ids = first[..., None] + torch.arange(width, device=lo.device)
    valid = torch.arange(width, device=lo.device) < count[..., None]
    return ids.clamp(0, max(n_blocks - 1, 0)), valid


def token_rows(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions where ``mask`` (B, S) is True, left-aligned: (B, E) long and which entries are real."""
    width = max(1, int(mask.sum(-1).max()) if mask.numel() else 1)
    pos = mask.to(torch.uint8).argsort(dim=-1, descending=True, stable=True)[:, :width]
    return pos, mask.gather(-1, pos)


def _sorted_positions(order: torch.Tensor | None, b: int, h: int, n: int, slots: int, device) -> torch.Tensor:
    """The original position at every sorted slot, (B, H, slots) long, -1 for the slots past the end."""
    pos = torch.arange(n, device=device).expand(b, h, n) if order is None else order.expand(b, h, n)
    return F.pad(pos, (0, slots - n), value=-1)


def _take(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x (B, H, n, d) at positions pos (B, H, m) (-1: a zero row) -> (B, H, m, d)."""
    out = x.gather(2, pos.clamp(min=0)[..., None].expand(-1, -1, -1, x.shape[-1]))
    return out.masked_fill((pos < 0)[..., None], 0.0)


def _shared(k, v, key_mask, shared_keys):
    """The shared keys and values (B, H, E, d) and which are real (B, E), or None."""
    if shared_keys is None:
        return None
    real = shared_keys if key_mask is None else shared_keys & key_mask
    if not bool(real.any()):
        return None
    pos, ok = token_rows(real)
    idx = pos[:, None, :].expand(-1, k.shape[1], -1)
    return _take(k, idx), _take(v, idx), ok


def _normalise(scores: torch.Tensor, ok: torch.Tensor, with_lse: bool):
    """softmax over the allowed entries of the last dim (rows with none: zeros, log-sum-exp -inf)."""
    has = ok.any(-1, keepdim=True)
    scores = scores.masked_fill(~ok, float("-inf")).masked_fill(~has, 0.0)
    lse = torch.logsumexp(scores, -1).masked_fill(~has[..., 0], float("-inf")) if with_lse else None
    return scores.softmax(-1) * has, lse


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: Pattern,
    *,
    key_mask: torch.Tensor | None,
    scale: float,
    dropout: float = 0.0,
    with_lse: bool = False,
    kernel: str = "gather",
):
    """Softmax attention of q (B, H, N, d) to k, v (B, H, S, d / dv) on ``pattern``'s pairs only: (B, H, N, dv) in
    v's dtype (with ``with_lse``: in the compute dtype, float32 for half inputs, ready for :func:`combine`), and with
    ``with_lse`` the log-sum-exp of every query's allowed scores (B, H, N), float32 or float64
    (-inf for a query with no allowed key, whose output is 0).

    ``kernel``: ``"gather"`` (this module's plain-torch kernel), ``"flex"`` (compiled FlexAttention on the same
    pattern: :mod:`._flex`; an error when it cannot run the call), ``"band"`` (the banded kernel, :mod:`._band`, for
    a ``pattern.band``, the block-band kernel, :mod:`._blockband`, for ``pattern.neighbours``; an error when it
    cannot run the call) or ``"auto"`` (in CPU inference on short inputs SDPA over the pattern's dense mask, see
    :func:`._dense.try_dense`; on the CPU the banded kernels where they can run the call; else flex where
    it can and the sequence is long enough to repay it, see ``_flex.worth_it``; else gather); ``"fused"``: what
    ``"auto"`` runs, with the block-band kernel's C++ form (``_blockband.attend(fused=True)``) in its place where it
    runs (off the CPU, with a warning)."""
    how = dict(key_mask=key_mask, scale=scale, dropout=dropout, with_lse=with_lse)
    done = _other_kernels(q, k, v, pattern, kernel=kernel, **how)
    if done is not None:
        return done
    dt, out_dtype = compute_dtype(q.dtype), v.dtype
    key_mask = safe_key_mask(key_mask)
    b, h, n, d = q.shape
    s, dv, blk = k.shape[2], v.shape[-1], pattern.block
    q, k, v = q.to(dt), k.to(dt), zero_padded_values(v.to(dt), key_mask)
    tq, tk = math.ceil(n / blk), math.ceil(s / blk)
    qpos = _sorted_positions(pattern.q_order, b, h, n, tq * blk, q.device)  # (B, H, Tq * blk)
    kpos = _sorted_positions(pattern.k_order, b, h, s, tk * blk, q.device)
    qs, ks, vs = _take(q, qpos) * scale, _take(k, kpos), _take(v, kpos)
    key_ok = kpos >= 0
    if key_mask is not None or pattern.shared_keys is not None:
        batch = _batch_index(b, q.device)
        if key_mask is not None:
            key_ok = key_ok & key_mask[batch, kpos.clamp(min=0)]
        if pattern.shared_keys is not None:  # computed in the shared strip, not again in the blocks
            key_ok = key_ok & ~pattern.shared_keys[batch, kpos.clamp(min=0)]
    k_tab, v_tab = ks.reshape(b * h * tk, blk, d), vs.reshape(b * h * tk, blk, dv)
    pos_tab, ok_tab = kpos.reshape(b * h * tk, blk), key_ok.reshape(b * h * tk, blk)
    kvb = pattern.kv_blocks.expand(b, h, tq, -1)
    n_kv = kvb.shape[-1]
    blocks = kvb.clamp(0, tk - 1) + (torch.arange(b * h, device=q.device) * tk).view(b, h, 1, 1)
    bvalid = (kvb >= 0) & (kvb < tk)
    if pattern.kv_valid is not None:
        bvalid = bvalid & pattern.kv_valid.expand(b, h, tq, -1)
    shared = _shared(k, v, key_mask, pattern.shared_keys)
    n_sh = 0 if shared is None else shared[0].shape[2]
    out = qs.new_empty(b, h, tq * blk, dv)
    lse = qs.new_empty(b, h, tq * blk) if with_lse else None
    per = max(1, chunk_elements(_CHUNK_ELEMENTS, q.device) // max(1, b * h * blk * (n_kv * blk + n_sh)))
    for t0 in range(0, tq, per):
        t1 = min(tq, t0 + per)
        c, rows = t1 - t0, slice(t0 * blk, t1 * blk)
        idx = blocks[:, :, t0:t1].reshape(-1)
        kg = k_tab.index_select(0, idx).view(b, h, c, n_kv * blk, d)
        jpos = pos_tab.index_select(0, idx).view(b, h, c, n_kv * blk)
        ok = ok_tab.index_select(0, idx).view(b, h, c, n_kv, blk) & bvalid[:, :, t0:t1, :, None]
        ok = ok.view(b, h, c, 1, n_kv * blk)
        qc = qs[:, :, rows].reshape(b, h, c, blk, d)
        scores = qc @ kg.transpose(-1, -2)  # (B, H, c, blk, K * blk)
        ipos = qpos[:, :, rows].reshape(b, h, c, blk).clamp(min=0)
        jc = jpos.clamp(min=0)
        if pattern.allow is not None:
            ok = ok & pattern.allow(ipos[..., :, None], jc[..., None, :])
        if pattern.bias is not None:
            scores = scores + pattern.bias(ipos[..., :, None], jc[..., None, :])
        ok = ok.expand_as(scores)
        if shared is not None:
            scores = torch.cat([scores, qc @ shared[0][:, :, None].transpose(-1, -2)], -1)
            ok = torch.cat([ok, shared[2][:, None, None, None, :].expand(b, h, c, blk, n_sh)], -1)
        p, lse_c = _normalise(scores, ok, with_lse)
        if dropout > 0.0:
            p = F.dropout(p, dropout)
        o = p[..., : n_kv * blk] @ v_tab.index_select(0, idx).view(b, h, c, n_kv * blk, dv)
        if shared is not None:
            o = o + p[..., n_kv * blk :] @ shared[1][:, :, None]
        out[:, :, rows] = o.reshape(b, h, c * blk, dv)
        if with_lse:
            lse[:, :, rows] = lse_c.reshape(b, h, c * blk)
    out, lse = _unsort(out, lse, pattern.q_order, n)
    if pattern.global_queries is not None and bool(pattern.global_queries.any()):
        out, lse = _global_rows(q, scale, k, v, key_mask, pattern.global_queries, out, lse, dropout)
    return (out, lse) if with_lse else out.to(out_dtype)  # to combine: in the compute dtype


def _other_kernels(q, k, v, pattern: Pattern, *, kernel: str, **how):
    """The output of the kernel ``kernel`` picks other than gather (the dense route, the banded kernels, flex; see
    :func:`attend`), or None for the gather kernel. ``"fused"`` is ``"auto"`` with the block-band kernel's C++ form."""
    from . import _dense

    fused = kernel == FUSED
    if fused:
        kernel = "auto"
        if q.device.type != "cpu":
            warnings.warn(
                f"approx: kernel='fused' runs its C++ kernel on the CPU only; on {q.device} it runs what 'auto' runs",
                stacklevel=4,
            )
    done = _dense.try_dense(q, k, v, pattern, **how, kernel=kernel)
    if done is None:
        done = _try_band(q, k, v, pattern, **how, kernel=kernel, fused=fused)
    if done is None:
        done = _try_flex(q, k, v, pattern, **how, kernel=kernel)
    return done


def _try_band(
    q, k, v, pattern: Pattern, *, key_mask, scale, dropout, with_lse, kernel, fused: bool = False
) -> torch.Tensor | None:
    """The banded kernels' output when ``kernel`` asks for them (``"band"``, or ``"auto"`` on the CPU for a band or
    neighbouring blocks) and they can run the call; None to go on; an error for ``"band"`` when they cannot.
    ``fused``: neighbouring blocks on the block-band kernel's C++ form."""
    banded = pattern.band is not None or pattern.neighbours is not None
    if not (kernel == BAND or (kernel == "auto" and q.device.type == "cpu" and banded)):
        return None
    key_mask = safe_key_mask(key_mask)
    why = _band_unusable(q, k, v, pattern, key_mask=key_mask, dropout=dropout, with_lse=with_lse)
    if why is None:
        if pattern.band is not None:
            return _attend_band(q, k, v, pattern, key_mask=key_mask, scale=scale)
        return _attend_blockband(q, k, v, pattern, key_mask=key_mask, scale=scale, fused=fused)
    if kernel == BAND:
        raise RuntimeError(
            f"kernel='band' cannot run this call: {why}; kernel='auto' picks a kernel that can (or name 'gather')"
        )
    return None


def _try_flex(q, k, v, pattern: Pattern, *, key_mask, scale, dropout, with_lse, kernel):
    """FlexAttention's output (:mod:`._flex`) when ``kernel`` is ``"flex"``, or ``"auto"`` on an inference call long
    enough to repay it (``_flex.worth_it``) that it can run; None to go on with the gather kernel; an error for
    ``"flex"`` when it cannot run the call."""
    if kernel == "gather":
        return None
    from . import _flex

    why = _flex.unusable(q, k, v, pattern, dropout=dropout, with_lse=with_lse)
    # auto: inference only (FlexAttention's GPU backward picks tiles that must divide the blocks, 128 rows on an H100
    # at head dim 64, and compiles at the first backward, too late to fall back; not measured yet)
    grad = tracked(q, k, v)
    if why is None and (kernel == "flex" or (not grad and _flex.worth_it(q, k, pattern))):
        done = _flex.attend(q, k, v, pattern, key_mask=key_mask, scale=scale, with_lse=with_lse)
        if done is not None:
            return done
        why = _flex.unusable(q, k, v, pattern, dropout=dropout, with_lse=with_lse)  # it failed to compile
    if kernel == "flex":
        raise RuntimeError(f"kernel='flex' cannot run this call: {why}")
    return None


def _attend_band(q, k, v, pattern: Pattern, *, key_mask, scale: float) -> torch.Tensor:
    """The banded kernel (:mod:`._band`) on a window pattern, and the global queries' dense rows written over it."""
    from . import _band

    out_dtype = v.dtype
    out = _band.attend(
        q,
        k,
        v,
        reach=pattern.band,
        block=pattern.block,
        key_mask=key_mask,
        shared_keys=pattern.shared_keys,
        scale=scale,
    )
    if pattern.global_queries is not None and bool(pattern.global_queries.any()):
        dt = out.dtype
        v = zero_padded_values(v.to(dt), key_mask)
        out, _ = _global_rows(
            q.to(dt), scale, k.to(dt), v, key_mask, pattern.global_queries, out, None, 0.0, inplace=True
        )
    return out.to(out_dtype)


def _attend_blockband(q, k, v, pattern: Pattern, *, key_mask, scale: float, fused: bool = False) -> torch.Tensor:
    """The block-band kernel (:mod:`._blockband`; ``fused``: its C++ form) on a pattern with ``neighbours``, in v's
    dtype."""
    from . import _blockband

    return _blockband.attend(q, k, v, pattern, key_mask=key_mask, scale=scale, fused=fused).to(v.dtype)


def _band_unusable(q, k, v, pattern: Pattern, *, key_mask, dropout: float, with_lse: bool) -> str | None:
    """Why ``kernel="band"`` cannot run this call (None: it can): the banded kernel (:mod:`._band`) for a
    ``pattern.band``, the block-band kernel (:mod:`._blockband`) for ``pattern.neighbours``."""
    from . import _band

    if pattern.band is None and pattern.neighbours is not None:
        from . import _blockband

        return _blockband.unusable(q, k, v, pattern, key_mask=key_mask, dropout=dropout, with_lse=with_lse)
    if pattern.band is None:
        return "the pattern is not a contiguous band (window with dilation 1) nor neighbouring blocks (bigbird)"
    if with_lse:
        return "it returns no log-sum-exp"
    g = 0 if pattern.shared_keys is None else int(pattern.shared_keys.sum(-1).max())
    return _band.unusable(q, k, v, reach=pattern.band, block=pattern.block, shared=g, dropout=dropout)


def _unsort(out, lse, order, n, inv=None):
    """Back from sorted slots to original positions: (B, H, N, dv) and (B, H, N); ``inv``: ``order.argsort(-1)``
    when the caller has it."""
    if order is None:
        return out[:, :, :n], None if lse is None else lse[:, :, :n]
    inv = (order.argsort(-1) if inv is None else inv).expand(out.shape[0], out.shape[1], n)
    out = out.gather(2, inv[..., None].expand(-1, -1, -1, out.shape[-1]))
    return out, None if lse is None else lse.gather(2, inv)


def _global_rows(q, scale, k, v, key_mask, global_queries, out, lse, dropout, *, inplace=False, rows=None):
    """Replace the rows of global queries by dense attention to every real key: each batch row's global queries
    left-aligned, (B, H, G, S) scores in chunks of queries (no copy of K or V per global query), the scores and the
    softmax in the compute dtype (float32 for half inputs), the value product in the values' dtype. Without key
    padding, log-sum-exp or dropout, and with every listed query real, a chunk is five launches (no masks: on a GPU
    each launch costs more than this arithmetic), the same numbers. ``inplace``: ``out`` is the caller's own (no
    gradient), written in place. ``rows``: :func:`global_rows` of ``global_queries`` when the caller has it."""
    pos, real, every = global_rows(global_queries) if rows is None else rows  # (B, G), (B, G), bool
    b, h, _, d = q.shape
    s = k.shape[2]
    dt = compute_dtype(q.dtype)
    kt = k.to(dt).transpose(-1, -2)  # scores in float32 for half inputs (one copy of K): not rounded to 8 bits
    plain = key_mask is None and lse is None and dropout == 0.0 and every
    ok = torch.ones(b, 1, 1, s, dtype=torch.bool, device=q.device) if key_mask is None else key_mask[:, None, None, :]
    if not inplace:
        out, lse = out.clone(), None if lse is None else lse.clone()
    step = max(1, chunk_elements(_CHUNK_ELEMENTS, q.device) // max(1, b * h * s))
    for g0 in range(0, pos.shape[1], step):
        idx = pos[:, g0 : g0 + step]  # (B, g)
        qg = q.gather(2, idx[:, None, :, None].expand(b, h, -1, d)).to(dt) * scale  # (B, H, g, d)
        slots = idx[:, None, :, None].expand(b, h, -1, out.shape[-1])
        if plain:  # every key and every listed query real: no masks to apply
            new = (torch.softmax(qg @ kt, -1).to(v.dtype) @ v).to(out.dtype)
            out = out.scatter_(2, slots, new) if inplace else out.scatter(2, slots, new)
            continue
        p, lse_g = _normalise(qg @ kt, ok.expand(b, h, idx.shape[1], s), lse is not None)
        if dropout > 0.0:
            p = F.dropout(p, dropout)
        keep = real[:, None, g0 : g0 + step, None]  # (B, 1, g, 1): padding entries of the left-aligned list
        new = torch.where(keep, (p.to(v.dtype) @ v).to(out.dtype), out.gather(2, slots))
        out = out.scatter_(2, slots, new) if inplace else out.scatter(2, slots, new)
        if lse is not None:
            lse = lse.scatter(
                2,
                idx[:, None, :].expand(b, h, -1),
                torch.where(keep[..., 0], lse_g, lse.gather(2, idx[:, None, :].expand(b, h, -1))),
            )
    return out, lse


def global_rows(global_queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The global queries (B, N) as :func:`_global_rows` takes them: their positions left-aligned (B, G), which of
    those are real, and whether all are (one host synchronisation)."""
    pos, real = token_rows(global_queries)
    return pos, real, bool(real.all())


def combine(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Outputs of several patterns over disjoint (or de-duplicated) pairs merged into one softmax:
    O = sum_r exp(L_r - L) O_r with L = logsumexp_r L_r (a query with no pair anywhere gets 0), one
    :func:`merge` after the other (without gradients to track, into ``outs[0]``)."""
    out, lse = outs[0], lses[0]
    for o, o_lse in zip(outs[1:], lses[1:], strict=True):
        out, lse = merge(out, lse, o, o_lse)
    return out


def merge(out: torch.Tensor, lse: torch.Tensor, other: torch.Tensor, other_lse: torch.Tensor):
    """Two softmax outputs over disjoint pairs, (..., N, dv) with their log-sum-exps (..., N), merged into the
    softmax over both: ``(exp(L1 - L) O1 + exp(L2 - L) O2, L)`` with ``L = logaddexp(L1, L2)``; a query with no
    pair in either gets 0. A running merge holds two outputs where :func:`combine` over a list holds them all
    (LSH merges each round as it ends). Without gradients to track, ``out`` is overwritten with the result.

    The log-sum-exps and weights are computed in float64 (from float32 or half log-sum-exps): torch computes
    ``logaddexp`` and ``exp`` in vector lanes and a scalar tail whose boundaries move with the tensor's size (and
    its split between threads), and the two round the same input differently in the last bit, so an input's
    output changed with what else its batch held (LSH: one token by 3e-7 in one layer of MiniLM, then, across near
    ties in a later layer's sort, by up to 0.2 in its last hidden states). A last-bit difference in float64 is
    lost when the weights are rounded to the inputs' dtype (but for the rare value within that bit of a rounding
    boundary). The returned log-sum-exp keeps its dtype. (LSH's inference path, where speed matters most, merges in
    float32 on buffers without a scalar tail instead: ``_lshrounds._merge_round``.)"""
    dt = lse.dtype
    total = torch.logaddexp(lse.to(torch.float64), other_lse)
    finite = total.masked_fill(torch.isinf(total), 0.0)  # no pair anywhere: both weights exp(-inf) = 0
    w, w_other = torch.exp(lse - finite)[..., None], torch.exp(other_lse - finite)[..., None]
    w, w_other, total = w.to(out.dtype), w_other.to(other.dtype), total.to(dt)
    if torch.is_grad_enabled() and (out.requires_grad or other.requires_grad or w.requires_grad):
        return out * w + other * w_other, total
    return out.mul_(w).addcmul_(other, w_other), total


# ------------------------------------------------------------------------------------------ dense paths


def _block_table(pattern: Pattern, b: int, h: int, tq: int, tk: int, device) -> torch.Tensor:
    """(B, H, Tq, Tk) bool: the key blocks each query block attends, from the pattern's block lists."""
    kvb = pattern.kv_blocks.expand(b, h, tq, -1)
    valid = (kvb >= 0) & (kvb < tk)
    if pattern.kv_valid is not None:
        valid = valid & pattern.kv_valid.expand(b, h, tq, -1)
    table = torch.zeros(b, h, tq, tk + 1, dtype=torch.bool, device=device)  # column tk: the invalid entries
    table.scatter_(-1, kvb.clamp(0, tk - 1).masked_fill(~valid, tk), True)
    return table[..., :tk]


def dense_mask(pattern: Pattern, *, b: int, h: int, n: int, s: int, key_mask, device):
    """The pattern as a dense (B, H, N, S) bool mask over original positions and the (B|1, H|1, N, S) additive
    bias (0 where there is none), from the same block lists as :func:`attend` (measuring and tests only)."""
    key_mask = safe_key_mask(key_mask)
    blk = pattern.block
    tq, tk = math.ceil(n / blk), math.ceil(s / blk)
    blockmask = _block_table(pattern, b, h, tq, tk, device)
    # every block's entry over its block x block pairs: one copy of a broadcast view
    whole = blockmask[:, :, :, None, :, None].expand(b, h, tq, blk, tk, blk).reshape(b, h, tq * blk, tk * blk)
    sorted_mask = whole[:, :, :n, :s]
    if pattern.q_order is None and pattern.k_order is None and pattern.bias is None:  # slots are positions
        if pattern.allow is not None:
            i = torch.arange(n, device=device).expand(b, h, n)[..., :, None]  # (B, H, N, 1), as the sorted path
            j = torch.arange(s, device=device).expand(b, h, s)[..., None, :]
            sorted_mask = sorted_mask & pattern.allow(i, j)
        return _with_global_and_real(pattern, sorted_mask, key_mask, n, s), torch.zeros((), device=device)
    qpos = _sorted_positions(pattern.q_order, b, h, n, n, device)  # (B, H, N): original position per slot
    kpos = _sorted_positions(pattern.k_order, b, h, s, s, device)
    if pattern.allow is not None:
        sorted_mask = sorted_mask & pattern.allow(qpos[..., :, None], kpos[..., None, :])
    bias = pattern.bias(qpos[..., :, None], kpos[..., None, :]) if pattern.bias is not None else None
    # un-sort: the slot of original position i is inv[i]
    inv_q = qpos.argsort(-1)
    inv_k = kpos.argsort(-1)
    mask = sorted_mask.gather(2, inv_q[..., None].expand(-1, -1, -1, s)).gather(
        3, inv_k[:, :, None, :].expand(-1, -1, n, -1)
    )
    if bias is not None:
        bias = bias.expand(b, h, n, s).gather(2, inv_q[..., None].expand(-1, -1, -1, s))
        bias = bias.gather(3, inv_k[:, :, None, :].expand(-1, -1, n, -1))
    mask = _with_global_and_real(pattern, mask, key_mask, n, s)
    return mask, (torch.zeros((), device=device) if bias is None else bias)


def _with_global_and_real(pattern: Pattern, mask: torch.Tensor, key_mask, n: int, s: int) -> torch.Tensor:
    """A dense (B|1, H|1, N, S) mask of a pattern's own pairs with its shared keys' columns and global queries' rows
    added, then the padded keys taken out."""
    if pattern.shared_keys is not None:
        mask = mask | pattern.shared_keys[:, None, None, :s]
    if pattern.global_queries is not None:
        mask = mask | pattern.global_queries[:, None, :n, None]
    if key_mask is not None:
        mask = mask & key_mask[:, None, None, :]
    return mask


def dense_weights(q, k, pattern: Pattern, *, key_mask, scale: float) -> torch.Tensor:
    """The dense (B, H, N, S) attention matrix of ``pattern`` (rows without an allowed key are 0); the shared
    keys and global rows carry no bias, as in :func:`attend`."""
    dt = compute_dtype(q.dtype)
    b, h, n, _ = q.shape
    s = k.shape[2]
    mask, bias = dense_mask(pattern, b=b, h=h, n=n, s=s, key_mask=key_mask, device=q.device)
    scores = (q.to(dt) @ k.to(dt).transpose(-1, -2)) * scale
    plain = torch.zeros(b, 1, n, s, dtype=torch.bool, device=q.device)
    if pattern.shared_keys is not None:
        plain = plain | pattern.shared_keys[:, None, None, :s]
    if pattern.global_queries is not None:
        plain = plain | pattern.global_queries[:, None, :n, None]
    scores = scores + torch.where(plain, torch.zeros((), device=q.device, dtype=dt), bias.to(dt))
    return _normalise(scores, mask, False)[0]


def pattern_stats(
    q, k, pattern: Pattern, *, key_mask, scale: float, alpha: float = 1.5, exact_rows: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The pattern's graph against the alpha-entmax gold graph G, as Sparsefinder reports it: counts per head (H,)
    summed over the batch over real queries and keys (``predicted`` |Ĝ|, ``valid`` pairs, ``gold`` |G|, ``hit``
    |G ∩ Ĝ|, ``queries``, ``exact``: queries with G ⊆ Ĝ). ``exact_rows`` (B,) bool: batch rows that get exact
    attention (a method's ``exact_below``), counted with every pair. O(N S): measuring only."""
    from ._fitting import gold_graph  # the entmax gold graph, as for Sparsefinder

    dt = compute_dtype(q.dtype)
    q, k = q.detach().to(dt), k.detach().to(dt)
    b, h, n, _ = q.shape
    s = k.shape[2]
    counted = key_mask  # the real tokens (a row of padding alone has none: nothing of it is counted)
    key_mask = safe_key_mask(key_mask)
    pred, _ = dense_mask(pattern, b=b, h=h, n=n, s=s, key_mask=key_mask, device=q.device)
    if exact_rows is not None:
        real_keys = torch.ones(b, s, dtype=torch.bool, device=q.device) if key_mask is None else key_mask
        pred = pred | (exact_rows[:, None, None, None] & real_keys[:, None, None, :])
    gold = gold_graph(q, k, key_mask, scale, alpha)
    real_q = torch.ones(b, n, dtype=torch.bool, device=q.device) if counted is None or n != s else counted
    if counted is not None and n != s:  # queries of a row without a real key are not counted either
        real_q = real_q & counted.any(-1, keepdim=True)
    real = real_q[:, None, :, None]
    valid = (real & (torch.ones_like(pred) if counted is None else counted[:, None, None, :])).expand_as(pred)
    missed = (gold & ~pred & real).sum(-1)
    return {
        "predicted": (pred & real).sum((0, 2, 3)).double().cpu(),
        "valid": valid.sum((0, 2, 3)).double().cpu(),
        "gold": (gold & real).sum((0, 2, 3)).double().cpu(),
        "hit": (gold & pred & real).sum((0, 2, 3)).double().cpu(),
        "queries": real[..., 0].expand(b, h, n).sum((0, 2)).double().cpu(),
        "exact": ((missed == 0) & real[..., 0]).sum((0, 2)).double().cpu(),
    }
