"""Sparsefinder: the sparse-consistency property (a graph holding the gold support gives exact entmax), its
dense limits, graph statistics on a hand-made example, fitting (better than random projections), the
unfitted error, model-level fitting, save/load and the evaluation harness's graph block. The generic
padding / dtype / gradient / save-load tests cover it as well (fitted through the registry's hook)."""

import json

import pytest
import torch
from conftest import batch, model_output, tiny_model
from entmax import entmax15
from evalfixtures import write_checkpoint, write_data
from reference import naive_attention

import approx
from approx import ApproxAttention
from approx.attention._fitting import evaluate_loss, random_projections
from approx.attention.sparsefinder import SparsefinderConfig
from approx.harness.fitting import graph_summary

B, H, N, D = 2, 3, 64, 16
PAD = 20


def inputs(seed=0, n=N, rank=4, dtype=torch.float64):
    """Queries and keys with a low-rank structure (scores depend on 4 latent dims) plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(H, rank, D, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
    q = torch.einsum("bhnr,hrd->bhnd", torch.randn(B, H, n, rank, generator=g, dtype=torch.float64), u) * 1.5
    k = torch.einsum("bhnr,hrd->bhnd", torch.randn(B, H, n, rank, generator=g, dtype=torch.float64), u)
    q = q + 0.1 * torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
    k = k + 0.1 * torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, n - PAD :] = False
    return q.to(dtype), k.to(dtype), v.to(dtype), mask


def dense_entmax(q, k, v, mask, scale=D**-0.5):
    """Independent float64 reference: the package's entmax15 over all (masked) scores."""
    scores = torch.einsum("bhnd,bhsd->bhns", q.double(), k.double()) * scale
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    return torch.einsum("bhns,bhsd->bhnd", entmax15(scores, dim=-1), v.double())


_STATE = {}


def fitted(**options):
    """A layer fitted on inputs(seed=0) (cached per projection settings: the fit does not depend on the grouping's
    budget options, only the centroids do)."""
    cfg = SparsefinderConfig(**options)
    lyr = ApproxAttention("sparsefinder", cfg, head_dim=D)
    key = (cfg.clusters, cfg.seed, cfg.alpha)
    if key not in _STATE:
        q, k, _, mask = inputs(0, dtype=torch.float32)
        lyr.fit([(q, k, mask, D**-0.5)], steps=200)
        _STATE[key] = lyr.state()
    lyr.load_state(_STATE[key])
    return lyr


# ------------------------------------------------------------------------------------------ exact limits


@pytest.mark.parametrize("grouping", ["distance", "bucketing", "kmeans"])
def test_window_covering_every_pair_is_dense_entmax(grouping):
    q, k, v, mask = inputs(1)
    out = fitted(grouping=grouping, window=N, global_tokens=0)(q, k, v, mask)
    torch.testing.assert_close(out, dense_entmax(q, k, v, mask), rtol=0, atol=1e-12)
    soft = fitted(grouping=grouping, window=N, target="softmax")(q, k, v, mask)
    torch.testing.assert_close(soft, naive_attention(q, k, v, mask), rtol=0, atol=1e-12)


def test_graph_holding_the_gold_support_gives_exact_entmax():
    """Sparse consistency: tokens fall in 4 latent groups and attend within their group; k-means on
    hand-set projections (the group coordinates) and centroids (the group centres) predicts the group pairs,
    a graph holding G but only about a quarter of the pairs, and the output is the dense entmax output."""
    g = torch.Generator().manual_seed(5)
    group = torch.randint(4, (B, H, N), generator=g)
    centre = torch.eye(D, dtype=torch.float64)[:4] * 4  # (4, D)
    q = centre[group] + 0.3 * torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    k = centre[group] + 0.3 * torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, N - PAD :] = False
    cfg = dict(grouping="kmeans", clusters=4, window=0, global_tokens=0)
    lyr = ApproxAttention("sparsefinder", SparsefinderConfig(**cfg), head_dim=D)
    pick = torch.eye(D)[:, :4].expand(H, D, 4)  # (H, d, r): the group coordinates
    lyr.load_state(
        {
            "proj_q": pick,
            "proj_k": pick,
            "centroids": (centre[:, :4].float() * 1.0).expand(H, 4, 4),
            "fitted": torch.tensor(1).byte(),
        }
    )
    stats = graph_summary({0: lyr.graph_stats(q, k, mask)})
    assert stats["recall"] == 1.0 and stats["exact_fraction"] == 1.0
    assert stats["sparsity"] > 0.6, "the graph is (almost) dense: the test would prove nothing"
    torch.testing.assert_close(lyr(q, k, v, mask), dense_entmax(q, k, v, mask), rtol=0, atol=1e-12)
    # softmax has no zeros: on the same graph it differs from dense softmax, so the graph really leaves pairs out
    soft = ApproxAttention("sparsefinder", SparsefinderConfig(**cfg, target="softmax"), head_dim=D)
    soft.load_state(lyr.state())
    assert (soft(q, k, v, mask) - naive_attention(q, k, v, mask)).abs().max() > 1e-3


@pytest.mark.parametrize(
    "options",
    [
        {"grouping": "kmeans", "top_clusters": 2, "window": 2, "last_token": True},
        {"grouping": "bucketing", "buckets": 4, "global_tokens": 2},
        {"grouping": "distance", "threshold": 1.5, "target": "softmax"},
        {"grouping": "kmeans", "window": 0, "global_tokens": 0, "alpha": 1.3},
        {"grouping": "kmeans", "window": 3, "global_tokens": 2, "last_token": True},  # the cluster-block path
        {"grouping": "kmeans", "window": 1, "target": "softmax"},
    ],
)
def test_fast_path_equals_the_simulated_dense_graph(options, monkeypatch):
    """The fast paths (gathered keys; cluster blocks for kmeans with one cluster per query) and the dense
    simulated path are separate code on the same graph. Small chunks and a short first entmax sort exercise the
    chunking and the partial sort's widening."""
    from approx.attention import sparsefinder

    monkeypatch.setattr(sparsefinder, "_ENTMAX_K", 2)
    q, k, v, mask = inputs(3)
    lyr = fitted(**options)
    w = lyr.weights(q, k, mask)  # (B, H, N, S) dense, on the predicted graph
    assert (w[1, :, :, N - PAD :] == 0).all()
    want = w @ v.masked_fill(~mask[:, None, :, None], 0)
    for budget in (sparsefinder._BLOCK_ELEMENTS, 1):  # chunks of many blocks (of clusters of several sizes), of one
        monkeypatch.setattr(sparsefinder, "_BLOCK_ELEMENTS", budget)
        torch.testing.assert_close(lyr(q, k, v, mask), want, rtol=0, atol=1e-9)


def test_cluster_ids_are_the_nearest_centroids_in_row_blocks(monkeypatch):
    """Nearest centroids, computed a block of rows at a time, against a float64 argsort of all distances."""
    from approx.attention import _graph

    monkeypatch.setattr(_graph, "_ID_ROWS", 7)  # several blocks and a short last one
    g = torch.Generator().manual_seed(0)
    qp, kp = torch.randn(B, H, 30, 4, generator=g), torch.randn(B, H, 25, 4, generator=g)
    cent = torch.randn(H, 6, 4, generator=g)
    q_ids, k_ids = _graph.cluster_ids(qp, kp, cent, top_clusters=2)
    dq = ((qp.double()[..., None, :] - cent.double()[None, :, None]) ** 2).sum(-1)  # (B, H, N, C)
    dk = ((kp.double()[..., None, :] - cent.double()[None, :, None]) ** 2).sum(-1)
    assert torch.equal(q_ids, dq.argsort(-1)[..., :2])
    assert torch.equal(k_ids, dk.argmin(-1, keepdim=True))


def test_keys_in_several_groups_are_counted_once():
    """Bucketing joins q and k when any of the r dimensions shares a bucket: a key sharing several must get
    one weight. With one bucket per dimension every pair shares all r: softmax over the graph is exact."""
    q, k, v, mask = inputs(4)
    lyr = fitted(grouping="bucketing", buckets=1, window=3, target="softmax")
    torch.testing.assert_close(lyr(q, k, v, mask), naive_attention(q, k, v, mask), rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------------- statistics


def hand_made():
    """One head, 2-d queries and keys, identity projections, centroids at (-5, 0) and (5, 0), scale 1, no
    window or global token; token 4 is padding. Keys 0, 1 (and pad 4) are in cluster 0, keys 2, 3 in cluster 1.

    query       scores (k0..k3)            gold (entmax15)  cluster  predicted   hit
    (-10, 0)    10, 10, -10, -10           {0, 1}           0        {0, 1}      2
    (0.5, 10)   9.5, -10.5, 10.5, -9.5     {0, 2} (gap 1<2) 1        {2, 3}      1
    (10, 0.2)   -9.8, -10.2, 10.2, 9.8     {2, 3}           1        {2, 3}      2
    (-0.5, -10) -9.5, 10.5, -10.5, 9.5     {1, 3}           0        {0, 1}      1
    -> valid pairs 16, |Ĝ| = 8, |G| = 8, hits 6: sparsity 0.5, recall 0.75, exact fraction 2/4."""
    q = torch.tensor([[-10, 0], [0.5, 10], [10, 0.2], [-0.5, -10], [-3, 0]], dtype=torch.float64)
    k = torch.tensor([[-1, 1], [-1, -1], [1, 1], [1, -1], [-1, 0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True, False]])
    cfg = SparsefinderConfig(grouping="kmeans", clusters=2, projection_dim=2, window=0, global_tokens=0)
    lyr = ApproxAttention("sparsefinder", cfg, head_dim=2)
    eye = torch.eye(2)[None]
    lyr.load_state(
        {
            "proj_q": eye,
            "proj_k": eye,
            "centroids": torch.tensor([[[-5.0, 0], [5.0, 0]]]),
            "fitted": torch.tensor(1).byte(),
        }
    )
    return lyr, q[None, None], k[None, None], mask


def test_statistics_on_a_hand_made_example():
    lyr, q, k, mask = hand_made()
    counts = lyr.graph_stats(q, k, mask, scale=1.0)
    assert {n: float(t.sum()) for n, t in counts.items()} == {
        "predicted": 8,
        "valid": 16,
        "gold": 8,
        "hit": 6,
        "queries": 4,
        "exact": 2,
    }
    s = graph_summary({0: counts})
    assert (s["sparsity"], s["recall"], s["exact_fraction"]) == (0.5, 0.75, 0.5)
    # the output of query 1 is entmax over its predicted keys {2, 3} only
    v = torch.arange(10, dtype=torch.float64).reshape(1, 1, 5, 2)
    out = lyr(q, k, v, mask, scale=1.0)
    p = entmax15(torch.tensor([10.5, -9.5], dtype=torch.float64), dim=-1)
    torch.testing.assert_close(out[0, 0, 1], p @ v[0, 0, 2:4])


# ----------------------------------------------------------------------------------------------- fitting


def test_fitted_projections_beat_random_ones_on_held_out_inputs():
    """Margin loss and recall at equal sparsity (the 25 % nearest real keys of each query) on held-out
    inputs: the fitted projections against the random ones they start from."""
    lyr = fitted()
    st = lyr.state()
    rq, rk = random_projections(H, D, 4, seed=0)
    held = [inputs(s, dtype=torch.float32) for s in (10, 11)]
    samples = [(q, k, m, D**-0.5) for q, k, _, m in held]
    loss_fit = evaluate_loss(samples, st["proj_q"], st["proj_k"], 1.5)
    loss_rand = evaluate_loss(samples, rq, rk, 1.5)
    assert loss_fit < 0.5 * loss_rand, (loss_fit, loss_rand)

    def recall(pq, pk):
        hits = total = 0
        for q, k, _, m in held:
            scores = (q @ k.transpose(-1, -2) * D**-0.5).masked_fill(~m[:, None, None, :], float("-inf"))
            gold = (entmax15(scores, dim=-1) > 0) & m[:, None, :, None]
            dist = torch.cdist(q @ pq[None], k @ pk[None]).masked_fill(~m[:, None, None, :], 1e30)
            near = dist <= dist.kthvalue(int(0.25 * (N - PAD)), dim=-1, keepdim=True).values
            hits += int((gold & near).sum())
            total += int(gold.sum())
        return hits / total

    r_fit, r_rand = recall(st["proj_q"], st["proj_k"]), recall(rq, rk)
    assert r_fit > r_rand + 0.1 and r_fit > 0.8, (r_fit, r_rand)


def test_fit_is_seeded():
    q, k, _, mask = inputs(0, dtype=torch.float32)
    states = []
    for seed in (0, 0, 1):
        lyr = ApproxAttention("sparsefinder", SparsefinderConfig(seed=seed), head_dim=D)
        lyr.fit([(q, k, mask, D**-0.5)], steps=20)
        states.append(lyr.state())
    assert all(torch.equal(states[0][n], states[1][n]) for n in states[0])
    assert not torch.equal(states[0]["proj_q"], states[2]["proj_q"])


def test_fit_settings_are_checked_against_the_fit_config():
    """approx.fit's settings are the fields of the method's fit_config (defaults in one dataclass): an unknown or
    impossible one is refused before anything runs, naming the valid ones."""
    fit_config = approx.get_method("sparsefinder").fit_config
    names = [o["name"] for o in fit_config.describe()]
    assert {"steps", "lr", "queries", "margin", "fit_projections_too"} <= set(names)
    assert fit_config.from_options(steps=7).steps == 7
    model = approx.patch(tiny_model("bert"), "sparsefinder", clusters=3)
    with pytest.raises(ValueError) as e:
        approx.fit(model, [batch(16)], progress=False, step=10)
    assert "did you mean 'steps'" in str(e.value) and all(n in str(e.value) for n in names)
    with pytest.raises(ValueError, match="lr"):
        approx.fit(model, [batch(16)], progress=False, lr=-1.0)


def test_the_fit_runs_the_registered_teacher():
    """While fitting, a layer runs its method's teacher: entmax for target=entmax, exact softmax otherwise."""
    from approx.harness.fitting import _stand_in

    for target, want in (("entmax", "entmax"), ("softmax", "full")):
        layer = ApproxAttention("sparsefinder", SparsefinderConfig(target=target, alpha=1.3), head_dim=D, layer_index=2)
        stand_in = _stand_in(layer)
        assert (stand_in.method.name, stand_in.layer_index) == (want, 2)
        if want == "entmax":
            assert stand_in.config.alpha == 1.3


def test_running_before_fitting_says_to_fit_first():
    model = approx.patch(tiny_model("bert"), "sparsefinder")
    with pytest.raises(RuntimeError, match=r"fit first with approx\.fit"):
        model(**batch(16))
    with pytest.raises(ValueError, match="needs fitting"):
        approx.fit(approx.patch(tiny_model("bert"), "clustered"), [batch(16)])


@pytest.mark.parametrize("grouping", ["distance", "kmeans"])
def test_cross_attention_is_refused_by_every_path(grouping):
    """Queries and keys of different lengths: the window and the global tokens are shared positions, so a call with
    N != S is refused by name (it had failed on a broadcast, deep in the kernel), on the output, weights and
    statistics paths."""
    lyr = fitted(grouping=grouping)
    q, k, v, _ = inputs(1, dtype=torch.float32)
    for keys, values in ((k[:, :, :40], v[:, :, :40]), (torch.cat([k, k], 2), torch.cat([v, v], 2))):
        for call in (lambda: lyr(q, keys, values), lambda: lyr.weights(q, keys), lambda: lyr.graph_stats(q, keys)):
            with pytest.raises(ValueError, match=r"sparsefinder: self-attention only \(N = S\).*got N = 64"):
                call()


def test_model_fit_with_full_window_equals_the_entmax_model_and_survives_save_load(tmp_path):
    """approx.fit on a tiny model (entmax target: q/k collected while the model runs entmax); with a window
    covering every pair the fitted model is the entmax model; the state is saved and reloaded."""
    inputs_ = batch(40, pad=9)
    model = tiny_model("bert")
    with torch.no_grad():
        ref = model_output(approx.patch(model, "entmax"), **inputs_)
    approx.patch(model, "sparsefinder", window=64)
    report = approx.fit(model, [batch(40, seed=s) for s in range(3)], progress=False, steps=50)
    assert report["layers"] == [0, 1] and report["inputs"] == 6
    with torch.no_grad():
        out = model_output(model, **inputs_)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    approx.save(model, tmp_path / "sf")
    saved = json.loads((tmp_path / "sf/approx_config.json").read_text())
    assert saved["layers"][0]["config"]["window"] == 64
    loaded = approx.load(tmp_path / "sf").eval()
    with torch.no_grad():
        assert torch.equal(model_output(loaded, **inputs_), out)
    stats = approx.graph_stats(loaded, [inputs_], progress=False)
    assert stats["recall"] == 1.0 and stats["sparsity"] == 0.0 and set(stats["per_layer"]) == {"0", "1"}
    assert len(stats["per_layer"]["0"]["heads"]) == 4


def test_harness_reports_graph_sparsity_and_recall(tmp_path):
    from transformers import AutoModel, AutoTokenizer

    from approx.harness.data import wikitext_windows

    data = write_data(tmp_path / "data")
    path = write_checkpoint(tmp_path / "ckpt", "base")
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    approx.patch(model, "sparsefinder", clusters=3, window=1, target="softmax")
    approx.fit(model, wikitext_windows(tok, data, split="valid", length=32, count=4), progress=False, steps=50)
    expected = approx.graph_stats(model, wikitext_windows(tok, data, split="test", length=32, count=4), progress=False)
    layers = approx.patched_layers(model)
    approx.unpatch(model)
    (r,) = approx.evaluate(
        model, "wikitext2", [layers], tokenizer=tok, data_dir=str(data), source="local", max_length=32, limit=4
    )
    graph = r["fidelity"]["graph"]
    assert 0 < graph["sparsity"] < 1 and 0 < graph["recall"] <= 1
    for name in ("sparsity", "recall", "exact_fraction"):
        assert graph[name] == pytest.approx(expected[name], rel=1e-9)
    assert set(graph["per_layer"]) == {"0", "1"}
    # methods without a predicted graph report none
    (c,) = approx.evaluate(
        model, "wikitext2", ["clustered:clusters=3"], tokenizer=tok, data_dir=str(data), source="local", limit=2
    )
    assert "graph" not in c["fidelity"]


def test_cli_fit_saves_a_fitted_model_that_loads_and_runs(tmp_path, capsys):
    from approx.harness.cli import main

    data = write_data(tmp_path / "data")
    path = write_checkpoint(tmp_path / "ckpt", "base")
    out = tmp_path / "fitted"
    args = ["fit", "--model", str(path), "--data-dir", str(data), "--windows", "3", "--length", "32"]
    args += ["--method", "sparsefinder:clusters=3,target=softmax", "--steps", "20", "--stats-windows", "2"]
    assert main([*args, "--output-dir", str(out), "--quiet"]) == 0
    assert "fitted 2 layers on 3 valid windows" in capsys.readouterr().out
    report = json.loads((out / "approx_fit.json").read_text())
    assert report["method"]["clusters"] == 3 and report["fit"]["options"] == {"steps": 20}
    assert 0 < report["graph_on_test"]["recall"] <= 1 and "git_commit" in report["provenance"]
    # what the fit read: the file, and the batches its samples came in (their padding, its steps' draws)
    assert report["data"] == {
        "file": str((data / "wikitext-2" / "wiki.valid.tokens").resolve()), "split": "valid", "windows": 3,
        "length": 32, "batch_size": 4,
    }  # fmt: skip
    model = approx.load(out).eval()
    with torch.no_grad():
        ids = torch.randint(5, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
        assert torch.isfinite(model(input_ids=ids).last_hidden_state).all()
    # a method with nothing to fit, and evaluating an unfitted sparsefinder, exit 2 saying why
    assert main([*args[:-6], "--method", "clustered", "--output-dir", str(out)]) == 2
    assert "nothing to fit" in capsys.readouterr().err
    assert (
        main(["eval", "--model", str(path), "--task", "wikitext2", "--data-dir", str(data), "--method", "sparsefinder"])
        == 2
    )
    assert "must be fitted" in capsys.readouterr().err
    # the fitted folder is a method of `approx eval`: its layers run, and the harness reports their graph,
    # equal to graph_stats of the reloaded model on the same windows
    from transformers import AutoTokenizer

    from approx.harness.data import wikitext_windows

    res = tmp_path / "eval.json"
    ev = ["eval", "--model", str(path), "--task", "wikitext2", "--data-dir", str(data), "--max-length", "32"]
    assert main([*ev, "--limit", "3", "--method", str(out), "--method", "clustered", "--output", str(res)]) == 0
    fitted, clustered = json.loads(res.read_text())
    assert fitted["method"]["name"] == "sparsefinder" and fitted["method"]["clusters"] == 3
    windows = wikitext_windows(AutoTokenizer.from_pretrained(path), data, split="test", length=32, count=3)
    expected = approx.graph_stats(approx.load(out).eval(), windows, progress=False)
    for name in ("sparsity", "recall", "exact_fraction"):
        assert fitted["fidelity"]["graph"][name] == pytest.approx(expected[name], rel=1e-9)
    assert "graph" not in clustered["fidelity"]
    assert main([*ev, "--method", str(out), "--clusters", "4"]) == 2
    assert "saved setting" in capsys.readouterr().err


def test_saved_layers_leave_the_model_as_it_was(tmp_path):
    """approx.integration.saved_layers builds a saved folder's layers for another model without patching it
    and without giving it the saved checkpoint's attention implementation."""
    from approx.integration import saved_layers

    model = tiny_model("bert")
    approx.patch(model, "sparsefinder", window=64)
    approx.fit(model, [batch(40, seed=s) for s in range(2)], progress=False, steps=5)
    approx.save(model, tmp_path / "sf")
    other = tiny_model("bert", seed=1)
    other.set_attn_implementation("eager")
    layers = saved_layers(other, tmp_path / "sf")
    assert not approx.is_patched(other) and other.config._attn_implementation == "eager"
    assert sorted(layers) == [0, 1] and int(layers[0].state()["fitted"]) == 1
    torch.testing.assert_close(layers[1].state()["proj_q"], approx.patched_layers(model)[1].state()["proj_q"])


def test_buckets_hold_equally_many_real_keys_whatever_the_padding():
    """Bucketing against its definition: with a row's real keys ranked per projected dimension (distinct values),
    key of rank i falls in bucket #{m in 1..beta-1 : floor(m n / beta) <= i} (n real keys), so each bucket holds
    floor or ceil of n / beta of them; a query takes the bucket of the keys it falls among; padding (huge, at the
    end or not) changes no real id. (Boundaries taken over the padded length, or ties sent to the lower bucket,
    had survived every test.)"""
    from approx.attention._graph import bucket_ids

    g = torch.Generator().manual_seed(0)
    b, h, s, r, beta = 2, 3, 37, 4, 5
    kp = torch.randn(b, h, s, r, generator=g, dtype=torch.float64)
    qp = torch.randn(b, h, 11, r, generator=g, dtype=torch.float64)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[1, 29:] = False  # row 1: 29 real keys
    padded = kp.clone()
    padded[1, :, 29:] = 1e6
    q_ids, k_ids = bucket_ids(qp, padded, mask, beta)
    for row, n in ((0, s), (1, 29)):
        bounds_at = [m * n // beta for m in range(1, beta)]
        for head in range(h):
            for dim in range(r):
                real = kp[row, head, :n, dim]
                rank = real.argsort().argsort()
                want = torch.tensor([sum(p <= int(i) for p in bounds_at) for i in rank])
                assert torch.equal(k_ids[row, head, :n, dim], want)
                counts = torch.bincount(want, minlength=beta)
                assert int(counts.max()) - int(counts.min()) <= 1
                ordered = real.sort().values
                for j, x in enumerate(qp[row, head, :, dim]):  # a query: the bucket of the keys at or below it
                    below = int((ordered <= x).sum())
                    assert int(q_ids[row, head, j, dim]) == sum(p < below for p in bounds_at)
    unpadded_q, unpadded_k = bucket_ids(qp[1:], kp[1:, :, :29], None, beta)
    assert torch.equal(k_ids[1, :, :29], unpadded_k[0]) and torch.equal(q_ids[1], unpadded_q[0])


def test_cost_counts_the_window_the_docs_define():
    """The cost's estimate of the predicted graph, written out from the definitions: a query's group (``top_clusters``
    clusters of S / ``clusters`` keys: balanced), its window |i - j| <= w (2w + 1 keys), and the global tokens, whose
    rows attend every key. (A window counted as 2w keys had survived the tests.)"""
    from approx import get_method

    spec = get_method("sparsefinder")
    n, d, dv = 200, 16, 24
    for w, glob, last, clusters, top in ((3, 0, False, 200, 1), (5, 2, True, 10, 2), (0, 1, False, 25, 1)):
        config = SparsefinderConfig(window=w, global_tokens=glob, last_token=last, clusters=clusters, top_clusters=top)
        cost = spec.cost(config, n=n, s=n, d=d, dv=dv)
        g = glob + int(last)
        per_query = top * -(-n // clusters) + (2 * w + 1 if w else 0) + g
        assert cost.qk_pairs == n * per_query + g * n, (w, glob, last, clusters, top)
