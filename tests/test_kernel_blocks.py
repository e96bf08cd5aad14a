"""The kernels' building blocks where real runs take several slices or chunks, or meet their edge cases, against
float64 references (tests/reference.py's, or written here where a pattern or a bias is needed; a fifth mutation round
found these paths untested: every test ran one slice)."""

from __future__ import annotations

import sys

import pytest
import torch
from reference import naive_attention, taylor_kernel_attention

import approx
from approx import ApproxAttention
from approx.attention import _blocksparse, _common, _hashing, _segments


def _softmax_reference(q, k, v, bias, scale):
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.double()
    return scores.softmax(-1) @ v.double()


def test_summaries_attended_in_uneven_slices_of_heads(monkeypatch):
    """Nystrom's and Linformer's inference path takes a few (batch, head) slices at a time: with 5 of them in slices
    of 2, the last slice (of one) is computed too, with each batch item's bias (a -inf entry included)."""
    monkeypatch.setattr(_segments, "_SLICE_ELEMENTS", 2 * 8 * 5)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 1, 8, 4, generator=g, dtype=torch.float64)
    keys = torch.randn(5, 1, 5, 4, generator=g, dtype=torch.float64)
    values = torch.randn(5, 1, 5, 3, generator=g, dtype=torch.float64)
    bias = torch.randn(5, 1, 1, 5, generator=g, dtype=torch.float64)
    bias[4, 0, 0, 2] = float("-inf")
    with torch.no_grad():
        out = _segments.attend_summaries(q, keys, values, bias, 0.5)
    torch.testing.assert_close(out, _softmax_reference(q, keys, values, bias, 0.5), rtol=0, atol=1e-12)


def test_global_queries_in_several_chunks_on_the_gather_kernel(monkeypatch):
    """The window's global queries attend every key, a chunk of rows at a time: with chunks of one row, all three
    global rows (and every other row) equal dense softmax attention over the window's pattern, from its definition."""
    monkeypatch.setattr(_blocksparse, "_CHUNK_ELEMENTS", 2 * 2 * 64)
    g = torch.Generator().manual_seed(1)
    b, h, n, d = 2, 2, 64, 8
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    layer = ApproxAttention("window", approx.get_method("window").make_config(window=4, global_tokens=3,
                                                                              kernel="gather", block=8), head_dim=d)  # fmt: skip
    with torch.no_grad():
        out = layer(q, k, v)
    i = torch.arange(n)
    allowed = ((i[:, None] - i[None, :]).abs() <= 4) | (i[:, None] < 3) | (i[None, :] < 3)
    bias = torch.zeros(n, n, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    torch.testing.assert_close(out, _softmax_reference(q, k, v, bias, d**-0.5), rtol=0, atol=1e-10)


def test_a_row_with_exactly_as_many_real_tokens_as_clusters_is_exact():
    """Clustered attention gives a batch row with at most C real tokens exact attention (C clusters could hold a
    query each): at exactly C = 25, with near-equal queries that the clustering would merge, the row is exact."""
    g = torch.Generator().manual_seed(2)
    b, h, n, d = 2, 2, 60, 8
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    for j in range(1, 12, 2):  # near-equal pairs, which the hashing and K-means would put in one cluster
        q[1, :, j] = q[1, :, j - 1] + 1e-3 * torch.randn(h, d, generator=g, dtype=torch.float64)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, 25:] = False
    layer = ApproxAttention("clustered", approx.get_method("clustered").make_config(clusters=25), head_dim=d)
    with torch.no_grad():
        out = layer(q, k, v, mask)
    ref = naive_attention(q[1:], k[1:], v[1:], mask[1:])
    torch.testing.assert_close(out[1:, :, :25], ref[:, :, :25], rtol=0, atol=1e-10)


def test_the_linear_kernels_normaliser_has_its_floor():
    """Queries whose elu + 1 features are all but 0 (q = -30): the output is phi(q)^T S / max(phi(q)^T z, eps) as the
    option says, not the ratio of two underflowing numbers; the dense weights likewise."""
    g = torch.Generator().manual_seed(3)
    q = torch.full((1, 1, 4, 8), -30.0, dtype=torch.float64)
    k, v = (
        torch.randn(1, 1, 6, 8, generator=g, dtype=torch.float64),
        torch.randn(1, 1, 6, 3, generator=g, dtype=torch.float64),
    )
    eps = 1e-6
    layer = ApproxAttention("linear", approx.get_method("linear").make_config(eps=eps), head_dim=8)

    def phi(x):  # elu(x) + 1, without the cancellation of -1 + 1 for very negative x
        return torch.where(x > 0, x + 1, x.clamp(max=0).exp())

    phi_q, phi_k = phi(q), phi(k)
    a = phi_q @ phi_k.transpose(-1, -2)  # (1, 1, 4, 6)
    den = a.sum(-1, keepdim=True)
    assert float(den.max()) < eps  # the floor is what decides here
    with torch.no_grad():
        out = layer(q, k, v)
        weights = layer.weights(q, k, None, scale=8**-0.5)
    torch.testing.assert_close(out, (a @ v) / den.clamp_min(eps), rtol=1e-9, atol=0)
    torch.testing.assert_close(weights, a / den.clamp_min(eps), rtol=1e-9, atol=0)


def test_a_tight_cloud_far_from_the_origin_still_gets_codes_that_split_it():
    """Queries 1000 + 0.01 noise: in float32 the variance of their projections is lost to rounding and can come out
    below 0; clamped to 0 (thresholds at the mean) the codes still split the cloud, where a NaN threshold would give
    every query one code."""
    g = torch.Generator().manual_seed(4)
    q = 1000 + 0.01 * torch.randn(1, 1, 64, 16, generator=g)
    planes, offsets = torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
    codes = _hashing.pack_bits(_hashing.hash_queries(q, planes, offsets, None))
    assert len(codes.unique()) > 8


@pytest.mark.skipif(sys.byteorder != "little", reason="the packed bytes are read as a little-endian int64 here")
def test_packed_codes_are_the_bits_as_a_binary_number():
    """Every pattern of the low byte, and the top bits: the code is sum_i bit_i 2^i (one-to-one)."""
    patterns = torch.tensor([[(p >> i) & 1 for i in range(8)] for p in range(256)], dtype=torch.bool)
    bits = torch.zeros(256 + 2, 63, dtype=torch.bool)
    bits[:256, :8] = patterns
    bits[256, 62] = True
    bits[257, 55] = True
    expected = list(range(256)) + [1 << 62, 1 << 55]
    assert _hashing.pack_bits(bits).tolist() == expected


def test_cluster_blocks_of_a_hand_made_assignment():
    """Clusters of 4, 0 and 6 queries in blocks of 4: cluster 0 fills one block exactly (no empty block after it),
    cluster 2 takes two; the blocks in use are those three, and the spare blocks hold no query."""
    assign = torch.tensor([[[0, 2, 2, 0, 2, 0, 2, 2, 0, 2]]])
    order, slot, block_cluster, nb = _common.cluster_blocks(assign, 3, 4)
    assert order.tolist() == [[[0, 3, 5, 8, 1, 2, 4, 6, 7, 9]]]
    assert slot.tolist() == [[list(range(10))]]
    assert nb == (10 + 3 * 3 + 3) // 4 and block_cluster[0, 0, :3].tolist() == [0, 2, 2]
    dest, in_use, cluster = _common.block_rows(assign, 3, 4)
    assert in_use.tolist() == [0, 1, 2]
    spare = 10  # one past the last query
    assert dest[:3].tolist() == [[0, 3, 5, 8], [1, 2, 4, 6], [7, 9, spare, spare]]
    assert (dest[3:] == spare).all()


def test_taylor_normalises_queries_and_keys_of_tiny_norm_too():
    """Taylor's weights 1 + q^.k^ with q^ = q / |q|: a key of norm 1e-4 and a query of norm 1e-5 are still unit
    directions (the norm's floor is far below them), against the float64 formula."""
    g = torch.Generator().manual_seed(5)
    q, k = (
        torch.randn(1, 1, 3, 4, generator=g, dtype=torch.float64),
        torch.randn(1, 1, 5, 4, generator=g, dtype=torch.float64),
    )
    v = torch.randn(1, 1, 5, 2, generator=g, dtype=torch.float64)
    q[0, 0, 1] *= 1e-5 / q[0, 0, 1].norm()
    k[0, 0, 2] *= 1e-4 / k[0, 0, 2].norm()
    weights = taylor_kernel_attention(q, k, torch.eye(5, dtype=torch.float64)[None, None])  # V = I: the weights
    layer = ApproxAttention("taylor", approx.get_method("taylor").make_config(), head_dim=4)
    with torch.no_grad():
        torch.testing.assert_close(layer.weights(q, k, None, scale=0.5), weights, rtol=1e-12, atol=0)
        torch.testing.assert_close(layer(q, k, v), taylor_kernel_attention(q, k, v), rtol=1e-12, atol=1e-14)
