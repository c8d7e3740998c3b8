"""Rollout/train switch of the full training state vs naive .to(), the pinned bound and torch_memory_saver;
writes bench/results/phase_switch-<machine>.json.

Run from the repository root: ``python bench/phase_switch.py --machine nvidia-h100-x1``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlmem.benchmarks.phase_switch import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], default_json_dir=str(Path(__file__).resolve().parent / "results")))
