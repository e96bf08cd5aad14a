"""The clustering choices of issue #20 step 0 that are not in the paper: Euclidean Lloyd steps after the Hamming
K-means (``refine``) and improved clustered attention's keys chosen by the clusters' spread (``topk_by="spread"``).
Each against an independent float64 loop written from its definition, and in its exact limit."""

import math

import pytest
import torch
from reference import naive_attention

from approx import ApproxAttention, get_method
from approx.attention import clustered as clustered_mod

B, H, N, D = 2, 2, 48, 8
REAL_LAST = 35  # real tokens of batch row 1 (row 0: all N)


def qkv(seed=0, sharp=2.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64) * sharp
    k = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, REAL_LAST:] = False
    return q, k, v, mask


def make_layer(method, **options):
    config = get_method(method).make_config(**options)
    return ApproxAttention(method, config, head_dim=D)


def lloyd_reference(q, assign, mask, clusters, steps):
    """Lloyd steps in Euclidean space, one (row, head) at a time with Python loops, in float64."""
    assign = assign.clone()
    for b in range(q.shape[0]):
        real = int(mask[b].sum())
        for h in range(q.shape[1]):
            x = q[b, h, :real].double()
            a = assign[b, h, :real].tolist()
            for _ in range(steps):
                members = {c: [i for i in range(real) if a[i] == c] for c in range(clusters)}
                cents = {c: x[m].mean(0) for c, m in members.items() if m}
                a = [min(cents, key=lambda c: float((x[i] - cents[c]).pow(2).sum())) for i in range(real)]
            assign[b, h, :real] = torch.tensor(a)
    return assign


def sse(q, assign, mask, clusters):
    """Within-cluster sum of squared distances of the real queries."""
    total = 0.0
    for b in range(q.shape[0]):
        real = int(mask[b].sum())
        for h in range(q.shape[1]):
            x, a = q[b, h, :real], assign[b, h, :real]
            for c in a.unique():
                total += float((x[a == c] - x[a == c].mean(0)).pow(2).sum())
    return total


@pytest.mark.parametrize("rows", [None, 7])  # the default block of queries, or blocks of 7 (the loop over blocks)
@pytest.mark.parametrize("seed", range(3))
def test_refine_takes_the_lloyd_steps_of_a_float64_loop(seed, rows, monkeypatch):
    if rows is not None:
        monkeypatch.setattr(clustered_mod, "_REFINE_ROWS", rows)
    q, _, _, mask = qkv(seed)
    method = get_method("clustered")
    config0 = method.make_config(clusters=5, seed=seed, refine=0)  # the Hamming K-means alone
    state = method.init_state(config0, head_dim=D, seed=seed)
    hamming = clustered_mod.cluster_queries(q, mask, config0, state)
    errors = [sse(q, hamming, mask, 5)]
    for steps in (1, 3):
        config = method.make_config(clusters=5, seed=seed, refine=steps)
        got = clustered_mod.cluster_queries(q, mask, config, state)
        want = lloyd_reference(q, hamming, mask, 5, steps)
        for b, real in ((0, N), (1, REAL_LAST)):
            assert torch.equal(got[b, :, :real], want[b, :, :real])
        errors.append(sse(q, got, mask, 5))
    assert not torch.equal(got[0], hamming[0]), "the steps moved no query: the test would not see them"
    assert errors[0] > errors[1] >= errors[2] - 1e-9  # Lloyd steps never raise the within-cluster error


def test_refine_on_the_cpu_stops_at_a_fixed_point(monkeypatch):
    """On the CPU the eager steps stop once a step moves nothing (a fixed point: the float64 loop's clusters after as
    many steps as it takes to stop moving), so a large bound returns at once (2**40 steps had run for ever); the
    count of steps it runs is that of the float64 loop's, plus the one that moves nothing."""
    q, _, _, mask = qkv(5)
    method = get_method("clustered")
    config0 = method.make_config(clusters=5, seed=5, refine=0)
    state = method.init_state(config0, head_dim=D, seed=5)
    hamming = clustered_mod.cluster_queries(q, mask, config0, state)
    want, steps = hamming, 0
    while not torch.equal(nxt := lloyd_reference(q, want, mask, 5, 1), want) or steps == 0:
        want, steps = nxt, steps + 1
    assert steps >= 2, "the reference settled at once: the test would not see a stop"
    calls = []
    real = clustered_mod.centroids
    monkeypatch.setattr(clustered_mod, "centroids", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = clustered_mod.cluster_queries(q, mask, method.make_config(clusters=5, seed=5, refine=10**4), state)
    for b, n in ((0, N), (1, REAL_LAST)):
        assert torch.equal(got[b, :, :n], want[b, :, :n])
    assert len(calls) <= steps + 2  # (+1: the step that moved nothing; +1: the padded queries' first move)


def test_refine_in_the_compiled_engines_function_gives_the_eager_clusters():
    """``_clusters`` (what ``engine="compiled"`` compiles: sync-free K-means, then the Euclidean steps), run as plain
    code, against the eager path."""
    q, _, _, mask = qkv(4)
    method = get_method("clustered")
    config = method.make_config(clusters=5, refine=2, seed=1)
    state = method.init_state(config, head_dim=D, seed=1)
    eager = clustered_mod.cluster_queries(q, mask, config, state)
    args = (q, mask, state["planes"], clustered_mod.offsets(config, state), state["salt"], 5, config.iterations, 2)
    assign, qc = clustered_mod._clusters(*args)
    for b, real in ((0, N), (1, REAL_LAST)):
        assert torch.equal(assign[b, :, :real], eager[b, :, :real])
    torch.testing.assert_close(qc, clustered_mod.centroids(q, eager, mask, 5)[0])


@pytest.mark.parametrize("method", ["clustered", "i-clustered"])
def test_refine_keeps_the_exact_limit(method):
    """At most C distinct queries: each value its own cluster, which the Euclidean steps keep; clustered attention
    is then exact (improved clustered too: the recomputed top-k scores are exact)."""
    q, k, v, mask = qkv(1)
    values = q[:, :, :6]
    q = values[:, :, torch.arange(N) % 6]
    out = make_layer(method, clusters=6, refine=3)(q, k, v, mask)
    want = naive_attention(q, k, v, mask)
    for b, real in ((0, N), (1, REAL_LAST)):
        torch.testing.assert_close(out[b, :, :real], want[b, :, :real], rtol=1e-10, atol=1e-10)


def improved_reference(q, k, v, mask, assign, topk, scale, spread_ranks):
    """Improved clustered attention from its definition, given the clusters, one (row, head, cluster) at a time in
    float64: the centroid's attention A^c, the top-k keys T_j (by A^c, or by log A^c + s^2/2 sigma^2 . k^2 with the
    members' per-dimension variance sigma^2), then each member's exact softmax on T_j scaled by A^c's mass on T_j
    plus A^c's output off T_j."""
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        real = int(mask[b].sum())
        for h in range(q.shape[1]):
            x, keys, vals = q[b, h, :real], k[b, h, :real], v[b, h, :real]
            a = assign[b, h, :real]
            for c in a.unique().tolist():
                members = (a == c).nonzero().flatten()
                qc = x[members].mean(0)
                ac = torch.softmax(scale * keys @ qc, 0)
                rank = ac.log()
                if spread_ranks:
                    var = x[members].var(0, unbiased=False)
                    rank = rank + 0.5 * scale**2 * (keys.square() @ var)
                top = rank.topk(min(topk, real)).indices
                off = torch.ones(real, dtype=torch.bool)
                off[top] = False
                rest = ac[off] @ vals[off]
                for i in members.tolist():
                    p = torch.softmax(scale * keys[top] @ x[i], 0) * ac[top].sum()
                    out[b, h, i] = p @ vals[top] + rest
    return out


@pytest.mark.parametrize("sharp", [2.0, 20.0])  # 20: members score far above their cluster's top keys elsewhere
@pytest.mark.parametrize("topk_by", ["centroid", "spread"])
@pytest.mark.parametrize("seed", range(2))
def test_improved_keys_by_centroid_or_spread_match_a_float64_loop(topk_by, seed, sharp):
    q, k, v, mask = qkv(seed, sharp=sharp)
    lyr = make_layer("i-clustered", clusters=5, topk=6, topk_by=topk_by, seed=seed)
    config = lyr.config
    assign = clustered_mod.cluster_queries(q, mask, config, lyr.state())
    scale = 0.6 / math.sqrt(D)  # not SDPA's default, which the short-input route could otherwise take unseen
    want = improved_reference(q, k, v, mask, assign, 6, scale, topk_by == "spread")
    out = lyr(q, k, v, mask, scale=scale)
    weights = lyr.weights(q, k, mask, scale=scale)
    # the function engine="compiled" compiles (no chunks, every block at once), run as plain code
    from approx.attention import iclustered

    qc = clustered_mod.centroids(q, assign, mask, 5)[0]
    spread = iclustered.cluster_spread(q, assign, mask, qc) if topk_by == "spread" else None
    static = iclustered._improved_static(
        q, k, v.masked_fill(~mask[:, None, :, None], 0), mask, assign, qc, 6, scale, spread
    )
    for b, real in ((0, N), (1, REAL_LAST)):
        torch.testing.assert_close(out[b, :, :real], want[b, :, :real], rtol=1e-9, atol=1e-9)
        dense = weights[b, :, :real, :real] @ v[b, :, :real]
        torch.testing.assert_close(dense, want[b, :, :real], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(static[b, :, :real], want[b, :, :real], rtol=1e-9, atol=1e-9)


def test_spread_chooses_other_keys_than_the_centroid():
    """Not vacuous: on these inputs the two rankings differ, and so do the outputs."""
    q, k, v, mask = qkv(0, sharp=3.0)
    outs = [make_layer("i-clustered", clusters=5, topk=6, topk_by=by)(q, k, v, mask) for by in ("centroid", "spread")]
    assert (outs[0] - outs[1]).abs().max() > 1e-3


def test_spread_keeps_the_exact_limits():
    q, k, v, mask = qkv(2)
    want = naive_attention(q, k, v, mask)
    every_key = make_layer("i-clustered", clusters=5, topk=N, topk_by="spread")(q, k, v, mask)
    values = q[:, :, torch.arange(N) % 5]  # at most C distinct queries: no spread, every member its centroid
    distinct = make_layer("i-clustered", clusters=5, topk=4, topk_by="spread")(values, k, v, mask)
    want_distinct = naive_attention(values, k, v, mask)
    for b, real in ((0, N), (1, REAL_LAST)):
        torch.testing.assert_close(every_key[b, :, :real], want[b, :, :real], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(distinct[b, :, :real], want_distinct[b, :, :real], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("options", [{"refine": 2}, {"topk_by": "spread", "refine": 1}])
def test_padding_changes_nothing_with_the_new_choices(options):
    """Padded queries count in no centroid and no variance, padded keys in no ranking."""
    q, k, v, mask = qkv(3)
    lyr = make_layer("i-clustered", clusters=5, topk=6, **options)
    padded = lyr(q, k, v, mask)[1, :, :REAL_LAST]
    alone = lyr(q[1:, :, :REAL_LAST], k[1:, :, :REAL_LAST], v[1:, :, :REAL_LAST], None)[0]
    torch.testing.assert_close(padded, alone, rtol=1e-10, atol=1e-10)


def test_costs_count_the_new_work():
    base = get_method("i-clustered")
    plain = base.cost(base.make_config(refine=0), n=512, s=512, d=64, dv=64)
    refined = base.cost(base.make_config(refine=2), n=512, s=512, d=64, dv=64)
    spread = base.cost(base.make_config(refine=0, topk_by="spread"), n=512, s=512, d=64, dv=64)
    assert refined.flops == plain.flops + 2 * (2 * 512 * 25 * 64 + 2 * 512 * 64)
    assert spread.flops == plain.flops + 2 * 512 * 64 + 2 * 25 * 512 * 64
    assert spread.matmul_macs == plain.matmul_macs + 25 * 512 * 64  # the (C, S) product only
    assert refined.qk_pairs == spread.qk_pairs == plain.qk_pairs


# ------------------------------------------------------------------ recipes/sharper_clustering.py: variants, --update


def _sharper_recipe():
    import importlib.util
    import sys
    from pathlib import Path

    recipes = Path(__file__).resolve().parent.parent / "recipes"
    sys.path.insert(0, str(recipes))
    spec = importlib.util.spec_from_file_location("sharper_clustering", recipes / "sharper_clustering.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(recipe, variants, error, metric, protocol="p", folder="runs/checkpoints/x"):
    """A hand-made record of the recipe's JSON: one error row and one task result per config."""
    configs = recipe.configs(0, variants)
    rows = [
        {"config": c.to_dict() | {"name": c.method}, "seed": 0, "per_layer": [error], "mean": error} for c in configs
    ]
    results = [
        {
            "method": c.to_dict() | {"name": c.method},
            "metrics": {"accuracy": metric},
            "reference_metrics": {"accuracy": 70.0},
        }
        for c in configs
    ]
    task = {"checkpoint": {"folder": folder}, "split": "dev", "results": results}
    run = {"variants": [recipe._label(v) for v in variants], "wall_seconds": {}, "provenance": {"git_commit": "new"}}
    return {"protocol": protocol, "errors": rows, "tasks": {"mrpc": task}, "wall_seconds": {}, "provenance": {},
            "runs": [run]}  # fmt: skip


def test_sharper_recipe_update_adds_replaces_and_refuses():
    recipe = _sharper_recipe()
    old = _record(recipe, [{}, {"bits": 31}], 0.5, 70.0)
    for row in old["errors"] + old["tasks"]["mrpc"]["results"]:  # written before refine and topk_by existed
        for name in ("refine", "topk_by"):
            (row.get("config") or row["method"]).pop(name, None)
    del old["runs"]
    new = _record(recipe, [{"bits": 31}, {"refine": 1}, {"topk_by": "spread"}], 0.4, 71.0)
    merged = recipe.merge(old, new)
    rows = recipe._rows(merged)
    labels = [label for (_, _, label) in rows]
    assert labels.count("baseline") == 4 and labels.count("bits=31") == 4 and labels.count("refine=1") == 4
    assert labels.count("topk_by=spread") == 2  # improved clustering only
    assert rows[("clustered", 25, "baseline")]["error"] == 0.5  # kept
    assert rows[("clustered", 25, "bits=31")]["error"] == 0.4  # replaced, not duplicated
    assert rows[("i-clustered", 25, "topk_by=spread")]["metrics"]["mrpc"] == 71.0
    assert list(rows)[:3] == [("clustered", 25, label) for label in ("baseline", "bits=31", "refine=1")]
    assert [r["variants"] for r in merged["runs"]][1:] == [["bits=31", "refine=1", "topk_by=spread"]]
    again = recipe.merge(merged, _record(recipe, [{"refine": 1}, {"topk_by": "spread"}, {"bits": 31}], 0.3, 72.0))
    assert [r["variants"] for r in again["runs"]] == [
        ["baseline", "bits=31"],
        ["refine=1", "topk_by=spread", "bits=31"],
    ]
    for changed in ({"protocol": "other"}, {"folder": "runs/checkpoints/y"}):
        other = _record(recipe, [{"refine": 1}], 0.4, 71.0, **changed)
        with pytest.raises(SystemExit, match="cannot --update"):
            recipe.merge(old, other)


def test_sharper_recipe_names_its_variants():
    recipe = _sharper_recipe()
    with pytest.raises(SystemExit, match="refine=1"):
        recipe.chosen_variants(["refine=2"])
    assert recipe.chosen_variants(["topk_by=spread"]) == [{"topk_by": "spread"}]


# ------------------------------------------------------- records written before refine existed: the paper's clusters


def test_a_folder_saved_before_refine_loads_with_the_papers_clusters(tmp_path):
    """``refine`` came with a default of 1 step; a folder saved before it (no ``refine`` in its settings) meant none,
    and loads, evaluates and labels as it was saved: outputs against the same layer made with ``refine=0``."""
    import json

    from conftest import batch, model_output, tiny_model

    import approx
    from approx.harness.spec import as_setup, short_label
    from approx.saved import SETTINGS_FILE

    model = tiny_model("bert")
    approx.patch(model, "i-clustered", layers=[0], clusters=6, topk=4, seed=2, refine=0)
    inputs = batch(48, pad=13)
    with torch.no_grad():
        want = model_output(model, **inputs)
        approx.patch(model, "i-clustered", layers=[0], clusters=6, topk=4, seed=2)  # today's default: refine=1
        assert not torch.allclose(model_output(model, **inputs), want), "refine=1 changes nothing: test is blind"
    approx.patch(model, "i-clustered", layers=[0], clusters=6, topk=4, seed=2, refine=0)
    approx.save(model, tmp_path / "old")
    settings = json.loads((tmp_path / "old" / SETTINGS_FILE).read_text())
    for layer in settings["layers"]:
        del layer["config"]["refine"]  # as written before the option existed
    del settings["layers_sha256"]  # which came later still
    (tmp_path / "old" / SETTINGS_FILE).write_text(json.dumps(settings))

    loaded = approx.load(tmp_path / "old")
    assert approx.patched_layers(loaded)[0].config.refine == 0
    with torch.no_grad():
        torch.testing.assert_close(model_output(loaded, **inputs), want)
    setup = as_setup(str(tmp_path / "old"))
    assert setup.options["refine"] == 0
    assert "refine=0" in short_label({"name": setup.method, **settings["layers"][0]["config"]})
    assert "refine" not in short_label({"name": "i-clustered", **get_method("i-clustered").make_config().to_dict()})


def test_autotune_recipe_clustering_choice():
    """recipes/autotune_pareto.py: the paper's clustering by default (the clustered table's uniform rows), today's
    default refine on request, for SQuAD only (GLUE's uniform rows were measured with the paper's)."""
    import argparse
    import importlib.util
    import sys
    from pathlib import Path

    recipes = Path(__file__).resolve().parent.parent / "recipes"
    sys.path.insert(0, str(recipes))
    spec = importlib.util.spec_from_file_location("autotune_pareto", recipes / "autotune_pareto.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    paper, default = recipe.candidates("paper"), recipe.candidates("default")
    assert len(paper) == len(default)
    refined = [(a, b) for a, b in zip(paper, default, strict=True) if hasattr(a, "refine")]
    assert len(refined) == 5  # clustered and improved clustered at 25 and 100, improved at 50
    assert all(a.refine == 0 and b.refine == type(b)().refine == 1 for a, b in refined)
    assert all(a == b for a, b in zip(paper, default, strict=True) if not hasattr(a, "refine"))
    with pytest.raises(SystemExit, match="only squad"):
        recipe.run_task("rte", argparse.Namespace(clustering="default"))


def test_a_model_pickled_before_refine_unpickles_with_the_papers_clusters(tmp_path):
    """``torch.save(model)`` of a patched model whose config predates ``refine`` (its pickled state has no such field)
    loads with ``refine=0``, not today's default, and gives the outputs it gave."""
    from conftest import batch, model_output, tiny_model

    import approx

    model = tiny_model("bert")
    approx.patch(model, "clustered", layers=[0], clusters=6, seed=2, refine=0)
    inputs = batch(48, pad=13)
    with torch.no_grad():
        want = model_output(model, **inputs)
    del approx.patched_layers(model)[0].config.__dict__["refine"]  # as pickled before the option existed
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert approx.patched_layers(loaded)[0].config.refine == 0
    with torch.no_grad():
        torch.testing.assert_close(model_output(loaded, **inputs), want)


def test_sharper_recipe_reports_variants_without_a_baseline():
    recipe = _sharper_recipe()
    alone = _record(recipe, [{"refine": 1}], 0.4, 71.0)
    table = recipe.markdown(alone)
    assert "no `baseline` row to compare with" in table and "wins on both" not in table
