"""The clustered-table recipe's results as a markdown table next to the paper's numbers.

Reads ``recipes/results/clustered_table_<task>.json`` (written by ``recipes/clustered_table.py``), puts each
method's task metric beside the paper's value (:data:`PAPER`) and checks the paper's pattern on our numbers:

* i-clustered-25 within 1 % (relative) of full attention on every task;
* clustered-25 clearly worse (more than :data:`CLEARLY_WORSE` relative) exactly where the paper's is (SQuAD,
  RTE, MRPC, QNLI, STS-B, MNLI), and not where the paper's is not.

Every cell where our pattern differs from the paper's is flagged and explained under the table.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import approx
from approx.harness.tasks import get_task

__all__ = ["PAPER", "load_results", "markdown_table", "pattern_checks", "method_label"]

# Vyas, Katharopoulos, Fleuret, "Fast Transformers with Clustered Attention", NeurIPS 2020 (arXiv 2007.04825),
# §4.3, table "approximation of a fine-tuned RoBERTa" (GLUE at max length 128, SQuAD at 384, 25 clusters,
# k = 32; attention replaced at inference without retraining); as published.
# The paper does not name the metric per task; we compare with CoLA: Matthews correlation, MRPC / QQP: accuracy,
# STS-B: Pearson, SQuAD: F1, the others accuracy (MNLI: matched).
PAPER_SOURCE = "Vyas et al. 2020 (arXiv 2007.04825), §4.3: fine-tuned RoBERTa-base, attention swapped at inference"
PAPER: dict[str, dict[str, float]] = {
    "full": {
        "cola": 0.601,
        "mnli": 0.880,
        "mrpc": 0.868,
        "qnli": 0.929,
        "qqp": 0.915,
        "rte": 0.682,
        "sst2": 0.947,
        "stsb": 0.900,
        "wnli": 0.437,
        "squad": 0.904,
    },
    "clustered-25": {
        "cola": 0.598,
        "mnli": 0.794,
        "mrpc": 0.436,
        "qnli": 0.746,
        "qqp": 0.894,
        "rte": 0.498,
        "sst2": 0.944,
        "stsb": 0.789,
        "wnli": 0.437,
        "squad": 0.006,
    },
    "i-clustered-25": {
        "cola": 0.601,
        "mnli": 0.880,
        "mrpc": 0.873,
        "qnli": 0.930,
        "qqp": 0.915,
        "rte": 0.704,
        "sst2": 0.947,
        "stsb": 0.900,
        "wnli": 0.437,
        "squad": 0.876,
    },
}
TASK_ORDER = ["cola", "mnli", "mrpc", "qnli", "qqp", "rte", "sst2", "stsb", "wnli", "squad"]
TASK_NAMES = {
    "cola": "CoLA",
    "mnli": "MNLI",
    "mrpc": "MRPC",
    "qnli": "QNLI",
    "qqp": "QQP",
    "rte": "RTE",
    "sst2": "SST-2",
    "stsb": "STS-B",
    "wnli": "WNLI",
    "squad": "SQuAD",
}
# the metric each task's table row reports: the task's own primary metric (approx tasks)
PRIMARY_METRIC = {t: get_task(t).primary_metric for t in TASK_NAMES}
WITHIN = 0.01  # i-clustered-25 must stay within 1 % (relative) of full
CLEARLY_WORSE = 0.05  # clustered-25 "clearly worse": more than 5 % (relative) below full
RESULT_GLOB = "clustered_table_*.json"
DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"


def method_label(method: dict[str, Any]) -> str:
    """``clustered-25``, ``i-clustered-100``, ``favor-256``, ``window-32`` (the method's budget knob; extra options
    after a colon)."""
    name = method["name"]
    knob = {
        "clustered": "clusters",
        "i-clustered": "clusters",
        "favor": "features",
        "window": "window",
        "bigbird": "block",
        "sparse-transformer": "stride",
        "lsh": "cluster_size",
        "linformer": "projections",
        "nystrom": "landmarks",
    }.get(name)
    label = f"{name}-{method[knob]}" if knob else name
    if name == "i-clustered" and method.get("topk") != 32:
        label += f":k={method['topk']}"
    if name in ("clustered", "i-clustered"):  # the paper's clustering has no Euclidean step (a record without one: 0)
        recorded = approx.get_method(name).config_class.recorded_options(
            {k: v for k, v in method.items() if k != "name"}
        )
        if recorded.get("refine", 0) != 0:
            label += f":refine={recorded['refine']}"
    return label


def load_results(folder: str | Path) -> dict[str, dict[str, Any]]:
    """Task -> the recipe's record, for every ``clustered_table_<task>.json`` in ``folder``."""
    out = {}
    for path in sorted(Path(folder).glob(RESULT_GLOB)):
        record = json.loads(path.read_text())
        out[record["task"]] = record
    return out


def _scores(record: dict[str, Any]) -> dict[str, float]:
    """Method label -> primary metric (0-100), ``full`` from the reference metrics."""
    metric = PRIMARY_METRIC[record["task"]]
    first = record["results"][0]
    scores = {"full": first["reference_metrics"][metric]}
    for r in record["results"]:
        scores[method_label(r["method"])] = r["metrics"][metric]
    return scores


def _exact_shares(record: dict[str, Any]) -> dict[str, float | None]:
    """Method label -> the share of layer inputs on which its attention equalled exact attention's
    (``fidelity.exact_inputs``; None where the result predates the count)."""
    return {
        method_label(r["method"]): (r.get("fidelity", {}).get("exact_inputs") or {}).get("share")
        for r in record["results"]
    }


def _drop(full: float, other: float) -> float:
    """Relative drop below full (negative when better); NaN when undefined."""
    if full is None or other is None or math.isnan(full) or math.isnan(other) or full == 0:
        return math.nan
    return (full - other) / abs(full)


def pattern_checks(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One check per task and clustered variant: what the paper shows, what we measure, and whether they agree."""
    checks = []
    for task in TASK_ORDER:
        if task not in results:
            continue
        ours = _scores(results[task])
        paper = {m: PAPER[m][task] for m in PAPER}
        i_drop = _drop(ours["full"], ours.get("i-clustered-25"))
        checks.append(
            {
                "task": task,
                "method": "i-clustered-25",
                "expected": f"within {WITHIN:.0%} of full",
                "relative_drop": i_drop,
                "paper_relative_drop": _drop(paper["full"], paper["i-clustered-25"]),
                "agrees": not math.isnan(i_drop) and i_drop <= WITHIN,
            }
        )
        c_drop = _drop(ours["full"], ours.get("clustered-25"))
        paper_drop = _drop(paper["full"], paper["clustered-25"])
        paper_worse = paper_drop > CLEARLY_WORSE
        checks.append(
            {
                "task": task,
                "method": "clustered-25",
                "expected": f"{'more' if paper_worse else 'not more'} than {CLEARLY_WORSE:.0%} below full",
                "relative_drop": c_drop,
                "paper_relative_drop": paper_drop,
                "agrees": not math.isnan(c_drop) and (c_drop > CLEARLY_WORSE) == paper_worse,
            }
        )
    return checks


# modules that moved after some records were written (the library/lab separation): a record's text is shown with the
# names a reader can import today; the records themselves keep what their run wrote
MOVED = {"approx.tasks.": "approx.harness.tasks."}


def _current_names(text: str) -> str:
    for old, new in MOVED.items():
        text = text.replace(old, new)
    return text


def _relative(drop: float) -> str:
    return f"{abs(drop):.1%} {'below' if drop >= 0 else 'above'} full"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _where(record: dict) -> str:
    """What the record ran on: "CPU", or the GPU's name (older records: "GPU")."""
    device = str(record.get("device") or record["results"][0].get("provenance", {}).get("device", "cpu"))
    if not device.startswith("cuda"):
        return "CPU"
    return record["provenance"].get("accelerator") or "GPU"


def _short_commit(commit: str | None) -> str:
    if not commit:
        return "unknown"
    return commit[:12] + ("+dirty" if commit.endswith("+dirty") else "")


# a cell whose method ran exact attention on at least this share of the task's layer inputs is marked
MOSTLY_EXACT = 0.5


def _cell(value: float | None, paper: float | None, flag: bool, exact: float | None = None) -> str:
    ours = "-" if value is None else ("nan" if math.isnan(value) else f"{value:.1f}")
    ours += " °" if exact is not None and exact >= MOSTLY_EXACT else ""
    text = ours if paper is None else f"{ours} ({100 * paper:.1f})"
    return f"**{text}** ⚠" if flag else text


def _share_table(tasks: list[str], labels: list[str], shares: dict[str, dict[str, float | None]]) -> list[str]:
    """The share of layer inputs each method ran exact attention on, per task (none when no result has the count)."""
    if not any(v is not None for t in tasks for v in shares[t].values()):
        return []
    rows = ["| attention | " + " | ".join(TASK_NAMES[t] for t in tasks) + " |", "|" + " --- |" * (len(tasks) + 1)]
    for label in labels[1:]:  # full attention is exact by definition
        cells = [shares[t].get(label) for t in tasks]
        rows.append(f"| {label} | " + " | ".join("n/r" if v is None else f"{v:.0%}" for v in cells) + " |")
    return [
        "",
        f"° the method ran exact attention on at least {MOSTLY_EXACT:.0%} of the task's layer inputs (those within "
        "its budget: no more tokens than clusters, a window or pattern covering every pair, a short-input fallback), "
        "so the cell is mostly the fine-tuned model's own score. The share of (layer, input) pairs on which each "
        "method's attention output equalled exact attention's (`fidelity.exact_inputs`; n/r: not recorded, the "
        "result predates the count):",
        "",
        *rows,
    ]


def markdown_table(results: dict[str, dict[str, Any]]) -> str:
    """Our numbers with the paper's in brackets; ⚠ marks where our pattern differs from the paper's."""
    if not results:
        return "No results: run `python recipes/clustered_table.py` first."
    tasks = [t for t in TASK_ORDER if t in results]
    scores = {t: _scores(results[t]) for t in tasks}
    shares = {t: _exact_shares(results[t]) for t in tasks}
    checks = pattern_checks(results)
    flagged = {(c["task"], c["method"]) for c in checks if not c["agrees"]}
    labels: list[str] = ["full", "clustered-25", "i-clustered-25"]
    for t in tasks:
        labels += [m for m in scores[t] if m not in labels]
    head = "| attention | " + " | ".join(f"{TASK_NAMES[t]} ({PRIMARY_METRIC[t]})" for t in tasks) + " |"
    rows = [head, "|" + " --- |" * (len(tasks) + 1)]
    for label in labels:
        cells = [
            _cell(scores[t].get(label), PAPER.get(label, {}).get(t), (t, label) in flagged, shares[t].get(label))
            for t in tasks
        ]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    notes = []
    for c in checks:
        if c["agrees"]:
            continue
        if math.isnan(c["relative_drop"]):
            full = _scores(results[c["task"]])["full"]
            ours = f"undefined: full attention scores {full:.1f}, so there is nothing to lose"
        else:
            ours = _relative(c["relative_drop"])
        notes.append(
            f"- ⚠ {TASK_NAMES[c['task']]}, {c['method']}: the paper's pattern is {c['expected']} (the paper's is "
            f"{_relative(c['paper_relative_drop'])}); ours is {ours}."
        )
    agree = sum(c["agrees"] for c in checks)
    lines = [
        "\n".join(rows),
        "",
        f"Cells: ours (paper), metric × 100. Paper: {PAPER_SOURCE}. Pattern checks (i-clustered-25 within "
        f"{WITHIN:.0%} of full; clustered-25 more than {CLEARLY_WORSE:.0%} below full exactly where the paper's "
        f"is): {agree} of {len(checks)} agree.",
    ]
    missing = [TASK_NAMES[t] for t in TASK_ORDER if t not in results]
    if missing:
        lines[-1] += f" Paper tasks without a result here: {', '.join(missing)}."
    if notes:
        lines += ["", *notes]
    lines += _share_table(tasks, labels, shares)
    lines += ["", "How each column was made:", ""]
    for t in tasks:
        r = results[t]
        first = r["results"][0]
        prov = r["provenance"]
        w = r["wall_seconds"]
        steps = [c.get("settings", {}).get("steps") for c in r["checkpoints"] if c.get("settings")]
        made = f"{len(steps)} checkpoint(s), {'+'.join(map(str, steps))} steps" if steps else "hub checkpoint"
        made += f" (`--profile {r['profile']}`)" if r.get("profile") else ""
        lines.append(
            f"- {TASK_NAMES[t]}: {_current_names(r['protocol'])}; {first['examples']} examples; {made}; {_where(r)} wall time "
            f"fine-tuning {_duration(w['finetune'])}, evaluation {_duration(w['evaluate'])} "
            f"(commit `{_short_commit(prov.get('git_commit'))}`, {prov.get('date_utc', '?')})"
            + "".join(
                f"; {', '.join(x['methods'])} evaluated again in {_duration(x['wall_seconds'])} (`--methods`, commit "
                f"`{_short_commit(x['provenance'].get('git_commit'))}`, {x['provenance'].get('date_utc', '?')})"
                for x in r.get("reruns", [])
            )
            + "."
        )
    return "\n".join(lines)
