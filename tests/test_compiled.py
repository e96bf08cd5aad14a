"""engine="compiled" (torch.compile of the sync-free clustering and the static block recomputation) against the eager
code and the float64 reference; skipped, saying why, where torch.compile cannot compile (no C++ compiler).

Every test here uses float64 inputs with a padded row, so that the one compiled graph per function (dynamic shapes)
serves them all: a compilation takes tens of seconds on the CPU.
"""

import pytest
import torch
from reference import naive_attention
from test_methods import D, make_qkv, padded_mask

from approx import ApproxAttention, get_method
from approx.attention import _compiled, _hashing, _kmeans
from approx.attention import clustered as clustered_mod

N = 300


def run(method, x, mask, **options):
    layer = ApproxAttention(method, get_method(method).make_config(**options), head_dim=D)
    try:
        with torch.no_grad():
            return layer(*x, mask)
    except RuntimeError as err:
        if "could not compile" in str(err):
            pytest.skip(f"torch.compile cannot compile here: {err}")
        raise


C = 8  # one number of clusters everywhere: it is part of the compiled graph


@pytest.mark.parametrize("distinct", [None, 5])
def test_compiled_clustering_equals_the_eager_kmeans(distinct):
    """The compiled hash + sync-free K-means + Euclidean step + centroids give the eager CPU path's clusters
    (incremental votes, a fixed-point stop), padding and fewer distinct codes than clusters included."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, N, D, generator=g, dtype=torch.float64) * 3
    q[:, :, : N // 3] = q[:, :, :1]  # many equal queries
    if distinct is not None:  # fresh codes for the clusters left without one
        q = q[:, :, :distinct][:, :, torch.arange(N) % distinct]
    mask = padded_mask(N, N - 70)
    config = clustered_mod.ClusteredConfig(clusters=C, seed=1)
    state = get_method("clustered").init_state(config, head_dim=D, seed=1)
    eager = clustered_mod.cluster_queries(q, mask, config, state)
    args = (q, mask, state["planes"], state["offsets"], state["salt"], C, config.iterations, config.refine)
    try:
        assign, qc = _compiled.call(clustered_mod._clusters, *args, method="clustered")
    except RuntimeError as err:
        if "could not compile" not in str(err):
            raise
        pytest.skip(f"torch.compile cannot compile here: {err}")
    real = mask[:, None, :].expand_as(eager)
    assert torch.equal(assign[real], eager[real])
    torch.testing.assert_close(qc, clustered_mod.centroids(q, eager, mask, config.clusters)[0])


@pytest.mark.parametrize("method", ["clustered", "i-clustered"])
def test_compiled_engine_gives_the_eager_output(method):
    x = make_qkv(N, dtype=torch.float64)
    mask = padded_mask(N, N - 70)
    eager = run(method, x, mask, clusters=C)
    compiled = run(method, x, mask, clusters=C, engine="compiled")
    real = mask[:, None, :, None].expand_as(eager)
    torch.testing.assert_close(compiled[real], eager[real], rtol=1e-10, atol=1e-12)


def test_exact_limits_while_the_compiled_code_runs():
    """Against float64 attention: clustered with at most C distinct queries (each cluster one value), improved
    clustered with k = every key (every score recomputed)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, N, D, generator=g, dtype=torch.float64) * 0.5 for _ in range(3))
    mask = padded_mask(N, N - 70)
    ref = naive_attention(q, k, v, mask)
    real = mask[:, None, :, None].expand_as(ref)
    distinct = q[:, :, :C][:, :, torch.arange(N) % C]
    out = run("clustered", (distinct, k, v), mask, clusters=C, engine="compiled")
    torch.testing.assert_close(out[real], naive_attention(distinct, k, v, mask)[real], rtol=1e-9, atol=1e-9)
    out = run("i-clustered", (q, k, v), mask, clusters=C, topk=N, engine="compiled")
    torch.testing.assert_close(out[real], ref[real], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("distinct", [None, 3])
def test_sync_free_start_is_the_synchronised_one(distinct):
    """Without a host synchronisation the start compares every query at once: the same C codes, fresh codes where
    the queries hold fewer distinct codes than clusters (``distinct``), and where the first 4C do (C = 60)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, N, D, generator=g)
    q[:, :, : N // 2] = q[:, :, :1]
    if distinct is not None:
        q = q[:, :, N // 2 - 1 : N // 2 - 1 + distinct][:, :, torch.arange(N) % distinct]
    mask = padded_mask(N, N - 70)
    state = get_method("clustered").init_state(clustered_mod.ClusteredConfig(), head_dim=D, seed=0)
    signs = _hashing.hash_signs(q, state["planes"], state["offsets"], mask)[..., :-1]
    for clusters in (4, 60):
        fresh = _kmeans._FreshCodes(state["salt"], 3, clusters, signs.shape[-1], "cpu")
        synced = _kmeans._initial_centroids(signs, mask, clusters, state["salt"], fresh)
        free = _kmeans._initial_centroids(signs, mask, clusters, state["salt"], fresh[0], sync=False)
        assert torch.equal(free, synced)


def test_engine_option_is_checked_and_a_failed_compilation_says_what_to_do(monkeypatch):
    with pytest.raises(ValueError, match="'eager', 'compiled'"):
        get_method("clustered").make_config(engine="fast")

    def broken(*args):
        raise ValueError("no C++ compiler")

    monkeypatch.setattr(_compiled, "_COMPILE_ERRORS", (ValueError,))
    monkeypatch.setitem(_compiled._COMPILED, (clustered_mod._clusters, True), broken)
    layer = ApproxAttention("clustered", get_method("clustered").make_config(engine="compiled"), head_dim=D)
    with pytest.raises(RuntimeError, match="engine='eager'"):
        layer(*make_qkv(N), None)


@pytest.mark.parametrize("method", ["clustered", "i-clustered"])
def test_compiled_engine_gradients_equal_the_eager_ones(method):
    """Training through the compiled graphs (torch.compile's autograd): the eager code's gradients, float64."""
    mask = padded_mask(N, N - 70)
    grads = {}
    for engine in ("eager", "compiled"):
        x = [t.requires_grad_() for t in make_qkv(N, dtype=torch.float64)]
        layer = ApproxAttention(method, get_method(method).make_config(clusters=C, engine=engine), head_dim=D)
        try:
            out = layer(*x, mask)
        except RuntimeError as err:
            if "could not compile" in str(err):
                pytest.skip(f"torch.compile cannot compile here: {err}")
            raise
        (out.masked_fill(~mask[:, None, :, None], 0) * torch.linspace(-1, 1, D, dtype=torch.float64)).sum().backward()
        grads[engine] = [t.grad for t in x]
    for name, a, b in zip("qkv", grads["compiled"], grads["eager"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=f"d{name}")


def test_the_clustering_graph_does_not_depend_on_the_length():
    """``_clusters`` (hash, sync-free K-means, one Euclidean step, centroids) traced with dynamic shapes is one graph
    for every length: a Python loop over blocks of queries would fix the length in it and recompile per length
    (dynamo's tracing only, no inductor: seconds). The clusters equal the eager code's."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    config = clustered_mod.ClusteredConfig(clusters=C, seed=1)
    assert config.refine >= 1
    state = get_method("clustered").init_state(config, head_dim=D, seed=1)
    traced = torch.compile(clustered_mod._clusters, backend=counter, dynamic=True)
    g = torch.Generator().manual_seed(0)
    for n in (40, 56, 72, 90):
        q = torch.randn(2, 3, n, D, generator=g)
        mask = padded_mask(n, n - 7)
        args = (q, mask, state["planes"], state["offsets"], state["salt"], C, config.iterations, config.refine)
        assign, _ = traced(*args)
        real = mask[:, None, :].expand_as(assign)
        assert torch.equal(assign[real], clustered_mod.cluster_queries(q, mask, config, state)[real])
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for 4 lengths"
