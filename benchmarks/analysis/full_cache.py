"""Issue 12's quality table from `refreshkv sweep benchmarks/sweeps/full-cache.yaml`: each quantized C_f against the
dense one.

    python benchmarks/analysis/full_cache.py docs/results/full-cache/full-cache.jsonl

Per length and C_f: the perplexity ratio to dense-C_f `refreshkv` on the same windows (mean PPL / mean dense PPL,
95% paired bootstrap interval, as `refreshkv report` computes `vs full`), the RULER needle score (mean over the
needle tasks' examples, `full` and dense alongside), and the KV bytes held relative to `full`'s on the same
examples. Decode speed is not here: the sweep shares the cores; it comes from a quiet `refreshkv bench`.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from refreshkv.eval import stats
from refreshkv.eval.distributed import sweep_files
from refreshkv.eval.report import load_results

DENSE = "dense"


def interval(estimate: stats.Estimate) -> str:
    if estimate.value is None:
        return "-"
    low_high = f" [{estimate.interval[0]:.3f}, {estimate.interval[1]:.3f}]" if estimate.interval else ""
    return f"{estimate.value:.3f}{low_high}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    paths = sweep_files(parser.parse_args().results)
    if not paths:
        sys.exit("error: no results file (or NAME.rankN.jsonl files) at that path")
    rows = load_results(paths)
    # (length, task kind, store) -> {example id: row}; store "full" is the `full` method
    table: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for row in rows:
        store = "full" if row["method"] == "full" else row["params"].get("full_cache", DENSE)
        kind = "ppl" if row["task"] == "ppl" else "needles"
        table[(row["length"], kind, store)][f"{row['task']}/{row['id']}"] = row
    stores = ["full", DENSE, "int8", "int4", "int2"]
    print("| L | C_f | PPL vs dense (windows) | needles score (examples) | KV held vs full |")
    print("|---|---|---|---|---|")
    for length in sorted({key[0] for key in table}):
        for store in stores:
            ppl, dense_ppl = table.get((length, "ppl", store), {}), table.get((length, "ppl", DENSE), {})
            shared = sorted(set(ppl) & set(dense_ppl))
            vs_dense = stats.macro_ratio([[(ppl[i]["score"], dense_ppl[i]["score"]) for i in shared]])
            needles = table.get((length, "needles", store), {})
            score = stats.macro_mean([[row["score"] for row in needles.values()]])
            mine = {**ppl, **needles}
            full = {**table.get((length, "ppl", "full"), {}), **table.get((length, "needles", "full"), {})}
            both = sorted(set(mine) & set(full))
            held = (
                sum(mine[i]["kv_bytes_full"] for i in both) / sum(full[i]["kv_bytes_full"] for i in both)
                if both
                else None
            )
            print(
                f"| {length} | {store} | {interval(vs_dense) if store != 'full' else '-'} ({len(ppl)}) | "
                f"{interval(score)} ({len(needles)}) | {'-' if held is None else f'{held:.3f}'} |"
            )


if __name__ == "__main__":
    main()
