"""Token-budget micro-batches against fixed-size ones on a long-tailed length distribution;
writes bench/results/token_budget-<machine>.json.

Run from the repository root: ``python bench/token_budget.py --machine nvidia-h100-x1``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlmem.benchmarks.token_budget import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], default_json_dir=str(Path(__file__).resolve().parent / "results")))
