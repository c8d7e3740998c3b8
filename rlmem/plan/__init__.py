"""The memory planner behind ``rlmem plan``: what a training step and a rollout take on a GPU
(:func:`estimate_memory`), which options make them fit and how fast each is (:func:`recommend`), and the
named model presets the benchmarks and the tiny default job build. Pure arithmetic over model shapes, except
the presets (which build torch/transformers models); imports :mod:`rlmem.activations.modmap` for the module
names and nothing above it.
"""

from .estimate import MemoryEstimate, estimate_memory
from .recommend import Recommendation, format_recommendations, recommend
from .shapes import Hardware, ModelShape, PlanOptions, Workload

__all__ = [
    "Hardware",
    "MemoryEstimate",
    "ModelShape",
    "PlanOptions",
    "Recommendation",
    "Workload",
    "estimate_memory",
    "format_recommendations",
    "recommend",
]
