"""Region pause/resume vs the link's ceiling; writes bench/results/region-<machine>.json.

Run from the repository root: ``python bench/region.py [--machine nvidia-h100-x1] [--sizes 1,4,16]``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlmem.benchmarks.region import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], default_json_dir=str(Path(__file__).resolve().parent / "results")))
