"""MkDocs hooks: serve the committed figures from where the recipes and benchmarks write them, and list every
method module on the API page (``<!-- attention-modules -->``), so that adding a method is adding its file.

The PNGs live under ``recipes/results/`` and ``benchmarks/results/`` (next to the JSON they are drawn from);
MkDocs only publishes files under ``docs/``. Rather than committing copies, this hook adds each PNG to the
site at build time under ``figures/<folder>/``, so a page links ``figures/benchmarks/attention_op_cpu.png``
and ``mkdocs build --strict`` checks the link like any other. Only files inside the repository are read.
"""

from __future__ import annotations

import pkgutil
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {
    "figures/recipes": ROOT / "recipes" / "results",
    "figures/benchmarks": ROOT / "benchmarks" / "results",
}


def on_files(files: Files, config) -> Files:
    for prefix, folder in SOURCES.items():
        for png in sorted(folder.rglob("*.png")):
            uri = f"{prefix}/{png.relative_to(folder).as_posix()}"
            files.append(File.generated(config, uri, abs_src_path=str(png)))
    return files


MODULES_MARKER = "<!-- attention-modules -->"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MODULES_MARKER not in markdown:
        return markdown
    package = ROOT / "approx" / "attention"
    names = sorted(info.name for info in pkgutil.iter_modules([str(package)]) if not info.name.startswith("_"))
    names.sort(key=lambda name: name != "full")  # the exact reference first
    return markdown.replace(MODULES_MARKER, "\n\n".join(f"::: approx.attention.{name}" for name in names))
