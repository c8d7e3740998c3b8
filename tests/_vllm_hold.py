"""A logits processor for the real-vLLM tests, loaded in the server's processes (``--logits-processors
_vllm_hold:Hold``, this file's folder on their path). A request whose ``vllm_xargs`` carry
``{"hold": DIR}`` is held in flight: until ``DIR/go`` exists, each decoding step of a batch that holds it
takes at least :data:`PACE_S` (200 tokens: 20 s), and ``DIR/running`` says how many requests held by DIR
the running batch has. Between steps the engine still takes its requests (a sleep, say). The logits are
left as they are, and requests without the argument are not touched.
"""

from __future__ import annotations

import os
import time

from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

PACE_S = 0.1


class Hold(LogitsProcessor):
    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        self.held: dict[int, str] = {}  # batch index -> DIR

    def is_argmax_invariant(self) -> bool:
        return False  # applied to greedy batches too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for i in batch_update.removed:
            self.held.pop(i, None)
        for i, params, _, _ in batch_update.added:
            d = (params.extra_args or {}).get("hold")
            if d:
                self.held[i] = str(d)
            else:
                self.held.pop(i, None)
        for a, b, how in batch_update.moved:
            da, db = self.held.pop(a, None), self.held.pop(b, None)
            if da is not None:
                self.held[b] = da
            if how == MoveDirectionality.SWAP and db is not None:
                self.held[a] = db

    def apply(self, logits):
        if not self.held:
            return logits
        dirs = set(self.held.values())
        for d in dirs:
            tmp = os.path.join(d, f".running.{os.getpid()}")
            with open(tmp, "w") as f:
                f.write(str(sum(v == d for v in self.held.values())))
            os.replace(tmp, os.path.join(d, "running"))
        if not all(os.path.exists(os.path.join(d, "go")) for d in dirs):
            time.sleep(PACE_S)
        return logits
