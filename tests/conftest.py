"""Shared fixtures: tiny models of every supported family built from configs (no downloads), the data
folder and the offline MiniLM-L6 for the real-model tests."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from approx.integration import SUPPORTED_MODEL_TYPES  # noqa: E402 (after the environment above)

# The tests run many tiny ops: one thread avoids thread-pool waits (tens of ms per op on a busy machine).
torch.set_num_threads(1)

# every supported family, each with a tiny model from tiny_config (tests/test_patch.py checks that it patches and
# unpatches bit-exactly): a family added to SUPPORTED_MODEL_TYPES is tested without editing this list
FAMILIES = list(SUPPORTED_MODEL_TYPES)
HEADS = ["base", "sequence-classification", "question-answering", "masked-lm"]
# families whose positions are one learned absolute table (approx.extend_positions works on them); the others rotate
# q and k (RoPE) and have no table to extend (tests/test_positions.py checks both sides of this split)
ROTARY = ["esm", "eurobert", "jina_embeddings_v3", "modernbert", "nomic_bert"]
ABSOLUTE_POSITIONS = [f for f in FAMILIES if f not in ROTARY]

# what a family's tiny config needs beside the common sizes: token ids inside the tiny vocabulary, a bottleneck as
# small as the model, a default language, ESM-2's rotary positions
_TINY_EXTRA = {
    "albert": dict(embedding_size=16),
    "esm": dict(pad_token_id=1, mask_token_id=2, position_embedding_type="rotary"),
    # (with grouped-query attention, which EuroBERT's config offers: two query heads per key/value head)
    "eurobert": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, mask_token_id=3, num_key_value_heads=2),
    # (its layers have no normalisation: at the default initialiser range the tiny model's attention is near uniform)
    "mobilebert": dict(embedding_size=16, intra_bottleneck_size=16, initializer_range=0.1),
    # layer 0 full attention, layer 1 a sliding window of 4 tokens on each side (shorter than the tests' inputs); its
    # special tokens those of the evaluation fixtures' vocabulary (tests/evalfixtures.py), as a checkpoint's match its
    # tokenizer (ModernBERT's config names its CLS and SEP, which the question-global window reads)
    "modernbert": dict(
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        cls_token_id=2,
        sep_token_id=3,
        mask_token_id=4,
        global_attn_every_n_layers=2,
        local_attention=8,
    ),
    "xmod": dict(default_language="en_XX"),
}


def heads_of(family: str) -> list[str]:
    """The task heads of ``HEADS`` that transformers has for ``family`` ("base" always)."""
    from transformers.models.auto import modeling_auto as auto

    names = {
        "sequence-classification": auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
        "question-answering": auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
        "masked-lm": auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    }
    return [h for h in HEADS if h == "base" or family in names[h]]


FAMILY_HEADS = [(f, h) for f in FAMILIES for h in heads_of(f)]


def pytest_addoption(parser):
    parser.addoption("--data-dir", default=None, help="evaluation data folder (default: $APPROX_DATA_DIR)")


# the skip reasons of tests that need a C++ compiler (the fused kernels, torch.compile): without one, a run would pass
# with those tests unrun, which only `-ra` shows; the summary says so in any run
COMPILER_SKIPS = ("cannot be built here", "cannot compile here")


def pytest_terminal_summary(terminalreporter):
    reasons = [
        str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        for report in terminalreporter.stats.get("skipped", [])
    ]
    unbuilt = [r for r in reasons if any(words in r for words in COMPILER_SKIPS)]
    if unbuilt:
        terminalreporter.write_sep("=", "tests that need a C++ compiler", yellow=True)
        count = f"{len(unbuilt)} test{'' if len(unbuilt) == 1 else 's'}"
        terminalreporter.write_line(
            f"{count} of approx's C++ kernels or torch.compile skipped: no working compiler here. The first reason: "
            f"{unbuilt[0].removeprefix('Skipped: ')}"
        )


def tiny_config(family: str, **overrides):
    from transformers import AutoConfig

    if family == "distilbert":
        kw = dict(vocab_size=99, dim=32, n_layers=2, n_heads=4, hidden_dim=37, max_position_embeddings=512)
    else:
        kw = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
        kw.update(_TINY_EXTRA.get(family, {}))
    kw.update(overrides)
    return AutoConfig.for_model(family, **kw)


# the query and key projections of every family (BERT's query/key and its relatives', DistilBERT's q_lin/k_lin, the
# q_proj/k_proj of EuroBERT, NomicBERT and Jina v3)
_QK_WEIGHTS = ("query.weight", "key.weight", "q_lin.weight", "k_lin.weight", "q_proj.weight", "k_proj.weight")


def tiny_model(family: str, head: str = "base", seed: int = 0, **overrides):
    import transformers

    cls = {
        "base": transformers.AutoModel,
        "sequence-classification": transformers.AutoModelForSequenceClassification,
        "question-answering": transformers.AutoModelForQuestionAnswering,
        "masked-lm": transformers.AutoModelForMaskedLM,
    }[head]
    torch.manual_seed(seed)
    model = cls.from_config(tiny_config(family, **overrides)).eval()
    # Sharpen the attention of the random model (default init makes it almost uniform, where every
    # approximation looks exact): scale up query and key projections.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(_QK_WEIGHTS):
                p.mul_(25.0)
            elif name.endswith("Wqkv.weight"):  # ModernBERT's fused projection: q and k are its first two thirds
                p[: 2 * p.shape[0] // 3].mul_(25.0)
    return model


def model_output(model, **inputs) -> torch.Tensor:
    out = model(**inputs)
    for name in ("last_hidden_state", "logits", "start_logits"):
        if getattr(out, name, None) is not None:
            return getattr(out, name)
    raise AssertionError(f"no output tensor in {type(out).__name__}")


def batch(seq_len: int = 48, pad: int = 0, batch_size: int = 2, seed: int = 1):
    """input_ids/attention_mask with the second row padded by ``pad`` tokens at the end."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 99, (batch_size, seq_len), generator=g)
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    if pad:
        mask[1, seq_len - pad :] = 0
        ids[1, seq_len - pad :] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(scope="session")
def data_dir(pytestconfig) -> Path:
    from approx.harness.data import DataNotFoundError, find_data_dir

    try:
        return find_data_dir(pytestconfig.getoption("--data-dir"), need="wikitext-2/wiki.test.tokens")
    except DataNotFoundError as e:
        pytest.skip(f"real-data test skipped: {e}")


@pytest.fixture(scope="session")
def minilm_path() -> str:
    try:
        from approx.harness.data import default_model_path

        return default_model_path()
    except ModuleNotFoundError as e:
        pytest.skip(f"real-model test skipped: {e}")


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    """Small synthetic GLUE / SQuAD / WikiText files (16 rows each) for fine-tuning and recipe tests;
    tests/test_evaluation.py overrides it with its own, larger files."""
    from evalfixtures import write_data

    return write_data(tmp_path_factory.mktemp("data"), n=16)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    """A tiny bare BERT checkpoint folder (with tokenizer) to fine-tune."""
    from evalfixtures import write_checkpoint

    return str(write_checkpoint(tmp_path_factory.mktemp("base"), "base"))


@pytest.fixture
def benchmark_script():
    """Import a script of benchmarks/ by name (they are scripts, not a package): ``benchmark_script("short_inputs")``."""

    def load(name: str):
        path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses and pickling look the module up by name
        spec.loader.exec_module(module)
        return module

    return load
