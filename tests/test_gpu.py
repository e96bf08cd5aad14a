"""The same method code on a CUDA device (marker ``gpu``; skipped, saying why, where torch sees no GPU).

Driven by the registry like ``test_methods.py``, so a new method is covered without editing this file. The
oracles are independent of the code under test: the float64 references of ``reference.py`` (computed on the
CPU), the exact limits of each method, and the separate dense ``weights()`` path computed on the CPU.

    python -m pytest -m gpu tests/test_gpu.py      # on a machine with a GPU
"""

import pytest
import torch
from conftest import batch, model_output, tiny_model
from reference import naive_attention
from test_methods import (
    LIMITED,
    METHODS,
    B,
    D,
    H,
    layer,
    limit_inputs,
    limit_reference,
    make_qkv,
    padded_mask,
    small_budget,
)

import approx
from approx import get_method

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU test skipped: torch sees no CUDA device"),
]
CUDA = "cuda"


def on_gpu(method, **options):
    return layer(method, **options).to(CUDA)


def cuda(*tensors):
    return tuple(t.to(CUDA) for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", METHODS)
def test_runs_on_gpu_in_every_dtype(method, dtype):
    q, k, v = cuda(*make_qkv(dtype=dtype, dv=D + 4))
    out = on_gpu(method, **small_budget(method))(q, k, v, padded_mask(120, 90).to(CUDA))
    assert out.device.type == "cuda" and out.dtype == dtype and out.shape == (B, H, 120, D + 4)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("method", METHODS)
def test_gpu_fast_path_equals_cpu_dense_weights(method):
    """float64 on the GPU against the method's separate dense path on the CPU: same function on any device."""
    spec = get_method(method)
    q, k, v = make_qkv(dtype=torch.float64)
    mask = padded_mask(120, 90)
    lyr = layer(method, **small_budget(method))
    if spec.weights is None:
        expected = lyr(q, k, v, mask)  # e.g. full: checked against float64 below
    else:
        expected = lyr.weights(q, k, mask) @ v.masked_fill(~mask[:, None, :, None], 0)
    out = lyr.to(CUDA)(*cuda(q, k, v, mask))
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("method", METHODS)
def test_gpu_padding_invariance_and_poisoned_padding(method):
    n_real, n_pad = 100, 37
    q, k, v = make_qkv(n_real + n_pad)
    lyr = on_gpu(method, **small_budget(method))
    short = lyr(*cuda(q[:, :, :n_real], k[:, :, :n_real], v[:, :, :n_real]), None)
    mask = padded_mask(n_real + n_pad, n_real).logical_or(torch.tensor([[True], [False]]))
    padded = lyr(*cuda(q, k, v, mask))
    torch.testing.assert_close(padded[1, :, :n_real], short[1], rtol=1e-5, atol=1e-5)
    v, k = v.clone(), k.clone()
    v[1, :, n_real:], k[1, :, n_real:] = 1e9, 1e3
    out = lyr(*cuda(q, k, v, mask))
    assert torch.isfinite(out).all() and out[1, :, :n_real].abs().max() <= v[1, :, :n_real].abs().max() + 1e-4


@pytest.mark.parametrize("method", METHODS)
def test_gpu_gradients_flow(method):
    q, k, v = (t.to(CUDA).requires_grad_() for t in make_qkv())
    on_gpu(method, **small_budget(method))(q, k, v, padded_mask(120, 90).to(CUDA)).square().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


def test_gpu_exact_limits_against_float64():
    """full, and every method along its registered exact limit (as in test_methods.py: softmax attention, or the
    float64 formula of the kernel a method computes instead), on the GPU; exact_below."""
    q, k, v = make_qkv(dtype=torch.float64)
    mask = padded_mask(120, 90)
    ref = naive_attention(q, k, v, mask)
    args = cuda(q, k, v, mask)
    torch.testing.assert_close(on_gpu("full")(*args).cpu(), ref, rtol=1e-9, atol=1e-9)
    for method in [m for m in METHODS if "exact_below" in get_method(m).config_class.option_names()]:
        out = on_gpu(method, exact_below=121, **small_budget(method))(*args).cpu()
        torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    real = mask[:, None, :, None]
    for method in LIMITED:
        limit = get_method(method).exact_limit
        q, k, v = limit_inputs(distinct=limit.distinct_queries)
        ref, args = limit_reference(limit, q, k, v, mask).masked_fill(~real, 0), cuda(q, k, v, mask)

        def error(**options):
            opts = {**small_budget(method), **limit.options(120), **options}
            return (on_gpu(method, **opts)(*args).cpu().masked_fill(~real, 0) - ref).norm() / ref.norm()

        if limit.approaches is None:
            assert error() <= 1e-9, method
        else:
            errors = [error(**step) for step in limit.approaches(120)]
            assert all(a > b for a, b in zip(errors, errors[1:])), (method, errors)
            assert errors[-1] <= limit.ratio * errors[0], (method, errors)


@pytest.mark.parametrize("method", METHODS)
def test_patched_tiny_model_on_gpu(method):
    """A whole patched model on the GPU: the exact method reproduces the unpatched model there."""
    model = tiny_model("bert").to(CUDA)
    inputs = {k: t.to(CUDA) for k, t in batch(seq_len=48, pad=11).items()}
    with torch.no_grad():
        ref = model_output(model, **inputs)
        spec = get_method(method)
        if spec.requires_fit(spec.config_class(**small_budget(method))):
            pytest.skip(f"{method} needs fitting on the model's own queries (covered on the CPU)")
        approx.patch(model, method, **small_budget(method))
        out = model_output(model, **inputs)
        assert out.device.type == "cuda" and torch.isfinite(out).all()
        if method == "full":
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        approx.unpatch(model)
        torch.testing.assert_close(model_output(model, **inputs), ref, rtol=0, atol=0)


# ------------------------------------------------------------------------- FlexAttention on CUDA
# The sparse patterns' kernel="flex" path on CUDA (with gradients and the log-sum-exp, which the CPU build lacks):
# long enough for the default blocks, a padded row, N not a multiple of the block. The oracle is the method's
# separate dense weights() path in float64 on the CPU.
FLEX_CASES = [
    ("window", {"window": 100, "global_tokens": 2}),
    ("window", {"window": 40, "dilation": 3, "block": 32}),
    ("bigbird", {"block": 32, "random_blocks": 2, "full_fallback": False}),
    ("sparse-transformer", {"pattern": "strided", "stride": 64, "heads": "split"}),
    ("sparse-transformer", {"pattern": "strided", "stride": 64, "heads": "union"}),  # combines with the lse
    ("sparse-transformer", {"pattern": "fixed", "stride": 64, "summary": 8, "heads": "union"}),
]
FLEX_N, FLEX_REAL = 1100, 1001


def _flex_layer(method, kernel, **options):
    spec = get_method(method)
    return approx.ApproxAttention(method, spec.config_class(kernel=kernel, **options), head_dim=D)


# the window's banded kernel (kernel="band", plain torch) on the same inputs and oracle
KERNEL_CASES = [(m, "flex", o) for m, o in FLEX_CASES] + [
    ("window", "band", {"window": 100, "global_tokens": 2}),
    ("window", "band", {"window": 37, "block": 32}),
]


@pytest.mark.parametrize(
    "method,kernel,options", KERNEL_CASES, ids=[f"{m}-{kn}-{i}" for i, (m, kn, _) in enumerate(KERNEL_CASES)]
)
def test_kernels_on_gpu_equal_float64_dense_weights(method, kernel, options):
    q, k, v = make_qkv(FLEX_N, dtype=torch.float64, sharp=1.0)
    mask = padded_mask(FLEX_N, FLEX_REAL)
    lyr = _flex_layer(method, kernel, **options)
    expected = lyr.weights(q, k, mask) @ v.masked_fill(~mask[:, None, :, None], 0)
    real = mask[:, None, :, None]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        with torch.no_grad():
            out = lyr.to(CUDA)(*cuda(q.to(dtype), k.to(dtype), v.to(dtype), mask))
        assert out.dtype == dtype and out.device.type == "cuda"
        out = out.double().cpu()
        assert torch.isfinite(out).all()
        err = ((out - expected).masked_fill(~real, 0).norm() / expected.masked_fill(~real, 0).norm()).item()
        assert err <= tol, (method, options, dtype, err)


@pytest.mark.parametrize("rows", ["apart", "mask"])
@pytest.mark.parametrize("method,options", FLEX_CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(FLEX_CASES)])
def test_flex_kept_block_masks_on_gpu_equal_float64_dense_weights(method, options, rows, monkeypatch):
    """Inputs without padding: the pattern and FlexAttention's block mask are kept after the first call
    (``_blocksparse.cached``); the second call gives the float64 dense weights' output too, with the global queries'
    rows computed apart or inside the block mask (``_flex.GLOBAL_ROWS``)."""
    from approx.attention import _blocksparse, _flex

    monkeypatch.setattr(_flex, "GLOBAL_ROWS", rows)
    _blocksparse.clear_cache()
    q, k, v = make_qkv(FLEX_N, dtype=torch.float64, sharp=1.0)
    lyr = _flex_layer(method, "flex", **options)
    expected = lyr.weights(q, k, None) @ v
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        gpu = lyr.to(CUDA)
        with torch.no_grad():
            outs = [gpu(*cuda(q.to(dtype), k.to(dtype), v.to(dtype)), None).double().cpu() for _ in range(2)]
        for out in outs:
            err = ((out - expected).norm() / expected.norm()).item()
            assert torch.isfinite(out).all() and err <= tol, (method, options, rows, dtype, err)
    _blocksparse.clear_cache()


# the backward's tiles must divide the blocks (64 rows on an H100 below head dim 64): the cases with blocks of 64
FLEX_GRAD_CASES = [(m, o) for m, o in FLEX_CASES if o.get("block", 64) % 64 == 0]


@pytest.mark.parametrize(
    "method,options", FLEX_GRAD_CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(FLEX_GRAD_CASES)]
)
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_flex_gradients_on_gpu_equal_the_gather_kernel(method, options, padded, monkeypatch):
    """FlexAttention's backward (CUDA only, asked for with kernel="flex") against the plain-torch gather kernel's
    autograd, float32; the global queries' rows computed after the kernel (without padding by
    the dense rows' unmasked path, ``_blocksparse._global_rows``)."""
    from approx.attention import _flex

    monkeypatch.setattr(_flex, "GLOBAL_ROWS", "apart")
    q, k, v = make_qkv(FLEX_N, sharp=1.0)
    mask = padded_mask(FLEX_N, FLEX_REAL if padded else FLEX_N).to(CUDA)
    grads = {}
    for kernel in ("gather", "flex"):
        leaves = [t.to(CUDA).requires_grad_() for t in (q, k, v)]
        out = _flex_layer(method, kernel, **options).to(CUDA)(*leaves, mask)
        (out.masked_fill(~mask[:, None, :, None], 0) * torch.linspace(-1, 1, D, device=CUDA)).sum().backward()
        grads[kernel] = [t.grad for t in leaves]
    for name, g_flex, g_gather in zip("qkv", grads["flex"], grads["gather"], strict=True):
        err = ((g_flex - g_gather).norm() / g_gather.norm()).item()
        assert torch.isfinite(g_flex).all() and err <= 1e-4, (method, options, name, err)


def test_auto_kernel_uses_flex_on_long_gpu_inputs_for_inference(monkeypatch):
    """kernel='auto' sends a long CUDA inference call to FlexAttention, a training call to the gather kernel."""
    from approx.attention import _flex

    calls = []
    real_attend = _flex.attend
    monkeypatch.setattr(_flex, "attend", lambda *a, **kw: calls.append(1) or real_attend(*a, **kw))
    q, k, v = (t.to(CUDA) for t in make_qkv(FLEX_N))
    with torch.no_grad():
        _flex_layer("window", "auto", window=64)(q, k, v, None)
    assert calls == [1], "kernel='auto' did not use FlexAttention on a long CUDA input"
    _flex_layer("window", "auto", window=64)(*(t.requires_grad_() for t in (q, k, v)), None).sum().backward()
    assert calls == [1], "kernel='auto' used FlexAttention with gradients"


@pytest.mark.parametrize("method", ["clustered", "i-clustered"])
def test_compiled_engine_on_gpu_equals_the_cpu_eager_code(method):
    """engine="compiled" (Triton kernels through torch.compile on CUDA) against the eager code on the CPU, float64.
    The hash is computed in float32 on both, in different orders, so a query sitting on a threshold may take
    another cluster: almost every row must agree to float64 precision."""
    q, k, v = make_qkv(1100, sharp=1.0, dtype=torch.float64)
    mask = padded_mask(1100, 1001)
    options = {"clusters": 25}
    expected = layer(method, **options)(q, k, v, mask)
    with torch.no_grad():
        out = layer(method, engine="compiled", **options).to(CUDA)(*cuda(q, k, v, mask)).cpu()
    real = mask[:, None, :].expand(out.shape[:3])
    same = ((out - expected).abs().amax(-1) <= 1e-9 * expected.abs().amax()) | ~real
    assert same.float().mean() >= 0.99, same.float().mean()


def test_autotune_on_gpu_takes_cpu_inputs_and_costs_at_the_cost_inputs():
    """Calibration inputs built on the CPU (token-id lists, cost inputs) tune a model on the GPU: the batches go to
    the model's device, the costs are taken at the cost inputs, and the tuned model runs there."""
    model = tiny_model("bert", num_hidden_layers=2).to(CUDA)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(5, 99, (int(n),), generator=g).tolist() for n in torch.randint(20, 60, (8,), generator=g)]
    cost = [[5] * n for n in (90, 120, 150)]
    tuning = approx.autotune(model, data, cost_data=cost, target=None, budget=0.8, batch_size=4, progress=False,
                             methods=["efficient", "nystrom:landmarks=4"])  # fmt: skip
    assert tuning.met and tuning.cost <= 0.8 and tuning.calibration["cost_inputs"] == len(cost)
    inputs = {k: t.to(CUDA) for k, t in batch(seq_len=48, pad=11).items()}
    with torch.no_grad():
        assert torch.isfinite(model_output(model, **inputs)).all()
