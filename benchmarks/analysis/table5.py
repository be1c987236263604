"""refreshkv.txt Table 5 from two `refreshkv sweep benchmarks/table5.yaml` results files: before -> after training.

    python benchmarks/analysis/table5.py docs/training/table5-before.jsonl docs/training/table5-after.jsonl

Test PPL per method is exp(mean loss) over every scored token of every window (the last S tokens of each window),
as a corpus perplexity; the change is relative ((after - before) / before). Only windows present in both files are
used, so the two columns are on the same examples.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def read_rows(path: Path) -> dict[tuple, dict]:
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[(row["method"], json.dumps(row["params"], sort_keys=True), row["id"])] = row
    return rows


def perplexities(rows: dict[tuple, dict], keys: set[tuple]) -> dict[tuple, float]:
    losses: dict[tuple, list[float]] = {}
    for method, params, example in sorted(keys):
        losses.setdefault((method, params), []).extend(rows[(method, params, example)]["losses"])
    return {setting: math.exp(sum(values) / len(values)) for setting, values in losses.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args()
    before, after = read_rows(args.before), read_rows(args.after)
    shared = set(before) & set(after)
    if not shared:
        raise SystemExit("error: the two files share no (method, parameters, example) rows")
    ppl_before, ppl_after = perplexities(before, shared), perplexities(after, shared)
    windows = len({key[2] for key in shared})
    print(f"| method | stride | test PPL before -> after ({windows} windows) | change |")
    print("|---|---|---|---|")
    for (method, params), value in ppl_before.items():
        stride = json.loads(params).get("stride", "-")
        change = (ppl_after[(method, params)] - value) / value
        print(f"| {method} | {stride} | {value:.3f} -> {ppl_after[(method, params)]:.3f} | {change:+.2%} |")


if __name__ == "__main__":
    main()
