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
from refreshkv.eval.distributed import sweep_files

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
FOLDER = RESULTS / "selection-dev"
FULL_PERPLEXITY = {"SmolLM2": "selection-dev/smollm2-default.jsonl", "Gemma": "gemma-16k/gemma-16k.jsonl"}
# A source of rows: (file, method or None for every row, {parameter: value, None for one not given}).
Source = tuple[str, str | None, dict]
# the parameters of candidates held in one file beside the default: a row with one of them is not the default's
CANDIDATES = {"anchor": ("window", "answer"), "threshold": (-1.0,), "keep_decoded": (True,)}
# (what, the candidate's sources, the baseline's sources); several sources are pooled
SCORES: list[tuple[str, list[Source], list[Source]]] = [
    (
        "SmolLM2 multivalue",
        [(f"smollm2-wider-multivalue-{tag}.jsonl", None, {})],
        [("smollm2-wider-multivalue.jsonl", method, {})],
    )
    for tag in ("qf1", "qf075", "qf05", "qf1c0")
    for method in ("refreshkv", "snapkv", "oracle")
]
# seed 1's 40 examples hold the default (the floor) and refreshkv without it (question_floor 0) side by side
SEED1_FLOOR: Source = ("smollm2-multivalue-seed1.jsonl", "refreshkv", {"question_floor": None})
SEED1_NO_FLOOR: Source = ("smollm2-multivalue-seed1.jsonl", "refreshkv", {"question_floor": 0.0})
SCORES += [
    ("SmolLM2 multivalue, seed 1", [SEED1_FLOOR], [base])
    for base in (SEED1_NO_FLOOR, (SEED1_FLOOR[0], "snapkv", {}), (SEED1_FLOOR[0], "full", {}))
]
SCORES += [
    ("SmolLM2 multivalue, seeds 0-1", [("smollm2-wider-multivalue-qf1.jsonl", None, {}), SEED1_FLOOR], bases)
    for bases in (
        [("smollm2-wider-multivalue.jsonl", "refreshkv", {}), SEED1_NO_FLOOR],
        [("smollm2-wider-multivalue.jsonl", "snapkv", {}), (SEED1_FLOOR[0], "snapkv", {})],
        [("smollm2-wider-multivalue.jsonl", "full", {}), (SEED1_FLOOR[0], "full", {})],
    )
]
# seeds 2-4, 40 examples each: the default beside full, the oracle and snapkv; then seeds 0-2 and 0-4 pooled
LATER_SEEDS: list[Source] = [(f"smollm2-multivalue-seed{seed}.jsonl", "refreshkv", {}) for seed in (2, 3, 4)]
SCORES += [
    (f"SmolLM2 multivalue, seed {seed}", [source], [(source[0], method, {})])
    for seed, source in zip((2, 3, 4), LATER_SEEDS)
    for method in ("snapkv", "oracle", "full")
]
SCORES += [
    (
        f"SmolLM2 multivalue, seeds 0-{2 + len(later) - 1}",
        [("smollm2-wider-multivalue-qf1.jsonl", None, {}), SEED1_FLOOR, *later],
        [
            (file, method, {})
            for file in ("smollm2-wider-multivalue.jsonl", SEED1_FLOOR[0], *(source[0] for source in later))
        ],
    )
    for later in (LATER_SEEDS[:1], LATER_SEEDS)
    for method in ("snapkv", "oracle", "full")
]
# candidates on the same examples: the first query check against the window's queries (seeds 0-1); never a full step
# after the prompt (threshold -1) and recycled's full steps in every layer (seeds 3-4): do the full steps cost values?
# The first query check taking the answer's query as its anchor (anchor=answer); the answer kept beside C_p's K with
# the question's selection at 4x its score (keep_decoded, question_floor 4; seeds 0-4)
BASELINE_FILES = {"0-1": ["smollm2-wider-multivalue.jsonl", SEED1_FLOOR[0]], "3-4": [s[0] for s in LATER_SEEDS[1:]]}
BASELINE_FILES["0-4"] = BASELINE_FILES["0-1"] + [s[0] for s in LATER_SEEDS]
DEFAULTS = {"0-1": [("smollm2-wider-multivalue-qf1.jsonl", None, {}), SEED1_FLOOR], "3-4": LATER_SEEDS[1:]}
DEFAULTS["0-4"] = DEFAULTS["0-1"] + LATER_SEEDS
SCORES += [
    (f"SmolLM2 multivalue, seeds {seeds}, {name}", [(file, method, params)], baseline)
    for seeds, name, file, method, params in (
        ("0-1", "anchor=window", "smollm2-multivalue-anchor.jsonl", "refreshkv", {"anchor": "window"}),
        ("3-4", "threshold -1", "smollm2-multivalue-never.jsonl", "refreshkv", {"threshold": -1.0}),
        ("3-4", "recycled", "smollm2-multivalue-never.jsonl", "recycled", {}),
        ("0-4", "anchor=answer", "smollm2-multivalue-answer.jsonl", "refreshkv", {"anchor": "answer"}),
        *(
            (
                "0-4",
                f"keep_decoded, question_floor {floor}",
                f"smollm2-multivalue-keep-decoded{tag}.jsonl",
                "refreshkv",
                {"keep_decoded": True, "question_floor": floor},
            )
            for floor, tag in ((4.0, ""), (2.0, "-qf2"))
        ),
    )
    for baseline in (
        DEFAULTS[seeds],
        *([(base, method, {}) for base in BASELINE_FILES[seeds]] for method in ("snapkv", "oracle")),
    )
]
# the default since issue 47's keep_decoded (the question's floor the family's: 4, Gemma 3 1) on the rest of the dev
# sets, against the default before it and the baselines'
SCORES += [
    (what, [(file, "refreshkv", {"keep_decoded": True, "question_floor": floor})], [base])
    for what, file, floor, bases in (
        (
            "SmolLM2 dev, keep_decoded, floor 4",
            "smollm2-keep-decoded.jsonl",
            4.0,
            [("smollm2-qf1.jsonl", None, {}), ("smollm2-wider-multikey.jsonl", "snapkv", {})],
        ),
        (
            "Gemma 8K, keep_decoded, floor 1",
            "gemma-keep-decoded-qf1.jsonl",
            1.0,
            [("gemma-qf1.jsonl", None, {}), *(("gemma-new.jsonl", m, {}) for m in ("snapkv", "oracle"))],
        ),
        (
            "Gemma multi-turn, keep_decoded, floor 1",
            "multi-turn-gemma-keep-decoded-qf1.jsonl",
            1.0,
            [("multi-turn-gemma-qf1.jsonl", None, {}), *(("multi-turn-gemma.jsonl", m, {}) for m in ("quest", "full"))],
        ),
    )
    for base in bases
]
PREFIXED_MULTIVALUE = "smollm2-prefixed-multivalue-keep-decoded.jsonl"  # seed 1: the default now, before, snapkv
SCORES += [
    (
        "SmolLM2 prefixed multivalue, seed 1",
        [(PREFIXED_MULTIVALUE, "refreshkv", {"keep_decoded": True, "question_floor": 4.0})],
        [(PREFIXED_MULTIVALUE, method, params)],
    )
    for method, params in (("refreshkv", {"keep_decoded": False, "question_floor": 1.0}), ("snapkv", {}))
]
SCORES += [
    ("SmolLM2 multikey", [("smollm2-qf1.jsonl", None, {})], [("smollm2-wider-multikey.jsonl", m, {})])
    for m in ("refreshkv", "snapkv")
]
SCORES += [
    ("SmolLM2 prefixed", [("smollm2-qf1.jsonl", None, {})], [("smollm2-prefixed-w32c05.jsonl", "refreshkv", {})])
]
SCORES += [("Gemma 8K", [("gemma-qf1.jsonl", None, {})], [("gemma-t09.jsonl", "refreshkv", {})])]
SCORES += [("Gemma 8K", [("gemma-qf1.jsonl", None, {})], [("gemma-new.jsonl", m, {})]) for m in ("snapkv", "oracle")]
SCORES += [
    ("Gemma multi-turn", [("multi-turn-gemma-qf1.jsonl", None, {})], [("multi-turn-gemma-t09.jsonl", "refreshkv", {})])
]
SCORES += [
    ("Gemma multi-turn", [("multi-turn-gemma-qf1.jsonl", None, {})], [("multi-turn-gemma.jsonl", m, {})])
    for m in ("quest", "full")
]
PERPLEXITY = [
    ("SmolLM2", "smollm2-qf1.jsonl", "smollm2-carry-ppl.jsonl"),
    ("SmolLM2", "smollm2-qf1c0.jsonl", "smollm2-carry-ppl.jsonl"),
    ("SmolLM2", "smollm2-anchor.jsonl", "smollm2-qf1.jsonl"),
    ("SmolLM2", "smollm2-keep-decoded.jsonl", "smollm2-qf1.jsonl"),
    ("Gemma", "gemma-16k-qf1.jsonl", "gemma-16k-t09.jsonl"),
    ("Gemma", "gemma-16k-qf1c0.jsonl", "gemma-16k-t09.jsonl"),
    ("Gemma", "gemma-16k-keep-decoded.jsonl", "gemma-16k-qf1.jsonl"),
    ("Gemma", "gemma-16k-keep-decoded-qf1.jsonl", "gemma-16k-qf1.jsonl"),
    ("Gemma", "gemma-16k-keep-decoded-qf2.jsonl", "gemma-16k-qf1.jsonl"),
]


def rows(path: Path, method: str | None = None, params: dict | None = None) -> dict:
    """{(task, question form, example id): score} of `method`'s rows (refreshkv: the default's carry where a file
    holds several; those whose parameters hold `params`, and no candidate's parameter (`CANDIDATES`) that `params`
    does not name), or of every row (a candidate's file). A sweep's rank files
    are read with it."""
    out: dict = {}
    for line in (line for file in sweep_files(path) for line in file.read_text().splitlines()):
        row = json.loads(line)
        wanted = params or {}
        if method is not None and (
            row.get("method") != method
            or (method == "refreshkv" and row["params"].get("carry", 0.5) != 0.5)
            or any(row["params"].get(name) != value for name, value in wanted.items())
            or any(row["params"].get(name) in values and name not in wanted for name, values in CANDIDATES.items())
        ):
            continue
        key = (row["task"], row["task_options"].get("question", "prefixed"), row["id"])
        out.setdefault(key, row["score"])
    return out


def pooled(sources: list[Source]) -> dict:
    """`rows` of every source, pooled (their example ids differ)."""
    return {
        key: score for file, method, params in sources for key, score in rows(FOLDER / file, method, params).items()
    }


def label(sources: list[Source], method: bool) -> str:
    """A table cell: the sources' files, or their methods and parameters."""
    if not method:
        return " + ".join(file for file, _, _ in sources)
    named = (
        " ".join([name or file, *(f"{k}={v}" for k, v in params.items() if v is not None)])
        for file, name, params in sources
    )
    return " + ".join(dict.fromkeys(named))


def score_lines() -> list[str]:
    lines = ["| rows | task | candidate | baseline | n | candidate | baseline | paired difference [95%] |"]
    lines.append("|---" * 8 + "|")
    for what, candidate, baseline in SCORES:
        ours, theirs = pooled(candidate), pooled(baseline)
        for task in sorted({key[:2] for key in ours if key[0] != "ppl"}):
            shared = [key for key in ours if key[:2] == task and key in theirs]
            if not shared:
                continue
            difference = stats.macro_mean([[ours[key] - theirs[key] for key in shared]])
            low, high = difference.interval or (float("nan"), float("nan"))
            mean = [sum(values[key] for key in shared) / len(shared) for values in (ours, theirs)]
            cells = [what, f"{task[0].split('/')[-1]} ({task[1]})", label(candidate, False), label(baseline, True)]
            cells += [str(len(shared)), f"{mean[0]:.3f}", f"{mean[1]:.3f}"]
            cells += [f"{difference.value:+.3f} [{low:+.3f}, {high:+.3f}]"]
            lines.append("| " + " | ".join(cells) + " |")
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
