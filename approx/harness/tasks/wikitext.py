"""WikiText-2 / WikiText-103 (Merity et al. 2016): masked-LM loss and fidelity on fixed-length windows.

Protocol (version 1): the tokenised WikiText file of the split (``wiki.test.tokens``; hub:
``Salesforce/wikitext``, ``wikitext-2-v1`` / ``wikitext-103-v1``) is tokenised whole without special
tokens and cut into consecutive non-overlapping chunks of ``max_length - 2`` tokens (default window 512),
each wrapped as ``[CLS] chunk [SEP]``; ``--limit`` keeps the first windows.

* ``masked-lm`` mode (a checkpoint with a masked-LM head): in each window 15 % of the chunk's positions
  (at least one), drawn by a generator seeded with the window's index, are replaced by the mask token
  (no 80/10/10 mixing). Metrics: the mean cross-entropy at those positions (``mlm_loss``, nats),
  ``perplexity`` = exp(mlm_loss) and ``bits_per_token`` = mlm_loss / ln 2 (the same loss in bits per
  masked token; the text after the last whole window is not scored). This is a single-pass estimate, not
  Salazar et al.'s one-token-at-a-time pseudo-perplexity (which needs one forward pass per token). Fidelity:
  top-1 agreement at the masked positions and the KL divergence of the predicted token distributions there.
* ``fidelity`` mode (any encoder): the unmasked windows; no task metric, only the fidelity the harness
  measures for every task (hidden-state cosine per layer, attention-output error).

Training (``approx finetune --task wikitext2 --train-split valid``: a masked-LM head, fresh on a bare encoder):
the same windows, unmasked, masked anew in every epoch as BERT was (Devlin et al. 2019): 15 % of the chunk's
positions (at least one) drawn by a generator seeded with (seed, epoch, window), each replaced by the mask token
(80 %), a random token that is not a special one (10 %) or left as it is (10 %); labels are the original tokens
there and -100 elsewhere (:func:`training_mask`). The evaluation protocol above is not affected.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from ...config import as_integer
from ..data import read_wikitext, token_windows
from .base import Feature, Task, register_task

MASK_FRACTION = 0.15
TRAIN_MIX = (0.8, 0.1, 0.1)  # training: of the chosen positions, [MASK] / a random token / unchanged
MLM = "masked-lm"
FIDELITY = "fidelity"


def mask_positions(window_index: int, body: int, fraction: float = MASK_FRACTION) -> list[int]:
    """The masked positions (1 .. body) of window ``window_index``: fixed by the protocol, not by a seed."""
    g = torch.Generator().manual_seed(1_000_003 * (window_index + 1))
    count = max(1, round(fraction * body))
    return sorted((torch.randperm(body, generator=g)[:count] + 1).tolist())


def training_mask(
    ids: list[int], *, window: int, epoch: int, seed: int, mask_id: int, candidates: torch.Tensor
) -> tuple[list[int], list[int]]:
    """(input ids, labels) of training window ``window`` of ``[CLS] chunk [SEP]`` ids in ``epoch``: BERT's dynamic
    masking. ``candidates``: the token ids a random replacement is drawn from (the vocabulary less special tokens)."""
    body = len(ids) - 2
    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 1_000_033 + window)
    count = max(1, round(MASK_FRACTION * body))
    positions = torch.randperm(body, generator=g)[:count] + 1  # (P,) inside the chunk
    u = torch.rand(count, generator=g)  # (P,) which of the three each chosen position gets
    replacements = candidates[torch.randint(len(candidates), (count,), generator=g)]  # (P,)
    inputs = torch.tensor(ids)
    labels = torch.full_like(inputs, -100)
    labels[positions] = inputs[positions]
    masked, swapped = u < TRAIN_MIX[0], (u >= TRAIN_MIX[0]) & (u < TRAIN_MIX[0] + TRAIN_MIX[1])
    inputs[positions[masked]] = mask_id
    inputs[positions[swapped]] = replacements[swapped]
    return inputs.tolist(), labels.tolist()


class WikiText(Task):
    version = 1
    default_max_length = 512
    modes: ClassVar[dict[str, str]] = {"masked-lm": MLM, "base": FIDELITY}
    splits = ("test", "valid")
    default_split = "test"
    folder: ClassVar[str]
    hub_config: ClassVar[str]

    def local_files(self, split):
        return [f"{self.folder}/wiki.{split}.tokens"]

    def read_local(self, folder, split):
        path = folder / self.local_files(split)[0]
        return [{"text": read_wikitext(path), "source": str(path)}]

    def read_hub(self, split):
        import datasets

        rows = datasets.load_dataset(
            "Salesforce/wikitext", self.hub_config, split={"valid": "validation"}.get(split, split)
        )
        return [{"text": "".join(rows["text"]), "source": f"Salesforce/wikitext {self.hub_config} {split}"}]

    def load(self, split=None, *, source=None, data_dir=None, limit=None):
        # one "example" holds the whole text; windows are made with the tokenizer, and `limit` counts windows
        if split and "/" in split:
            raise ValueError(f"{self.name}: cross-fitting halves ({split!r}) are for GLUE and SQuAD, not WikiText")
        examples, where = super().load(split, source=source, data_dir=data_dir)
        if limit is not None and (as_integer(limit) is None or limit < 1):
            raise ValueError(f"limit must be an integer, at least 1, got {limit!r}")
        return [{**examples[0], "windows": limit}], where

    def load_after(self, split, skip, *, limit=None, source=None, data_dir=None):
        raise ValueError(
            f"{self.name}: one example, the whole text, of which a limit counts windows from its start: there are no "
            "examples past a calibration's to read (calibrate on valid, evaluate on test)"
        )

    def features(self, examples, tokenizer, *, max_length, mode):
        ex = examples[0]
        windows = token_windows(tokenizer, ex["text"], length=max_length, count=ex.get("windows"), source=ex["source"])
        feats = []
        for i, ids in enumerate(windows):
            extra: dict[str, Any] = {}
            if mode == MLM:
                if tokenizer.mask_token_id is None:
                    raise ValueError("masked-LM evaluation needs a tokenizer with a mask token")
                positions = mask_positions(i, len(ids) - 2)
                extra = {"positions": positions, "targets": [ids[p] for p in positions]}
                ids = list(ids)
                for p in positions:
                    ids[p] = tokenizer.mask_token_id
            feats.append(Feature(i, ids, None, extra))
        return feats

    def train_features(self, examples, tokenizer, *, max_length):
        """The unmasked windows; :meth:`train_batch` masks them anew in every epoch."""
        if tokenizer.mask_token_id is None:
            raise ValueError("masked-LM training needs a tokenizer with a mask token")
        return self.features(examples, tokenizer, max_length=max_length, mode=FIDELITY)

    def train_batch(self, features, tokenizer, *, epoch, seed):
        special = torch.tensor(sorted(set(tokenizer.all_special_ids)))
        vocab = torch.arange(len(tokenizer))
        candidates = vocab[~torch.isin(vocab, special)]
        batch = []
        for f in features:
            ids, labels = training_mask(
                f.input_ids, window=f.example, epoch=epoch, seed=seed, mask_id=tokenizer.mask_token_id,
                candidates=candidates,
            )  # fmt: skip
            batch.append(Feature(f.example, ids, f.token_type_ids, {**f.extra, "labels": {"labels": labels}}))
        return batch

    def train_protocol(self, max_length):
        return (
            f"consecutive [CLS] chunk [SEP] windows of {max_length} tokens from the split's start (all of them, or the "
            f"first `limit`, as the record's limit says), masked anew in every "
            f"epoch (BERT's dynamic masking): {MASK_FRACTION:.0%} of each chunk's positions drawn from (seed, epoch, "
            "window), of which 80 % become [MASK], 10 % a random non-special token and 10 % stay; cross-entropy at "
            "those positions"
        )

    def head_options(self) -> dict[str, Any]:
        return {}

    def outputs(self, model_output, inputs, features, mode):
        if mode != MLM:
            return [None] * len(features)
        logits = model_output.logits
        return [logits[i, f.extra["positions"]].float().cpu() for i, f in enumerate(features)]  # (P, vocab)

    def divergence(self, reference, output, mode):
        return None if mode != MLM else self.kl(reference, output)

    def compact(self, output, feature, mode):
        if mode != MLM:
            return None
        targets = torch.tensor(feature.extra["targets"])
        loss = torch.nn.functional.cross_entropy(output.double(), targets, reduction="sum")
        return {"loss_sum": float(loss), "count": len(targets), "top1": output.argmax(-1).tolist()}

    def predict(self, examples, features, outputs, mode):
        return [out if mode == MLM else None for out in outputs]

    def score(self, examples, predictions, mode):
        if mode != MLM:
            return {}
        loss = sum(p["loss_sum"] for p in predictions) / sum(p["count"] for p in predictions)
        return {"mlm_loss": loss, "perplexity": math.exp(loss), "bits_per_token": loss / math.log(2)}

    def resampling_examples(self, examples, predictions, mode):
        return [examples[0]] * len(predictions)  # the split is one example; score() reads the windows' predictions

    def resampling_unit(self, mode):
        return "window (its masked tokens together)"

    def fidelity(self, divergences, ref_predictions, predictions, mode):
        if mode != MLM:
            return {}
        pairs = [
            (a, b)
            for r, p in zip(ref_predictions, predictions, strict=True)
            for a, b in zip(r["top1"], p["top1"], strict=True)
        ]
        kl = [d for d in divergences if d is not None]
        return {"agreement": sum(a == b for a, b in pairs) / len(pairs), "kl_divergence": sum(kl) / len(kl)}

    def protocol(self, mode, max_length):
        what = (
            f"masked-LM: {MASK_FRACTION:.0%} of each window's positions masked (fixed per window), mean cross-entropy"
            if mode == MLM
            else "hidden-state fidelity only (no task head)"
        )
        return f"consecutive [CLS] chunk [SEP] windows of {max_length} tokens over the whole split; {what}"


@register_task
class WikiText2(WikiText):
    """WikiText-2: masked-LM loss (masked-LM head) or hidden-state fidelity (any encoder) on 512-token windows."""

    name, folder, hub_config = "wikitext2", "wikitext-2", "wikitext-2-v1"
    metrics = ("mlm_loss", "perplexity", "bits_per_token")
    lower_is_better = frozenset(metrics)


@register_task
class WikiText103(WikiText):
    """WikiText-103: as wikitext2, on the larger corpus's test split (when its files are available)."""

    name, folder, hub_config = "wikitext103", "wikitext-103", "wikitext-103-v1"
    metrics = ("mlm_loss", "perplexity", "bits_per_token")
    lower_is_better = frozenset(metrics)
