"""squad-doc and squad-doc-sliding: articles rebuilt from the SQuAD file, the seeded window rule recomputed from
its documented formula, the sliding baseline cut as squad cuts a context, oracle logits scored, end to end on
tiny checkpoints (against a plain forward pass), and the same cross-fitting halves as squad."""

import hashlib
import json

import numpy as np
import pytest
import torch
from evalfixtures import write_checkpoint, write_data

import approx
from approx.harness.metrics import squad_exact_match
from approx.harness.tasks import Feature, get_task
from approx.harness.tasks.squad_doc import SquadDocSliding

DOC, SLIDING, SQUAD = get_task("squad-doc"), get_task("squad-doc-sliding"), get_task("squad")


def u_of(question_id: str) -> float:
    """The documented draw: SHA-256 of "20240516:<id>", first 8 bytes (big-endian) over 2^64."""
    return int.from_bytes(hashlib.sha256(f"20240516:{question_id}".encode()).digest()[:8], "big") / 2**64


def window_chars(feature: Feature) -> tuple[int, int]:
    """First and last article character a feature reads (from its token offsets)."""
    inside = [o for o in feature.extra["offsets"] if o is not None]
    return inside[0][0], inside[-1][1]


def oracle(task, examples, features):
    """Predictions from logits that point at the first gold answer in every input that holds all of it."""
    outputs = []
    for f in features:
        ex, offsets = examples[f.example], f.extra["offsets"]
        lo, hi = ex["answer_start"], ex["answer_start"] + len(ex["answers"][0])
        logits = torch.zeros(2, len(f.input_ids))
        inside = [i for i, o in enumerate(offsets) if o is not None]
        if offsets[inside[0]][0] <= lo and offsets[inside[-1]][1] >= hi:
            logits[0, next(i for i in inside if offsets[i][1] > lo)] = 10.0
            logits[1, next(i for i in reversed(inside) if offsets[i][0] < hi)] = 10.0
        outputs.append(task.compact(logits, f, "fine-tuned"))  # as the harness keeps them
    return task.predict(examples, features, outputs, "fine-tuned")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = write_data(tmp_path_factory.mktemp("data"))
    return root, str(write_checkpoint(tmp_path_factory.mktemp("qa"), "question-answering"))


@pytest.fixture(scope="module")
def real(pytestconfig):
    from transformers import AutoTokenizer

    from approx.harness.data import DataNotFoundError, default_model_path, find_data_dir

    try:
        folder = find_data_dir(pytestconfig.getoption("--data-dir"), need="squad/dev-v1.1.json")
    except DataNotFoundError as e:
        pytest.skip(f"real-data test skipped (needs squad/dev-v1.1.json): {e}")
    try:
        tok = AutoTokenizer.from_pretrained(default_model_path())
    except ModuleNotFoundError as e:
        pytest.skip(f"real-model test skipped: {e}")
    examples, _ = DOC.load(source="local", data_dir=str(folder))
    return folder, examples, tok


# ------------------------------------------------------------------------------------------------ articles


def test_articles_are_the_paragraphs_in_file_order(real):
    folder, examples, _ = real
    raw = json.loads((folder / "squad/dev-v1.1.json").read_text())["data"]
    articles = {a["title"]: "\n\n".join(p["context"] for p in a["paragraphs"]) for a in raw}
    assert len(articles) == 48 and len({ex["context"] for ex in examples}) == 48
    plain, _ = SQUAD.load(source="local", data_dir=str(folder))
    assert [ex["id"] for ex in examples] == [ex["id"] for ex in plain] and len(examples) == 10570
    for ex, sq in zip(examples, plain, strict=True):
        assert ex["context"] == articles[ex["title"]]
        assert ex["context"][ex["paragraph_start"] : ex["paragraph_end"]] == sq["context"]
        answer = ex["answers"][0]
        assert ex["context"][ex["answer_start"] : ex["answer_start"] + len(answer)] == answer


def test_limit_and_halves_come_after_the_articles_and_match_squad(synthetic, real):
    for root in (synthetic[0], real[0]):
        whole, _ = DOC.load(source="local", data_dir=str(root))
        first, _ = DOC.load(source="local", data_dir=str(root), limit=2)
        titles = list(dict.fromkeys(e["title"] for e in whole))
        # round-robin over the articles: the first question of each of the first two, with its whole article
        assert first == [next(e for e in whole if e["title"] == t) for t in titles[:2]]  # file order kept
        spread, _ = DOC.load(source="local", data_dir=str(root), limit=len(titles) + 1)
        assert {e["title"] for e in spread} == set(titles)
        for half in ("dev/0", "dev/1"):
            doc, _ = DOC.load(half, source="local", data_dir=str(root))
            sq, _ = SQUAD.load(half, source="local", data_dir=str(root))
            assert [(e["id"], e["title"]) for e in doc] == [(e["id"], e["title"]) for e in sq]
        assert not {e["title"] for e in DOC.load("dev/0", source="local", data_dir=str(root))[0]} & {
            e["title"] for e in DOC.load("dev/1", source="local", data_dir=str(root))[0]
        }


def test_examples_past_a_calibration_never_overlap_it(synthetic, real):
    """A score target reads the examples past the calibration's limit. squad-doc's limit takes questions round-robin
    over the articles (back in file order), so the first ones of a larger limit are not the calibration's: the
    scorer had scored 50 of 64 calibration questions at the docs' --limit 64 --score-examples 400. load_after gives
    what the larger limit adds, and every task that cuts a prefix gives its slice, as before."""
    for root in (synthetic[0], real[0]):
        whole, _ = DOC.load(source="local", data_dir=str(root))
        for skip, limit in ((2, 3), (64, 400), (1, None)):
            if skip + (limit or 0) > len(whole):
                continue
            calibration, _ = DOC.load(source="local", data_dir=str(root), limit=skip)
            after, _ = DOC.load_after(None, skip, limit=limit, source="local", data_dir=str(root))
            ids = {e["id"] for e in calibration}
            assert not ids & {e["id"] for e in after}
            assert len(after) == (len(whole) - skip if limit is None else limit)
            if limit is not None:
                both, _ = DOC.load(source="local", data_dir=str(root), limit=skip + limit)
                assert [e["id"] for e in both if e["id"] not in ids] == [e["id"] for e in after]
        plain, _ = SQUAD.load(source="local", data_dir=str(root))
        assert SQUAD.load_after(None, 3, limit=4, source="local", data_dir=str(root))[0] == plain[3:7]
        assert SQUAD.load(source="local", data_dir=str(root), limit=np.int64(4))[0] == plain[:4]  # a sweep's integer
    with pytest.raises(ValueError, match="wikitext2: one example, the whole text"):  # its limit counts windows
        get_task("wikitext2").load_after("valid", 2, limit=3)


def test_hub_rows_give_the_local_articles(synthetic, monkeypatch):
    """``--source hub``: the question rows of `rajpurkar/squad` (faked from the local file: no network) are
    built into the same articles as the local file."""
    import datasets

    import approx.harness.tasks.base as base

    local, _ = DOC.load(source="local", data_dir=str(synthetic[0]))
    plain, _ = SQUAD.load(source="local", data_dir=str(synthetic[0]))
    rows = [
        {k: e[k] for k in ("id", "question", "context", "title")}
        | {"answers": {"text": e["answers"], "answer_start": [e["answer_start"]] * len(e["answers"])}}
        for e in plain
    ]
    monkeypatch.setattr(base, "_hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setattr(datasets, "load_dataset", lambda path, name=None, split=None: rows)
    assert DOC.load(source="hub")[0] == local


# ------------------------------------------------------------------------------------------------- windows


@pytest.mark.parametrize("max_length", [128, 512, 4096])
def test_window_follows_the_documented_rule(real, max_length):
    _, examples, tok = real
    sample = examples[::1000]
    feats = DOC.features(sample, tok, max_length=max_length, mode="fine-tuned")
    assert [f.example for f in feats] == list(range(len(sample)))
    for ex, f in zip(sample, feats, strict=True):
        enc = tok(ex["context"], add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        q = tok(ex["question"].lstrip(), add_special_tokens=False)["input_ids"]
        start = next(i for i, o in enumerate(offsets) if o[0] >= ex["paragraph_start"])
        stop = next((i for i, o in enumerate(offsets) if o[0] >= ex["paragraph_end"]), len(ids))
        budget = max_length - len(q) - 3
        room = max(0, budget - (stop - start))
        placed = start - round(u_of(ex["id"]) * room)
        lo = max(0, min(placed, len(ids) - budget))
        hi = min(len(ids), lo + budget)
        assert f.extra["window"] == (lo, hi) and f.extra["gold"] == (start, stop)
        if lo == placed and room > 0:  # not moved at an article edge: the paragraph sits at u
            assert abs(f.extra["gold_position"] - u_of(ex["id"])) <= 1 / room
        assert f.input_ids == [tok.cls_token_id, *q, tok.sep_token_id, *ids[lo:hi], tok.sep_token_id]
        assert f.token_type_ids == [0] * (len(q) + 2) + [1] * (hi - lo + 1)
        assert window_chars(f) == (offsets[lo][0], offsets[hi - 1][1]) and len(f.input_ids) <= max_length
        if stop - start > budget:  # a paragraph longer than the window: the window starts at the paragraph
            assert lo == min(start, len(ids) - budget)


def test_window_holds_gold_is_deterministic_and_spreads_the_gold_paragraph(real):
    _, examples, tok = real
    sample = examples[::50]  # 212 questions from every article
    feats = DOC.features(sample, tok, max_length=4096, mode="fine-tuned")
    again = DOC.features(sample, tok, max_length=4096, mode="fine-tuned")
    assert [(f.input_ids, f.extra) for f in feats] == [(f.input_ids, f.extra) for f in again]
    positions = []
    for ex, f in zip(sample, feats, strict=True):
        first, last = window_chars(f)
        assert first <= ex["paragraph_start"] and ex["paragraph_end"] <= last  # every paragraph fits at 4096
        assert first <= ex["answer_start"] and ex["answer_start"] + len(ex["answers"][0]) <= last
        positions.append(f.extra["gold_position"])
    assert all(0 <= p <= 1 for p in positions)
    quartiles = [sum(q / 4 <= p < (q + 1) / 4 or (q == 3 and p == 1) for p in positions) for q in range(4)]
    assert min(quartiles) >= 0.15 * len(positions), quartiles


def test_sliding_reads_the_same_window_in_384_token_inputs(real):
    _, examples, tok = real
    sample = examples[::500]
    doc = DOC.features(sample, tok, max_length=2048, mode="fine-tuned")
    sliding = SLIDING.features(sample, tok, max_length=2048, mode="fine-tuned")
    assert len(sliding) > 4 * len(sample)
    for i, f in enumerate(doc):
        reads = [g for g in sliding if g.example == i]
        assert all(len(g.input_ids) <= 384 for g in reads)
        assert all(g.extra["window"] == f.extra["window"] for g in reads)
        read = [o for g in reads for o in g.extra["offsets"] if o is not None]
        assert read[0] == next(o for o in f.extra["offsets"] if o is not None)
        assert sorted(set(read)) == [o for o in f.extra["offsets"] if o is not None]  # the window, all of it


def test_sliding_cuts_a_whole_article_as_squad_cuts_a_context(real):
    _, examples, tok = real
    ex = examples[0]  # Super Bowl 50: under 20k tokens, so the window is the whole article
    ours = SLIDING.features([ex], tok, max_length=20_000, mode="fine-tuned")
    squads = SQUAD.features([ex], tok, max_length=384, mode="fine-tuned")
    assert len(ours) == len(squads) > 10
    for a, b in zip(ours, squads, strict=True):
        assert a.input_ids == b.input_ids and a.token_type_ids == b.token_type_ids
        assert list(a.extra["offsets"]) == b.extra["offsets"]


# ------------------------------------------------------------------------------------------------- scoring


@pytest.mark.parametrize("task", [DOC, SLIDING])
def test_oracle_logits_score_exact_match_100(real, task):
    _, examples, tok = real
    sample = examples[::700]
    feats = task.features(sample, tok, max_length=4096, mode="fine-tuned")
    predictions = oracle(task, sample, feats)
    assert squad_exact_match(predictions, [ex["answers"] for ex in sample]) == 100.0


def test_oracle_on_synthetic_files_with_several_reads_and_a_roberta_tokenizer(synthetic):
    from transformers import AutoTokenizer, RobertaTokenizer

    examples, _ = DOC.load(source="local", data_dir=str(synthetic[0]))
    word = AutoTokenizer.from_pretrained(synthetic[1])
    chars = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a"]  # byte-level, one token per character
    byte = RobertaTokenizer(vocab={t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>", "<mask>", *chars])})
    short = type("ShortReads", (SquadDocSliding,), {"read_length": 48})()
    for task, tok, n in ((DOC, word, 100), (short, word, 100), (DOC, byte, 300), (SLIDING, byte, 600)):
        feats = task.features(examples, tok, max_length=n, mode="fine-tuned")
        assert all(len(f.input_ids) <= (task.read_length or n) for f in feats)
        assert squad_exact_match(oracle(task, examples, feats), [ex["answers"] for ex in examples]) == 100.0
        if task is short:
            assert len(feats) > 2 * len(examples)
    f = DOC.features(examples[:1], byte, max_length=300, mode="fine-tuned")[0]
    assert f.token_type_ids is None and f.input_ids[0] == byte.cls_token_id and f.input_ids[-1] == byte.sep_token_id
    assert f.input_ids.count(byte.sep_token_id) == 3  # <s> q </s></s> window </s>


def test_kept_logits_give_the_predictions_of_all_logits(synthetic):
    """compact keeps the 20 best starts and ends only: squad's span rule on all logits picks the same spans."""
    from transformers import AutoTokenizer

    examples, _ = DOC.load(source="local", data_dir=str(synthetic[0]))
    feats = DOC.features(examples, AutoTokenizer.from_pretrained(synthetic[1]), max_length=100, mode="fine-tuned")
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        logits = [torch.randn(2, len(f.input_ids), generator=g) for f in feats]
        kept = [DOC.compact(out, f, "fine-tuned") for out, f in zip(logits, feats, strict=True)]
        assert DOC.predict(examples, feats, kept, "fine-tuned") == SQUAD.predict(examples, feats, logits, "fine-tuned")


def test_refusals(synthetic):
    from transformers import AutoTokenizer

    examples, _ = DOC.load(source="local", data_dir=str(synthetic[0]))
    tok = AutoTokenizer.from_pretrained(synthetic[1])
    need = max(len(tok(ex["question"], add_special_tokens=False)["input_ids"]) for ex in examples) + 3 + 64
    DOC.features(examples, tok, max_length=need, mode="fine-tuned")
    with pytest.raises(ValueError, match=f"at least {need} tokens"):
        DOC.features(examples, tok, max_length=need - 1, mode="fine-tuned")

    class Slow:
        is_fast = False

    with pytest.raises(ValueError, match="fast tokenizer"):
        SLIDING.features(examples, Slow(), max_length=512, mode="fine-tuned")
    with pytest.raises(ValueError, match="squad-doc-sliding cannot be fine-tuned.*'squad-doc'"):
        SLIDING.train_features(examples, tok, max_length=512)


def test_training_windows_are_the_evaluation_windows_labelled_with_the_answer(synthetic):
    """Every question gets the window it is evaluated on (same tokens), labelled with the first gold answer's
    token span: the article's characters under that span are the answer; [CLS] (0, 0) exactly when the window
    does not hold all of the answer (one more question, on a paragraph eight times longer than its window with the
    answer in its last eighth, has its answer cut off)."""
    from transformers import AutoTokenizer

    examples, _ = DOC.load(source="local", data_dir=str(synthetic[0]))
    tok = AutoTokenizer.from_pretrained(synthetic[1])
    ex = examples[0]
    text = ex["context"][ex["paragraph_start"] : ex["paragraph_end"]]
    long = " ".join([text] * 8)
    at = ex["answer_start"] - ex["paragraph_start"] + 7 * (len(text) + 1)
    assert long[at : at + len(ex["answers"][0])] == ex["answers"][0]
    examples.append({**ex, "id": "cut", "title": "long", "context": long, "paragraph_start": 0,
                     "paragraph_end": len(long), "answer_start": at})  # fmt: skip
    longest = max(len(tok(ex["question"], add_special_tokens=False)["input_ids"]) for ex in examples)
    cut = 0
    for n in (longest + 3 + 64, 512):
        train = DOC.train_features(examples, tok, max_length=n)
        evaluation = DOC.features(examples, tok, max_length=n, mode="fine-tuned")
        assert [(f.example, f.input_ids) for f in train] == [(f.example, f.input_ids) for f in evaluation]
        assert sorted(f.example for f in train) == list(range(len(examples)))
        for f in train:
            ex, labels = examples[f.example], f.extra["labels"]
            s, e = labels["start_positions"], labels["end_positions"]
            lo, hi = ex["answer_start"], ex["answer_start"] + len(ex["answers"][0])
            first, last = window_chars(f)
            if first <= lo and hi <= last:
                offsets = f.extra["offsets"]
                assert 0 < s <= e and ex["context"][offsets[s][0] : offsets[e][1]].strip() == ex["answers"][0].strip()
            else:
                cut += 1
                assert (s, e) == (0, 0)
    assert cut >= 1  # the long paragraph's question at the shorter length at least
    assert "one pass" in DOC.train_protocol(512) and "20240516" in DOC.train_protocol(512)


def test_describe_and_protocol_state_the_rule():
    assert DOC.describe()["splits"] == ["dev"] and DOC.describe()["default_max_length"] == 4096
    assert DOC.version == SLIDING.version == 1 and DOC.metrics == SLIDING.metrics == ("exact_match", "f1")
    for task in (DOC, SLIDING):
        text = task.protocol("fine-tuned", 1024)
        assert "1024-token window" in text and "20240516" in text and "round(u*max(0, B-P))" in text
    assert "384-token windows with document stride 128" in SLIDING.protocol("fine-tuned", 1024)
    assert "one pass" in DOC.protocol("fine-tuned", 1024)


# ---------------------------------------------------------------------------------------------- end to end


def plain_metrics(task, model, tok, examples, max_length):
    """Independent reference: each feature through the unpatched model alone, squad's span rule on all logits."""
    feats = task.features(examples, tok, max_length=max_length, mode="fine-tuned")
    outputs = []
    with torch.no_grad():
        for f in feats:
            types = torch.tensor([f.token_type_ids]) if f.token_type_ids is not None else None
            out = model(input_ids=torch.tensor([f.input_ids]), token_type_ids=types)
            outputs.append(torch.stack([out.start_logits[0], out.end_logits[0]]))
    return SQUAD.score(examples, SQUAD.predict(examples, feats, outputs, "fine-tuned"), "fine-tuned")


@pytest.mark.parametrize("name", ["squad-doc", "squad-doc-sliding"])
def test_end_to_end_on_synthetic_files(synthetic, name):
    from transformers import AutoModelForQuestionAnswering, AutoTokenizer

    root, path = synthetic
    full, fav = approx.evaluate(
        path, name, ["full", "favor:features=16"], data_dir=str(root), source="local", max_length=100, limit=3,
        batch_size=2, progress=False,
    )  # fmt: skip
    assert full["examples"] == 3 and full["task"] == name and full["task_version"] == 1
    assert full["metrics"] == full["reference_metrics"] and full["fidelity"]["agreement"] == 1.0
    assert fav["fidelity"]["kl_divergence"] > 0 and 0 <= fav["metrics"]["f1"] <= 100
    examples, _ = get_task(name).load(source="local", data_dir=str(root), limit=3)
    model = AutoModelForQuestionAnswering.from_pretrained(path).eval()
    reference = plain_metrics(get_task(name), model, AutoTokenizer.from_pretrained(path), examples, 100)
    assert full["reference_metrics"] == pytest.approx(reference)


def test_end_to_end_on_the_real_file_at_1024_tokens(real):
    from conftest import tiny_model

    folder, _, tok = real
    model = tiny_model("bert", "question-answering", vocab_size=tok.vocab_size, max_position_embeddings=1024)
    (full,) = approx.evaluate(
        model, "squad-doc", ["full"], tokenizer=tok, data_dir=str(folder), source="local", max_length=1024,
        limit=3, progress=False,
    )  # fmt: skip
    assert full["examples"] == full["features"] == 3 and full["metrics"] == full["reference_metrics"]
    examples, _ = DOC.load(source="local", data_dir=str(folder), limit=3)
    assert full["reference_metrics"] == pytest.approx(plain_metrics(DOC, model, tok, examples, 1024))


def test_positions_are_extended_for_the_one_pass_read_only(real):
    """At 1024 tokens a 512-position model is extended for squad-doc (one 1024-token input) but not for the
    sliding baseline, whose inputs are 384 tokens long."""
    from conftest import tiny_model

    folder, _, tok = real
    model = tiny_model("bert", "question-answering", vocab_size=tok.vocab_size, max_position_embeddings=512)
    kw = dict(tokenizer=tok, data_dir=str(folder), source="local", max_length=1024, limit=2, progress=False)
    (doc,) = approx.evaluate(model, "squad-doc", ["full"], **kw)
    (sliding,) = approx.evaluate(model, "squad-doc-sliding", ["full"], **kw)
    assert doc["positions"]["extended_from"] == 512 and doc["positions"]["extended_to"] == 1024
    assert "positions" not in sliding and "extended" not in sliding["protocol"]
