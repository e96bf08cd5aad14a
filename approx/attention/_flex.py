"""The block-sparse patterns of :mod:`._blocksparse` run by PyTorch's FlexAttention (compiled).

``torch.nn.attention.flex_attention`` takes a ``BlockMask`` (which key blocks each query block visits) and a
``mask_mod`` / ``score_mod`` evaluated inside the visited blocks; compiled, it never forms an (N, S) matrix and
fuses the scores, the online softmax and the value sum. Measured against the gather kernel on the same pattern
(``benchmarks/flex_vs_gather.py``; docs' Speed page) it is several times faster on long CPU inputs, but on the CPU
it has **no backward pass**, it needs a C++ compiler and a first compilation of seconds per dtype, and it does not
take float64. So ``kernel="auto"`` (the sparse-pattern methods' default) uses it only where it can run the call and
repay the compilation: no gradient (on a GPU its backward runs and the GPU tests check it against the gather
kernel's autograd, but its speed is unmeasured: ``kernel="flex"`` asks for it), no dropout,
float32 / float16 / bfloat16, at least :data:`MIN_LENGTH` keys, on the CPU not where shared keys in most blocks would
make it visit far more keys than the gather kernel scores (:func:`_shared_everywhere`: the fixed Sparse Transformer's
summary keys); everything else runs the gather kernel, which gives
the same output to float rounding (a test checks it). A compilation failure is reported once (a warning naming the
reason) and the gather kernel is used from then on.

A pattern kept by ``_blocksparse.cached`` (a function of the shapes and options) keeps the block mask built for it
for inputs without key padding, so that a steady call rebuilds no mask; on a GPU, rebuilding them cost more than
the kernel (docs' Speed page, "On a GPU"). The rows of global queries, which attend every key, run inside the block
mask or after the kernel as dense rows (:data:`GLOBAL_ROWS`).

The pattern is translated as it is: queries and keys are put in the pattern's sorted order, every query block's
key blocks (its own, the blocks holding shared keys, every block for a block holding a global query) form the
``BlockMask``, and ``mask_mod`` looks the original positions up to apply the pattern's own block membership, its
``allow`` function, key padding, shared keys and global queries; ``bias`` becomes a ``score_mod``. The pattern's
functions are called on one pair at a time (shape (1, 1, 1) positions), so they must be functions of the
positions only (``Pattern.flex = False`` says otherwise, e.g. LSH's per-round lookups).
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from ._blocksparse import account, global_rows
from ._common import compute_dtype, safe_key_mask, zero_padded_values
from ._compiled import compile_errors

__all__ = ["MIN_LENGTH", "attend", "unusable", "worth_it"]

# keys from which kernel="auto" takes FlexAttention (the compiled kernel's per-call overhead is repaid; see the
# docs' Speed page for the measurement)
MIN_LENGTH = 1024
# the largest forward tile asked of the GPU kernel; blocks must be multiples of 16 there (Triton's matrix tiles)
GPU_TILE = 64
# where the rows of global queries (which attend every key) are computed: "apart", as dense rows after the kernel
# (matrix products over every key, spread over the whole device, a few more launches), "mask", inside the block
# mask, where their query block visits every key block (our reading of the timings: on a GPU that block's thread
# blocks walk the whole sequence while the others are done), or "auto": apart from ROWS_APART_FROM keys. Measured
# on an H200 (bfloat16, window 256 with CLS global, docs' Speed page): in the mask 0.34 / 0.62 / 1.81 ms at
# N = 4096 / 16384 / 65536, apart 0.67 / 0.87 / 1.14 ms; the threshold lies between the two lengths measured on
# either side of the crossover
GLOBAL_ROWS = "auto"
ROWS_APART_FROM = 32768
_COMPILED = None
_RAISE = False  # debugging: let a compilation error through
_BROKEN: dict[str, str] = {}  # device type -> why compiling failed there once (then the gather kernel is used)
# compiled shapes per device type: torch.compile specialises on every shape and pattern (several methods and lengths
# in one process), and after its recompile limit (8 by default, for all of them together) it runs the *uncompiled*
# flex_attention, a dense O(N S) computation; approx's calls raise that limit to this, and kernel="auto" stops
# asking flex for new shapes once it is reached (a warning says so)
MAX_SHAPES = 64
_SHAPES: dict[str, set] = {}


_COMPILE_ERRORS = compile_errors()


def _call(qs, ks, vs, score_mod, mask, scale: float, with_lse: bool, blk: int):
    """The compiled flex_attention: (out, lse) with ``with_lse`` (not on the CPU: see :func:`unusable`), else out.

    On a GPU the kernel's tiles must divide the pattern's blocks, and inductor's default tiles are up to 128 rows
    (an H100 at head dim 64 in bfloat16), so the forward tiles are set to at most the block (:data:`GPU_TILE`)."""
    options = {}
    if qs.device.type != "cpu":
        options["kernel_options"] = {"BLOCK_M": min(GPU_TILE, blk), "BLOCK_N": min(GPU_TILE, blk)}
    if with_lse:
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = _flex_fn()(
            qs, ks, vs, score_mod=score_mod, block_mask=mask, scale=scale, return_aux=AuxRequest(lse=True), **options
        )
        return out, aux.lse
    return _flex_fn()(qs, ks, vs, score_mod=score_mod, block_mask=mask, scale=scale, **options)


def _flex_fn():
    global _COMPILED
    if _COMPILED is None:
        from torch.nn.attention.flex_attention import flex_attention

        # static shapes: with dynamic=True inductor's CPU code (torch 2.13) confuses the size of a captured table
        # with the query split size and fails to compile; lengths are bucketed instead (_bucket)
        _COMPILED = torch.compile(flex_attention, dynamic=False)
    return _COMPILED


def unusable(q, k, v, pattern, *, dropout: float, with_lse: bool = False) -> str | None:
    """Why FlexAttention cannot run this call, or None when it can."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return "this torch has no torch.nn.attention.flex_attention"
    if not getattr(pattern, "flex", True):
        return "this pattern's functions are not position-only"
    if dropout > 0.0:
        return "attention dropout is not applied by FlexAttention here"
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"FlexAttention does not take {q.dtype}"
    if q.device.type == "cpu" and with_lse:
        return "compiled FlexAttention on the CPU does not return the log-sum-exp (needed to combine patterns)"
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return "FlexAttention has no backward pass on the CPU"
    blk = getattr(pattern, "block", 64)
    if q.device.type != "cpu" and blk % 16:
        return f"FlexAttention's GPU kernels take blocks of a multiple of 16 rows, not {blk}"
    if blk % 16:  # measured on torch 2.13's CPU build: 2-7, 10-14, 20, 28 agreed with the gather kernel
        return (
            f"FlexAttention is used on the CPU with blocks of a multiple of 16 rows only, not {blk}: its compiled "
            "CPU kernel gave wrong outputs at blocks of 8, 24 and 40 rows (NaN at 24), with no error"
        )
    if q.device.type in _BROKEN:
        return f"FlexAttention failed to compile earlier on {q.device.type} ({_BROKEN[q.device.type]})"
    return None


def worth_it(q, k, pattern=None) -> bool:
    """kernel='auto': long enough to repay the compiled kernel (and its compilation), on the CPU not a pattern whose
    shared keys would make FlexAttention visit far more keys than the gather kernel scores (:func:`_shared_everywhere`),
    and a shape already compiled or room for one more (see :data:`MAX_SHAPES`; a warning says when the limit is
    reached)."""
    if k.shape[2] < MIN_LENGTH:
        return False
    if q.device.type == "cpu" and _shared_everywhere(pattern, k.shape[2]):
        return False
    shapes = _SHAPES.setdefault(q.device.type, set())
    blk = getattr(pattern, "block", 64)
    key = (tuple(q.shape[:2]), _bucket(q.shape[2], blk), _bucket(k.shape[2], blk), q.dtype, blk, q.shape[-1])
    if key in shapes or len(shapes) < MAX_SHAPES:
        shapes.add(key)
        return True
    if len(shapes) == MAX_SHAPES:
        shapes.add(None)  # warn once
        warnings.warn(
            f"approx: FlexAttention has compiled {MAX_SHAPES} shapes in this process; new shapes run the gather "
            "kernel (pad inputs to a few lengths, or pass kernel='flex' to compile anyway)",
            RuntimeWarning,
            stacklevel=4,
        )
    return False


def _shared_everywhere(pattern, s: int) -> bool:
    """Whether FlexAttention would visit more than twice the keys per query block that the gather kernel scores,
    because of the pattern's shared keys: every query block visits each key block (in the pattern's sorted order)
    that holds a shared key, where the gather kernel scores the shared keys once as a strip. The Sparse
    Transformer's fixed pattern has summary keys in every block of l: about 8x at any stride (c = 8 of every l keys),
    and on FlexAttention it ran 0.29-0.58x the gather kernel's speed at 2048-8192 tokens with split heads, 0.21-0.49x
    in union mode (``attention_op_cpu_sparse_fixed``, docs' Speed page). A window whose question tokens are shared
    fills the blocks they lie in: about 1x, FlexAttention kept. One batch row over the limit decides for the call."""
    shared = getattr(pattern, "shared_keys", None)
    if shared is None:
        return False
    from ._blocksparse import _sorted_positions

    shared = shared[:, :s]
    blk, b = pattern.block, shared.shape[0]
    tk = -(-s // blk)
    order = pattern.k_order
    kpos = _sorted_positions(order, b, 1 if order is None else order.shape[1], s, tk * blk, shared.device)
    batch = torch.arange(b, device=shared.device)[:, None, None]
    in_slot = (kpos >= 0) & shared[batch, kpos.clamp(min=0)]  # (B, H|1, Tk * blk): a shared key at each sorted slot
    blocks = in_slot.view(*in_slot.shape[:2], tk, blk).any(-1).sum(-1)  # key blocks holding one
    own = pattern.kv_blocks.shape[-1]  # the key blocks each query block lists
    visited = (blocks + own).clamp(max=tk) * blk
    return bool((visited > 2 * (own * blk + shared.sum(-1)[:, None])).any())


def _bucket(n: int, blk: int) -> int:
    """The padded length compiled for n: a multiple of the block and of a quarter of n's octave (at most a quarter
    more rows and keys; four compiled shapes per doubling of the length, as ``torch.compile`` specialises on shapes)."""
    quarter = (1 << max(0, n.bit_length() - 1)) // 4
    step = blk * max(1, -(-quarter // blk))
    return -(-n // step) * step


def _block_lists(pattern, b, h, tq, tk, qpos, kpos, key_ok, device, *, global_blocks=True):
    """(B, H, Tq, Tk) bool each: the pattern's own key blocks, the visited ones (shared keys' and, with
    ``global_blocks``, global queries' blocks too) and the *full* ones, where every pair is in without looking
    (FlexAttention skips ``mask_mod`` there): own blocks the pattern marks full (``kv_full``; every own block when
    it has no ``allow``) with only real keys."""
    from ._blocksparse import _batch_index  # noqa: PLC0415

    kvb = pattern.kv_blocks.expand(b, h, tq, -1)
    valid = (kvb >= 0) & (kvb < tk)
    if pattern.kv_valid is not None:
        valid = valid & pattern.kv_valid.expand(b, h, tq, -1)

    def scatter(which):
        m = torch.zeros(b, h, tq, tk + 1, dtype=torch.bool, device=device)
        return m.scatter_(-1, kvb.clamp(0, tk - 1).masked_fill(~which, tk), True)[..., :tk]

    own = scatter(valid)
    candidate = pattern.kv_full
    if candidate is None and pattern.allow is None:
        candidate = torch.ones((), dtype=torch.bool, device=device)
    full = torch.zeros_like(own)
    if candidate is not None:
        real_block = key_ok.view(b, h, tk, -1).all(-1)  # (B, H, Tk): no padded key in the block
        full = scatter(valid & candidate.expand(b, h, tq, kvb.shape[-1])) & real_block[:, :, None, :]
    visit = own.clone()
    batch = _batch_index(b, device)
    if pattern.shared_keys is not None:
        shared_slot = (kpos >= 0) & pattern.shared_keys[batch, kpos.clamp(min=0)]  # (B, H, Tk * blk)
        visit |= shared_slot.view(b, h, tk, -1).any(-1)[:, :, None, :]
    if pattern.global_queries is not None and global_blocks:
        global_slot = (qpos >= 0) & pattern.global_queries[batch, qpos.clamp(min=0)]
        visit |= global_slot.view(b, h, tq, -1).any(-1)[..., None]
    return own, visit, full


def _lists(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, Tq, Tk) bool -> FlexAttention's counts (B, H, Tq) and block indices (B, H, Tq, Tk), int32."""
    counts = blocks.sum(-1, dtype=torch.int32)
    return counts, blocks.to(torch.uint8).argsort(dim=-1, descending=True, stable=True).to(torch.int32)


def _mods(pattern, qpos, kpos, key_ok, own, batch):
    """FlexAttention's ``mask_mod`` and ``score_mod`` (None without a bias) of a pattern, over sorted slots: the
    pattern's own blocks and ``allow``, shared keys and global queries, key padding; look-ups only where needed."""
    blk = pattern.block
    qpos0, kpos0 = qpos.clamp(min=0), kpos.clamp(min=0)
    # shared keys and global queries per sorted slot (a lookup by slot: inductor's CPU code generation fails on a
    # table indexed by a value read from another table)
    shared = None if pattern.shared_keys is None else pattern.shared_keys[batch, kpos0] & (kpos >= 0)
    glob = None if pattern.global_queries is None else pattern.global_queries[batch, qpos0] & (qpos >= 0)
    allow, bias, plain_fn = pattern.allow, pattern.bias, pattern.plain

    # look-ups only where needed: positions when sorted, own blocks unless allow implies them, key padding
    sorted_q, sorted_k = pattern.q_order is not None, pattern.k_order is not None
    check_own = allow is None or not pattern.allow_implies_blocks
    check_keys = not bool(key_ok.all())

    def pair(bi, hi, qi, kj):
        i = qpos0[bi, hi, qi] if sorted_q else qi
        j = kpos0[bi, hi, kj] if sorted_k else kj
        inside = own[bi, hi, qi // blk, kj // blk] if check_own else None
        if allow is not None:
            inside = allow(i, j) if inside is None else inside & allow(i, j)
        if plain_fn is not None:  # shared keys and global queries as a function of the positions
            return i, j, inside, plain_fn(i, j)
        plain = None  # a shared key or a global query: in, whatever the pattern says
        if shared is not None:
            plain = shared[bi, hi, kj]
        if glob is not None:
            plain = glob[bi, hi, qi] if plain is None else plain | glob[bi, hi, qi]
        return i, j, inside, plain

    def mask_mod(bi, hi, qi, kj):
        _, _, inside, plain = pair(bi, hi, qi, kj)
        ok = inside if plain is None else inside | plain
        return key_ok[bi, hi, kj] & ok if check_keys else ok

    score_mod = None
    if bias is not None:

        def score_mod(score, bi, hi, qi, kj):
            i, j, _, plain = pair(bi, hi, qi, kj)
            return score + (bias(i, j) if plain is None else torch.where(plain, 0.0, bias(i, j)))

    return mask_mod, score_mod


def _prepare(pattern, b, h, n, s, key_mask, device):
    """What a call derives from the pattern and the key padding alone: the bucketed block counts, the original
    position at every sorted slot, the ``BlockMask``, the ``score_mod`` and the inverse of the query order."""
    from torch.nn.attention.flex_attention import BlockMask

    from ._blocksparse import _batch_index, _sorted_positions

    blk = pattern.block
    tq0, tk0 = math.ceil(n / blk), math.ceil(s / blk)
    tq, tk = _bucket(n, blk) // blk, _bucket(s, blk) // blk  # a few lengths per octave: few compilations
    qpos = _sorted_positions(pattern.q_order, b, h, n, tq * blk, device)
    kpos = _sorted_positions(pattern.k_order, b, h, s, tk * blk, device)
    batch = _batch_index(b, device)
    key_ok = kpos >= 0
    if key_mask is not None:
        key_ok = key_ok & key_mask[batch, kpos.clamp(min=0)]
    apart = _rows_apart(pattern, s)
    lists = _block_lists(
        pattern,
        *(b, h, tq0, tk0),
        *(qpos[..., : tq0 * blk], kpos[..., : tk0 * blk], key_ok[..., : tk0 * blk]),
        device,
        global_blocks=not apart,
    )
    own, visit, full = (F.pad(m, (0, tk - tk0, 0, tq - tq0)) for m in lists)  # the bucket's extra blocks: none
    mask_mod, score_mod = _mods(pattern, qpos, kpos, key_ok, own, batch)
    partial_counts, partial = _lists(visit & ~full)
    full_counts, full_idx = _lists(full) if bool(full.any()) else (None, None)
    mask = BlockMask.from_kv_blocks(
        partial_counts,
        partial,
        full_counts,
        full_idx,
        BLOCK_SIZE=blk,
        mask_mod=mask_mod,
        seq_lengths=(tq * blk, tk * blk),
    )
    inv = None if pattern.q_order is None else pattern.q_order.argsort(-1)  # sorted slot -> original position
    rows = global_rows(pattern.global_queries) if apart else None  # the global queries, computed after the kernel
    return tq, tk, qpos, kpos, mask, score_mod, inv, rows


def _rows_apart(pattern, s: int) -> bool:
    """Whether the global queries' rows are computed after the kernel (:data:`GLOBAL_ROWS`) for ``s`` keys."""
    if GLOBAL_ROWS not in ("auto", "apart", "mask"):
        raise ValueError(f"_flex.GLOBAL_ROWS is {GLOBAL_ROWS!r}; choose 'auto', 'apart' or 'mask'")
    glob = pattern.global_queries
    apart = GLOBAL_ROWS == "apart" or (GLOBAL_ROWS == "auto" and s >= ROWS_APART_FROM)
    return apart and glob is not None and bool(glob.any())


def attend(q, k, v, pattern, *, key_mask, scale: float, with_lse: bool):
    """The pattern's attention through compiled FlexAttention; None when compiling fails (after a warning).

    A pattern kept by ``_blocksparse.cached`` (``pattern.static``) keeps its block mask for inputs without key
    padding: the next call with the same shapes rebuilds no mask."""
    from ._blocksparse import _global_rows, _take, _unsort

    key_mask = safe_key_mask(key_mask)
    b, h, n, _ = q.shape
    s, blk = k.shape[2], pattern.block
    if pattern.static and key_mask is None:
        key = ("flex", b, h, n, s, GLOBAL_ROWS, ROWS_APART_FROM)
        prepared = pattern.derived.get(key)
        if prepared is None:
            prepared = pattern.derived[key] = _prepare(pattern, b, h, n, s, None, q.device)
            account(pattern)  # the entry that keeps the pattern holds the mask too: counted against its limits
    else:
        prepared = _prepare(pattern, b, h, n, s, key_mask, q.device)
    tq, tk, qpos, kpos, mask, score_mod, inv, rows = prepared
    v = zero_padded_values(v, key_mask)

    def slots(x, order, pos, length):  # in the sorted order and padded to the bucket (a copy only when needed)
        if order is not None:
            return _take(x, pos)
        return x if x.shape[2] == length else F.pad(x, (0, 0, 0, length - x.shape[2]))

    qs, ks, vs = (
        slots(q, pattern.q_order, qpos, tq * blk),
        slots(k, pattern.k_order, kpos, tk * blk),
        slots(v, pattern.k_order, kpos, tk * blk),
    )
    try:
        limits = torch._dynamo.config.patch(
            recompile_limit=MAX_SHAPES, accumulated_recompile_limit=max(256, 4 * MAX_SHAPES)
        )
        with limits:
            res = _call(qs, ks, vs, score_mod, mask, scale, with_lse, blk)
    except _COMPILE_ERRORS as err:  # a compiler missing or failing: say so once, then use gather on this device
        if _RAISE:
            raise
        why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        _BROKEN[q.device.type] = why
        warnings.warn(
            f"approx: FlexAttention could not compile ({why}); the sparse-pattern methods use their gather kernel on "
            f"{q.device.type}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    out, lse = (res[0], res[1].float()) if with_lse else (res, None)
    out, lse = _unsort(out, lse, pattern.q_order, n, inv)
    if rows is not None:  # dense rows for the global queries (their kernel rows saw only the visited blocks)
        glob, inplace = pattern.global_queries, not out.requires_grad  # autograd keeps the kernel's output
        out, lse = _global_rows(q, scale, k, v, key_mask, glob, out, lse, 0.0, inplace=inplace, rows=rows)
    return (out.to(compute_dtype(v.dtype)), lse) if with_lse else out.to(v.dtype)
