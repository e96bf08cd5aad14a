"""Render the README's results block from the committed result files (so the README is never typed).

python recipes/update_readme.py            # rewrite the block between the results markers
python recipes/update_readme.py --check    # exit 1 if the README is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from approx.evaluation import markdown_report
from approx.fidelity import markdown_table

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- results:start -->\n", "<!-- results:end -->"
FIDELITY = [
    ("recipes/results/minilm_wikitext2_fidelity.json", "recipes/minilm_wikitext2_fidelity.py", "Clustered attention"),
    ("recipes/results/minilm_wikitext2_favor.json", "recipes/minilm_wikitext2_favor.py", "FAVOR+"),
]
BENCHMARK = "benchmarks/results/attention_op_cpu.json"
HARNESS = [
    "recipes/results/minilm_stsb_zero_shot.json",
    "recipes/results/minilm_wikitext2_harness.json",
]


def _provenance_line(p: dict) -> str:
    return f"commit `{(p.get('git_commit') or 'unknown')[:12]}`, {p.get('date_utc', '?')}, torch {p['libraries']['torch'] if 'libraries' in p else '?'}"


def fidelity_block(path: str, recipe: str, title: str) -> str:
    report = json.loads((ROOT / path).read_text())
    return (
        f"**{title}**, zero-shot on MiniLM-L6, {report['windows']} WikiText-2 test windows of "
        f"{report['window_length']} tokens, every layer patched, no retraining (`python {recipe}`; "
        f"{_provenance_line(report['provenance'])}). Cosines are to the unpatched model's final hidden "
        "states; times are whole-model forward passes at this short length, where the approximations do not "
        "pay off yet:\n\n" + markdown_table(report, short=True) + "\n"
    )


def benchmark_block(path: str) -> str:
    res = json.loads((ROOT / path).read_text())
    methods = [m for m in res["methods"] if m != "full"]
    head = "| N | sdpa ms | " + " | ".join(f"{m} ms (× SDPA)" for m in methods) + " |"
    rows = [head, "|" + " --- |" * (2 + len(methods))]
    for n in res["lengths"]:
        times = {c: sorted(v)[len(v) // 2] * 1000 for c, v in res["times_s"][str(n)].items() if v}
        cells = [f"{times[m]:.0f} ({times['sdpa'] / times[m]:.2f}×)" if m in times else "not run" for m in methods]
        rows.append(f"| {n} | {times['sdpa']:.0f} | " + " | ".join(cells) + " |")
    mem = res["memory"]
    big = str(max(res["lengths"]))
    mem_line = ", ".join(
        f"{c} {mem[big][c]['peak_extra_mib']:.0f} MiB" for c in ["sdpa", *methods] if c in mem.get(big, {})
    )
    configs = "; ".join(f"{m}: " + ", ".join(f"{k}={v}" for k, v in res["configs"][m].items()) for m in methods)
    return (
        f"**Attention op alone**, shape (1, 12, N, 64), float32 forward, {res['provenance']['torch_threads']} "
        f"threads, median of {res['repeats']} interleaved calls (`python benchmarks/attention_op.py`; "
        f"{_provenance_line(res['provenance'])}; full table, memory and plot in `benchmarks/results/`):\n\n"
        + "\n".join(rows)
        + f"\n\nPeak extra memory at N = {big}: {mem_line}. Settings: {configs}. Dense O(N²) methods are not run"
        " above the eager limit (`--eager-max`).\n"
    )


def harness_block(paths: list[str]) -> str:
    runs = [json.loads((ROOT / p).read_text()) for p in paths if (ROOT / p).is_file()]
    if not runs:
        return ""
    prov = runs[0][0]["provenance"]
    text = (
        "**Evaluation harness**, MiniLM-L6 zero-shot, every method against the unpatched model on the same batches "
        f"(`python recipes/minilm_harness_report.py`; {_provenance_line(prov)}). Wall time of each run, all "
        "methods included: "
        + ", ".join(f"{r[0]['task']} {r[0]['provenance']['wall_seconds']:.0f} s" for r in runs)
        + ". *seconds* are the forward passes of each method over the whole run; peak MiB is a peak-RSS delta, "
        "which reads low when a method reuses memory the allocator kept from earlier runs.\n\n"
    )
    return text + "\n\n".join(markdown_report(r) for r in runs) + "\n"


def render() -> str:
    parts = [fidelity_block(*f) for f in FIDELITY if (ROOT / f[0]).is_file()]
    parts.append(harness_block(HARNESS))
    if (ROOT / BENCHMARK).is_file():
        parts.append(benchmark_block(BENCHMARK))
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    readme = ROOT / "README.md"
    text = readme.read_text()
    head, rest = text.split(START)
    _, tail = rest.split(END)
    new = head + START + render() + END + tail
    if args.check:
        return 0 if new == text else 1
    readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
