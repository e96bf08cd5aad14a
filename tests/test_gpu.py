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
from test_methods import LIMITED, METHODS, B, D, H, layer, limit_inputs, make_qkv, padded_mask, small_budget

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
    """full, and every method along its registered exact limit (as in test_methods.py), on the GPU; exact_below."""
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
        ref, args = naive_attention(q, k, v, mask).masked_fill(~real, 0), cuda(q, k, v, mask)

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
