"""Recipe: zero-shot fidelity of FAVOR+ (Performer) attention on a real pretrained encoder.

MiniLM-L6 on WikiText-2 test windows of 512 tokens, every layer switched to FAVOR+ without retraining:
the number of random features m in {64, 128, 256, 512, 1024} with the default positive softmax features
(orthogonal, hyperbolic +-w), the same m without the hyperbolic pairing (the evidence for the default),
i.i.d. instead of orthogonal directions, and the generalised ReLU kernel. The Performer paper expects a
pretrained softmax model to need a short fine-tuning after the swap; these are the zero-shot numbers.

    python recipes/minilm_wikitext2_favor.py         # 32 windows, a few minutes on 2 CPU cores

Writes recipes/results/minilm_wikitext2_favor.json (with provenance) and prints a markdown table.
"""

from pathlib import Path

from approx.attention.favor import FavorConfig
from approx.harness.fidelity import recipe_main

FEATURES = (64, 128, 256, 512, 1024)
CONFIGS = [
    *(FavorConfig(features=m) for m in FEATURES),
    *(FavorConfig(features=m, hyperbolic=False) for m in FEATURES),
    FavorConfig(features=256, orthogonal=False),
    FavorConfig(features=256, kernel="relu", hyperbolic=False),
]

if __name__ == "__main__":
    recipe_main(CONFIGS, str(Path(__file__).parent / "results" / "minilm_wikitext2_favor.json"), __doc__)
