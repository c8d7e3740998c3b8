"""Complete training loops built on rlmem: ``grpo`` is the co-located GRPO loop behind ``rlmem train``.

Its set-up sits beside it, one concern a module: the config (``config.py``, read from YAML by
``yaml_config.py``), where it runs (``runtime.py``), the prompts and rewards behind one protocol
(``prompts.py``: the toy task of ``task.py``, or the user's data of ``data.py`` and ``rewards.py``), the
model, reference, optimizer, PhaseManager and engine (``policy.py``), checkpoints (``checkpoint.py``), and
what a run writes and prints (``runlog.py``, ``loggers.py``, ``report.py``; ``rlmem report`` imports only
``report.py``). A recipe is a flat script over the library: it may import every layer below it and nothing
imports it but the CLI and the benchmarks.
"""
