"""Batching the work of a step: variable-length sequences into micro-batches under a token budget, the same
number per data-parallel rank, balanced by compute. Pure Python over lengths; imports nothing of rlmem.
"""

from .batching import sequence_cost, token_budget_batches

__all__ = ["sequence_cost", "token_budget_batches"]
