"""Make what `rlmem train model=... data=...` needs without any download: a byte-level BPE tokenizer with
a chat template, trained in memory (saved as DIR/tokenizer), and a JSONL of arithmetic questions
(DIR/arith.jsonl). Usage: python scripts/tiny_assets.py DIR [--rows N]."""

import argparse
import json
import random
from pathlib import Path

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def questions(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        out.append({"prompt": f"What is {a}+{b}? Put the answer in \\boxed{{}}.", "answer": str(a + b)})
    return out


def main() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir")
    p.add_argument("--rows", type=int, default=512)
    args = p.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    rows = questions(args.rows, 0)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|pad|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=special, show_progress=False)
    tok.train_from_iterator([f"{r['prompt']} \\boxed{{{r['answer']}}}" for r in rows], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(d / "tokenizer"))
    (d / "arith.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {d / 'tokenizer'} ({len(fast)} tokens) and {d / 'arith.jsonl'} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
