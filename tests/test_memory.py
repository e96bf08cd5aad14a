"""approx.harness.memory: the CPU allocation peak against allocations whose sizes are known in advance."""

from __future__ import annotations

import torch

from approx.harness.memory import allocation_peak


def test_allocation_peak_follows_what_is_held_at_once():
    """8 MiB, then 16 MiB while the 8 are held, then the 8 freed and 8 more allocated: at most 24 MiB held at
    once; a buffer held from before the call is not counted; the call's result comes back."""
    mib = 2**20
    before = torch.empty(32 * mib, dtype=torch.uint8)  # held before the call: not counted

    def work():
        a = torch.empty(8 * mib, dtype=torch.uint8)
        b = torch.empty(16 * mib, dtype=torch.uint8)
        del a
        c = torch.empty(8 * mib, dtype=torch.uint8)
        return b.numel() + c.numel()

    out, peak = allocation_peak(work)
    assert out == 24 * mib and peak == 24.0
    del before


def test_allocation_peak_grows_with_the_attention_matrix():
    """Eager attention allocates its (H, N, N) scores: doubling N quadruples the peak above the inputs, within the
    size of the (H, N, d) output; SDPA's peak stays linear in N."""
    h, d = 4, 16
    peaks = {}
    with torch.inference_mode():
        for n in (256, 512):
            q = torch.randn(1, h, n, d)
            peaks["eager", n] = allocation_peak(lambda q=q: (q @ q.transpose(-1, -2)).softmax(-1) @ q)[1]
            peaks["sdpa", n] = allocation_peak(lambda q=q: torch.nn.functional.scaled_dot_product_attention(q, q, q))[1]
    scores = {n: h * n * n * 4 / 2**20 for n in (256, 512)}
    for n in (256, 512):
        assert 2 * scores[n] <= peaks["eager", n] <= 2 * scores[n] + 1  # scores and their softmax, then the output
    assert peaks["sdpa", 512] < 4 * h * 512 * d * 4 / 2**20 + 1  # a few (H, N, d) tensors, no (N, N) one
