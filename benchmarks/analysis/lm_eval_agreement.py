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

import argparse
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
LENGTH, EXAMPLES, RATIO = 2048, 20, 0.125


def runner_rows(method: str, count: int) -> dict[str, dict]:
    """`refreshkv eval`'s rows of `method`, by example id."""
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


def lm_eval_samples(method: str, count: int) -> list[dict]:
    """lm-eval's samples of `method` on the shipped task, in the data's order."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from refreshkv.lm_eval import TASKS_DIR, RefreshKVLM

    params = {} if method == "full" else {"budget_ratio": RATIO}
    result = lm_eval.simple_evaluate(
        model=RefreshKVLM(method=method, threads=1, **params),
        tasks=[LM_EVAL_TASK],
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
        limit=count,
        log_samples=True,
        apply_chat_template=True,
    )
    return sorted(result["samples"][LM_EVAL_TASK], key=lambda sample: sample["doc_id"])


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
        lines.append(
            f"| `{method}` | {len(mine)} | {same}/{len(mine)} | {same_score}/{len(mine)} | {ours:.3f} | {theirs:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "lm-eval-agreement" / "smollm2.jsonl")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods")
    parser.add_argument("--limit", type=int, default=EXAMPLES, help="examples per method")
    parser.add_argument("--summary", action="store_true", help="print the table of --out and stop")
    args = parser.parse_args()
    if not args.summary:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        done = set()
        if args.out.exists():
            done = {json.loads(line)["method"] for line in args.out.read_text(encoding="utf-8").splitlines() if line}
        for method in args.methods.split(","):
            if method in done:
                continue
            ours = runner_rows(method, args.limit)
            theirs = lm_eval_samples(method, args.limit)
            rows = []
            for index, sample in enumerate(theirs):
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
            with args.out.open("a", encoding="utf-8") as file:  # a method's rows together, or none of them
                file.write("".join(json.dumps(row) + "\n" for row in rows))
            print(summary(args.out), flush=True)
    print(summary(args.out))


if __name__ == "__main__":
    main()
