"""Fitting methods whose state is learned (Sparsefinder), and the graph statistics of predicted attention.

::

    approx.patch(model, "sparsefinder", grouping="kmeans", clusters=8, target="softmax")
    approx.fit(model, windows)              # learns projections and centroids of every patched layer
    approx.graph_stats(model, test_windows) # sparsity, recall and exact fraction per layer and head
    approx.save(model, "out/")              # the fitted state is saved with the model

:func:`fit` runs the model on unlabeled inputs with the fitted layers temporarily replaced by the attention
the method predicts (its registered ``teacher``, e.g. Sparsefinder's entmax for ``target="entmax"``; exact
softmax, i.e. ``full``, by default), collects each layer's queries and keys through
:class:`approx.integration.attention_probe`, and hands them to the method's fit function with the fit settings,
checked against the method's ``fit_config`` (their defaults and help: ``get_method(name).fit_config.describe()``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from tqdm.auto import tqdm

from ..integration import attach, attention_probe, patched_elsewhere, patched_layers
from ..layer import ApproxAttention
from ..registry import get_method, methods

__all__ = ["fit", "graph_stats", "graph_summary", "as_batches"]

log = logging.getLogger(__name__)


def input_list(data: Iterable | Mapping) -> list:
    """``data`` as a list of input dicts (batches: any mapping, e.g. a tokenizer's ``BatchEncoding``, and one alone
    is one batch; a mapping of 1-D values, one text's ids as ``tokenizer(text)`` gives them, is a batch of one) or
    of token-id lists; a ``ValueError`` naming the item for anything else (text, a number, other shapes)."""
    if isinstance(data, Mapping):
        data = [data]
    items = [dict(x) if isinstance(x, Mapping) else x for x in data]
    for i, x in enumerate(items):
        if isinstance(x, dict):
            for key, value in x.items():
                if not isinstance(value, torch.Tensor):  # lists, as a tokenizer returns them without return_tensors
                    try:
                        x[key] = torch.as_tensor(value)
                    except (TypeError, ValueError):
                        raise ValueError(
                            f"input {i}: {key!r} is not a tensor, nor rows of one length: pad the batch "
                            "(tokenizer(..., padding=True, return_tensors='pt'))"
                        ) from None
            dims = {value.dim() for value in x.values() if isinstance(value, torch.Tensor)}
            if dims == {1}:  # one text's ids, unbatched (tokenizer(text)): a batch of one
                x.update((key, value[None]) for key, value in x.items() if isinstance(value, torch.Tensor))
            elif dims - {2}:
                shapes = ", ".join(f"{key} {tuple(value.shape)}" for key, value in x.items())
                raise ValueError(
                    f"input {i}: {shapes}: give (batch, tokens) tensors, or one text's 1-D ids (a batch of one)"
                )
            continue
        if isinstance(x, (str, bytes)) or not hasattr(x, "__len__") or not hasattr(x, "__iter__"):
            raise ValueError(
                f"input {i} is a {type(x).__name__}: give token-id lists or input dicts (input_ids, attention_mask), "
                "e.g. tokenizer(texts)['input_ids']"
            )
        try:
            empty = len(x) == 0
        except TypeError:  # (a 0-d tensor: one number)
            raise ValueError(f"input {i} is a single number: give token-id lists") from None
        if empty:  # (a batch of empty rows reached the model as a 0-token tensor: a reshape error)
            raise ValueError(f"input {i} is an empty token-id list: every input needs at least one token")
    return items


def as_batches(data: Iterable, batch_size: int = 4, pad_id: int = 0) -> list[dict[str, torch.Tensor]]:
    """Model inputs from ``data``: a list of input dicts (``input_ids``, ``attention_mask``...) as they are, or
    of token-id lists (e.g. ``approx.harness.data.wikitext_windows``), batched and right-padded with ``pad_id``."""
    data = input_list(data)
    if not data:
        raise ValueError("no data to run the model on")
    if isinstance(data[0], dict):
        return data
    batches = []
    for i in range(0, len(data), batch_size):
        rows = [list(map(int, r)) for r in data[i : i + batch_size]]
        n = max(map(len, rows))
        ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), n), dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, : len(r)], mask[j, : len(r)] = torch.tensor(r), 1
        batches.append({"input_ids": ids, "attention_mask": mask})
    return batches


def _run(model, batches, probe, progress: bool, desc: str) -> None:
    device = next(model.parameters()).device
    training = model.training
    model.eval()
    try:
        with torch.no_grad(), attention_probe(probe):
            for inputs in tqdm(batches, disable=not progress, desc=desc, unit="batch", leave=False):
                model(**{k: v.to(device) for k, v in inputs.items()})
    finally:
        model.train(training)


def _stand_in(layer: ApproxAttention) -> ApproxAttention:
    """The attention a fitted layer predicts (its method's ``teacher``, exact ``full`` by default), to run while
    its queries and keys are collected."""
    teacher = layer.method.teacher
    name, options = teacher(layer.config) if teacher is not None else ("full", {})
    config = get_method(name).make_config(**options)
    return ApproxAttention(name, config, head_dim=layer.head_dim, layer_index=layer.layer_index)


def _settings_by_method(layers: dict[int, ApproxAttention], options: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each fitted method's settings: the plain ``options`` for every one, and for one alone those in a dict under
    its name (``sparsefinder={"queries": 256}``), which win (a name that is a fit setting of one of them is that
    setting); refused (``ValueError`` listing the valid ones) where a method does not have a setting, before
    anything runs."""
    fitted = {lyr.method.name: lyr.method for lyr in layers.values()}
    fields = {name: _fit_fields(method) for name, method in fitted.items()}
    settings_named = set().union(*fields.values())
    names = set(methods()) | set(fitted)
    named = {key: options[key] for key in options if key in names and key not in settings_named}
    shared = {key: value for key, value in options.items() if key not in named}
    for name, value in named.items():
        if name not in fitted:
            raise ValueError(
                f"{name}={value!r}: no layer to fit runs {name}; the layers to fit run {', '.join(sorted(fitted))}"
            )
        if not isinstance(value, dict):
            raise ValueError(f"{name}={value!r}: a method's own fit settings go in a dict, {name}={{'steps': 100}}")
    if len(fitted) > 1:  # a plain setting one of them lacks and another has: say how to give it to that one alone
        for name in sorted(fitted):
            lacking = sorted((set(shared) & settings_named) - fields[name])
            if lacking:
                own = ", ".join(f"{n}={{...}}" for n in sorted(fitted))
                raise ValueError(
                    f"{name}'s fit has no setting {', '.join(map(repr, lacking))} (its settings: "
                    f"{', '.join(sorted(fields[name])) or 'none'}); the layers to fit run {', '.join(sorted(fitted))}, "
                    f"and a setting given plainly goes to each: give one method's own in a dict under its name ({own})"
                )
    settings = {}
    for name, method in fitted.items():
        mine = {**shared, **named.get(name, {})}
        for key in sorted(set(mine) - fields[name]):  # an option of a method (its seed, say): set when patching
            owners = [n for n in (name, *sorted(fitted)) if key in fitted[n].config_class.option_names()]
            if owners:
                raise ValueError(
                    f"{key!r} is an option of {owners[0]}, not a setting of its fit: give it when patching "
                    f"(approx.patch(model, {owners[0]!r}, {key}=...)); the fit reads it from the layer. {owners[0]}'s "
                    f"fit settings: {', '.join(sorted(fields[owners[0]])) or 'none'}"
                )
        if method.fit_config is not None:
            method.fit_config.from_options(**mine)
        elif mine:
            raise ValueError(f"{name}: its fit takes no settings, got {', '.join(map(repr, mine))}")
        settings[name] = mine
    return settings


def _fit_fields(method) -> set[str]:
    """The names of a fitted method's fit settings (none for a fit without settings)."""
    return {f.name for f in dataclasses.fields(method.fit_config)} if method.fit_config is not None else set()


def fit(
    model: torch.nn.Module,
    data: Iterable,
    *,
    batch_size: int = 4,
    progress: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """Fit the state of every patched layer whose config needs it (``Method.requires_fit``), from the model's own
    queries and keys on ``data`` (input dicts or token-id lists, see :func:`as_batches`; unlabeled text is enough).
    A model whose fittable methods run at options without learned state (e.g. Linformer's ``mean``) gets a
    warning and nothing is fitted.

    ``options`` are the fit settings of the method's ``fit_config`` (e.g. Sparsefinder's ``steps``, ``lr``,
    ``queries``, ``margin``; defaults and help in ``approx.get_method("sparsefinder").fit_config.describe()``),
    checked before anything runs (``ValueError`` listing the valid ones); the seed is the method's ``seed``
    option. Where the layers to fit run more than one method (Sparsefinder on some, Linformer ``fitted`` on
    others), a setting given plainly goes to each of them, so it must be one of each one's, and the settings of one
    method alone go in a dict under its name, which win over the plain ones:
    ``approx.fit(model, data, steps=100, sparsefinder={"queries": 256}, linformer={"rows": 64})``.
    Returns what was fitted and how long it took."""
    patched = patched_layers(model)
    elsewhere = "" if patched else patched_elsewhere(model)
    if elsewhere:
        raise ValueError(f"{type(model).__name__} is not patched{elsewhere}: fit that one")
    layers = {i: lyr for i, lyr in patched.items() if lyr.method.requires_fit(lyr.config)}
    if not layers:
        if not any(lyr.method.needs_fit for lyr in patched.values()):
            fitted = ", ".join(name for name in methods() if get_method(name).needs_fit)
            raise ValueError(
                f"no patched layer needs fitting: patch the model with a method that learns its state ({fitted})"
            )
        log.warning("approx.fit: nothing to fit: the patched layers' options have no learned state")
        return {"layers": [], "inputs": 0, "options": options, "seconds": 0.0, "collect_seconds": 0.0}
    by_method = _settings_by_method(layers, options)
    start = time.perf_counter()
    batches = as_batches(data, batch_size)
    samples: dict[int, list] = {i: [] for i in layers}

    stand_ins = {i: _stand_in(lyr).to(next(model.parameters()).device) for i, lyr in layers.items()}

    def collect(layer, q, k, v, key_mask, scale, out) -> None:
        if stand_ins.get(layer.layer_index) is layer:  # this model's layers only (not another model's of that index)
            mask = None if key_mask is None else key_mask.detach().cpu()
            samples[layer.layer_index].append((q.detach().float().cpu(), k.detach().float().cpu(), mask, scale))

    attach(model, stand_ins)
    try:
        _run(model, batches, collect, progress, "collect q/k")
    finally:
        attach(model, layers)
    collected = time.perf_counter() - start
    for i, lyr in tqdm(layers.items(), disable=not progress, desc="fit layers", unit="layer"):
        lyr.fit(samples[i], **by_method[lyr.method.name])
    seconds = time.perf_counter() - start
    log.info("fitted %d layers in %.1f s (collecting q/k: %.1f s)", len(layers), seconds, collected)
    return {
        "layers": sorted(layers),
        "inputs": sum(int(b["input_ids"].shape[0]) for b in batches),
        "options": options,
        "settings": _settings(layers, by_method),
        "seconds": seconds,
        "collect_seconds": collected,
    }


def _settings(layers: dict[int, ApproxAttention], by_method: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every fit setting each fitted method ran with, defaults included, by method (``options`` holds the given
    ones only): what a later default must not change in a record."""
    return {
        method.name: method.fit_config.from_options(**by_method[method.name]).to_dict() if method.fit_config else {}
        for method in {lyr.method.name: lyr.method for lyr in layers.values()}.values()
    }


class GraphStatsProbe:
    """An attention probe adding up, per patched layer, the graph counts of methods that predict an attention
    graph (``layer.graph_stats``); other layers are ignored. ``summary()`` gives sparsity, recall and exact
    fraction per layer and head."""

    def __init__(self) -> None:
        self.counts: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, layer, q, k, v, key_mask, scale, out) -> None:
        stats = layer.graph_stats(q, k, key_mask, scale=scale)
        if stats is None:
            return
        mine = self.counts.setdefault(layer.layer_index, {})
        for name, t in stats.items():
            mine[name] = mine.get(name, 0) + t

    def summary(self) -> dict[str, Any] | None:
        return graph_summary(self.counts) if self.counts else None


def _rates(c: dict[str, Any]) -> dict[str, float]:
    total = {k: float(torch.as_tensor(v, dtype=torch.float64).sum()) for k, v in c.items()}
    return {
        "sparsity": 1.0 - total["predicted"] / max(total["valid"], 1.0),
        "recall": total["hit"] / total["gold"] if total["gold"] else 1.0,
        "exact_fraction": total["exact"] / max(total["queries"], 1.0),
    }


def graph_summary(counts: dict[int, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Counts per layer (each a dict of per-head tensors: predicted, valid, gold, hit, queries, exact) ->
    overall, per-layer and per-head sparsity = 1 - |Ĝ| / valid pairs, recall = |G ∩ Ĝ| / |G| and exact
    fraction = share of real queries with recall 1."""
    names = ("predicted", "valid", "gold", "hit", "queries", "exact")
    total = {n: sum(float(c[n].sum()) for c in counts.values()) for n in names}
    per_layer = {}
    for i in sorted(counts):
        c = counts[i]
        heads = len(c["predicted"])
        per_layer[str(i)] = {**_rates(c), "heads": [_rates({n: c[n][h] for n in names}) for h in range(heads)]}
    return {**_rates(total), "per_layer": per_layer, "counts": total}


def graph_stats(model: torch.nn.Module, data: Iterable, *, batch_size: int = 4, progress: bool = True):
    """Sparsity, recall and exact fraction of the predicted attention graphs of a patched (and fitted) model on
    ``data``, overall, per layer and per head, measured on the queries and keys each layer actually sees."""
    probe = GraphStatsProbe()
    _run(model, as_batches(data, batch_size), probe, progress, "graph stats")
    if not probe.counts:
        raise ValueError("no patched layer predicts an attention graph (patch with sparsefinder first)")
    return probe.summary()
