"""refreshkv.txt Table 5 from two `refreshkv sweep benchmarks/sweeps/table5.yaml` results files: before -> after
training.

    python benchmarks/analysis/table5.py docs/results/table5/table5-before.jsonl docs/results/table5/table5-after.jsonl
    python benchmarks/analysis/table5.py docs/results/table5/table5-before.jsonl      (the before column alone)

Test PPL per method is exp(mean loss) over every scored token of every window (the last S tokens of each window),
as a corpus perplexity; the change is relative ((after - before) / before). Only windows present in both files are
used, so the two columns are on the same examples.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from refreshkv.eval.distributed import sweep_files
from refreshkv.eval.report import load_results


def read_rows(path: Path) -> dict[tuple, dict]:
    """Rows of the file and of its data-parallel rank files (NAME.rankN.jsonl), by (method, parameters, example)."""
    paths = sweep_files(path)
    if not paths:
        raise SystemExit(f"error: no results at {path} (nor {path.stem}.rankN{path.suffix} beside it)")
    return {(row["method"], json.dumps(row["params"], sort_keys=True), row["id"]): row for row in load_results(paths)}


def perplexities(rows: dict[tuple, dict], keys: set[tuple]) -> dict[tuple, float]:
    losses: dict[tuple, list[float]] = {}
    for method, params, example in sorted(keys):
        losses.setdefault((method, params), []).extend(rows[(method, params, example)]["losses"])
    return {setting: math.exp(sum(values) / len(values)) for setting, values in losses.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path, nargs="?")
    args = parser.parse_args()
    before = read_rows(args.before)
    after = read_rows(args.after) if args.after else before
    shared = set(before) & set(after)
    if not shared:
        raise SystemExit("error: the two files share no (method, parameters, example) rows")
    ppl_before, ppl_after = perplexities(before, shared), perplexities(after, shared)
    windows = len({key[2] for key in shared})
    if not args.after:
        print(f"| method | stride | test PPL ({windows} windows) | vs full |")
        print("|---|---|---|---|")
        full = next(value for (method, _), value in ppl_before.items() if method == "full")
        for (method, params), value in ppl_before.items():
            print(f"| {method} | {json.loads(params).get('stride', '-')} | {value:.3f} | {value / full:.3f} |")
        return
    print(f"| method | stride | test PPL before -> after ({windows} windows) | change |")
    print("|---|---|---|---|")
    for (method, params), value in ppl_before.items():
        stride = json.loads(params).get("stride", "-")
        change = (ppl_after[(method, params)] - value) / value
        print(f"| {method} | {stride} | {value:.3f} -> {ppl_after[(method, params)]:.3f} | {change:+.2%} |")


if __name__ == "__main__":
    main()
