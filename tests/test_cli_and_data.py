"""The command line and the data helpers."""

import pytest

import approx
from approx.harness.cli import main
from approx.harness.data import DataNotFoundError, find_data_dir, read_wikitext
from approx.harness.fidelity import parse_setup


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
    assert "| i-clustered:clusters=10,topk=16 |" in capsys.readouterr().out
    report = json.loads(out.read_text())
    expected = approx.get_method("i-clustered").make_config(clusters=10, topk=16).to_dict()
    assert report["results"][0]["method"] == {"name": "i-clustered", **expected}
    assert report["provenance"]["approx_version"] == approx.__version__


def test_readme_method_table_is_generated_from_the_configs():
    from pathlib import Path

    from approx.harness.cli import methods_markdown

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    table = readme.split("<!-- methods-table:start -->\n")[1].split("\n<!-- methods-table:end -->")[0]
    assert table == methods_markdown(), "README method table is stale: paste `approx methods --markdown`"


def test_readme_results_are_rendered_from_the_committed_result_files():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parent.parent
    check = subprocess.run([sys.executable, "recipes/update_readme.py", "--check"], cwd=root)
    assert check.returncode == 0, "README results block is stale: run python recipes/update_readme.py"


def test_readme_task_table_is_generated_from_the_tasks():
    from pathlib import Path

    from approx.harness.cli import tasks_markdown

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    table = readme.split("<!-- tasks-table:start -->\n")[1].split("\n<!-- tasks-table:end -->")[0]
    assert table == tasks_markdown(), "README task table is stale: paste `approx tasks --markdown`"
