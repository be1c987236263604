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

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("full", "refreshkv", "snapkv", "streamingllm")
TASK, EXAMPLES = "refreshkv_keyed_numbers", 20


def rows_of(method: str, count: int) -> list[dict]:
    from method_rows import lm_eval_samples  # beside this script

    rows = []
    for sample in lm_eval_samples(TASK, method, count):
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
            compared = any((other, row["index"]) in chosen for row in mine)
            cells.append(f"{len(indices)} ({', '.join(indices)})" if indices else "0" if compared else "-")
        accuracy = sum(row["acc"] for row in mine) / len(mine)
        lines.append(f"| `{method}` | {len(mine)} | {accuracy:.2f} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main() -> None:
    from method_rows import run  # beside this script

    run(__doc__, ROOT / "docs" / "results" / "lm-eval-choice" / "smollm2.jsonl", METHODS, EXAMPLES, rows_of, summary)


if __name__ == "__main__":
    main()
