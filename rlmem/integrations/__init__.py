"""Glue to other frameworks, one module each, importing its framework lazily: ``hf`` (a batched sampler for
Hugging Face causal LMs whose KV cache is a Region), ``megatron`` (what a Megatron-Core trainer holds, and
how ``PhaseManager`` treats it), ``trl`` (a callback for TRL's ``GRPOTrainer``), ``vllm_transfer`` (rlmem
as a vLLM weight-transfer backend, loaded in vLLM's processes). May import :mod:`rlmem.memory`,
:mod:`rlmem.plan`, :mod:`rlmem.train`, :mod:`rlmem.colocate` and the layers below them; the recipes and
benchmarks import it.
"""
