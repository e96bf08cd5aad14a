"""recipes/long_inputs.py: the best point per method and length, the targets, the memory exponent and the
figure, on hand-made results whose answers are known."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from approx.harness.spec import short_label

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


@pytest.fixture(scope="module")
def recipe():
    sys.path.insert(0, str(RECIPES))
    spec = importlib.util.spec_from_file_location("long_inputs", RECIPES / "long_inputs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def result(task, n, method, value, exact, seconds, exact_seconds, mib=None, exact_mib=None, **options):
    metric = "f1" if task.startswith("squad") else "bits_per_token"
    return {
        "task": task,
        "max_length": n,
        "method": {"name": method, **options},
        "metrics": {metric: value},
        "reference_metrics": {metric: exact},
        "fidelity": {
            "speedup": exact_seconds / seconds,
            "seconds_per_example": seconds,
            "reference_seconds_per_example": exact_seconds,
            "peak_memory_mib_per_input": mib,
            "reference_peak_memory_mib_per_input": exact_mib,
        },
    }


def test_best_point_is_the_fastest_budget_that_keeps_the_quality(recipe):
    results = [
        # 4096: clusters=25 is fastest but loses F1; clusters=100 keeps 99.5 % at 1.6x: target met
        result("squad-doc", 4096, "clustered", 50.0, 80.0, 1.0, 2.0, clusters=25),
        result("squad-doc", 4096, "clustered", 79.6, 80.0, 1.25, 2.0, clusters=100),
        result("squad-doc", 4096, "clustered", 80.0, 80.0, 1.9, 2.0, clusters=400),
        # 8192: nothing keeps 99 %: the best-kept budget is reported, target not met
        result("squad-doc", 8192, "favor", 60.0, 80.0, 1.0, 4.0, features=64),
        result("squad-doc", 8192, "favor", 70.0, 80.0, 2.0, 4.0, features=256),
        # bits per token: lower is better; within 2 % of exact (2.0 -> at most 2.04)
        result("wikitext2", 4096, "favor", 2.03, 2.0, 1.0, 1.5, features=64),
        result("wikitext2", 4096, "favor", 2.5, 2.0, 0.5, 1.5, features=16),
    ]
    best = {(b["task"], b["length"], b["method"].split(":")[0]): b for b in recipe.best_points(results)}
    b = best[("squad-doc", 4096, "clustered")]
    assert b["method"] == short_label({"name": "clustered", "clusters": 100})
    assert b["kept"] == pytest.approx(79.6 / 80) and b["speedup"] == pytest.approx(1.6)
    assert b["quality_floor_met"] and b["target_met"] is True
    b = best[("squad-doc", 8192, "favor")]
    assert b["method"] == short_label({"name": "favor", "features": 256})
    assert b["kept"] == pytest.approx(70 / 80) and not b["quality_floor_met"] and b["target_met"] is False
    b = best[("wikitext2", 4096, "favor")]
    assert b["kept"] == pytest.approx(2.0 / 2.03) and b["target_met"] is True and b["speedup"] == pytest.approx(1.5)


def test_a_fast_point_that_misses_the_speed_target(recipe):
    results = [result("squad-doc", 8192, "clustered", 80.0, 80.0, 2.0, 4.0, clusters=100)]  # 2x < 2.5x
    (b,) = recipe.best_points(results)
    assert b["quality_floor_met"] and b["target_met"] is False


def test_a_reader_that_answers_nothing_is_not_judged(recipe):
    """Exact F1 below MIN_EXACT_F1: no "kept", no target met or missed, whatever the speed."""
    assert recipe.kept(result("squad-doc", 1024, "favor", 0.0, 0.0, 1, 1)) is None
    assert recipe.kept(result("squad-doc", 1024, "favor", 5.0, 3.0, 1, 1)) is None
    results = [result("squad-doc", 8192, "favor", 0.0, 0.0, 1.0, 5.0, features=64)]
    (b,) = recipe.best_points(results)
    assert b["kept"] is None and b["quality_judged"] is False and b["target_met"] is None
    assert "not judged" in recipe.markdown({"best": [b], "baselines": []})


def test_memory_exponent(recipe):
    results = [
        result("squad-doc", n, "favor", 1, 1, 1, 1, mib=3.0 * n, exact_mib=0.001 * n * n, features=64)
        for n in (1024, 2048, 4096)
    ]
    slopes = recipe.memory_growth(results)
    assert slopes["favor:features=64"] == pytest.approx(1.0) and slopes["exact (sdpa)"] == pytest.approx(2.0)
    assert math.isfinite(slopes["favor:features=64"])


def test_memory_exponent_from_allocations_when_every_result_has_them(recipe):
    """The allocator's peaks (evaluate(allocations=True)) are fitted instead of the peak-RSS deltas when every
    squad-doc result has them; one result without them: the deltas, for all."""
    results = [
        result("squad-doc", n, "favor", 1, 1, 1, 1, mib=0.0 + (n == 4096), exact_mib=1.0, features=64)
        for n in (1024, 2048, 4096)
    ]
    for r in results:
        n = r["max_length"]
        r["fidelity"].update(allocated_peak_mib_per_input=2.0 * n, reference_allocated_peak_mib_per_input=1e-3 * n * n)
    assert recipe.memory_measure(results) == "allocations"
    slopes = recipe.memory_growth(results)
    assert slopes["favor:features=64"] == pytest.approx(1.0) and slopes["exact (sdpa)"] == pytest.approx(2.0)
    results[1]["fidelity"]["reference_allocated_peak_mib_per_input"] = None  # exact attention's missing once
    assert recipe.memory_measure(results) == "peak"
    results[1]["fidelity"]["reference_allocated_peak_mib_per_input"] = 1e-3 * 2048**2
    results[0]["fidelity"]["allocated_peak_mib_per_input"] = None
    assert recipe.memory_measure(results) == "peak"
    assert recipe.memory_growth(results)["exact (sdpa)"] == pytest.approx(0.0)  # the deltas: 1 MiB throughout


def test_memory_target_judged_on_allocator_peaks_only(recipe):
    """Met when every exponent (exact attention's too) is at most LINEAR; NOT met naming the ones above it; not
    judged on peak-RSS deltas or without exponents."""
    results = [
        result("squad-doc", n, "favor", 1, 1, 1, 1, mib=0.0, exact_mib=0.0, features=64) for n in (1024, 2048, 4096)
    ]
    for r in results:
        n = r["max_length"]
        r["fidelity"].update(allocated_peak_mib_per_input=2.0 * n, reference_allocated_peak_mib_per_input=0.5 * n)
    record = {"memory_exponent": recipe.memory_growth(results), "memory_measure": recipe.memory_measure(results)}
    assert recipe.memory_target(record).endswith("met (b = 1.00 to 1.00)")
    for r in results:  # exact attention's peak quadratic: it is held to the target too (only eager is exempt)
        r["fidelity"]["reference_allocated_peak_mib_per_input"] = 1e-3 * r["max_length"] ** 2
    record = {"memory_exponent": recipe.memory_growth(results), "memory_measure": recipe.memory_measure(results)}
    assert recipe.memory_target(record).endswith("NOT met (`exact (sdpa)` 2.00)")
    assert "not judged" in recipe.memory_target({**record, "memory_measure": "peak"})
    assert "not judged" in recipe.memory_target({"memory_exponent": {}, "memory_measure": "allocations"})
    # on CUDA the plain peaks are the allocator's: judged
    assert "NOT met" in recipe.memory_target({**record, "memory_measure": "peak", "device": "cuda"})
    nan = {"memory_exponent": {"exact (sdpa)": 1.0, "favor": float("nan")}, "memory_measure": "allocations"}
    assert "NOT met (`favor` nan)" in recipe.memory_target(nan)


def test_only_squad_doc_pays_for_the_allocation_pass(recipe, monkeypatch):
    """On the CPU the squad-doc evaluation measures allocations (the memory fit reads it); its sliding baseline and
    wikitext2 do not (an untimed profiled pass each, for a figure nobody reads). On a GPU none does."""
    import argparse

    import approx

    calls = []
    monkeypatch.setattr(recipe, "evaluate_checkpoints", lambda task, *a, **kw: calls.append((task, kw)) or [])
    monkeypatch.setattr(approx, "evaluate", lambda path, task, *a, **kw: calls.append((task, kw)) or [])
    for device in ("cpu", "cuda"):
        calls.clear()
        args = argparse.Namespace(profile="cpu", questions=2, windows=1, methods=None, data_dir=None, quiet=True,
                                  seed=0, device=device)  # fmt: skip
        recipe.run_length(1024, args, [("squad", "validation")], "mlm")
        asked = {task: kw.get("allocations", False) for task, kw in calls}
        assert asked == {"squad-doc": device == "cpu", "squad-doc-sliding": False, "wikitext2": False}


def test_figure_and_table(recipe, tmp_path):
    results = [
        result("squad-doc", n, "clustered", 70.0, 80.0, 1.0, 2.0, clusters=c) for n in (1024, 2048) for c in (25, 100)
    ] + [result("wikitext2", 1024, "favor", 2.1, 2.0, 1.0, 1.5, features=64)]
    baseline = result("squad-doc-sliding", 1024, "full", 60.0, 60.0, 1.0, 1.0)
    record = {"results": results, "baselines": [baseline], "profile": "cpu", "device": "cpu"}
    record["best"] = recipe.best_points(results)
    recipe.figure(record, tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 10_000
    table = recipe.markdown(record)
    assert "squad-doc-sliding | 1024" in table and table.count("\n") == 2 + len(record["best"])


def test_update_refuses_results_made_with_other_settings(recipe, monkeypatch, tmp_path):
    """--update refuses, before any work, a file whose results came from another profile (other readers), device,
    seed, or number of questions or windows at a length this run reads too: the record names one of each (a run
    with --profile gpu --seed 3 --questions 5 had been merged beside another's rows, the record naming only its own
    readers). Other lengths may hold other numbers; a record naming what it read is compared on that."""
    import json

    def never(*args, **kwargs):
        raise AssertionError("worked before refusing")

    monkeypatch.setattr(recipe, "squad_checkpoints", never)
    monkeypatch.setattr(recipe, "mlm_checkpoint", never)
    path = tmp_path / "r.json"

    def held(examples=16, seed=0, **top):
        rows = []
        for task, n in (("squad-doc", 1024), ("squad-doc-sliding", 1024), ("wikitext2", 2048)):
            r = result(task, n, "full", 1, 1, 1, 1)
            r.update(examples=examples if task != "wikitext2" else 4, provenance={"seed": seed})
            rows.append(r)
        record = {"reader": "squad", "profile": "cpu", "device": "cpu", "results": rows, "runs": [], **top}
        path.write_text(json.dumps(record))

    argv = ["--lengths", "1024", "--update", "--quiet", "--profile", "cpu", "--device", "cpu", "--results", str(path)]
    some = ["--methods", "window"]  # (the file's "full" rows are kept beside this run's, so they are compared)
    held()
    for extra, said in (
        (["--profile", "gpu"], "profile 'cpu' \\(this run: 'gpu'\\)"),
        ([*some, "--seed", "3"], "seed 0 \\(this run: 3\\)"),
        ([*some, "--questions", "5"], "squad-doc at 1024 tokens: 16 examples \\(this run: 5\\)"),
    ):
        with pytest.raises(SystemExit, match=said):
            recipe.main([*argv, *extra])
    with pytest.raises(SystemExit, match="device 'cpu' \\(this run: 'cuda'\\)"):
        recipe.main([*argv, "--device", "cuda", "--tasks", "wikitext2"])
    with pytest.raises(SystemExit, match="wikitext2 at 2048 tokens: 4 examples \\(this run: 1\\)"):
        recipe.main([*argv, *some, "--tasks", "wikitext2", "--lengths", "2048", "--windows", "1"])
    for same in (
        [],
        ["--tasks", "wikitext2", "--lengths", "2048"],
        [*some, "--lengths", "2048", "--questions", "5"],  # (other lengths may hold other numbers)
        ["--questions", "5"],  # every row at 1024 made again: none kept there to compare
        ["--tasks", "wikitext2", "--lengths", "2048", "--windows", "1"],
    ):
        with pytest.raises(AssertionError, match="worked before refusing"):  # on to the work
            recipe.main([*argv, *same])
    # a record naming what it read is compared on that (here: every example at 1024 tokens)
    held(requested={"squad-doc": {"1024": None}})
    with pytest.raises(SystemExit, match="squad-doc at 1024 tokens: every examples \\(this run: 16\\)"):
        recipe.main([*argv, *some])
    # a length the profile does not size, without --questions / --windows: refused before any work
    with pytest.raises(SystemExit, match="give how many to read at 3000 \\(--questions\\), 3000 \\(--windows\\)"):
        recipe.main([*argv, "--lengths", "3000"])


def test_update_keeps_what_the_run_does_not_redo(recipe):
    """--update: a result is replaced only when this run makes it again (its task, its length, its method when
    --methods names some); the sliding baseline is redone with squad-doc whatever the methods."""
    lsh = result("squad-doc", 2048, "lsh", 1, 1, 1, 1)
    base = result("squad-doc-sliding", 2048, "full", 1, 1, 1, 1)
    tasks = {"squad-doc", "squad-doc-sliding"}
    assert recipe.redone(lsh, tasks, [2048], None) and recipe.redone(lsh, tasks, [2048], ["lsh"])
    assert not recipe.redone(lsh, tasks, [1024], ["lsh"])  # another length: kept
    assert not recipe.redone(lsh, tasks, [2048], ["window"])  # another method: kept
    assert not recipe.redone(lsh, {"wikitext2"}, [2048], None)  # another task: kept
    assert recipe.redone(base, tasks, [2048], ["window"]) and not recipe.redone(base, tasks, [4096], ["window"])


def test_a_run_whose_results_were_all_redone_is_no_longer_listed(recipe):
    """The runs kept beside merged results are those that made one of them (same command, same commit)."""

    def made(command, commit):
        r = result("wikitext2", 1024, "lsh", 1, 1, 1, 1)
        r["provenance"] = {"command": command, "git_commit": commit}
        return r

    runs = [{"provenance": {"command": c, "git_commit": g}} for c, g in (("a", "1"), ("a", "2"), ("b", "2"))]
    kept = recipe.made_by(runs, [made("a", "2"), made("b", "2"), made("b", "2")])
    assert [(r["provenance"]["command"], r["provenance"]["git_commit"]) for r in kept] == [("a", "2"), ("b", "2")]
    assert recipe.made_by(runs, []) == []
    # runs with ids (the run's start, in each of its results): the same command at the same commit twice
    first, second = ({"run": t, "provenance": {"command": "a", "git_commit": "1"}} for t in ("t1", "t2"))
    r = made("a", "1")
    r["provenance"]["run"] = "t2"
    assert recipe.made_by([first, second], [r]) == [second]


def test_merged_runs_are_drawn_on_one_time_scale(recipe):
    """Two runs timed exact attention at 1 s and 2 s per example: each run's times are scaled so that exact attention
    takes the median (1.5 s); a method 2x faster than exact in its run sits at 0.75 s whichever run it came from,
    and the sliding baseline goes with its squad-doc run."""

    def made(r, run):
        r["provenance"] = {"command": run, "git_commit": "c"}
        return r

    a = made(result("squad-doc", 1024, "lsh", 1, 1, 0.5, 1.0), "a")
    b = made(result("squad-doc", 1024, "window", 1, 1, 1.0, 2.0), "b")
    base = made(result("squad-doc-sliding", 1024, "full", 1, 1, 3.0, 3.0), "b")
    scales = recipe.time_scales([a, b], [base])
    for r in (a, b):
        key = (r["task"], 1024, ("a" if r is a else "b", "c"))
        assert r["fidelity"]["seconds_per_example"] * scales[key] == pytest.approx(0.75)
    assert scales[("squad-doc-sliding", 1024, ("b", "c"))] == pytest.approx(0.75)


def test_methods_by_name_and_the_question(recipe):
    """methods(task, names): the configurations of the named methods only; on squad-doc the window's question is
    global, on WikiText-2 it is not; every method family of the issue is in METHODS."""
    chosen = recipe.methods("squad-doc", ["window", "nystrom"])
    assert {c.method for c in chosen} == {"window", "nystrom"}
    assert all(c.question_global for c in chosen if c.method == "window")
    assert not any(c.question_global for c in recipe.methods("wikitext2", ["window"]))
    assert len(recipe.methods("wikitext2")) == sum(len(v) for v in recipe.METHODS.values())
    import approx

    families = {
        "bigbird",
        "sparse-transformer",
        "lsh",
        "linear",
        "efficient",
        "taylor",
        "linformer",
        "nystrom",
        "monarch",
    }
    assert families <= set(recipe.METHODS) <= set(approx.methods())


def test_the_long_reader_is_fine_tuned_from_the_clustered_tables_reader(recipe, monkeypatch, tmp_path):
    """--reader squad-doc: each fold's squad reader is fine-tuned again on squad-doc windows of the same training half
    with LONG_READER's settings, and that second checkpoint reads the other half; the record names both. Without a
    CUDA device it is refused before fine-tuning anything unless that checkpoint is cached (then any profile reads
    it)."""
    calls = []

    def ensure(base, task, train_split, settings, **kw):
        calls.append((Path(base).name, task, train_split, settings))
        record = {"settings": {**settings, "steps": 3}, "losses": [5.0, 2.0], "examples": 7}
        return tmp_path / f"{task}-{train_split.replace('/', '')}", record, False

    monkeypatch.setattr(recipe, "ensure_checkpoint", ensure)
    monkeypatch.setattr(recipe, "CHECKPOINTS", tmp_path / "checkpoints")
    monkeypatch.setattr(recipe.torch.cuda, "is_available", lambda: True)
    pairs, records = recipe.squad_checkpoints("gpu", False, None, "squad-doc")
    long = recipe.LONG_READER
    assert [c[1:3] for c in calls[::2]] == [("squad", "dev/0"), ("squad", "dev/1")]
    assert calls[1::2] == [("squad-dev0", "squad-doc", "dev/0", long), ("squad-dev1", "squad-doc", "dev/1", long)]
    assert pairs == [(str(tmp_path / "squad-doc-dev0"), "dev/1"), (str(tmp_path / "squad-doc-dev1"), "dev/0")]
    assert [e["trained_from"]["folder"] for e in records] == ["squad-dev0", "squad-dev1"]
    assert {(e["task"], e["first_loss"], e["last_loss"], e["examples"]) for e in records} == {
        ("squad-doc", 5.0, 2.0, 7)
    }
    calls.clear()
    assert recipe.squad_checkpoints("cpu", False, None)[0] == [(str(tmp_path / "squad-dev0"), "dev/1")]
    assert [c[1] for c in calls] == ["squad"]
    calls.clear()
    monkeypatch.setattr(recipe.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(recipe, "default_model", lambda: "the-base-model")
    with pytest.raises(SystemExit, match="on a CUDA device.*none is cached"):
        recipe.squad_checkpoints("cpu", False, None, "squad-doc")
    assert calls == []  # refused before fine-tuning even the base reader
    settings = {**recipe.base_settings("squad", "cpu"), **recipe.READER["cpu"]}
    base = recipe.checkpoint_key("the-base-model", "squad", "dev/0", settings)
    cached = recipe.CHECKPOINTS / recipe.checkpoint_key(base, "squad-doc", "dev/0", long)
    cached.mkdir(parents=True)
    (cached / "finetune.json").write_text("{}")
    assert recipe.squad_checkpoints("cpu", False, None, "squad-doc")[0] == [(str(tmp_path / "squad-doc-dev0"), "dev/1")]
    assert calls[1] == ("squad-dev0", "squad-doc", "dev/0", long)
    calls.clear()
    with pytest.raises(ValueError, match="squad, squad-doc"):
        recipe.squad_checkpoints("gpu", False, None, "long")
    assert calls == []


def test_a_short_run_caps_every_fine_tuning_and_caches_it_where_it_is_told(recipe, monkeypatch, tmp_path):
    """--max-steps, --train-limit and --checkpoints reach both readers' and the masked-LM model's fine-tuning (other
    settings, so other cache keys than the full runs'); a capped squad-doc reader is trained on the CPU too."""
    calls = []

    def ensure(base, task, train_split, settings, **kw):
        calls.append((task, settings, kw["root"]))
        return tmp_path / f"{task}-{train_split.replace('/', '')}", {"settings": settings}, False

    monkeypatch.setattr(recipe, "ensure_checkpoint", ensure)
    monkeypatch.setattr(recipe, "default_model", lambda: "the-base-model")
    monkeypatch.setattr(recipe.torch.cuda, "is_available", lambda: False)
    root = tmp_path / "short"
    recipe.squad_checkpoints("cpu", False, None, "squad-doc", root=root, max_steps=2, train_limit=8)
    recipe.mlm_checkpoint(False, None, root=root, max_steps=2, train_limit=8)
    assert [c[0] for c in calls] == ["squad", "squad-doc", "wikitext2"]
    assert all(c[2] == root and c[1]["max_steps"] == 2 and c[1]["limit"] == 8 for c in calls)
    assert calls[1][1] == {**recipe.LONG_READER, "max_steps": 2, "limit": 8}
    calls.clear()
    recipe.squad_checkpoints("cpu", False, None)  # no caps: the recipe's own settings, in runs/checkpoints
    assert calls[0][2] == recipe.CHECKPOINTS and "max_steps" not in calls[0][1]
    args = recipe.build_parser().parse_args(["--max-steps", "2", "--train-limit", "8", "--checkpoints", str(root)])
    assert (args.max_steps, args.train_limit, args.checkpoints) == (2, 8, root)


def test_update_refuses_to_merge_another_readers_results(recipe, monkeypatch, tmp_path):
    import json

    """Refused before any fine-tuning or evaluation; --reader squad-doc writes its own files by default."""

    def never(*args, **kwargs):
        raise AssertionError("worked before refusing")

    results = tmp_path / "r.json"
    results.write_text(json.dumps({"reader": "squad", "results": [], "runs": []}))
    monkeypatch.setattr(recipe, "squad_checkpoints", never)
    monkeypatch.setattr(recipe, "run_length", never)
    argv = ["--tasks", "squad-doc", "--lengths", "1024", "--update", "--quiet", "--profile", "gpu", "--device", "cpu"]
    with pytest.raises(SystemExit, match="'squad' reader, this run reads with 'squad-doc'"):
        recipe.main([*argv, "--reader", "squad-doc", "--results", str(results)])
    monkeypatch.setattr(recipe, "DOC_READER_OUTPUT", results)  # the default file of --reader squad-doc
    with pytest.raises(SystemExit, match=f"{results} holds"):
        recipe.main([*argv, "--reader", "squad-doc"])
    results.write_text(json.dumps({"reader": "squad-doc", "results": [], "runs": []}))
    monkeypatch.setattr(recipe, "OUTPUT", results)
    with pytest.raises(SystemExit, match="'squad-doc' reader, this run reads with 'squad'"):
        recipe.main(argv)
    # a short run's checkpoints (--max-steps, --train-limit) are others than the full run's: not merged either way
    # (a 1-step reader's rows had joined the committed ones, and its folder replaced theirs in "checkpoints")
    results.write_text(json.dumps({"reader": "squad", "results": [], "runs": []}))
    with pytest.raises(SystemExit, match=r"caps \{\}, this run's are \{'max_steps': 1\}"):
        recipe.main([*argv, "--max-steps", "1"])
    results.write_text(json.dumps({"reader": "squad", "fine_tuning_caps": {"max_steps": 1}, "results": [], "runs": []}))
    with pytest.raises(SystemExit, match=r"caps \{'max_steps': 1\}, this run's are \{\}"):
        recipe.main([*argv, "--tasks", "wikitext2"])
    # a file without squad-doc results (a wikitext2 run's: reader null) takes either reader's
    results.write_text(json.dumps({"reader": None, "results": [], "runs": []}))
    with pytest.raises(AssertionError, match="worked before refusing"):  # (not refused: on to the work)
        recipe.main([*argv, "--reader", "squad-doc", "--results", str(results)])
