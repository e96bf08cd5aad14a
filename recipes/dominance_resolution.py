"""Recipe: are the uniform settings that issue #20's tuned models do not dominate better than them, or tied with them
at the evaluation's resolution?

Issue #20 asks that on every clustered-table task the tuned models' Pareto front dominate every uniform setting's
(cost no higher, metric no lower). ``recipes/autotune_pareto.py`` counts that strictly, on the evaluation examples as
they are, and leaves a few uniform settings over (docs/autotune.md). For each of them (:data:`CASES`), this recipe
takes the best tuned model of the same search that costs no more (the record's ``best_tuned_at_cost``), rebuilds it
from the record's per-layer (and per-head) choices, evaluates it and the uniform setting again on the same examples
with the same checkpoints (each half with its own, for a cross-fitted task), checks that both reproduce the record's
metrics, and gives the paired bootstrap interval of the tuned model's metric minus the uniform setting's
(:func:`approx.harness.resampling.paired_interval`, over the evaluation examples). An interval that holds 0 says these
examples cannot tell the two apart at that level; one entirely below 0 says the uniform setting is better.

    python recipes/dominance_resolution.py --threads 2             # every case (about 10 minutes on 2 threads)
    python recipes/dominance_resolution.py --report                # the table from the committed JSON

Needs the records' checkpoints in runs/checkpoints, or the folder --checkpoints names (the autotune recipe fine-tunes
them; this recipe never does): each is found by its folder name, the records' paths being where they were made.
Writes ``recipes/results/dominance_resolution.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shared import CHECKPOINTS, RESULTS, ROOT, write_json  # noqa: E402

import approx  # noqa: E402
from approx.harness.argcheck import (
    at_least,  # noqa: E402
    run_script,
)
from approx.harness.provenance import provenance  # noqa: E402
from approx.harness.resampling import interval_text, level_label, paired_interval  # noqa: E402
from approx.harness.spec import short_label  # noqa: E402
from approx.harness.tasks import get_task  # noqa: E402
from approx.integration import checkpoint_heads, load_pretrained  # noqa: E402

OUTPUT = RESULTS / "dominance_resolution.json"
# (record, task, convention, uniform setting): what issue #20's count leaves undominated (docs/autotune.md): every
# leftover of one search per task and convention (STS-B's with heads, SST-2's without, whose leftovers are fewest and
# nearest), and SQuAD's in its two main searches (KL targets, score targets), each leftover that some tuned model of
# the search costs no more than (the score search's uniform linear attention, at 0.189, is cheaper than all of its
# tuned models)
CASES = [
    ("autotune_pareto.json", "squad", "flops", "efficient"),
    ("autotune_pareto.json", "squad", "flops", "monarch"),
    ("autotune_pareto.json", "squad", "matmul", "i-clustered:refine=0"),
    ("autotune_pareto_squad_score.json", "squad", "flops", "efficient"),
    ("autotune_pareto_squad_score.json", "squad", "matmul", "i-clustered:clusters=100,refine=0"),
    ("autotune_pareto_glue_heads.json", "stsb", "flops", "bigbird:block=16,random_blocks=1,full_fallback=False"),
    ("autotune_pareto_glue_heads.json", "stsb", "flops", "i-clustered:refine=0"),
    ("autotune_pareto_glue_heads.json", "stsb", "flops", "nystrom"),
    ("autotune_pareto.json", "sst2", "matmul", "clustered:refine=0"),
    ("autotune_pareto.json", "sst2", "matmul", "sparse-transformer:stride=32,heads=union"),
]
COST_FIELD = {"flops": "flops_vs_full", "matmul": "matmul_vs_softmax_model"}
RESAMPLES, LEVEL, SEED = 10000, 0.95, 0
TOLERANCE = 1e-6  # a re-evaluation must reproduce the record's metric to this (absolute, in the metric's units)


def _rows(record: dict[str, Any], task: str, convention: str, setting: str):
    """The uniform row named ``setting`` and the best tuned row of ``convention``'s search that costs no more."""
    rec = record["tasks"][task]
    metric, field = rec["metric"], COST_FIELD[convention]
    uniform = [u for u in rec["uniform"] if short_label(u["method"]) == setting]
    if len(uniform) != 1:
        names = ", ".join(short_label(u["method"]) for u in rec["uniform"])
        raise ValueError(f"{task}: {len(uniform)} uniform rows named {setting!r}; the record has {names}")
    u = uniform[0]
    cost = u["fidelity"]["cost"][field]
    cheaper = [
        r for r in rec["tuned"] if r["autotune"]["cost"] == convention and r["fidelity"]["cost"][field] <= cost + 1e-12
    ]
    if not cheaper:
        raise ValueError(f"{task} {convention}: no tuned model costs as little as {setting} ({cost:.3f})")
    best = max(cheaper, key=lambda r: (r["metrics"][metric], -r["fidelity"]["cost"][field]))
    return rec, u, best


def _parts(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A result's halves (a cross-fitted one) or itself."""
    return row.get("halves") or [row]


def _recorded(name: str, options: dict[str, Any]):
    """The config a record describes: an option it lacks means what it meant when the record was written
    (``MethodConfig.from_record``: e.g. clustering's ``refine``, absent before it existed, is 0), not today's
    default."""
    return approx.get_method(name).config_class.from_record({k: v for k, v in options.items() if k != "name"})


def _tuned_layers(model, choices: list[dict[str, Any]]) -> dict[int, Any]:
    """The layers of a tuned model from the record's ``tuned_layers`` (method, options and heads per layer)."""
    layers = {}
    for c in choices:
        options = dataclasses.asdict(_recorded(c["method"], c["config"]))
        approx.patch(model, c["method"], layers=[c["layer"]], on_heads=c.get("heads"), **options)
        layers[c["layer"]] = approx.patched_layers(model)[c["layer"]]
        approx.unpatch(model)
    return layers


def _config(method: dict[str, Any]):
    return _recorded(method["name"], method)


def run_case(case: tuple[str, str, str, str], args) -> dict[str, Any]:
    name, task, convention, setting = case
    record = json.loads((RESULTS / name).read_text())
    rec, u_row, t_row = _rows(record, task, convention, setting)
    metric = rec["metric"]
    spec = get_task(task)
    t_parts, u_parts = _parts(t_row), _parts(u_row)
    if [p["split"] for p in t_parts] != [p["split"] for p in u_parts]:
        raise ValueError(f"{task}: the tuned and uniform rows were scored on other splits")
    examples, tuned, uniform, reproduced, mode = [], [], [], [], None
    start = time.perf_counter()
    for tp, up in zip(t_parts, u_parts, strict=True):
        if tp["model"] != up["model"]:
            raise ValueError(f"{task} {tp['split']}: the tuned and uniform rows ran other checkpoints")
        # the records name the checkpoint where it was when they were made (another checkout, /tmp): its folder name
        # under --checkpoints, where the autotune recipe caches it, else that path
        folder = str(Path(args.checkpoints) / Path(tp["model"]).name)
        if not Path(folder).is_dir():
            folder = tp["model"]
        if not Path(folder).is_dir():
            raise FileNotFoundError(
                f"{task} {tp['split']}: checkpoint {Path(tp['model']).name} is not cached in {args.checkpoints} (nor at "
                f"{tp['model']}, where the record was made): run recipes/autotune_pareto.py first, or give --checkpoints"
            )
        model, tokenizer = load_pretrained(folder, task=checkpoint_heads(folder)[0], progress=False)
        layers = _tuned_layers(model, tp["tuned_layers"])
        results = approx.evaluate(
            model, task, [layers, _config(up["method"])], tokenizer=tokenizer, split=tp["split"],
            limit=tp.get("limit"), max_length=tp["max_length"], batch_size=tp["batch_size"], predictions=True,
            resamples=0, warmup=False, progress=not args.quiet, data_dir=args.data_dir,
        )  # fmt: skip
        mode = results[0]["mode"]
        examples += spec.load(tp["split"], data_dir=args.data_dir, limit=tp.get("limit"))[0]
        for r, row, out in ((results[0], tp, tuned), (results[1], up, uniform)):
            out += r["predictions"]
            reproduced.append(
                {
                    "split": tp["split"],
                    "which": "tuned" if out is tuned else "uniform",
                    "record": row["metrics"][metric],
                    "now": r["metrics"][metric],
                }
            )
    t_value = spec.score(examples, tuned, mode)[metric]
    u_value = spec.score(examples, uniform, mode)[metric]
    interval = paired_interval(spec, mode, examples, tuned, uniform, resamples=RESAMPLES, level=LEVEL, seed=SEED)
    field = COST_FIELD[convention]
    return {
        "record": name,
        "task": task,
        "metric": metric,
        "convention": convention,
        "uniform": {"setting": setting, "cost": u_row["fidelity"]["cost"][field], "metric": u_value},
        "tuned": {
            "label": t_row["method"].get("label"),
            "layers": [short_label({"name": c["method"], **c["config"]}) for c in t_parts[0]["tuned_layers"]],
            "cost": t_row["fidelity"]["cost"][field],
            "metric": t_value,
        },
        "reproduced": reproduced,
        "all_reproduced": all(abs(x["record"] - x["now"]) <= TOLERANCE for x in reproduced),
        "interval": interval,
        "seconds": time.perf_counter() - start,
    }


def _verdict(entry: dict[str, float]) -> str:
    if entry["low"] > 0:
        return "tuned better"
    if entry["high"] < 0:
        return "uniform better"
    return "not told apart"


def markdown(payload: dict[str, Any]) -> str:
    level = payload["level"]
    rows = [
        f"| record | task | cost | uniform setting | its cost | its metric | best tuned at no more cost | tuned minus uniform "
        f"({level_label(level)} interval) | verdict | reproduced |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for c in payload["cases"]:
        entry = c["interval"]["metrics"][c["metric"]]
        rows.append(
            f"| {c['record']} | {c['task']} ({c['metric']}) | {c['convention']} | `{c['uniform']['setting']}` | "
            f"{c['uniform']['cost']:.3f} | {c['uniform']['metric']:.2f} | {c['tuned']['metric']:.2f} at "
            f"{c['tuned']['cost']:.3f} | {interval_text(entry)} | {_verdict(entry)} | "
            f"{'yes' if c['all_reproduced'] else 'NO'} |"
        )
    p = payload["provenance"]
    rows += [
        "",
        f"Paired bootstrap over the evaluation examples ({payload['resamples']} resamples, seed {payload['seed']}; "
        "`approx.harness.resampling`), each pair evaluated again side by side on the record's checkpoints and "
        "examples (`python recipes/dominance_resolution.py"
        f"{' --threads ' + str(p.get('torch_threads')) if p.get('torch_threads') else ''}`; commit "
        f"`{str(p.get('git_commit'))[:12]}`, {p.get('date_utc', '')}, {payload['seconds'] / 60:.0f} min).",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=at_least(1), help="torch CPU threads")
    p.add_argument("--data-dir", help="data folder (default: $APPROX_DATA_DIR, then ../shared/data)")
    p.add_argument("--report", action="store_true", help="print the table from the committed JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument(
        "--checkpoints", default=str(CHECKPOINTS), help="the cached checkpoints' folder (default runs/checkpoints)"
    )
    p.add_argument("--output", default=str(OUTPUT), help=f"JSON to write (default {OUTPUT.relative_to(ROOT)})")
    args = p.parse_args(argv)
    if args.report:
        print(markdown(json.loads(Path(args.output).read_text())))
        return 0
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    cases = []
    for case in CASES:
        print(f"{case[1]} {case[2]}: {case[3]}", file=sys.stderr)
        cases.append(run_case(case, args))
    payload = {
        "recipe": "recipes/dominance_resolution.py",
        "resamples": RESAMPLES,
        "level": LEVEL,
        "seed": SEED,
        "cases": cases,
        "seconds": time.perf_counter() - start,
        "provenance": provenance(seed=SEED, device="cpu"),
    }
    write_json(Path(args.output), payload)
    print(markdown(payload))
    return 0 if all(c["all_reproduced"] for c in cases) else 1


if __name__ == "__main__":
    run_script(main)
