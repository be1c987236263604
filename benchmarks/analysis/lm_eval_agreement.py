"""Does lm-evaluation-harness under a method give `refreshkv eval`'s answers? SmolLM2's niah_multikey_1 at 2048
tokens asked without an answer prefix (the chat form users write), K = L/8, each method at its defaults.

    python benchmarks/analysis/lm_eval_agreement.py [--methods full,snapkv] [--limit N]

Per method (`METHODS`), the same 20 examples twice: `refreshkv eval --task ruler/niah_multikey_1 --length 2048
--seed 0 --task-option question=bare --task-option max_new_tokens=32 --budget-ratio 0.125` (the CLI, in a
subprocess), and lm-eval's `simple_evaluate` with the model type `refreshkv` on the shipped task
`refreshkv_niah_multikey_1_bare` with `apply_chat_template` (example i of its data is the runner's example i).

Output: one JSONL row per method and example (resumes: a method whose examples are all in --out is skipped), and the
table on stdout: per method, the share of examples with the same answer (character for character) and the same
score, and the mean score of each. `--summary` prints the table of --out without running anything.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("full", "refreshkv", "recycled", "snapkv", "pyramidkv", "h2o", "streamingllm", "quest")
RUNNER_TASK, SUBTASK_OPTIONS = "ruler/niah_multikey_1", ("question=bare", "max_new_tokens=32")
LM_EVAL_TASK = "refreshkv_niah_multikey_1_bare"
LENGTH, EXAMPLES = 2048, 20
# What the committed rows ran where a method's default has changed since: pyramidkv's rows are of its default before
# it took snapkv's selection, the papers' centred kernel (`--preset paper` today). Rows run again (its rows deleted
# from --out) run today's default: drop the method's entry then.
LABELS = {"pyramidkv": "`pyramidkv`, the papers' centred kernel (today's `--preset paper`)"}


def runner_rows(method: str, count: int) -> dict[str, dict]:
    """`refreshkv eval`'s rows of `method`, by example id."""
    from method_rows import RATIO  # beside this script: the K of lm-eval's runs

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "eval.jsonl"
        options = [part for option in SUBTASK_OPTIONS for part in ("--task-option", option)]
        ratio = [] if method == "full" else ["--budget-ratio", str(RATIO)]
        command = [sys.executable, "-m", "refreshkv", "eval", "--task", RUNNER_TASK, "--length", str(LENGTH)]
        command += ["--seed", "0", "--num-examples", str(count), *options, "--method", method, *ratio]
        one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}  # as lm-eval's model below: the same sums
        subprocess.run([*command, "--no-fidelity", "--out", str(out)], check=True, env=one_thread)
        rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {row["id"]: row for row in rows if "prediction" in row}


def summary(path: Path) -> str:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    lines = [
        "| method | examples | same answer | same score | mean score, `refreshkv eval` | mean score, lm-eval |",
        "|---|---|---|---|---|---|",
    ]
    for method in dict.fromkeys(row["method"] for row in rows):
        mine = [row for row in rows if row["method"] == method]
        same = sum(row["eval_prediction"] == row["lm_eval_prediction"] for row in mine)
        same_score = sum(row["eval_score"] == row["lm_eval_score"] for row in mine)
        ours = statistics.mean(row["eval_score"] for row in mine)
        theirs = statistics.mean(row["lm_eval_score"] for row in mine)
        label = LABELS.get(method, f"`{method}`")
        lines.append(
            f"| {label} | {len(mine)} | {same}/{len(mine)} | {same_score}/{len(mine)} | {ours:.3f} | {theirs:.3f} |"
        )
    return "\n".join(lines)


def rows_of(method: str, count: int) -> list[dict]:
    """Both answers and both scores of `method` on each example."""
    from method_rows import lm_eval_samples  # beside this script

    ours = runner_rows(method, count)
    rows = []
    for index, sample in enumerate(lm_eval_samples(LM_EVAL_TASK, method, count)):
        row = ours[sample["doc"]["id"]]
        rows.append(
            {
                "method": method,
                "id": row["id"],
                "index": index,
                "prompt_tokens": row["prompt_tokens"],
                "budget": row.get("budget"),
                "eval_prediction": row["prediction"],
                "eval_score": row["score"],
                "lm_eval_prediction": sample["resps"][0][0],
                "lm_eval_score": sample["score"],
            }
        )
    return rows


def main() -> None:
    from method_rows import run  # beside this script

    run(__doc__, ROOT / "docs" / "results" / "lm-eval-agreement" / "smollm2.jsonl", METHODS, EXAMPLES, rows_of, summary)


if __name__ == "__main__":
    main()
