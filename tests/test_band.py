"""The banded kernel (window's CPU fast path, approx/attention/_band.py) against a float64 softmax written from the
window's definition: band edges, sequence ends, padding, global tokens and questions, chunks across and within
heads, strided inputs, half precision, and when it declines (gradients, dilation, too many shared keys)."""

import pytest
import torch

import approx
from approx import ApproxAttention
from approx.attention import _band
from approx.attention.sparse_transformer import SparseTransformerConfig
from approx.attention.window import WindowConfig

B, H, D = 2, 3, 16


def qkv(n, seed=0, dtype=torch.float64, heads=H):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, heads, n, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))


def reference(q, k, v, key_mask, *, window, glob):
    """float64 softmax over {j : |i - j| <= window} plus the global rows and columns, real keys only; a query with
    no real key in reach gets 0."""
    q, k, v = q.double(), k.double(), v.double()
    n = q.shape[2]
    diff = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    allowed = (diff.abs() <= window)[None] | glob[:, None, :] | glob[:, :, None]
    allowed = (allowed & key_mask[:, None, :])[:, None]
    has = allowed.any(-1, keepdim=True)
    scores = (q @ k.transpose(-1, -2)) * D**-0.5
    return scores.masked_fill(~allowed, float("-inf")).masked_fill(~has, 0.0).softmax(-1) * has @ v


def run(q, k, v, mask, **options):
    layer = ApproxAttention("window", WindowConfig(kernel="band", **options), head_dim=D)
    with torch.no_grad():
        return layer(q, k, v, mask)


def lengths_mask(n, real):
    """(B, N): the first row all real, the second ``real`` tokens then padding."""
    return torch.arange(n)[None, :] < torch.tensor([n, real])[:, None]


@pytest.mark.parametrize(
    "n,real,options",
    [
        (100, 77, {"window": 5, "block": 8}),  # reach below a block
        (96, 96, {"window": 16, "block": 8, "global_tokens": 0}),  # reach a multiple of the block, no globals
        (101, 60, {"window": 13, "block": 8, "global_tokens": 3}),  # n and reach off the block grid
        (70, 9, {"window": 4, "block": 4}),  # a short row: queries whose window holds padding only
        (50, 50, {"window": 60, "block": 16}),  # reach beyond the sequence: exact attention
        (37, 30, {"window": 1000, "block": 8}),  # far beyond: the reach is cut to the sequence
        (40, 33, {"window": 0, "block": 8}),  # the diagonal alone (plus CLS)
        (64, 64, {"window": 7, "block": 2}),  # the smallest block with room for CLS
    ],
)
def test_matches_the_definition(n, real, options):
    q, k, v = qkv(n)
    mask = lengths_mask(n, real)
    out = run(q, k, v, mask, **options)
    glob = (torch.arange(n) < options.get("global_tokens", 1)).expand(B, n)
    ref = reference(q, k, v, mask, window=options["window"], glob=glob)
    rows = mask[:, None, :, None]
    torch.testing.assert_close(out.masked_fill(~rows, 0), ref.masked_fill(~rows, 0), rtol=1e-12, atol=1e-12)
    assert torch.isfinite(out).all()  # padded queries too (no NaN from a row without keys)


def test_padding_in_the_middle_and_padding_only_windows():
    """Key padding anywhere (the kernel assumes no layout): masked keys never get weight; a query whose reach
    holds no real key and no shared key gets 0."""
    n = 90
    q, k, v = qkv(n, seed=3)
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[0, 30:62] = False  # a hole wider than the window
    mask[1, ::3] = False
    out = run(q, k, v, mask, window=6, block=8, global_tokens=0)
    ref = reference(q, k, v, mask, window=6, glob=torch.zeros(B, n, dtype=torch.bool))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert (out[0, :, 37:55] == 0).all()  # no real key within 6 of them


def test_questions_differ_per_row():
    n = 80
    q, k, v = qkv(n, seed=1)
    mask = lengths_mask(n, 66)
    question = torch.zeros(B, n, dtype=torch.bool)
    question[0, :11] = True
    question[1, :4] = True
    layer = ApproxAttention("window", WindowConfig(window=5, block=16, question_global=True, kernel="band"), head_dim=D)
    with torch.no_grad(), approx.tokens(question_mask=question):
        out = layer(q, k, v, mask)
    ref = reference(q, k, v, mask, window=5, glob=question | (torch.arange(n) < 1))
    torch.testing.assert_close(out[:, :, :66], ref[:, :, :66], rtol=1e-12, atol=1e-12)


def test_shared_keys_anywhere_and_padded():
    """The kernel alone (no global rows): shared keys in the middle of a row too (several runs of windows that need
    a key bias), a shared key that is padding (never attended), a value width unlike the key width."""
    n = 77
    q, k, _ = qkv(n, seed=7)
    v = torch.randn(B, H, n, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    mask = lengths_mask(n, 60)
    shared = torch.zeros(B, n, dtype=torch.bool)
    shared[0, [0, 33, 34, 70]] = True
    shared[1, [5, 40, 66]] = True  # 66 is padding in row 1
    out = _band.attend(q, k, v, reach=4, block=8, key_mask=mask, shared_keys=shared, scale=D**-0.5)
    diff = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    allowed = ((diff.abs() <= 4)[None] | shared[:, None, :]) & mask[:, None, :]
    scores = (q @ k.transpose(-1, -2)) * D**-0.5
    ref = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(out[:, :, :60], ref[:, :, :60], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-12, atol=1e-12)


def test_non_finite_padding_never_reaches_a_real_row():
    """inf and NaN in padded keys, values and shared keys (whatever a model leaves at padding): the real rows get
    what they get with finite padding, as the gather kernel's masking gives."""
    n = 50
    q, k, v = qkv(n, seed=9)
    mask = lengths_mask(n, 41)
    shared = torch.zeros(B, n, dtype=torch.bool)
    shared[:, [0, 45]] = True  # 45 is padding in row 1
    bad_k, bad_v = k.clone(), v.clone()
    bad_k[1, :, 41:] = float("inf")
    bad_k[1, 0, 44:] = float("nan")
    bad_v[1, :, 41:] = float("nan")
    options = {"reach": 5, "block": 8, "key_mask": mask, "shared_keys": shared, "scale": D**-0.5}
    out = _band.attend(q, bad_k, bad_v, **options)
    diff = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    allowed = ((diff.abs() <= 5)[None] | shared[:, None, :]) & mask[:, None, :]
    scores = (q @ k.transpose(-1, -2)) * D**-0.5  # the finite keys: padding's values are never read
    ref = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1) @ v
    assert torch.isfinite(out[:, :, :41]).all()
    torch.testing.assert_close(out[:, :, :41], ref[:, :, :41], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-12, atol=1e-12)
    # left padding: a row's unused shared-key slots are filled with its first position, here a padded (inf) key
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, :9] = False
    shared = torch.zeros(B, n, dtype=torch.bool)
    shared[:, [0, 20]] = True  # row 1: 0 is padding
    bad_k = k.clone()
    bad_k[1, :, :9] = float("inf")
    out = _band.attend(q, bad_k, v, **{**options, "key_mask": mask, "shared_keys": shared})
    allowed = ((diff.abs() <= 5)[None] | shared[:, None, :]) & mask[:, None, :]
    ref = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1) @ v
    assert torch.isfinite(out[1, :, 9:]).all()
    torch.testing.assert_close(out[:, :, 9:], ref[:, :, 9:], rtol=1e-12, atol=1e-12)


def test_chunks_across_and_within_heads(monkeypatch):
    """Small chunks: several heads side by side in one chunk (short sequences), and one head's blocks over several
    chunks (long ones); the output is the same."""
    q, k, v = qkv(120, seed=2, heads=5)
    mask = lengths_mask(120, 97)
    glob = (torch.arange(120) < 1).expand(B, 120)
    ref = reference(q, k, v, mask, window=9, glob=glob)
    for elements in (8 * 40 * 3, 8 * 40 * 30, 8 * 40 * 200):  # chunks of 3 blocks, 2 heads, all 5 heads
        monkeypatch.setattr(_band, "_CHUNK_ELEMENTS", elements)
        out = run(q, k, v, mask, window=9, block=8)
        torch.testing.assert_close(out[:, :, :97], ref[:, :, :97], rtol=1e-12, atol=1e-12)


def test_strided_inputs_as_a_model_passes_them():
    """q, k, v as an attention layer makes them, (B, N, H, d) transposed to (B, H, N, d): same output, and the
    output a view of a (B, N, H, dv) tensor (the layer's own layout: no copy to hand it back)."""
    q, k, v = qkv(75, seed=4)
    mask = lengths_mask(75, 70)
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert not strided[0].is_contiguous()
    out = run(*strided, mask, window=6, block=8)
    ref = reference(q, k, v, mask, window=6, glob=(torch.arange(75) < 1).expand(B, 75))
    torch.testing.assert_close(out[:, :, :70], ref[:, :, :70], rtol=1e-12, atol=1e-12)
    raw = _band.attend(q, k, v, reach=6, block=8, key_mask=mask, shared_keys=None, scale=D**-0.5)
    assert raw.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_half_precision(dtype, tol):
    """Half inputs: computed in float32, returned in the input dtype, as the float32 path on the rounded inputs."""
    q, k, v = qkv(70, seed=5, dtype=dtype)
    mask = lengths_mask(70, 55)
    out = run(q, k, v, mask, window=5, block=8)
    assert out.dtype == dtype
    ref = reference(q, k, v, mask, window=5, glob=(torch.arange(70) < 1).expand(B, 70))
    torch.testing.assert_close(out[:, :, :55].double(), ref[:, :, :55], rtol=tol, atol=tol)


def test_auto_takes_the_band_kernel_for_inference_only(monkeypatch):
    """kernel='auto' on the CPU: the banded kernel without gradients; with them the gather kernel, whose gradients
    match the float64 reference's."""
    calls = []
    real_attend = _band.attend
    monkeypatch.setattr(_band, "attend", lambda *a, **kw: calls.append(1) or real_attend(*a, **kw))
    q, k, v = qkv(50, seed=6)
    mask = lengths_mask(50, 41)
    layer = ApproxAttention("window", WindowConfig(window=4, block=8), head_dim=D)
    with torch.no_grad():
        layer(q, k, v, mask)
    assert calls == [1]
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    layer(q, k, v, mask)[:, :, :41].sum().backward()
    assert calls == [1]
    glob = (torch.arange(50) < 1).expand(B, 50)
    r = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    reference(*r, mask, window=4, glob=glob)[:, :, :41].sum().backward()
    for mine, theirs in zip((q, k, v), r, strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-10, atol=1e-10)


def test_band_declines_with_a_reason():
    q, k, v = qkv(40)
    with pytest.raises(ValueError, match="contiguous windows only"):
        WindowConfig(kernel="band", dilation=2)
    with pytest.raises(ValueError, match="blocks of two rows or more"):  # when made, not at its first call
        WindowConfig(kernel="band", block=1)
    with pytest.raises(ValueError, match="kernel"):
        SparseTransformerConfig(kernel="band")  # neither a band nor neighbouring blocks (bigbird's block-band kernel)
    layer = ApproxAttention("window", WindowConfig(window=3, block=8, kernel="band"), head_dim=D)
    q.requires_grad_()
    with pytest.raises(RuntimeError, match="kernel='band' cannot run this call: it is inference only"):
        layer(q, k, v)
    question = torch.zeros(B, 40, dtype=torch.bool)
    question[:, :20] = True  # 20 shared keys; blocks of 8 with reach 3 leave each row 2 * 8 - 7 = 9 masked columns
    layer = ApproxAttention("window", WindowConfig(window=3, block=8, question_global=True, kernel="band"), head_dim=D)
    with torch.no_grad(), approx.tokens(question_mask=question), pytest.raises(RuntimeError, match="shared keys"):
        layer(q.detach(), k, v)
    auto = ApproxAttention("window", WindowConfig(window=3, block=8, question_global=True), head_dim=D)
    with torch.no_grad(), approx.tokens(question_mask=question):  # auto: the gather kernel instead, same pairs
        out = auto(q.detach(), k, v)
    torch.testing.assert_close(
        out,
        reference(q.detach(), k, v, torch.ones(B, 40, dtype=torch.bool), window=3, glob=question),
        rtol=1e-12,
        atol=1e-12,
    )


def test_masked_columns_leave_room_for_every_row():
    """Each row of a block has block + 2P - (2 reach + 1) masked columns, and the slots chosen for shared keys are
    among them and distinct."""
    for reach, block in [(0, 2), (3, 8), (8, 8), (13, 4), (256, 64)]:
        g = _band.masked_columns(reach, block)
        assert g >= block - 1
        slots = _band._slots(reach, block, g, "cpu")
        pad = -(-reach // block) * block
        r = torch.arange(block)[:, None]
        assert ((slots - pad - r).abs() > reach).all()
        assert all(len(set(row.tolist())) == g for row in slots)


@pytest.mark.parametrize(
    "n,real,reach,block",
    [
        (100, 77, 5, 8),  # reach below a block
        (96, 96, 16, 8),  # reach a multiple of the block
        (101, 60, 13, 8),  # n and reach off the block grid
        (70, 9, 4, 4),  # queries whose window holds padding only: output 0, gradient 0
        (37, 30, 1000, 8),  # reach beyond the sequence
        (40, 33, 0, 8),  # the diagonal alone
        (300, 280, 64, 64),  # ModernBERT's window, several chunks of blocks
    ],
)
def test_the_training_form_matches_the_definition_and_its_gradient(n, real, reach, block, monkeypatch):
    """``attend_with_gradients`` (the band for training: checkpointed chunks of blocks) against the float64 softmax
    from the window's definition, outputs and the gradients of q, k and v (autograd through the reference), with
    chunks of one block too; and torch's gradcheck on a small case."""
    q, k, v = (t.requires_grad_() for t in qkv(n))
    mask = lengths_mask(n, real)
    glob = torch.zeros(B, n, dtype=torch.bool)
    want = reference(q, k, v, mask, window=reach, glob=glob)
    grad_out = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)
    for chunk, fewest in ((_band._CHUNK_ELEMENTS, _band.MIN_CHUNK_BLOCKS), (1, 1)):  # (1: a chunk per block)
        monkeypatch.setattr(_band, "_CHUNK_ELEMENTS", chunk)
        monkeypatch.setattr(_band, "MIN_CHUNK_BLOCKS", fewest)
        got = _band.attend_with_gradients(q, k, v, reach=reach, block=block, key_mask=mask, scale=D**-0.5)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), grad_out), want_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        with torch.no_grad():  # (no gradient to keep: plain views of the padded tensors, the same numbers)
            plain = _band.attend_with_gradients(q, k, v, reach=reach, block=block, key_mask=mask, scale=D**-0.5)
        torch.testing.assert_close(plain, want, rtol=1e-12, atol=1e-12)
    small = tuple(t[:1, :1, :12].detach().clone().requires_grad_() for t in (q, k, v))
    torch.autograd.gradcheck(
        lambda a, b, c: _band.attend_with_gradients(a, b, c, reach=3, block=4, key_mask=None, scale=0.5), small
    )


def test_the_training_form_keeps_less_than_autograd_through_the_scores():
    """Its chunks are checkpointed: what autograd keeps for the backward grows with N d, not with the band's
    N (block + 2 P) scores per head (counted through saved-tensor hooks: the bytes kept, storages counted once)."""

    def kept(fn, n):
        q, k, v = (torch.randn(1, 4, n, 16, requires_grad=True) for _ in range(3))
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(q, k, v).sum().backward()
        return sum(storages.values())

    def plain(q, k, v):  # the same chunk function without checkpointing: its scores and weights kept
        with _no_checkpoint():
            return _band.attend_with_gradients(q, k, v, reach=64, block=64, key_mask=None, scale=0.25)

    def checkpointed(q, k, v):
        return _band.attend_with_gradients(q, k, v, reach=64, block=64, key_mask=None, scale=0.25)

    assert kept(checkpointed, 4096) < kept(plain, 4096) / 4


def _no_checkpoint():
    import contextlib
    from unittest import mock

    @contextlib.contextmanager
    def patched():
        with mock.patch("torch.utils.checkpoint.checkpoint", lambda fn, *a, use_reentrant: fn(*a)):
            yield

    return patched()
