"""The window (Longformer) method: an independent float64 reference from the definition, the one-sided
convention, global tokens and the question, the cost count, and lucidrains' local-attention as a peer."""

import warnings

import pytest
import torch
from reference import naive_attention

import approx
from approx import ApproxAttention
from approx.attention import _blocksparse, _context
from approx.attention.window import NO_QUESTION, WindowConfig, cost, pattern, window_pairs

B, H, D = 2, 3, 16


def qkv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for _ in range(3))


def allowed_pairs(key_mask, n, s, *, window, dilation=1, glob=None):
    """(B, N, S) bool: {j : |i - j| <= window * dilation, dilation | (i - j)} plus the global rows and columns, real
    keys only, from the definition."""
    diff = torch.arange(n)[:, None] - torch.arange(s)[None, :]
    allowed = ((diff.abs() <= window * dilation) & (diff % dilation == 0))[None].expand(key_mask.shape[0], n, s)
    if glob is not None:
        allowed = allowed | glob[:, None, :s] | glob[:, :n, None]
    return allowed & key_mask[:, None, :]


def reference(q, k, v, key_mask, *, window, dilation=1, glob=None):
    """softmax over :func:`allowed_pairs`, float64."""
    n, s = q.shape[2], k.shape[2]
    allowed = allowed_pairs(key_mask, n, s, window=window, dilation=dilation, glob=glob)
    scores = (q @ k.transpose(-1, -2)) * D**-0.5
    return scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1) @ v


def mask_of(n, real):
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, real:] = False
    return mask


@pytest.mark.parametrize(
    "options",
    [
        {"window": 5, "block": 8, "global_tokens": 0},
        {"window": 5, "block": 8},
        {"window": 3, "dilation": 4, "global_tokens": 2, "block": 16},
        {"window": 7, "block": 5, "global_tokens": 3},  # blocks not a multiple of anything
        {"window": 0, "block": 8, "global_tokens": 0},  # only i = j
    ],
)
def test_matches_the_definition(options):
    q, k, v = qkv(100)
    mask = mask_of(100, 77)
    out = ApproxAttention("window", WindowConfig(**options), head_dim=D)(q, k, v, mask)
    glob = (torch.arange(100) < options.get("global_tokens", 1)).expand(B, 100)
    ref = reference(q, k, v, mask, window=options["window"], dilation=options.get("dilation", 1), glob=glob)
    real = mask[:, None, :, None]
    torch.testing.assert_close(out.masked_fill(~real, 0), ref.masked_fill(~real, 0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", ["auto", "band", "gather"])
def test_a_window_reaching_most_of_a_short_input_matches_the_definition(kernel, monkeypatch):
    """Where the banded kernel would score as many keys per query as the input has (a block's slice of block + 2P, here
    8 + 2 x 16 = 40 keys for 40 tokens), ``auto`` runs SDPA over the dense mask instead: the same softmax as the
    definition, with global tokens, the question global, padding, and a row of padding alone, as ``band`` and
    ``gather`` compute it."""
    from approx.attention import _dense

    q, k, v = qkv(40)
    q, k, v = torch.cat([q, q[:1]]), torch.cat([k, k[:1]]), torch.cat([v, v[:1]])  # a third row: padding alone
    mask = torch.ones(B + 1, 40, dtype=torch.bool)
    mask[1, 29:], mask[2] = False, False
    question = torch.zeros(B + 1, 40, dtype=torch.bool)
    question[0, :6], question[1, :9], question[2, :4] = True, True, True  # each row its own question
    config = WindowConfig(window=12, block=8, global_tokens=2, question_global=True, kernel=kernel)
    dense, calls = _dense.attend_dense, []
    monkeypatch.setattr(_dense, "attend_dense", lambda *a, **kw: calls.append(1) or dense(*a, **kw))
    with approx.tokens(question_mask=question), torch.no_grad():
        out = ApproxAttention("window", config, head_dim=D)(q, k, v, mask)
    assert len(calls) == (kernel == "auto")  # the dense route is auto's alone
    glob = question | (torch.arange(40) < 2)
    mask[2] = True  # a row of padding alone attends every key (approx's rule for it: no NaN), its window as a row's
    ref = reference(q, k, v, mask, window=12, glob=glob)
    torch.testing.assert_close(out[[0, 2]], ref[[0, 2]], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[1, :, :29], ref[1, :, :29], rtol=1e-12, atol=1e-12)


def test_block_size_does_not_change_the_output():
    q, k, v = qkv(150)
    mask = mask_of(150, 111)
    outs = [ApproxAttention("window", WindowConfig(window=9, block=b), head_dim=D)(q, k, v, mask) for b in (4, 16, 64)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-12, atol=1e-12)


def test_window_is_one_sided():
    """window = w: an interior query (no global token near it) attends exactly 2 w + 1 keys; Longformer's
    two-sided attention_window = 2 w."""
    q, k, _ = qkv(64)
    w = ApproxAttention("window", WindowConfig(window=4, global_tokens=0, block=8), head_dim=D).weights(q, k)
    counts = (w > 0).sum(-1)
    assert (counts[:, :, 4:-4] == 9).all()
    assert (counts[:, :, 0] == 5).all()  # the first query: itself and 4 keys to the right


def test_question_tokens_are_global():
    q, k, v = qkv(60)
    mask = mask_of(60, 50)
    question = torch.zeros(B, 60, dtype=torch.bool)
    question[0, :12] = True
    question[1, :7] = True
    layer = ApproxAttention("window", WindowConfig(window=3, block=8, question_global=True), head_dim=D)
    with pytest.raises(RuntimeError, match="question"):
        layer(q, k, v, mask)
    assert NO_QUESTION.startswith("window:")
    with approx.tokens(question_mask=question):
        out = layer(q, k, v, mask)
    glob = question | (torch.arange(60) < 1)
    ref = reference(q, k, v, mask, window=3, glob=glob)
    torch.testing.assert_close(out[:, :, :50], ref[:, :, :50], rtol=1e-12, atol=1e-12)
    assert _context.question_mask() is None  # the context ends with the block


def test_question_is_found_from_ids_or_token_types():
    ids = torch.tensor([[101, 7, 8, 102, 9, 9, 102, 0], [101, 5, 102, 6, 6, 6, 102, 0]])
    types = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1, 1, 0]])
    want = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(_context.question_of(ids, None, 102), want)
    assert torch.equal(_context.question_of(ids, types, None), want)
    assert _context.question_of(ids, None, None) is None
    assert _context.question_of(ids, torch.zeros_like(types), None) is None  # one segment: no question at all
    # one segment ended by its only SEP (RoBERTa's </s> found as eos, a BERT input without token types): no question,
    # rather than every token before the SEP made global (which made the window exact attention)
    single = torch.tensor([[0, 7, 8, 9, 2, 1, 1], [0, 5, 5, 2, 1, 1, 1]])
    assert _context.question_of(single, None, 2) is None
    pair = torch.tensor([[0, 7, 2, 2, 9, 9, 2], [0, 5, 5, 2, 1, 1, 1]])  # a RoBERTa pair beside a single segment
    assert torch.equal(_context.question_of(pair, None, 2), torch.tensor([[1, 1, 0, 0, 0, 0, 0], [0] * 7]).bool())


def test_padding_that_shares_the_sep_id_is_no_second_segment():
    """EuroBERT pads with its eos id, the id approx takes as SEP: a padded single segment [bos, a, b, eos, pad, pad]
    has no question, its padding not counted as SEPs; a pair keeps its question. Through a model's config too."""
    from conftest import tiny_model

    eos = 2
    ids = torch.tensor([[1, 5, 6, eos, eos, eos], [1, 5, eos, 7, 8, eos]])
    real = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    want = torch.tensor([[0] * 6, [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(_context.question_of(ids, None, eos, real), want)
    assert _context.question_of(ids[:1], None, eos, real[:1]) is None
    assert _context.question_of(ids[:1], None, eos) is not None  # (what the padding made of it without the mask)
    model = tiny_model("eurobert", pad_token_id=eos, eos_token_id=eos)
    assert torch.equal(approx.integration.question_positions(model, ids, None, real), want)
    approx.patch(model, "full")
    # what a patched forward hands its methods, from a (B, N) mask, a caller's boolean or additive 4D mask (its key
    # padding; before, these were read without padding, which then passed for a second segment), or a dict of them
    additive = torch.zeros(2, 1, 6, 6).masked_fill(~real.bool()[:, None, None, :], -10000.0)
    for mask in (real, real.bool()[:, None, None, :].expand(2, 1, 6, 6), additive, {"full_attention": additive}):
        seen = []
        with torch.no_grad(), approx.integration.attention_probe(lambda *a: seen.append(_context.question_mask())):  # noqa: B023
            if isinstance(mask, dict):  # (EuroBERT's forward takes no dict: the patched model's hook, called here)
                approx.integration._set_question(model, (), {"input_ids": ids, "attention_mask": mask})
                seen.append(_context.question_mask())
                approx.integration._reset_question(model, (), None)
            else:
                model(input_ids=ids, attention_mask=mask)
        assert seen and all(torch.equal(m, want) for m in seen)


def test_a_patched_model_passes_its_question(monkeypatch):
    """A patched BERT sets the question mask from token_type_ids at every forward, and clears it after."""
    from conftest import tiny_model

    model = tiny_model("bert").eval()
    approx.patch(model, "window", window=2, block=4, question_global=True)
    ids = torch.randint(5, 90, (2, 24))
    types = torch.zeros(2, 24, dtype=torch.long)
    types[:, 9:] = 1
    seen = []
    with approx.integration.attention_probe(lambda *a: seen.append(_context.question_mask())):
        model(input_ids=ids, token_type_ids=types)
    assert seen and all(torch.equal(m, (torch.arange(24) < 8).expand(2, 24)) for m in seen)
    assert _context.question_mask() is None
    # arguments given by position are read by name as well (the token types were not seen: a reviewer's finding)
    seen.clear()
    mask = torch.ones(2, 24, dtype=torch.long)
    with approx.integration.attention_probe(lambda *a: seen.append(_context.question_mask())):
        model(ids, mask, types)
    assert seen and all(torch.equal(m, (torch.arange(24) < 8).expand(2, 24)) for m in seen)
    with pytest.raises(RuntimeError, match="question"):
        model(input_ids=ids)  # BERT's config has no sep_token_id and no token types were given
    approx.unpatch(model)
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_gradient_checkpointing_with_the_question_global_is_refused_clearly():
    """Checkpointing recomputes a layer in the backward pass, after the forward that set the question has ended:
    refused at the forward with what to do (it failed in the backward, saying no question was found); without
    checkpointing, or in eval mode, the same model trains and runs."""
    from conftest import tiny_model

    model = tiny_model("roberta", "question-answering")
    approx.patch(model, "window", window=4, block=4, question_global=True)
    ids = torch.randint(5, 90, (2, 32))
    ids[:, 0], ids[:, 8:10], ids[:, -1] = 0, 2, 2  # <s> question </s></s> context </s>
    labels = dict(start_positions=torch.tensor([12, 20]), end_positions=torch.tensor([14, 22]))
    model.train()
    with warnings.catch_warnings():  # the check for checkpointing asks transformers in words it does not deprecate
        warnings.simplefilter("error", FutureWarning)
        model(input_ids=ids, **labels).loss.backward()
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient checkpointing.*gradient_checkpointing_disable"):
        model(input_ids=ids, **labels)
    with approx.tokens(question_mask=torch.arange(32).expand(2, 32) < 8):  # the caller's mask outlives the forward
        model(input_ids=ids, **labels).loss.backward()
    with torch.no_grad():
        model(input_ids=ids)
    model.eval()
    model(input_ids=ids)


@pytest.mark.parametrize("n,s,w,dil", [(100, 100, 5, 1), (100, 100, 7, 3), (40, 40, 60, 1), (30, 50, 4, 2)])
def test_pair_count_matches_the_mask(n, s, w, dil):
    diff = torch.arange(n)[:, None] - torch.arange(s)[None, :]
    assert window_pairs(n, s, w, dil) == int(((diff.abs() <= w * dil) & (diff % dil == 0)).sum())
    c = cost(WindowConfig(window=w, dilation=dil, global_tokens=0), n=n, s=s, d=64, dv=64)
    assert c.qk_pairs == window_pairs(n, s, w, dil) and c.matmul_macs == c.qk_pairs * 128


@pytest.mark.parametrize(
    "options",
    [
        {"window": 3, "question_global": True},
        {"window": 2, "dilation": 3, "global_tokens": 2, "question_global": True},
        {"window": 40, "global_tokens": 0, "question_global": True},  # windows reaching past the row
        {"window": 4, "global_tokens": 3},  # no question: the first tokens only
        {"window": 3, "question_global": True, "exact_below": 30},  # the shortest row falls back to exact
    ],
)
def test_cost_per_row_counts_its_global_question(options):
    """What the harness's probe counts (``Method.costs`` in the forward's context) is, per batch row, the number of
    pairs of the pattern's definition among the row's real tokens: questions of different lengths (one row without
    any, one scattered) and padding; the cost model without the data counts the first ``global_tokens`` only."""
    n, lengths, questions = 50, [50, 41, 23, 37, 30], [12, 5, 0, 9, 0]
    mask = torch.arange(n)[None] < torch.tensor(lengths)[:, None]
    question = torch.arange(n)[None] < torch.tensor(questions)[:, None]
    question[4, [4, 9, 10, 22]] = True  # a mask given by hand (approx.tokens) need not be a prefix
    config = WindowConfig(block=8, **options)
    method = approx.get_method("window")
    with approx.tokens(question_mask=question):
        costs = method.costs(config, b=len(lengths), n=n, key_mask=mask, d=16, dv=8)
    glob = (torch.arange(n) < config.global_tokens).expand(len(lengths), n)
    glob = glob | question if config.question_global else glob
    allowed = allowed_pairs(mask, n, n, window=config.window, dilation=config.dilation, glob=glob)
    for row, (m, c) in enumerate(zip(lengths, costs, strict=True)):
        want = m * m if m < config.exact_below else int(allowed[row, :m].sum())
        assert (c.qk_pairs, c.matmul_macs, c.flops) == (want, want * 24, 2 * want * 24), row
        if not config.question_global:
            assert c == cost(config, n=m, s=m, d=16, dv=8)
    # the pattern the method runs covers those very pairs
    with approx.tokens(question_mask=question):
        pat = pattern(config, b=len(lengths), n=n, s=n, device="cpu")
    dense, _ = _blocksparse.dense_mask(pat, b=len(lengths), h=1, n=n, s=n, key_mask=mask, device="cpu")
    assert torch.equal(dense[:, 0] & mask[:, :, None], allowed & mask[:, :, None])
    if config.question_global:
        with pytest.raises(RuntimeError, match="question"):
            method.costs(config, b=len(lengths), n=n, key_mask=mask, d=16, dv=8)


def test_exact_when_the_window_covers_everything():
    q, k, v = qkv(90)
    mask = mask_of(90, 70)
    out = ApproxAttention("window", WindowConfig(window=89, block=16), head_dim=D)(q, k, v, mask)
    torch.testing.assert_close(out[:, :, :70], naive_attention(q, k, v, mask)[:, :, :70], rtol=1e-12, atol=1e-12)


def test_local_attention_peer_agrees():
    """lucidrains' local-attention (exact_windowsize, non-causal, one block back and forward) is the same window."""
    local_attention = pytest.importorskip("local_attention", reason="the [peers] extra is not installed")
    w, n = 8, 96
    q, k, v = (t.float() for t in qkv(n))
    mask = mask_of(n, 80)
    peer = local_attention.LocalAttention(
        window_size=w, causal=False, look_backward=1, look_forward=1, exact_windowsize=True, autopad=True
    )
    theirs = peer(q.reshape(B * H, n, D), k.reshape(B * H, n, D), v.reshape(B * H, n, D)).reshape(B, H, n, D)
    ours = ApproxAttention("window", WindowConfig(window=w, global_tokens=0, block=16), head_dim=D)(q, k, v)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    padded = peer(q, k, v, mask=mask)  # (B, H, n, d) with a key-padding mask
    ours_padded = ApproxAttention("window", WindowConfig(window=w, global_tokens=0), head_dim=D)(q, k, v, mask)
    torch.testing.assert_close(ours_padded[1, :, :80], padded[1, :, :80], rtol=1e-5, atol=1e-5)


def test_graph_stats_count_exact_rows_as_full():
    """A batch row below exact_below gets exact attention, so its graph statistics count every real pair."""
    q, k, _ = qkv(60)
    mask = mask_of(60, 40)  # row 1: 40 real tokens, below exact_below=50; row 0: 60, approximated
    layer = ApproxAttention("window", WindowConfig(window=2, block=8, exact_below=50), head_dim=D)
    stats = layer.graph_stats(q, k, mask, scale=D**-0.5)
    # non-global rows: their window among positions 1..59, plus the CLS column; the CLS row: every key
    row0 = sum(min(59, i + 2) - max(1, i - 2) + 1 for i in range(1, 60)) + 59 + 60
    assert torch.equal(stats["predicted"], torch.full((H,), float(row0 + 40 * 40), dtype=torch.float64))
    assert torch.equal(stats["valid"], torch.full((H,), float(60 * 60 + 40 * 40), dtype=torch.float64))


def test_autotune_counts_the_question_as_the_harness_does():
    """autotune's search path costs a question-global window from the check inputs' own questions (found as a patched
    forward finds them: before the first SEP): the path point with every layer on the window costs what the harness's
    probe measures when that point is verified, in both conventions."""
    from conftest import tiny_model

    from approx.harness.autotune import Search

    model = tiny_model("bert", num_hidden_layers=2)
    model.config.sep_token_id = 3
    g = torch.Generator().manual_seed(0)
    rows = []
    for length, question in ((40, 9), (31, 4), (52, 13), (25, 6), (44, 2), (36, 11)):
        ids = torch.randint(5, 99, (length,), generator=g)
        ids[question] = ids[-1] = 3
        rows.append(ids.tolist())
    label = "window:window=2,block=4,question_global=true"
    search = Search(model, rows[:2], check_data=rows[2:], methods=[label], batch_size=3, progress=False)
    for convention in ("flops", "matmul"):
        path, points = search._path(convention)
        every = next(j for j, a in enumerate(path) if all(c == 1 for c in a))
        with torch.inference_mode():
            search._verify(path[every])
        probe = search.measured[tuple(path[every])][1]
        mine, full = {"flops": (0, 2), "matmul": (4, 5)}[convention]
        assert points[every]["cost"] == pytest.approx(probe.cost[mine] / probe.cost[full], rel=1e-12)


def test_padding_before_the_global_tokens_is_refused_everywhere_and_a_hole_after_them_is_not():
    """Left padding would make a pad token global: the forward, the weights, the graph statistics and the per-row
    cost refuse it, saying how to pad. A pad between real tokens after the global positions changes none of them,
    and the pattern is the definition's there; so is left padding with no global token."""
    n = 40
    q, k, v = qkv(n)
    left = torch.ones(B, n, dtype=torch.bool)
    left[1, :7] = False
    layer = ApproxAttention("window", WindowConfig(window=3, block=8), head_dim=D)
    method = approx.get_method("window")
    calls = [
        lambda m: layer(q, k, v, m),
        lambda m: layer.weights(q, k, m, scale=D**-0.5),
        lambda m: layer.graph_stats(q, k, m, scale=D**-0.5),
        lambda m: method.costs(layer.config, b=B, n=n, key_mask=m, d=D, dv=D),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="padding must come after the real tokens.*padding_side"):
            call(left)
    hole = torch.ones(B, n, dtype=torch.bool)
    hole[1, 20:25] = False
    for call in calls:
        call(hole)
    glob = torch.zeros(B, n, dtype=torch.bool)
    glob[:, 0] = True
    real = hole[:, None, :, None].expand(B, H, n, D)
    ref = reference(q, k, v, hole, window=3, glob=glob)
    torch.testing.assert_close(layer(q, k, v, hole)[real], ref[real], rtol=1e-10, atol=1e-12)
    no_global = ApproxAttention("window", WindowConfig(window=3, block=8, global_tokens=0), head_dim=D)
    out = no_global(q, k, v, left)
    torch.testing.assert_close(out[1, :, 7:], reference(q, k, v, left, window=3)[1, :, 7:], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("n, s", [(1, 1), (7, 7), (13, 9), (9, 13), (40, 40)])
@pytest.mark.parametrize("window, dilation", [(0, 1), (3, 1), (3, 2), (50, 3), (10**7, 1)])
def test_window_pairs_counts_the_pairs_of_any_window(n, s, window, dilation):
    """The pairs (i, j) with |i - j| a multiple of the dilation at most ``window`` of it, counted here by brute force,
    windows far wider than the sequence included (ten million: a way to say "every key", counted over the offsets
    that fit, not over ten million of them)."""
    from approx.attention.window import window_pairs

    expected = sum(
        1 for i in range(n) for j in range(s) if (i - j) % dilation == 0 and abs(i - j) // dilation <= window
    )
    assert window_pairs(n, s, window, dilation) == expected
