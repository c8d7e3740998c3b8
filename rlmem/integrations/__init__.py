"""Glue to other frameworks, one module each, importing its framework lazily: ``megatron`` (what a
Megatron-Core trainer holds, and how ``PhaseManager`` treats it), ``trl`` (a callback for TRL's
``GRPOTrainer``), ``vllm_transfer`` (rlmem as a vLLM weight-transfer backend, loaded in vLLM's processes),
and ``hf`` (the name :class:`~rlmem.rollout.HFSampler` was first published under). May import
:mod:`rlmem.memory`, :mod:`rlmem.plan`, :mod:`rlmem.train`, :mod:`rlmem.colocate`, :mod:`rlmem.rollout` and
the layers below them; the recipes and benchmarks import it.
"""
