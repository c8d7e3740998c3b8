"""Complete training loops built on rlmem: ``grpo`` is the co-located GRPO loop behind ``rlmem train``
(config in ``GRPOConfig``, the toy task in ``task``, what it records and prints in ``_report``). A recipe is
a flat script over the library: it may import every layer below it and nothing imports it but the CLI and
the benchmarks.
"""
