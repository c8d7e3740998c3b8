"""``rlmem serve``: a rollout server in its own process: :class:`~rlmem.HFSampler` behind HTTP (FastAPI and
uvicorn), with generate, sleep and wake by level and tag, weight updates from a trainer's shared weights
(through the device's broker) or from tensors by handle, and its memory in the broker's ledger.

``core.py`` is the served model without HTTP, ``app.py`` the endpoints, ``main.py`` the command. Imports
everything below it (the recipe's model loading among it); nothing imports it but the command line.
"""

from .core import NotReadyError, ServedModel

__all__ = ["NotReadyError", "ServedModel"]
