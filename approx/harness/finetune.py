"""Fine-tuning, patched or not, with ``accelerate``: the checkpoints the evaluation harness compares.

::

    approx.finetune("path/or/hub-id", "rte", output_dir="ckpt/rte")                       # plain fine-tuning
    approx.finetune("path/or/hub-id", "rte", output_dir="ckpt/rte-favor", method="favor")  # patched model

The model gets the task's head (a fresh one when the checkpoint has none), is optionally patched, and is
trained with AdamW and a linear warm-up / decay schedule through an ``accelerate.Accelerator``, so the same
code runs on CPU, one GPU, mixed precision (``mixed_precision="bf16"``) or several processes under
``accelerate launch``. Training state is checkpointed to ``output_dir/checkpoint`` at the end of every epoch
(and every ``checkpoint_every`` steps), and ``resume=True`` continues from it where it stopped. At the end the
model is saved as a normal Hugging Face checkpoint (with ``approx_config.json`` and the method state when
patched, see :func:`approx.save`), with ``finetune.json`` recording the settings, losses and provenance, and
evaluated on ``eval_split`` with :func:`approx.evaluate` when one is given.

The training settings are a :class:`FinetuneConfig` (its defaults are the only ones; ``approx finetune``'s
flags are generated from it), given as keyword arguments or as ``config=``.

Cross-fitting, for tasks whose train split is not available offline: ``train_split="dev/0",
eval_split="dev/1"`` and then the swap (see :func:`approx.harness.tasks.base.cross_fit_half`).

Masked-LM training (``wikitext2`` / ``wikitext103``, e.g. ``train_split="valid"``): a bare encoder gets a
masked-LM head (``AutoModelForMaskedLM``: the decoder tied to the word embeddings, which is checked, the rest of
the head fresh); the task masks the training windows anew in every epoch
(:meth:`~approx.harness.tasks.base.Task.train_batch`), and the loss projects onto the vocabulary only the masked
positions (:func:`masked_lm_loss`), the same cross-entropy as the model's own loss without the (B, N, V) logits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
from tqdm.auto import tqdm

from .. import _json
from ..config import MethodConfig, option
from ..integration import (
    check_saved_model,
    checkpoint_heads,
    load_method_state,
    load_pretrained,
    local_mode,
    own_attention_dropout,
    patch,
    patched_layers,
    record_redraw_seed,
    save,
    save_method_state,
    saved_local,
    unpatch,
)
from ..integration import redraw as redraw_layers
from ..layer import warn_seed_record
from ..positions import extend_positions, limit_for, trained_positions
from ..registry import get_method
from ..saved import SETTINGS_FILE, STATE_FILE, read_settings, read_state
from .spec import PER_LAYER, Setup, as_setup, layer_entries, saved_folder
from .tasks import Feature, Task, get_task
from .tasks.base import collate, parse_split, splits_overlap

__all__ = ["FinetuneConfig", "finetune", "masked_lm_loss"]

STATE_DIR = "checkpoint"
PROGRESS_FILE = "progress.json"
MIXED_PRECISION = ("no", "fp16", "bf16")
MASKED_LM = "masked-lm"
IGNORE = -100  # label of the positions a token-level loss skips


@dataclasses.dataclass(frozen=True)
class FinetuneConfig(MethodConfig):
    """Fine-tuning settings: AdamW with a linear warm-up / decay schedule, through ``accelerate``."""

    method: ClassVar[str] = "finetune"  # the name errors are reported under

    epochs: float = option(3.0, "training epochs (may be fractional)")
    max_steps: int | None = option(
        None, "optimizer steps, in place of the epochs (as transformers' Trainer; default: none, the epochs decide)"
    )
    learning_rate: float = option(5e-5, "AdamW peak learning rate")
    weight_decay: float = option(0.01, "AdamW weight decay (not applied to biases and LayerNorm weights)")
    warmup: float = option(0.1, "share of steps with linear warm-up")
    batch_size: int = option(32, "inputs per batch (per process)")
    max_length: int | None = option(None, "max tokens per input (default: the task's)")
    seed: int = option(0, "seed of the data order, a fresh head's weights and the method's random state")
    mixed_precision: str = option("no", "accelerate mixed precision: no, fp16 (GPU only) or bf16")
    redraw_every: int | None = option(None, "redraw the method's random state every N steps (default: never)")
    checkpoint_every: int | None = option(None, "also save training state every N steps (default: every epoch)")
    attention_dropout: float | None = option(
        None,
        "dropout on the attention probabilities while training (default: the model's own); 0 lets exact attention "
        "keep its fused SDPA kernels in training (about 6x faster per step at 4096 tokens on a CPU); the saved "
        "config keeps the model's own value",
    )

    def check(self) -> None:
        self.require(self.epochs > 0, "epochs", "must be positive")
        self.require(self.max_steps is None or self.max_steps >= 1, "max_steps", "must be at least 1")
        self.require(self.learning_rate > 0, "learning_rate", "must be positive")
        self.require(self.weight_decay >= 0, "weight_decay", "must not be negative")
        self.require(0 <= self.warmup < 1, "warmup", "is a share of the steps, 0 <= warmup < 1")
        self.require(self.batch_size >= 1, "batch_size", "must be at least 1")
        self.require(self.max_length is None or self.max_length >= 3, "max_length", "must be at least 3")
        self.require(self.mixed_precision in MIXED_PRECISION, "mixed_precision", f"one of {', '.join(MIXED_PRECISION)}")
        for name in ("redraw_every", "checkpoint_every"):
            self.require(getattr(self, name) is None or getattr(self, name) >= 1, name, "must be at least 1")
        p = self.attention_dropout
        self.require(p is None or 0 <= p < 1, "attention_dropout", "a probability, 0 <= p < 1")


def _batch(features: list[Feature], pad_id: int) -> dict[str, torch.Tensor]:
    inputs = collate(features, pad_id, torch.device("cpu"))
    for name in features[0].extra["labels"]:
        values = [f.extra["labels"][name] for f in features]
        if isinstance(values[0], list):  # one label per token: padded positions are ignored by the loss
            n = inputs["input_ids"].shape[1]
            values = [v + [IGNORE] * (n - len(v)) for v in values]
        inputs[name] = torch.tensor(values, dtype=torch.float32 if isinstance(values[0], float) else torch.long)
    return inputs


class _Collate:
    """Training batches: the task's features for the epoch the training loop sets (``Task.train_batch``: e.g.
    masked-LM's masks, drawn anew every epoch), padded and stacked with their labels."""

    def __init__(self, task: Task, tokenizer: Any, seed: int) -> None:
        self.task, self.tokenizer, self.seed, self.epoch = task, tokenizer, seed, 0
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def __call__(self, features: list[Feature]) -> dict[str, torch.Tensor]:
        drawn = self.task.train_batch(features, self.tokenizer, epoch=self.epoch, seed=self.seed)
        return _batch(drawn, self.pad_id)


def masked_lm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], decoder: torch.nn.Module) -> torch.Tensor:
    """The masked-LM cross-entropy of ``model`` (with a masked-LM head) on ``batch`` (labels -100 where no loss is
    taken), projecting onto the vocabulary only the labelled positions: the hidden states reaching ``decoder``
    (the model's output embeddings, the (H -> V) projection) are cut to those rows first. The model's own loss
    computes (B, N, V) logits, of which masked-LM training uses 15 %; the result is the same number. A head that reads
    the decoder's weights without calling it (MobileBERT's) never reaches the hook: its (B, N, V) logits are cut
    afterwards."""
    inputs = dict(batch)
    labels = inputs.pop("labels")
    keep = labels != IGNORE  # (B, N)
    called = []

    def rows(module, args):  # (B, N, H) -> (M, H)
        called.append(True)
        return (args[0][keep], *args[1:])

    hook = decoder.register_forward_pre_hook(rows)
    try:
        logits = model(**inputs).logits  # (M, V), or (B, N, V) when the decoder was not called
    finally:
        hook.remove()
    if not called:
        logits = logits[keep]
    return torch.nn.functional.cross_entropy(logits, labels[keep])  # under autocast: in float32


def _head(net: torch.nn.Module, model: str, head: str) -> dict[str, Any]:
    """What the training head is: its name, whether the checkpoint had it, and for a masked-LM head whether its
    decoder is tied to the word embeddings (refused when the config asks for a tie that does not hold)."""
    record: dict[str, Any] = {"name": head, "fresh": head not in checkpoint_heads(model)}
    if head == MASKED_LM:
        decoder, embeddings = net.get_output_embeddings(), net.get_input_embeddings()
        tied = decoder.weight.data_ptr() == embeddings.weight.data_ptr()
        if getattr(net.config, "tie_word_embeddings", True) and not tied:
            raise RuntimeError(
                f"{type(net).__name__}: the masked-LM decoder is not tied to the word embeddings although the config "
                "asks for it (tie_word_embeddings); refusing to train an untied head"
            )
        record["tied_to_word_embeddings"] = tied
    return record


def _trains_on_cpu() -> bool:
    """Whether accelerate will train on the CPU: ``_start`` asks for it without CUDA, and ``ACCELERATE_USE_CPU``
    (``accelerate launch --cpu``) forces it (read before an ``Accelerator`` is made, whose state is process-wide)."""
    from accelerate.utils import parse_flag_from_env

    return not torch.cuda.is_available() or parse_flag_from_env("ACCELERATE_USE_CPU")


def _schedule(optimizer, warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclasses.dataclass
class _Training:
    """One fine-tuning run: the prepared (accelerate) objects and where training stands."""

    accelerator: Any
    net: Any
    optimizer: Any
    loader: Any
    scheduler: Any
    sampler: _EpochSampler
    collate: _Collate
    tokenizer: Any
    setup: Setup | None
    config: FinetuneConfig
    state_dir: Path
    features: int
    steps_per_epoch: int
    total: int
    head: dict[str, Any]
    positions: dict[str, Any] | None = None  # set when the learned positions were extended to max_length
    dropout_key: tuple[str, float] | None = None  # (config key, the model's own value) when training overrides it
    run: dict[str, Any] | None = None  # what a resume must ask for again (:func:`_run_record`)
    run_id: str = ""  # this run's, in its checkpoints and its record: a record of another run is not its end
    step: int = 0
    losses: list[float] = dataclasses.field(default_factory=list)


def _accelerator(mixed_precision: str):
    """accelerate's ``Accelerator`` in ``mixed_precision``. accelerate keeps one state per process, set by its first
    ``Accelerator``, and refuses another precision after it ("restart your runtime"): a second ``finetune`` call in
    one Python process (a notebook comparing bf16 with float32) gets a fresh state when an earlier ``finetune`` made
    the one there, in a process that runs alone, and no other run is under way in it. A state the caller's own
    ``Accelerator`` made is not reset (every ``Accelerator`` reads that one state: theirs would change precision
    under them), nor one shared by several processes (``accelerate launch``), nor one another thread's run trains
    on: another precision is refused there, with what to do. An ``Accelerator`` the caller makes after a
    ``finetune`` shares its state, which a later ``finetune`` in another precision resets."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, DistributedType

    state = AcceleratorState._shared_state
    held = state.get("_mixed_precision")
    if held is not None and held != mixed_precision:
        if state.get("distributed_type", DistributedType.NO) != DistributedType.NO:
            raise ValueError(
                f"mixed_precision {mixed_precision!r}: this process already trains under accelerate in {held!r} "
                "across several processes, whose state cannot change: launch a new run for the other precision"
            )
        if state.get(_MADE_HERE) is not True:
            raise ValueError(
                f"mixed_precision {mixed_precision!r}: an Accelerator of yours already set this process's accelerate "
                f"state to {held!r}, and approx does not change it under you: fine-tune with "
                f"mixed_precision={held!r}, or in a fresh process"
            )
        if _RUNNING[0] > 1:  # (this run counts itself)
            raise ValueError(
                f"mixed_precision {mixed_precision!r}: another finetune runs in this process (another thread) in "
                f"{held!r}, on accelerate's one state: fine-tune with mixed_precision={held!r}, or after it ends"
            )
        AcceleratorState._reset_state()  # one process, a state an earlier finetune made: the precision asked for
    fresh = not state
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=not torch.cuda.is_available())
    if fresh:
        state[_MADE_HERE] = True  # (in accelerate's shared state, so that a reset by anyone else forgets it)
    return accelerator


_MADE_HERE = "_approx_finetune_made_it"  # a key of accelerate's shared state: the state was made by finetune


_RUNNING = [0]  # finetune runs under way in this process (threads), this one included: none resets the state then
_RUNNING_LOCK = threading.Lock()


@contextlib.contextmanager
def _accelerate_state():
    """Count a run as under way, so that another run's :func:`_accelerator` does not reset the accelerate state it
    trains on. (Resetting a run's own state when it ended was tried and taken out: an ``Accelerator`` a callback
    made, or another thread's run, shared that state and broke.)"""
    with _RUNNING_LOCK:
        _RUNNING[0] += 1
    try:
        yield
    finally:
        with _RUNNING_LOCK:
            _RUNNING[0] -= 1


def _start(
    model: str,
    task: Task,
    examples,
    setup: Setup | None,
    cfg: FinetuneConfig,
    state_dir: Path,
    progress,
    origin=None,
    state_from=None,
):
    """Load the model with the task's head, patch it (a per-layer ``setup`` from ``origin``, the folder or layers it
    was read from, named in errors; ``state_from``: that folder or those layers, whose state the model's layers take:
    drawn or fitted, as they hold it), make the data loader, optimizer and schedule."""
    from accelerate.utils import set_seed

    accelerator = _accelerator(cfg.mixed_precision)
    set_seed(cfg.seed)
    head_name = next(iter(task.modes))
    overrides, dropout_key = {}, None
    if cfg.attention_dropout is not None:  # the model is built with it: every family's modules read their config
        dropout_key = own_attention_dropout(model)
        overrides[dropout_key[0]] = cfg.attention_dropout
    net, tokenizer = load_pretrained(model, task=head_name, progress=progress, **task.head_options(), **overrides)
    head = _head(net, model, head_name)
    if isinstance(origin, (str, os.PathLike)) and saved_folder(origin):  # its layer indices count in this model
        check_saved_model(net, origin)
    if setup is not None and setup.method == PER_LAYER:  # a saved per-layer model (approx.autotune): layer by layer
        # (and a folder's sliding-window layers as it ran them: trained on their own attention, saved as it was)
        local = saved_local(origin) if isinstance(origin, (str, os.PathLike)) and saved_folder(origin) else None
        for entry in setup.options["layers"]:
            try:  # a folder's head or layer the model lacks: say which folder and layer
                patch(
                    net, entry["method"], layers=[entry["layer"]], on_heads=entry.get("heads"), local=local,
                    **entry["config"],
                )  # fmt: skip
            except ValueError as e:  # "layer 7 does not exist ..." names its layer; a head's error does not
                where = "" if str(e).startswith(f"layer {entry['layer']}") else f"layer {entry['layer']}: "
                raise ValueError(f"{origin}: {where}{e}") from None
        _keep_state(net, state_from)
    elif setup is not None:
        patch(net, setup.method, **setup.options)
    features = task.train_features(examples, tokenizer, max_length=cfg.max_length)
    if not features:  # nothing to learn from: a traceback (or a model saved untrained) otherwise
        raise ValueError(f"{task.name}: the training data holds no examples to train on ({len(examples)} read)")
    positions = _extend_for_training(net, tokenizer, cfg.max_length, features)
    sampler, collate = _EpochSampler(len(features), cfg.seed), _Collate(task, tokenizer, cfg.seed)
    # its own generator: making an iterator (every epoch, and on resuming mid-epoch) then draws nothing from the
    # global one, so dropout after a resume continues as in an uninterrupted run
    loader = torch.utils.data.DataLoader(
        features, batch_size=cfg.batch_size, sampler=sampler, collate_fn=collate,
        generator=torch.Generator().manual_seed(cfg.seed),
    )  # fmt: skip
    steps_per_epoch = math.ceil(len(loader) / accelerator.num_processes)
    total = math.ceil(cfg.epochs * steps_per_epoch) if cfg.max_steps is None else cfg.max_steps
    decayed = {n for n, p in net.named_parameters() if p.ndim > 1 and "LayerNorm" not in n}
    groups = [
        {"params": [p for n, p in net.named_parameters() if n in decayed], "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in net.named_parameters() if n not in decayed], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate)
    scheduler = _schedule(optimizer, int(cfg.warmup * total), total)
    net, optimizer, loader, scheduler = accelerator.prepare(net, optimizer, loader, scheduler)
    return _Training(
        accelerator, net, optimizer, loader, scheduler, sampler, collate, tokenizer, setup, cfg, state_dir,
        len(features), steps_per_epoch, total, head, positions, dropout_key,
    )  # fmt: skip


def _extend_for_training(net, tokenizer, max_length: int, features: list[Feature]) -> dict[str, Any] | None:
    """Inputs longer than the model's learned positions: extend them to ``max_length`` for good (the trained
    rows copied block after block, as Longformer did before training at 4096), so the saved checkpoint reads
    that length; refused with what was found when the positions cannot be extended."""
    longest = max((len(f.input_ids) for f in features), default=0)
    limit = limit_for(net, longest, tokenizer)  # (refuses a model whose positions cannot be extended)
    if limit is None or longest <= limit:
        return None
    trained = trained_positions(net)
    extend_positions(net, max_length, tokenizer=tokenizer)
    return {
        "extended_from": limit,
        "extended_to": max_length,
        "trained_positions": trained,
        "rule": "approx.extend_positions (trained rows tiled)",
    }


def _run_record(model: str, task: str, train_split: str, limit, setup: Setup | None, cfg: FinetuneConfig) -> dict:
    """What a run is (the model, the data, the method and every training setting), as its checkpoint records it: a
    resume that asks for anything else is refused (:func:`_check_resume`), since the saved optimizer and schedule
    would carry on with the old values while ``finetune.json`` recorded the new ones."""
    method = None if setup is None else json.loads(_json.dumps({"name": setup.method, **setup.config()}))
    settings = {k: v for k, v in cfg.to_dict().items() if k != "checkpoint_every"}  # may change: trains the same
    return {"model": model, "task": task, "train_split": train_split, "limit": limit, "method": method,
            **json.loads(_json.dumps(settings))}  # fmt: skip


def _progress(state_dir: Path) -> dict[str, Any]:
    """The progress record of the run checkpointed in ``state_dir``; a file that cannot be read is named."""
    path = state_dir / PROGRESS_FILE
    try:
        saved = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not a progress record of a run ({e}); remove the folder to start afresh") from None
    if not (isinstance(saved, dict) and isinstance(saved.get("step"), int) and isinstance(saved.get("losses"), list)):
        raise ValueError(
            f"{path}: not a progress record of a run (no step and losses); remove the folder to start afresh"
        )
    return saved


def _check_resume(state_dir: Path, run: dict[str, Any]) -> None:
    """Refuse a resume whose settings differ from those the run in ``state_dir`` started with, naming each; a
    checkpoint written before runs were recorded is checked on its attention dropout alone."""
    saved = _progress(state_dir)
    started = saved.get("run", {"attention_dropout": saved.get("attention_dropout")})
    differ = [
        (k, v, run.get(k))
        for k, v in started.items()
        if (_used(run.get(k)) != _used(v) if k == "method" else run.get(k) != v)
    ]
    if differ:
        what = "; ".join(f"{k}: started with {v!r}, now {now!r}" for k, v, now in differ)
        raise ValueError(
            f"the run in {state_dir} started with other settings than this resume asks for ({what}): resume with the "
            "same ones, or start afresh in another output folder"
        )


def _used(method: Any) -> Any:
    """A run's method record without the options its other options leave unused (``MethodConfig.unused``): a run
    started with a value for one (recorded before it was refused, or by a run's seed) trains as one without it."""
    if not isinstance(method, dict) or not isinstance(method.get("name"), str):
        return method
    try:
        config_class = get_method(method["name"]).config_class
        unused = config_class(
            **config_class.recorded_options({k: v for k, v in method.items() if k != "name"})
        ).unused()
    except (KeyError, TypeError, ValueError):  # (not a method of today's registry, a per-layer record: as recorded)
        return method
    return {k: v for k, v in method.items() if k not in unused}


def _check_no_unfinished_run(output_dir: Path, state_dir: Path) -> None:
    """Refuse to start afresh over a run that did not finish (stopped by ``stop_after``, or killed: its training
    state is there, and no record of *that* run finishing: a finished record of an earlier run in the folder, with
    another ``run_id``, is not its end), which training would overwrite without a word."""
    if not (state_dir / PROGRESS_FILE).is_file():
        return
    progress = _progress(state_dir)
    try:
        done = json.loads((output_dir / "finetune.json").read_text())
        # ("" and absent both mean a run from before run ids: a legacy checkpoint resumed and finished records "")
        finished = not done.get("partial", True) and (done.get("run_id") or None) == (progress.get("run_id") or None)
    except (OSError, ValueError, AttributeError):
        finished = False
    if not finished:
        step = progress.get("step")
        raise ValueError(
            f"{output_dir} holds a run that did not finish (its training state, at step {step}, in {state_dir}): "
            "continue it with resume=True (--resume), or start afresh in another output folder (or remove this one)"
        )


def _check_not_another_model(model: Any, output_dir: Path) -> None:
    """Refuse to write over a model that no fine-tuning run wrote: the model being fine-tuned itself, or a folder
    holding a checkpoint without ``finetune.json`` (both had been replaced without a word). A folder an earlier run
    wrote is written again, as the same command run twice would."""
    here = output_dir.expanduser().resolve()
    if isinstance(model, str | os.PathLike) and Path(model).expanduser().is_dir():
        if Path(model).expanduser().resolve() == here:
            raise ValueError(
                f"{output_dir} is the model being fine-tuned: the run would write over it; give another output folder"
            )
    if (here / "config.json").is_file() and not (here / "finetune.json").is_file():
        raise ValueError(
            f"{output_dir} holds a model that no fine-tuning run wrote (config.json, no finetune.json): the run would "
            "write over it; give another output folder, or remove that one"
        )


def _resume(tr: _Training) -> None:
    with warnings.catch_warnings():  # the method state loaded is that of the last redraw, whose seed is recorded below
        warnings.filterwarnings("ignore", message=r"approx: the .* state loaded into", category=UserWarning)
        tr.accelerator.load_state(str(tr.state_dir))
        saved = _progress(tr.state_dir)
        if tr.setup is not None and saved.get("method_state"):
            load_method_state(tr.accelerator.unwrap_model(tr.net), tr.state_dir)
    tr.step, tr.losses = saved["step"], saved["losses"]
    tr.run_id = saved.get("run_id", "")  # (a checkpoint written before runs had one: none)
    if tr.setup is not None and saved.get("method_state"):
        seed = _state_seed(tr)
        if seed is not None:  # the loaded state is that of the last redraw: its seed, as redraw records it
            record_redraw_seed(tr.accelerator.unwrap_model(tr.net), seed)


def _state_seed(tr: _Training) -> int | None:
    """The seed the method's random state was last redrawn from at ``tr.step`` (None: never redrawn yet)."""
    every = tr.config.redraw_every
    return tr.config.seed + tr.step // every if every and tr.step >= every else None


def _checkpoint(tr: _Training) -> None:
    tr.accelerator.save_state(str(tr.state_dir))
    if tr.accelerator.is_main_process:
        save_method_state(tr.accelerator.unwrap_model(tr.net), tr.state_dir)
        record = {"step": tr.step, "losses": tr.losses, "method_state": tr.setup is not None,
                  "attention_dropout": tr.config.attention_dropout, "run": tr.run, "run_id": tr.run_id}  # fmt: skip
        (tr.state_dir / PROGRESS_FILE).write_text(json.dumps(record) + "\n")


def _after_step(tr: _Training, stop: int, callback) -> None:
    """Redraw the method's random state, call back and checkpoint when it is time."""
    cfg, unwrap = tr.config, tr.accelerator.unwrap_model
    if cfg.redraw_every and tr.setup is not None and tr.step % cfg.redraw_every == 0:
        redraw_layers(unwrap(tr.net), seed=_state_seed(tr))
    if callback is not None:
        callback(tr.step, unwrap(tr.net))
    every = cfg.checkpoint_every
    if (every and tr.step % every == 0) or tr.step % tr.steps_per_epoch == 0 or tr.step == stop:
        _checkpoint(tr)


def _train(tr: _Training, stop: int, callback, bar) -> None:
    """Optimizer steps until ``stop``, resuming mid-epoch on the batches a full run would have seen."""
    tr.net.train()
    while tr.step < stop:
        epoch, skip = divmod(tr.step, tr.steps_per_epoch)
        tr.sampler.set_epoch(epoch)
        tr.collate.epoch = epoch
        if hasattr(tr.loader, "set_epoch"):  # accelerate keeps its own epoch counter and passes it on
            tr.loader.set_epoch(epoch)
        batches = tr.accelerator.skip_first_batches(tr.loader, skip) if skip else tr.loader
        for batch in batches:
            loss = _loss(tr, batch)
            tr.accelerator.backward(loss)
            tr.optimizer.step()
            tr.scheduler.step()
            tr.optimizer.zero_grad()
            tr.step += 1
            tr.losses.append(float(tr.accelerator.gather(loss.detach()).mean()))
            bar.update(1)
            bar.set_postfix(loss=f"{tr.losses[-1]:.4f}")
            _after_step(tr, stop, callback)
            if tr.step >= stop:
                break


def _loss(tr: _Training, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if tr.head["name"] == MASKED_LM:
        return masked_lm_loss(tr.net, batch, tr.accelerator.unwrap_model(tr.net).get_output_embeddings())
    return tr.net(**batch).loss


def _record(tr: _Training, task: Task, model: str, train_split, eval_split, examples: int) -> dict[str, Any]:
    cfg = tr.config
    return {
        "task": task.name,
        "task_version": task.version,
        "base_model": model,
        "method": None if tr.setup is None else {"name": tr.setup.method, **tr.setup.config()},
        # the seed of the method's random state at the end, when --redraw-every redrew it (the model's settings)
        **({"state_seed": _state_seed(tr)} if tr.setup is not None and _state_seed(tr) is not None else {}),
        "train_split": train_split,
        "limit": (tr.run or {}).get("limit"),  # N training examples as the task's limit reads them, or None: all
        "eval_split": eval_split,
        "head": tr.head,
        **({"positions": tr.positions} if tr.positions else {}),
        "train_protocol": task.train_protocol(cfg.max_length),
        "examples": examples,
        "features": tr.features,
        "settings": {
            "epochs": cfg.epochs,
            "max_steps": cfg.max_steps,
            "steps": tr.total,  # max_steps, or the epochs' steps
            "epochs_run": round(tr.step / tr.steps_per_epoch, 4),  # a partial run: so far
            "learning_rate": cfg.learning_rate,
            "weight_decay": cfg.weight_decay,
            "warmup": cfg.warmup,
            "batch_size": cfg.batch_size,
            "max_length": cfg.max_length,
            "mixed_precision": cfg.mixed_precision,
            "redraw_every": cfg.redraw_every,
            "attention_dropout": cfg.attention_dropout,
        },
        "losses": tr.losses,
    }


def _save_model(tr: _Training, output_dir: Path) -> torch.nn.Module:
    """Write the model as it stands to ``output_dir``: a Hugging Face checkpoint with its tokenizer, plus the
    method's settings and state when patched (:func:`approx.save`), which ``approx eval --model`` reads."""
    net = tr.accelerator.unwrap_model(tr.net)
    if tr.dropout_key is not None:  # a training-time override: the checkpoint keeps the model's own value
        setattr(net.config, *tr.dropout_key)
    if tr.accelerator.is_main_process:
        if tr.setup is not None:
            save(net, output_dir)
        else:
            net.save_pretrained(output_dir)
            _drop_patch_files(output_dir)
        tr.tokenizer.save_pretrained(output_dir)
    return net


def _drop_patch_files(output_dir: Path) -> None:
    """Remove the method settings and state an earlier patched run left in ``output_dir`` (said): they describe that
    run's model, and the plain one saved now would read as patched."""
    stale = [name for name in (SETTINGS_FILE, STATE_FILE) if (output_dir / name).is_file()]
    for name in stale:
        (output_dir / name).unlink()
    if stale:
        warnings.warn(
            f"approx: removed {', '.join(stale)} from {output_dir}: an earlier patched run's method settings, which "
            "would describe the model saved there now (trained with full attention) as patched",
            stacklevel=4,
        )


def _evaluation_local(net) -> str:
    """How the fine-tuned model's sliding-window layers run in its evaluation: as saved (:func:`approx.local_mode`),
    but their own attention off the CPU, where the banded kernel does not run (said; the saved folder keeps it)."""
    local = local_mode(net)
    device = next(net.parameters()).device
    if local == "band" and device.type != "cpu":
        warnings.warn(
            f"approx: the fine-tuned model is saved with local='band', and evaluated on {device}, where approx's banded "
            "kernel does not run, with its sliding-window layers' own attention (the same window, to rounding)",
            stacklevel=3,
        )
        return "model"
    return local


def _save_and_evaluate(tr: _Training, task: Task, output_dir: Path, eval_split, data: dict, progress: bool):
    """Save the final checkpoint (with the method's settings and state when patched) and evaluate it."""
    net = _save_model(tr, output_dir).eval()
    if eval_split is None:
        return None
    # its results name the fine-tuned model (its folder), not the one it started from
    net.name_or_path = str(output_dir)
    from .evaluation import evaluate

    layers = patched_layers(net)
    local = _evaluation_local(net) if layers else "model"
    if layers:
        unpatch(net)
    cfg = tr.config
    return evaluate(
        net, task, [layers] if layers else ["full"], tokenizer=tr.tokenizer, split=eval_split, **data,
        max_length=cfg.max_length, batch_size=cfg.batch_size, seed=cfg.seed, progress=progress,
        local=None if local == "model" else local,
    )  # fmt: skip


def finetune(
    model: str | os.PathLike,
    task: str,
    *,
    output_dir: str | Path,
    method: str | Setup | MethodConfig | None = None,
    train_split: str = "train",
    eval_split: str | None = None,
    data_dir: str | None = None,
    source: str | None = None,
    limit: int | None = None,
    config: FinetuneConfig | None = None,
    stop_after: int | None = None,
    resume: bool = False,
    progress: bool = True,
    callback: Callable[[int, torch.nn.Module], None] | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """Fine-tune ``model`` (a folder or hub id) on ``task``; returns the ``finetune.json`` record (with the
    evaluation results under ``"evaluation"`` when ``eval_split`` is given).

    ``settings``: the fields of :class:`FinetuneConfig` (``epochs``, ``max_steps``, ``learning_rate``,
    ``batch_size``, ``redraw_every``, ...), over ``config`` when both are given. ``method``: patch the model
    before training (``"favor"``, ``"clustered:clusters=25"``, a config...); ``redraw_every``: redraw the
    method's random state every that many optimizer steps. ``epochs`` may be fractional; ``max_steps`` sets the
    number of optimizer steps in place of the epochs (as transformers' Trainer does). ``resume``: continue from
    ``output_dir/checkpoint``; ``stop_after``: run at most that many steps in this call (checkpointed; continue with
    ``resume=True``), to split a long run across jobs with a time limit. The final checkpoint is written when training completes. ``callback(step, model)`` is called after
    every optimizer step with the unwrapped model (in training mode; restore it if the callback changes it),
    e.g. to evaluate during training.

    Every stop writes a loadable checkpoint to ``output_dir``: after ``stop_after`` steps it is the model so far,
    and ``finetune.json`` says so (``"partial": true``, ``"step"``; no evaluation); ``resume=True`` continues
    from the training state in ``output_dir/checkpoint`` exactly as an uninterrupted run would have.
    """
    from .provenance import mark_start, provenance

    mark_start()
    wall = time.perf_counter()
    model = os.fspath(model)
    task_def = get_task(task)
    base = config.to_dict() if config is not None else {}
    cfg = FinetuneConfig.from_options(**{**base, **settings})  # unknown names: ValueError with the valid ones
    cfg = dataclasses.replace(cfg, max_length=cfg.max_length or task_def.default_max_length)
    if cfg.mixed_precision == "fp16" and _trains_on_cpu():
        raise ValueError(  # accelerate turns fp16 off on a CPU without a word: the run was float32, recorded as fp16
            "mixed_precision fp16 (--mixed-precision) needs a GPU: on a CPU accelerate trains in float32 without a "
            "word; use bf16 there, or no"
        )
    entries = None if method is None else layer_entries(method)
    if entries is not None:  # a folder or patched layers: layer by layer, only the layers they hold
        setup = Setup(PER_LAYER, {"layers": entries})
    else:
        setup = None if method is None else as_setup(method, cfg.seed)
    _check_setup(setup, method, cfg)
    _check_request(model, method, task_def, train_split, eval_split, stop_after)
    output_dir = Path(output_dir)
    state_dir = output_dir / STATE_DIR
    run = _run_record(model, task_def.name, train_split, limit, setup, cfg)
    if resume and not (state_dir / PROGRESS_FILE).is_file():
        raise FileNotFoundError(f"nothing to resume: {state_dir / PROGRESS_FILE} does not exist")
    if not resume:
        _check_no_unfinished_run(output_dir, state_dir)
        _check_not_another_model(model, output_dir)
    if resume:  # before anything is loaded (a checkpoint of another method would not even load)
        _check_resume(state_dir, run)
    examples, where = task_def.load(train_split, source=source, data_dir=data_dir, limit=limit)
    if not examples:  # before the model loads
        raise ValueError(f"{task_def.name} {train_split}: no examples to train on")
    if eval_split is not None:  # a split that does not exist, or data that cannot be read: now, not after training
        task_def.load(eval_split, source=source, data_dir=data_dir)
    origin = "the patched layers given" if isinstance(method, dict) else method
    with _accelerate_state():  # (counted as under way: another thread's run does not reset its state)
        tr = _start(model, task_def, examples, setup, cfg, state_dir, progress, origin=origin, state_from=method)
        tr.run, tr.run_id = run, uuid.uuid4().hex  # (a resume reads the run's own)
        if resume:
            _resume(tr)
        stop = tr.total if stop_after is None else min(tr.total, tr.step + stop_after)
        show = progress and tr.accelerator.is_main_process
        with tqdm(total=tr.total, initial=tr.step, disable=not show, desc=f"finetune {task}") as bar:
            _train(tr, stop, callback, bar)
        tr.accelerator.wait_for_everyone()
        record = _record(tr, task_def, model, train_split, eval_split, len(examples))
        record.update(partial=tr.step < tr.total, step=tr.step, run_id=tr.run_id)
        if record["partial"]:  # stopped on request: the model so far, loadable; the training state to resume from
            _save_model(tr, output_dir)
            record["stopped_at"] = tr.step
        else:
            data = {"data_dir": data_dir, "source": source}
            evaluation = _save_and_evaluate(tr, task_def, output_dir, eval_split, data, progress)
            if evaluation is not None:
                record["evaluation"] = evaluation
        record["provenance"] = provenance(
            seed=cfg.seed, device=tr.accelerator.device, processes=tr.accelerator.num_processes,
            data_source=where.describe(), wall_seconds=time.perf_counter() - wall,
        )  # fmt: skip
        if tr.accelerator.is_main_process:
            (output_dir / "finetune.json").write_text(_json.dumps(record))
        return record


def _keep_state(net: torch.nn.Module, origin: Any) -> None:
    """The state of the folder or patched layers the model was patched from (``origin``), into its layers: what
    they hold (drawn under another seed, loaded, or fitted by ``approx fit``), not what their options would draw."""
    layers = patched_layers(net)
    if isinstance(origin, dict):  # approx.patched_layers of a model
        for i, layer in layers.items():
            layer.load_state_dict(origin[i].state_dict())
    else:  # a folder approx.save wrote: its state file checked against the SHA-256 its settings record
        read_state(layers, origin, read_settings(origin).get("state_sha256"))
        warn_seed_record(list(layers.values()))
    # (fitted methods mark their state "fitted"; a folder saved before its fit would fail at the first forward)
    unfitted = [i for i, lyr in layers.items() if lyr.method.requires_fit(lyr.config) and not _fitted(lyr)]
    if unfitted:
        where, then = ("the patched layers given", "them") if isinstance(origin, dict) else (str(origin), "the folder")
        raise ValueError(
            f"{where}: layers {unfitted} have not been fitted yet; fit them first (approx.fit, or `approx fit`), "
            f"then fine-tune {then} fitted"
        )


def _fitted(layer) -> bool:
    """Whether a layer whose method learns its state holds a fitted one (its ``fitted`` flag)."""
    flag = layer.state().get("fitted")
    return flag is not None and int(flag) == 1


def _check_request(model: str, method: Any, task: Task, train_split: str, eval_split, stop_after) -> None:
    """Before anything is read: refuse an evaluation split the task lacks and a ``stop_after`` below 1 step; warn
    when a folder holding a patched model is trained without a method (it trains full attention) and when the
    evaluation split shares examples with the training split."""
    if eval_split is not None:  # its name now (its data once the training data is read, before the model loads)
        task.check_split(parse_split(eval_split)[0])
    if stop_after is not None and (isinstance(stop_after, bool) or not isinstance(stop_after, int) or stop_after < 1):
        raise ValueError(f"stop_after (--stop-after) must be at least 1 step, got {stop_after!r}")
    if method is None and saved_folder(model):
        warnings.warn(
            f"approx: {model} holds a patched model's settings (approx_config.json): fine-tuning reads it as a plain "
            "checkpoint and trains it with full attention; to train it patched, give the folder as the method too "
            f"(method={model!r}, --method {model})",
            stacklevel=3,
        )
    if eval_split is not None and splits_overlap(train_split, eval_split):
        warnings.warn(
            f"approx: finetune evaluates on {eval_split}, which shares examples with the training split {train_split}: "
            "its scores are not held out (the two halves dev/0 and dev/1 of a split are apart)",
            stacklevel=3,
        )


def _check_setup(setup: Setup | None, method: Any, cfg: FinetuneConfig) -> None:
    """Before anything loads: refuse a method named with fitted state it has not learned yet (a folder's fitted
    layers keep theirs) and a ``redraw_every`` with no random state to redraw (it would be ignored)."""
    configs = []  # (layer or None for every layer, method, config)
    if setup is not None and setup.method == PER_LAYER:
        for x in setup.options["layers"]:
            m = get_method(x["method"])
            configs.append((x["layer"], m, m.config_class.from_record(x["config"])))
    elif setup is not None:
        m = get_method(setup.method)
        configs.append((None, m, m.config_class.from_options(**setup.options)))
    unfitted = [m.name for i, m, c in configs if i is None and m.requires_fit(c)]
    if unfitted:
        raise ValueError(
            f"{setup.label}: {unfitted[0]} learns its state from the model's attention before it can run; fit it "
            f"first (`approx fit --method {setup.label} --model MODEL --output-dir FITTED`, or approx.fit), then "
            "fine-tune with the folder as the method (--method FITTED), which keeps the fitted state"
        )
    if cfg.redraw_every is not None and not any(_draws_state(m, c) for _, m, c in configs):
        what = (
            "no method is patched"
            if setup is None
            else f"{method if isinstance(method, str) else setup.label} draws no random state (hash planes, features)"
        )
        raise ValueError(f"redraw_every (--redraw-every) {cfg.redraw_every}: {what}, so there is nothing to redraw")


def _draws_state(method, config) -> bool:
    """Whether ``method`` with ``config`` draws random state from a seed (what a redraw draws anew): not fitted
    state (learned), and not a method or mode that draws nothing (Linformer's ``mean``)."""
    if method.init_state is None or method.requires_fit(config) or "seed" in config.unused():
        return False  # (a seed left unused: BigBird without random blocks draws a key it never reads)
    return bool(method.init_state(config, head_dim=8, seed=0))


class _EpochSampler(torch.utils.data.Sampler):
    """A shuffle that depends only on (seed, epoch), so a resumed run sees the batches it would have seen."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())
