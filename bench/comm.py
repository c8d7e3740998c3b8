"""NCCL communicator suspend/resume against destroying and re-creating the groups;
writes bench/results/comm-<machine>.json.

Run from the repository root: ``python bench/comm.py --machine nvidia-h200-x2``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlmem.benchmarks.comm import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], default_json_dir=str(Path(__file__).resolve().parent / "results")))
