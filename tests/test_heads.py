"""A method on some heads of a layer (``heads=``), the others exact; and approx.autotune trying candidates on fewer heads.

The references are independent: float64 textbook formulas (tests/reference.py, and the linear kernel's elu + 1
formula written out here), the unpatched model, and each head's error computed here from the captured q, k, v.
"""

import json
import pickle
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import batch, model_output, tiny_model
from reference import naive_attention, naive_weights

import approx
from approx.attention import iclustered
from approx.integration import attach
from approx.layer import ApproxAttention, attention_probe, check_heads
from approx.saved import layers_digest


def linear_reference(q, k, v, key_mask):
    """elu(x) + 1 features, out_i = phi(q_i) sum_j phi(k_j) v_j^T / phi(q_i) . sum_j phi(k_j), real keys only."""
    q, k, v = q.double(), k.double(), v.double()
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    if key_mask is not None:
        fk = fk * key_mask[:, None, :, None]
    a = torch.einsum("bhnf,bhsf->bhns", fq, fk)
    return torch.einsum("bhns,bhsd->bhnd", a / a.sum(-1, keepdim=True), v)


def qkv(b=2, h=5, n=23, d=8, pad=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=dtype) for _ in range(3))
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, n - pad :] = False
    return q, k, v, mask


@pytest.mark.parametrize("heads", [[1, 3], [4, 0], [2], [0, 1, 2, 3]])
def test_method_heads_and_exact_heads(heads):
    q, k, v, mask = qkv()
    layer = ApproxAttention("linear", head_dim=8, heads=heads)
    out = layer(q, k, v, mask)
    mine = sorted(set(heads))
    rest = [h for h in range(5) if h not in mine]
    real = mask[:, :, None]
    torch.testing.assert_close(
        out[:, mine] * real[:, None], linear_reference(q, k, v, mask)[:, mine] * real[:, None], rtol=1e-10, atol=1e-10
    )
    torch.testing.assert_close(
        out[:, rest] * real[:, None], naive_attention(q, k, v, mask)[:, rest] * real[:, None], rtol=1e-10, atol=1e-10
    )
    assert layer.heads == tuple(mine)


# the sparse patterns also on their block kernels (auto runs these short inputs on SDPA over the dense mask), and
# improved clustered attention on its blocks of queries (these few keys take its dense route)
BLOCK_KERNELS = [("window", "band"), ("bigbird", "band"), ("sparse-transformer", "gather"), ("i-clustered", "blocks")]


@pytest.mark.parametrize(
    "method,kernel",
    [(m, None) for m in approx.methods() if m != "sparsefinder"] + BLOCK_KERNELS,  # sparsefinder: fitted
)
@pytest.mark.parametrize("padded", [False, True])
def test_a_head_computes_the_same_alone(monkeypatch, method, kernel, padded):
    """Each registered method on heads 1, 2 and 5 of 6 gives those heads what the method on every head gives them:
    what a method draws or assigns per head (BigBird's random blocks, the clustering's random starts, the Sparse
    Transformer's even and odd heads) follows the head's index in the layer, not its place in the call."""
    spec = approx.get_method(method)
    if kernel == "blocks":
        monkeypatch.setattr(iclustered, "_ROWS_UP_TO", 0)
        kernel = None
    config = spec.make_config(**dict(spec.test_options or {}), **({} if kernel is None else {"kernel": kernel}))
    q, k, v, mask = qkv(h=6, n=70, pad=15)
    mask = mask if padded else None
    whole = ApproxAttention(method, config, head_dim=8)(q, k, v, mask)
    some = ApproxAttention(method, config, head_dim=8, heads=[5, 1, 2])(q, k, v, mask)
    real = 1.0 if mask is None else mask[:, None, :, None]
    torch.testing.assert_close(some[:, [1, 2, 5]] * real, whole[:, [1, 2, 5]] * real, rtol=0, atol=0)
    if spec.weights is not None:
        w_whole = ApproxAttention(method, config, head_dim=8).weights(q, k, mask)
        w_some = ApproxAttention(method, config, head_dim=8, heads=[5, 1, 2]).weights(q, k, mask)
        torch.testing.assert_close(w_some[:, [1, 2, 5]] * real, w_whole[:, [1, 2, 5]] * real)


def test_exact_limit_on_some_heads():
    """The window's exact limit (window >= N) on heads 0 and 2, while the window's code runs: exact on every head."""
    q, k, v, mask = qkv(n=40, pad=9)
    layer = ApproxAttention("window", approx.get_method("window").make_config(window=64, kernel="gather"),
                            head_dim=8, heads=[0, 2])  # fmt: skip
    real = mask[:, None, :, None]
    torch.testing.assert_close(layer(q, k, v, mask) * real, naive_attention(q, k, v, mask) * real)


def test_weights_and_gradients_on_some_heads():
    q, k, v, mask = qkv()
    layer = ApproxAttention("linear", head_dim=8, heads=[1, 4])
    w = layer.weights(q, k, mask)
    torch.testing.assert_close(w[:, [0, 2, 3]], naive_weights(q, k, mask)[:, [0, 2, 3]])
    torch.testing.assert_close(w @ v, layer(q, k, v, mask))
    q.requires_grad_(True)
    layer(q, k, v, mask)[:, :, :17].sum().backward()
    got = q.grad.clone()
    q.grad = None
    ref = torch.cat([linear_reference(q, k, v, mask)[:, [1, 4]], naive_attention(q, k, v, mask)[:, [0, 2, 3]]], 1)
    ref[:, :, :17].sum().backward()  # the same sum, heads in another order
    torch.testing.assert_close(got, q.grad)


def test_costs_on_some_heads():
    """Summed over heads: the method's cost model on its heads, exact attention's (N^2 (d + dv) MACs) on the others."""
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, 20:] = False
    method = approx.get_method("nystrom")
    config = method.make_config(landmarks=4)
    layer = ApproxAttention("nystrom", config, head_dim=16, heads=[0, 5, 7])
    got = layer.costs(b=2, n=30, key_mask=mask, d=16, dv=16, heads=12)
    for row, n in zip(got, (30, 20), strict=True):
        one = method.cost(config, n=n, s=n, d=16, dv=16)
        assert row.matmul_macs == 3 * one.matmul_macs + 9 * n * n * 32
        assert row.flops == 3 * one.flops + 9 * 2 * n * n * 32
        assert row.qk_pairs == 3 * one.qk_pairs + 9 * n * n
    whole = ApproxAttention("nystrom", config, head_dim=16).costs(b=2, n=30, key_mask=mask, d=16, dv=16, heads=12)
    assert [c.flops for c in whole] == [12 * method.cost(config, n=n, s=n, d=16, dv=16).flops for n in (30, 20)]


@pytest.mark.parametrize("pattern", ["strided", "fixed"])
@pytest.mark.parametrize("on_heads", [None, [0, 3, 4], [1], [0, 2, 4]])
@pytest.mark.parametrize("mode", ["split", "union", "split, exact below 30"])
def test_sparse_transformer_split_costs_count_each_heads_own_half(pattern, on_heads, mode):
    """In "split" mode even heads attend A1 and odd heads A2, so a layer's pairs depend on which heads it holds:
    counted against the pairs its dense weights give each head (real queries and keys; exact heads every pair).
    In "union" mode every head attends A1 ∪ A2; with ``exact_below`` the shorter row is exact on every head."""
    torch.manual_seed(0)
    heads, n = 5, 40
    q, k = torch.randn(2, heads, n, 8, dtype=torch.float64), torch.randn(2, heads, n, 8, dtype=torch.float64)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, 29:] = False
    options = {"heads": mode.split(",")[0], "exact_below": 30 if "exact" in mode else 0}
    if pattern == "fixed":  # (the strided pattern has no summary positions: the option is refused there)
        options["summary"] = 2
    config = approx.get_method("sparse-transformer").make_config(pattern=pattern, stride=6, block=8, **options)
    layer = ApproxAttention("sparse-transformer", config, head_dim=8, heads=on_heads)
    w = layer.weights(q, k, mask)
    real = mask[:, None, :, None] & mask[:, None, None, :]
    pairs = ((w != 0) & real).sum((1, 2, 3))
    costs = layer.costs(b=2, n=n, key_mask=mask, d=8, dv=8, heads=heads)
    assert [c.qk_pairs for c in costs] == pairs.tolist()
    assert [c.matmul_macs for c in costs] == (pairs * 16).tolist()


def test_sparse_transformer_split_counts_no_pair_for_a_query_without_keys():
    """Fixed A2 on a sequence of at most l - c tokens holds no key: an odd head gives each query the mean of the
    values (uniform weights) and counts no pair, an even head counts A1 (here every pair)."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 20, 8, dtype=torch.float64), torch.randn(1, 2, 20, 8, dtype=torch.float64)
    config = approx.get_method("sparse-transformer").make_config(pattern="fixed", stride=32, summary=4, block=8)
    w = ApproxAttention("sparse-transformer", config, head_dim=8).weights(q, k)
    torch.testing.assert_close(w[0, 1], torch.full((20, 20), 1 / 20, dtype=torch.float64))
    for on_heads, pairs in (([1], 0), ([0], 400), (None, 400)):
        layer = ApproxAttention("sparse-transformer", config, head_dim=8, heads=on_heads)
        exact = 0 if on_heads is None else (2 - len(on_heads)) * 400
        assert layer.costs(b=1, n=20, key_mask=None, d=8, dv=8, heads=2)[0].qk_pairs == pairs + exact


def test_a_method_cannot_register_both_a_batch_and_a_head_cost():
    from approx.registry import Cost, register

    with pytest.raises(ValueError, match="not both"):
        register("nope", object, cost=lambda *a, **k: Cost(0, 0), batch_cost=lambda **k: [], head_cost=lambda **k: 0)


@pytest.mark.parametrize(
    ("heads", "message"),
    [([], "empty"), ([-1], "integers from 0"), (["1"], "integers from 0"), ("0", "list of head indices"),
     ([True], "integers from 0")],
)  # fmt: skip
def test_bad_heads_refused(heads, message):
    with pytest.raises(ValueError, match=message):
        check_heads(heads)


def test_patch_heads_on_a_model():
    model = tiny_model("bert")
    inputs = batch(seq_len=40, pad=7)
    with torch.no_grad():
        ref = model_output(model, **inputs)
        approx.patch(model, "window", window=64, kernel="gather", on_heads=[1, 2])  # the exact limit, on two heads
        exact = model_output(model, **inputs)
        real = inputs["attention_mask"].bool()
        torch.testing.assert_close(exact[real], ref[real], rtol=1e-5, atol=1e-5)
        approx.unpatch(model)
        approx.patch(model, "linear", on_heads=[0, 1, 2, 3])  # every head: the method on every head, to the bit
        every = model_output(model, **inputs)
        approx.unpatch(model)
        approx.patch(model, "linear")
        assert torch.equal(every, model_output(model, **inputs))
        approx.unpatch(model)
        approx.patch(model, "linear", on_heads=[3])
        some = model_output(model, **inputs)
        assert not torch.allclose(some[real], every[real]) and not torch.allclose(some[real], ref[real])
    assert "heads=[3]" in repr(approx.patched_layers(model)[0])
    approx.unpatch(model)
    for bad, words in (
        ([4], "head 4 does not exist"),
        ([-5], "head -5 does not exist"),
        ([3, -1], "head 3 is given twice"),
    ):
        with pytest.raises(ValueError, match=rf"{words}"):
            approx.patch(model, "linear", on_heads=bad)
    assert not approx.is_patched(model)
    approx.patch(model, "linear", on_heads=[-1])  # from the end, as layers=[-1]
    assert approx.patched_layers(model)[0].heads == (3,)
    approx.unpatch(model)
    with pytest.raises(ValueError, match="fitted state"):
        approx.patch(model, "linformer", mode="fitted", on_heads=[0])
    big = ApproxAttention("linear", head_dim=8, heads=[6])
    with pytest.raises(ValueError, match="layer 1: head 6 does not exist"):
        attach(model, {1: big})
    q, k, v, mask = qkv(h=4)
    with pytest.raises(ValueError, match=r"set on heads \[6\], and this call has 4 heads"):
        big(q, k, v, mask)


def test_save_load_and_pickle_keep_heads(tmp_path):
    model = tiny_model("bert")
    inputs = batch(seq_len=32, pad=5)
    approx.patch(model, "bigbird", block=4, random_blocks=1, layers=[0], on_heads=[0, 3])
    approx.patch(model, "linear", layers=[1])
    with torch.no_grad():
        before = model_output(model, **inputs)
    approx.save(model, tmp_path / "m")
    layers = json.loads((tmp_path / "m" / "approx_config.json").read_text())["layers"]
    assert [x.get("heads") for x in layers] == [[0, 3], None]
    loaded = approx.load(tmp_path / "m")
    with torch.no_grad():
        assert torch.equal(model_output(loaded.eval(), **inputs), before)
    assert approx.patched_layers(loaded)[0].heads == (0, 3)
    again = pickle.loads(pickle.dumps(approx.patched_layers(model)[0]))
    assert again.heads == (0, 3)
    from approx.harness.spec import as_setup, short_label

    setup = as_setup(str(tmp_path / "m"))
    assert setup.method == "per-layer"
    assert short_label({"name": setup.method, **setup.config()}).startswith("per-layer[0 bigbird:")
    assert "[heads 0,3]; 1 linear]" in short_label({"name": setup.method, **setup.config()})
    # a head the model does not have, in the file: refused naming the file, before any model is touched
    layers[0]["heads"] = [0, 9]
    meta = {**json.loads((tmp_path / "m" / "approx_config.json").read_text()), "layers": layers}
    meta["layers_sha256"] = layers_digest(layers)  # as if saved so: the head check, not the digest's, refuses it
    (tmp_path / "m" / "approx_config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"approx_config.json: head 9 does not exist"):
        approx.load(tmp_path / "m")


def test_same_method_on_other_heads_is_per_layer():
    from approx.harness.spec import as_setup

    model = tiny_model("bert")
    approx.patch(model, "linear", on_heads=[0])
    assert as_setup(approx.patched_layers(model)).method == "per-layer"
    approx.unpatch(model)
    approx.patch(model, "linear")
    assert as_setup(approx.patched_layers(model)).method == "linear"


def _head_errors(model, data, layer_index, method, **options):
    """Per head, the squared error of the layer's attention output under ``method`` against float64 exact attention
    on the same q, k, v (captured with the attention probe), summed over real tokens: computed here, not by approx."""
    sums = torch.zeros(4, dtype=torch.float64)

    def probe(layer, q, k, v, key_mask, scale, out):
        diff = (out.double() - naive_attention(q, k, v, key_mask, scale)).pow(2).sum(-1)
        if key_mask is not None:
            diff = diff * key_mask[:, None, :]
        sums.add_(diff.sum((0, 2)))

    approx.patch(model, method, layers=[layer_index], **options)
    with torch.no_grad(), attention_probe(probe):
        for inputs in data:
            model(**inputs)
    approx.unpatch(model)
    return sums


def test_autotune_tries_candidates_on_fewer_heads(tmp_path):
    from approx.harness.autotune import Search

    model = tiny_model("bert", head="sequence-classification")
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(5, 99, (int(n),), generator=g).tolist() for n in torch.randint(20, 40, (12,), generator=g)]
    search = Search(model, data, measure="kl", methods=["linear"], head_counts=[2, 1, 2], batch_size=3, progress=False)
    assert search.labels == ["linear", "linear on 1 heads", "linear on 2 heads"]
    rows = {(r["layer"], r["candidate"]): r for r in search.table}
    for i in range(2):
        assert len(rows[(i, "linear on 2 heads")]["heads"]) == 2
        assert set(rows[(i, "linear on 1 heads")]["heads"]) <= set(rows[(i, "linear on 2 heads")]["heads"])
        # cheaper than the whole layer on exact attention, dearer than the method on every head
        assert search.costs["flops"][i][1] < search.costs["flops"][i][3] < search.costs["flops"][i][0]
    tuning = search.choose("kl<=1e9")  # anything goes: the cheapest point, every layer on linear everywhere
    assert tuning.choices == ["linear", "linear"] and tuning.head_counts == [1, 2]
    tuning = search.choose(budget=0.999)
    assert all(c == "full" or c == "linear" or c.startswith("linear[heads ") for c in tuning.choices)


def test_autotune_chooses_the_heads_it_changes_least():
    """The heads of a "k heads" option are the k with the least attention-output error under the method on the whole
    layer, as measured here independently on the same (fit) inputs."""
    from approx.harness.autotune import Search
    from approx.harness.fitting import as_batches

    model = tiny_model("bert", head="sequence-classification")
    g = torch.Generator().manual_seed(5)
    fit = [torch.randint(5, 99, (int(n),), generator=g).tolist() for n in torch.randint(20, 40, (6,), generator=g)]
    check = [torch.randint(5, 99, (30,), generator=g).tolist() for _ in range(4)]
    search = Search(model, fit, check_data=check, measure="kl", methods=["window:window=4,kernel=gather"],
                    head_counts=[2], batch_size=2, progress=False)  # fmt: skip
    batches = as_batches(fit, 2, 0)
    for i in range(2):
        sums = _head_errors(model, batches, i, "window", window=4, kernel="gather")
        row = next(r for r in search.table if r["layer"] == i and r["candidate"].endswith("on 2 heads"))
        assert row["heads"] == sorted(sums.argsort()[:2].tolist())
        assert search.options[1][i].heads == tuple(row["heads"])


def test_head_counts_refused():
    from approx.harness.autotune import Search

    model = tiny_model("bert")
    data = [[5, 6, 7, 8], [9, 10, 11, 12]]
    for bad, message in (([0], "from 1 to 3"), ([4], "from 1 to 3"), ([1.5], "from 1 to 3"), (3, "a list")):
        with pytest.raises(ValueError, match=message):
            Search(model, data, methods=["linear"], head_counts=bad, progress=False)


def test_cli_head_counts_refused_before_loading(capsys):
    from approx.harness.cli import main

    code = main(["autotune", "--output-dir", "/nonexistent/x", "--head-counts", "0", "--method", "linear"])
    assert code == 2
    assert "--head-counts are numbers of heads, at least 1" in capsys.readouterr().err


def test_graph_stats_on_some_heads():
    """A head left exact predicts every real pair (recall 1, every query exact); the method's heads count as they do
    with the method on every head (the window's pattern is the same on every head)."""
    q, k, _, mask = qkv(h=4, n=40, pad=9, dtype=torch.float32)
    config = approx.get_method("window").make_config(window=4)
    whole = ApproxAttention("window", config, head_dim=8).graph_stats(q, k, mask)
    some = ApproxAttention("window", config, head_dim=8, heads=[1, 3]).graph_stats(q, k, mask)
    for name in whole:
        assert torch.equal(some[name][[1, 3]], whole[name][[1, 3]]), name
    for name in ("valid", "gold", "queries"):
        assert torch.equal(some[name], whole[name]), name
    real = mask.sum(-1)
    assert torch.equal(some["predicted"][[0, 2]], torch.full((2,), float((real * real).sum())))
    assert torch.equal(some["hit"][[0, 2]], whole["gold"][[0, 2]])
    assert torch.equal(some["exact"][[0, 2]], torch.full((2,), float(real.sum())))
    assert bool((whole["hit"] < whole["gold"]).all())  # the window misses pairs: the exact heads' counts differ


def test_the_sparse_transformers_heads_option_beside_on_heads(tmp_path):
    """``heads`` is an option of the Sparse Transformer ("split"/"union"); ``on_heads`` chooses the heads, both at once."""
    model = tiny_model("bert")
    approx.patch(model, "sparse-transformer", stride=4, heads="union", on_heads=[0, 2])
    layer = approx.patched_layers(model)[0]
    assert layer.config.heads == "union" and layer.heads == (0, 2)
    approx.save(model, tmp_path / "st")
    entry = json.loads((tmp_path / "st" / "approx_config.json").read_text())["layers"][0]
    assert entry["config"]["heads"] == "union" and entry["heads"] == [0, 2]


def test_finetune_from_a_folder_keeps_the_heads(tmp_path, base_model, fixture_dir):
    from approx.harness.finetune import finetune

    model, tok = approx.integration.load_pretrained(base_model, progress=False)
    approx.patch(model, "sparse-transformer", stride=4, heads="union", layers=[0], on_heads=[1])
    approx.patch(model, "linear", layers=[1], on_heads=[0, 3])
    folder = approx.save(model, tmp_path / "some", tokenizer=tok)
    saved = json.loads((folder / "approx_config.json").read_text())["layers"]
    finetune(base_model, "rte", output_dir=tmp_path / "ft", method=str(folder), train_split="dev/0",
             data_dir=str(fixture_dir), source="local", batch_size=4, max_steps=1, progress=False)  # fmt: skip
    trained = json.loads((tmp_path / "ft" / "approx_config.json").read_text())["layers"]
    assert trained == saved and [x["heads"] for x in trained] == [[1], [0, 3]]


@pytest.mark.parametrize(("heads", "message"), [([], "empty"), (["x"], "integers from 0"), ([-2], "integers from 0")])
def test_a_folders_malformed_heads_refused_with_the_file_named(tmp_path, heads, message):
    model = tiny_model("bert")
    approx.patch(model, "linear", layers=[0], on_heads=[1])
    folder = approx.save(model, tmp_path / "some")
    settings = folder / "approx_config.json"
    meta = json.loads(settings.read_text())
    meta["layers"][0]["heads"] = heads
    settings.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"approx_config\.json: layers\[0\]: .*{message}"):
        approx.restore(tiny_model("bert"), folder)


def test_finetune_from_a_folder_with_a_head_the_model_lacks_names_the_folder(tmp_path, base_model, fixture_dir):
    from approx.harness.finetune import finetune

    model, tok = approx.integration.load_pretrained(base_model, progress=False)
    heads = model.config.num_attention_heads
    approx.patch(model, "linear", layers=[1], on_heads=[0])
    folder = approx.save(model, tmp_path / "some", tokenizer=tok)
    settings = folder / "approx_config.json"
    meta = json.loads(settings.read_text())
    meta["layers"][0]["heads"] = [0, heads]  # well formed, but one head past the model's
    meta["layers_sha256"] = layers_digest(meta["layers"])  # as if saved so: the head check refuses it
    settings.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"{re.escape(str(folder))}: layer 1: head {heads} does not exist"):
        finetune(base_model, "rte", output_dir=tmp_path / "ft", method=str(folder), train_split="dev/0",
                 data_dir=str(fixture_dir), source="local", batch_size=4, max_steps=1, progress=False)  # fmt: skip
    assert not (tmp_path / "ft" / "approx_config.json").exists()


def test_a_layer_on_some_heads_run_first_under_inference_mode_then_trains(monkeypatch):
    """The heads' index tensors are kept from call to call: one first made under torch.inference_mode (as
    approx.autotune builds its candidates) must still serve a call with gradients, which saves it for backward."""
    import approx.layer as layer_module

    monkeypatch.setattr(layer_module, "_HEAD_INDEX", {})
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 5, 24, 8, dtype=torch.float64) for _ in range(3))
    layer = ApproxAttention("linear", approx.get_method("linear").make_config(), head_dim=8, heads=[1, 4])
    with torch.inference_mode():
        before = layer(q, k, v)
    q.requires_grad_(True)
    out = layer(q, k, v)
    torch.testing.assert_close(out.detach(), before)
    out.sum().backward()
    assert q.grad is not None and bool(q.grad[:, [1, 4]].abs().sum() > 0)
