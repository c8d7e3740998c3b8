"""Predicted (rlmem plan) against measured peak memory of the 2.47B model in 11 configurations;
writes bench/results/plan_accuracy-<machine>.json.

Run from the repository root: ``python bench/plan_accuracy.py --machine nvidia-h100-x1``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlmem.benchmarks.plan_accuracy import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], default_json_dir=str(Path(__file__).resolve().parent / "results")))
