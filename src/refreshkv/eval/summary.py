"""The numbers behind a report: result rows grouped by configuration and compared with `full` on the same examples,
and per-method summaries over tasks (report.py renders them as tables, plots.py as figures; the rules are in
report.py's docstring)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

from ..core.policy import BUILT_IN, METHODS, BudgetPolicy, label_notes
from . import stats
from .results_file import canonical, read_results

ROW_FIELDS = (
    "run",
    "config",
    "id",
    "task",
    "method",
    "params",
    "length",
    "seed",
    "model",
    "score",
    "decode_ms_per_token",
    "kv_bytes_full",
)
NUMBER_FIELDS = (
    "length",
    "seed",
    "score",
    "decode_ms_per_token",
    "kv_bytes_full",
    "kv_bytes_attended_mean",
    "budget_ratio",
    "full_step_fraction",
    "decode_steps",
)
PPL_BINS = 16


def load_results(paths) -> list[dict]:
    """Rows of every file, checked; a row repeated across files (same config and id) counts once (the last)."""
    rows: dict[tuple, dict] = {}
    for path in paths:
        if Path(path).is_dir():
            raise ValueError(
                f"{path} is a directory; give the JSONL results file(s) in it, e.g. {Path(path) / '*.jsonl'}"
            )
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
    bad = [
        (row, name)
        for row in rows
        for name in NUMBER_FIELDS
        if isinstance(row.get(name), float) and not math.isfinite(row[name])
    ]
    if bad:
        row, name = bad[0]
        print(
            f"warning: {len(bad)} non-finite value(s) left out of the averages, e.g. {name}={row[name]} "
            f"of {method_label(row)} on {row['id']}",
            file=sys.stderr,
        )


def method_label(row: dict) -> str:
    """`method(param=value,...)`, with `label_notes`: `(ceiling)` for a quality reference that reads the whole cache
    (oracle), `(from PACKAGE)` for rows of a method another package provided (its own group: another method)."""
    params = ",".join(f"{k}={v}" for k, v in sorted((row.get("params") or {}).items()))
    label = f"{row['method']}({params})" if params else row["method"]
    return label + label_notes(row["method"], row.get("provider", BUILT_IN))


def curve_label(row: dict) -> str:
    """The method's label without the parameters that set its budget (`Policy.budget_parameters`; budget and
    budget_ratio for a method not installed here): the rows of one budget curve share it, variants (another kernel)
    get curves of their own."""
    budget = METHODS.get(row["method"], BudgetPolicy).budget_parameters
    others = {k: v for k, v in (row.get("params") or {}).items() if k not in budget}
    return method_label({**row, "params": others})


def is_reference(row: dict) -> bool:
    return row["method"] == "full" and not row.get("params")


def example_key(row: dict) -> str:
    return canonical(
        [
            row["model"],
            row["task"],
            row.get("task_options") or {},
            row["length"],
            row["seed"],
            row.get("chat"),
            row.get("dtype"),
            row["id"],
        ]
    )


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
            self._summary = {
                "task": self.task,
                "length": self.length,
                "method": self.label,
                "n": len(self.rows),
                **aggregate([self]),
                "effective_stride": mean(strides) if strides and None not in strides else None,
            }
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
        pairs = [
            (r["losses"], f["losses"])
            for r, f in self.pairs()
            if r.get("losses") and f.get("losses") and len(r["losses"]) == len(f["losses"])
        ]
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
            return [
                [sum(res[kind][layer][o] for res in results) / len(results) for o in range(offsets)]
                for layer in range(layers)
            ]

        return {
            "k": results[0]["k"],
            "sinks": results[0]["sinks"],
            "layers": results[0].get("layers", list(range(len(results[0]["topk"])))),  # rows before it was recorded
            "topk": average("topk"),
            "streaming": average("streaming"),
        }


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
    # fidelity to full on full's own answer (runtime/fidelity.py): already paired, example by example
    kl = stats.macro_mean([[r.get("kl_to_full") for r in g.rows] for g in members])
    agreement = stats.macro_mean([[r.get("top1_agreement") for r in g.rows] for g in members])
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
        "kl_to_full": kl.value,
        "kl_to_full_ci": None if reference else kl.interval,
        "top1_agreement": agreement.value,
        "top1_agreement_ci": None if reference else agreement.interval,
    }


def group_rows(rows: list[dict]) -> list[Group]:
    references = {example_key(r): r for r in rows if is_reference(r)}
    groups: dict[tuple, Group] = {}
    for row in rows:
        task = row["task"] + (f" turn {row['turn']}" if "turn" in row else "")  # a conversation: each turn apart
        key = (row["model"], task, canonical(row.get("task_options") or {}), row["length"], method_label(row))
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


def turn_summary(rows: list[dict]) -> list[dict]:
    """Per conversation task, length and method: the mean score of turn 1 and of turns 2..N over the same
    conversations, and the later turns' score relative to turn 1's, each with a bootstrap interval over
    conversations (paired: a conversation's turn 1 and its later turns are resampled together)."""
    table: dict[tuple, dict[str, dict[int, float]]] = {}
    for row in rows:
        if "turn" in row and row.get("score") is not None:
            key = (row["task"], row["length"], method_label(row))
            table.setdefault(key, {}).setdefault(row["conversation"], {})[row["turn"]] = row["score"]
    summary = []
    for (task, length, label), conversations in sorted(table.items()):
        pairs = [
            (mean([s for turn, s in turns.items() if turn > 1]), turns[1])
            for turns in conversations.values()
            if 1 in turns and len(turns) > 1
        ]
        estimates = {
            "turn_1": stats.macro_mean([[first for _, first in pairs]]),
            "later_turns": stats.macro_mean([[later for later, _ in pairs]]),
            "later_vs_turn_1": stats.macro_ratio([pairs]),
        }
        summary.append(
            {"task": task, "length": length, "method": label, "conversations": len(pairs)}
            | {key: estimate.value for key, estimate in estimates.items()}
            | {f"{key}_ci": estimate.interval for key, estimate in estimates.items()}
        )
    return summary


def budget_share(row: dict, kept: float | None) -> float | None:
    """K / L of a method from one of its rows: its `budget_ratio` parameter, or its `budget` over its length; for a
    method without a budget (refreekv) `kept`, the mean share of prompt tokens it kept; None for full."""
    params = row.get("params") or {}
    if "budget_ratio" in params:
        return params["budget_ratio"]
    if "budget" in params:
        return params["budget"] / row["length"]
    return None if is_reference(row) else kept


FRONTIER_TARGET = 0.95  # of full's score (a perplexity within 1 / 0.95 of full's)


def budget_frontier(summary: MethodSummary) -> list[dict]:
    """Per method of one (model, kind, length): the smallest K / L at which it keeps 95% of full's score."""
    by_method: dict[str, list[dict]] = {}
    for row in summary.rows:
        if row["budget_share"] is not None and row["vs_full"] is not None:
            by_method.setdefault(row["curve"], []).append(row)
    frontier = []
    for method, rows in sorted(by_method.items()):
        rows.sort(key=lambda r: r["budget_share"])
        reached = [
            r
            for r in rows
            if (r["vs_full"] <= 1 / FRONTIER_TARGET if summary.kind == "ppl" else r["vs_full"] >= FRONTIER_TARGET)
        ]
        largest = rows[-1]["budget_share"]
        frontier.append(
            {
                "method": method,
                "shares": [r["budget_share"] for r in rows],
                "smallest": reached[0]["budget_share"] if reached else None,
                "text": f"L/{1 / reached[0]['budget_share']:.3g}" if reached else f"not within L/{1 / largest:.3g}",
            }
        )
    return frontier


def summary_row(kind: str, length: int, label: str, members: list[Group], first: Group) -> dict:
    """One method's row of a `MethodSummary`: its figures over `members` (one group per shared task, maybe none) and
    its K / L from `first` (any of its groups), which for a method without a budget (refreekv) is the mean share it
    kept."""
    figures = aggregate(members)
    return {
        "tasks": kind,
        "length": length,
        "method": label,
        "n_tasks": len(members),
        "n": sum(len(g.rows) for g in members),
        "base": first.method,
        "curve": curve_label(first.rows[0]),
        "budget_share": budget_share(first.rows[0], figures["budget_ratio"]),
        **figures,
    }


def oracle_gaps(summary: MethodSummary) -> list[dict]:
    """Per method and K / L (budgeted methods of one summary), its `vs full` and fidelity beside the oracle's at the
    same K / L: `gap` = the method's `vs full` minus the oracle's (None where the oracle did not run that K), so
    how far each selection sits below the best that attends to K tokens. Ordered by K / L, then method."""
    rows = [r for r in summary.rows if r["budget_share"] is not None and r["vs_full"] is not None]

    def share(row):  # K / L as a key: equal budgets given as a ratio and in tokens may differ in the last bits
        return round(row["budget_share"], 6)

    oracle = {share(r): r["vs_full"] for r in rows if r["base"] == "oracle"}
    return [
        {**r, "gap": None if r["base"] == "oracle" or share(r) not in oracle else r["vs_full"] - oracle[share(r)]}
        for r in sorted(rows, key=lambda r: (r["budget_share"], r["base"] != "oracle", r["method"]))
    ]


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
        rows = [
            summary_row(
                kind,
                length,
                label,
                [by_method[label][t] for t in sorted(shared)],
                next(iter(by_method[label].values())),
            )
            for label in sorted(by_method, key=lambda label: (label != "full", label))
        ]
        summaries.append(MethodSummary(model, kind, length, sorted(shared), sorted(left_out), rows))
    return summaries
