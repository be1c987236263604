"""The tables of README.md and docs/results.md, drawn from the committed rows under docs/results/:

    python benchmarks/analysis/docs_tables.py            # rewrite every table between its markers (README.md,
                                                         # docs/results.md, docs/serving.md, docs/evaluation.md)
    python benchmarks/analysis/docs_tables.py --check    # exit 1, naming the tables, where a file differs

A table sits between `<!-- table: NAME -->` and `<!-- /table -->` in a markdown file; NAME is a key of `TABLES`.
Each table is a list of rows (a label and the sources of its rows: files, a method, parameters) and columns (model,
task, question form, length, figure). A column's figures are over the examples that every row with rows there has
(its `n`), so the rows of a column compare like with like; a row with no rows in a column says so.
Perplexity is the mean over `full`'s on the same windows with its 95% paired bootstrap interval (as `refreshkv
report`); a score is the mean of the examples' scores; KL is KL(full || method) per answer token, each method fed
`full`'s answer; KV is the mean of the rows' KV bytes held and read per step. Speed comes from `refreshkv bench`
JSON files.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import re
import sys
from pathlib import Path

from refreshkv.eval import stats
from refreshkv.eval.distributed import sweep_files

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
NO_DEFAULT = "no row of today's default"


@dataclasses.dataclass(frozen=True)
class Pick:
    """The rows of `method` in `files` (each with its rank files) whose parameters hold `params` (None: not given)."""

    files: tuple[str, ...]
    method: str
    params: tuple[tuple[str, object], ...] = ()

    def rows(self) -> list[dict]:
        out = []
        for name in self.files:
            for path in sweep_files(RESULTS / name):
                for line in path.read_text(encoding="utf-8").splitlines():
                    row = json.loads(line)
                    given = row.get("params") or {}
                    if row["method"] == self.method and all(given.get(k) == v for k, v in self.params):
                        out.append(row)
        return out


def pick(method: str, *files: str, **params) -> Pick:
    return Pick(tuple(files), method, tuple(sorted(params.items())))


@dataclasses.dataclass(frozen=True)
class Column:
    header: str
    task: str  # a row's `task`
    figure: str  # "score" (mean), "right_kl" (sum of scores · mean KL), "ppl" (over `full`'s), "kv" (MB held / read)
    model: str = ""  # a substring of the row's model
    length: int | None = None
    question: str | None = None  # the task option `question` ("bare", "sentence"; None: RULER's prefixed form)


@dataclasses.dataclass(frozen=True)
class Bench:
    """`refreshkv bench` figures of `method` at `length` in a JSON file under docs/results/."""

    file: str
    method: str
    length: int

    def row(self) -> dict:
        data = json.loads((RESULTS / self.file).read_text(encoding="utf-8"))
        return next(r for r in data["rows"] if r["method"] == self.method and r["length"] == self.length)


@dataclasses.dataclass(frozen=True)
class Row:
    label: str
    picks: tuple[Pick, ...]
    bench: Bench | None = None
    missing: str = "-"  # a cell where the row has no rows


def key(row: dict) -> tuple:
    return (row["task"], row["length"], row["id"])


def selected(rows: list[dict], column: Column) -> dict[tuple, dict]:
    out = {}
    for row in rows:
        if (
            row["task"] == column.task
            and column.model in row["model"]
            and (column.length is None or row["length"] == column.length)
            and (row.get("task_options") or {}).get("question") == column.question
        ):
            out.setdefault(key(row), row)
    return out


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def cell(column: Column, rows: list[dict], full: dict[tuple, dict]) -> str:
    if column.figure == "ppl":
        if all(r["method"] == "full" and not r.get("params") for r in rows):
            return "1"
        estimate = stats.macro_ratio([[(r["score"], full[key(r)]["score"]) for r in rows]])
        low, high = estimate.interval or (float("nan"), float("nan"))
        return f"{estimate.value:.3f} [{low:.3f}, {high:.3f}]"
    if column.figure == "score":
        return f"{mean(r['score'] for r in rows):.2f}"
    if column.figure == "right_kl":
        kl = [r["kl_to_full"] for r in rows if r.get("kl_to_full") is not None]
        return f"{sum(r['score'] for r in rows):g} · {mean(kl):.3f}" if kl else f"{sum(r['score'] for r in rows):g}"
    if column.figure == "kv":
        held, read = (mean(r[field] for r in rows) / 2**20 for field in ("kv_bytes_full", "kv_bytes_attended_mean"))
        return f"{held:.0f} / {read:.0f}"
    raise ValueError(f"unknown figure {column.figure}")


def table(rows: list[Row], columns: list[Column], first: str, full: Pick | None = None, transpose=False) -> str:
    """Markdown: a header of `first` and the columns' headers with their `n`, then one line per row (`transpose`:
    one line per column)."""
    by_row = [[r for p in row.picks for r in p.rows()] for row in rows]
    full_rows = full.rows() if full else []
    cells: list[list[str]] = [[row.label] for row in rows]
    headers = [first]
    for column in columns:
        picked = [selected(found, column) for found in by_row]
        reference = selected(full_rows, column)
        shared = set.intersection(*(set(p) for p in picked if p)) if any(picked) else set()
        if column.figure == "ppl":
            shared &= set(reference)
        headers.append(f"{column.header} ({len(shared)})")
        for line, chosen, row in zip(cells, picked, rows):
            figures = [chosen[k] for k in sorted(shared)] if chosen else []
            line.append(cell(column, figures, reference) if figures else row.missing)
    if any(row.bench for row in rows):
        headers.append("decode ms/token (vs `full`)")
        for line, row in zip(cells, rows):
            if row.bench is None:
                line.append(row.missing)
                continue
            found = row.bench.row()
            line.append(f"{found['decode_ms_per_token']:.1f} ({found['speedup_vs_full']:.2f}x)")
    lines = [headers, *cells]
    if transpose:
        lines = [list(line) for line in zip(*lines)]
    out = ["| " + " | ".join(lines[0]) + " |", "|---" * len(lines[0]) + "|"]
    return "\n".join(out + ["| " + " | ".join(line) + " |" for line in lines[1:]])


# ---- the tables --------------------------------------------------------------------------------------------------

GEMMA_16K = ("gemma-16k/gemma-16k.jsonl",)
GEMMA_16K_SPAN = ("gemma-16k-span/gemma-16k-span.jsonl",)
# refreshkv's default today on Gemma 3 (question_floor 1, threshold 0.9), its parameters written out
GEMMA_DEFAULT = dict(window=32, carry=0.5, threshold=0.9, question_floor=1.0, keep_decoded=True)
GEMMA_16K_DEFAULT = pick(
    "refreshkv",
    "selection-dev/gemma-16k-keep-decoded-qf1.jsonl",
    "selection-dev/gemma-16k-keep-decoded-qf1-niah.jsonl",
    **GEMMA_DEFAULT,
)
BENCH_16K = "bench-gemma/16k.json"  # today's defaults, one interleaved run on one machine

HEADLINE_COLUMNS = [
    Column("perplexity / `full`'s, book windows", "ppl", "ppl", "gemma", 16384),
    Column("niah_multikey_1: right · KL", "ruler/niah_multikey_1", "right_kl", "gemma", 16384),
    Column("KV MB held / read per step", "ppl", "kv", "gemma", 16384),
]


def headline() -> str:
    rows = [
        Row("`full`", (pick("full", *GEMMA_16K),), Bench(BENCH_16K, "full", 16384)),
        Row("`refreshkv`", (GEMMA_16K_DEFAULT,), Bench(BENCH_16K, "refreshkv", 16384), missing=NO_DEFAULT),
        Row("`snapkv`, window 1", (pick("snapkv", *GEMMA_16K_SPAN),), Bench(BENCH_16K, "snapkv", 16384)),
        Row("`streamingllm`", (pick("streamingllm", *GEMMA_16K),), Bench(BENCH_16K, "streamingllm", 16384)),
        Row("`quest`", (pick("quest", *GEMMA_16K),), missing="not run at 16K"),
    ]
    return table(rows, HEADLINE_COLUMNS, "method", full=pick("full", *GEMMA_16K))


def gemma_16k() -> str:
    rows = [
        Row("refreshkv, today's default", (GEMMA_16K_DEFAULT,), missing=NO_DEFAULT),
        Row("refreshkv, window 1 (span pooling)", (pick("refreshkv", *GEMMA_16K_SPAN),)),
        Row("refreshkv, the papers' setting", (pick("refreshkv", *GEMMA_16K),)),
        Row("recycled, stride 10 (span pooling)", (pick("recycled", *GEMMA_16K_SPAN),)),
        Row("snapkv, window 1 (span pooling)", (pick("snapkv", *GEMMA_16K_SPAN),)),
        Row("snapkv, the papers' setting", (pick("snapkv", *GEMMA_16K),)),
        Row("quest", (pick("quest", *GEMMA_16K),)),
        Row("streamingllm", (pick("streamingllm", *GEMMA_16K),)),
        Row("h2o", (pick("h2o", *GEMMA_16K),)),
        Row("oracle", (pick("oracle", *GEMMA_16K),)),
    ]
    columns = [
        Column("perplexity / `full`'s", "ppl", "ppl", "gemma", 16384),
        Column("niah_multikey_1: right · KL", "ruler/niah_multikey_1", "right_kl", "gemma", 16384),
        Column("KV MB held / read", "ppl", "kv", "gemma", 16384),
    ]
    return table(rows, columns, "Gemma 3 270M, 16K, K = 2048", full=pick("full", *GEMMA_16K))


DEV = "selection-dev/"
MULTIVALUE_SEEDS = tuple(f"{DEV}smollm2-multivalue-seed{seed}.jsonl" for seed in (1, 3, 4))
BASELINES = (  # the files that hold the baselines' rows on the dev sets' examples
    f"{DEV}smollm2-wider-multivalue.jsonl",
    *MULTIVALUE_SEEDS,
    f"{DEV}smollm2-wider-multikey.jsonl",
    f"{DEV}smollm2-default.jsonl",
    f"{DEV}smollm2-prefixed-multivalue-keep-decoded.jsonl",
    f"{DEV}gemma-new.jsonl",
    f"{DEV}multi-turn-gemma.jsonl",
)


def defaults() -> str:
    """refreshkv's default today (the answer kept in C_p, the question's floor 4x, Gemma 3 1x) against the one before
    (C_p of K + 1, floor 1) and the baselines on the dev sets' examples."""
    today = [("smollm2-multivalue-keep-decoded", 4.0), ("smollm2-keep-decoded", 4.0)]
    today += [("smollm2-prefixed-multivalue-keep-decoded", 4.0), ("gemma-keep-decoded-qf1", 1.0)]
    today += [("multi-turn-gemma-keep-decoded-qf1", 1.0)]
    before = [("smollm2-wider-multivalue-qf1", 1.0), ("smollm2-qf1", 1.0), ("gemma-qf1", 1.0)]
    before += [("multi-turn-gemma-qf1", 1.0), ("gemma-16k-qf1", 1.0)]
    rows = [
        Row(
            "**today's default**",
            (
                *(pick("refreshkv", f"{DEV}{f}.jsonl", keep_decoded=True, question_floor=q) for f, q in today),
                GEMMA_16K_DEFAULT,
            ),
        ),
        Row(
            "before (C_p of K + 1, floor 1)",
            (
                *(pick("refreshkv", f"{DEV}{f}.jsonl", question_floor=q) for f, q in before),
                pick("refreshkv", *MULTIVALUE_SEEDS, budget_ratio=0.125, question_floor=None),
                pick(
                    "refreshkv",
                    f"{DEV}smollm2-prefixed-multivalue-keep-decoded.jsonl",
                    keep_decoded=False,
                    question_floor=1.0,
                ),
            ),
        ),
        Row("snapkv", (pick("snapkv", *BASELINES),)),
        Row("oracle", (pick("oracle", *BASELINES),)),
        Row("`full`", (pick("full", *BASELINES, *GEMMA_16K),)),
    ]
    smollm2 = dict(model="SmolLM2", length=4096)
    gemma = dict(model="gemma", length=8192)
    columns = [
        Column("SmolLM2 niah_multivalue, no prefix", "ruler/niah_multivalue", "score", question="bare", **smollm2),
        Column("SmolLM2 niah_multikey_1, no prefix", "ruler/niah_multikey_1", "score", question="bare", **smollm2),
        Column("SmolLM2 niah_multivalue, RULER's prefix", "ruler/niah_multivalue", "score", **smollm2),
        Column("SmolLM2 perplexity / `full`'s at 4K", "ppl", "ppl", **smollm2),
        Column("Gemma niah_multikey_1, a sentence", "ruler/niah_multikey_1", "score", question="sentence", **gemma),
        Column("Gemma niah_single_1, a sentence", "ruler/niah_single_1", "score", question="sentence", **gemma),
        Column("Gemma niah_single_2, a sentence", "ruler/niah_single_2", "score", question="sentence", **gemma),
        Column("Gemma multi-turn, prefixed turns", "multiturn/niah", "score", question="prefixed", **gemma),
        Column("Gemma multi-turn, bare turns", "multiturn/niah", "score", question="bare", **gemma),
        Column("Gemma perplexity / `full`'s at 16K", "ppl", "ppl", "gemma", 16384),
    ]
    full = pick("full", f"{DEV}smollm2-default.jsonl", *GEMMA_16K)
    return table(rows, columns, "K = L/8 (examples)", full=full, transpose=True)


NEW_METHODS = ("adakv", "cake", "d2o", "dapq", "defensivekv", "fasa", "keydiff", "kvmerger", "lazyeviction")
NEW_METHODS += ("mikv", "think", "tova")
NEW = ("new-methods/gemma-16k.jsonl", "new-methods/smollm2-dev.jsonl", "new-methods/gemma-dev.jsonl")
NEW_SPAN = (
    "new-methods/smollm2-dev-span.jsonl",
    "new-methods/gemma-dev-span.jsonl",
    "new-methods/gemma-16k-span.jsonl",
)
# pooling by span by default, chosen on the dev sets; their papers' centred kernel is `--preset paper`
SPAN_DEFAULT = ("adakv", "cake", "dapq", "defensivekv", "lazyeviction")
# of them, the two whose papers' kernel 5 gave way to 7 on the dev sets (after their span rows), and those rows
KERNEL_7 = ("cake", "defensivekv")
NEW_KERNEL = (
    "new-methods/smollm2-dev-kernel.jsonl",
    "new-methods/gemma-dev-kernel.jsonl",
    "new-methods/gemma-16k-kernel.jsonl",
)
DEV_WIDER = (f"{DEV}smollm2-wider-multikey.jsonl", f"{DEV}smollm2-wider-multivalue.jsonl")


def new_methods() -> str:
    """The newer methods at their defaults, K = L/8, beside `full`, today's refreshkv and snapkv on the same
    examples: Gemma's 16K book windows, its dev set's niah_multikey_1 asked in a sentence, and SmolLM2's dev set
    without an answer prefix."""
    today = (
        pick("refreshkv", f"{DEV}smollm2-keep-decoded.jsonl", keep_decoded=True, question_floor=4.0),
        pick("refreshkv", f"{DEV}smollm2-multivalue-keep-decoded.jsonl", keep_decoded=True, question_floor=4.0),
        GEMMA_16K_DEFAULT,
        pick("refreshkv", f"{DEV}gemma-keep-decoded-qf1.jsonl", keep_decoded=True, question_floor=1.0),
    )
    gemma_dev = f"{DEV}gemma-new.jsonl"
    rows = [
        Row("`full`", (pick("full", *DEV_WIDER, gemma_dev, *GEMMA_16K),)),
        Row("`refreshkv`, today's default", today),
        Row(
            "`snapkv` (at 16K: window 1)",
            (pick("snapkv", *DEV_WIDER, gemma_dev), pick("snapkv", *GEMMA_16K_SPAN)),
        ),
        *(row for method in NEW_METHODS for row in new_method_rows(method)),
    ]
    smollm2 = dict(model="SmolLM2", length=4096, question="bare")
    columns = [
        Column("Gemma perplexity / `full`'s at 16K", "ppl", "ppl", "gemma", 16384),
        Column("Gemma KV MB held / read at 16K", "ppl", "kv", "gemma", 16384),
        Column("Gemma niah_multikey_1, a sentence", "ruler/niah_multikey_1", "score", "gemma", 8192, "sentence"),
        Column("SmolLM2 niah_multikey_1, no prefix", "ruler/niah_multikey_1", "score", **smollm2),
        Column("SmolLM2 niah_multivalue, no prefix", "ruler/niah_multivalue", "score", **smollm2),
    ]
    return table(rows, columns, "K = L/8 (examples)", full=pick("full", *GEMMA_16K))


def new_method_rows(method: str) -> list[Row]:
    """A method's row at its defaults; where they pool by span (chosen on the dev sets), its papers' rows beside
    (and for cake and defensivekv, whose kernel 7 was chosen after, their rows at the papers' kernel by span)."""
    if method not in SPAN_DEFAULT:
        return [Row(f"`{method}`", (pick(method, *NEW),))]
    if method in KERNEL_7:
        return [
            Row(f"`{method}` (span pooling, kernel 7)", (pick(method, *NEW_KERNEL, kernel=7),)),
            Row(f"`{method}` span pooling, kernel 5", (pick(method, *NEW_SPAN, pooling="span"),)),
            Row(f"`{method}` --preset paper", (pick(method, *NEW, pooling=None),)),
        ]
    return [
        Row(f"`{method}` (span pooling)", (pick(method, *NEW_SPAN, pooling="span"),)),
        Row(f"`{method}` --preset paper", (pick(method, *NEW, pooling=None),)),
    ]


NEW_WINDOWS = "new-methods/smollm2-dev-window.jsonl"


def new_methods_windows() -> str:
    """The methods that pool by span, their window and kernel varied one at a time around their span rows (window 32;
    kernel 7, cake and defensivekv 5 then, 7 since) on SmolLM2's dev set without an answer prefix (the examples of
    those rows)."""
    rows = []
    for method in SPAN_DEFAULT:
        kernels = {k: pick(method, NEW_WINDOWS, kernel=k) for k in (3, 13)}
        span_rows = pick(method, *NEW_SPAN, pooling="span")
        if method in KERNEL_7:
            kernels |= {5: span_rows} | {k: pick(method, *NEW_KERNEL, kernel=k) for k in (7, 9)}
        else:
            kernels[7] = span_rows
        varied = 5 if method in KERNEL_7 else 7  # the kernel the windows were varied at
        rows += [
            Row(f"`{method}` window 32, kernel {k}" + (" (default)" if k == 7 else ""), (found,))
            for k, found in sorted(kernels.items())
        ]
        rows += [
            Row(f"`{method}` window {w}, kernel {varied}", (pick(method, NEW_WINDOWS, window=w),)) for w in (16, 64)
        ]
    smollm2 = dict(model="SmolLM2", length=4096, question="bare")
    columns = [
        Column("SmolLM2 niah_multikey_1, no prefix", "ruler/niah_multikey_1", "score", **smollm2),
        Column("SmolLM2 niah_multivalue, no prefix", "ruler/niah_multivalue", "score", **smollm2),
    ]
    return table(rows, columns, "K = L/8 (examples)")


def vllm_rows() -> list[dict]:
    return json.loads((RESULTS / "vllm-serving" / "cpu.json").read_text(encoding="utf-8"))["rows"]


def vllm_serving() -> str:
    """Decode inside vLLM by the wall clock (benchmarks/perf/vllm_serving.py): per length and batch, each method's
    decode tokens/s (every step counted) against vLLM's own and the ceiling, its steps, first tokens and refreshes."""
    lines = [
        "| length | requests | attention | decode tokens/s | vs vLLM's own | share of the ceiling | step ms: mean "
        "/ median / p90 / max | largest step vs vLLM's own | first token s (vs own) | second token s | full steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in vllm_rows():
        name = {"vllm": "vLLM's own", "ceiling": "ceiling: vLLM's own at K"}.get(row["method"], f"`{row['method']}`")
        steps = " / ".join(f"{row[f'step_ms_{key}']:.0f}" for key in ("mean", "median", "p90", "max"))
        # a user's wait where every run prefilled anew; prompts found in the prefix cache say nothing of it
        first = (
            f"{row['first_token_s_mean']:.1f} ({row['first_token_s_mean_vs_vllm']:.2f}x)"
            if row["fresh_prefill"]
            else "-"
        )
        lines.append(
            f"| {row['length']} | {row['batch']} | {name} | {row['tokens_per_s']:.1f} | "
            f"{row['tokens_per_s_vs_vllm']:.2f}x | {row['share_of_ceiling']:.2f} | {steps} | "
            f"{row['step_ms_max_vs_vllm']:.2f}x | {first} | {row['second_token_s_mean']:.2f} | "
            f"{row['full_step_share']:.3f} |"
        )
    return "\n".join(lines)


def vllm_headline() -> str:
    """The README's line of the same figures: each method's decode tokens/s as a multiple of vLLM's own."""
    rows = vllm_rows()
    methods = [m for m in dict.fromkeys(row["method"] for row in rows) if m not in ("vllm", "ceiling")]
    cells = sorted({(row["length"], row["batch"]) for row in rows})
    lines = [
        "| decode tokens/s vs vLLM's own, wall clock | " + " | ".join(f"{b} x {n}" for n, b in cells) + " |",
        "|---|" + "---|" * len(cells),
    ]
    for method in methods + ["ceiling"]:
        by_cell = {(row["length"], row["batch"]): row for row in rows if row["method"] == method}
        name = "ceiling: vLLM's own at K" if method == "ceiling" else f"`{method}`"
        ratios = " | ".join(f"{by_cell[cell]['tokens_per_s_vs_vllm']:.2f}x" for cell in cells)
        lines.append(f"| {name} | {ratios} |")
    return "\n".join(lines)


BEST = ("baselines-best/smollm2-2k.jsonl",)


def baselines_best() -> str:
    """Each eviction baseline at its defaults (snapkv's selection) and at `preset: paper`, SmolLM2 at 2K, K = L/8."""
    rows = [
        Row("`full`", (pick("full", *BEST),)),
        Row("`snapkv` (span pooling, window 32)", (pick("snapkv", *BEST, preset=None),)),
        Row("`pyramidkv`, default (snapkv's selection)", (pick("pyramidkv", *BEST, preset=None),)),
        Row("`pyramidkv`, `--preset paper` (centred kernel)", (pick("pyramidkv", *BEST, preset="paper"),)),
        Row("`dynamickv`, default (snapkv's selection)", (pick("dynamickv", *BEST, preset=None),)),
        Row("`dynamickv`, `--preset paper` (window 16, centred)", (pick("dynamickv", *BEST, preset="paper"),)),
        Row("`h2o` (its paper's; no preset)", (pick("h2o", *BEST),)),
    ]
    columns = [
        Column("niah_multikey_1 without prefix: score", "ruler/niah_multikey_1", "score", "SmolLM2", 2048, "bare"),
        Column("KV MB held / read per step", "ruler/niah_multikey_1", "kv", "SmolLM2", 2048, "bare"),
    ]
    return table(rows, columns, "SmolLM2-135M, 2K, K = L/8")


def script_summary(name: str, rows: str):
    """The table that the script benchmarks/analysis/NAME.py prints of its committed rows (its `summary`)."""

    def draw() -> str:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.summary(RESULTS / rows)

    return draw


TABLES = {
    "headline": headline,
    "gemma-16k": gemma_16k,
    "defaults": defaults,
    "vllm-serving": vllm_serving,
    "vllm-headline": vllm_headline,
    "lm-eval-agreement": script_summary("lm_eval_agreement", "lm-eval-agreement/smollm2.jsonl"),
    "lm-eval-choice": script_summary("lm_eval_choice", "lm-eval-choice/smollm2.jsonl"),
    "baselines-best": baselines_best,
    "new-methods": new_methods,
    "new-methods-windows": new_methods_windows,
    "long-output": script_summary("long_output", "long-output/smollm2-forced.jsonl"),
    "long-output-free": script_summary("long_output", "long-output/smollm2-free.jsonl"),
}
DOCS = [ROOT / "README.md", ROOT / "docs" / "results.md", ROOT / "docs" / "serving.md", ROOT / "docs" / "evaluation.md"]
MARKED = re.compile(r"(<!-- table: ([\w-]+) -->\n)(.*?)(<!-- /table -->)", re.DOTALL)


def redraw(text: str, drawn: dict[str, str]) -> str:
    def fill(match: re.Match) -> str:
        name = match.group(2)
        if name not in TABLES:
            raise ValueError(f"unknown table '{name}'; known: {', '.join(TABLES)}")
        if name not in drawn:
            drawn[name] = TABLES[name]()
        return f"{match.group(1)}{drawn[name]}\n{match.group(4)}"

    return MARKED.sub(fill, text)


def stale(paths=DOCS) -> list[Path]:
    """The files whose tables differ from what the rows draw."""
    drawn: dict[str, str] = {}
    return [path for path in paths if redraw(path.read_text(encoding="utf-8"), drawn) != path.read_text()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 where a table differs")
    args = parser.parse_args(argv)
    if args.check:
        differ = stale()
        for name in differ:
            print(f"{name.relative_to(ROOT)}: its tables differ from the rows; run benchmarks/analysis/docs_tables.py")
        return 1 if differ else 0
    drawn: dict[str, str] = {}
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        new = redraw(text, drawn)
        if new != text:
            path.write_text(new, encoding="utf-8")
            print(f"rewrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
