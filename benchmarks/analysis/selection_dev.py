"""Issue 47's tables: refreshkv's and recycled's selection with the papers' window of 1 (the old default), with a
window of 32, with window 32 and carry 1, on Gemma 3 with the query-check threshold 0.9 (the earlier rows ran at
0.85), and with the question's selection as a floor (`question_floor` 1, the default since issue 47), beside full,
the oracle, snapkv and quest, from the rows in docs/results/selection-dev/.

    python benchmarks/analysis/selection_dev.py            # markdown tables on stdout

Each cell is a mean over the examples of its row (n: those of the refreshkv or recycled column with the most that
`full` has too; a column with fewer says how many it has), so the columns compare example by example; perplexity is
each method's mean over full's (as `refreshkv report`) on the windows every method of the table has, with its 95%
paired bootstrap interval. Rows of the candidates that were not adopted (a sliding window, other carries) are left
out; their files' READMEs say what they hold.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

from refreshkv.eval import stats

FOLDER = Path(__file__).resolve().parents[2] / "docs" / "results" / "selection-dev"
STUDIES = {  # model: files, read in order (a repeated example keeps its first row)
    "SmolLM2-135M-Instruct, 4K, chat": [
        "smollm2.jsonl",
        "smollm2-default.jsonl",
        "smollm2-prefixed.jsonl",
        "smollm2-new.jsonl",
        "smollm2-carry.jsonl",
        "smollm2-carry-ppl.jsonl",
        "smollm2-carry-uuid.jsonl",
        "smollm2-ppl-default.jsonl",
        "smollm2-prefixed-default.jsonl",
        "smollm2-prefixed-w32c05.jsonl",
        "smollm2-qf1.jsonl",
        "smollm2-qf1-single.rank0.jsonl",
        "smollm2-qf1-single.rank1.jsonl",
        "smollm2-wider-multivalue-qf1.jsonl",
    ],
    "Gemma 3 270M, 8K, base": [
        "gemma.jsonl",
        "gemma-new.jsonl",
        "gemma-default.jsonl",
        "gemma-w32c05.jsonl",
        "gemma-t09.jsonl",
        "gemma-qf1.jsonl",
    ],
    "Gemma 3 270M, 8K, multi-turn": [
        "multi-turn-gemma.jsonl",
        "multi-turn-gemma-new.jsonl",
        "multi-turn-gemma-default.jsonl",
        "multi-turn-gemma-w32c05.jsonl",
        "multi-turn-gemma-t09.jsonl",
        "multi-turn-gemma-qf1.jsonl",
    ],
    "Gemma 3 270M, 16K, K = 2048": [
        "gemma-16k-default.jsonl",
        "gemma-16k-w32c0.jsonl",
        "gemma-16k-w32c05.rank0.jsonl",
        "gemma-16k-w32c05.rank1.jsonl",
        "gemma-16k-t09.jsonl",
        "gemma-16k-qf1.jsonl",
    ],
}
SELECTIONS = {
    (1, 0.0): "w1",
    (32, 0.0): "w32",
    (32, 0.5): "w32 carry 0.5",
    (32, 1.0): "w32 carry 1",
}  # (window, carry): label
THRESHOLD = 0.9  # Gemma 3's query-check threshold (methods/refreshkv.py); rows without one ran at 0.85
COLUMNS = ["full", "oracle", "snapkv", "quest"]
COLUMNS += [f"{method} {label}" for method in ("refreshkv", "recycled") for label in SELECTIONS.values()]
COLUMNS.insert(COLUMNS.index("refreshkv w32 carry 0.5") + 1, f"refreshkv w32 carry 0.5 threshold {THRESHOLD}")
FLOORED = ["refreshkv w32 carry 0.5 floor 1", f"refreshkv w32 carry 0.5 threshold {THRESHOLD} floor 1"]  # the default
COLUMNS[COLUMNS.index(f"refreshkv w32 carry 0.5 threshold {THRESHOLD}") + 1 : 0] = FLOORED


def column(row: dict) -> str | None:
    """The table column of a row, or None for a candidate that was not adopted."""
    method, params = row["method"], row["params"]
    if method not in ("refreshkv", "recycled"):
        return method if method in COLUMNS else None
    window, carry, floor = params.get("window", 1), params.get("carry"), params.get("question_floor")
    threshold = params.get("threshold")
    if floor is not None:  # rows since question_floor (7079f1f) leave the defaults of then out: window 32, carry 0.5
        window, carry = params.get("window", 32), params.get("carry", 0.5)
        threshold = threshold or (THRESHOLD if "gemma" in row["model"] else None)
    elif window > 1 and carry is None:  # a window sliding with decoding (commits 751aa3e-bb21822): not adopted
        return None
    label = SELECTIONS.get((window, carry or 0.0))
    if label is not None and threshold is not None:
        label += f" threshold {threshold}"
    if label is not None and floor:
        label += f" floor {floor:g}"
    name = None if label is None else f"{method} {label}"
    return name if name in COLUMNS else None


def budget(row: dict) -> str:
    params = row["params"]
    if "budget_ratio" in params:
        return {0.0625: "L/16", 0.125: "L/8"}.get(params["budget_ratio"], str(params["budget_ratio"]))
    return f"K={params['budget']}" if "budget" in params else "-"


def form(row: dict) -> str:
    return row["task_options"].get("question", "prefixed")


def load(files: list[str]) -> dict:
    """{(task, form): {column: {budget: {example: row}}}}; `full` under every budget."""
    table: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: collections.defaultdict(dict)))
    for name in files:
        path = FOLDER / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            row = json.loads(line)
            label = column(row)
            if label is not None:
                cell = table[(row["task"], form(row))][label][budget(row)]
                cell.setdefault(row["id"], row)
    return table


def generation_table(title: str, table: dict) -> list[str]:
    lines = [
        f"**{title}**: share right; n examples (a column with fewer: its n after it)",
        "",
    ]
    lines += ["| task | question | K | n | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 4) + "|"]
    header = len(lines)
    for (task, asked), columns in sorted(table.items()):
        if task == "ppl":
            continue
        budgets = sorted({b for c in columns.values() for b in c if b != "-"}) or ["-"]
        for k in budgets:
            cells = {name: {**columns[name].get(k, {}), **columns[name].get("-", {})} for name in COLUMNS}
            subject = max((cells[name] for name in COLUMNS[4:]), key=len)
            if cells["full"]:  # the examples `full` has, so that every column compares with it
                subject = {i: row for i, row in subject.items() if i in cells["full"]}
            if not subject:
                continue
            values = []
            for name in COLUMNS:
                shared = [i for i in subject if i in cells[name]]
                mean = sum(cells[name][i]["score"] for i in shared) / len(shared) if shared else None
                values.append(
                    "" if mean is None else f"{mean:.2f}" + ("" if len(shared) == len(subject) else f" ({len(shared)})")
                )
            lines.append(f"| {task.split('/')[-1]} | {asked} | {k} | {len(subject)} | " + " | ".join(values) + " |")
    return lines + [""] if len(lines) > header else []  # a study of perplexity only has no generation table


def perplexity_table(title: str, table: dict) -> list[str]:
    columns = table.get(("ppl", "prefixed"))
    if not columns or "full" not in columns:
        return []
    full = columns["full"]["-"]
    runs = [(name, k, rows) for name in COLUMNS[1:] for k, rows in sorted(columns.get(name, {}).items())]
    windows = sorted(set(full).intersection(*[rows for _, _, rows in runs]))
    lines = [f"**{title}**: perplexity over `full`'s [95% interval] on the {len(windows)} windows every row has", ""]
    lines += ["| method | K | ratio |", "|---|---|---|"]
    for name, k, rows in runs:
        estimate = stats.macro_ratio([[(rows[i]["score"], full[i]["score"]) for i in windows]])
        low, high = estimate.interval or (float("nan"), float("nan"))
        lines.append(f"| {name} | {k} | {estimate.value:.3f} [{low:.3f}, {high:.3f}] |")
    return lines + [""]


def main() -> None:
    out = []
    for title, files in STUDIES.items():
        table = load(files)
        out += generation_table(title, table) + perplexity_table(title, table)
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
