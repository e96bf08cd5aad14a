"""approx: swap the self-attention of pretrained Hugging Face encoders for efficient approximations.

import approx
approx.methods()                                   # ['full', 'bigbird', 'clustered', 'efficient', ...]
approx.patch(model, "i-clustered", clusters=25, topk=32)
approx.unpatch(model)                              # bit-identical to the original again
approx.evaluate("ckpt/", "sst2", ["clustered:clusters=25", "i-clustered"])  # metrics, fidelity, cost, time
approx.finetune("bert-base-uncased", "rte", output_dir="ckpt/rte", method="favor", epochs=3)
approx.fit(model, windows)                         # learn the state of fitted methods (sparsefinder)
approx.extend_positions(model, 4096, tokenizer=tok)  # read 4096 tokens (trained positions copied)
approx.autotune(model, inputs, target="cosine>=0.99")  # each layer's method and budget, tuned to a target
"""

from ._version import __version__ as __version__  # noqa: E402
from .attention._context import tokens  # noqa: E402
from .attention._fallback import FallbackWarning  # noqa: E402
from .config import MethodConfig  # noqa: E402
from .harness.autotune import Tuning, autotune  # noqa: E402
from .harness.evaluation import evaluate, markdown_report  # noqa: E402
from .harness.finetune import FinetuneConfig, finetune  # noqa: E402
from .harness.fitting import fit, graph_stats  # noqa: E402
from .harness.spec import Setup  # noqa: E402
from .integration import (  # noqa: E402
    RedrawSchedule,
    UnsupportedModelError,
    is_patched,
    load,
    load_method_state,
    local_layers,
    local_mode,
    patch,
    patched_layers,
    redraw,
    restore,
    save,
    settings,
    unpatch,
)
from .layer import ApproxAttention  # noqa: E402
from .positions import extend_positions  # noqa: E402
from .registry import Cost, get_method  # noqa: E402
from .registry import methods as _registered_methods  # noqa: E402

__all__ = [
    "ApproxAttention",
    "autotune",
    "Cost",
    "FallbackWarning",
    "FinetuneConfig",
    "MethodConfig",
    "UnsupportedModelError",
    "evaluate",
    "extend_positions",
    "finetune",
    "fit",
    "get_method",
    "graph_stats",
    "is_patched",
    "load",
    "load_method_state",
    "local_layers",
    "local_mode",
    "markdown_report",
    "methods",
    "patch",
    "patched_layers",
    "redraw",
    "RedrawSchedule",
    "restore",
    "save",
    "settings",
    "Setup",
    "tokens",
    "Tuning",
    "unpatch",
]


def methods() -> list[str]:
    """Names of the available attention methods, the exact reference ``"full"`` first."""
    names = _registered_methods()
    return sorted(names, key=lambda n: (n != "full", n))
