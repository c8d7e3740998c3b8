"""Small models for tests: tied weights, a frozen layer, a non-contiguous and a bf16 parameter (state tests);
a tiny Qwen2 and prompts for it, small grouped-query models of four families and greedy `generate()` (sampler
tests)."""

from __future__ import annotations

import torch
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 61, dim: int = 24, mixed: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.mix = nn.Parameter(torch.randn(dim, dim).t())  # non-contiguous
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.scale = nn.Parameter(torch.ones(dim, dtype=torch.bfloat16 if mixed else torch.float32))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("offset", torch.linspace(0, 1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.offset
        h = torch.tanh(self.frozen(h)) @ self.mix
        h = h + self.down(torch.relu(self.up(h)))
        h = h * self.scale.float()
        return self.head(h)


def make(seed: int = 0, device: str = "cpu", mixed: bool = True) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(mixed=mixed).to(device)


OPTIMIZERS = {
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw-forloop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
}


PROMPTS = [[1, 5, 6, 7, 3], [1, 8, 3], [1, 4, 9, 4, 12, 4, 3], [1, 9, 3], [1, 10, 11, 3]]


def tiny_qwen2(device: str) -> nn.Module:
    """A 2-layer Qwen2 with tied embeddings over a 14-token vocabulary, in eval mode."""
    import transformers

    cfg = transformers.Qwen2Config(
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=14,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        initializer_range=0.5,  # wide random weights: completions differ from prompt to prompt
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).to(device).eval()


def grouped_model(family: str, device: str, heads: int = 8, kv: int = 2) -> torch.nn.Module:
    """A small causal LM of ``family`` (llama, mistral, qwen2, qwen3) with ``heads`` query heads over ``kv``
    KV heads, its weights scaled up so that its logits are far from ties."""
    import transformers

    cls = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }[family]
    config = getattr(transformers, cls[0])(
        vocab_size=97,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=16,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, cls[1])(config)
    # Larger weights than the init's: logits far from ties, so the greedy tokens are the model's own.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    return model.eval()


def reference(model: nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of ``generate()`` for one prompt (EOS 2, pad 0), up to and including EOS."""
    out = model.generate(
        torch.tensor([prompt], device=model.device),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=2,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    return out[: out.index(2) + 1] if 2 in out else out


def near_greedy(model: nn.Module, prompt: list[int], got: list[int], rel: float = 1e-2) -> list[int]:
    """The steps where ``got`` is not a greedy choice of ``model`` fed its own tokens: a token whose logit
    sits more than ``rel`` of the step's largest magnitude below the best. A rounding that differs in the
    last bit (a fused GEMM) may flip a near-tie, never pick a far token."""
    ids = torch.tensor([prompt + got], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    best = logits.max(-1).values
    chosen = logits.gather(-1, torch.tensor(got, device=logits.device)[:, None])[:, 0]
    far = best - chosen > rel * logits.abs().max(-1).values
    return far.nonzero()[:, 0].tolist()
