"""Questions about a technical manual, asked as a user asks them (issue 47's held-out form, rebuilt from its
description): does the default selection find a needle outside RULER's haystacks?

    OMP_NUM_THREADS=1 python benchmarks/experiments/manual_needles.py --trials 10 --out manual.json

The manual is the plain-text documentation of eight Python standard-library modules (pydoc, this interpreter's), a
~3.4K-token window of it per trial with one sentence "The special magic number for KEY is: NNNNNNN." at a random
depth, asked in SmolLM2-135M-Instruct's chat template as "What is the special magic number for KEY?" with nothing
after it; K = L/8 (every method's default), greedy, 40 new tokens. A method finds the needle when its answer holds
the number. Every method decodes from one shared prefill (`generate_many`).

Answer (10 trials, commit 2b06210, AMD EPYC, one thread; docs/results/selection-dev/manual-needles.json): the needle
was found by full, snapkv, recycled and refreshkv with the old default and the new one in 9 trials, the oracle 8,
quest 5. This manual does not reproduce the held-out failure of the papers' selection (issue 47: 0 of 2 there); the
dev set's RULER haystacks (docs/results.md) do.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pydoc
import random

import torch

from refreshkv import generate_many, load_model, make_policy
from refreshkv.eval.tasks.base import encode_user_turn

MODULES = ["argparse", "logging", "subprocess", "json", "csv", "sqlite3", "shutil", "pathlib"]
METHODS = {
    "full": "full",
    "oracle": "oracle",
    "snapkv": "snapkv",
    "quest": "quest",
    "refreshkv (old default)": make_policy("refreshkv", window=1, carry=0.0),
    "refreshkv": "refreshkv",
    "recycled": "recycled",
}


def manual_lines() -> list[str]:
    text = "\n".join(pydoc.plaintext.document(importlib.import_module(m)) for m in MODULES)
    return text.replace("\b", "").split("\n")


def trial_prompt(tokenizer, lines: list[str], rng: random.Random, tokens: int) -> tuple[str, str]:
    """A window of the manual of about `tokens` tokens with the needle at a random depth, and the needle's value."""
    start = rng.randrange(0, len(lines) - 2000)
    taken = 40
    while len(tokenizer.encode("\n".join(lines[start : start + taken + 40]))) <= tokens:
        taken += 40
    window = lines[start : start + taken]
    key = rng.choice(["quiet-harbor", "amber-lantern", "silver-orchard", "hollow-meadow"])
    value = str(rng.randint(10**6, 10**7 - 1))
    window.insert(
        rng.randrange(len(window) // 10, 9 * len(window) // 10), f"The special magic number for {key} is: {value}."
    )
    return "\n".join(window) + f"\n\nWhat is the special magic number for {key}?", value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=3400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model, tokenizer = load_model(None)
    lines, rng = manual_lines(), random.Random(args.seed)
    rows = []
    for trial in range(args.trials):
        prompt, value = trial_prompt(tokenizer, lines, rng, args.tokens)
        ids = torch.tensor([encode_user_turn(tokenizer, prompt, "", True)])
        outs = generate_many(model, ids, methods=list(METHODS.values()), max_new_tokens=40)
        for name, out in zip(METHODS, outs):
            answer = tokenizer.decode(out.tokens[0], skip_special_tokens=True)
            rows.append({"trial": trial, "method": name, "found": value in answer, "answer": answer, "value": value})
            print(trial, "found" if value in answer else "-----", name, repr(answer[:90]))
    with open(args.out, "w") as file:
        json.dump({"modules": MODULES, "tokens": args.tokens, "seed": args.seed, "rows": rows}, file, indent=1)
    for name in METHODS:
        print(f"{name}: {sum(r['found'] for r in rows if r['method'] == name)} of {args.trials}")


if __name__ == "__main__":
    main()
