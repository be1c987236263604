"""Questions about a technical manual, asked as a user asks them (issue 47's held-out form, rebuilt from its
description): does the default selection find a needle outside RULER's haystacks?

    OMP_NUM_THREADS=1 python benchmarks/experiments/manual_needles.py --trials 10 --out manual.json
    OMP_NUM_THREADS=1 python benchmarks/experiments/manual_needles.py --trials 10 --values 4 --max-new-tokens 96 \
        --out manual-multivalue.json

The manual is the plain-text documentation of eight Python standard-library modules (pydoc, this interpreter's), a
~3.4K-token window of it per trial with `--values` sentences "The special magic number for KEY is: NNNNNNN." (one
key) at random depths, asked in SmolLM2-135M-Instruct's chat template as "What is the special magic number for
KEY?" (with several values: "What are all the special magic numbers for KEY?") with nothing after it; K = L/8 (every
method's default), greedy. A trial scores the share of the values the answer holds. Every method decodes from one
shared prefill (`generate_many`).

Answers (10 trials each; docs/results/selection-dev/manual-needles.json and manual-needles-multivalue.json, an Intel
Xeon, one thread, commit 95a0515 (refreshkv with `keep_decoded`)): one needle was found by full, snapkv, recycled and
refreshkv (the papers' selection, the default before `keep_decoded` and the default) in 9 trials, the oracle 8, quest
5: this manual does not reproduce the held-out failure of the papers' selection (issue 47: 0 of 2 there). Four
values: snapkv and the default 3.75 of 10, the default before 3, the oracle 2.75, recycled 2.5, the papers'
selection 2, `full` 1.75, quest 0.5 (the labels that ran before, on an AMD EPYC, gave the same answers): as in the
held-out cases (`full` 0.25, snapkv 0.40-0.50), keeping K tokens finds more values than attending to all of them.
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
    "refreshkv (papers' selection)": make_policy(
        "refreshkv", window=1, carry=0.0, question_floor=0.0, keep_decoded=False
    ),
    "refreshkv (before: floor 1, C_p of K + 1)": make_policy("refreshkv", question_floor=1.0, keep_decoded=False),
    "refreshkv": "refreshkv",
    "recycled": "recycled",
}


def manual_lines() -> list[str]:
    text = "\n".join(pydoc.plaintext.document(importlib.import_module(m)) for m in MODULES)
    return text.replace("\b", "").split("\n")


def trial_prompt(tokenizer, lines: list[str], rng: random.Random, tokens: int, values: int) -> tuple[str, list[str]]:
    """A window of the manual of about `tokens` tokens holding `values` needles of one key at random depths, and
    their values."""
    start = rng.randrange(0, len(lines) - 2000)
    taken = 40
    while len(tokenizer.encode("\n".join(lines[start : start + taken + 40]))) <= tokens:
        taken += 40
    window = lines[start : start + taken]
    key = rng.choice(["quiet-harbor", "amber-lantern", "silver-orchard", "hollow-meadow"])
    numbers = [str(rng.randint(10**6, 10**7 - 1)) for _ in range(values)]
    for number in numbers:
        window.insert(
            rng.randrange(len(window) // 10, 9 * len(window) // 10), f"The special magic number for {key} is: {number}."
        )
    question = "What is the special magic number" if values == 1 else "What are all the special magic numbers"
    return "\n".join(window) + f"\n\n{question} for {key}?", numbers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=3400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--values", type=int, default=1, help="needles of one key; the score is the share found")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model, tokenizer = load_model(None)
    lines, rng = manual_lines(), random.Random(args.seed)
    rows = []
    for trial in range(args.trials):
        prompt, numbers = trial_prompt(tokenizer, lines, rng, args.tokens, args.values)
        ids = torch.tensor([encode_user_turn(tokenizer, prompt, "", True)])
        outs = generate_many(model, ids, methods=list(METHODS.values()), max_new_tokens=args.max_new_tokens)
        for name, out in zip(METHODS, outs):
            answer = tokenizer.decode(out.tokens[0], skip_special_tokens=True)
            found = sum(number in answer for number in numbers) / len(numbers)
            rows.append({"trial": trial, "method": name, "found": found, "answer": answer, "values": numbers})
            print(trial, f"{found:.2f}", name, repr(answer[:90]))
    settings = {"modules": MODULES, "tokens": args.tokens, "seed": args.seed, "values": args.values}
    with open(args.out, "w") as file:
        json.dump({**settings, "max_new_tokens": args.max_new_tokens, "rows": rows}, file, indent=1)
    for name in METHODS:
        print(f"{name}: {sum(r['found'] for r in rows if r['method'] == name):g} of {args.trials}")


if __name__ == "__main__":
    main()
