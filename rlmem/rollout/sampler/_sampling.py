"""The next token of each row from a step's logits: greedy at temperature 0, else drawn from the tempered
distribution truncated to its top-p nucleus, with the generation's own generator.

It runs on the device after each decode step (a graph replay or an eager forward) with no host sync: the
tokens stay there until the generation loop (``_generate``) reads a block of them. :func:`eval_mode` is the
mode the model samples in, whatever mode its owner left it in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["eval_mode", "sample"]


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """One token per row: greedy at temperature 0, else from the tempered, top-p truncated distribution.

    Rows go through in slices, so the fp32 probabilities of a large batch over a large vocabulary never
    exist all at once."""
    if temperature == 0:
        return logits.argmax(-1)
    rows = max(1, (1 << 28) // (4 * logits.shape[-1]))  # ~256 MiB of fp32 per slice
    out = []
    for part in logits.split(rows):
        probs = torch.softmax(part.float() / temperature, -1)
        if top_p < 1:
            sorted_p, order = probs.sort(-1, descending=True)
            # Keep a token while the mass before it is below top_p (the most likely one is always kept).
            drop = sorted_p.cumsum(-1) - sorted_p >= top_p
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0))
        out.append(torch.multinomial(probs, 1, generator=gen)[:, 0])
    return torch.cat(out)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode for the block, the modules that were training put back after it. A model
    handed over in training mode (TRL's, between its steps) must not sample with dropout, nor with gradient
    checkpointing, which makes transformers' layers (5.17 and earlier) drop the KV cache."""
    training = [m for m in model.modules() if m.training]
    for m in training:
        m.training = False
    try:
        yield
    finally:
        for m in training:
            m.training = True
