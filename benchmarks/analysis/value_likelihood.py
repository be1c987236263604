"""Issue 47: does a method's cache hold the values a multivalue answer lists? Teacher-forced, so free of the
butterfly effect of greedy generation (one different token early and the rest of the answer differs).

For each RULER niah_multivalue example without answer prefix (SmolLM2, chat, K = L/8), the reference answer is
forced after the prompt, "The special magic numbers for KEY mentioned in the provided text are:" and one numbered line
per value, and each method's loss (nats) of every value's tokens is recorded, beside the share of full layer-steps.
The methods of one example share its prefill. Rows go to a JSON-lines file, one per example and method; a rerun runs
only the pairs it lacks (resumes):

    python benchmarks/analysis/value_likelihood.py --seed 3 --examples 20 --out value-likelihood.jsonl
    python benchmarks/analysis/value_likelihood.py --seed 3 --methods snapkv refreshkv --out value-likelihood.jsonl
    python benchmarks/analysis/value_likelihood.py --report value-likelihood.jsonl   # paired table on stdout

docs/failure-analysis.md (section C) quotes its table over seeds 3 and 4 (docs/results/selection-dev/
smollm2-value-likelihood-seed3.jsonl, -seed4.jsonl).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from refreshkv import make_policy
from refreshkv.eval import stats
from refreshkv.eval.config import RunConfig
from refreshkv.eval.examples import prepare
from refreshkv.eval.perplexity import teacher_forced_many
from refreshkv.runtime.loading import load_model

# label: (method, parameters): refreshkv's default and refreshkv never refreshing after the prompt (threshold -1), each
# as it is (a decoded token evicts the lowest-scored selected one, C_p holds K) and with keep_decoded (decoded tokens
# kept beside the K, as snapkv keeps them)
METHODS = {
    "full": ("full", {}),
    "oracle": ("oracle", {"budget_ratio": 0.125}),
    "snapkv": ("snapkv", {"budget_ratio": 0.125}),
    "refreshkv": ("refreshkv", {"budget_ratio": 0.125}),
    "refreshkv threshold -1": ("refreshkv", {"budget_ratio": 0.125, "threshold": -1.0}),
    "refreshkv keep_decoded": ("refreshkv", {"budget_ratio": 0.125, "keep_decoded": True}),
    "refreshkv threshold -1 keep_decoded": (
        "refreshkv",
        {"budget_ratio": 0.125, "threshold": -1.0, "keep_decoded": True},
    ),
    **{
        f"refreshkv keep_decoded question_floor {floor}": (
            "refreshkv",
            {"budget_ratio": 0.125, "keep_decoded": True, "question_floor": float(floor)},
        )
        for floor in (2, 4, 16)
    },
}
KEY = re.compile(r"special magic numbers for (\S+) mentioned in the provided text\?")


def reference_answer(prompt: str, values: list[str]) -> tuple[str, list[tuple[int, int]]]:
    """The answer a model is asked for, and the character span of each value in it."""
    key = KEY.findall(prompt)[-1]
    text = f"The special magic numbers for {key} mentioned in the provided text are:\n\n"
    spans = []
    for number, value in enumerate(values, 1):
        text += f"{number}. "
        spans.append((len(text), len(text) + len(value)))
        text += value + "\n"
    return text, spans


def run(seed: int, examples: int, labels: list[str], out: Path) -> None:
    model, tokenizer = load_model()[:2]
    held = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    done = {(row["id"], row["label"]) for row in held}
    config = RunConfig(
        task="ruler/niah_multivalue",
        method="full",
        length=4096,
        seed=seed,
        task_options={"question": "bare"},
        chat=True,
    )
    for item in prepare(model, tokenizer, config, examples):
        todo = [label for label in labels if (item.example["id"], label) not in done]
        if not todo:
            continue
        answer, spans = reference_answer(item.example["prompt"], item.example["reference"])
        encoded = tokenizer(answer, add_special_tokens=False, return_offsets_mapping=True)
        value_tokens = [
            [i for i, (start, end) in enumerate(encoded["offset_mapping"]) if start >= low and end <= high]
            for low, high in spans
        ]
        ids = list(item.input_ids) + encoded["input_ids"]
        policies = [make_policy(METHODS[label][0], **METHODS[label][1]) for label in todo]
        with torch.inference_mode():
            results = teacher_forced_many(model, ids, len(item.input_ids), policies)
        rows = []
        for label, result in zip(todo, results):
            losses = [[result.losses[i] for i in tokens] for tokens in value_tokens]
            method, params = METHODS[label]
            row = {"id": item.example["id"], "label": label, "method": method, "params": params}
            row |= {"value_nll": [sum(v) for v in losses], "first_digit_nll": [v[0] for v in losses]}
            row |= {"answer_nll": sum(result.losses), "full_step_fraction": result.cache.full_step_fraction()}
            rows.append(row)
        with out.open("a") as file:  # one example's rows at once: a killed run leaves whole examples
            file.write("".join(json.dumps(row) + "\n" for row in rows))
        print(item.example["id"], {row["label"]: round(sum(row["value_nll"]), 2) for row in rows}, flush=True)


def report(paths: list[Path], base_label: str) -> None:
    rows: dict[str, dict[str, dict]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows.setdefault(row["label"], {})[row["id"]] = row
    base = rows[base_label]
    print(f"| method | n | value loss (nats per value) | first digit | minus {base_label}'s [95%] | full layer-steps |")
    print("|---|---|---|---|---|---|")
    for label, by_id in rows.items():
        ids = sorted(set(by_id) & set(base))
        per_value = [sum(by_id[i]["value_nll"]) / len(by_id[i]["value_nll"]) for i in ids]
        first = [sum(by_id[i]["first_digit_nll"]) / len(by_id[i]["first_digit_nll"]) for i in ids]
        theirs = [sum(base[i]["value_nll"]) / len(base[i]["value_nll"]) for i in ids]
        difference = stats.macro_mean([[a - b for a, b in zip(per_value, theirs)]])
        low, high = difference.interval or (float("nan"), float("nan"))
        steps = sum(by_id[i]["full_step_fraction"] for i in ids) / len(ids)
        print(
            f"| {label} | {len(ids)} | {sum(per_value) / len(ids):.3f} | {sum(first) / len(ids):.3f} | "
            f"{difference.value:+.3f} [{low:+.3f}, {high:+.3f}] | {steps:.3f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--report", type=Path, nargs="+")
    parser.add_argument("--base", choices=list(METHODS), default="snapkv", help="the report's baseline")
    args = parser.parse_args()
    if args.report:
        report(args.report, args.base)
    elif args.out:
        run(args.seed, args.examples, args.methods, args.out)
    else:
        parser.error("give --out (run) or --report")


if __name__ == "__main__":
    main()
