"""Activation offloading and checkpointing: step time and peak memory against none, save_on_cpu and
checkpointing; writes bench/results/activations-<machine>.json.

Run from the repository root: ``python bench/activations.py --machine nvidia-h100-x1``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlmem.benchmarks.activations import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], default_json_dir=str(Path(__file__).resolve().parent / "results")))
