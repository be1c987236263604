"""`refreshkv report`: summary tables (terminal and Markdown) of evaluation JSONL files.

Rows are grouped by (model, task, task options, length, method with its parameters). A row is compared with the
`full` row (no parameters) of the same example: same model, task, options, length, seed, chat, dtype and example
id. Over the examples a group shares with `full`:

- `vs full`: mean score / mean score of `full` (for ppl the perplexity ratio, lower is better);
- `speed-up`: mean decode ms/token of `full` / the group's;
- `KV vs full`: mean KV bytes held / `full`'s.

Per-layer figures: effective stride = decode steps / full-attention steps of the layer, summed over examples
(refreshkv.txt Fig. 4; undefined when a layer never attends fully); kept prompt tokens per layer (`budget_per_layer`,
refreekv.txt Table 2); ppl ratio by position (refreshkv.txt Fig. 3): per bin of target positions, the perplexity
of the group's losses over that of `full` on the same examples; recovery curves (recycled-attention.txt Fig. 2).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path

from .runner import canonical, read_results

ROW_FIELDS = ("run", "config", "id", "task", "method", "params", "length", "seed", "model", "score",
              "decode_ms_per_token", "kv_bytes_full")
NUMBER_FIELDS = ("length", "seed", "score", "decode_ms_per_token", "kv_bytes_full", "budget_ratio",
                 "full_step_fraction", "decode_steps")
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

    @property
    def method(self) -> str:
        return self.rows[0]["method"]

    @property
    def is_reference(self) -> bool:
        return is_reference(self.rows[0])

    def pairs(self):
        return [(row, ref) for row, ref in zip(self.rows, self.references) if ref is not None]

    def summary(self) -> dict:
        pairs = self.pairs()
        strides = self.effective_stride()
        return {
            "task": self.task,
            "length": self.length,
            "method": self.label,
            "n": len(self.rows),
            "score": mean(r["score"] for r in self.rows),
            "vs_full": ratio(mean(r["score"] for r, _ in pairs), mean(f["score"] for _, f in pairs)) if pairs else None,
            "decode_ms": mean(r["decode_ms_per_token"] for r in self.rows),
            "speedup": ratio(mean(f["decode_ms_per_token"] for _, f in pairs), mean(r["decode_ms_per_token"] for r, _ in pairs))
            if pairs else None,
            "kv_mb": mean(r["kv_bytes_full"] for r in self.rows) / 2**20,
            "kv_vs_full": ratio(mean(r["kv_bytes_full"] for r, _ in pairs), mean(f["kv_bytes_full"] for _, f in pairs))
            if pairs else None,
            "budget_ratio": mean(r.get("budget_ratio") for r in self.rows),
            "full_step_fraction": mean(r.get("full_step_fraction") for r in self.rows),
            "effective_stride": mean(strides) if strides and None not in strides else None,
        }

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


# ---- tables ----------------------------------------------------------------------------------------------------

COLUMNS = (
    ("task", "task", "{}"),
    ("L", "length", "{}"),
    ("method", "method", "{}"),
    ("n", "n", "{}"),
    ("score", "score", "{:.3f}"),
    ("vs full", "vs_full", "{:.3f}"),
    ("ms/tok", "decode_ms", "{:.2f}"),
    ("speed-up", "speedup", "{:.2f}x"),
    ("KV MB", "kv_mb", "{:.1f}"),
    ("KV vs full", "kv_vs_full", "{:.3f}"),
    ("kept", "budget_ratio", "{:.3f}"),
    ("full steps", "full_step_fraction", "{:.3f}"),
    ("eff. stride", "effective_stride", "{:.1f}"),
)


def cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def summary_rows(groups: list[Group]) -> list[dict]:
    return [group.summary() for group in groups]


def rich_tables(groups: list[Group]) -> list:
    """One rich Table per (model, task, task options, length), one row per method."""
    from rich.table import Table

    panels: dict[tuple, list[Group]] = {}
    for group in groups:
        panels.setdefault((group.model, group.task, group.options, group.length), []).append(group)
    many_models = len({g.model for g in groups}) > 1
    tables = []
    for (model, task, options, length), members in panels.items():
        title = f"{task} at {length} tokens" + (f" {options}" if options != "{}" else "")
        table = Table(title=title, caption=f"model: {model}" if many_models or len(tables) == len(panels) - 1 else None)
        for label, key, _ in COLUMNS[2:]:
            table.add_column(label, justify="left" if key == "method" else "right", no_wrap=key == "method")
        for summary in summary_rows(members):
            table.add_row(*(cell(summary[key], fmt) for _, key, fmt in COLUMNS[2:]))
        tables.append(table)
    return tables


def markdown_table(groups: list[Group]) -> str:
    lines = ["| " + " | ".join(label for label, _, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for summary in summary_rows(groups):
        lines.append("| " + " | ".join(cell(summary[key], fmt) for _, key, fmt in COLUMNS) + " |")
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
             f"Model: {', '.join(sorted({g.model for g in groups}))}", "", markdown_table(groups), ""]
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
