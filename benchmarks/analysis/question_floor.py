"""Issue 47's `question_floor` rows against the default, snapkv and the oracle on the same examples (docs/results.md,
"The question's selection as a floor"), from docs/results/selection-dev/:

    python benchmarks/analysis/question_floor.py            # markdown on stdout

Each line compares one candidate file with a baseline file example by example: the mean score of each on the
examples both have, and the paired difference with its 95% bootstrap interval; perplexity is each run's mean over
`full`'s (as `refreshkv report`) on the windows both runs and `full` have, with its 95% paired bootstrap interval.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from refreshkv.eval import stats

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
FOLDER = RESULTS / "selection-dev"
FULL_PERPLEXITY = {"SmolLM2": "selection-dev/smollm2-default.jsonl", "Gemma": "gemma-16k/gemma-16k.jsonl"}
DEFAULT = {"method": "refreshkv", "carry": 0.5}  # the default's rows in files that hold other carries too
# (what, candidate file, baseline file, the baseline's rows)
SCORES = [
    ("SmolLM2 multivalue", f"smollm2-wider-multivalue-{tag}.jsonl", "smollm2-wider-multivalue.jsonl", method)
    for tag in ("qf1", "qf075", "qf05", "qf1c0")
    for method in ("refreshkv", "snapkv", "oracle")
]
SCORES += [
    ("SmolLM2 multikey", "smollm2-qf1.jsonl", "smollm2-wider-multikey.jsonl", m) for m in ("refreshkv", "snapkv")
]
SCORES += [("SmolLM2 prefixed", "smollm2-qf1.jsonl", "smollm2-prefixed-w32c05.jsonl", "refreshkv")]
SCORES += [("Gemma 8K", "gemma-qf1.jsonl", "gemma-t09.jsonl", "refreshkv")]
SCORES += [("Gemma 8K", "gemma-qf1.jsonl", "gemma-new.jsonl", m) for m in ("snapkv", "oracle")]
SCORES += [("Gemma multi-turn", "multi-turn-gemma-qf1.jsonl", "multi-turn-gemma-t09.jsonl", "refreshkv")]
SCORES += [("Gemma multi-turn", "multi-turn-gemma-qf1.jsonl", "multi-turn-gemma.jsonl", m) for m in ("quest", "full")]
PERPLEXITY = [
    ("SmolLM2", "smollm2-qf1.jsonl", "smollm2-carry-ppl.jsonl"),
    ("SmolLM2", "smollm2-qf1c0.jsonl", "smollm2-carry-ppl.jsonl"),
    ("Gemma", "gemma-16k-qf1.jsonl", "gemma-16k-t09.jsonl"),
    ("Gemma", "gemma-16k-qf1c0.jsonl", "gemma-16k-t09.jsonl"),
]


def rows(path: Path, method: str | None = None) -> dict:
    """{(task, question form, example id): score} of `method`'s rows (refreshkv: the default's carry where a file
    holds several), or of every row (a candidate's file)."""
    out: dict = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        row = json.loads(line)
        if method is not None and (
            row.get("method") != method or (method == "refreshkv" and row["params"].get("carry", 0.5) != 0.5)
        ):
            continue
        key = (row["task"], row["task_options"].get("question", "prefixed"), row["id"])
        out.setdefault(key, row["score"])
    return out


def score_lines() -> list[str]:
    lines = ["| rows | task | candidate | baseline | n | candidate | baseline | paired difference [95%] |"]
    lines.append("|---" * 8 + "|")
    for what, name, base, method in SCORES:
        ours, theirs = rows(FOLDER / name), rows(FOLDER / base, method)
        for task in sorted({key[:2] for key in ours if key[0] != "ppl"}):
            shared = [key for key in ours if key[:2] == task and key in theirs]
            if not shared:
                continue
            difference = stats.macro_mean([[ours[key] - theirs[key] for key in shared]])
            low, high = difference.interval or (float("nan"), float("nan"))
            mean = [sum(values[key] for key in shared) / len(shared) for values in (ours, theirs)]
            lines.append(
                f"| {what} | {task[0].split('/')[-1]} ({task[1]}) | {name} | {method} | {len(shared)} | "
                f"{mean[0]:.3f} | {mean[1]:.3f} | {difference.value:+.3f} [{low:+.3f}, {high:+.3f}] |"
            )
    return lines + [""]


def perplexity_lines() -> list[str]:
    lines = ["| model | candidate | windows | candidate / full | default / full |", "|---|---|---|---|---|"]
    for model, name, base in PERPLEXITY:
        full = {key[2]: v for key, v in rows(RESULTS / FULL_PERPLEXITY[model], "full").items() if key[0] == "ppl"}
        ours = {key[2]: v for key, v in rows(FOLDER / name).items() if key[0] == "ppl"}
        theirs = {key[2]: v for key, v in rows(FOLDER / base, "refreshkv").items() if key[0] == "ppl"}
        windows = sorted(set(ours) & set(theirs) & set(full))
        if not windows:
            continue
        cells = []
        for run in (ours, theirs):
            estimate = stats.macro_ratio([[(run[i], full[i]) for i in windows]])
            low, high = estimate.interval or (float("nan"), float("nan"))
            cells.append(f"{estimate.value:.3f} [{low:.3f}, {high:.3f}]")
        lines.append(f"| {model} | {name} | {len(windows)} | {cells[0]} | {cells[1]} |")
    return lines + [""]


def main() -> None:
    sys.stdout.write("\n".join(score_lines() + perplexity_lines()) + "\n")


if __name__ == "__main__":
    main()
