"""The README and the docs say what the code and the committed results say: generated tables are current, the
quick start's test command is the one CI runs, and the README stays a guide (no lab report)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _block(text: str, name: str) -> str:
    return text.split(f"<!-- {name}:start -->\n")[1].split(f"\n<!-- {name}:end -->")[0]


def test_readme_method_table_is_generated_from_the_configs():
    from approx.harness.cli import methods_markdown, methods_summary_markdown

    assert _block(README, "methods-table") == methods_summary_markdown(), (
        "stale method table: run python recipes/update_docs.py"
    )
    assert _block((ROOT / "docs" / "methods.md").read_text(), "methods-table") == methods_markdown(), (
        "stale method table: run python recipes/update_docs.py"
    )


def test_readme_task_table_is_generated_from_the_tasks():
    from approx.harness.cli import tasks_markdown

    assert _block(README, "tasks-table") == tasks_markdown(), "stale task table: run python recipes/update_docs.py"


def test_readme_results_are_rendered_from_the_committed_result_files():
    """Every generated block of the README and docs/ (tables, results, benchmarks) matches its source."""
    check = subprocess.run([sys.executable, "recipes/update_docs.py", "--check"], cwd=ROOT)
    assert check.returncode == 0, "stale generated blocks: run python recipes/update_docs.py"


def test_ci_runs_the_readme_test_command_verbatim():
    commands = re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)
    test_command = next(c for c in commands if "pytest" in c)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci, f"the README's test command is not a line of .ci/run: {test_command}"
    assert test_command.endswith("&& mkdocs build --strict"), "the docs build is part of the test command"


def test_readme_is_a_guide_not_a_lab_report():
    lines = README.splitlines()
    assert len(lines) <= 260, f"README has {len(lines)} lines; move details to docs/"
    assert not re.search(r"issue #\d+", README, flags=re.I), "issue numbers belong in CHANGELOG.md"
    assert not re.search(r"`[0-9a-f]{7,40}(\+dirty)?`", README), "commit hashes belong in docs/results.md"
    outside = set(re.findall(r"\.\./[\w./-]+", README)) - {"../shared/data"}
    assert not outside, f"paths outside the repository: {sorted(outside)}"
    assert README.index("## Layout") < README.index("## Methods"), "the layout map comes near the top"


def test_every_name_the_docs_call_under_approx_exists():
    """``approx.name(...)`` and ``approx.a.b.name`` in the README and the docs site resolve (importing modules along
    the way): a documented function that is not where the docs say (``approx.load_method_state`` was only in
    approx.integration; ``approx.tasks.base`` had moved under approx.harness) fails here."""
    import importlib
    import re

    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for dotted in sorted(set(re.findall(r"`[^`]*?\b(approx(?:\.[A-Za-z_]\w*)+)", doc.read_text()))):
            obj, parts = importlib.import_module("approx"), dotted.split(".")[1:]
            for i, part in enumerate(parts):
                if not hasattr(obj, part):
                    try:
                        obj = importlib.import_module(".".join(["approx", *parts[: i + 1]]))
                        continue
                    except ImportError:
                        missing.append(f"{doc.name}: {dotted}")
                        break
                obj = getattr(obj, part)
    assert not missing, missing
