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


def test_cached_keeps_one_pattern_per_key_and_mode_within_its_limits(monkeypatch):
    built = []

    def build():
        built.append(1)
        return [(slice(None), [_blocksparse.Pattern(4, torch.zeros(1, 1, 1, 1000, dtype=torch.long))], None)]

    first = _blocksparse.cached(("k", 1), build)
    assert _blocksparse.cached(("k", 1), build) is first and len(built) == 1
    assert first[0][1][0].static, "a kept pattern carries its key (FlexAttention keeps its block mask on it)"
    _blocksparse.cached(("k", 2), build)  # another key (BigBird: another random key value)
    with torch.inference_mode():
        _blocksparse.cached(("k", 1), build)
    assert len(built) == 3
    assert not _blocksparse.cached(None, build)[0][1][0].static and len(built) == 4  # None: never kept
    monkeypatch.setattr(_blocksparse, "CACHE_SIZE", 2)
    _blocksparse.cached(("other",), build)
    assert len(_blocksparse._CACHE) == 2, "the least recently used entries are dropped past CACHE_SIZE"
    assert [k[0] for k in _blocksparse._CACHE] == [("k", 1), ("other",)], "kept: the most recently used"
    # bytes: each entry holds 8000 bytes of block ids; a limit under two entries keeps the newest alone
    monkeypatch.setattr(_blocksparse, "CACHE_BYTES", 12000)
    _blocksparse.cached(("third",), build)
    assert [k[0] for k in _blocksparse._CACHE] == [("third",)]
    monkeypatch.setattr(_blocksparse, "CACHE_BYTES", 10)
    kept = _blocksparse.cached(("fourth",), build)
    assert [k[0] for k in _blocksparse._CACHE] == [("fourth",)], "the newest entry stays, whatever its size"
    # what a kernel derives is counted when it says so
    monkeypatch.setattr(_blocksparse, "CACHE_BYTES", 1 << 30)
    pattern = kept[0][1][0]
    before = _blocksparse._CACHE[pattern.cache_key][1]
    pattern.derived["x"] = (torch.zeros(500), lambda: pattern)
    _blocksparse.account(pattern)
    assert _blocksparse._CACHE[pattern.cache_key][1] == before + 2000


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
    # the window's pattern does not depend on padding: a padded batch takes the kept one (the kernels derive their
    # masks from the padding at every call)
    assert len(calls) == 2 and len(_blocksparse._CACHE) == 2
    other = make("window", window=7, global_tokens=2, block=8, kernel="gather")  # other options, same shape
    torch.testing.assert_close(other(q, k, v), window_reference(q, k, v, 7, 2), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(layer(q, k, v), window_reference(q, k, v, 5, 2), rtol=1e-10, atol=1e-10)
    one = tuple(t[:1, :2] for t in (q, k, v))  # another batch size and head count
    torch.testing.assert_close(layer(*one), window_reference(*one, 5, 2), rtol=1e-10, atol=1e-10)
    assert len(calls) == 4


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
    """The random blocks come from the layer's key: a redraw, load_state or in-place change (through ``.data`` too)
    must not reuse the pattern of the old key. Oracle: the same layer with nothing kept (the cache emptied)."""
    calls = count_calls(monkeypatch, bigbird_mod, "pattern")
    layer = make("bigbird", block=4, random_blocks=1, full_fallback=False)
    q, k, v = qkv(64, seed=3)

    def fresh(*inputs):
        _blocksparse.clear_cache()
        return layer(*(inputs or (q, k, v)))

    before = layer(q, k, v)
    torch.testing.assert_close(layer(q, k, v), before, rtol=0, atol=0)
    assert len(calls) == 1
    layer.redraw(seed=7)
    after = layer(q, k, v)
    assert len(calls) == 2 and not torch.allclose(after, before), "the redrawn key picks other random blocks"
    torch.testing.assert_close(after, fresh(), rtol=0, atol=0)
    for change in (lambda: layer.rand_key.add_(12345), lambda: layer.rand_key.data.add_(999)):
        old = layer(q, k, v)
        change()
        changed = layer(q, k, v)
        assert not torch.allclose(changed, old)
        torch.testing.assert_close(changed, fresh(), rtol=0, atol=0)
    layer.load_state({"rand_key": torch.tensor([5])})
    torch.testing.assert_close(layer(q, k, v), fresh(), rtol=0, atol=0)
    fewer = tuple(t[:, :2] for t in (q, k, v))  # another head count: other random blocks per head
    torch.testing.assert_close(layer(*fewer), fresh(*fewer), rtol=0, atol=0)
    unmasked = layer(q, k, v)
    built = len(calls)
    torch.testing.assert_close(layer(q, k, v, torch.ones(B, 64, dtype=torch.bool)), unmasked, rtol=0, atol=0)
    assert len(calls) == built, "a mask with every key real takes the kept pattern"


def test_bigbird_with_a_key_made_in_inference_mode():
    """A layer made (or redrawn) under torch.inference_mode, as approx.autotune builds its candidates, holds an
    inference tensor as its key, which has no version counter: the pattern is kept by the key's value."""
    q, k, v = qkv(64, seed=5)
    with torch.inference_mode():
        layer = make("bigbird", block=4, random_blocks=1, full_fallback=False)
        layer.redraw(seed=3)
        first = layer(q, k, v)
        torch.testing.assert_close(layer(q, k, v), first, rtol=0, atol=0)
    _blocksparse.clear_cache()
    torch.testing.assert_close(layer(q, k, v), first, rtol=0, atol=0)


def test_sparse_transformer_keeps_its_head_groups(monkeypatch):
    calls = count_calls(monkeypatch, st_mod, "head_groups")
    layer = make("sparse-transformer", stride=6, block=8, kernel="gather")
    q, k, v = qkv(50)
    first = layer(q, k, v)
    torch.testing.assert_close(layer(q, k, v), first, rtol=0, atol=0)
    torch.testing.assert_close(layer(q, k, v, torch.ones(B, 50, dtype=torch.bool)), first, rtol=0, atol=0)
    assert len(calls) == 1
    other = make("sparse-transformer", stride=5, block=8, kernel="gather")  # other options, same shape
    out = other(q, k, v)
    _blocksparse.clear_cache()
    torch.testing.assert_close(other(q, k, v), out, rtol=0, atol=0)
    assert len(calls) == 3
    _blocksparse.clear_cache()
    torch.testing.assert_close(layer(q, k, v), first, rtol=0, atol=0)
    assert len(calls) == 4


@pytest.mark.parametrize("rows", ["auto", "apart", "mask"])
@pytest.mark.parametrize("method", ["window", "bigbird"])
def test_flex_keeps_its_block_mask_for_unpadded_inputs(method, rows, monkeypatch):
    """kernel='flex' prepares the BlockMask once per shape on a kept pattern, every call with key padding; the
    output stays the gather kernel's, the global queries' rows computed after the kernel (unpadded: in a few
    launches, ``_blocksparse._global_rows``) or inside the block mask. Skipped where FlexAttention cannot compile."""
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
        fewer = tuple(t[:, :2] for t in (q, k, v))  # another head count, same pattern: another block mask
        torch.testing.assert_close(flex(*fewer), gather(*fewer), rtol=1e-5, atol=1e-5)
        assert len(prepared) == 2
        padded = [flex(q, k, v, mask) for _ in range(2)]
        assert len(prepared) == 4
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


def test_unpadded_rows_in_several_chunks(monkeypatch):
    """The global queries' rows computed after the kernel, a few queries per chunk (small chunks forced): the gather
    kernel's output. Skipped where FlexAttention cannot compile."""
    monkeypatch.setattr(_flex, "GLOBAL_ROWS", "apart")
    monkeypatch.setattr(_blocksparse, "_CHUNK_ELEMENTS", 2 * B * H * 256)  # two global queries per chunk
    options = {"window": 9, "global_tokens": 5, "block": 32}
    q, k, v = qkv(256, seed=6, dtype=torch.float32)
    with torch.no_grad():
        ref = make("window", kernel="gather", **options)(q, k, v)
        try:
            out = make("window", kernel="flex", **options)(q, k, v)
        except RuntimeError:
            if _flex._BROKEN.get("cpu"):
                pytest.skip(f"FlexAttention cannot compile here: {_flex._BROKEN.get('cpu')}")
            raise
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_unpatch_forgets_the_kept_patterns():
    from conftest import batch, tiny_model

    import approx

    model = tiny_model("bert", num_hidden_layers=2)
    approx.patch(model, "window", window=4, block=8)
    inputs = batch(seq_len=40, pad=0)
    with torch.no_grad():
        model(**{n: t for n, t in inputs.items() if n != "attention_mask"})
    assert _blocksparse._CACHE
    approx.unpatch(model)
    assert not _blocksparse._CACHE


def test_threads_sharing_the_cache_wait_for_each_other(monkeypatch):
    """One model called from several threads shares the cache: a thread that adds a pattern while another walks the
    entries to trim them waits (it had changed the dict under the walk: "OrderedDict mutated during iteration", 4 of
    240 calls of a threaded reviewer's run). Made deterministic: the walk pauses at its first entry until the other
    thread has added its pattern, or for a second when it is (rightly) kept waiting."""
    import threading

    started, done, failed = threading.Event(), threading.Event(), []

    class Walked(collections.OrderedDict):
        def values(self):
            for value in super().values():
                if not started.is_set():
                    started.set()
                    done.wait(timeout=1.0)
                yield value

    monkeypatch.setattr(_blocksparse, "_CACHE", Walked())
    _blocksparse._CACHE[("z",)] = [[torch.zeros(1)], 4]  # an entry before: the walk has one more to take after

    def other():
        started.wait(timeout=5.0)
        try:
            _blocksparse.cached(("b",), lambda: [torch.zeros(2)])
        except Exception as e:  # noqa: BLE001 (reported below)
            failed.append(e)
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    try:
        _blocksparse.cached(("a",), lambda: [torch.zeros(3)])  # walks the entries to trim them after adding its own
    finally:
        thread.join()
    assert not failed and [k[0] for k in _blocksparse._CACHE] == ["z", ("a",), ("b",)]
