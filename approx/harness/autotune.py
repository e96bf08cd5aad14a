"""Each layer's method and budget, tuned to a fidelity target on a few calibration inputs.

::

    tuning = approx.autotune(model, inputs, target="cosine>=0.99", cost="matmul")
    tuning.choices                  # per attention layer: "i-clustered:clusters=25", "full", ...
    approx.save(model, "tuned/")    # an ordinary patched model: each layer's choice and how it was tuned

One method and one budget for every layer is what papers and tools do; attention is easy in some layers and
hard in others, so :func:`autotune` chooses per layer from the model's own attention, in four steps:

1. **Measure** (the *fit* half of the calibration inputs). For every candidate and every layer, the model runs
   with that layer alone replaced: the end-to-end loss of fidelity to the unpatched model (1 − cosine of the
   last hidden states, or the KL divergence of the outputs, as ``target`` says), the layer's attention-output
   error, and its attention cost from the method's cost model at the inputs' real lengths (``cost="flops"``:
   approx's full cost model; ``"matmul"``: the literature's attention matmul multiply-accumulates, the
   MonarchAttention paper's axis). Full attention is always a candidate: no loss, the cost of exact attention.
2. **Search** (no model runs). Treating the per-layer losses as additive, each layer's candidates are reduced to
   their lower convex hull in (cost, loss), and the hull steps of all layers are taken in order of increasing
   loss per unit of cost saved (the greedy by marginal error per unit cost). Every assignment on this path is
   optimal for the additive model at its own cost (it minimises loss + λ·cost for some λ), from all full
   attention to every layer at its cheapest candidate.
3. **Verify** (the *check* half, inputs the measurement never saw). Assignments along the path are run end to end,
   by bisection, for the cheapest one whose measured fidelity meets ``target``; bisection takes fidelity to fall
   along the path, so where it does not, a cheaper point beyond the bracket may meet the target too. A score
   target (``score>=X``) verifies the same path on a task's metric instead, as a ``score`` callable measures it on
   labelled examples (:mod:`approx.harness.scoring`): the cheapest point keeping X times the unpatched model's. With
   ``budget`` alone: the first point within the budget (the lowest estimated loss), measured. The fidelity reported
   is the measured one, never the additive estimate. Costs on the path, the budget and the report are the cost
   models at the real lengths of the *cost inputs*, and their data where a cost depends on it (window's global
   question tokens, found as a patched forward finds them). The cost inputs are the check inputs unless
   ``cost_data`` is given: inputs like those the tuned model will run on (e.g. a few hundred of the task's training
   inputs), of which only the lengths (and, for a cost that depends on the question, the tokens) are read; every
   registered cost model counts each input at its own length, so how they are batched does not matter. A few dozen
   check inputs are a small sample of lengths,
   and a cost that falls or rises steeply with the length (MonarchAttention's blocks, a window wider than most
   inputs) can then rank the candidates otherwise than the inputs the model will meet.
4. **Uniform settings** (``uniform=True``, the default). The additive model can misjudge: layers' errors add up
   otherwise than measured alone, and a candidate that is mediocre on each layer alone may hold up well on all of
   them. So the uniform settings, each whole-layer candidate on every layer (what papers and tools run), are
   verified the same way (a score target: scored), cheapest first, among those costing less than the path's
   point: the first that meets the target replaces it (with a budget too, where no path point within it meets the
   target: the cheapest within it that does; with ``budget`` alone: the most faithful within the budget, when it
   measures better).
   The tuned model then never costs more than a uniform setting that meets the same target on the same check
   inputs; :attr:`Tuning.origin` says which was taken and :attr:`Tuning.uniform` lists what was verified.

Heads: with ``head_counts`` (e.g. ``(6, 9)``), each candidate is also tried on only that many heads of each layer, the
others exact (``approx.patch(..., on_heads=...)``): the heads where the candidate, run on the whole layer in step 1,
changed the attention output least (the squared error of each head's output, summed over the fit inputs). These are
options of the layer like the others, each measured alone in step 1 (one more run per layer, candidate and count),
and a choice reads ``"bigbird:block=16[heads 0,3,5]"``. Without it the heads of a layer share its method. The random
state of each
candidate (hash planes, random blocks) is drawn from ``seed`` and the layer index, as :func:`approx.patch`
draws it, so the tuned model's layers are the ones measured. Methods with fitted state (Sparsefinder,
Linformer ``fitted``) are refused as candidates: fit them and evaluate the folder instead.

A model's sliding-window layers (ModernBERT's local layers, which :func:`approx.patch` never patches) are not tuned:
they run their own attention in every run (or with ``local="band"`` approx's banded kernel, in every run but the
unpatched reference's), read :data:`LOCAL_CHOICES` in the choices, and are left out of the costs, as the harness's
cost block leaves them out; the search runs over the other layers.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import re
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..attention import _context
from ..config import MethodConfig, as_integer
from ..integration import (
    attach,
    attention_modules,
    attention_probe,
    attention_shape,
    check_local,
    is_patched,
    local_layers,
    model_head_from_name,
    patch,
    patched_layers,
    question_positions,
    set_tuning,
    unpatch,
)
from ..layer import ApproxAttention
from ..registry import get_method
from .fidelity import AttentionProbe
from .fitting import as_batches, input_list
from .resampling import level_label
from .scoring import relative
from .spec import Setup, as_setup, heads_label, short_label

__all__ = [
    "DEFAULT_CANDIDATES",
    "LOCAL_CHOICES",
    "Search",
    "Target",
    "Tuning",
    "autotune",
    "check_goal",
    "default_measure",
    "hull_path",
    "parse_target",
    "task_batches",
]

log = logging.getLogger(__name__)

# Candidates when none are named: a budget ladder of the methods that keep most of a pretrained encoder's
# quality zero-shot (docs/results.md), and the cheap kernel and low-rank ones for the layers where they suffice.
DEFAULT_CANDIDATES: tuple[str, ...] = (
    "i-clustered:clusters=25",
    "i-clustered:clusters=50",
    "i-clustered:clusters=100",
    "clustered:clusters=25",
    "nystrom:landmarks=32",
    "linformer:projections=64",
    "linformer:projections=128",
    "bigbird:block=16,random_blocks=1",
    "efficient",
)

# what Tuning.choices says of a sliding-window layer (ModernBERT's local layers), which is never tuned (approx.patch
# leaves such layers alone), by the tuning's ``local``: its own attention, or approx's banded kernel
LOCAL_CHOICES = {"model": "own (sliding window)", "band": "band (sliding window)"}

COSTS = {"flops": (0, 2), "matmul": (4, 5)}  # the convention -> (method, full) slots of AttentionProbe.cost
RATIO_NAMES = {"flops": "flops_vs_full", "matmul": "matmul_vs_softmax"}  # as the harness's cost block names them

_TARGET = re.compile(r"^\s*(cosine|kl|score)\s*(>=|<=)\s*([0-9.eE+-]+)\s*$")
_NUMBER = re.compile(r"^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*$")


class _DefaultTarget(str):
    """The default target of :func:`autotune`: ``cosine>=0.99`` without a budget, none with one."""


DEFAULT_TARGET = _DefaultTarget("cosine>=0.99")


@dataclasses.dataclass(frozen=True)
class Target:
    """What the tuned model must keep. End-to-end fidelity to the unpatched model: ``cosine >= value`` (mean over real
    tokens of the cosine between the last hidden states) or ``kl <= value`` (mean KL(unpatched || patched) of the
    output distributions: per input for classification and each of a QA head's start and end, per real token for a
    masked-LM head). Or a task's metric: ``score >= value``, the tuned model's score at least ``value`` times the
    unpatched model's on the labelled examples of a scorer (:func:`~approx.harness.scoring.task_scorer`)."""

    measure: str
    value: float

    def met(self, fidelity: float) -> bool:
        """Whether ``fidelity`` (in this target's measure; for ``score``, the score as a fraction of the unpatched
        model's) meets the target."""
        return fidelity <= self.value if self.measure == "kl" else fidelity >= self.value

    def loss(self, fidelity: float) -> float:
        """What the search adds up per layer: 1 − cosine, or the KL divergence (never below 0; infinite when the
        fidelity is not a number, e.g. a method that broke down)."""
        if not math.isfinite(fidelity):
            return math.inf
        return max(1.0 - fidelity if self.measure == "cosine" else fidelity, 0.0)

    def __str__(self) -> str:
        return f"{self.measure}{'<=' if self.measure == 'kl' else '>='}{self.value:g}"


def parse_target(target: str | float | Target) -> Target:
    """``"cosine>=0.99"``, ``"kl<=0.01"``, ``"score>=0.99"`` or a float (a cosine) -> :class:`Target`; ``ValueError``
    otherwise."""
    if isinstance(target, Target):
        return target
    if isinstance(target, (int, float)) and not isinstance(target, bool):
        target = f"cosine>={target}"
    expected = (
        f"target {target!r}: expected 'cosine>=X' (X at most 1), 'kl<=X' (X >= 0), 'score>=X' (a fraction of the "
        "unpatched model's score, above 0) or a number (a cosine)"
    )
    if isinstance(target, str) and _NUMBER.match(target):  # "0.99" as a command line gives it
        target = f"cosine>={target.strip()}"
    m = _TARGET.match(target) if isinstance(target, str) else None
    if m is None or (m.group(1) == "kl") == (m.group(2) == ">="):
        raise ValueError(expected)
    try:
        value = float(m.group(3))
    except ValueError:
        raise ValueError(expected) from None
    measure = m.group(1)
    if (
        (measure == "cosine" and not -1.0 <= value <= 1.0)
        or (measure == "kl" and not value >= 0)
        or (measure == "score" and not 0 < value <= 1)
    ):
        hint = f"; did you mean score>={value / 100:g}?" if measure == "score" and 50 <= value <= 100 else ""
        raise ValueError(
            f"target {target!r}: a cosine lies in [-1, 1], a KL divergence is at least 0 and a score target is a "
            f"fraction of the unpatched model's score, in (0, 1] (0.99: within 1 %){hint}"
        )
    return Target(measure, value)


def check_goal(target, budget: float | None) -> Target | None:
    """The parsed target (None without one); a target or a budget required, the budget above 0."""
    goal = None if target is None else parse_target(target)
    if goal is None and budget is None:
        raise ValueError(
            "give a fidelity target (e.g. target='cosine>=0.99'), a cost budget (e.g. budget=0.5), or both"
        )
    if budget is not None and not budget > 0:
        raise ValueError(f"budget is a cost relative to full attention, above 0; got {budget!r}")
    return goal


def check_score(goal: Target | None, score) -> bool:
    """Whether ``goal`` is a score target; a score target needs a ``score`` callable, and only a score target takes
    one."""
    scoring = goal is not None and goal.measure == "score"
    if scoring and not callable(score):
        raise ValueError(
            f"target {goal} keeps a task's score: pass score=, a callable giving the metric of the model as it is "
            "(approx.harness.scoring.task_scorer(model, tokenizer, task, split=...))"
        )
    if score is not None and not scoring:
        raise ValueError(f"score= is read by a score target (e.g. 'score>=0.99') only; the target is {goal}")
    return scoring


# ----------------------------------------------------------------------------------------------------- search


def hull_path(loss: Sequence[Sequence[float]], cost: Sequence[Sequence[float]]) -> list[list[int]]:
    """The search of step 2 (module docstring): ``loss[l][c]`` and ``cost[l][c]`` of option ``c`` at layer ``l``,
    option 0 being full attention. Returns the path of assignments (one option per layer), from all options 0
    to every layer at its cheapest hull point; each step moves one layer one step along its lower convex hull in
    (cost, loss), steps taken in order of increasing loss added per cost saved (layer order breaking ties). Options
    costing at least as much as option 0, and options of infinite or undefined loss or cost, are never chosen (option 0
    is exact)."""
    steps = []  # (slope, layer, order within the layer, option)
    for layer, (losses, costs) in enumerate(zip(loss, cost, strict=True)):
        current, order, previous = 0, 0, -math.inf
        usable = [c for c in range(len(costs)) if math.isfinite(losses[c]) and math.isfinite(costs[c])]
        while True:
            cheaper = [c for c in usable if costs[c] < costs[current]]
            if not cheaper:
                break
            slope = {c: (losses[c] - losses[current]) / (costs[current] - costs[c]) for c in cheaper}
            best = min(slope.values())
            # on a tie, the nearest point first: the path passes through every point of the hull's edge. The tolerance
            # is relative, so that the path does not depend on the units of loss and cost (an absolute one made
            # every slope a tie where losses are small and costs are FLOP counts: KL 1e-6 per 1e9 FLOPs)
            nxt = max((c for c in cheaper if slope[c] <= best + 1e-9 * abs(best)), key=lambda c: costs[c])
            # a hull's slopes do not fall; rounding on (nearly) collinear points must not reorder a layer's steps
            previous = max(previous, slope[nxt])
            steps.append((previous, layer, order, nxt))
            current, order = nxt, order + 1
    steps.sort(key=lambda s: (s[0], s[1], s[2]))
    assignment = [0] * len(loss)
    path = [list(assignment)]
    for _, layer, _, option in steps:
        assignment[layer] = option
        path.append(list(assignment))
    return path


# -------------------------------------------------------------------------------------------- measurement


def _last_hidden(out) -> torch.Tensor:
    hidden = getattr(out, "hidden_states", None)
    return (hidden[-1] if hidden is not None else out.last_hidden_state).float()


def _output_logits(out, mask: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """The output distributions to compare for a KL target: (name, log-probabilities) per output, padding
    excluded; empty for a bare encoder and for a regression head (one score per input)."""
    found = []
    for name in ("logits", "start_logits", "end_logits"):
        t = getattr(out, name, None)
        if t is None:
            continue
        t = t.float()
        if t.shape[-1] == 1:  # a regression head's score: no distribution to compare
            continue
        if name != "logits":  # QA: a distribution over the input's real positions
            t = t.masked_fill(~mask.bool(), float("-inf"))
        found.append((name, t.log_softmax(-1)))
    return found


def _kl(ref_logp: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor, name: str) -> tuple[float, int]:
    p = ref_logp.exp()
    # KL per distribution, at least 0 (float32 rounding can leave -1e-9 where the two agree)
    terms = torch.where(p > 0, p * (ref_logp - logp), torch.zeros_like(p)).sum(-1).clamp_min(0)
    if name == "logits" and terms.dim() == 2:  # masked LM: per real token
        return float(terms[mask.bool()].sum()), int(mask.sum())  # (selected: NaN x 0 would be NaN)
    return float(terms.sum()), int(terms.numel())


@dataclasses.dataclass
class _Reference:
    """The unpatched model's outputs on one batch."""

    inputs: dict[str, torch.Tensor]
    hidden: torch.Tensor
    logits: list[tuple[str, torch.Tensor]]


class _Calibration:
    """Runs the model on fixed batches and compares with the unpatched model's outputs on them."""

    def __init__(
        self,
        model,
        batches: list[dict[str, torch.Tensor]],
        target: Target,
        local: str | None = None,
        what: str = "the calibration inputs",
    ) -> None:
        self.model, self.target, self.local = model, target, local
        self.device = next(model.parameters()).device
        self.refs = []
        # per batch: (attention mask, question); refuses a batch without input_ids and attention_mask
        self.masks: list[tuple[torch.Tensor, torch.Tensor | None]] = [_masks(model, inputs) for inputs in batches]
        if not any(
            bool(mask.any()) for mask, _ in self.masks
        ):  # (measured as fidelity 0: every loss 1, a blind search)
            raise ValueError(f"{what} hold no real token (every attention mask is 0): nothing to compare on")
        for inputs in batches:
            inputs = {k: v.to(self.device) for k, v in inputs.items()}
            out = model(**inputs, output_hidden_states=True)
            logits = _output_logits(out, inputs["attention_mask"])
            if target.measure == "kl" and not logits:
                raise ValueError(
                    f"a {target.measure} target compares output distributions, and {type(model).__name__} has none "
                    "(a bare encoder, or a regression head's single score): use a cosine target, or load the model "
                    "with its classification, QA or masked-LM head"
                )
            self.refs.append(_Reference(inputs, _last_hidden(out), logits))
        self.forwards = len(batches)
        self.inputs = _inputs(batches)

    def run(self, layers: dict[int, ApproxAttention]) -> tuple[float, AttentionProbe]:
        """Fidelity (in the target's measure) with ``layers`` attached, and the probe of the attention error and
        cost of those layers."""
        probe = AttentionProbe(total_layers=len(attention_modules(self.model)))
        num, den = 0.0, 0
        attach(self.model, layers, local=self.local)
        try:
            with attention_probe(probe):
                for ref in self.refs:
                    out = self.model(**ref.inputs, output_hidden_states=True)
                    mask = ref.inputs["attention_mask"]
                    if self.target.measure == "cosine":
                        num, den = (
                            num + float(_cosine(_last_hidden(out), ref.hidden)[mask.bool()].sum()),
                            den + int(mask.sum()),
                        )
                    else:
                        for (name, ref_logp), (_, logp) in zip(ref.logits, _output_logits(out, mask), strict=True):
                            s, n = _kl(ref_logp, logp, mask, name)
                            num, den = num + s, den + n
        finally:
            unpatch(self.model)
        self.forwards += len(self.refs)
        return num / max(den, 1), probe


def _masks(
    model, inputs: dict[str, torch.Tensor], what: str = "a calibration batch"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a batch's attention cost depends on besides its shape: its attention mask, and its question tokens (None
    without any) as a patched forward finds them."""
    if not isinstance(inputs, dict) or "input_ids" not in inputs or "attention_mask" not in inputs:
        got = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
        raise ValueError(
            f"{what} needs input_ids and attention_mask; got {got} (give batches, or token-id lists, not both)"
        )
    question = question_positions(
        model, inputs["input_ids"], inputs.get("token_type_ids"), inputs.get("attention_mask")
    )
    return inputs["attention_mask"].bool().cpu(), None if question is None else question.cpu()


def _inputs(batches: list[dict[str, torch.Tensor]]) -> int:
    return sum(int(b["input_ids"].shape[0]) for b in batches)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per token, the cosine of two hidden states, in float64 and clamped to [-1, 1]; exactly 1 where they are equal
    (in float32 equal vectors measured 0.99999988 or 1.0000002, so that exact attention could miss ``cosine>=1``)."""
    cos = F.cosine_similarity(a.double(), b.double(), dim=-1).clamp(-1.0, 1.0)
    return cos.masked_fill((a == b).all(-1), 1.0)


# ------------------------------------------------------------------------------------------------- result


@dataclasses.dataclass
class Tuning:
    """What :func:`autotune` chose and how. ``choices``: per attention layer, the chosen candidate's label (or
    ``"full"``; :data:`LOCAL_CHOICES` for a sliding-window layer, which is not tuned). ``fidelity``: measured end to end
    on the check inputs; ``cost``: the attention cost at the cost
    inputs (the check inputs unless ``cost_data`` was given), relative to full attention in the tuning's convention
    (``costs``: in both). ``met``: whether ``fidelity`` (a score target: ``score``) meets the target and ``cost`` the
    budget. ``table``: per layer and candidate, the loss, attention error and cost ratios measured with that layer
    alone replaced (on the fit inputs); ``path``: the search's assignments (cost ratio at the cost inputs, estimated
    loss, and the measured fidelity of the ones verified, or with a score target the score of the ones scored, as a
    fraction of the unpatched model's); ``calibration``: the numbers of fit, check and cost inputs, the forward passes and the seconds taken;
    ``score`` (a score target only): the tuned model's score (``value``), the unpatched model's (``reference``), their
    ratio (``relative``, what the target judges), what the scorer reads (``scorer``) and, with a
    :class:`~approx.harness.scoring.TaskScorer`, ``interval``: the paired bootstrap interval of the tuned model's score
    minus the unpatched model's over the scored examples (``difference``) and of their ratio (``relative``): how far
    the kept share could move with other examples (the cheapest model that passes on them may pass by their luck);
    ``local``: how a model's sliding-window layers ran in the tuning's runs and run in the tuned model (``"model"``:
    their own attention; ``"band"``: approx's banded kernel, as ``autotune(local="band")`` asked). ``measure``: what
    ``fidelity`` is (``"kl"`` or ``"cosine"``, the search's measure); ``origin``: ``"path"`` (a point of the search
    path) or ``"uniform"`` (one candidate on every layer: cheaper than the path's point for the same target, meeting
    a target that the path's points within the budget miss, or more faithful within a budget); ``uniform``: each
    uniform setting's label, cost ratio and, where verified by this search (for this target or an earlier one),
    measured fidelity (and score)."""

    choices: list[str]
    fidelity: float
    cost: float
    costs: dict[str, float | None]
    met: bool
    target: str | None
    budget: float | None
    cost_convention: str
    candidates: list[str]
    table: list[dict[str, Any]]
    path: list[dict[str, Any]]
    calibration: dict[str, Any]
    seed: int
    score: dict[str, Any] | None = None
    measure: str | None = None
    head_counts: list[int] = dataclasses.field(default_factory=list)
    origin: str = "path"
    uniform: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    local: str = "model"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """A few lines for a terminal: each layer's choice, then fidelity and cost."""
        lines = [f"layer {i}: {c}" for i, c in enumerate(self.choices)]
        what = f"target {self.target}" if self.target else f"budget {self.budget:g}"
        if self.score is not None:
            scorer = self.score["scorer"]
            where = f" ({scorer['metric']} on {scorer['count']} labelled examples)" if isinstance(scorer, dict) else ""
            what += (
                f": {'met' if self.met else 'NOT met'}; score {self.score['value']:.4g}{where}, "
                f"{self.score['relative']:.4f} of the unpatched model's {self.score['reference']:.4g}"
            )
            if self.score.get("interval"):
                low, high = self.score["interval"]["relative"]
                what += f" ({level_label(self.score['interval']['level'])} interval over these examples: {low:.4f} to {high:.4f})"
        lines.append(
            f"{what}{'' if self.score is not None else ': met' if self.met else ': NOT met'}; measured "
            f"{self.measure or 'fidelity'} {self.fidelity:.5f} on "
            f"{self.calibration['check_inputs']} held-out inputs; attention cost {self.cost:.3f} of full "
            f"({self.cost_convention}, at the lengths of {self.calibration.get('cost_inputs', '?')} inputs)"
        )
        if self.origin == "uniform":
            why = "measures better than the search path's point within the budget"
            if self.target:
                why = "meets the target at less cost than the search path's point"
                if self.budget is not None:
                    why += " (or within the budget, where the path's points miss it)"
            local = set(LOCAL_CHOICES.values())
            tuned = next(c for c in self.choices if c not in local)
            where = "every layer it tunes" if local & set(self.choices) else "every layer"
            lines.append(f"a uniform setting ({tuned} on {where}): it {why}")
        return "\n".join(lines)


def _split(data: list, seed: int, batch_size: int, pad_id: int) -> tuple[list, list]:
    """The fit and check halves: token-id lists shuffled with ``seed`` and halved; input dicts (batches)
    alternate (a single batch is split by its rows)."""
    if not data:
        raise ValueError("no calibration data: pass token-id lists or input dicts (input_ids, attention_mask)")
    if isinstance(data[0], dict):
        if len(data) == 1 and data[0]["input_ids"].shape[0] >= 2:
            half = data[0]["input_ids"].shape[0] // 2
            return [{k: v[:half] for k, v in data[0].items()}], [{k: v[half:] for k, v in data[0].items()}]
        if len(data) < 2:
            raise ValueError(
                "one calibration input given: pass at least two (the search and the check use different ones)"
            )
        return list(data[0::2]), list(data[1::2])
    if len(data) < 2:
        raise ValueError("one calibration input given: pass at least two (the search and the check use different ones)")
    order = list(range(len(data)))
    random.Random(seed).shuffle(order)
    half = len(order) // 2
    fit = as_batches([data[i] for i in order[:half]], batch_size, pad_id)
    check = as_batches([data[i] for i in order[half:]], batch_size, pad_id)
    return fit, check


def check_candidate(s: Setup) -> None:
    """Refuse a candidate autotune cannot take (``full``, always one; a method with learned state), before anything
    is loaded."""
    spec = get_method(s.method)
    if s.method == "full":
        raise ValueError("'full' is always a candidate; name only approximations")
    if spec.requires_fit(spec.make_config(**s.options)):
        raise ValueError(
            f"candidate {short_label({'name': s.method, **s.config()})} has fitted state; autotune draws its "
            "candidates fresh: choose methods without learned state (see `approx methods`)"
        )


def _candidate_layers(model, setups: list[Setup]) -> list[dict[int, ApproxAttention]]:
    """Each candidate's layers for every attention layer, drawn as :func:`approx.patch` draws them."""
    layers = []
    for s in setups:
        check_candidate(s)
        patch(model, s.method, **s.options)
        layers.append(patched_layers(model))
        unpatch(model)
    return layers


def _share(value: float | None, full: float | None) -> float | None:
    return value / full if value is not None and full and math.isfinite(value) else None


def _cost(
    layer: ApproxAttention, masks: list[tuple[torch.Tensor, torch.Tensor | None]], convention: str, heads: int
) -> float:
    """A layer's attention cost over batches (their attention masks and question tokens, :func:`_masks`), summed over
    its ``heads`` heads, from its method's cost model at their real lengths (with the batches' data for a method whose
    cost depends on it; exact attention's on heads the method leaves exact); infinite for a method that does not
    count this convention. The harness's probe counts the same, but for the exact attention of rows a method broke
    down on (FAVOR+'s underflow), which it adds from the run: so a tuned model's table can put such a layer above
    the cost the search chose it at."""
    total = 0.0
    for mask, question in masks:
        with _context.tokens(question_mask=question):
            costs = layer.costs(b=mask.shape[0], n=mask.shape[1], key_mask=mask, d=layer.head_dim,
                                dv=layer.head_dim, heads=heads)  # fmt: skip
        for c in costs:
            value = c.flops if convention == "flops" else c.matmul_macs
            if value is None:
                return math.inf
            total += value
    return total


def _head_counts(counts: Sequence[int], heads: int) -> list[int]:
    """The head counts to try each candidate on, checked against the model's ``heads``: sorted, without repeats."""
    if isinstance(counts, (str, bytes)) or not hasattr(counts, "__iter__"):
        raise ValueError(f"head_counts must be a list of integers, got {counts!r}")
    chosen = []
    for k in counts:
        n = as_integer(k)
        if n is None or not 1 <= n < heads:
            raise ValueError(
                f"head_counts: {k!r} is not a number of heads from 1 to {heads - 1} (the model has {heads} heads a "
                "layer; every head is the candidate itself)"
            )
        chosen.append(n)
    return sorted(set(chosen))


class Search:
    """Steps 1 and 2 of the module docstring, done once: every candidate measured on every layer alone (the *fit*
    inputs), the search path, and the unpatched model's outputs on the *check* inputs. :meth:`choose` then does
    steps 3 and 4 for a target or budget, as often as wanted (e.g. for a range of targets) without measuring again.
    ``measure``: ``"cosine"`` or ``"kl"`` (what the targets will be); the other arguments as :func:`autotune`'s."""

    def __init__(
        self,
        model: torch.nn.Module,
        data: Iterable,
        *,
        measure: str = "cosine",
        methods: Sequence[str | Setup | MethodConfig] | None = None,
        cost: str = "flops",
        check_data: Iterable | None = None,
        cost_data: Iterable | None = None,
        head_counts: Sequence[int] = (),
        batch_size: int = 8,
        pad_id: int | None = None,
        seed: int = 0,
        progress: bool = True,
        local: str | None = None,
    ) -> None:
        wall = time.perf_counter()
        self.local = _check_local(model, local)
        if measure not in ("cosine", "kl"):
            raise ValueError(f"measure {measure!r} unknown; choose cosine or kl")
        if cost not in COSTS:
            raise ValueError(f"cost convention {cost!r} unknown; choose one of: {', '.join(COSTS)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if is_patched(model):
            raise ValueError(
                "the model is patched: autotune compares with the unpatched model; approx.unpatch it first"
            )
        if isinstance(methods, (str, os.PathLike, Setup, MethodConfig, dict)):  # one candidate, as evaluate reads it
            methods = [methods]  # (a string was read letter by letter, a folder's Path or a layers dict refused)
        given = list(methods) if methods is not None else list(DEFAULT_CANDIDATES)
        if not given:
            raise ValueError("name at least one candidate method (see `approx methods`)")
        setups = [as_setup(m, seed) for m in given]
        self.heads = attention_shape(model)[1]
        self.head_counts = _head_counts(head_counts, self.heads)
        self.labels = [short_label({"name": s.method, **s.config()}) for s in setups]
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"candidates named twice: {sorted({x for x in self.labels if self.labels.count(x) > 1})}")
        if pad_id is None:
            pad_id = getattr(model.config, "pad_token_id", None) or 0
        data = input_list(data)
        if check_data is None:
            fit_batches, check_batches = _split(data, seed, batch_size, pad_id)
        else:
            fit_batches = as_batches(data, batch_size, pad_id)
            check_batches = as_batches(check_data, batch_size, pad_id)
        cost_batches = None
        if cost_data is not None:
            cost_data = input_list(cost_data)
            if not cost_data:
                raise ValueError("cost_data is empty: give the inputs to take the costs at, or None (the check inputs)")
            cost_batches = as_batches(cost_data, batch_size, pad_id)
        self.model, self.measure, self.cost_convention, self.seed = model, Target(measure, 1.0), cost, seed
        # seeded for any draw a method makes from torch's global generator; the caller's generators are left as they were
        cuda = range(torch.cuda.device_count()) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed)
            with _evaluating(model), torch.inference_mode():
                self._measure(setups, fit_batches, check_batches, cost_batches, progress)
        self.seconds = time.perf_counter() - wall

    def _measure(self, setups, fit_batches, check_batches, cost_batches, progress: bool) -> None:
        model, labels = self.model, self.labels
        self.options = _candidate_layers(model, setups)  # per column (candidate), layer -> its layer
        self.bases = list(range(len(labels)))  # per column, the candidate it runs (a column on some heads: its own)
        self.full = _full_layers(model)
        # the layers tuned, one row of the search each: every attention layer but a model's sliding-window layers
        # (ModernBERT's), which keep their own attention in every assignment and are left out of its cost
        self.rows = sorted(self.full)
        self.local_layers = local_layers(model)
        n_layers = len(self.rows)
        fit = _Calibration(model, fit_batches, self.measure, self.local, "the search's calibration inputs")
        self.check = _Calibration(model, check_batches, self.measure, self.local, "the check's calibration inputs")
        # per layer, per option (option 0 full attention, option c column c - 1): the loss, and per convention the
        # costs the path, the budget and the report use: each layer's cost model at the cost inputs' lengths (the
        # check inputs', where the verification runs, unless cost_data was given; the table below: the fit inputs'),
        # taken before the long measurement so that inputs they cannot be taken at are refused first
        self.loss = [[0.0] for _ in range(n_layers)]
        self.costs = {k: [[0.0] for _ in range(n_layers)] for k in COSTS}
        self.cost_inputs = self.check.inputs if cost_batches is None else _inputs(cost_batches)
        self._cost_masks = (
            self.check.masks if cost_batches is None else [_masks(model, b, "a cost batch") for b in cost_batches]
        )
        if not any(bool(mask.any()) for mask, _ in self._cost_masks):
            raise ValueError("the cost inputs hold no real token (every attention mask is 0): nothing to take costs at")
        for convention in COSTS:
            for r, i in enumerate(self.rows):
                self.costs[convention][r][0] = _cost(self.full[i], self._cost_masks, convention, self.heads)
        for c in range(len(labels)):
            self._add_costs(c)
        self.table = []
        runs = n_layers * len(labels) * (1 + len(self.head_counts))
        bar = tqdm(total=runs, disable=not progress, desc="autotune: each layer alone", unit="run")
        with bar:
            candidates = len(labels)
            errors = [self._measure_column(fit, c, bar) for c in range(candidates)]
            for k in self.head_counts:  # each candidate on the k heads of each layer where it changes least
                for c in range(candidates):
                    self.options.append({
                        i: layer.with_heads(errors[c][i].argsort(stable=True)[:k].tolist())
                        for i, layer in self.options[c].items()
                    })  # fmt: skip
                    self.labels.append(f"{self.labels[c]} on {k} heads")
                    self.bases.append(c)
                    self._add_costs(len(self.labels) - 1)
                    self._measure_column(fit, len(self.labels) - 1, bar)
        self.fit_inputs, self.fit_forwards = fit.inputs, fit.forwards
        self.paths: dict[str, list[list[int]]] = {}
        self.points: dict[str, list[dict[str, Any]]] = {}
        self.measured: dict[tuple[int, ...], tuple[float, AttentionProbe]] = {}  # by assignment, shared by paths
        # per scorer (:func:`_scorer_key`, the scorer kept beside): its raw scores by assignment, None the unpatched
        # model's
        self.scores: dict[tuple, tuple[Callable, dict[tuple[int, ...] | None, float]]] = {}
        # per scorer: the predictions behind those scores, where the scorer gives them (a TaskScorer does)
        self.predictions: dict[tuple, dict[tuple[int, ...] | None, list]] = {}

    def _add_costs(self, column: int) -> None:
        """Each layer's costs of one column (as option ``column + 1``), in both conventions."""
        for convention in COSTS:
            for i, row in zip(self.rows, self.costs[convention], strict=True):
                row.append(_cost(self.options[column][i], self._cost_masks, convention, self.heads))

    def _measure_column(self, fit: _Calibration, column: int, bar) -> dict[int, torch.Tensor]:
        """Every layer alone with one column's layer (as option ``column + 1``): its loss and a row of the table each.
        Returns per layer the squared attention-output error of each head, summed over the fit inputs."""
        label, errors = self.labels[column], {}
        for i, layer in self.options[column].items():
            bar.set_postfix_str(f"layer {i}, {label}", refresh=False)
            fidelity, probe = fit.run({i: layer})
            loss = self.measure.loss(fidelity)
            self.loss[self.rows.index(i)].append(loss)
            if not math.isfinite(loss):
                warnings.warn(f"autotune: {label} on layer {i} gives fidelity {fidelity}: never chosen", stacklevel=4)
            err = math.sqrt(probe.err_num[str(i)] / max(probe.err_den[str(i)], 1e-30))
            self.table.append({
                "layer": i, "candidate": label, "fidelity": fidelity, "loss": loss, "attention_relative_error": err,
                **({} if layer.heads is None else {"heads": list(layer.heads)}),
                **{RATIO_NAMES[k]: _share(probe.cost[COSTS[k][0]], probe.cost[COSTS[k][1]]) for k in COSTS},
            })  # fmt: skip
            errors[i] = probe.head_err_num[str(i)]
            bar.update(1)
        return errors

    def _choice(self, layer: int, option: int) -> str:
        """What a layer runs at an option, for :attr:`Tuning.choices`: ``"full"``, a candidate's label, or on some
        heads the label and those heads (``"bigbird:block=16[heads 0,3,5]"``)."""
        if option == 0:
            return "full"
        heads = self.options[option - 1][layer].heads
        return self.labels[option - 1] if heads is None else self.labels[self.bases[option - 1]] + heads_label(heads)

    def _choices(self, assignment: Sequence[int]) -> list[str]:
        """:attr:`Tuning.choices` of an assignment (one option per row): per attention layer, :meth:`_choice`, or
        :data:`LOCAL_CHOICES` for a sliding-window layer (by the tuning's ``local``)."""
        chosen = {i: self._choice(i, a) for i, a in zip(self.rows, assignment, strict=True)}
        local = LOCAL_CHOICES[self.local or "model"]
        return [chosen.get(i, local) for i in range(len(self.rows) + len(self.local_layers))]

    def _path(self, convention: str) -> tuple[list[list[int]], list[dict[str, Any]]]:
        """The search path (step 2) for a cost convention and its points (choices, cost ratio, estimated loss)."""
        if convention not in self.paths:
            costs = self.costs[convention]
            total_full = sum(row[0] for row in costs)
            path = hull_path(self.loss, costs)
            self.paths[convention] = path
            self.points[convention] = [
                {
                    "choices": self._choices(p),
                    "cost": sum(costs[i][a] for i, a in enumerate(p)) / total_full,
                    "estimated_loss": sum(self.loss[i][a] for i, a in enumerate(p)),
                }
                for p in path
            ]
        return self.paths[convention], self.points[convention]

    def _ratio(self, assignment: Sequence[int], convention: str) -> float | None:
        """The attention cost of ``assignment`` relative to full attention at the cost inputs (None: a method that
        does not count this convention)."""
        costs = self.costs[convention]
        mine = sum(costs[i][a] for i, a in enumerate(assignment))
        full = sum(row[0] for row in costs)
        return mine / full if full and math.isfinite(mine) else None

    def _layers(self, assignment: Sequence[int]) -> dict[int, ApproxAttention]:
        return {
            i: (self.full[i] if a == 0 else self.options[a - 1][i]) for i, a in zip(self.rows, assignment, strict=True)
        }

    def _verify(self, assignment: Sequence[int]) -> float:
        """The measured fidelity of an assignment on the check inputs (run once, then remembered)."""
        key = tuple(assignment)
        if key not in self.measured:
            self.measured[key] = self.check.run(self._layers(assignment))
            log.info("autotune: %s: %.5f", key, self.measured[key][0])
        return self.measured[key][0]

    def _scored(self, assignment: Sequence[int] | None, score) -> float:
        """``score`` of an assignment (None: the unpatched model) as a fraction of the unpatched model's score, each
        run once per scorer, then remembered."""
        cache = self.scores.setdefault(_scorer_key(score), (score, {}))[1]  # the scorer kept: its key stays its own
        predictions = self.predictions.setdefault(_scorer_key(score), {})
        key = None if assignment is None else tuple(assignment)
        if None not in cache:
            # the model is unpatched here (choose unpatches it first)
            reference = self._score_once(score, predictions, None)
            relative(reference, reference)  # refuses a reference of 0, below or not a number, before keeping it
            cache[None] = reference
        if key not in cache:
            attach(self.model, self._layers(assignment), local=self.local)
            try:
                cache[key] = self._score_once(score, predictions, key)
            finally:
                unpatch(self.model)
            log.info("autotune: %s: score %.5f", key, cache[key])
        return relative(cache[key], cache[None])

    def _score_once(self, score, predictions: dict, key) -> float:
        """``score`` of the model as it is; a scorer that gives its predictions too (``scored``, as
        :class:`~approx.harness.scoring.TaskScorer` does) has them kept under ``key``, for the chosen model's
        interval."""
        if hasattr(score, "scored") and hasattr(score, "interval"):
            value, predictions[key] = score.scored(self.model)
            return float(value)
        return float(score(self.model))

    def choose(
        self,
        target: str | float | Target | None = None,
        budget: float | None = None,
        *,
        cost: str | None = None,
        score: Callable[[torch.nn.Module], float] | None = None,
        uniform: bool = True,
        progress: bool = True,
    ) -> Tuning:
        """Steps 3 and 4: patch the model with the cheapest path point that meets ``target`` (by bisection along the path,
        as if fidelity fell monotonically along it), or with ``budget`` alone the dearest point within it (the lowest
        estimated loss); returns the :class:`Tuning`. ``cost``: the convention of the path and the budget (default:
        the search's). ``score``: with a ``score>=X`` target, a callable giving the task's metric of the model as it
        is (:func:`~approx.harness.scoring.task_scorer`): the target is met where it is at least X times the unpatched
        model's (the path is still the search's, built from its fidelity measure). ``uniform`` (default true): then
        weigh the uniform settings too, each candidate on every layer, verified end to end the same way (a score
        target: scored): the cheapest that meets the target is taken when it costs less than the path's point (with a
        budget too, where no path point within it meets the target: the cheapest within it that does; with a budget
        alone: the most faithful within it, when it measures better): :attr:`Tuning.origin` says which was taken.
        The model is unpatched first (a patch of this search's or any)."""
        wall = time.perf_counter()
        goal = check_goal(target, budget)
        convention = cost or self.cost_convention
        if convention not in COSTS:
            raise ValueError(f"cost convention {convention!r} unknown; choose one of: {', '.join(COSTS)}")
        scoring = check_score(goal, score)
        if goal is not None and not scoring and goal.measure != self.measure.measure:
            raise ValueError(
                f"target {goal} is a {goal.measure} target, and this search measured {self.measure.measure}"
            )
        if is_patched(self.model):
            unpatch(self.model)
        path, points = self._path(convention)
        within = [j for j, p in enumerate(points) if budget is None or p["cost"] <= budget + 1e-12]
        last = len(points) - 1  # the bisection's runs: the path's end, then ceil(log2(last)) halvings (a budget: one)
        steps = 1 if goal is None or last < 2 else 1 + math.ceil(math.log2(last))

        def value(assignment: Sequence[int]) -> float:  # what the target judges of an assignment
            return self._scored(assignment, score) if scoring else self._verify(assignment)

        meets = None if goal is None else lambda j: goal.met(value(path[j]))
        with _evaluating(self.model), torch.inference_mode():
            with tqdm(total=steps, disable=not progress, desc="autotune: verify", unit="run") as bar:
                chosen = self._bisect(path, meets, within, bar)
                bar.total = bar.n  # the path's end may meet the target: fewer runs than the bracket allows
                bar.refresh()
            assignment = path[chosen]
            # what a measured value is, for the warnings
            unit = "of the unpatched model's score" if scoring else self.measure.measure
            met = goal.met(value(assignment)) if goal else True
            if goal is not None and not met:
                warnings.warn(
                    f"autotune: even full attention on every layer measures {value(assignment):.5f} ({unit}), short "
                    f"of {goal}",
                    stacklevel=2,
                )
            assignment, met, origin, over = self._settle(
                path, points, chosen, within, goal, met, budget, convention, value, uniform, progress
            )
            if over and not met:
                measured = value(assignment) if goal else self._verify(assignment)
                warnings.warn(
                    f"autotune: the {'target' if goal else 'budget'} cannot be met within cost {budget:g} along "
                    f"the search path{' or by a uniform setting' if uniform else ''}; kept the assignment at cost "
                    f"{self._ratio(assignment, convention):.3f} (it measures {measured:.5f}, {unit})",
                    stacklevel=2,
                )
            fidelity = self._verify(assignment)  # the search's fidelity measure, for a score target too
        attach(self.model, self._layers(assignment), local=self.local)
        costs = {RATIO_NAMES[k]: self._ratio(assignment, k) for k in COSTS}
        tuning = Tuning(
            choices=self._choices(assignment),
            fidelity=fidelity,
            cost=costs[RATIO_NAMES[convention]],
            costs=costs,
            met=met,
            target=None if goal is None else str(goal),
            budget=budget,
            cost_convention=convention,
            candidates=list(self.labels),
            table=self.table,
            path=self._path_records(path, points, score if scoring else None),
            calibration=self._calibration(time.perf_counter() - wall),
            seed=self.seed,
            score=self._score_record(assignment, score) if scoring else None,
            measure=self.measure.measure,
            head_counts=list(self.head_counts),
            origin=origin,
            uniform=self._uniform_records(convention, score if scoring else None) if uniform else [],
            local=self.local or "model",
        )
        set_tuning(self.model, tuning.to_dict())
        return tuning

    def _calibration(self, choose_seconds: float) -> dict[str, Any]:
        """:attr:`Tuning.calibration`: the inputs measured, verified and costed, the forward passes and the time."""
        return {
            "fit_inputs": self.fit_inputs,
            "check_inputs": self.check.inputs,
            "cost_inputs": self.cost_inputs,
            "forward_passes": self.fit_forwards + self.check.forwards,
            "measure_seconds": self.seconds,
            "choose_seconds": choose_seconds,
        }

    def _settle(self, path, points, chosen, within, goal, met, budget, convention, value, uniform, progress):
        """After the bisection: a path point over the budget gives way to the first point within it (measured against
        the target), then step 4 (:meth:`_uniform_choice`). Returns the assignment, whether it meets the target (and
        the budget), its origin (``"path"`` or ``"uniform"``) and whether the bisection's point was over the budget."""
        assignment = path[chosen]
        over = budget is not None and points[chosen]["cost"] > budget + 1e-12
        if over:
            met = False
            if goal is not None and within:
                assignment = path[within[0]]
                # beyond the bisection's bracket a point may still meet the target (a noisy score, say)
                met = goal.met(value(assignment))
        if uniform and (met or over):  # (a target that even full attention misses: none)
            better = self._uniform_choice(assignment, goal, met, budget, convention, value, progress)
            if better is not None:
                return better, True, "uniform", over
        return assignment, met, "path", over

    def _uniform(self, convention: str, budget: float | None) -> list[tuple[float, list[int]]]:
        """The uniform settings as assignments (each candidate on every layer, a candidate on some heads excepted)
        with their cost ratio in ``convention``, cheapest first: those cheaper than full attention and within
        ``budget``, with a finite loss on every layer (a candidate that broke down on a layer is never chosen)."""
        n, out = len(self.loss), []
        for column, base in enumerate(self.bases):
            if base != column:  # a candidate on some heads
                continue
            assignment = [column + 1] * n
            ratio = self._ratio(assignment, convention)
            if ratio is None or not ratio < 1.0 or (budget is not None and ratio > budget + 1e-12):
                continue
            if all(math.isfinite(self.loss[i][column + 1]) for i in range(n)):
                out.append((ratio, assignment))
        return sorted(out, key=lambda item: item[0])

    def _uniform_choice(self, assignment, goal, met, budget, convention, value, progress) -> list[int] | None:
        """A uniform setting (:meth:`_uniform`) to take instead of ``assignment``, the path's choice, or None. With a
        target: the cheapest meeting it that costs less than ``assignment`` (any within the budget when
        ``assignment`` misses the target); with a budget alone: the most faithful as measured, when it measures
        better than ``assignment`` (or ``assignment`` is over the budget)."""
        options = self._uniform(convention, budget)
        if goal is not None and met:
            current = self._ratio(assignment, convention)
            options = [o for o in options if current is None or o[0] < current - 1e-12]
        best, best_loss = None, math.inf
        if goal is None and met:
            best_loss = self.measure.loss(self._verify(assignment))
        with tqdm(total=len(options), disable=not progress or not options, desc="autotune: uniform", unit="run") as bar:
            for _, option in options:
                if goal is not None:
                    found = goal.met(value(option))
                    bar.update(1)
                    if found:
                        return option
                    continue
                loss = self.measure.loss(self._verify(option))
                bar.update(1)
                if loss < best_loss:
                    best, best_loss = option, loss
        return best

    def _uniform_records(self, convention: str, score) -> list[dict[str, Any]]:
        """The uniform settings for a :class:`Tuning`: each candidate's label, cost ratio in ``convention`` and, where
        verified, its measured fidelity (and score)."""
        n = len(self.loss)
        return [
            {
                "choice": self.labels[c],
                "cost": self._ratio([c + 1] * n, convention),
                **self._measured([c + 1] * n, score),
            }
            for c, base in enumerate(self.bases)
            if base == c
        ]

    def _path_records(self, path: list[list[int]], points: list[dict[str, Any]], score) -> list[dict[str, Any]]:
        """The path's points for a :class:`Tuning`: with the measured fidelity of the ones verified, and the score (a
        fraction of the unpatched model's) of the ones ``score`` scored."""
        return [{**p, **self._measured(a, score)} for a, p in zip(path, points, strict=True)]

    def _measured(self, assignment: Sequence[int], score) -> dict[str, float]:
        """What was measured of an assignment: its fidelity where verified, its score (a fraction of the unpatched
        model's) where ``score`` scored it."""
        key, out = tuple(assignment), {}
        if key in self.measured:
            out["measured_fidelity"] = self.measured[key][0]
        scores = {} if score is None else self.scores[_scorer_key(score)][1]
        if key in scores:
            out["measured_score"] = relative(scores[key], scores[None])
        return out

    def _score_record(self, assignment: Sequence[int], score) -> dict[str, Any]:
        """:attr:`Tuning.score` of a scored assignment."""
        cache = self.scores[_scorer_key(score)][1]
        record = {
            "value": cache[tuple(assignment)],
            "reference": cache[None],
            "relative": relative(cache[tuple(assignment)], cache[None]),
            "scorer": score.describe() if hasattr(score, "describe") else _name(score),
        }
        predictions = self.predictions.get(_scorer_key(score), {})
        if tuple(assignment) in predictions and None in predictions and len(predictions[None]) > 1:
            # how far the kept share could move with other examples of the same kind: the cheapest assignment that
            # passes on these examples may have passed by their luck (the drawn examples' bootstrap, this seed's)
            iv = score.interval(predictions[tuple(assignment)], predictions[None], seed=self.seed)
            entry = iv["metrics"][score.metric] if hasattr(score, "metric") else None
            if entry is not None:
                reference = cache[None]
                record["interval"] = {
                    "level": iv["level"],
                    "resamples": iv["resamples"],
                    "seed": iv["seed"],
                    "difference": [entry["low"], entry["high"]],
                    "relative": [1 + entry["low"] / reference, 1 + entry["high"] / reference],
                }
        return record

    def _bisect(self, path: list[list[int]], meets: Callable[[int], bool] | None, within: list[int], bar) -> int:
        """The chosen path point: with ``meets`` (whether point j meets the target, measured), the cheapest that
        does, by bisection; without (a budget alone), the first within the budget, measured."""
        last = len(path) - 1
        if meets is None:  # budget alone: the most faithful point (by the estimate) within it, measured
            chosen = within[0] if within else last
            self._verify(path[chosen])
            bar.update(1)
            return chosen
        met = meets(last)
        bar.update(1)
        if met:
            return last
        lo, hi = 0, last  # as if fidelity fell monotonically along the path: hi misses the target
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if meets(mid):
                lo = mid
            else:
                hi = mid
            bar.update(1)
        meets(lo)
        return lo


def _scorer_key(fn) -> tuple:
    """What identifies a scorer across calls: the object, or for a bound method (``obj.score``, a new object at each
    attribute access) its instance and function."""
    owner = getattr(fn, "__self__", None)
    return (id(fn), None) if owner is None else (id(owner), getattr(fn, "__func__", None))


def _name(fn) -> str:
    """A callable's name for a record (no memory address)."""
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


class _evaluating:  # noqa: N801
    """The model in eval mode within the block, its training flag restored afterwards."""

    def __init__(self, model) -> None:
        self.model = model

    def __enter__(self) -> None:
        self.training = self.model.training
        self.model.eval()

    def __exit__(self, *exc) -> None:
        self.model.train(self.training)


def autotune(
    model: torch.nn.Module,
    data: Iterable,
    *,
    target: str | float | Target | None = DEFAULT_TARGET,
    methods: Sequence[str | Setup | MethodConfig] | None = None,
    budget: float | None = None,
    cost: str = "flops",
    score: Callable[[torch.nn.Module], float] | None = None,
    measure: str | None = None,
    check_data: Iterable | None = None,
    cost_data: Iterable | None = None,
    head_counts: Sequence[int] = (),
    uniform: bool = True,
    batch_size: int = 8,
    pad_id: int | None = None,
    seed: int = 0,
    progress: bool = True,
    local: str | None = None,
) -> Tuning:
    """Patch ``model`` in place with one method and budget per attention layer, the cheapest assignment whose
    end-to-end fidelity meets ``target`` (the search is in this module's docstring); returns the
    :class:`Tuning`, which :func:`approx.save` also records with the model.

    ``data``: unlabelled calibration inputs (token-id lists, or input dicts of ``input_ids`` and
    ``attention_mask``, e.g. a task's inputs or text windows): shuffled with ``seed`` and halved into the inputs
    measured per layer and the held-out inputs the choice is verified on (dicts are taken as batches and
    alternate); ``check_data``: the held-out inputs given separately (then all of ``data`` is measured);
    ``cost_data``: inputs like those the tuned model will run on (token-id lists or batches), at whose real lengths
    the costs of the search, the budget and the report are taken; the model never runs on them (default: the check
    inputs). Give a few hundred of the task's inputs when a few dozen check inputs would misrepresent the lengths
    the model meets.
    ``target``: ``"cosine>=X"`` (last hidden states, mean over real tokens), ``"kl<=X"`` (the output
    distributions of a model with a task head) or a float (a cosine); by default ``"cosine>=0.99"``, or none when a
    ``budget`` is given (as ``approx autotune`` takes them). ``"score>=X"`` keeps X times the unpatched model's
    task metric instead, as ``score`` (a callable giving the metric of the model as it is, e.g.
    :func:`~approx.harness.scoring.task_scorer` on labelled examples the model will not be evaluated on) measures
    it; the path is then searched with ``measure`` (``"kl"`` or ``"cosine"``; default: ``"kl"`` for a model whose head
    gives distributions, else ``"cosine"``) and verified by the score. ``methods``: the
    candidate methods with their budgets (``"i-clustered:clusters=50"``, Setups or configs; default
    :data:`DEFAULT_CANDIDATES`); full attention is always one. ``budget``: the highest attention cost allowed,
    relative to full attention in the ``cost`` convention (``"flops"``: approx's full cost model;
    ``"matmul"``: the attention matmul multiply-accumulates of the literature); with a target too, a target
    not reachable within it is reported (``met`` false, a warning) and the best assignment within it is kept.
    ``head_counts``: also try each candidate on only that many heads of a layer (e.g. ``(6, 9)`` of 12), the
    heads where it changed the layer's attention output least when it ran on all of them, the other heads exact
    (``approx.patch(..., on_heads=...)``): one more run per layer, candidate and count.
    ``uniform``: also verify the uniform settings (each candidate on every layer) and take the cheapest meeting the
    target when it costs less than the search path's choice (step 4 of the module docstring); false: the path only.
    ``pad_id``: padding of token-id lists (default: the model config's ``pad_token_id``, else 0). ``local``: how a
    model's sliding-window layers run in every run of the tuning but the unpatched reference's, and in the tuned model
    (:func:`approx.patch`'s option: ``"band"``, approx's banded kernel, CPU only; None or ``"model"``: their own
    attention). For several targets on the same measurements, use :class:`Search` and its ``choose``.
    """
    if isinstance(target, _DefaultTarget) and budget is not None:  # a budget alone, as on the command line
        target = None
    goal = check_goal(target, budget)  # refused before anything is measured
    scoring = check_score(goal, score)
    if measure is not None and goal is not None and not scoring and measure != goal.measure:
        raise ValueError(f"measure {measure!r} given with target {goal}: a {goal.measure} target is measured so")
    if measure is None:
        measure = default_measure(model) if scoring else goal.measure if goal else "cosine"
    search = Search(
        model, data, measure=measure, methods=methods, cost=cost, check_data=check_data,
        cost_data=cost_data, head_counts=head_counts, batch_size=batch_size, pad_id=pad_id, seed=seed,
        progress=progress, local=local,
    )  # fmt: skip
    return search.choose(goal, budget, score=score, uniform=uniform, progress=progress)


def default_measure(model: torch.nn.Module) -> str:
    """The search's fidelity measure under a score target: ``"kl"`` when the model's head gives distributions
    (classification, QA, masked LM), ``"cosine"`` for a bare encoder or a regression head (one score per input)."""
    head = model_head_from_name(type(model).__name__)
    if head == "base" or (head == "sequence-classification" and getattr(model.config, "num_labels", 2) == 1):
        return "cosine"
    return "kl"


def _check_local(model, local: str | None) -> str | None:
    """``local`` checked as :func:`approx.patch` checks it (a known mode; ``"band"`` for a model with sliding-window
    layers only), and ``"band"`` refused off the CPU, where the kernel would not run and the tuning would say it had."""
    check_local(model, attention_modules(model), local)
    device = next(model.parameters()).device
    if local == "band" and device.type != "cpu":
        raise ValueError(
            f"local='band' runs approx's banded kernel on the CPU only; the model is on {device}, where the "
            "sliding-window layers run their own attention: tune it there with local='model'"
        )
    return local


def _full_layers(model) -> dict[int, ApproxAttention]:
    """Exact attention through approx on every layer: a layer the tuning leaves exact is still recorded."""
    patch(model, "full")
    layers = patched_layers(model)
    unpatch(model)
    return layers


def task_batches(
    model,
    tokenizer,
    task: str,
    *,
    split: str | None = None,
    limit: int | None = None,
    max_length: int | None = None,
    batch_size: int = 8,
    seed: int = 0,
    data_dir: str | None = None,
    source: str | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Calibration inputs from a task's ``split`` (its labels unused): the inputs the task feeds ``model``'s head
    (token types included), shuffled with ``seed`` and batched; :func:`autotune` alternates the batches between
    its two halves. Calibrate on a training split (e.g. ``dev/0`` of a cross-fitted task) and evaluate on
    another."""
    from ..integration import model_head_from_name
    from .tasks import get_task
    from .tasks.base import collate

    spec = get_task(task)
    mode = spec.mode_for(model_head_from_name(type(model).__name__))
    if split is None:
        split = spec.default_split
        log.warning(
            "autotune: calibrating on %s %s, the split an evaluation reads by default: evaluate the tuned model on "
            "another split, or calibrate on the data the model was trained on (split=...)",
            task,
            split,
        )
    examples, _ = spec.load(split, source=source, data_dir=data_dir, limit=limit)
    length = spec.default_max_length if max_length is None else max_length
    features = spec.features(examples, tokenizer, max_length=length, mode=mode)
    if len(features) < 2:
        raise ValueError(f"{task} {split}: {len(features)} input(s); autotune needs at least two")
    order = list(range(len(features)))
    random.Random(seed).shuffle(order)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    rows = [features[i] for i in order]
    return [collate(rows[i : i + batch_size], pad, device) for i in range(0, len(rows), batch_size)]
