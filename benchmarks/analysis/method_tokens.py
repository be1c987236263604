"""Every registered method's greedy tokens on the embedded model, as JSON: run before and after a refactor to show
that it changes no method's output (`diff` the two files).

    python benchmarks/analysis/method_tokens.py --length 1500 --budget 128 --new-tokens 24 > tokens.json

Uses only the public API (`refreshkv.load_model`, `generate_many`, `METHODS`, `make_policy`), so the same script runs
at older commits (PYTHONPATH=<old checkout>/src). One shared prefill; every method with a budget gets `--budget`; a
left-padded batch of two prompts (the second shorter) exercises padding too.
"""

import argparse
import json

import torch

import refreshkv
from refreshkv import METHODS, generate_many, make_policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1500)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = refreshkv.load_model()
    try:
        from refreshkv.texts import book_text
    except ImportError:  # before the texts package existed
        from refreshkv.demo import book_text
    book = tokenizer.encode(book_text(), add_special_tokens=False)
    short = args.length * 3 // 4
    ids = torch.full((2, args.length), tokenizer.pad_token_id or 0)
    mask = torch.zeros_like(ids)
    ids[0], mask[0] = torch.tensor(book[: args.length]), 1
    ids[1, -short:], mask[1, -short:] = torch.tensor(book[1000 : 1000 + short]), 1
    names = sorted(METHODS)
    policies = [
        make_policy(n, **({"budget": args.budget} if "budget" in METHODS[n].parameters() else {})) for n in names
    ]
    outs = generate_many(model, ids, mask, methods=policies, max_new_tokens=args.new_tokens, eos_token_id=[])
    print(json.dumps({name: out.tokens for name, out in zip(names, outs)}, indent=1))


if __name__ == "__main__":
    main()
