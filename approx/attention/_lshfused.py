"""LSH's rounds in one C++ pass per query cluster, for CPU inference: ``lsh`` with ``engine="fused"``.

The inference path of :mod:`._lshrounds` is plain torch: per round and chunk of query clusters, a gather of the
queries, keys and values, one batched product, a dozen elementwise passes over the (c x c) scores (the pairs of
earlier rounds, the softmax, its log-sum-exp) and a second product, then a merge of the round into the output. The
two products run at about the rate SDPA reaches; the passes around them, each a trip through memory, took half the
call (torch.profiler, N = 4096, 4 rounds of 128, 2 threads), and held ``lsh`` at 3.4x SDPA against the 4x of issue
#17. :file:`csrc/lsh_rounds.cpp` does the same arithmetic with one query cluster's data in cache: gathered into small
buffers, scored by one BLAS product, masked and exponentiated in vector registers, multiplied by the values, and
merged into the running rows through their maxima and sums (the flash-attention form of the log-sum-exp merge).

It is built on first use (:mod:`._cpp`: a C++ compiler and ``ninja``, about half a minute, then cached on disk). A
build that fails raises an error saying so: the caller asked for this engine, and ``engine="eager"`` computes the same
in plain torch.

The kernel runs where :func:`usable` says (the CPU, no gradient, no attention dropout, cluster numbers exact in the
compute dtype); elsewhere ``engine="fused"`` runs the eager engine's paths, as documented on the option. Half
precision is computed in float32, as on the other paths. tests/test_lsh.py checks it against the loop reference
from the papers' definition in float64, and against the eager engine in float32.
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType

import torch

from . import _cpp, _lshrounds
from ._common import compute_dtype, safe_key_mask, tracked, zero_padded_values

__all__ = ["attend", "build", "usable", "warn_off_cpu"]

# How the kernel splits its work between threads: "auto" takes each (batch, head) row as a task, or each round's
# query clusters when there are fewer rows than threads (one sequence of 12 heads on a machine of more cores would
# otherwise leave the rest idle); "rows" and "clusters" force one (the tests run both; the same arithmetic, each
# query's rounds in order, so the same output to the bit, but for a lone task on several threads: it runs outside a
# parallel region, where MKL may split a product between threads and round it otherwise).
SPLITS = {"auto": 0, "rows": 1, "clusters": 2}
SPLIT = "auto"


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout: float, clusters: int) -> bool:
    """Whether the kernel runs the call: on the CPU, without a gradient to track or attention dropout, with the
    ``clusters`` key cluster numbers exact in the compute dtype (they are compared as floats: below 2^24 in
    float32)."""
    dt = compute_dtype(q.dtype)
    exact = _lshrounds.id_dtype(dt, clusters) == dt
    return q.device.type == "cpu" and dropout == 0.0 and not tracked(q, k, v) and exact


def warn_off_cpu(device: torch.device) -> None:
    """Say that the kernel does not run on ``device`` (once per place in the code, as warnings go)."""
    warnings.warn(
        f"approx: lsh engine='fused' runs its C++ kernel on the CPU only; on {device} it runs what engine='eager' runs",
        stacklevel=3,
    )


@functools.cache
def build() -> ModuleType:
    """The compiled kernel (:func:`._cpp.load`): ``RuntimeError`` when it cannot be built, naming why."""
    return _cpp.load("lsh_rounds", asked="lsh: engine='fused'", instead="engine='eager' (the default)")


def attend(q, k, v, hashed, *, key_mask, scale: float) -> torch.Tensor:
    """The rounds of ``hashed`` (:class:`.lsh.Hashed`) merged: (B, H, N, dv) in v's dtype, as
    :func:`._lshrounds.attend` computes it (up to rounding), without gradients."""
    kernel = build()
    key_mask = safe_key_mask(key_mask)
    if key_mask is not None and bool(key_mask.all()):
        key_mask = None
    dt = compute_dtype(q.dtype)
    b, h, n, d = q.shape
    s, dv = k.shape[2], v.shape[-1]
    rounds = hashed.q_order.shape[0]
    qf = q.to(dt).reshape(b * h * n, d).contiguous()
    # padded keys and values zeroed: a padded key's score is replaced by -inf, which an inf or NaN in it would defeat
    kf = zero_padded_values(k.to(dt), key_mask).reshape(b * h * s, d).contiguous()
    vf = zero_padded_values(v.to(dt), key_mask).reshape(b * h * s, dv).contiguous()
    real = torch.empty(0, dtype=torch.bool) if key_mask is None else key_mask.contiguous()
    out = kernel.attend(
        qf,
        kf,
        vf,
        hashed.q_order.reshape(rounds, b * h, n).contiguous(),
        hashed.k_order.reshape(rounds, b * h, s).contiguous(),
        hashed.target.reshape(rounds, b * h, n).contiguous(),
        hashed.k_cluster.reshape(rounds, b * h, s).contiguous(),
        hashed.kv.reshape(b, -1).contiguous(),
        real,
        h,
        hashed.block,
        float(scale),
        SPLITS[SPLIT],
    )
    return out.view(b, h, n, dv).to(v.dtype)
