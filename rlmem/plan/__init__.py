"""The memory planner behind ``rlmem plan``: what a training step and a rollout take on a GPU
(:func:`estimate_memory`) and which options make them fit and how fast each is (:func:`recommend`). Pure
arithmetic over model shapes; imports :mod:`rlmem.activations.modmap` for the module names and the named
presets' shapes from :mod:`rlmem.models.presets`, nothing above them (``rlmem.plan.presets`` is the presets'
old name, kept for one release).
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
