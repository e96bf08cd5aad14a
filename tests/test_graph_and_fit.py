"""The attention-graph statistics and Sparsefinder's fit against computations written here from their definitions
(float64, the entmax package's own entmax15, naive loops), so that a mutation of the code measured cannot move
both sides: the fourth mutation round (fitting, the predicted graph, the graph statistics) found these untested."""

from __future__ import annotations

import pytest
import torch
from conftest import batch, tiny_model
from reference import naive_attention

import approx
from approx import ApproxAttention
from approx.attention import _fitting, _graph, sparsefinder
from approx.attention.sparsefinder import SparsefinderConfig
from approx.harness.fitting import as_batches
from approx.integration import attention_probe

entmax_pkg = pytest.importorskip("entmax")


def _gold(q, k, key_mask, scale):
    """The entmax-1.5 support of the scaled scores, float64, padded keys out: (B, H, N, S) bool."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return entmax_pkg.entmax15(scores, dim=-1) > 0


# ------------------------------------------------------------------------------------------- graph statistics


def _window_graph(n: int, real: torch.Tensor, window: int) -> torch.Tensor:
    """window's pattern from its docstring: |i - j| <= window, CLS (position 0) global both ways; real keys only:
    (B, 1, N, N)."""
    i = torch.arange(n)
    band = ((i[:, None] - i[None, :]).abs() <= window) | (i[:, None] == 0) | (i[None, :] == 0)
    return band[None, None] & real[:, None, None, :]


def test_graph_statistics_equal_a_count_from_the_definitions_over_batches_layers_and_heads():
    """``approx.graph_stats`` of a window model on two batches of unequal lengths (padding), two layers, four heads and
    a scale of d^-0.5, against a count made here from the queries and keys each layer saw: the window's pairs from its
    definition, the gold graph from the entmax package in float64, the rates pooled over everything (overall), per
    layer and per head. Run on a model in training mode with dropout: the statistics are those of the model as it
    predicts (eval mode, the same twice), and it comes back in training mode."""
    model = tiny_model("bert", hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3)
    approx.patch(model, "window", window=2, block=4)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(5, 99, (int(n),), generator=g).tolist() for n in (12, 9, 16, 5, 11)]
    seen = []

    def capture(layer, q, k, v, key_mask, scale, out):
        seen.append((layer.layer_index, q.detach(), k.detach(), key_mask, scale))

    model.train()
    with attention_probe(capture):
        stats = approx.graph_stats(model, data, batch_size=3, progress=False)
    assert model.training
    assert approx.graph_stats(model, data, batch_size=3, progress=False) == stats
    assert len(seen) == 4 and {s[0] for s in seen} == {0, 1}  # two batches, two layers
    names = ("predicted", "valid", "gold", "hit", "queries", "exact")
    counts = {i: {n: torch.zeros(4, dtype=torch.float64) for n in names} for i in (0, 1)}
    for i, q, k, key_mask, scale in seen:
        assert scale == pytest.approx(8**-0.5)
        b, h, n, _ = q.shape
        real = torch.ones(b, n, dtype=torch.bool) if key_mask is None else key_mask
        pred = _window_graph(n, real, 2).expand(b, h, n, n)
        gold = _gold(q, k, real, scale)
        rows = real[:, None, :, None]
        c = counts[i]
        c["predicted"] += (pred & rows).sum((0, 2, 3))
        c["valid"] += (rows & real[:, None, None, :]).expand(b, h, n, n).sum((0, 2, 3))
        c["gold"] += (gold & rows).sum((0, 2, 3))
        c["hit"] += (gold & pred & rows).sum((0, 2, 3))
        c["queries"] += rows[..., 0].expand(b, h, n).sum((0, 2))
        c["exact"] += (((gold & ~pred).sum(-1) == 0) & rows[..., 0]).sum((0, 2))

    def rates(c):
        return {
            "sparsity": 1 - float(c["predicted"].sum() / c["valid"].sum()),
            "recall": float(c["hit"].sum() / c["gold"].sum()),
            "exact_fraction": float(c["exact"].sum() / c["queries"].sum()),
        }

    overall = rates({n: counts[0][n] + counts[1][n] for n in names})
    assert {key: stats[key] for key in overall} == pytest.approx(overall, abs=1e-12)
    assert 0 < overall["recall"] < 1 and 0 < overall["sparsity"] < 1  # neither side trivial
    for i in (0, 1):
        layer = stats["per_layer"][str(i)]
        assert {key: layer[key] for key in overall} == pytest.approx(rates(counts[i]), abs=1e-12)
        for hd in range(4):
            head = {n: counts[i][n][hd : hd + 1] for n in names}
            assert layer["heads"][hd] == pytest.approx(rates(head), abs=1e-12)
    assert rates(counts[0]) != rates(counts[1])  # the layers differ: the overall figure is not one layer's


def test_as_batches_marks_only_each_rows_own_tokens_as_real():
    (batch,) = as_batches([[5, 6, 7], [8]], batch_size=2, pad_id=1)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 1, 1]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_fit_receives_each_batchs_key_mask(monkeypatch):
    """The queries and keys collected for the fit come with the key mask of their batch: padding is not taken for
    real keys (in the gold graph, the negatives and the k-means points)."""
    model = approx.patch(tiny_model("bert"), "sparsefinder", layers=[0], clusters=2)
    got = []
    monkeypatch.setattr(approx.ApproxAttention, "fit", lambda self, samples, **kw: got.extend(samples))
    data = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    approx.fit(model, data, batch_size=2, progress=False)
    masks = [b["attention_mask"].bool() for b in as_batches(data, batch_size=2)]
    assert len(got) == 2
    assert not bool(masks[0].all()) and bool(masks[1].all())  # a padded batch, then one without padding
    for (q, k, key_mask, scale), mask in zip(got, masks):
        assert torch.equal(mask, torch.ones_like(mask) if key_mask is None else key_mask)


# -------------------------------------------------------------------------------------- the predicted graph


def _naive_buckets(values: torch.Tensor, keys: torch.Tensor, real: torch.Tensor, buckets: int) -> torch.Tensor:
    """(L,) values -> bucket ids: boundary t (1 .. buckets - 1) is the real ``keys``' value at rank
    floor(t n / buckets) of the n real ones."""
    ks = sorted(float(x) for x, r in zip(keys, real) if r)
    bounds = [ks[min(t * len(ks) // buckets, len(ks) - 1)] for t in range(1, buckets)]
    return torch.tensor([sum(float(x) >= bd for bd in bounds) for x in values])


def test_the_bucketing_graph_joins_a_query_and_a_key_sharing_a_bucket_in_some_dimension():
    """Bucketing's dense graph against a loop over the definition: per projected dimension m, buckets of equally many
    real keys; query i and key j joined when they share the bucket of some dimension, or are within the window, or
    one is global (the first token, and the last real token with ``last_token``); padded keys never."""
    g = torch.Generator().manual_seed(3)
    b, h, n, r = 2, 2, 11, 3
    qp, kp = torch.randn(b, h, n, r, generator=g), torch.randn(b, h, n, r, generator=g)
    key_mask = torch.ones(b, n, dtype=torch.bool)
    key_mask[1, 8:] = False
    config = SparsefinderConfig(grouping="bucketing", buckets=3, projection_dim=r, window=1, last_token=True)
    got = _graph.predicted_mask(qp, kp, key_mask, slice(None), config, state={})
    for bb in range(b):
        real = key_mask[bb]
        last = int(real.sum()) - 1
        for hh in range(h):
            ks = kp[bb, hh]
            qid = torch.stack([_naive_buckets(qp[bb, hh, :, m], ks[:, m], real, 3) for m in range(r)], -1)
            kid = torch.stack([_naive_buckets(ks[:, m], ks[:, m], real, 3) for m in range(r)], -1)
            for i in range(n):
                for j in range(n):
                    joined = bool((qid[i] == kid[j]).any()) or abs(i - j) <= 1 or 0 in (i, j) or last in (i, j)
                    assert bool(got[bb, hh, i, j]) == (joined and bool(real[j])), (bb, hh, i, j)


# ------------------------------------------------------------------------------------------- Sparsefinder's fit


def _samples(seed: int = 0, padded: int = 3):
    """One batch row of 2 heads, 10 tokens, the last ``padded`` of them padding filled with a sentinel value; each
    head's queries and keys of their own scale, so the heads' gold graphs differ."""
    g = torch.Generator().manual_seed(seed)
    n, d = 10, 4
    q = torch.randn(1, 2, n, d, generator=g) * torch.tensor([1.0, 4.0])[None, :, None, None]
    k = torch.randn(1, 2, n, d, generator=g)
    mask = torch.ones(1, n, dtype=torch.bool)
    if padded:
        mask[0, -padded:] = False
        q[0, :, -padded:] = 7.0
        k[0, :, -padded:] = 7.0
    return [(q, k, mask, 0.5)]


def _index(rows: torch.Tensor, table: torch.Tensor) -> list[int]:
    """The position of each row of ``rows`` (M, d) in ``table`` (L, d), found by equality."""
    return [int((table == row).all(-1).nonzero()[0]) for row in rows]


def test_the_pair_sampler_draws_each_heads_gold_pairs_and_negatives_outside_them():
    """Every weighted draw: a real query, a positive in that head's gold graph (float64 entmax of the scaled
    scores), a negative among the real keys outside it."""
    samples = _samples()
    (q, k, mask, scale) = samples[0]
    gold = _gold(q, k, mask, scale)[0]
    sampler = _fitting._PairSampler(samples, alpha=1.5)
    g = torch.Generator().manual_seed(0)
    weighted = 0
    for _ in range(5):
        qs, kp, kn, w = sampler.draw(64, g)
        for hh in range(2):
            qi, pos, neg = _index(qs[hh], q[0, hh]), _index(kp[hh], k[0, hh]), _index(kn[hh], k[0, hh])
            for a, p, ng, weight in zip(qi, pos, neg, w[hh].tolist()):
                if weight:
                    weighted += 1
                    assert mask[0, a] and mask[0, p] and mask[0, ng]
                    assert gold[hh, a, p] and not gold[hh, a, ng]
    assert weighted > 300


def test_the_margin_loss_is_the_weighted_mean_of_its_definition():
    g = torch.Generator().manual_seed(1)
    qs, kp, kn = (torch.randn(2, 3, 4, generator=g) for _ in range(3))
    w = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    pq, pk = torch.randn(2, 4, 2, generator=g), torch.randn(2, 4, 2, generator=g)
    expected, total = 0.0, 0.0
    for hh in range(2):
        for m in range(3):
            a = qs[hh, m].double() @ pq[hh].double()
            dp = ((a - kp[hh, m].double() @ pk[hh].double()) ** 2).sum()
            dn = ((a - kn[hh, m].double() @ pk[hh].double()) ** 2).sum()
            expected += float(w[hh, m]) * max(0.0, 0.75 + float(dp - dn))
            total += float(w[hh, m])
    got = _fitting.margin_loss(qs, kp, kn, w, pq, pk, margin=0.75)
    assert float(got) == pytest.approx(expected / total, rel=1e-5)


def test_the_fit_starts_from_two_different_projections_and_the_held_out_loss_uses_the_documented_margin():
    pq, pk = _fitting.random_projections(2, 4, 3, seed=0)
    assert not torch.equal(pq, pk)
    samples = _samples(padded=0)
    default = _fitting.evaluate_loss(samples, pq, pk, 1.5)
    assert default == _fitting.evaluate_loss(samples, pq, pk, 1.5, margin=1.0)
    assert default != _fitting.evaluate_loss(samples, pq, pk, 1.5, margin=0.5)


def _kmeans(samples, clusters: int, iterations: int = 20, points: int = 10000, seed: int = 0):
    eye = torch.eye(samples[0][0].shape[-1]).expand(samples[0][0].shape[1], -1, -1)
    return _fitting.fit_kmeans(samples, eye, eye, clusters, seed=seed, iterations=iterations, points=points)


def test_kmeans_fits_queries_and_keys_and_leaves_padding_out():
    """Queries in one tight blob and keys in another, 2 clusters: one centroid at each blob's mean (the k-means runs
    on queries and keys both); padding (a far sentinel) moves nothing: the same centroids as without it."""
    g = torch.Generator().manual_seed(0)
    q = 5.0 + 0.1 * torch.randn(1, 1, 12, 2, generator=g)
    k = -5.0 + 0.1 * torch.randn(1, 1, 12, 2, generator=g)
    mask = torch.ones(1, 12, dtype=torch.bool)
    mask[0, 9:] = False
    q[0, 0, 9:], k[0, 0, 9:] = 100.0, 100.0
    c = _kmeans([(q, k, mask, 1.0)], clusters=2)[0]
    means = torch.stack([q[0, 0, :9].double().mean(0), k[0, 0, :9].double().mean(0)])
    got = c[c[:, 0].argsort(descending=True)].double()
    torch.testing.assert_close(got, means, rtol=0, atol=1e-5)
    unpadded = _kmeans([(q[:, :, :9], k[:, :, :9], None, 1.0)], clusters=2)
    torch.testing.assert_close(_kmeans([(q, k, mask, 1.0)], clusters=2), unpadded, rtol=0, atol=0)


def _with_a_row_of_padding(samples):
    """``samples`` with one more batch row whose tokens are all padding, filled with values far from the real ones."""
    g = torch.Generator().manual_seed(9)
    out = []
    for q, k, mask, scale, *rest in samples:
        pad = [10.0 * torch.randn(1, *x.shape[1:], generator=g) for x in (q, k, *rest)]
        empty = torch.zeros(1, mask.shape[1], dtype=torch.bool)
        joined = [torch.cat([x, y]) for x, y in zip((q, k), pad)]
        out.append((*joined, torch.cat([mask, empty]), scale, *(torch.cat([x, y]) for x, y in zip(rest, pad[2:]))))
    return out


def test_sparsefinders_fit_learns_nothing_from_a_row_of_padding_alone():
    """A batch row whose attention mask is all zeros (the attention runs it as if every token were real, to keep
    its output finite) adds no pair to the projections' fit and no point to the k-means: the fitted state is the
    one without it, to the bit. Samples of such rows alone are refused: there is nothing to fit on."""
    config = SparsefinderConfig(projection_dim=3, clusters=3)
    samples = _samples()
    settings = {"steps": 20, "queries": 16, "kmeans_iterations": 5}
    fitted = sparsefinder.fit(config, {}, samples, **settings)
    padded = sparsefinder.fit(config, {}, _with_a_row_of_padding(samples), **settings)
    for name in ("proj_q", "proj_k", "centroids"):
        torch.testing.assert_close(padded[name], fitted[name], rtol=0, atol=0, msg=name)
    q, k, mask, scale = samples[0]
    nothing = [(q, k, torch.zeros_like(mask), scale)]
    with pytest.raises(ValueError, match="every row of the samples is padding"):
        sparsefinder.fit(config, {}, nothing, **settings)
    with pytest.raises(ValueError, match="every row of the samples is padding"):
        sparsefinder.fit(config, fitted, nothing, fit_projections_too=False)  # the k-means alone


@pytest.mark.parametrize("method, options", [("sparsefinder", {"clusters": 3}), ("linformer", {"mode": "fitted"})])
def test_a_fit_on_non_finite_padding_learns_what_finite_padding_teaches(method, options):
    """inf and NaN at padded queries, keys and values (a hidden state gone bad at padding) fit the state that finite
    padding fits: Sparsefinder's entmax target had crashed in its sort on a padded query's NaN scores (a reviewer's
    finding), and Linformer's fit had stored non-finite projections."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 24, 8, generator=g) for _ in range(3))
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[1, 15:] = False
    fit = {"sparsefinder": {"steps": 10, "queries": 8}, "linformer": {"steps": 10}}[method]

    def fitted(q, k, v, mask=mask):
        torch.manual_seed(0)
        layer = approx.ApproxAttention(method, approx.get_method(method).config_class(**options), head_dim=8)
        sample = (q, k, mask, 8**-0.5) if method == "sparsefinder" else (q, k, mask, 8**-0.5, v)
        layer.fit([sample], **fit)
        return layer.state()

    clean = fitted(q, k, v)
    # the mask read as the forward reads it: a tokenizer's 0/1 integers as bool (the fits had failed on them)
    for name, t in fitted(q, k, v, mask.long()).items():
        torch.testing.assert_close(t, clean[name], rtol=0, atol=0, msg=name)
    bad = [t.clone() for t in (q, k, v)]
    for t in bad:
        t[1, :, 15:20] = float("inf")
        t[1, 0, 20:] = float("nan")
    poisoned = fitted(*bad)
    for name, t in clean.items():
        assert torch.isfinite(poisoned[name]).all(), name
        torch.testing.assert_close(poisoned[name], t, rtol=1e-5, atol=1e-6, msg=name)


def test_kmeans_runs_to_a_fixed_point_of_lloyds_step():
    """Points spread along a line, 3 clusters, 30 iterations: each centroid is the mean of the points nearest to it
    (Lloyd's fixed point, checked in float64 here); one iteration is not enough to get there from the start."""
    x = torch.linspace(0, 10, 40) ** 1.5
    pts = torch.stack([x, torch.zeros_like(x)], -1)[None, None]  # (1, 1, 40, 2): queries and keys the same points
    samples = [(pts, pts, None, 1.0)]

    def fixed_point(c: torch.Tensor) -> bool:
        p = pts[0, 0].double()
        assign = torch.cdist(p, c.double()).argmin(-1)
        means = torch.stack([p[assign == a].mean(0) if (assign == a).any() else c[a].double() for a in range(len(c))])
        return torch.allclose(means, c.double(), atol=1e-5)

    assert fixed_point(_kmeans(samples, clusters=3, iterations=30)[0])
    assert not fixed_point(_kmeans(samples, clusters=3, iterations=1)[0])


def test_kmeans_with_more_clusters_than_points_keeps_every_centroid_on_a_point():
    pts = torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, -1.0]])[None, None]
    c = _kmeans([(pts[:, :, :2], pts[:, :, 2:], None, 1.0)], clusters=5)[0]
    for centroid in c:
        assert any(torch.equal(centroid, p) for p in pts[0, 0])


def test_a_fit_of_zero_steps_is_allowed_and_negative_steps_are_not():
    """``steps=0`` keeps the starting projections and fits the centroids only (the option's help: it cannot be
    negative)."""
    assert _fitting.SparsefinderFitConfig.from_options(steps=0).steps == 0
    with pytest.raises(ValueError, match="steps"):
        _fitting.SparsefinderFitConfig.from_options(steps=-1)
    samples = _samples(padded=0)
    settings = _fitting.SparsefinderFitConfig.from_options(steps=0)
    pq, pk, info = _fitting.fit_projections(samples, 1.5, 3, settings, seed=0)
    start = _fitting.random_projections(2, 4, 3, seed=0)
    assert torch.equal(pq, start[0]) and torch.equal(pk, start[1]) and info["steps"] == 0


def test_linformers_fit_error_is_the_relative_output_error_over_the_real_queries():
    """``fit_error`` of ``mean`` on a batch row of exactly L real tokens (then padding) equals the relative squared
    error of the layer's own ``mean`` output against float64 exact attention, over the real query rows only (the
    padded rows' targets out of the denominator too)."""
    g = torch.Generator().manual_seed(6)
    n, d, length = 12, 4, 8
    q, k, v = (torch.randn(1, 2, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(1, n, dtype=torch.bool)
    mask[0, length:] = False
    from approx.attention.linformer import LinformerConfig, fit_error

    # (the constructor: the layer's means never read ``length``, which fit_error reads as the length they pool at)
    config = LinformerConfig(mode="mean", projections=4, length=length)

    error = fit_error(config, {}, [(q, k, mask, d**-0.5, v)])
    layer = approx.ApproxAttention("linformer", config, head_dim=d)
    with torch.no_grad():
        out = layer(q, k, v, mask)[:, :, :length].double()
    exact = naive_attention(q, k, v, mask)[:, :, :length]
    assert error == pytest.approx(float((out - exact).square().sum() / exact.square().sum()), rel=1e-5)


def test_attached_layers_are_filed_under_the_layer_they_are_attached_to():
    """approx.fit files each layer's queries and keys under its ``layer_index``: layers built by hand (index 0 by
    default) and attached at other layers take those layers' indices, so each is fitted on its own layer's queries
    and keys, as the same layers made by approx.patch are (bit for bit); one layer object on two layers is refused."""
    from conftest import batch

    from approx import ApproxAttention
    from approx.integration import attach

    data = [batch(24, pad=3)]
    made = approx.patch(tiny_model("bert"), "sparsefinder", grouping="distance")
    approx.fit(made, data, progress=False, steps=3)
    model = tiny_model("bert")
    head_dim = approx.patched_layers(made)[0].head_dim
    layers = {
        i: ApproxAttention("sparsefinder", SparsefinderConfig(grouping="distance"), head_dim=head_dim) for i in (0, -1)
    }
    attach(model, layers)
    count = len(approx.patched_layers(model))
    assert sorted(approx.patched_layers(model)) == [0, count - 1] == [lyr.layer_index for lyr in layers.values()]
    approx.unpatch(model)
    attach(
        model,
        {
            i: ApproxAttention("sparsefinder", SparsefinderConfig(grouping="distance"), head_dim=head_dim)
            for i in range(count)
        },
    )
    approx.fit(model, data, progress=False, steps=3)
    mine, theirs = approx.patched_layers(model), approx.patched_layers(made)
    for i in range(count):
        for name, t in theirs[i].state().items():
            assert torch.equal(mine[i].state()[name], t), (i, name)
    approx.unpatch(model)
    one = ApproxAttention("linear", head_dim=head_dim)
    with pytest.raises(ValueError, match="attached to layers 0 and 1"):
        attach(model, {0: one, 1: one})
    assert not approx.is_patched(model)
    attach(model, {0: one})
    with pytest.raises(ValueError, match="attached to layers 0 and 1"):  # in two calls too
        attach(model, {1: one})
    assert list(approx.patched_layers(model)) == [0] and one.layer_index == 0
    attach(model, {0: one})  # the same layer again where it is: fine


def test_layers_of_two_fitted_methods_take_shared_settings_and_each_ones_own(monkeypatch):
    """Sparsefinder on layer 0 and Linformer ``fitted`` on layer 1: a setting given plainly reaches both layers' fits,
    one in a dict under a method's name reaches that method's layer only (and wins over the plain one); a plain
    setting one of them lacks is refused, saying how to give it to one alone, as are a dict for a method no layer to
    fit runs and a method's settings not given as a dict, before anything runs; the report records each method's."""
    model = approx.patch(tiny_model("bert"), "sparsefinder", layers=[0], clusters=3)
    approx.patch(model, "linformer", layers=[1], mode="fitted", projections=8, length=32)
    received, fit = [], ApproxAttention.fit

    def spy(self, samples, **options):
        received.append((self.layer_index, self.method.name, options))
        return fit(self, samples, **options)

    monkeypatch.setattr(ApproxAttention, "fit", spy)
    data = [batch(32, pad=5)]
    for bad, words in (
        ({"queries": 8}, r"linformer's fit has no setting 'queries' \(its settings: lr, rows, steps\); the layers to "
                         r"fit run linformer, sparsefinder, and a setting given plainly goes to each: give one "
                         r"method's own in a dict under its name \(linformer=\{...\}, sparsefinder="),
        ({"entmax": {"steps": 1}}, "entmax={'steps': 1}: no layer to fit runs entmax"),
        ({"sparsefinder": 8}, r"sparsefinder=8: a method's own fit settings go in a dict"),
        ({"linformer": {"queries": 8}}, r"^(?!.*given plainly).*'queries'"),  # (in its own dict: no such hint)
        ({"stepz": 8}, r"^(?!.*given plainly).*'stepz'.*did you mean 'steps'"),  # (neither has it: no such hint)
        ({"sparsefinder": {"steps": -1}}, r"^(?!.*given plainly).*steps"),
        # a method's own option (the fit draws from the layer's seed): where to give it
        ({"seed": 1}, r"'seed' is an option of sparsefinder, not a setting of its fit: give it when patching "
                      r"\(approx.patch\(model, 'sparsefinder', seed=...\)\)"),
        ({"sparsefinder": {"clusters": 4}}, r"'clusters' is an option of sparsefinder, not a setting of its fit"),
        ({"length": 8}, r"'length' is an option of linformer, not a setting of its fit"),  # (sparsefinder has none)
    ):  # fmt: skip
        with pytest.raises(ValueError, match=words):
            approx.fit(model, data, progress=False, **bad)
    assert received == []
    report = approx.fit(
        model, data, progress=False, steps=2, sparsefinder={"queries": 8, "steps": 3}, linformer={"rows": 4}
    )
    assert sorted(received, key=lambda r: r[0]) == [
        (0, "sparsefinder", {"steps": 3, "queries": 8}),
        (1, "linformer", {"steps": 2, "rows": 4}),
    ]
    assert report["layers"] == [0, 1]
    assert (report["settings"]["sparsefinder"]["steps"], report["settings"]["sparsefinder"]["queries"]) == (3, 8)
    assert (report["settings"]["linformer"]["steps"], report["settings"]["linformer"]["rows"]) == (2, 4)
    with torch.no_grad():
        assert torch.isfinite(model(**data[0]).last_hidden_state).all()


def test_a_fit_setting_named_like_a_method_is_that_setting():
    """A fitted method (a plugin's) whose fit has a setting named like a registered method (``window``): given
    plainly, it is that setting, not a dict of the ``window`` method's own (which no layer to fit runs)."""
    import dataclasses
    import types

    from approx.config import MethodConfig, option
    from approx.harness.fitting import _settings_by_method

    @dataclasses.dataclass(frozen=True)
    class PluginFit(MethodConfig):
        window: int = option(4, "a window")

    layer = types.SimpleNamespace(method=types.SimpleNamespace(name="mylin", fit_config=PluginFit))
    assert _settings_by_method({0: layer}, {"window": 8}) == {"mylin": {"window": 8}}
    assert _settings_by_method({0: layer}, {"mylin": {"window": 2}}) == {"mylin": {"window": 2}}
