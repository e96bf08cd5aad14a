"""approx installed from a built wheel works without the checkout: ``approx methods``, ``approx tasks`` and
``approx eval`` run from a folder outside the repository, importing the installed package.

The wheel is built without build isolation and installed without dependencies into a virtual environment that
sees this interpreter's packages (torch, transformers...), so nothing is downloaded; the test checks that the
``approx`` imported there is the wheel's copy, not the checkout's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The ``bin`` folder of a venv holding approx installed from a freshly built wheel."""
    pytest.importorskip("setuptools")
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"  # a clean copy: a build inside the checkout would leave (and reuse) build/
    shutil.copytree(ROOT / "approx", source / "approx", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    build = subprocess.run([*pip_wheel, "-w", str(work / "dist"), str(source)], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (work / "dist").glob("approx-*.whl")
    env_dir = work / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=True)
    bin_dir = env_dir / "bin"
    # and this interpreter's own packages, when it runs in a venv itself (whose packages a venv made from it does
    # not see): a .pth of their folders, after the venv's own, so the wheel's approx is the one imported
    inner = subprocess.run(
        [str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    outer = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    Path(inner, "outer_packages.pth").write_text("".join(f"{path}\n" for path in outer), encoding="utf-8")
    install = subprocess.run(
        [str(bin_dir / "python"), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    return bin_dir


def _run(bin_dir: Path, *args: str, cwd: Path, program: str = "approx") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}  # (a checkout on it would be imported)
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([str(bin_dir / program), *args], capture_output=True, text=True, cwd=cwd, env=env)


def test_the_wheel_is_what_runs(installed, tmp_path):
    where = _run(
        installed, "-c", "import approx; print(approx.__file__)", cwd=tmp_path, program="python"
    ).stdout.strip()
    assert Path(where).is_relative_to(installed.parent), f"imported {where}, not the wheel's copy"
    wheel_files = {p.name for p in Path(where).parent.rglob("*.py")}
    assert "paper_table.py" not in wheel_files  # the lab stays out of the package


def test_methods_and_tasks_from_the_wheel(installed, tmp_path):
    import approx
    from approx.harness.tasks import tasks

    methods = _run(installed, "methods", cwd=tmp_path)
    assert methods.returncode == 0, methods.stderr
    assert all(f"{m}:" in methods.stdout for m in approx.methods())
    listed = _run(installed, "tasks", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert all(f"{t} (v" in listed.stdout for t in tasks())


def test_eval_from_the_wheel(installed, tmp_path, data_dir, minilm_path):
    out = _run(
        installed,
        *("eval", "--task", "stsb", "--limit", "8", "--batch-size", "8", "--quiet"),
        *("--method", "clustered:clusters=4", "--data-dir", str(data_dir), "--output", "r.json"),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "| clustered" in out.stdout and (tmp_path / "r.json").is_file()
