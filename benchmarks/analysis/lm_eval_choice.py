"""Does a multiple choice move with the method? lm-eval's `refreshkv_keyed_numbers` (niah_multikey_1 at 2048
tokens: after the asked key's answer prefix, which of the text's four needle numbers follows) on SmolLM2, each
method at K = L/8 and its defaults, `full` with the whole cache.

    python benchmarks/analysis/lm_eval_choice.py [--methods full,refreshkv,snapkv] [--limit N]

Each option is scored one decode step at a time under the method after the context's prefill (the model type
`refreshkv`, `loglikelihood`); the method's question window is the end of the context, which holds the question and
the answer prefix naming the key.

Output: one JSONL row per method and example (the four options' log-likelihoods, the option chosen, right or not;
resumes per method) and the table on stdout: per method, the accuracy and the examples whose choice differs from
`full`'s and from `snapkv`'s. `--summary` prints the table of --out without running anything.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("full", "refreshkv", "snapkv", "streamingllm")
TASK, EXAMPLES, RATIO = "refreshkv_keyed_numbers", 20, 0.125


def rows_of(method: str, count: int) -> list[dict]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from refreshkv.lm_eval import TASKS_DIR, RefreshKVLM

    params = {} if method == "full" else {"budget_ratio": RATIO}
    result = lm_eval.simple_evaluate(
        model=RefreshKVLM(method=method, threads=1, **params),
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
        limit=count,
        log_samples=True,
        apply_chat_template=True,
    )
    rows = []
    for sample in sorted(result["samples"][TASK], key=lambda sample: sample["doc_id"]):
        likelihoods = [response[0][0] for response in sample["resps"]]
        chosen = max(range(len(likelihoods)), key=likelihoods.__getitem__)
        rows.append(
            {
                "method": method,
                "id": sample["doc"]["id"],
                "index": sample["doc_id"],
                "label": sample["doc"]["label"],
                "loglikelihoods": likelihoods,
                "chosen": chosen,
                "acc": sample["acc"],
            }
        )
    return rows


def summary(path: Path) -> str:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    chosen = {(row["method"], row["index"]): row["chosen"] for row in rows}

    lines = [
        "| method | examples | accuracy | choice differs from `full`'s | from `snapkv`'s |",
        "|---|---|---|---|---|",
    ]
    for method in dict.fromkeys(row["method"] for row in rows):
        mine = [row for row in rows if row["method"] == method]
        cells = []
        for other in ("full", "snapkv"):
            indices = [
                str(row["index"]) for row in mine if chosen.get((other, row["index"]), row["chosen"]) != row["chosen"]
            ]
            cells.append(f"{len(indices)} ({', '.join(indices)})" if indices else "0")
        accuracy = sum(row["acc"] for row in mine) / len(mine)
        lines.append(f"| `{method}` | {len(mine)} | {accuracy:.2f} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "lm-eval-choice" / "smollm2.jsonl")
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
            if method not in done:
                rows = rows_of(method, args.limit)
                with args.out.open("a", encoding="utf-8") as file:  # a method's rows together, or none of them
                    file.write("".join(json.dumps(row) + "\n" for row in rows))
    print(summary(args.out))


if __name__ == "__main__":
    main()
