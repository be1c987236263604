"""`refreshkv report`: summary tables (terminal and Markdown) of evaluation JSONL files.

Rows are grouped by (model, task, task options, length, method with its parameters). A row is compared with the
`full` row (no parameters) of the same example: same model, task, options, length, seed, chat, dtype and example
id. Over the examples a group shares with `full`:

- `vs full`: mean score / mean score of `full` (for ppl the perplexity ratio, lower is better), over the pairs where
  both scores are finite;
- `speed-up`: mean decode ms/token of `full` / the group's;
- `KV vs full`: mean KV bytes held / `full`'s.

Intervals (`stats.py`): the score and `vs full` carry a 95% percentile bootstrap interval, 1000 resamples with seed 0
(the same report every time); `vs full` resamples the examples shared with `full` as pairs, so both sides are drawn
on the same examples. `≈` marks a method whose `vs full` interval contains 1: its difference from `full` is within
bootstrap noise. A group with one example has no interval; a zero mean of `full` gives no ratio.

Per-method summary (first in the terminal and summary.md): per (model, length), one row per method over the
generation tasks (all but `ppl` and `recovery`) and one over the `ppl` tasks. Rule: only the tasks (task and options)
that every method of that (model, length) has rows for enter, so every row averages the same tasks (the others are
named under the table). Figures are macro means: the mean over tasks of each task's mean, every task weighted
equally, as RULER averages its 13 tasks; `vs full` is the macro mean of the method over the macro mean of `full` on
the examples each task shares with `full`, with a stratified bootstrap (examples resampled within each task).

Per-layer figures: effective stride = decode steps / full-attention steps of the layer, summed over examples
(refreshkv.txt Fig. 4; undefined when a layer never attends fully); kept prompt tokens per layer (`budget_per_layer`,
refreekv.txt Table 2); ppl ratio by position (refreshkv.txt Fig. 3): per bin of target positions, the perplexity
of the group's losses over that of `full` on the same examples; recovery curves (recycled-attention.txt Fig. 2).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..runtime.markdown import md_row, md_text
from ..runtime.output_files import refuse_not_a_file, write_text
from . import stats
from .summary import (
    FRONTIER_TARGET,
    Group,
    budget_frontier,
    group_rows,
    load_results,
    mean,
    method_summaries,
    oracle_gaps,
    shown_options,
    turn_summary,
)

# ---- tables ----------------------------------------------------------------------------------------------------

WITHIN_NOISE = "≈"
LEGEND = (
    f"[low, high]: 95% percentile bootstrap interval ({stats.RESAMPLES} resamples, seed {stats.SEED}); "
    f"`vs full` resamples the examples shared with full as pairs. {WITHIN_NOISE}: the `vs full` interval "
    "contains 1, the difference from full is within noise."
)
METRICS = (
    ("score", "score", "{:.3f}"),
    ("vs full", "vs_full", "{:.3f}"),
    ("ms/tok", "decode_ms", "{:.2f}"),
    ("speed-up", "speedup", "{:.2f}x"),
    ("KV held MB", "kv_mb", "{:.1f}"),
    ("KV read MB/step", "kv_read_mb", "{:.1f}"),
    ("KV vs full", "kv_vs_full", "{:.3f}"),
    ("kept", "budget_ratio", "{:.3f}"),
    ("full steps", "full_step_fraction", "{:.3f}"),
    ("KL to full", "kl_to_full", "{:.4f}"),  # nats per answer token, on full's answer
    ("top-1 vs full", "top1_agreement", "{:.3f}"),
)
METRIC = {key: (label, key, fmt) for label, key, fmt in METRICS}
# what names or counts a row, shown as it is
LABELS = {"task": "task", "tasks": "tasks", "length": "L", "method": "method", "n_tasks": "# tasks", "n": "n"}
FIELD = {key: (label, key, "{}") for key, label in LABELS.items()}
GAP_COLUMNS = (
    ("K / L", "budget_share", "{:.4g}"),
    FIELD["method"],
    FIELD["n"],
    METRIC["vs_full"],
    ("gap to oracle", "gap", "{:+.3f}"),
    METRIC["kl_to_full"],
    METRIC["top1_agreement"],
)
COLUMNS = (
    *(FIELD[key] for key in ("task", "length", "method", "n")),
    *METRICS,
    ("eff. stride", "effective_stride", "{:.1f}"),
)
SUMMARY_COLUMNS = (*(FIELD[key] for key in ("tasks", "length", "method", "n_tasks", "n")), *METRICS)


def cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def render(summary: dict, key: str, fmt: str) -> str:
    """A figure with its interval, e.g. `0.812 [0.700, 0.910]`, and the within-noise mark where it has them."""
    text = cell(summary[key], fmt)
    if summary[key] is not None and summary.get(f"{key}_ci"):
        text += " [" + ", ".join(fmt.format(v) for v in summary[f"{key}_ci"]) + "]"
    return text + (f" {WITHIN_NOISE}" if summary.get(f"{key}_within_noise") else "")


def summary_rows(groups: list[Group]) -> list[dict]:
    return [group.summary() for group in groups]


def _rich_table(title: str, columns, rows: list[dict], caption: str | None):
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(title), caption=Text(caption) if caption else None)  # Text: "[...]" is not markup
    for label, key, _ in columns:
        table.add_column(label, justify="left" if key == "method" else "right", no_wrap=key == "method")
    for row in rows:
        table.add_row(*(Text(render(row, key, fmt)) for _, key, fmt in columns))
    return table


def rich_tables(groups: list[Group]) -> list:
    """The per-method summaries, then one rich Table per (model, task, task options, length), one row per method."""
    many_models = len({g.model for g in groups}) > 1
    summaries = method_summaries(groups)
    tables = [
        _rich_table(
            s.title + (f", model {s.model}" if many_models else ""),
            SUMMARY_COLUMNS[2:],
            s.rows,
            s.note + ("\n" + LEGEND if i == len(summaries) - 1 else ""),
        )
        for i, s in enumerate(summaries)
    ]
    panels: dict[tuple, list[Group]] = {}
    for group in groups:
        panels.setdefault((group.model, group.task, group.options, group.length), []).append(group)
    for i, ((model, task, options, length), members) in enumerate(panels.items()):
        title = f"{task} at {length} tokens" + (f" {shown_options(options)}" if options != "{}" else "")
        last = i == len(panels) - 1
        caption = "\n".join(([LEGEND] if last else []) + ([f"model: {model}"] if many_models or last else []))
        tables.append(_rich_table(title, COLUMNS[2:], summary_rows(members), caption or None))
    return tables


def markdown_table(groups: list[Group]) -> str:
    return _markdown(summary_rows(groups), COLUMNS)


def _markdown(rows: list[dict], columns) -> str:
    lines = [md_row(label for label, _, _ in columns), "|" + "---|" * len(columns)]
    lines += [md_row(render(row, key, fmt) for _, key, fmt in columns) for row in rows]
    return "\n".join(lines)


def score_by_task(groups: list[Group]) -> str:
    """The per-task scores at a glance: a row per task and length, a column per method (`full` first); n is the
    number of examples of the task's first method."""
    labels = list(dict.fromkeys(g.label for g in sorted(groups, key=lambda g: not g.is_reference)))
    cells = {(g.task, g.options, g.length, g.label): g.summary() for g in groups}
    tasks = list(dict.fromkeys((g.task, g.options, g.length) for g in groups))
    lines = [md_row(["task", "L", "n", *labels]), "|---|---|---|" + "---|" * len(labels)]
    for task, options, length in tasks:
        found = [cells.get((task, options, length, label)) for label in labels]
        n = next(summary["n"] for summary in found if summary)
        scores = [cell(summary["score"], "{:.3f}") if summary else "" for summary in found]
        lines.append(md_row([task, length, n, *scores]))
    return "\n".join(lines)


def _per_layer_table(title: str, series: dict[str, list], fmt: str) -> list[str]:
    width = max(len(v) for v in series.values())
    lines = [
        f"### {title}",
        "",
        md_row(["method", *(f"L{i}" for i in range(width))]),
        "|---|" + "---|" * width,
    ]
    for name, values in series.items():
        lines.append(md_row([name, *(cell(v, fmt) for v in values)]))
    return lines + [""]


def measured_layers(recovery: dict) -> str:
    """Which layers a recovery mean is over: all of them, or the ones that attend to the whole context (Gemma 3)."""
    layers = recovery["layers"]
    if layers == list(range(len(layers))):
        return "layers"
    return "layers " + ", ".join(map(str, layers)) + " (the others are windowed)"


def markdown_summary(groups: list[Group], sources, plots: list[Path]) -> str:
    lines = [
        "# Evaluation report",
        "",
        "Sources: " + ", ".join(md_text(s) for s in sources),
        "",
        f"Model: {md_text(', '.join(sorted({g.model for g in groups})))}",
        "",
    ]
    summaries = method_summaries(groups)
    if summaries:
        lines += [
            "## Per method across tasks",
            "",
            _markdown([r for s in summaries for r in s.rows], SUMMARY_COLUMNS),
            "",
            *(f"- {md_text(s.note)}" for s in summaries),
            "",
            LEGEND,
            "",
        ]
    frontiers = [(s, budget_frontier(s)) for s in summaries]
    frontiers = [(s, f) for s, f in frontiers if any(len(row["shares"]) > 1 for row in f)]
    for s, frontier in frontiers:
        lines += [
            f"## Budget frontier: {md_text(s.kind)} at {s.length} tokens",
            "",
            f"The smallest K (as a share of L) at which each method keeps {FRONTIER_TARGET:.0%} of full's score"
            + (" (a perplexity within 1/0.95 of full's)" if s.kind == "ppl" else "")
            + ", over the budgets run.",
            "",
            "| method | K / L run | smallest K at 95% of full |",
            "|---|---|---|",
            *(md_row([row["method"], ", ".join(f"{x:.4g}" for x in row["shares"]), row["text"]]) for row in frontier),
            "",
            "Each budget beside the oracle (the exact top-K of the current query at every step, the best any method "
            "that attends to K tokens can do), on the same examples: `gap` = the method's `vs full` minus the "
            "oracle's at that K / L.",
            "",
            _markdown(oracle_gaps(s), GAP_COLUMNS),
            "",
        ]
    turns = turn_summary([row for g in groups for row in g.rows])
    if turns:
        lines += [
            "## Conversations: turn 1 against the later turns",
            "",
            "| task | L | method | conversations | turn 1 | turns 2..N | later / turn 1 |",
            "|---|---|---|---|---|---|---|",
            *(
                md_row(
                    [r["task"], r["length"], r["method"], r["conversations"]]
                    + [render(r, key, "{:.2f}") for key in ("turn_1", "later_turns", "later_vs_turn_1")]
                )
                for r in turns
            ),
            "",
        ]
    lines += ["## Score by task", "", score_by_task(groups), ""]
    lines += ["## Per task", "", markdown_table(groups), "", LEGEND, ""]
    strides = {f"{g.task} L={g.length} {g.label}": g.effective_stride() for g in groups if not g.is_reference}
    strides = {k: v for k, v in strides.items() if v and all(s is not None for s in v)}
    if strides:
        lines += _per_layer_table("Effective stride per layer (decode steps / full steps)", strides, "{:.1f}")
    budgets = {
        f"{g.task} L={g.length} {g.label}": g.budget_per_layer()
        for g in groups
        if g.budget_per_layer() and (mean(r.get("budget_ratio") for r in g.rows) or 1) < 1
    }
    if budgets:
        lines += _per_layer_table("Kept prompt tokens per layer", budgets, "{:.0f}")
    for g in groups:
        curve = g.ppl_ratio_by_position()
        if curve and not g.is_reference:
            lines += [
                f"### PPL ratio to full by position: L={g.length} {md_text(g.label)}",
                "",
                "| positions from | " + " | ".join(map(str, curve[0])) + " |",
                "|---|" + "---|" * len(curve[0]),
                "| ratio | " + " | ".join(f"{v:.3f}" for v in curve[1]) + " |",
                "",
            ]
        recovery = g.recovery()
        if recovery:
            offsets = len(recovery["topk"][0])
            topk = [mean(layer[o] for layer in recovery["topk"]) for o in range(offsets)]
            streaming = [mean(layer[o] for layer in recovery["streaming"]) for o in range(offsets)]
            lines += [
                f"### Attention recovery, mean over {measured_layers(recovery)}: t={g.length}, K={recovery['k']}",
                "",
                "| offset i | " + " | ".join(map(str, range(offsets))) + " |",
                "|---|" + "---|" * offsets,
                "| top-K of step t | " + " | ".join(f"{v:.3f}" for v in topk) + " |",
                md_row([f"StreamingLLM ({recovery['sinks']} sinks + recent)", *(f"{v:.3f}" for v in streaming)]),
                "",
            ]
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    return "\n".join(lines)


def default_out_dir(first: str | os.PathLike) -> Path:
    path = Path(first)
    return path.with_name(path.stem + "-report")


def write_report(paths, out_dir: str | os.PathLike | None = None, plots: bool = True):
    """Load the rows, write PNGs and summary.md into `out_dir`; returns (groups, out_dir, written files). Each file
    replaces its old one whole; a symbolic link in their place is refused before any is written
    (runtime/output_files.py)."""
    groups = group_rows(load_results(paths))
    out_dir = Path(out_dir) if out_dir is not None else default_out_dir(paths[0])
    if plots:
        from .plots import check_matplotlib

        check_matplotlib()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # e.g. an existing file of that name
        raise ValueError(
            f"cannot make the report folder {out_dir} ({error.strerror}); give another --out-dir"
        ) from None
    from .plots import PLOTS, write_plots

    summary = out_dir / "summary.md"
    for name in ["summary.md", *(name for name, _ in PLOTS if plots)]:  # a link refused before anything is written
        refuse_not_a_file(out_dir / name, "report file")
    written = write_plots(groups, out_dir) if plots else []
    write_text(summary, markdown_summary(groups, [str(p) for p in paths], written), "report file")
    return groups, out_dir, written + [summary]
