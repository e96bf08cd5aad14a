"""The sparse-pattern methods keep the pattern of inputs without key padding (``_blocksparse.cached``) and
FlexAttention keeps its block mask on it: a call after the first rebuilds nothing. These tests check that what is
kept is reused only when it is the same pattern: other shapes, padding, the question's tokens, a redrawn or changed
random key and inference mode each get their own; outputs match a float64 reference or the same code with nothing
kept."""

import collections
import dataclasses

import pytest
import torch

from approx import ApproxAttention
from approx.attention import _blocksparse, _flex
from approx.attention import bigbird as bigbird_mod
from approx.attention import sparse_transformer as st_mod
from approx.attention import window as window_mod
from approx.registry import get_method

B, H, D = 2, 3, 8


@pytest.fixture(autouse=True)
def empty_cache(monkeypatch):
    monkeypatch.setattr(_blocksparse, "_CACHE", collections.OrderedDict())


def qkv(n, seed=0, dtype=torch.float64, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(B, H, n, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)
        for _ in range(3)
    )


def make(method, **options):
    return ApproxAttention(method, get_method(method).make_config(**options), head_dim=D)


def count_calls(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def window_reference(q, k, v, window, global_tokens, key_mask=None):
    """float64 softmax over |i - j| <= window, the first global_tokens rows and columns, real keys only."""
    n = q.shape[2]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = ((i - j).abs() <= window) | (i < global_tokens) | (j < global_tokens)
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    scores = (q.double() @ k.double().transpose(-1, -2)) * D**-0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v.double()


def test_cached_keeps_one_pattern_per_key_pins_and_mode(monkeypatch):
    built = []

    def build():
        built.append(1)
        return [(slice(None), [_blocksparse.Pattern(4, torch.zeros(1, 1, 1, 1, dtype=torch.long))], None)]

    pin = torch.zeros(1)
    first = _blocksparse.cached(("k",), build, pins=(pin,))
    assert _blocksparse.cached(("k",), build, pins=(pin,)) is first and len(built) == 1
    assert first[0][1][0].static, "a kept pattern is marked static (FlexAttention keeps its block mask on it)"
    _blocksparse.cached(("k",), build, pins=(torch.zeros(1),))  # another state tensor
    pin.add_(1)  # the same one, changed in place
    _blocksparse.cached(("k",), build, pins=(pin,))
    with torch.inference_mode():
        _blocksparse.cached(("k",), build, pins=(pin,))
    assert len(built) == 4
    assert not _blocksparse.cached(None, build)[0][1][0].static and len(built) == 5  # None: never kept
    monkeypatch.setattr(_blocksparse, "CACHE_SIZE", 2)
    _blocksparse.cached(("other",), build)
    assert len(_blocksparse._CACHE) == 2, "the least recently used entries are dropped past CACHE_SIZE"


def test_window_builds_its_pattern_once_per_shape(monkeypatch):
    calls = count_calls(monkeypatch, window_mod, "pattern")
    layer = make("window", window=5, global_tokens=2, block=8, kernel="gather")
    q, k, v = qkv(60)
    for _ in range(3):
        torch.testing.assert_close(layer(q, k, v), window_reference(q, k, v, 5, 2), rtol=1e-10, atol=1e-10)
    assert len(calls) == 1
    all_real = torch.ones(B, 60, dtype=torch.bool)
    torch.testing.assert_close(layer(q, k, v, all_real), window_reference(q, k, v, 5, 2), rtol=1e-10, atol=1e-10)
    assert len(calls) == 1, "a mask with every key real takes the kept pattern"
    q2, k2, v2 = qkv(44, seed=1)
    torch.testing.assert_close(layer(q2, k2, v2), window_reference(q2, k2, v2, 5, 2), rtol=1e-10, atol=1e-10)
    assert len(calls) == 2, "another length: another pattern"
    mask = all_real.clone()
    mask[1, 50:] = False
    for _ in range(2):
        out = layer(q, k, v, mask)
    ref = window_reference(q, k, v, 5, 2, mask)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out[1, :, :50], ref[1, :, :50], rtol=1e-10, atol=1e-10)
    # a padded batch is not kept (its pattern would be the same here, but the kernels derive masks from padding)
    assert len(calls) == 2 and len(_blocksparse._CACHE) == 2


def test_window_with_the_question_global_builds_every_call(monkeypatch):
    import approx

    calls = count_calls(monkeypatch, window_mod, "pattern")
    layer = make("window", window=3, global_tokens=0, question_global=True, block=8, kernel="gather")
    q, k, v = qkv(40)
    for length in (5, 9):  # the question is data: a new one each call
        question = torch.zeros(B, 40, dtype=torch.bool)
        question[:, :length] = True
        with approx.tokens(question_mask=question):
            out = layer(q, k, v)
        torch.testing.assert_close(out, window_reference(q, k, v, 3, length), rtol=1e-10, atol=1e-10)
    assert len(calls) == 2 and not _blocksparse._CACHE


def test_pattern_built_under_inference_mode_is_not_given_to_autograd():
    layer = make("window", window=4, block=8, kernel="gather")
    with torch.inference_mode():
        layer(*qkv(48))
    q, k, v = qkv(48, requires_grad=True)
    layer(q, k, v).sum().backward()  # an inference tensor saved for backward would raise here
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_bigbird_rebuilds_after_a_redraw_or_a_changed_key(monkeypatch):
    """The random blocks come from the layer's key: a redraw, load_state or in-place change must not reuse the
    pattern of the old key. Oracle: the same layer with nothing kept (the cache emptied before the call)."""
    calls = count_calls(monkeypatch, bigbird_mod, "pattern")
    layer = make("bigbird", block=4, random_blocks=1, full_fallback=False)
    q, k, v = qkv(64, seed=3)

    def fresh():
        _blocksparse.clear_cache()
        return layer(q, k, v)

    before = layer(q, k, v)
    torch.testing.assert_close(layer(q, k, v), before, rtol=0, atol=0)
    assert len(calls) == 1
    layer.redraw(seed=7)
    after = layer(q, k, v)
    assert len(calls) == 2 and not torch.allclose(after, before), "the redrawn key picks other random blocks"
    torch.testing.assert_close(after, fresh(), rtol=0, atol=0)
    layer.rand_key.add_(12345)
    changed = layer(q, k, v)
    assert not torch.allclose(changed, after)
    torch.testing.assert_close(changed, fresh(), rtol=0, atol=0)


def test_sparse_transformer_keeps_its_head_groups(monkeypatch):
    calls = count_calls(monkeypatch, st_mod, "head_groups")
    layer = make("sparse-transformer", stride=6, block=8, kernel="gather")
    q, k, v = qkv(50)
    first = layer(q, k, v)
    torch.testing.assert_close(layer(q, k, v), first, rtol=0, atol=0)
    assert len(calls) == 1
    _blocksparse.clear_cache()
    torch.testing.assert_close(layer(q, k, v), first, rtol=0, atol=0)
    assert len(calls) == 2


@pytest.mark.parametrize("rows", ["auto", "apart", "mask"])
@pytest.mark.parametrize("method", ["window", "bigbird"])
def test_flex_keeps_its_block_mask_for_unpadded_inputs(method, rows, monkeypatch):
    """kernel='flex' prepares the BlockMask once per shape on a kept pattern, every call with key padding; the
    output stays the gather kernel's, the global queries' rows computed after the kernel (unpadded: in a few
    launches, ``_flex._unpadded_rows``) or inside the block mask. Skipped where FlexAttention cannot compile."""
    monkeypatch.setattr(_flex, "GLOBAL_ROWS", rows)
    prepared = count_calls(monkeypatch, _flex, "_prepare")
    options = {"window": {"window": 9, "block": 32}, "bigbird": {"block": 16, "random_blocks": 2}}[method]
    gather, flex = make(method, kernel="gather", **options), make(method, kernel="flex", **options)
    q, k, v = qkv(256, seed=4, dtype=torch.float32)
    mask = torch.ones(B, 256, dtype=torch.bool)
    mask[1, 200:] = False
    with torch.no_grad():
        try:
            outs = [flex(q, k, v) for _ in range(2)]
        except RuntimeError:
            if _flex._BROKEN.get("cpu"):
                pytest.skip(f"FlexAttention cannot compile here: {_flex._BROKEN.get('cpu')}")
            raise
        assert len(prepared) == 1
        for out in outs:
            torch.testing.assert_close(out, gather(q, k, v), rtol=1e-5, atol=1e-5)
        padded = [flex(q, k, v, mask) for _ in range(2)]
        assert len(prepared) == 3
        ref = gather(q, k, v, mask)
    for out in padded:
        torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[1, :, :200], ref[1, :, :200], rtol=1e-5, atol=1e-5)


def test_global_rows_auto_takes_them_apart_from_a_length(monkeypatch):
    """GLOBAL_ROWS='auto' computes the global queries' rows after the kernel from ROWS_APART_FROM keys, inside the
    block mask below; a pattern without global queries has none to take apart; an unknown setting is refused."""
    glob = torch.zeros(1, 256, dtype=torch.bool)
    glob[:, 0] = True
    pat = _blocksparse.Pattern(64, torch.zeros(1, 1, 4, 1, dtype=torch.long), global_queries=glob)
    monkeypatch.setattr(_flex, "ROWS_APART_FROM", 200)
    assert _flex._rows_apart(pat, 256) and not _flex._rows_apart(pat, 199)
    assert not _flex._rows_apart(dataclasses.replace(pat, global_queries=None), 256)
    monkeypatch.setattr(_flex, "GLOBAL_ROWS", "mask")
    assert not _flex._rows_apart(pat, 256)
    monkeypatch.setattr(_flex, "GLOBAL_ROWS", "apart")
    assert _flex._rows_apart(pat, 10)
    monkeypatch.setattr(_flex, "GLOBAL_ROWS", "sideways")
    with pytest.raises(ValueError, match="'auto', 'apart' or 'mask'"):
        _flex._rows_apart(pat, 256)
