"""A randomised test (hypothesis) over the options of every registered method, driven by the registry and the
config dataclasses: invalid values are refused by name, valid ones give finite outputs that padding does not
change. Bounded in time (``max_examples``, ``deadline``): a few seconds."""

import contextlib
import dataclasses
import math
import sys
import typing
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import approx
from approx import ApproxAttention, get_method, methods

METHODS = methods()

_NUMBERS = [-1.0, 0.0, 1e-12, 1e-3, 0.25, 1.0, 1 + 1e-12, 1 + 1e-9, 1.001, 1.3, 1.5, 2.0, 3.0, 1e7, 1e30]


def _choices(method: str) -> list[str]:
    """Strings an option of ``method`` may take: the tuples of strings of its module (its kernels, groupings...)."""
    module = sys.modules[get_method(method).attend.__module__]
    found = [x for value in vars(module).values() if isinstance(value, tuple) for x in value if isinstance(x, str)]
    return sorted(set(found))


def _option_values(method: str, hint, default):
    wrong_type = st.sampled_from(["3", None, 2.5] if hint is int else ["3", None])
    values = {
        int: st.integers(-2, 40),
        float: st.sampled_from(_NUMBERS + [math.nan, math.inf]) | st.floats(-2.0, 50.0),
        bool: st.booleans(),
        str: st.sampled_from(_choices(method) + ["nonsense"]),
    }[hint]
    return st.just(default) | values | wrong_type


def _padding_tolerance(config) -> float:
    """How far real outputs may move when padding is added, in float64. A longer (padded) input goes through
    matrix products of another shape, so its scores differ in the last bits, and so does a bisection's threshold
    tau. alpha-entmax weights are (x - tau)^(1 / (alpha - 1)): near the edge of the support that exponent is
    Hölder, so a change dx moves a weight by up to dx^(1 / (alpha - 1)), far more than dx once alpha > 2 (seen,
    with the entmax of padded and unpadded scores themselves identical: about 1e-6 at alpha = 9, 0.041 at
    alpha = 10, 0.065 at alpha = 11, i.e. dx up to about 1e-12); the bound takes dx = 1e-10 for a margin.
    Sort-based entmax15 (alpha = 1.5) and the other methods get the plain 1e-8."""
    alpha = getattr(config, "alpha", 1.5)
    if alpha == 1.5 or alpha <= 2.0:
        return 1e-8
    return max(1e-8, 1e-10 ** (1.0 / (alpha - 1.0)))


def _options(method: str):
    cls = get_method(method).config_class
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    return st.fixed_dictionaries({f.name: _option_values(method, hints[f.name], f.default) for f in fields})


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=25, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_options_are_refused_by_name_or_give_finite_padding_free_outputs(method, data):
    """Random options of every registered method (from its config dataclass), random shapes and padding: an
    invalid value raises ValueError naming an option that was set; a valid config gives finite outputs, and
    more padding does not change the real outputs. (Methods with learned state: validation only.)"""
    spec = get_method(method)
    options = data.draw(_options(method), label="options")
    set_options = [name for name, value in options.items() if value is not getattr(spec.config_class, name, value)]
    try:
        config = spec.config_class(**options)
    except ValueError as e:
        assert any(f"option {name!r}" in str(e) for name in options), str(e)
        return
    if spec.requires_fit(config):
        return
    assert set_options is not None
    batch = data.draw(st.integers(1, 2), label="batch")
    heads = data.draw(st.integers(1, 2), label="heads")
    d = data.draw(st.sampled_from([4, 8]), label="d")
    n = data.draw(st.integers(1, 40), label="n")
    extra = data.draw(st.integers(1, 20), label="extra padding")
    real = data.draw(st.lists(st.integers(1, n), min_size=batch, max_size=batch), label="real tokens")
    size = data.draw(st.sampled_from([0.5, 2.0]), label="input scale")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    q, k, v = (size * torch.randn(batch, heads, n + extra, d, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.arange(n + extra)[None, :] < torch.tensor(real)[:, None]  # (B, n + extra)
    lyr = ApproxAttention(method, config, head_dim=d)
    # a method that reads the question (window's question_global) gets one: a random prefix of each row's tokens
    asks = getattr(config, "question_global", False)
    question = torch.arange(n + extra)[None, :] < torch.tensor([data.draw(st.integers(0, r)) for r in real])[:, None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fallbacks announced by the methods are not the point here
        with approx.tokens(question_mask=question[:, :n]) if asks else contextlib.nullcontext():
            short = lyr(q[:, :, :n], k[:, :, :n], v[:, :, :n], mask[:, :n])
        with approx.tokens(question_mask=question) if asks else contextlib.nullcontext():
            long = lyr(q, k, v, mask)
    assert torch.isfinite(short).all() and torch.isfinite(long).all()
    atol = _padding_tolerance(config)
    for row, count in enumerate(real):
        torch.testing.assert_close(long[row, :, :count], short[row, :, :count], rtol=1e-6, atol=atol)


@pytest.mark.parametrize(
    "method", [m for m in METHODS if float in typing.get_type_hints(get_method(m).config_class).values()]
)
def test_float_options_refuse_nan_and_infinity_by_name(method):
    """A saved model records its options in JSON, which has neither NaN nor infinity (approx writes them as null):
    every float option refuses both, naming itself, rather than saving a folder that cannot be loaded back (a
    Sparsefinder ``threshold`` of infinity was accepted, saved as null and refused by ``approx.load``)."""
    cls = get_method(method).config_class
    for name, hint in typing.get_type_hints(cls).items():
        if hint is not float:
            continue
        for bad in (math.inf, -math.inf, math.nan):
            with pytest.raises(ValueError, match=rf"option {name!r} must be a finite number"):
                cls(**{name: bad})
