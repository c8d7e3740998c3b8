"""The benchmarks behind ``rlmem bench NAME``: one module per benchmark on one harness (``_harness.Run``:
common arguments, device, machine name, summary, targets, JSON in ``bench/results/``), with the helpers they
share in ``_common``. The top layer: may import every part of rlmem; nothing imports it but the CLI.
"""
