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

Cross-fitting, for tasks whose train split is not available offline: ``train_split="dev/0",
eval_split="dev/1"`` and then the swap (see :func:`approx.harness.tasks.base.cross_fit_half`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..config import MethodConfig
from ..integration import load_pretrained, patch, patched_layers, save, unpatch
from ..integration import redraw as redraw_layers
from .evaluation import _collate, as_setup
from .fidelity import Setup
from .tasks import Feature, get_task

__all__ = ["finetune"]

STATE_DIR = "checkpoint"
PROGRESS_FILE = "progress.json"


def _batch(features: list[Feature], pad_id: int) -> dict[str, torch.Tensor]:
    inputs = _collate(features, pad_id, torch.device("cpu"))
    for name in features[0].extra["labels"]:
        values = [f.extra["labels"][name] for f in features]
        inputs[name] = torch.tensor(values, dtype=torch.float32 if isinstance(values[0], float) else torch.long)
    return inputs


def _schedule(optimizer, warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def finetune(
    model: str,
    task: str,
    *,
    output_dir: str | Path,
    method: str | Setup | MethodConfig | None = None,
    train_split: str = "train",
    eval_split: str | None = None,
    data_dir: str | None = None,
    source: str | None = None,
    limit: int | None = None,
    epochs: float = 3.0,
    max_steps: int | None = None,
    learning_rate: float = 5e-5,
    weight_decay: float = 0.01,
    warmup: float = 0.1,
    batch_size: int = 32,
    max_length: int | None = None,
    seed: int = 0,
    mixed_precision: str = "no",
    redraw_every: int | None = None,
    checkpoint_every: int | None = None,
    stop_after: int | None = None,
    resume: bool = False,
    progress: bool = True,
    callback: Callable[[int, torch.nn.Module], None] | None = None,
) -> dict[str, Any]:
    """Fine-tune ``model`` (a folder or hub id) on ``task``; returns the ``finetune.json`` record (with the
    evaluation results under ``"evaluation"`` when ``eval_split`` is given).

    ``method``: patch the model before training (``"favor"``, ``"clustered:clusters=25"``, a config...);
    ``redraw_every``: redraw the method's random state every that many optimizer steps. ``epochs`` may be
    fractional; ``max_steps`` caps the optimizer steps. ``resume``: continue from ``output_dir/checkpoint``;
    ``stop_after``: run at most that many steps in this call (checkpointed; continue with ``resume=True``), to
    split a long run across jobs with a time limit. The final checkpoint is written when training completes.
    ``callback(step, model)`` is called after every optimizer step with the unwrapped model (in training mode;
    restore it if the callback changes it), e.g. to evaluate during training.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from .provenance import provenance

    wall = time.perf_counter()
    task_def = get_task(task)
    if batch_size < 1 or learning_rate <= 0 or epochs <= 0 or not 0 <= warmup < 1:
        raise ValueError(
            f"need batch_size >= 1, learning_rate > 0, epochs > 0 and 0 <= warmup < 1; got {batch_size}, "
            f"{learning_rate}, {epochs}, {warmup}"
        )
    setup = None if method is None else as_setup(method, seed)
    max_length = max_length or task_def.default_max_length
    output_dir = Path(output_dir)
    state_dir = output_dir / STATE_DIR
    if resume and not (state_dir / PROGRESS_FILE).is_file():
        raise FileNotFoundError(f"nothing to resume: {state_dir / PROGRESS_FILE} does not exist")
    examples, where = task_def.load(train_split, source=source, data_dir=data_dir, limit=limit)

    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=not torch.cuda.is_available())
    set_seed(seed)
    head = next(iter(task_def.modes))
    net, tokenizer = load_pretrained(model, task=head, progress=progress, **task_def.head_options())
    if setup is not None:
        patch(net, setup.method, **setup.options)
    features = task_def.train_features(examples, tokenizer, max_length=max_length)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    sampler = _EpochSampler(len(features), seed)
    loader = torch.utils.data.DataLoader(
        features, batch_size=batch_size, sampler=sampler, collate_fn=lambda fs: _batch(fs, pad_id)
    )
    steps_per_epoch = math.ceil(len(loader) / accelerator.num_processes)
    total = math.ceil(epochs * steps_per_epoch) if max_steps is None else max_steps
    decay = [p for n, p in net.named_parameters() if p.ndim > 1 and "LayerNorm" not in n]
    no_decay = [p for n, p in net.named_parameters() if not (p.ndim > 1 and "LayerNorm" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=learning_rate
    )
    scheduler = _schedule(optimizer, int(warmup * total), total)
    net, optimizer, loader, scheduler = accelerator.prepare(net, optimizer, loader, scheduler)

    step, losses = 0, []
    if resume:
        accelerator.load_state(str(state_dir))
        saved = json.loads((state_dir / PROGRESS_FILE).read_text())
        step, losses = saved["step"], saved["losses"]
        if setup is not None and saved.get("method_state"):
            _load_method_state(accelerator.unwrap_model(net), state_dir)

    def checkpoint() -> None:
        accelerator.save_state(str(state_dir))
        if accelerator.is_main_process:
            _save_method_state(accelerator.unwrap_model(net), state_dir)
            record = {"step": step, "losses": losses, "method_state": setup is not None}
            (state_dir / PROGRESS_FILE).write_text(json.dumps(record) + "\n")

    stop = total if stop_after is None else min(total, step + stop_after)
    net.train()
    bar = tqdm(
        total=total, initial=step, disable=not (progress and accelerator.is_main_process), desc=f"finetune {task}"
    )
    while step < stop:
        epoch, skip = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch)
        if hasattr(loader, "set_epoch"):  # accelerate keeps its own epoch counter and passes it on
            loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        for batch in batches:
            loss = net(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            losses.append(float(accelerator.gather(loss.detach()).mean()))
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            if redraw_every and setup is not None and step % redraw_every == 0:
                redraw_layers(accelerator.unwrap_model(net), seed=seed + step // redraw_every)
            if callback is not None:
                callback(step, accelerator.unwrap_model(net))
            if (checkpoint_every and step % checkpoint_every == 0) or step % steps_per_epoch == 0 or step == stop:
                checkpoint()
            if step >= stop:
                break
    bar.close()
    accelerator.wait_for_everyone()
    if step < total:  # stopped early on request: the state is checkpointed, nothing final to save
        return {"task": task_def.name, "stopped_at": step, "steps": total, "losses": losses}
    net = accelerator.unwrap_model(net).eval()
    record: dict[str, Any] = {
        "task": task_def.name,
        "task_version": task_def.version,
        "base_model": model,
        "method": None if setup is None else {"name": setup.method, **setup.config()},
        "train_split": train_split,
        "eval_split": eval_split,
        "examples": len(examples),
        "features": len(features),
        "settings": {
            "epochs": epochs,
            "steps": total,
            "learning_rate": learning_rate,
            "weight_decay": weight_decay,
            "warmup": warmup,
            "batch_size": batch_size,
            "max_length": max_length,
            "mixed_precision": mixed_precision,
            "redraw_every": redraw_every,
        },
        "losses": losses,
    }
    if accelerator.is_main_process:
        if setup is not None:
            save(net, output_dir)
        else:
            net.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
    if eval_split is not None:
        from .evaluation import evaluate

        layers = patched_layers(net)
        if layers:
            unpatch(net)
        record["evaluation"] = evaluate(
            net,
            task_def,
            [layers] if layers else ["full"],
            tokenizer=tokenizer,
            split=eval_split,
            data_dir=data_dir,
            source=source,
            max_length=max_length,
            batch_size=batch_size,
            seed=seed,
            progress=progress,
        )
    record["provenance"] = provenance(
        seed=seed,
        device=accelerator.device,
        processes=accelerator.num_processes,
        data_source=where.describe(),
        wall_seconds=time.perf_counter() - wall,
    )
    if accelerator.is_main_process:
        (output_dir / "finetune.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


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


def _save_method_state(model, folder: Path) -> None:
    from safetensors.torch import save_file

    state = {
        f"layer.{i}.{n}": t.detach().cpu().contiguous()
        for i, lyr in patched_layers(model).items()
        for n, t in lyr.state().items()
    }
    if state:
        save_file(state, str(folder / "approx_state.safetensors"))


def _load_method_state(model, folder: Path) -> None:
    from safetensors.torch import load_file

    path = folder / "approx_state.safetensors"
    if not path.is_file():
        return
    state = load_file(str(path))
    for i, lyr in patched_layers(model).items():
        prefix = f"layer.{i}."
        mine = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if mine:
            lyr.load_state(mine)
