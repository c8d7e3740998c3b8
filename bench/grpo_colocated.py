"""Co-located GRPO with and without rlmem offload: KV budget that fits, rollout tokens/s, switch share;
writes bench/results/grpo_colocated-<machine>.json.

Run from the repository root: ``python bench/grpo_colocated.py --machine nvidia-h100-x1``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlmem.benchmarks.grpo_colocated import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], default_json_dir=str(Path(__file__).resolve().parent / "results")))
