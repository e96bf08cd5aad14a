"""Fine-tuning with accelerate on tiny checkpoints and synthetic data: learning, saving, resuming, patched
models, cross-fitting halves and SQuAD's training targets."""

import json
import re
import shutil
import warnings

import pytest
import torch
from evalfixtures import write_checkpoint

import approx
from approx.harness.cli import main
from approx.harness.finetune import _check_no_unfinished_run, finetune
from approx.harness.tasks import get_task
from approx.harness.tasks.base import cross_fit_half


def _run(base, data, out, **kw):
    opts = dict(
        train_split="dev/0", data_dir=str(data), source="local", batch_size=4, learning_rate=1e-3, progress=False
    )
    opts.update(kw)
    return finetune(base, opts.pop("task", "rte"), output_dir=out, **opts)


def test_finetune_learns_saves_and_evaluates(base_model, fixture_dir, tmp_path):
    rec = _run(base_model, fixture_dir, tmp_path / "ft", max_steps=40, warmup=0.0, eval_split="dev/1")
    losses = rec["losses"]
    assert len(losses) == 40 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "ft")
    assert model.config.id2label == {0: "entailment", 1: "not_entailment"}
    (ev,) = rec["evaluation"]
    assert ev["split"] == "dev/1" and ev["examples"] == 8 and ev["method"]["name"] == "full"
    assert ev["model"] == str(tmp_path / "ft")  # the fine-tuned model, not the one it started from
    assert json.loads((tmp_path / "ft" / "finetune.json").read_text())["settings"]["steps"] == 40
    # the saved checkpoint gives the same metrics through the harness
    (again,) = approx.evaluate(
        str(tmp_path / "ft"), "rte", ["full"], split="dev/1", data_dir=str(fixture_dir), source="local", progress=False
    )
    assert again["reference_metrics"] == ev["reference_metrics"]


def test_the_record_says_how_many_epochs_max_steps_ran_and_the_limit(base_model, fixture_dir, tmp_path):
    """max_steps sets the steps in place of the epochs (as transformers' Trainer): the record had said "epochs": 1
    beside the 6 steps that were 3 epochs of 8 examples, and had no limit."""
    rec = _run(base_model, fixture_dir, tmp_path / "ft", epochs=1, max_steps=6, limit=8, warmup=0.0)
    assert len(rec["losses"]) == 6 and rec["limit"] == 8
    assert rec["settings"]["max_steps"] == 6 and rec["settings"]["steps"] == 6 and rec["settings"]["epochs_run"] == 3
    rec = _run(base_model, fixture_dir, tmp_path / "ft2", epochs=0.5, limit=8, warmup=0.0)
    assert rec["settings"]["steps"] == 1 and rec["settings"]["epochs_run"] == 0.5 and rec["limit"] == 8


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 runs on a GPU")
def test_fp16_on_a_cpu_is_refused(base_model, fixture_dir, tmp_path, monkeypatch):
    """accelerate turns fp16 off on a CPU without a word: the run was float32, recorded as fp16."""
    with pytest.raises(ValueError, match="fp16 .* needs a GPU"):
        _run(base_model, fixture_dir, tmp_path / "a", max_steps=1, mixed_precision="fp16")


def test_accelerate_trains_on_the_cpu_without_cuda_or_when_told(monkeypatch):
    """The fp16 refusal follows accelerate's own choice of the CPU: no CUDA, or ACCELERATE_USE_CPU (accelerate
    launch --cpu), where fp16 is dropped without a word even on a GPU machine."""
    from approx.harness.finetune import _trains_on_cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    assert not _trains_on_cpu()
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    assert _trains_on_cpu()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    assert _trains_on_cpu()


def test_a_head_of_other_sizes_is_refused_in_one_line_and_a_span_head_is_sized_for_spans(
    base_model, fixture_dir, tmp_path, capsys
):
    """A checkpoint whose classification head has another label count had crashed with transformers' traceback;
    on SQuAD the config's label count had sized the fresh span head (3 outputs, then a failed unpacking)."""
    three = write_checkpoint(tmp_path / "three", "sequence-classification", num_labels=3)
    capsys.readouterr()  # writing it may show a progress bar
    argv = ["finetune", "--model", str(three), "--task", "rte", "--data-dir", str(fixture_dir), "--train-split",
            "dev/0", "--max-steps", "1", "--output-dir", str(tmp_path / "b"), "--quiet"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sequence-classification weights have other sizes" in err
    assert "num_labels=2" in err
    rec = _run(str(three), fixture_dir, tmp_path / "qa", task="squad", max_steps=1, limit=2)
    assert len(rec["losses"]) == 1 and rec["head"]["fresh"]


def test_a_partial_run_records_the_epochs_so_far_and_no_data_is_refused(base_model, fixture_dir, tmp_path):
    rec = _run(base_model, fixture_dir, tmp_path / "p", max_steps=6, limit=8, stop_after=2, warmup=0.0)
    assert rec["partial"] and rec["settings"]["epochs_run"] == 1 and rec["settings"]["steps"] == 6
    empty = tmp_path / "data"
    shutil.copytree(fixture_dir, empty)
    rows = (empty / "glue/RTE/dev.tsv").read_text().splitlines()
    (empty / "glue/RTE/dev.tsv").write_text("\n".join(rows[:2]) + "\n")  # one example: one half of it is empty
    half = next(h for h in ("dev/0", "dev/1") if not cross_fit_half(get_task("rte").load("dev", data_dir=str(empty),
                                                                              source="local")[0], int(h[-1])))  # fmt: skip
    with pytest.raises(ValueError, match=f"rte {half}: no examples to train on"):
        _run(base_model, empty, tmp_path / "e", max_steps=1, train_split=half)


def test_resume_continues_exactly_where_it_stopped(base_model, fixture_dir, tmp_path):
    _run(base_model, fixture_dir, tmp_path / "a", max_steps=6)
    stopped = _run(base_model, fixture_dir, tmp_path / "b", max_steps=6, stop_after=4)
    assert stopped["stopped_at"] == stopped["step"] == 4 and stopped["partial"]
    record = json.loads((tmp_path / "b" / "finetune.json").read_text())
    assert record["partial"] and record["step"] == 4 and len(record["losses"]) == 4
    _run(base_model, fixture_dir, tmp_path / "b", max_steps=6, resume=True)
    assert not json.loads((tmp_path / "b" / "finetune.json").read_text())["partial"]
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        _run(base_model, fixture_dir, tmp_path / "c", max_steps=2, resume=True)
    _run(base_model, fixture_dir, tmp_path / "b", max_steps=2)  # a finished run's folder: started afresh, as asked


def test_a_model_no_run_wrote_is_not_written_over(base_model, fixture_dir, tmp_path):
    """The model being fine-tuned as its own output folder, or a folder holding a checkpoint without finetune.json,
    is refused before anything loads (a question-answering model had been replaced by an RTE classifier without a
    word); nothing in it changes."""
    copy = tmp_path / "copy"
    shutil.copytree(base_model, copy)
    before = {f.name: f.read_bytes() for f in copy.iterdir() if f.is_file()}
    with pytest.raises(ValueError, match="is the model being fine-tuned"):
        _run(str(copy), fixture_dir, copy, max_steps=1)
    with pytest.raises(ValueError, match="holds a model that no fine-tuning run wrote"):
        _run(base_model, fixture_dir, copy, max_steps=1)
    assert {f.name: f.read_bytes() for f in copy.iterdir() if f.is_file()} == before


def test_starting_afresh_over_a_run_that_did_not_finish_is_refused(base_model, fixture_dir, tmp_path):
    """A run stopped by ``stop_after``, or killed (its training state there, no record of it finishing), would have
    been overwritten by a run started without ``resume``, its steps lost without a word: refused, naming resume."""
    _run(base_model, fixture_dir, tmp_path / "s", max_steps=3, stop_after=1)
    before = (tmp_path / "s" / "finetune.json").read_text()
    with pytest.raises(ValueError, match=r"holds a run that did not finish .*at step 1.*resume=True \(--resume\)"):
        _run(base_model, fixture_dir, tmp_path / "s", max_steps=3)
    assert (tmp_path / "s" / "finetune.json").read_text() == before  # untouched
    (tmp_path / "s" / "finetune.json").unlink()  # killed before any record: the training state alone
    with pytest.raises(ValueError, match="did not finish"):
        _run(base_model, fixture_dir, tmp_path / "s", max_steps=3)
    assert _run(base_model, fixture_dir, tmp_path / "s", max_steps=3, resume=True)["step"] == 3
    # a run started afresh in a finished run's folder and killed: the finished record is the earlier run's, not its
    # end (a reviewer's sequence, which the first version let through)

    def killed(step, model):
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run(base_model, fixture_dir, tmp_path / "s", max_steps=3, checkpoint_every=1, callback=killed)
    assert not json.loads((tmp_path / "s" / "finetune.json").read_text())["partial"]  # (the earlier run's)
    with pytest.raises(ValueError, match="did not finish .*at step"):
        _run(base_model, fixture_dir, tmp_path / "s", max_steps=3)
    for bad in ("{not json", "{}", '{"step": 1}'):  # not JSON; JSON without the record's fields
        (tmp_path / "s" / "checkpoint" / "progress.json").write_text(bad)
        for resume in (False, True):
            with pytest.raises(ValueError, match=r"progress.json: not a progress record of a run"):
                _run(base_model, fixture_dir, tmp_path / "s", max_steps=3, resume=resume)
    # a run from before run ids: its checkpoint and record carry none, or "" once resumed and finished: finished
    _run(base_model, fixture_dir, tmp_path / "old", max_steps=2)
    progress = tmp_path / "old" / "checkpoint" / "progress.json"
    progress.write_text(json.dumps({k: v for k, v in json.loads(progress.read_text()).items() if k != "run_id"}))
    record = tmp_path / "old" / "finetune.json"
    for legacy in (None, ""):
        done = {k: v for k, v in json.loads(record.read_text()).items() if k != "run_id"}
        record.write_text(json.dumps(done if legacy is None else {**done, "run_id": legacy}))
        _check_no_unfinished_run(tmp_path / "old", tmp_path / "old" / "checkpoint")  # no refusal


def test_evaluating_on_the_training_examples_is_said(base_model, fixture_dir, tmp_path):
    with pytest.warns(UserWarning, match="evaluates on dev, which shares examples with the training split dev/0"):
        _run(base_model, fixture_dir, tmp_path / "o", max_steps=1, eval_split="dev")


@pytest.mark.parametrize(
    "change, words",
    [
        ({"learning_rate": 5e-5}, "learning_rate: started with 0.001, now 5e-05"),  # the saved schedule would win
        ({"task": "mrpc"}, "task: started with 'rte', now 'mrpc'"),
        ({"batch_size": 2}, "batch_size: started with 4, now 2"),
        ({"max_steps": 1}, "max_steps: started with 3, now 1"),
        ({"limit": 8}, "limit: started with None, now 8"),
        ({"method": "favor"}, "method: started with None, now {'name': 'favor'"),  # would not even load
    ],
)
def test_a_resume_that_asks_for_other_settings_is_refused(base_model, fixture_dir, tmp_path, change, words):
    """Every setting of a run is recorded with its checkpoint: a resume asking for another one is refused before
    anything loads, naming what differs, rather than training on with the saved optimizer's and recording the new."""
    _run(base_model, fixture_dir, tmp_path / "r", max_steps=3, stop_after=1)
    with pytest.raises(ValueError, match=re.escape(words)) as e:
        _run(base_model, fixture_dir, tmp_path / "r", resume=True, **{"max_steps": 3, **change})
    assert "resume with the same ones" in str(e.value)
    assert json.loads((tmp_path / "r" / "finetune.json").read_text())["step"] == 1  # untouched


def test_a_resume_compares_the_methods_without_their_unused_options(base_model, fixture_dir, tmp_path):
    """A run whose method record holds a value for an option its other options leave unused (clustered's seed at one
    cluster, recorded before such a value was refused) resumes: the value trained nothing, and giving it again is
    refused. An option that matters still stops the resume."""
    from approx.harness.finetune import PROGRESS_FILE

    out = tmp_path / "r"
    _run(base_model, fixture_dir, out, max_steps=3, stop_after=1, method="clustered:clusters=1")
    (progress,) = out.rglob(PROGRESS_FILE)
    saved = json.loads(progress.read_text())
    saved["run"]["method"]["seed"] = 3  # (as a run started before the refusal recorded its --seed there)
    progress.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="method: started with"):
        _run(base_model, fixture_dir, out, max_steps=3, resume=True, method="clustered:clusters=2")
    rec = _run(base_model, fixture_dir, out, max_steps=3, resume=True, method="clustered:clusters=1")
    assert rec["step"] == 3 and not rec["partial"]


def test_a_resume_may_checkpoint_more_often(base_model, fixture_dir, tmp_path):
    """How often a run checkpoints changes nothing it trains: a resume may ask for another interval."""
    _run(base_model, fixture_dir, tmp_path / "r", max_steps=3, stop_after=1)
    rec = _run(base_model, fixture_dir, tmp_path / "r", max_steps=3, resume=True, checkpoint_every=1)
    assert rec["step"] == 3 and not rec["partial"]


def test_a_stopped_run_leaves_a_checkpoint_that_eval_reads(base_model, fixture_dir, tmp_path, capsys):
    """--stop-after writes the model so far (tokenizer and approx settings included) and says so; `approx eval
    --model` reads it; the plain and the patched case."""
    for name, method in (("plain", []), ("patched", ["--method", "favor:features=8"])):
        out = tmp_path / name
        argv = ["finetune", "--model", base_model, "--task", "rte", "--output-dir", str(out), *method]
        argv += ["--train-split", "dev/0", "--data-dir", str(fixture_dir), "--max-steps", "4", "--batch-size", "4"]
        assert main([*argv, "--stop-after", "2", "--quiet"]) == 0
        said = capsys.readouterr().out
        assert "stopped after step 2 of 4" in said and "--resume" in said
        assert json.loads((out / "finetune.json").read_text())["partial"]
        assert (out / "approx_config.json").is_file() == bool(method)
        args = ["eval", "--model", str(out), "--task", "rte", "--split", "dev/1", "--data-dir", str(fixture_dir)]
        assert main([*args, "--method", str(out) if method else "full", "--quiet"]) == 0, capsys.readouterr().err


def test_patched_finetuning_saves_the_state_it_trained_with(base_model, fixture_dir, tmp_path):
    rec = _run(
        base_model,
        fixture_dir,
        tmp_path / "f",
        method="favor:features=8",
        max_steps=4,
        redraw_every=2,
        eval_split="dev/1",
    )
    assert rec["method"]["name"] == "favor" and (tmp_path / "f" / "approx_config.json").is_file()
    (ev,) = rec["evaluation"]
    assert ev["method"]["name"] == "favor" and ev["method"]["features"] == 8
    from transformers import AutoModelForSequenceClassification

    loaded = approx.load(tmp_path / "f", model_class=AutoModelForSequenceClassification)
    fresh = approx.patch(AutoModelForSequenceClassification.from_pretrained(tmp_path / "f"), "favor", features=8)
    saved, drawn = approx.patched_layers(loaded)[0].state(), approx.patched_layers(fresh)[0].state()
    assert any(not torch.equal(saved[n], drawn[n]) for n in saved)  # redrawn during training, and kept


def test_finetuning_from_a_folder_keeps_its_sliding_window_layers_on_the_banded_kernel(fixture_dir, tmp_path):
    """A folder saved with ``local="band"`` (ModernBERT) given as the method: the model trains (its window layers on the
    band's training form, which gradients need), is saved with ``local`` as the folder had it, and is evaluated so."""
    from transformers import AutoModelForSequenceClassification

    base = write_checkpoint(tmp_path / "base", "sequence-classification", family="modernbert")
    model = approx.patch(AutoModelForSequenceClassification.from_pretrained(base), "full", local="band")
    approx.save(model, tmp_path / "band")
    rec = _run(str(base), fixture_dir, tmp_path / "f", method=str(tmp_path / "band"), max_steps=2, eval_split="dev/1")
    assert json.loads((tmp_path / "f" / "approx_config.json").read_text())["local"] == "band"
    (ev,) = rec["evaluation"]
    assert ev["local"] == "band"
    # trained on a GPU, where the kernel does not run: evaluated with the layers' own attention, and said
    from approx.harness.finetune import _evaluation_local

    assert _evaluation_local(model) == "band"
    with pytest.warns(UserWarning, match=r"saved with local='band', and evaluated on meta, where approx's banded"):
        assert _evaluation_local(model.to("meta")) == "model"


def test_finetuning_a_deeper_model_with_a_folders_layers_is_refused(fixture_dir, tmp_path):
    """A folder's layer indices count in the model it was saved from: a 2-layer model's folder given as the method to
    fine-tune a 4-layer one had patched its layers 0 and 1 and said nothing (as ``approx.restore`` did: a reviewer's
    finding); refused before training, as ``restore`` refuses it."""
    from conftest import tiny_model
    from evalfixtures import vocab
    from transformers import AutoModelForSequenceClassification, BertTokenizer

    base = write_checkpoint(tmp_path / "base", "sequence-classification")
    two = AutoModelForSequenceClassification.from_pretrained(base)
    approx.save(approx.patch(two, "favor", layers=[1], features=8), tmp_path / "two")
    four = tmp_path / "four"
    tiny_model(
        "bert", "sequence-classification", vocab_size=len(vocab()), max_position_embeddings=512, num_hidden_layers=4
    ).save_pretrained(four)
    BertTokenizer(vocab=vocab()).save_pretrained(four)
    with pytest.raises(ValueError, match=r"saved from a model of 2 attention layers.*has 4"):
        _run(str(four), fixture_dir, tmp_path / "f", method=str(tmp_path / "two"), max_steps=1)
    assert not (tmp_path / "f" / "approx_config.json").exists()


@pytest.mark.parametrize("method", ["i-clustered:clusters=4,topk=8", "nystrom:landmarks=4"])
def test_patched_finetuning_in_mixed_precision(base_model, fixture_dir, tmp_path, method):
    """accelerate's bf16 mixed precision runs the model under torch.autocast, where improved clustered attention
    had failed on a product's dtype (and Nystrom attention in inference): both train with it. accelerate keeps one
    state per process, which refused another precision after the first run's ("restart your runtime"): runs in one
    process switch precision both ways."""
    from accelerate.state import AcceleratorState, DistributedType

    from approx.harness.finetune import _accelerator

    _run(base_model, fixture_dir, tmp_path / "plain", max_steps=1)  # the process's accelerate state: no precision
    rec = _run(base_model, fixture_dir, tmp_path / "mp", method=method, max_steps=2, mixed_precision="bf16")
    assert rec["method"]["name"] == method.split(":")[0] and all(map(torch.isfinite, map(torch.tensor, rec["losses"])))
    assert rec["settings"]["mixed_precision"] == "bf16"
    assert _run(base_model, fixture_dir, tmp_path / "back", max_steps=1)["settings"]["mixed_precision"] == "no"
    from approx.harness import finetune as ft

    ft._RUNNING[0] += 1  # another thread's run under way on the state: not reset under it, refused
    try:
        with pytest.raises(ValueError, match="another finetune runs in this process"):
            ft._RUNNING[0] += 1  # (and this one)
            try:
                _accelerator("bf16")
            finally:
                ft._RUNNING[0] -= 1
    finally:
        ft._RUNNING[0] -= 1
    held = dict(AcceleratorState._shared_state)  # several processes share it: not reset, refused
    AcceleratorState._shared_state.update(distributed_type=DistributedType.MULTI_CPU)
    try:
        with pytest.raises(ValueError, match="across several processes"):
            _accelerator("bf16")
    finally:
        AcceleratorState._shared_state.clear()
        AcceleratorState._shared_state.update(held)
    # an Accelerator a callback makes shares the run's state, and works after the run (a reset at the end broke it)
    from accelerate import Accelerator

    made = []
    _run(base_model, fixture_dir, tmp_path / "cb", max_steps=1, callback=lambda step, m: made.append(Accelerator()))
    assert made[0].device.type == "cpu" and made[0].mixed_precision == "no"
    # a state the caller's own Accelerator made is theirs: not changed under them (every Accelerator reads it)
    AcceleratorState._reset_state()
    try:
        mine = Accelerator(mixed_precision="bf16", cpu=True)
        with pytest.raises(ValueError, match="an Accelerator of yours already set .* to 'bf16'"):
            _run(base_model, fixture_dir, tmp_path / "theirs", max_steps=1)
        assert mine.mixed_precision == "bf16"
    finally:
        AcceleratorState._reset_state()


def test_redrawn_seed_is_recorded_whether_the_run_was_resumed_or_not(base_model, fixture_dir, tmp_path):
    """With redraws every 2 steps the state at step 5 was drawn from seed 0 + 5 // 2 = 2: the saved settings say so,
    with the same state, whether the run went straight through or stopped at 4 and resumed, and patching afresh with
    seed 2 draws that state; finetune.json keeps the seed the run started with and the state's seed beside it."""
    common = dict(method="favor:features=8", max_steps=5, redraw_every=2)
    _run(base_model, fixture_dir, tmp_path / "a", **common)
    _run(base_model, fixture_dir, tmp_path / "b", stop_after=4, **common)
    with warnings.catch_warnings(record=True) as caught:  # the resumed state is the redraw's, whose seed is recorded
        warnings.simplefilter("always")
        _run(base_model, fixture_dir, tmp_path / "b", resume=True, **common)
    assert not [w for w in caught if "state loaded into" in str(w.message)]
    from safetensors.torch import load_file

    for run in ("a", "b"):
        layers = json.loads((tmp_path / run / "approx_config.json").read_text())["layers"]
        assert [e["config"]["seed"] for e in layers] == [2] * len(layers), run
        record = json.loads((tmp_path / run / "finetune.json").read_text())
        assert record["method"]["seed"] == 0 and record["state_seed"] == 2
    a, b = (load_file(tmp_path / run / "approx_state.safetensors") for run in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from transformers import AutoModelForSequenceClassification

    fresh = approx.patch(
        AutoModelForSequenceClassification.from_pretrained(tmp_path / "a"), "favor", features=8, seed=2
    )
    drawn = {f"layer.{i}.{n}": t for i, lyr in approx.patched_layers(fresh).items() for n, t in lyr.state().items()}
    assert drawn.keys() == a.keys() and all(torch.equal(a[k], drawn[k]) for k in a)


def test_attention_dropout_is_overridden_while_training_and_the_checkpoint_keeps_its_own(
    base_model, fixture_dir, tmp_path
):
    """attention_dropout=0: every attention module and the config say 0 at every training step, the record says
    so, and the saved config keeps the model's own value; without it the model trains with its own."""
    from transformers import AutoConfig

    from approx.integration import attention_modules

    own = AutoConfig.from_pretrained(base_model).attention_probs_dropout_prob
    assert own > 0  # else the override could not be told from the model's own value
    seen = []

    def look(step, model):
        seen.append((model.config.attention_probs_dropout_prob, {m.dropout.p for m in attention_modules(model)}))

    rec = _run(base_model, fixture_dir, tmp_path / "d", max_steps=2, attention_dropout=0.0, callback=look)
    assert seen == [(0.0, {0.0})] * 2
    assert rec["settings"]["attention_dropout"] == 0.0
    assert AutoConfig.from_pretrained(tmp_path / "d").attention_probs_dropout_prob == own
    seen.clear()
    rec = _run(base_model, fixture_dir, tmp_path / "e", max_steps=1, callback=look)
    assert seen == [(own, {own})] and rec["settings"]["attention_dropout"] is None
    with pytest.raises(ValueError, match="attention_dropout"):
        _run(base_model, fixture_dir, tmp_path / "f", max_steps=1, attention_dropout=1.0)
    # a resume keeps the setting the run started with, or is refused
    _run(base_model, fixture_dir, tmp_path / "g", max_steps=3, stop_after=1, attention_dropout=0.0)
    with pytest.raises(ValueError, match="attention_dropout: started with 0.0, now None.*resume with the same ones"):
        _run(base_model, fixture_dir, tmp_path / "g", max_steps=3, resume=True)
    seen.clear()
    _run(base_model, fixture_dir, tmp_path / "g", max_steps=3, resume=True, attention_dropout=0.0, callback=look)
    assert seen == [(0.0, {0.0})] * 2
    assert AutoConfig.from_pretrained(tmp_path / "g").attention_probs_dropout_prob == own


def test_attention_dropout_key_by_family():
    from types import SimpleNamespace

    from conftest import tiny_config

    from approx.integration import attention_dropout_key

    for family, key in [("bert", "attention_probs_dropout_prob"), ("roberta", "attention_probs_dropout_prob"),
                        ("albert", "attention_probs_dropout_prob"), ("distilbert", "attention_dropout")]:  # fmt: skip
        assert attention_dropout_key(tiny_config(family)) == key, family
    with pytest.raises(ValueError, match="attention_probs_dropout_prob, attention_dropout"):
        attention_dropout_key(SimpleNamespace(hidden_dropout_prob=0.1))


def test_squad_doc_fine_tunes_a_reader_on_its_windows(fixture_dir, tmp_path):
    """squad-doc trains on one window per question (the evaluation's), its record states the rule, and the saved
    reader is evaluated on the other half."""
    base = str(write_checkpoint(tmp_path / "qa", "question-answering"))
    rec = _run(base, fixture_dir, tmp_path / "doc", task="squad-doc", max_steps=3, max_length=256,
               eval_split="dev/1", attention_dropout=0.0)  # fmt: skip
    examples, _ = get_task("squad-doc").load("dev/0", source="local", data_dir=str(fixture_dir))
    assert rec["task"] == "squad-doc" and rec["features"] == len(examples) and len(rec["losses"]) == 3
    assert "256-token window of the whole article" in rec["train_protocol"]
    (ev,) = rec["evaluation"]
    assert ev["task"] == "squad-doc" and ev["split"] == "dev/1" and "f1" in ev["reference_metrics"]


def test_cross_fit_halves_are_disjoint_and_cover_the_split(fixture_dir):
    for task in ("rte", "squad"):
        every, _ = get_task(task).load("dev", source="local", data_dir=str(fixture_dir))
        a, _ = get_task(task).load("dev/0", source="local", data_dir=str(fixture_dir))
        b, _ = get_task(task).load("dev/1", source="local", data_dir=str(fixture_dir))
        key = (lambda e: e["id"]) if task == "squad" else (lambda e: (e["text"], e["text_pair"]))
        assert {key(e) for e in a} | {key(e) for e in b} == {key(e) for e in every}
        assert not {key(e) for e in a} & {key(e) for e in b} and a and b
    a, _ = get_task("squad").load("dev/0", source="local", data_dir=str(fixture_dir))
    b, _ = get_task("squad").load("dev/1", source="local", data_dir=str(fixture_dir))
    assert not {e["title"] for e in a} & {e["title"] for e in b}  # split by article
    assert cross_fit_half(list(range(0)), 0) == []
    with pytest.raises(ValueError, match="dev/0 or dev/1"):
        get_task("rte").load("dev/2", source="local", data_dir=str(fixture_dir))


def test_squad_training_targets_point_at_the_answer(fixture_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(write_checkpoint(tmp_path / "qa", "question-answering"))
    task = get_task("squad")
    examples, _ = task.load(source="local", data_dir=str(fixture_dir))
    feats = task.train_features(examples, tok, max_length=48)
    inside = 0
    for f in feats:
        s, e = f.extra["labels"]["start_positions"], f.extra["labels"]["end_positions"]
        ex = examples[f.example]
        if s == 0:
            assert e == 0
            continue
        inside += 1
        offsets = f.extra["offsets"]
        assert ex["context"][offsets[s][0] : offsets[e][1]] == ex["answers"][0]
    assert inside >= len(examples)  # every answer sits inside at least one window


def test_cli_finetune_smoke(base_model, fixture_dir, tmp_path, capsys):
    argv = [
        "finetune",
        "--model",
        base_model,
        "--task",
        "stsb",
        "--output-dir",
        str(tmp_path / "s"),
        "--train-split",
        "dev/0",
        "--eval-split",
        "dev/1",
        "--max-steps",
        "2",
        "--batch-size",
        "4",
        "--data-dir",
        str(fixture_dir),
        "--quiet",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "saved to" in out and "pearson" in out
    assert f"`{base_model} fine-tuned ({tmp_path / 's'})`" in out  # the report's heading names the fine-tuned model
    assert (
        main(["finetune", "--task", "wikitext2", "--output-dir", str(tmp_path / "w"), "--data-dir", str(fixture_dir)])
        == 2
    )


def test_finetune_settings_have_their_defaults_in_the_config_only():
    """Every FinetuneConfig field is an `approx finetune` flag whose parser default is None (the dataclass
    decides) and whose help shows the dataclass default; finetune() restates none of them."""
    import dataclasses
    import inspect

    from approx.harness.cli import build_parser
    from approx.harness.finetune import FinetuneConfig

    sub = build_parser()._subparsers._group_actions[0].choices["finetune"]
    actions = {a.dest: a for a in sub._actions}
    fields = dataclasses.fields(FinetuneConfig)
    assert {f.name for f in fields} >= {"epochs", "learning_rate", "warmup", "batch_size", "seed", "redraw_every"}
    for f in fields:
        action = actions[f.name]
        assert action.option_strings == ["--" + f.name.replace("_", "-")] and action.default is None, f.name
        assert f.metadata["help"] in action.help
        if f.default is not None:
            assert f"(default {f.default})" in action.help
    assert not set(inspect.signature(finetune).parameters) & {f.name for f in fields}


def test_finetune_settings_are_checked_before_anything_loads(tmp_path):
    from approx.harness.finetune import FinetuneConfig

    for bad, words in [
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"warmup": 1.0}, "warmup"),
        ({"lerning_rate": 1e-3}, "did you mean 'learning_rate'"),
        ({"mixed_precision": "fp8"}, "bf16"),
    ]:
        with pytest.raises(ValueError, match=words):
            finetune("no/such/model", "rte", output_dir=tmp_path / "x", **bad)
    with pytest.raises(ValueError, match="batch_size"):
        finetune("no/such/model", "rte", output_dir=tmp_path / "x", config=FinetuneConfig(), batch_size=0)
    with pytest.raises(ValueError, match="did you mean 'epochs'"):  # with a config too: ValueError, not TypeError
        finetune("no/such/model", "rte", output_dir=tmp_path / "x", config=FinetuneConfig(), epoch=2)


def test_cli_fit_refuses_keeping_projections_it_never_fitted(capsys):
    assert main(["fit", "--fit-projections-too", "false", "--output-dir", "unused"]) == 2
    err = capsys.readouterr().err
    assert "--fit-projections-too false" in err and err.count("\n") == 1


def test_cli_finetune_flags_reach_the_settings(base_model, fixture_dir, tmp_path, capsys):
    from approx.harness.finetune import FinetuneConfig

    out = tmp_path / "c"
    argv = ["finetune", "--model", base_model, "--task", "rte", "--output-dir", str(out), "--train-split", "dev/0"]
    argv += ["--data-dir", str(fixture_dir), "--max-steps", "2", "--learning-rate", "0.002", "--warmup", "0"]
    assert main([*argv, "--batch-size", "4", "--quiet"]) == 0
    settings = json.loads((out / "finetune.json").read_text())["settings"]
    assert (settings["steps"], settings["learning_rate"], settings["warmup"], settings["batch_size"]) == (
        2,
        0.002,
        0,
        4,
    )
    assert settings["weight_decay"] == FinetuneConfig().weight_decay
    assert settings["max_length"] == get_task("rte").default_max_length
    assert main([*argv, "--mixed-precision", "fp8"]) == 2
    assert "mixed_precision" in capsys.readouterr().err


@pytest.mark.parametrize(
    "method, words",
    [
        (None, "no method is patched"),
        ("window:window=8", "window:window=8 draws no random state"),
        ("linformer", "linformer draws no random state"),
        ("entmax", "entmax draws no random state"),
        ("bigbird:random_blocks=0", "bigbird:random_blocks=0 draws no random state"),  # (a key it never reads)
        (approx.Setup("window", {"window": 8}), "window:window=8 draws no random state"),  # not the Setup's repr
    ],
)
def test_redraw_every_without_random_state_is_refused_before_loading(fixture_dir, tmp_path, method, words):
    """``redraw_every`` with nothing to redraw (no method, or one without drawn state) had been ignored: refused before
    the model loads (the model folder here does not exist)."""
    with pytest.raises(ValueError, match=f"redraw_every \\(--redraw-every\\) 2: {words}"):
        _run(str(tmp_path / "absent"), fixture_dir, tmp_path / "o", method=method, redraw_every=2, max_steps=2)


# ---------------------------------------------------------------------------- the schedule, redraws, stops, epochs


def test_the_learning_rate_warms_up_then_decays_linearly_to_zero(base_model, fixture_dir, tmp_path, monkeypatch):
    """The learning rate of every optimizer step, read from the optimizer as it steps, against the schedule's
    definition: W = int(warmup * steps) warm-up steps at lr (s + 1) / W, then lr (T - s) / (T - W) down to 0 at T
    (transformers' linear schedule after its warm-up; its warm-up starts at 0, which would waste a step)."""
    used = []
    real_step = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        used.append(self.param_groups[0]["lr"])
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    lr, steps, warmup = 1e-3, 10, 0.35  # W = 3
    _run(base_model, fixture_dir, tmp_path / "s", max_steps=steps, warmup=warmup, learning_rate=lr)
    w = int(warmup * steps)
    expected = [lr * (s + 1) / w if s < w else lr * (steps - s) / (steps - w) for s in range(steps)]
    assert used == pytest.approx(expected, rel=1e-12)
    from transformers import get_linear_schedule_with_warmup

    reference = get_linear_schedule_with_warmup(torch.optim.SGD([torch.zeros(1)], lr=lr), w, steps)
    theirs = []
    for _ in range(steps):
        theirs.append(reference.get_last_lr()[0])
        reference.optimizer.step()
        reference.step()
    assert used[w:] == pytest.approx(theirs[w:], rel=1e-12)


def _layer_state(model) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in approx.patched_layers(model)[0].state().items()}


def test_redraws_happen_after_every_nth_step_and_a_run_stopped_there_resumes_exactly(base_model, fixture_dir, tmp_path):
    """With ``redraw_every=2`` the state the model trains with is the one patch draws from seed 0 for steps 1 and 2,
    from seed 1 for steps 3 and 4, from seed 2 for 5 and 6 (each redraw after the step that ends a period). A run
    stopped at a redraw step, twice (``stop_after`` counts from where each call starts), then resumed, ends with the
    weights and state of a run that went straight through."""
    from transformers import AutoModelForSequenceClassification

    seen = {}
    common = dict(method="favor:features=8", max_steps=6, redraw_every=2, limit=8, warmup=0.0)
    _run(base_model, fixture_dir, tmp_path / "a", callback=lambda s, m: seen.setdefault(s, _layer_state(m)), **common)
    drawn = {}
    for seed in range(4):
        fresh = AutoModelForSequenceClassification.from_pretrained(base_model, num_labels=2)
        drawn[seed] = _layer_state(approx.patch(fresh, "favor", features=8, seed=seed))
    assert sorted(seen) == [1, 2, 3, 4, 5, 6]
    for step, state in seen.items():  # after step s (callback after the redraw): the state of steps s + 1 ...
        seed = step // 2
        assert all(torch.equal(state[n], drawn[seed][n]) for n in state), (step, seed)
    first = _run(base_model, fixture_dir, tmp_path / "b", stop_after=2, **common)
    second = _run(base_model, fixture_dir, tmp_path / "b", stop_after=2, resume=True, **common)
    assert first["step"] == 2 and second["step"] == 4 and second["partial"]
    _run(base_model, fixture_dir, tmp_path / "b", resume=True, **common)
    from safetensors.torch import load_file

    for file in ("model.safetensors", "approx_state.safetensors"):
        a, b = load_file(tmp_path / "a" / file), load_file(tmp_path / "b" / file)
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_every_epoch_sees_every_example_once_in_its_own_order(base_model, fixture_dir, tmp_path, monkeypatch):
    """The batches of three epochs of 8 examples (2 steps each), read as the loss gets them: each epoch holds every
    example exactly once, and the epochs' orders differ (a shuffle per epoch, not one order for the run)."""
    from approx.harness import finetune as ft

    rows = []
    real_loss = ft._loss

    def loss(tr, batch):
        for ids, real in zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist()):
            rows.append(tuple(ids[: sum(real)]))  # without the batch's padding
        return real_loss(tr, batch)

    monkeypatch.setattr(ft, "_loss", loss)
    _run(base_model, fixture_dir, tmp_path / "e", max_steps=6, limit=8, warmup=0.0)
    assert len(rows) == 24
    epochs = [rows[i : i + 8] for i in range(0, 24, 8)]
    assert len(set(epochs[0])) == 8 and all(sorted(e) == sorted(epochs[0]) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1


def test_a_run_that_crashes_mid_epoch_resumes_from_the_end_of_the_last_epoch(base_model, fixture_dir, tmp_path):
    """Without ``checkpoint_every`` the training state is saved at the end of every epoch: a run that fails in step 3
    (epochs of 2 steps) resumes from step 2 and ends where a run without the failure ends."""

    def crash(step, model):
        if step == 3:
            raise RuntimeError("the job was killed")

    common = dict(max_steps=6, limit=8, warmup=0.0)
    with pytest.raises(RuntimeError, match="killed"):
        _run(base_model, fixture_dir, tmp_path / "c", callback=crash, **common)
    assert json.loads((tmp_path / "c" / "checkpoint" / "progress.json").read_text())["step"] == 2
    _run(base_model, fixture_dir, tmp_path / "c", resume=True, **common)
    _run(base_model, fixture_dir, tmp_path / "d", **common)
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "c" / "model.safetensors"), load_file(tmp_path / "d" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
