"""notebooks/quickstart.ipynb runs end to end offline: its code cells are executed in order in one namespace
(a plain runner: no Jupyter kernel needed), from the notebook's own folder, and with Jupyter's nbconvert when
it is installed. Skips, saying why, without the MiniLM-L6 wheel, the data or Jupyter."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"
BESIDE_REPO = NOTEBOOK.parent.parent.parent / "shared" / "data"  # where the notebook looks without $APPROX_DATA_DIR


def code_cells(path: Path) -> list[str]:
    nb = json.loads(path.read_text())
    assert nb["nbformat"] == 4
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def test_notebook_has_no_stored_outputs():
    nb = json.loads(NOTEBOOK.read_text())
    assert all(
        not c.get("outputs") and c.get("execution_count") is None for c in nb["cells"] if c["cell_type"] == "code"
    )


def test_notebook_shows_its_plot_inline():
    """No forced backend (Agg never displays anything): the plot cell ends with plt.show()."""
    cells = code_cells(NOTEBOOK)
    assert not any("matplotlib.use(" in c or "MPLBACKEND" in c for c in cells)
    plot = next(c for c in cells if "plt.subplots" in c)
    assert plot.rstrip().endswith("plt.show()")


def _data_or_skip(pytestconfig) -> Path:
    from approx.harness.data import DataNotFoundError, find_data_dir

    try:
        return find_data_dir(pytestconfig.getoption("--data-dir"), need="glue/STS-B/dev.tsv")
    except DataNotFoundError as e:
        pytest.skip(f"notebook test skipped: {e}")


def _run_cells(namespace: dict) -> None:
    for i, source in enumerate(code_cells(NOTEBOOK)):
        try:
            exec(compile(source, f"{NOTEBOOK.name}[cell {i}]", "exec"), namespace)
        except Exception as e:  # name the cell that failed
            raise AssertionError(f"notebook cell {i} failed: {e!r}\n{source}") from e


@pytest.mark.realmodel
def test_quickstart_notebook_runs(minilm_path, pytestconfig, monkeypatch):
    monkeypatch.setenv("APPROX_DATA_DIR", str(_data_or_skip(pytestconfig)))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(NOTEBOOK.parent)
    namespace = {"__name__": "__main__"}
    _run_cells(namespace)
    results = namespace["results"]
    assert len(results) == 5 and results[0]["examples"] == namespace["LIMIT"]
    assert namespace["cosines"]["i-clustered:clusters=8,topk=8"] > namespace["cosines"]["clustered:clusters=8"]
    assert os.environ["MPLBACKEND"] == "Agg"


@pytest.mark.realmodel
def test_notebook_finds_the_data_from_its_own_folder(minilm_path, pytestconfig, monkeypatch, tmp_path):
    """Without $APPROX_DATA_DIR, from the notebook's folder (where Jupyter starts its kernel): the data next to
    the repository is found; elsewhere the first cell says what to set."""
    if _data_or_skip(pytestconfig) != BESIDE_REPO.resolve():
        pytest.skip(f"the data is not at {BESIDE_REPO}, where the notebook looks without $APPROX_DATA_DIR")
    monkeypatch.delenv("APPROX_DATA_DIR", raising=False)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(NOTEBOOK.parent)
    namespace = {"__name__": "__main__"}
    _run_cells(namespace)
    assert namespace["DATA_DIR"].resolve() == BESIDE_REPO.resolve() and len(namespace["results"]) == 5
    monkeypatch.setenv("APPROX_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="set APPROX_DATA_DIR"):
        exec(compile(code_cells(NOTEBOOK)[0], "cell 0", "exec"), {"__name__": "__main__"})


@pytest.mark.realmodel
@pytest.mark.slow
def test_notebook_runs_headless_with_nbconvert(minilm_path, pytestconfig, tmp_path):
    """`jupyter nbconvert --execute` from the notebook's folder: runs, and the plot is an inline image."""
    pytest.importorskip("nbconvert", reason='Jupyter is not installed (pip install -e ".[notebook]")')
    pytest.importorskip("ipykernel", reason='Jupyter is not installed (pip install -e ".[notebook]")')
    env = {**os.environ, "APPROX_DATA_DIR": str(_data_or_skip(pytestconfig))}
    env.pop("MPLBACKEND", None)
    cmd = [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", NOTEBOOK.name]
    cmd += ["--output-dir", str(tmp_path), "--ExecutePreprocessor.timeout=600"]
    done = subprocess.run(cmd, cwd=NOTEBOOK.parent, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    executed = json.loads((tmp_path / NOTEBOOK.name).read_text())
    outputs = [o for c in executed["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plot is not shown inline"
