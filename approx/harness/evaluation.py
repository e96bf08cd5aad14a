"""The evaluation harness: a task on a model under several attention methods, against the unpatched model.

::

    results = approx.evaluate("path/to/checkpoint", "sst2", ["clustered:clusters=25", "i-clustered"])

For every batch the unpatched model runs first, then each method on the same batch (patched, run,
unpatched), so task metrics, fidelity and timings are measured side by side. Each result is
self-describing: task and version, mode and protocol, model, the method with all its options, metrics
under the method and under full attention, fidelity, examples and provenance.

Fidelity, per method (task agreement / KL, hidden-state cosine per layer, worst input and pooled,
attention-output error, cost, time, peak memory) is computed in one place, :mod:`approx.harness.fidelity`.

Under ``accelerate launch --multi_gpu --num_processes N`` (or ``torchrun``; on a machine without a GPU the
processes join on CPU through gloo) every process takes every n-th batch (the same batches a single process would
make), outputs are gathered, and the metrics equal a single-process run's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..config import MethodConfig
from ..integration import (
    attach,
    attention_modules,
    attention_probe,
    attention_shape,
    check_checkpoint_local,
    check_checkpoint_supported,
    check_local,
    check_local_name,
    checkpoint_heads,
    is_patched,
    load_pretrained,
    local_layers,
    model_head_from_name,
    patch,
    patched_layers,
    patched_within,
    saved_layers,
    saved_local,
    unpatch,
)
from ..positions import extended_positions, limit_for, trained_positions
from ..registry import get_method
from ..saved import AUTOTUNE_RECORD, FIT_RECORD, check_checkpoint, read_settings
from . import fidelity as fid
from .argcheck import check_device
from .crossfit import examples_digest
from .memory import PeakMemory, allocation_peak
from .resampling import (
    DEFAULT_LEVEL,
    DEFAULT_RESAMPLES,
    interval_options,
    interval_text,
    level_label,
    paired_interval,
)
from .spec import PER_LAYER, Setup, as_setup, layer_spans, saved_folder, short_label
from .tasks import Feature, Task, get_task
from .tasks.base import collate, splits_overlap

__all__ = ["evaluate", "as_setup", "markdown_report"]

log = logging.getLogger(__name__)


def _forward(model, inputs, device):
    with PeakMemory(device) as mem:
        out = model(**inputs, output_hidden_states=True)
    return out, mem


@dataclasses.dataclass
class _Run:
    """What one evaluation runs on: the model in eval mode on its device, the task in its mode, the data."""

    model: torch.nn.Module
    model_name: str
    task: Task
    mode: str
    split: str
    examples: list[dict[str, Any]]
    source: Any
    features: list[Feature]
    device: torch.device
    pad_id: int
    model_info: dict[str, Any]
    positions: dict[str, Any] | None = None  # set when the harness extended the model's positions
    main_process: bool = True  # under several processes, the one that says what the results cannot (warnings)
    # {"model_weights_sha256": weights_digest, "model_dtype": its parameters' dtypes} of the model evaluated (its name
    # may be the checkpoint it started from; the same weights in bfloat16 give other numbers)
    weights: dict[str, str | None] | None = None

    @property
    def attention_layers(self) -> int:
        """Attention layers of the model, patched or not (the whole-model matmul count needs them)."""
        return len(attention_modules(self.model))


def _run_batches(
    run: _Run, batches, layers, labels: list[str], progress: bool, warmup: bool = True, allocations: bool = False
) -> list[dict[str, Any]]:
    """Run the unpatched model and every method on this process's batches; one record per batch with the
    per-feature outputs and each method's fidelity sums. The progress bar counts inputs and names the
    forward pass under way (full attention or a method), so long, slow batches still show movement.

    ``warmup``: before anything is timed, the unpatched model and every method run once, untimed, on the first
    batch (the longest: batches are sorted by length), so that one-time costs (FlexAttention's compilation for a
    new shape, lazily built state, the allocator's first growth) are not counted as the method's time. Their peak
    memory is kept: the first timed batch reports the larger of its own peak and the warm-up's, since a peak
    reached once may not be reached again by a process that keeps memory it freed. The unpatched model runs once
    more before that, unmeasured: a process's first forward pass costs memory once (kernels' code mapped, the
    allocator grown), which would otherwise count against whichever pass came first, full attention's. The warm-up covers the first
    batch's shape; a later pass during which ``torch.compile`` compiled again (another length) is run a second
    time and that time kept (:func:`_timed`; counted in ``fidelity.retimed_batches``). ``allocations``: the
    warm-up also measures each forward's CPU allocator peak on that batch (:func:`_warm_up`)."""
    records = []
    bar = tqdm(total=sum(len(idx) for _, idx in batches), disable=not progress, desc=run.task.name, unit="input")
    with bar:
        warm, allocated = (
            _warm_up(run, batches[0][1], layers, labels, bar, allocations) if warmup and batches else (None, None)
        )
        for b, idx in batches:
            records.append(_run_batch(run, b, idx, layers, labels, bar, warm, retime=warmup, allocated=allocated))
            warm = allocated = None
            bar.update(len(idx))
    return records


def _warm_up(run: _Run, idx: list[int], layers, labels: list[str], bar, allocations: bool = False):
    """The untimed first pass of :func:`_run_batches`: every forward of a batch once; their peak MiB (full
    attention first, then each method's), and with ``allocations`` the CPU allocator's peak of each forward,
    measured in one more untimed call under the profiler (:func:`~approx.harness.memory.allocation_peak`;
    else None)."""
    inputs = collate([run.features[i] for i in idx], run.pad_id, run.device)
    tokens = inputs["input_ids"].shape[1]
    bar.set_postfix_str(f"{tokens} tokens, warm-up: full attention", refresh=True)
    # the process's first forward pass maps kernels' code and grows the allocator once (on MiniLM-L6, 32 inputs of
    # 128 tokens: 135 MiB of peak RSS against 90 on the next calls): made before anything is measured, so that
    # it is not counted against full attention, whose pass comes first
    _forward(run.model, inputs, run.device)
    peaks = [_forward(run.model, inputs, run.device)[1].mib]
    for label, method_layers in zip(labels, layers, strict=True):
        bar.set_postfix_str(f"{tokens} tokens, warm-up: {label}", refresh=True)
        peaks.append(_method_forward(run, inputs, method_layers)[1].mib)
    if not allocations:
        return peaks, None
    bar.set_postfix_str(f"{tokens} tokens, allocations: full attention", refresh=True)
    allocated = [allocation_peak(_forward, run.model, inputs, run.device)[1]]
    for label, method_layers in zip(labels, layers, strict=True):
        bar.set_postfix_str(f"{tokens} tokens, allocations: {label}", refresh=True)
        allocated.append(allocation_peak(_method_forward, run, inputs, method_layers)[1])
    return peaks, allocated


@dataclasses.dataclass
class _MethodLayers:
    """A method's patched layers, made once (their state kept across batches), and how the model's sliding-window
    layers run under it (``local`` of :func:`approx.patch`)."""

    layers: dict
    local: str = "model"
    # for layers given as they are (a saved folder, patched layers), whose state their options do not determine:
    # {"folder": its path (a folder's), "state_sha256": the state that ran (layers_state_digest)}
    state: dict[str, str] | None = None


def _method_forward(run: _Run, inputs, method_layers: _MethodLayers, probe=None, measured: bool = True):
    """The model's forward with a method's layers attached (and detached again, whatever happens), under the
    fidelity ``probe`` when one is given: (output, its :class:`PeakMemory`, or None when not ``measured``)."""
    attach(run.model, method_layers.layers, local=method_layers.local)
    try:
        with attention_probe(probe) if probe is not None else contextlib.nullcontext():
            if not measured:
                return run.model(**inputs, output_hidden_states=True), None
            return _forward(run.model, inputs, run.device)
    finally:
        unpatch(run.model)


def _larger(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def _compiled_graphs() -> int:
    """Graphs ``torch.compile`` has compiled so far in this process (its own counter; 0 before anything
    imported it, when nothing can have been compiled)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def _timed(forward, retime: bool):
    """``forward()`` (its output, its :class:`PeakMemory`, and whatever else it returns), and whether it was timed
    again: with ``retime``, a call during which ``torch.compile`` compiled a graph (an input the warm-up did not
    cover: FlexAttention compiles for new lengths and key paddings) is made once more and the second call's time
    kept, its peak memory the larger of the two (the first call's includes the compiler's own memory). A second
    call that compiles again is kept with a warning: its time includes compilation."""
    before = _compiled_graphs()
    first = forward()
    if not retime or _compiled_graphs() == before:
        return first, 0
    first_mib, first = first[1].mib, None  # the first call's outputs freed before the second call
    again_from = _compiled_graphs()
    again = forward()
    again[1].mib = _larger(first_mib, again[1].mib)
    if _compiled_graphs() != again_from:
        log.warning("a timed forward pass compiled again when it was repeated: its time includes compilation")
    return again, 1


def _run_batch(
    run: _Run,
    b: int,
    idx: list[int],
    layers,
    labels: list[str],
    bar,
    warm=None,
    retime: bool = False,
    allocated=None,
) -> dict[str, Any]:
    """The unpatched model and every method on one batch: its record (outputs and fidelity sums). ``warm``: the
    warm-up's peaks on this batch (:func:`_warm_up`), counted in its peak memory; ``retime``: a pass that
    compiled is run and timed again (:func:`_timed`); ``allocated``: the warm-up's allocator peaks on this batch
    (full attention first), or None."""
    allocated = allocated or [None] * (len(layers) + 1)
    task, mode = run.task, run.mode
    feats = [run.features[i] for i in idx]
    inputs = collate(feats, run.pad_id, run.device)
    tokens = inputs["input_ids"].shape[1]
    bar.set_postfix_str(f"{tokens} tokens, full attention", refresh=True)
    (ref_out, ref_mem), ref_retimed = _timed(lambda: _forward(run.model, inputs, run.device), retime)
    warm = warm or [None] * (len(layers) + 1)
    ref_peak = _larger(ref_mem.mib, warm[0])
    ref_outputs = task.outputs(ref_out, inputs, feats, mode)
    compact = [task.compact(o, f, mode) for o, f in zip(ref_outputs, feats, strict=True)]
    record = {"batch": b, "features": idx, "outputs": compact, "setups": []}
    for s, (label, method_layers) in enumerate(zip(labels, layers, strict=True)):
        bar.set_postfix_str(f"{tokens} tokens, {label}", refresh=True)

        def forward(method_layers=method_layers):
            return _method_forward(run, inputs, method_layers)

        # timed and measured without the probe: its work (exact attention on the same inputs, the O(N^2) attention
        # graph) is neither the method's time nor its memory, and sharing the pass slowed the method's layers
        (_, mem), retimed = _timed(forward, retime)
        probe = fid.AttentionProbe(total_layers=run.attention_layers, local_layers=local_layers(run.model))
        out, _ = _method_forward(run, inputs, method_layers, probe, measured=False)  # fidelity: the same outputs
        outputs = task.outputs(out, inputs, feats, mode)
        sums = fid.batch_sums(
            ref_out.hidden_states,
            out.hidden_states,
            inputs["attention_mask"],
            probe,
            divergences=[task.divergence(r, o, mode) for r, o in zip(ref_outputs, outputs, strict=True)],
            seconds=mem.seconds,
            peak=_larger(mem.mib, warm[s + 1]),
            reference_seconds=ref_mem.seconds,
            reference_peak=ref_peak,
            retimed=retimed,
            reference_retimed=ref_retimed,
            allocated=allocated[s + 1],
            reference_allocated=allocated[0],
        )
        compact = [task.compact(o, f, mode) for o, f in zip(outputs, feats, strict=True)]
        record["setups"].append({"outputs": compact, "sums": sums})
    return record


def _in_feature_order(records, n_features, s=None):
    out = [None] * n_features
    for r in records:
        src = r if s is None else r["setups"][s]
        for i, value in zip(r["features"], src["outputs"], strict=True):
            out[i] = value
    return out


def _resolve_model(model, tokenizer, head: str, progress: bool):
    if isinstance(model, str):
        head_task = None if head == "base" else head
        loaded, tok = load_pretrained(model, task=head_task, progress=progress, tokenizer=tokenizer)
        return loaded, tok, model
    if tokenizer is None:
        raise ValueError("pass the tokenizer with a model object (or pass the model's folder or hub id)")
    name = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None) or type(model).__name__
    return model, tokenizer, name


def _method_list(methods: Any) -> list:
    """``methods`` as a list: one method given alone (a name, a folder, a Setup, a config or a patched model's layers)
    is a list of one, never a string's letters or a dict's keys."""
    return [methods] if isinstance(methods, (str, os.PathLike, Setup, MethodConfig, dict)) else list(methods)


def _setups(methods: Sequence, seed: int, batch_size: int, local: str | None = None) -> list[Setup]:
    """The methods as setups, refusing what cannot run before anything is loaded (``local``: a mode's name)."""
    check_local_name(local)
    if not methods:
        raise ValueError("name at least one method to compare with full attention (see `approx methods`)")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    setups = [as_setup(m, seed) for m in methods]
    # a method named twice (a name with options and a config object of the same are one), a folder or patched
    # layers given twice; a folder or layers of some layers read as their method's setup, and are not that method
    # on every layer, so they are told apart from names by what they are
    named = [
        ("layers", tuple(sorted((i, id(x)) for i, x in m.items()))) if isinstance(m, dict)
        else ("folder", os.path.realpath(m)) if saved_folder(m)
        else (s.method, s.config())
        for s, m in zip(setups, methods, strict=True)
    ]  # fmt: skip
    for i, s in enumerate(setups):
        if named[i] in named[:i]:
            label = short_label({"name": s.method, **s.config()})
            raise ValueError(f"{label} is given twice: each method is evaluated once, beside full attention")
    for s, given in zip(setups, methods, strict=True):
        if s.method == PER_LAYER:  # a saved folder: its layers are built as saved, state included
            continue
        spec, fitted = get_method(s.method), isinstance(given, dict) or saved_folder(given)
        if not fitted and spec.requires_fit(spec.make_config(**s.options)):
            raise ValueError(
                f"{s.method} must be fitted before it is evaluated: fit it (`approx fit ... --output-dir OUT`, then "
                "pass OUT as the method), or in Python approx.fit(model, data) and pass its layers: "
                "layers = approx.patched_layers(model); approx.unpatch(model); evaluate(model, task, [layers], ...)"
            )
    return setups


def _extend(model, tokenizer, length: int, stack: contextlib.ExitStack) -> dict[str, Any] | None:
    """Let the model read inputs of ``length`` tokens (the longest input of the evaluation) when its learned
    position table is shorter: the trained rows copied block after block (:func:`approx.extend_positions`) for
    the evaluation only (a model object passed in gets its own table back afterwards). What was done, for the
    result; None when nothing was needed. A model that cannot be extended is refused with what was found."""
    limit = limit_for(model, length, tokenizer)  # (refuses what cannot be extended)
    if limit is None or length <= limit:
        return None
    trained = trained_positions(model)
    stack.enter_context(extended_positions(model, length, tokenizer=tokenizer))
    log.warning("inputs of up to %d tokens are longer than the model's %d learned positions: extended them for "
                "this evaluation (trained rows copied block after block, as Longformer did)", length, limit)  # fmt: skip
    return {
        "extended_from": limit,
        "extended_to": length,
        "trained_positions": trained,
        "rule": "approx.extend_positions: the trained position rows copied block after block (Longformer, §5)",
    }


def _restore_modes(modes: list[tuple[torch.nn.Module, bool]]) -> None:
    for module, training in modes:
        module.training = training


def _prepare(
    model, tokenizer, task: Task, *, split, source, data_dir, limit, max_length, device, state, progress, stack, methods
):
    """Check the checkpoint's head and the data before loading any weights, then load the model (its positions
    extended when ``max_length`` is above its limit) and the features."""
    if isinstance(model, str):
        check_checkpoint_supported(model)  # (a GPT-2 is unsupported, not a model without a task head)
    head = (
        task.head_for(checkpoint_heads(model)) if isinstance(model, str) else model_head_from_name(type(model).__name__)
    )
    mode = task.mode_for(head)
    split = split or task.default_split
    examples, where = task.load(split, source=source, data_dir=data_dir, limit=limit)
    if isinstance(model, str):
        _say_if_trained_on(model, task, split)
        _say_if_fitted_elsewhere(model, methods)
        _check_own_weights(model, methods)
    model, tokenizer, model_name = _resolve_model(model, tokenizer, head, progress)
    from .provenance import weights_digest

    # the weights, before positions are extended (None where they give no digest): a path's are what it held when
    # it was read, and a model object's name may be the checkpoint it started from
    weights = {"model_weights_sha256": weights_digest(model), "model_dtype": _dtypes(model)}
    if device is not None:
        device = torch.device(device)
    else:
        device = state.device if state.num_processes > 1 else next(model.parameters()).device
    inner = patched_within(model)
    if is_patched(model) or inner is not None:
        which = "the model" if is_patched(model) else f"the model's {inner}"
        raise ValueError(
            f"{which} is patched: unpatch it and pass its layers as a method, e.g. layers = "
            "approx.patched_layers(model); approx.unpatch(model); evaluate(model, task, [layers])"
        )
    # a caller's model in training mode (evaluation in the middle of training) gets every module's mode back
    stack.callback(_restore_modes, [(m, m.training) for m in model.modules()])
    model.to(device).eval()
    model_info = task.prepare(model, mode)
    features = task.features(examples, tokenizer, max_length=max_length, mode=mode)
    special = set(tokenizer.all_special_ids)
    if features and all(special.issuperset(f.input_ids) for f in features):  # stops at the first with some text
        raise ValueError(
            f"max_length={max_length} leaves no room for the text: every input is special tokens only (e.g. "
            f"{tokenizer.convert_ids_to_tokens(features[0].input_ids)}); give more (the task's default is "
            f"{task.default_max_length})"
        )
    positions = _extend(model, tokenizer, max((len(f.input_ids) for f in features), default=0), stack)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    main = state.is_main_process
    return _Run(
        model, model_name, task, mode, split, examples, where, features, device, pad_id, model_info, positions, main,
        weights,
    )  # fmt: skip


def _dtypes(model: torch.nn.Module) -> str | None:
    """The dtypes of the model's floating-point parameters, as torch names them without ``torch.`` (``"float32"``;
    ``"bfloat16, float32"`` for a mix), None without any."""
    found = {str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()}
    return ", ".join(sorted(found)) or None


def _read_record(file: Path, key: str) -> Any:
    """``key`` of a JSON record this harness wrote (``finetune.json``, ``approx_fit.json``), or None: no such file,
    or not this harness's record, about which there is nothing to say."""
    try:
        record = json.loads(file.read_text()) if file.is_file() else {}
        return record.get(key) if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None


def _say_if_trained_on(model: str, task: Task, split: str) -> None:
    """Warn when a checkpoint fine-tuned here (its ``finetune.json``) trained on examples of the split evaluated:
    its scores there are not held out."""
    file = Path(model) / "finetune.json"
    trained = _read_record(file, "train_split") if _read_record(file, "task") == task.name else None
    if isinstance(trained, str) and splits_overlap(trained, split):
        warnings.warn(
            f"approx: {model} was fine-tuned on {task.name} {trained} (its finetune.json), which shares examples with "
            f"the split evaluated, {split}: its scores there are not held out",
            stacklevel=4,
        )


def _check_own_weights(model: str, methods: Sequence) -> None:
    """A folder given both as the model and as a method (``approx eval --model F --method F``) is refused when its
    checkpoint is not the one ``approx.save`` wrote beside its settings (:func:`approx.saved.check_checkpoint`), as
    ``approx.load`` refuses it: its settings were saved for other weights."""
    for method in methods:
        if saved_folder(method) and Path(model).exists() and Path(method).resolve() == Path(model).resolve():
            check_checkpoint(method, read_settings(method))


_MADE_ON = (  # a folder's record of the model a tool made it on, and what that model's weights shaped
    (FIT_RECORD, "fitted", "its fitted state learned that model's queries and keys"),
    (AUTOTUNE_RECORD, "tuned", "each layer's method was chosen, and its fidelity measured, on that model's attention"),
)


def _say_if_fitted_elsewhere(model: str, methods: Sequence) -> None:
    """Warn when a folder given as a method was fitted (``approx fit``: its ``approx_fit.json``) or tuned (``approx
    autotune``: its ``approx_autotune.json``) on another model than the one evaluated: its fitted state learned that
    model's queries and keys, its choices were measured on that model. (A folder written by ``approx.save`` from
    Python records no such model: nothing to compare.)"""
    for method in methods:
        for record, made, why in _MADE_ON:
            made_on = _read_record(Path(method) / record, "model") if saved_folder(method) else None
            if made_on is None:
                continue
            # the folder itself as the model: the tool saved into it the checkpoint it worked on (a checkpoint written
            # over it later is refused by its digest, _check_own_weights)
            names = [os.fspath(n) for n in (made_on, method) if isinstance(n, (str, os.PathLike))]
            same = any(n == model or (Path(n).exists() and Path(n).resolve() == Path(model).resolve()) for n in names)
            if not same:
                warnings.warn(
                    f"approx: {method} was {made} on {made_on} (its {record}), not on {model}, the model evaluated: "
                    f"{why}",
                    stacklevel=4,
                )


def _method_layers(model, setups: list[Setup], methods: Sequence, device, local: str | None) -> list[_MethodLayers]:
    """Each method's patched layers, made once so their state is kept across batches, and how the sliding-window
    layers run under it: ``local`` when given, else as a saved folder records it, else their own attention."""
    from .provenance import layers_state_digest

    layers = []
    for s, given in zip(setups, methods, strict=True):
        mode, state = local or "model", None
        if isinstance(given, dict):
            made = {i: lyr.to(device) for i, lyr in given.items()}
            state = {"state_sha256": layers_state_digest(made)}
        elif saved_folder(given):
            made = {i: lyr.to(device) for i, lyr in saved_layers(model, given).items()}
            mode = local or saved_local(given)
            state = {"folder": str(Path(given).resolve()), "state_sha256": layers_state_digest(made)}
        else:
            patch(model, s.method, **s.options)
            made = patched_layers(model)
            unpatch(model)
        check_local(model, attention_modules(model), mode, where=f"{s.label}: local" if local is None else "local")
        layers.append(_MethodLayers(made, mode, state))
    banded = [s.label for s, m in zip(setups, layers, strict=True) if m.local == "band"]
    if banded and device.type != "cpu":  # the kernel would not run, and the results would say it had
        raise ValueError(
            f"local='band' (for {', '.join(banded)}) runs approx's banded kernel on the CPU only; on {device} the "
            "sliding-window layers run their own attention: evaluate there with local='model'"
        )
    return layers


def _check_before_loading(model: Any, local: str | None, allocations: bool, warmup: bool, device: Any) -> None:
    """What can be told before the model and data are loaded: ``local='band'`` for a checkpoint (a path) without
    sliding-window layers; ``allocations`` without a warm-up or with another device asked for."""
    if isinstance(model, str):
        check_checkpoint_local(model, local)
    if allocations:
        _check_allocations(warmup, None if device is None else torch.device(device))


def _check_allocations(warmup: bool, device: torch.device | None) -> None:
    """``allocations=True`` measures the CPU allocator in the warm-up pass: refused without the warm-up, or on a
    ``device`` other than the CPU (None: not known yet)."""
    if not warmup:
        raise ValueError(
            "allocations=True (--allocations) measures the CPU allocator in the warm-up pass: it needs the warm-up "
            "(warmup=True; leave out --no-warmup)"
        )
    if device is not None and device.type != "cpu":
        raise ValueError(
            "allocations=True (--allocations) measures the CPU allocator: it needs the CPU, and this run is on "
            f"{device} (there peak_memory_mib is the allocator's peak)"
        )


def _checked_max_length(task: Task, max_length: Any) -> int:
    """The evaluation's length (the task's default for None), refused unless a positive int."""
    max_length = task.default_max_length if max_length is None else max_length
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be a positive int, got {max_length!r}")
    return max_length


def _results(
    run: _Run,
    setups,
    records,
    settings: dict[str, Any],
    prov,
    predictions: bool,
    intervals: dict[str, Any] | None,
    layers: list[_MethodLayers],
) -> list[dict[str, Any]]:
    """One self-describing result per method from the gathered batch records; ``intervals``: the options of
    :func:`~approx.harness.resampling.paired_interval` (resamples, level, seed), or None for none; ``layers``: each
    method's layers (how its model ran its sliding-window layers, and the state of layers given as they are)."""
    local = [m.local for m in layers]
    task, mode, examples, n = run.task, run.mode, run.examples, len(run.features)
    ref_predictions = task.predict(examples, run.features, _in_feature_order(records, n), mode)
    reference_metrics = task.score(examples, ref_predictions, mode)
    n_layers, n_heads, head_dim = attention_shape(run.model)
    digest = examples_digest(examples)  # which examples were scored, whatever file or folder they came from
    results = []
    for s, setup in enumerate(setups):
        method_predictions = task.predict(examples, run.features, _in_feature_order(records, n, s), mode)
        sums = fid.total_sums(r["setups"][s]["sums"] for r in records)
        protocol = task.protocol(mode, settings["max_length"])
        if run.positions:
            p = run.positions
            trained, rows = p["trained_positions"], p["extended_from"]
            had = f"{rows} learned positions" if trained == rows else f"{rows} positions ({trained} of them trained)"
            protocol += (
                f"; the model's {had} extended to {p['extended_to']} (the trained rows copied block after block)"
            )
        if local[s] == "band":
            protocol += "; the sliding-window layers on approx's banded kernel (local='band'), full attention unpatched"
        result = {
            "task": task.name,
            "task_version": task.version,
            "mode": mode,
            "split": run.split,
            "protocol": protocol,
            "model": run.model_name,
            **(run.weights or {}),
            "model_shape": {"attention_layers": n_layers, "heads": n_heads, "head_dim": head_dim},
            **({"positions": run.positions} if run.positions else {}),
            **run.model_info,
            "method": {"name": setup.method, **setup.config()},
            **({"method_state": layers[s].state} if layers[s].state is not None else {}),
            **({"local": local[s]} if local[s] != "model" else {}),
            "metrics": task.score(examples, method_predictions, mode),
            "reference_metrics": reference_metrics,
            "fidelity": fid.summarize(task, mode, sums, ref_predictions, method_predictions),
            **(
                {"intervals": paired_interval(task, mode, examples, method_predictions, ref_predictions, **intervals)}
                if intervals is not None and reference_metrics and len(ref_predictions) > 1
                else {}
            ),
            "examples": len(ref_predictions),
            "examples_digest": digest,
            "features": n,
            **settings,
            "provenance": prov,
        }
        if predictions:  # what merging cross-fitted halves needs (approx.harness.crossfit)
            result.update(
                predictions=method_predictions,
                reference_predictions=ref_predictions,
                fidelity_sums=sums,
            )
        results.append(result)
        if run.main_process:  # once, not by every process
            _say_if_exact(result)
    for note in undefined_notes(results) if run.main_process else []:  # in words, rather than a NaN in a table
        warnings.warn(f"approx: {note}", stacklevel=3)  # evaluate's caller
    if run.main_process and results and intervals is not None and reference_metrics and len(ref_predictions) < 2:
        warnings.warn(  # rather than a column that is silently not there
            f"approx: no intervals: a paired bootstrap needs at least 2 examples, and {len(ref_predictions)} was "
            "evaluated",
            stacklevel=3,
        )
    return results


def _nan(x: Any) -> bool:
    """NaN, or None: how a NaN reads back from a result's JSON (non-finite numbers are written as null)."""
    return x is None or (isinstance(x, float) and math.isnan(x))


def undefined_notes(results: list[dict[str, Any]]) -> list[str]:
    """Sentences for task metrics and intervals that are NaN (undefined): too few examples, or constant labels or
    predictions (a correlation over one example or of a constant column; Matthews' coefficient is 0, not NaN, when
    labels or predictions are of one class, as in scikit-learn and GLUE)."""
    if not results:
        return []
    n = results[0]["examples"]
    counted = f"{n} example{'' if n == 1 else 's'} evaluated"
    why = f"undefined on the {counted} (too few, or constant labels or predictions)"
    seen = [m for m, v in results[0]["reference_metrics"].items() if _nan(v)]
    notes = [f"full attention's {', '.join(seen)}: {why}"] if seen else []
    for r in results:
        label = result_label(r)
        bad = [m for m, v in r["metrics"].items() if _nan(v) and m not in seen]
        if bad:
            notes.append(f"`{label}`'s {', '.join(bad)}: {why}")
        spans = r.get("intervals", {}).get("metrics", {})
        loose = [m for m, e in spans.items() if (_nan(e["low"]) or _nan(e["high"])) and m not in seen + bad]
        if loose:
            notes.append(
                f"`{label}`'s interval of {', '.join(loose)}: undefined, as some resamples of the {counted} leave the "
                "metric undefined (too few examples, or constant labels or predictions)"
            )
    return notes


def result_label(result: dict[str, Any]) -> str:
    """A result's label: its method's (:func:`~approx.harness.spec.short_label`), and the layers it patched when they
    are not all the model's (``favor[layers 4-5 of 6]``: a folder or patched layers of some layers only carry
    their method's name, and two results of different models would read the same); `` +band`` at the end when the
    model's sliding-window layers ran on approx's banded kernel (``"local"``)."""
    label = short_label(result["method"])
    band = " +band" if result.get("local") == "band" else ""
    layers = (result.get("fidelity", {}).get("cost") or {}).get("layers") or {}
    patched, total = layers.get("patched"), layers.get("total")
    if result["method"]["name"] == PER_LAYER or not patched or total is None or len(patched) == total:
        return label + band
    return f"{label}[layers {layer_spans(patched)} of {total}]{band}"


def _say_if_exact(result: dict[str, Any]) -> None:
    """Warn when a method's attention equalled exact attention's on every input and layer: nothing it scored is its
    approximation's (the report lists every method's share under its table, :func:`_exact_lines`)."""
    exact = result["fidelity"].get("exact_inputs") or {}
    if result["method"]["name"] != "full" and exact.get("share") == 1.0:
        warnings.warn(
            f"{result_label(result)}: equalled exact attention on every input and layer ({exact['measured']} "
            f"layer inputs): these inputs are {_WITHIN_BUDGET}, so its results are exact attention's and say nothing "
            "about its approximation (longer inputs or a smaller budget would)",
            stacklevel=4,  # evaluate's caller
        )


# what makes a method's attention exact on an input, for the warning above and the report's list
_WITHIN_BUDGET = (
    "within its budget (at most as many tokens as clusters, a window or pattern covering every pair, a fallback on "
    "short inputs)"
)


def evaluate(
    model: str | os.PathLike | torch.nn.Module,
    task: str | Task,
    methods: Sequence[str | Setup | MethodConfig] | str | Setup | MethodConfig,
    *,
    tokenizer: Any = None,
    split: str | None = None,
    data_dir: str | None = None,
    source: str | None = None,
    limit: int | None = None,
    max_length: int | None = None,
    batch_size: int = 32,
    seed: int = 0,
    device: str | torch.device | None = None,
    progress: bool = True,
    predictions: bool = False,
    warmup: bool = True,
    allocations: bool = False,
    resamples: int | None = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
    local: str | None = None,
) -> list[dict[str, Any]]:
    """Evaluate ``task`` on ``model`` under each of ``methods`` and under full attention, on the same batches.

    ``model``: a local folder (a string or a ``pathlib.Path``) or hub id (the head the task needs is read from
    the checkpoint), or a loaded model with its ``tokenizer``. ``methods``: a list of (or one of) names with options
    (``"clustered:clusters=25"``), :class:`~approx.harness.spec.Setup` or config objects, the layers of a patched
    model (``approx.patched_layers(model)``, e.g. fine-tuned with its method; unpatch the model first), or folders
    written by :func:`approx.save` / ``approx fit`` (its layers, with their fitted or drawn state). Returns one
    self-describing result per method. ``predictions``: also return the per-example predictions under the method
    and under full attention (``"predictions"``, ``"reference_predictions"``, in the split's example order) and
    the fidelity sums (``"fidelity_sums"``), to score the two halves of a cross-fitted split together
    (:mod:`approx.harness.crossfit`).

    ``warmup``: every pass first run once, untimed, on the longest batch, so compilation is not timed (``"warmup"``).
    ``resamples`` (0: none), ``level``: each result's ``"intervals"`` (:func:`approx.harness.resampling.paired_interval`).
    ``local``: the sliding-window layers' mode (:func:`approx.patch`; None: a folder's own); ``"band"``: CPU only.

    ``allocations`` (CPU only, with the warm-up): full attention and every method run once more on that longest
    batch, untimed, under torch's profiler, whose memory events give the CPU allocator's peak
    (``fidelity.allocated_peak_mib_per_input`` and its reference twin): what the forward pass holds at once, where
    the peak-RSS delta of ``peak_memory_mib`` reads 0 whenever the C allocator reuses memory it kept (CUDA: the
    allocator's peak). Under several processes each measures its own longest batch; the largest is kept.

    ``max_length`` (default: the task's): when the task's inputs are longer than the model's learned positions,
    the positions are extended for this evaluation (:func:`approx.extend_positions`; a model object passed in
    gets its own table back afterwards) and every result says so (``"positions"``, its ``protocol`` and
    ``provenance``); a model whose positions cannot be extended is refused before anything runs.
    """
    wall = time.perf_counter()
    if isinstance(model, os.PathLike):  # e.g. the MiniLM wheel's get_model_path()
        model = os.fspath(model)
    from accelerate import PartialState
    from accelerate.utils import gather_object

    from .provenance import mark_start, provenance

    mark_start()
    check_device(device, "device")  # (an unknown one: torch's error below would not name the argument)
    # without a GPU (or with device="cpu"), processes started by `accelerate launch` / torchrun join on CPU (gloo)
    cpu = (device is not None and torch.device(device).type == "cpu") or not torch.cuda.is_available()
    state = PartialState(cpu=cpu)
    task = get_task(task) if isinstance(task, str) else task
    methods = _method_list(methods)
    setups = _setups(methods, seed, batch_size, local)
    intervals = interval_options(resamples, level, seed)  # checked before anything is loaded
    max_length = _checked_max_length(task, max_length)
    _check_before_loading(model, local, allocations, warmup, device)
    torch.manual_seed(seed)
    with contextlib.ExitStack() as stack:  # undoes a position extension on the way out
        run = _prepare(
            model, tokenizer, task, split=split, source=source, data_dir=data_dir, limit=limit,
            max_length=max_length, device=device, state=state, progress=progress, stack=stack, methods=methods,
        )  # fmt: skip
        if allocations:  # the device the run took (a model object's own, say)
            _check_allocations(warmup, run.device)
        layers = _method_layers(run.model, setups, methods, run.device, local)
        order = sorted(range(len(run.features)), key=lambda i: -len(run.features[i].input_ids))
        batches = [(b, order[i : i + batch_size]) for b, i in enumerate(range(0, len(order), batch_size))]
        labels = [short_label({"name": s.method, **s.config()}) for s in setups]
        with torch.inference_mode():
            mine = batches[state.process_index :: state.num_processes]
            records = _run_batches(run, mine, layers, labels, progress and state.is_main_process, warmup, allocations)
    if state.num_processes > 1:
        records = gather_object(records)
    records.sort(key=lambda r: r["batch"])
    peaks = [x["sums"]["reference_peak_mib"] for r in records for x in r["setups"][:1]]
    peaks += [x["sums"]["peak_mib"] for r in records for x in r["setups"]]
    prov = provenance(
        seed=seed,
        device=run.device,
        processes=state.num_processes,
        wall_seconds=time.perf_counter() - wall,
        peak_memory_mib=max((p for p in peaks if p is not None), default=None),
        memory_measure=PeakMemory(run.device).method,
        data_source=run.source.describe(),
        **({"positions": run.positions} if run.positions else {}),
    )
    settings = dict(max_length=max_length, batch_size=batch_size, limit=limit, warmup=warmup, allocations=allocations)
    return _results(run, setups, records, settings, prov, predictions, intervals, layers)


# hidden-state cosines shown after the last layer's, when every result has them (older result files do not)
_EXTRA_COSINES = (("worst_feature", "worst input cos"), ("pooled", "pooled cos"))


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:.{digits}f}"
    return str(x)


def markdown_report(results: list[dict[str, Any]], *, model_label: str | None = None) -> str:
    """One table: the unpatched model, then every method: task metrics (and, when every result has its interval, the
    primary metric's difference from full attention with its paired bootstrap interval), fidelity, cost, time, memory.

    ``model_label``: the model's name in the heading (default: the results' ``model``). The hidden-state
    columns for the worst input and pooled states are shown when the results have them."""
    if not results:
        return ""
    first = results[0]
    keys = ("task", "task_version", "mode", "examples")
    differ = [k for k in keys if any(r.get(k) != first.get(k) for r in results)]
    levels = {r["intervals"]["level"] for r in results if "intervals" in r}
    if differ or len(levels) > 1:
        parts = [f"{k} ({', '.join(map(str, dict.fromkeys(r.get(k) for r in results)))})" for k in differ]
        parts += [f"interval level ({', '.join(level_label(x) for x in sorted(levels))})"] if len(levels) > 1 else []
        what = ", ".join(parts)
        raise ValueError(
            f"markdown_report makes one table of one evaluation's results (one full-attention row, one header); "
            f"these differ in {what}: report each evaluation on its own"
        )
    metric_names = list(first["reference_metrics"])
    task_fid = [k for k in ("agreement", "kl_divergence", "mean_abs_difference") if k in first["fidelity"]]
    cosines = [("last", "hidden cos (last)")]
    cosines += [(k, h) for k, h in _EXTRA_COSINES if all(k in r["fidelity"]["hidden_state_cosine"] for r in results)]
    primary = first.get("intervals", {}).get("primary")
    with_interval = all(r.get("intervals", {}).get("metrics", {}).get(primary) for r in results)
    level = results[0]["intervals"]["level"] if with_interval else None
    head = ["method", *metric_names]
    head += [f"{primary} vs full ({level_label(level)} interval)"] if with_interval else []
    head += [*task_fid, *(h for _, h in cosines)]
    matmul = all(r["fidelity"]["cost"].get("matmul_vs_softmax_model") is not None for r in results)
    head += ["attn rel. err", "attn FLOPs vs full", *(["matmul vs softmax (model)"] if matmul else [])]
    head += ["seconds", "speed vs full", "peak MiB"]
    rows = [
        f"**{first['task']}** v{first['task_version']} ({first['mode']}, {first['examples']} examples) on "
        f"`{model_label or first['model']}`",
        "",
        "| " + " | ".join(head) + " |",
        "|" + " --- |" * len(head),
    ]
    ref_fid = first["fidelity"]
    ref_row = ["full (unpatched)", *(_fmt(first["reference_metrics"][m], 2) for m in metric_names)]
    ref_row += ["-"] * (len(task_fid) + with_interval) + ["1.0000"] * len(cosines)
    ref_row += ["0", "1.00", *(["1.00"] if matmul else []), _fmt(ref_fid["reference_seconds"], 2), "1.00x"]
    ref_row.append(_fmt(ref_fid["reference_peak_memory_mib"], 1))
    rows.append("| " + " | ".join(ref_row) + " |")
    for r in results:
        f = r["fidelity"]
        row = [result_label(r), *(_fmt(r["metrics"].get(m), 2) for m in metric_names)]
        row += [interval_text(r["intervals"]["metrics"][primary])] if with_interval else []
        row += [_fmt(f[k]) for k in task_fid]
        row += [_fmt(f["hidden_state_cosine"][k]) for k, _ in cosines]
        row += [
            _fmt(f["attention_relative_error"]["mean"]),
            _fmt(f["cost"]["flops_vs_full"], 3),
            *([_fmt(f["cost"]["matmul_vs_softmax_model"], 3)] if matmul else []),
            _fmt(f["seconds"], 2),
            f"{f['speedup']:.2f}x" if f["speedup"] else "-",
            _fmt(f["peak_memory_mib"], 1),
        ]
        rows.append("| " + " | ".join(row) + " |")
    exact = _exact_lines(results)
    undefined = [f"- {note}" for note in undefined_notes(results)]
    return "\n".join(rows + ([""] + exact if exact else []) + ([""] + undefined if undefined else []))


def _exact_lines(results: list[dict[str, Any]]) -> list[str]:
    """The report's lines on the methods that ran exact attention on some inputs (``fidelity.exact_inputs``), or
    none."""
    lines = []
    for r in results:
        exact = r["fidelity"].get("exact_inputs") or {}
        if not exact.get("share") or r["method"]["name"] == "full":
            continue
        what = (
            f"all {exact['measured']}: its results are exact attention's and say nothing about its approximation"
            if exact["share"] == 1.0
            else f"{exact['matched']} of {exact['measured']} ({exact['share']:.1%})"
        )
        lines.append(f"- `{result_label(r)}`: {what}")
    head = f"Layer inputs on which a method equalled exact attention, being {_WITHIN_BUDGET}:"
    return [head, "", *lines] if lines else []
