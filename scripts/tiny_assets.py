"""Make what `rlmem train model=... data=...` needs without any download: a byte-level BPE tokenizer with
a chat template, trained in memory (saved as DIR/tokenizer), and a JSONL of arithmetic questions
(DIR/arith.jsonl); with --family, a tiny random model of that family too (DIR/FAMILY, its tokenizer beside
it). Usage: python scripts/tiny_assets.py DIR [--rows N] [--family llama,qwen3,...]."""

import argparse

from rlmem.benchmarks.assets import FAMILIES, model_dir, tokenizer_and_data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir")
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--family", default="", help=f"comma-separated, of {', '.join(FAMILIES)}")
    args = p.parse_args()
    tok, data = tokenizer_and_data(args.dir, args.rows)
    print(f"wrote {tok} and {data} ({args.rows} rows)")
    for family in filter(None, args.family.split(",")):
        print(f"wrote {model_dir(family, f'{args.dir}/{family}', tok)}")


if __name__ == "__main__":
    main()
