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

import dataclasses
import json
import math
import os
import sys
from pathlib import Path

from . import stats
from .runner import canonical, read_results

ROW_FIELDS = ("run", "config", "id", "task", "method", "params", "length", "seed", "model", "score",
              "decode_ms_per_token", "kv_bytes_full")
NUMBER_FIELDS = ("length", "seed", "score", "decode_ms_per_token", "kv_bytes_full", "kv_bytes_attended_mean",
                 "budget_ratio", "full_step_fraction", "decode_steps")
PPL_BINS = 16


def load_results(paths) -> list[dict]:
    """Rows of every file, checked; a row repeated across files (same config and id) counts once (the last)."""
    rows: dict[tuple, dict] = {}
    for path in paths:
        if not Path(path).is_file():
            raise ValueError(f"results file {path} does not exist")
        for row in read_results(path, required=ROW_FIELDS, numbers=NUMBER_FIELDS)[0]:
            rows[(row["config"], row["id"])] = row
    if not rows:
        raise ValueError(f"no result rows in {', '.join(map(str, paths))}")
    warn_non_finite(rows.values())
    return list(rows.values())


def warn_non_finite(rows) -> None:
    """One line on the NaN / infinite figures (e.g. a diverged perplexity) that `mean` leaves out."""
    bad = [(row, name) for row in rows for name in NUMBER_FIELDS
           if isinstance(row.get(name), float) and not math.isfinite(row[name])]
    if bad:
        row, name = bad[0]
        print(f"warning: {len(bad)} non-finite value(s) left out of the averages, e.g. {name}={row[name]} "
              f"of {method_label(row)} on {row['id']}", file=sys.stderr)


def method_label(row: dict) -> str:
    params = ",".join(f"{k}={v}" for k, v in sorted((row.get("params") or {}).items()))
    return f"{row['method']}({params})" if params else row["method"]


def is_reference(row: dict) -> bool:
    return row["method"] == "full" and not row.get("params")


def example_key(row: dict) -> str:
    return canonical([row["model"], row["task"], row.get("task_options") or {}, row["length"], row["seed"],
                      row.get("chat"), row.get("dtype"), row["id"]])


def mean(values):
    values = [v for v in values if v is not None and math.isfinite(v)]  # load_results warns about the non-finite
    return sum(values) / len(values) if values else None


def ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


@dataclasses.dataclass
class Group:
    model: str
    task: str
    options: str
    length: int
    label: str
    rows: list[dict]
    references: list[dict | None]  # the matching full row of each row, or None
    _summary: dict | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def method(self) -> str:
        return self.rows[0]["method"]

    @property
    def is_reference(self) -> bool:
        return is_reference(self.rows[0])

    def pairs(self):
        return [(row, ref) for row, ref in zip(self.rows, self.references) if ref is not None]

    def summary(self) -> dict:
        if self._summary is None:  # kept: the tables, summary.md and the plots each ask, and bootstraps take time
            strides = self.effective_stride()
            self._summary = {"task": self.task, "length": self.length, "method": self.label, "n": len(self.rows),
                             **aggregate([self]),
                             "effective_stride": mean(strides) if strides and None not in strides else None}
        return self._summary

    def effective_stride(self) -> list[float | None] | None:
        rows = [r for r in self.rows if r.get("full_steps_per_layer") and r.get("decode_steps")]
        if not rows:
            return None
        steps = sum(r["decode_steps"] for r in rows)
        layers = len(rows[0]["full_steps_per_layer"])
        fulls = [sum(r["full_steps_per_layer"][i] for r in rows) for i in range(layers)]
        return [steps / f if f > 0 else None for f in fulls]

    def budget_per_layer(self) -> list[float] | None:
        rows = [r["budget_per_layer"] for r in self.rows if r.get("budget_per_layer")]
        if not rows:
            return None
        return [sum(r[i] for r in rows) / len(rows) for i in range(len(rows[0]))]

    def ppl_ratio_by_position(self) -> tuple[list[int], list[float]] | None:
        """(first position of each bin, perplexity ratio to full) over the examples shared with full."""
        pairs = [(r["losses"], f["losses"]) for r, f in self.pairs()
                 if r.get("losses") and f.get("losses") and len(r["losses"]) == len(f["losses"])]
        if not pairs or self.task != "ppl":
            return None
        count = min(len(p[0]) for p in pairs)
        width = max(1, math.ceil(count / PPL_BINS))
        starts, ratios = [], []
        for start in range(0, count, width):
            mine = mean(v for losses, _ in pairs for v in losses[start : start + width])
            full = mean(v for _, losses in pairs for v in losses[start : start + width])
            starts.append(start)
            ratios.append(math.exp(mine - full))
        return starts, ratios

    def recovery(self) -> dict | None:
        results = [r["recovery"] for r in self.rows if r.get("recovery")]
        if not results:
            return None

        def average(kind):
            layers, offsets = len(results[0][kind]), len(results[0][kind][0])
            return [[sum(res[kind][l][o] for res in results) / len(results) for o in range(offsets)] for l in range(layers)]

        return {"k": results[0]["k"], "sinks": results[0]["sinks"], "topk": average("topk"),
                "streaming": average("streaming")}


def macro(per_task) -> float | None:
    """Mean over tasks of each task's mean: every task weighted equally, whatever its number of examples."""
    return mean(mean(values) for values in per_task)


def mb(value):
    return None if value is None else value / 2**20


def aggregate(members: list[Group]) -> dict:
    """The figures of one method over the groups of one or more tasks (macro means; see the module docstring)."""
    pairs = [g.pairs() for g in members]

    def mine(field):  # the method's values per task
        return macro([r.get(field) for r in g.rows] for g in members)

    def paired(field):  # (method, full) on the examples shared with full
        return macro([r.get(field) for r, _ in p] for p in pairs), macro([f.get(field) for _, f in p] for p in pairs)

    score = stats.macro_mean([[r["score"] for r in g.rows] for g in members])
    vs_full = stats.macro_ratio([[(r["score"], f["score"]) for r, f in p] for p in pairs])
    reference = any(g.is_reference for g in members)  # full against itself: 1 by construction, no interval to show
    return {
        "score": score.value,
        "score_ci": score.interval,
        "vs_full": vs_full.value,
        "vs_full_ci": None if reference else vs_full.interval,
        "vs_full_within_noise": vs_full.contains_one and not reference,
        "decode_ms": mine("decode_ms_per_token"),
        "speedup": ratio(*reversed(paired("decode_ms_per_token"))),
        "kv_mb": mb(mine("kv_bytes_full")),
        "kv_read_mb": mb(mine("kv_bytes_attended_mean")),
        "kv_vs_full": ratio(*paired("kv_bytes_full")),
        "budget_ratio": mine("budget_ratio"),
        "full_step_fraction": mine("full_step_fraction"),
    }


def group_rows(rows: list[dict]) -> list[Group]:
    references = {example_key(r): r for r in rows if is_reference(r)}
    groups: dict[tuple, Group] = {}
    for row in rows:
        key = (row["model"], row["task"], canonical(row.get("task_options") or {}), row["length"], method_label(row))
        if key not in groups:
            groups[key] = Group(*key, rows=[], references=[])
        groups[key].rows.append(row)
        groups[key].references.append(references.get(example_key(row)))
    return sorted(groups.values(), key=lambda g: (g.model, g.task, g.options, g.length, not g.is_reference, g.label))


# ---- per-method summary ---------------------------------------------------------------------------------------


def task_kind(task: str) -> str | None:
    """Which per-method summary a task enters: recovery rows measure attention under full, with no score to compare."""
    return {"ppl": "ppl", "recovery": None}.get(task, "generation")


@dataclasses.dataclass
class MethodSummary:
    """The per-method rows of one (model, task kind, length): macro means over `tasks`, those every method ran."""

    model: str
    kind: str
    length: int
    tasks: list[str]
    left_out: list[str]
    rows: list[dict]

    @property
    def title(self) -> str:
        if self.kind == "ppl":
            return f"Per method: perplexity at {self.length} tokens (lower is better)"
        return f"Per method: generation tasks at {self.length} tokens, macro mean over {len(self.tasks)} task(s)"

    @property
    def note(self) -> str:
        left_out = f"; left out (not run by every method): {', '.join(self.left_out)}" if self.left_out else ""
        return f"{self.kind} at L={self.length}, tasks: {', '.join(self.tasks) or 'none'}{left_out}"


def shown_options(options: str) -> str:
    """Task options as a report shows them: files by name (rows pin their absolute paths and hashes)."""
    shown = json.loads(options)
    if "paths" in shown:
        paths = shown["paths"] if isinstance(shown["paths"], list) else [shown["paths"]]
        shown["paths"] = [Path(path).name for path in paths]
    shown.pop("sha256", None)
    return canonical(shown)


def method_summaries(groups: list[Group]) -> list[MethodSummary]:
    sets: dict[tuple, dict[str, dict[str, Group]]] = {}
    for g in groups:
        if task_kind(g.task):
            name = g.task + (f" {shown_options(g.options)}" if g.options != "{}" else "")
            sets.setdefault((g.model, task_kind(g.task), g.length), {}).setdefault(g.label, {})[name] = g
    summaries = []
    order = sorted(sets, key=lambda key: (key[0], key[1] != "generation", key[2]))  # generation tasks before ppl
    for (model, kind, length), by_method in ((key, sets[key]) for key in order):
        shared = set.intersection(*(set(tasks) for tasks in by_method.values()))
        left_out = set().union(*by_method.values()) - shared
        rows = [{"tasks": kind, "length": length, "method": label, "n_tasks": len(shared),
                 "n": sum(len(by_method[label][t].rows) for t in shared),
                 **aggregate([by_method[label][t] for t in sorted(shared)])}
                for label in sorted(by_method, key=lambda label: (label != "full", label))]
        summaries.append(MethodSummary(model, kind, length, sorted(shared), sorted(left_out), rows))
    return summaries


# ---- tables ----------------------------------------------------------------------------------------------------

WITHIN_NOISE = "≈"
LEGEND = (f"[low, high]: 95% percentile bootstrap interval ({stats.RESAMPLES} resamples, seed {stats.SEED}); "
          f"`vs full` resamples the examples shared with full as pairs. {WITHIN_NOISE}: the `vs full` interval "
          "contains 1, the difference from full is within noise.")
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
)
COLUMNS = (("task", "task", "{}"), ("L", "length", "{}"), ("method", "method", "{}"), ("n", "n", "{}"),
           *METRICS, ("eff. stride", "effective_stride", "{:.1f}"))
SUMMARY_COLUMNS = (("tasks", "tasks", "{}"), ("L", "length", "{}"), ("method", "method", "{}"),
                   ("# tasks", "n_tasks", "{}"), ("n", "n", "{}"), *METRICS)


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
    tables = [_rich_table(s.title + (f", model {s.model}" if many_models else ""), SUMMARY_COLUMNS[2:], s.rows,
                          s.note + ("\n" + LEGEND if i == len(summaries) - 1 else ""))
              for i, s in enumerate(summaries)]
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
    lines = ["| " + " | ".join(label for label, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(render(row, key, fmt) for _, key, fmt in columns) + " |" for row in rows]
    return "\n".join(lines)


def score_by_task(groups: list[Group]) -> str:
    """The per-task scores at a glance: a row per task and length, a column per method (`full` first); n is the
    number of examples of the task's first method."""
    labels = list(dict.fromkeys(g.label for g in sorted(groups, key=lambda g: not g.is_reference)))
    cells = {(g.task, g.options, g.length, g.label): g.summary() for g in groups}
    tasks = list(dict.fromkeys((g.task, g.options, g.length) for g in groups))
    lines = ["| task | L | n | " + " | ".join(labels) + " |", "|---|---|---|" + "---|" * len(labels)]
    for task, options, length in tasks:
        found = [cells.get((task, options, length, label)) for label in labels]
        n = next(summary["n"] for summary in found if summary)
        scores = [cell(summary["score"], "{:.3f}") if summary else "" for summary in found]
        lines.append(f"| {task} | {length} | {n} | " + " | ".join(scores) + " |")
    return "\n".join(lines)


def _per_layer_table(title: str, series: dict[str, list], fmt: str) -> list[str]:
    width = max(len(v) for v in series.values())
    lines = [f"### {title}", "", "| method | " + " | ".join(f"L{i}" for i in range(width)) + " |",
             "|---|" + "---|" * width]
    for name, values in series.items():
        lines.append(f"| {name} | " + " | ".join(cell(v, fmt) for v in values) + " |")
    return lines + [""]


def markdown_summary(groups: list[Group], sources, plots: list[Path]) -> str:
    lines = ["# Evaluation report", "", "Sources: " + ", ".join(f"`{s}`" for s in sources), "",
             f"Model: {', '.join(sorted({g.model for g in groups}))}", ""]
    summaries = method_summaries(groups)
    if summaries:
        lines += ["## Per method across tasks", "", _markdown([r for s in summaries for r in s.rows], SUMMARY_COLUMNS),
                  "", *(f"- {s.note}" for s in summaries), "", LEGEND, ""]
    lines += ["## Score by task", "", score_by_task(groups), ""]
    lines += ["## Per task", "", markdown_table(groups), "", LEGEND, ""]
    strides = {f"{g.task} L={g.length} {g.label}": g.effective_stride() for g in groups if not g.is_reference}
    strides = {k: v for k, v in strides.items() if v and all(s is not None for s in v)}
    if strides:
        lines += _per_layer_table("Effective stride per layer (decode steps / full steps)", strides, "{:.1f}")
    budgets = {f"{g.task} L={g.length} {g.label}": g.budget_per_layer() for g in groups
               if g.budget_per_layer() and (mean(r.get("budget_ratio") for r in g.rows) or 1) < 1}
    if budgets:
        lines += _per_layer_table("Kept prompt tokens per layer", budgets, "{:.0f}")
    for g in groups:
        curve = g.ppl_ratio_by_position()
        if curve and not g.is_reference:
            lines += [f"### PPL ratio to full by position: L={g.length} {g.label}", "",
                      "| positions from | " + " | ".join(map(str, curve[0])) + " |", "|---|" + "---|" * len(curve[0]),
                      "| ratio | " + " | ".join(f"{v:.3f}" for v in curve[1]) + " |", ""]
        recovery = g.recovery()
        if recovery:
            offsets = len(recovery["topk"][0])
            topk = [mean(layer[o] for layer in recovery["topk"]) for o in range(offsets)]
            streaming = [mean(layer[o] for layer in recovery["streaming"]) for o in range(offsets)]
            lines += [f"### Attention recovery, mean over layers: t={g.length}, K={recovery['k']}", "",
                      "| offset i | " + " | ".join(map(str, range(offsets))) + " |", "|---|" + "---|" * offsets,
                      "| top-K of step t | " + " | ".join(f"{v:.3f}" for v in topk) + " |",
                      f"| StreamingLLM ({recovery['sinks']} sinks + recent) | "
                      + " | ".join(f"{v:.3f}" for v in streaming) + " |", ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    return "\n".join(lines)


def default_out_dir(first: str | os.PathLike) -> Path:
    path = Path(first)
    return path.with_name(path.stem + "-report")


def write_report(paths, out_dir: str | os.PathLike | None = None, plots: bool = True):
    """Load the rows, write PNGs and summary.md into `out_dir`; returns (groups, out_dir, written files)."""
    groups = group_rows(load_results(paths))
    out_dir = Path(out_dir) if out_dir is not None else default_out_dir(paths[0])
    if plots:
        from .plots import check_matplotlib

        check_matplotlib()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # e.g. an existing file of that name
        raise ValueError(f"cannot make the report folder {out_dir} ({error.strerror}); give another --out-dir") from None
    written = []
    if plots:
        from .plots import write_plots

        written = write_plots(groups, out_dir)
    summary = out_dir / "summary.md"
    summary.write_text(markdown_summary(groups, [str(p) for p in paths], written), encoding="utf-8")
    return groups, out_dir, written + [summary]
