"""What the lm-eval scripts (lm_eval_agreement.py, lm_eval_choice.py) share: a shipped task's samples under a method
at K = L/8, their command line, and rows kept per method in one JSONL file. A method's rows are written together
once all its examples ran, so a killed run resumes at the first method that has none."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

RATIO = 0.125  # K = L/8


def lm_eval_samples(task: str, method: str, count: int) -> list[dict]:
    """lm-eval's samples of the shipped `task` under `method` (K = L/8 but for `full`) with the chat template, in the
    data's order."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from refreshkv.lm_eval import TASKS_DIR, RefreshKVLM

    params = {} if method == "full" else {"budget_ratio": RATIO}
    result = lm_eval.simple_evaluate(
        model=RefreshKVLM(method=method, threads=1, **params),
        tasks=[task],
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
        limit=count,
        log_samples=True,
        apply_chat_template=True,
    )
    return sorted(result["samples"][task], key=lambda sample: sample["doc_id"])


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def run(
    description: str,
    out: Path,
    methods: tuple[str, ...],
    examples: int,
    rows_of: Callable[[str, int], list[dict]],
    summary: Callable[[Path], str],
) -> None:
    """`rows_of(method, examples)` for each method that --out lacks, then `summary(--out)` on stdout."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--methods", default=",".join(methods), help="comma-separated methods")
    parser.add_argument("--limit", type=int, default=examples, help="examples per method")
    parser.add_argument("--summary", action="store_true", help="print the table of --out and stop")
    args = parser.parse_args()
    if not args.summary:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        done = {row["method"] for row in read_rows(args.out)} if args.out.exists() else set()
        for method in args.methods.split(","):
            if method not in done:
                rows = rows_of(method, args.limit)
                with args.out.open("a", encoding="utf-8") as file:  # a method's rows together, or none of them
                    file.write("".join(json.dumps(row) + "\n" for row in rows))
    print(summary(args.out))
