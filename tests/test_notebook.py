"""notebooks/quickstart.ipynb runs end to end offline: its code cells are executed in order in one namespace
(a plain runner: no Jupyter kernel needed). Skips, saying why, without the MiniLM-L6 wheel or the data."""

import json
import os
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"


def code_cells(path: Path) -> list[str]:
    nb = json.loads(path.read_text())
    assert nb["nbformat"] == 4
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def test_notebook_has_no_stored_outputs():
    nb = json.loads(NOTEBOOK.read_text())
    assert all(
        not c.get("outputs") and c.get("execution_count") is None for c in nb["cells"] if c["cell_type"] == "code"
    )


@pytest.mark.realmodel
def test_quickstart_notebook_runs(minilm_path, pytestconfig, monkeypatch):
    from approx.harness.data import DataNotFoundError, find_data_dir

    try:
        folder = find_data_dir(pytestconfig.getoption("--data-dir"), need="glue/STS-B/dev.tsv")
    except DataNotFoundError as e:
        pytest.skip(f"notebook test skipped: {e}")
    monkeypatch.setenv("APPROX_DATA_DIR", str(folder))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(NOTEBOOK.parent)
    namespace = {"__name__": "__main__"}
    for i, source in enumerate(code_cells(NOTEBOOK)):
        try:
            exec(compile(source, f"{NOTEBOOK.name}[cell {i}]", "exec"), namespace)
        except Exception as e:  # name the cell that failed
            raise AssertionError(f"notebook cell {i} failed: {e!r}\n{source}") from e
    results = namespace["results"]
    assert len(results) == 5 and results[0]["examples"] == namespace["LIMIT"]
    assert namespace["cosines"]["i-clustered:clusters=8,topk=8"] > namespace["cosines"]["clustered:clusters=8"]
    assert os.environ["MPLBACKEND"] == "Agg"
