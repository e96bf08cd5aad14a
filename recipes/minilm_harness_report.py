"""Recipe: the evaluation harness on the real MiniLM-L6 encoder, every method against full attention.

Two runs through ``approx.evaluate`` (the same code as ``approx eval``), each comparing every method with
the unpatched model on the same batches:

* ``stsb`` zero-shot on the full STS-B dev set (1,500 pairs): Spearman / Pearson of the cosine between
  mean-pooled sentence embeddings (MiniLM-L6 is a sentence-embedding model without a task head);
* ``wikitext2`` fidelity on 64 WikiText-2 test windows of 512 tokens (hidden-state cosine per layer,
  attention-output error; no task metric, as the encoder has no masked-LM head).

Methods: clustered-25, i-clustered-25 (k = 32), FAVOR+ (m = 256), entmax (α = 1.5), and the kernel and
low-rank family at their defaults: linear (elu + 1), Efficient Attention, Taylor, Linformer (segment means, 64
projections), Nyström (64 landmarks) and MonarchAttention (blocks of about √N); the sparse patterns at budgets
that approximate on WikiText-2's windows: window (one-sided 32, CLS global), BigBird (blocks of 16, one random
block, without transformers' full-attention fallback), the strided Sparse Transformer (l = 32, every head both
halves) and LSH (2 rounds of 32). Most STS-B sentences fit these budgets, and those of clustering, Linformer and
Nyström, whole: each result's ``fidelity.exact_inputs`` (the notes under the report's table) counts the inputs on
which a method ran exact attention.

    python recipes/minilm_harness_report.py     # about 12 minutes on 2 CPU cores (STS-B 308 s at df15c26,
                                                # WikiText-2 413 s at a8b55e2)
    python recipes/minilm_harness_report.py --only stsb --limit 16 --results-dir /tmp/h   # smoke

Writes recipes/results/minilm_stsb_zero_shot.json and recipes/results/minilm_wikitext2_harness.json (one
result per method, with provenance) and prints the tables with each run's wall time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import approx
from approx.attention.clustered import ClusteredConfig
from approx.attention.entmax import EntmaxConfig
from approx.attention.favor import FavorConfig
from approx.attention.iclustered import IClusteredConfig
from approx.harness.argcheck import at_least, run_script
from approx.harness.data import default_model_path
from approx.harness.evaluation import markdown_report

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shared import MINILM_LABEL, write_json  # noqa: E402

RESULTS = Path(__file__).parent / "results"
METHODS = [  # the clustering methods at the paper's clustering (refine=0), as the committed results were measured
    ClusteredConfig(clusters=25, refine=0),
    IClusteredConfig(clusters=25, topk=32, refine=0),
    FavorConfig(features=256),
    EntmaxConfig(),
    *(
        approx.get_method(name).make_config()
        for name in ("linear", "efficient", "taylor", "linformer", "nystrom", "monarch")
    ),
    # the sparse patterns at budgets that approximate at these lengths (their defaults cover a whole WikiText window)
    approx.get_method("window").make_config(window=32),
    approx.get_method("bigbird").make_config(block=16, random_blocks=1, full_fallback=False),
    approx.get_method("sparse-transformer").make_config(pattern="strided", stride=32, heads="union"),
    approx.get_method("lsh").make_config(cluster_size=32, rounds=2),
]
RUNS = [
    ("stsb", {"batch_size": 64}, "minilm_stsb_zero_shot.json"),
    ("wikitext2", {"limit": 64, "batch_size": 4}, "minilm_wikitext2_harness.json"),
]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None, help="default: $APPROX_DATA_DIR, then ../shared/data")
    parser.add_argument("--only", choices=[t for t, _, _ in RUNS], help="run one task only")
    parser.add_argument(
        "--limit", type=at_least(1), help="first N examples of each task (smoke runs; default: the runs')"
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help="where the JSON go (default recipes/results)")
    args = parser.parse_args(argv)
    for task, options, filename in RUNS:
        if args.only and task != args.only:
            continue
        options = {**options, **({} if args.limit is None else {"limit": args.limit})}
        results = approx.evaluate(default_model_path(), task, METHODS, data_dir=args.data_dir, **options)
        out = args.results_dir / filename
        write_json(out, results)  # (a committed file only by the settings that made it)
        print(markdown_report(results, model_label=MINILM_LABEL))
        print(f"\nwall time {results[0]['provenance']['wall_seconds']:.0f} s; wrote {out}\n")


if __name__ == "__main__":
    run_script(main)
