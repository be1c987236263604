"""PNG plots of a report (matplotlib, Agg backend); each plot is written only when its data exists."""

from __future__ import annotations

import math
from pathlib import Path

from ..runtime.output_files import save_figure
from .summary import Group, mean, method_summaries


def check_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        raise ValueError(
            "plots need the optional package matplotlib: pip install 'refreshkv[eval]' (or --no-plots)"
        ) from None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    try:
        save_figure(fig, path, "report file", dpi=120)
    finally:
        _pyplot().close(fig)
    return path


def score_vs_decode(groups: list[Group], path: Path) -> Path | None:
    """One panel per (task, length): mean score against mean decode ms/token, one point per method."""
    panels: dict[tuple, list[Group]] = {}
    for g in groups:
        if g.task != "recovery":
            panels.setdefault((g.task, g.length), []).append(g)
    if not panels:
        return None
    plt = _pyplot()
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 4 * rows), squeeze=False)
    for ax, ((task, length), members) in zip(axes.flat, panels.items()):
        for g in members:
            s = g.summary()
            ax.scatter(s["decode_ms"], s["score"], s=50, marker="*" if g.is_reference else "o", label=g.label)
            ax.annotate(g.label, (s["decode_ms"], s["score"]), fontsize=7, xytext=(4, 4), textcoords="offset points")
        ax.set_title(f"{task}, L={length}")
        ax.set_xlabel("decode ms / token")
        ax.set_ylabel("perplexity (lower is better)" if task == "ppl" else "mean score")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle("Score vs decode time")
    return _save(fig, path)


def _error_bar(value: float, interval) -> tuple[float, float]:
    """Distances below and above the point; none for a missing or unbounded (a resample of full at 0) interval."""
    if interval is None or not all(map(math.isfinite, interval)):
        return 0.0, 0.0
    return max(0.0, value - interval[0]), max(0.0, interval[1] - value)


def score_vs_decode_summary(groups: list[Group], path: Path) -> Path | None:
    """One point per method over the generation tasks: macro score, and its ratio to full, against decode ms/token."""
    summaries = [s for s in method_summaries(groups) if s.kind == "generation"]
    points = [(s, row) for s in summaries for row in s.rows if None not in (row["score"], row["decode_ms"])]
    if not points:
        return None
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for s, row in points:
        name = row["method"] + (f" L={s.length}" if len(summaries) > 1 else "")
        for ax, key in ((left, "score"), (right, "vs_full")):
            if row[key] is None:
                continue
            low, high = _error_bar(row[key], row[f"{key}_ci"])
            ax.errorbar(
                row["decode_ms"],
                row[key],
                yerr=[[low], [high]],
                fmt="*" if row["method"] == "full" else "o",
                markersize=8,
                capsize=3,
            )
            ax.annotate(name, (row["decode_ms"], row[key]), fontsize=7, xytext=(4, 4), textcoords="offset points")
    right.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    left.set_ylabel("macro mean score (tasks weighted equally)")
    right.set_ylabel("score / score of full (same examples)")
    for ax in (left, right):
        ax.set_xlabel("decode ms / token (macro mean)")
        ax.grid(alpha=0.3)
    fig.suptitle("Per method over the generation tasks (bars: 95% bootstrap intervals)")
    return _save(fig, path)


def frontier(groups: list[Group], path: Path) -> Path | None:
    """Quality against the KV bytes read per decode step, one curve per method over the budgets it ran: its score
    relative to full (perplexity ratio for ppl) and its KL to full on full's answers, per (kind, length)."""
    summaries = [s for s in method_summaries(groups) if len({r["budget_share"] for r in s.rows} - {None}) > 1]
    if not summaries:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(len(summaries), 2, figsize=(12, 4.5 * len(summaries)), squeeze=False)
    for (left, right), s in zip(axes, summaries):
        curves: dict[str, list[dict]] = {}
        for row in s.rows:
            if row["kv_read_mb"] is not None:
                curves.setdefault(row["curve"], []).append(row)
        for method, rows in sorted(curves.items()):
            rows.sort(key=lambda r: r["kv_read_mb"])
            for ax, key in ((left, "vs_full"), (right, "kl_to_full")):
                points = [(r["kv_read_mb"], r[key]) for r in rows if r[key] is not None]
                if points and method == "full":  # on top, in black: the oracle reads as much and lands on it
                    ax.plot(*zip(*points), "*", label=method, markersize=14, color="black", zorder=5)
                elif points:
                    ax.plot(*zip(*points), "o-", label=method, markersize=7)
        left.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        left.set_ylabel("perplexity / full's" if s.kind == "ppl" else "score / full's score (same examples)")
        right.set_ylabel("KL(full || method) per answer token, nats")
        if not right.lines:  # perplexity rows score the text itself: there is no answer of full's to compare on
            right.axis("off")
            right.text(0.5, 0.5, f"no KL to full for {s.kind} rows", ha="center", va="center", color="grey")
        for ax in (left, right):
            ax.set_xlabel("KV MB read per decode step")
            ax.set_title(f"{s.kind}, L = {s.length}", fontsize=9)
            ax.grid(alpha=0.3)
        left.legend(fontsize=7)
    fig.suptitle("Budget frontiers: quality against what a decode step reads")
    return _save(fig, path)


def ppl_ratio(groups: list[Group], path: Path) -> Path | None:
    curves = [(g, g.ppl_ratio_by_position()) for g in groups if not g.is_reference]
    curves = [(g, c) for g, c in curves if c]
    if not curves:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for g, (starts, ratios) in curves:
        ax.plot(starts, ratios, marker="o", label=f"{g.label} L={g.length}")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("target token position (bin start)")
    ax.set_ylabel("perplexity / perplexity of full")
    ax.set_title("PPL ratio to full by position")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _per_layer(series, path: Path, ylabel: str, title: str) -> Path | None:
    """One line per (group, values-per-layer) pair."""
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for g, values in series:
        ax.plot(range(len(values)), values, marker="o", label=f"{g.task} L={g.length} {g.label}")
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def effective_stride(groups: list[Group], path: Path) -> Path | None:
    series = [(g, g.effective_stride()) for g in groups if not g.is_reference]
    series = [(g, s) for g, s in series if s and all(v is not None for v in s)]
    return _per_layer(series, path, "decode steps / full-attention steps", "Effective stride per layer")


def recovery(groups: list[Group], path: Path) -> Path | None:
    series = [(g, g.recovery()) for g in groups]
    series = [(g, r) for g, r in series if r]
    if not series:
        return None
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for g, r in series:
        offsets = range(len(r["topk"][0]))
        topk = [mean(layer[o] for layer in r["topk"]) for o in offsets]
        streaming = [mean(layer[o] for layer in r["streaming"]) for o in offsets]
        line = left.plot(offsets, topk, marker="o", label=f"top-K of step t (t={g.length}, K={r['k']})")[0]
        left.plot(
            offsets,
            streaming,
            marker="s",
            linestyle="--",
            color=line.get_color(),
            label=f"StreamingLLM cache (t={g.length}, K={r['k']})",
        )
        layers = r["layers"]
        right.plot(
            layers,
            [mean(layer[1:]) for layer in r["topk"]],
            marker="o",
            color=line.get_color(),
            label=f"top-K (t={g.length})",
        )
        right.plot(
            layers,
            [mean(layer[1:]) for layer in r["streaming"]],
            marker="s",
            linestyle="--",
            color=line.get_color(),
            label=f"StreamingLLM (t={g.length})",
        )
    left.set_xlabel("steps after the top-K step (i)")
    left.set_ylabel("attention mass recovered (mean over layers, heads)")
    left.set_title("Attention recovery at t + i")
    right.set_xlabel("layer")
    right.set_ylabel("recovered mass (mean over i = 1..S)")
    right.set_title("Recovery per layer")
    for ax in (left, right):
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    return _save(fig, path)


def budget_per_layer(groups: list[Group], path: Path) -> Path | None:
    series = [(g, g.budget_per_layer()) for g in groups if not g.is_reference]
    series = [(g, b) for g, b in series if b and (mean(r.get("budget_ratio") for r in g.rows) or 1) < 1]
    return _per_layer(series, path, "kept prompt tokens (mean over KV heads, examples)", "Budget per layer")


PLOTS = (
    ("score_vs_decode.png", score_vs_decode),
    ("score_vs_decode_summary.png", score_vs_decode_summary),
    ("ppl_ratio_by_position.png", ppl_ratio),
    ("frontier.png", frontier),
    ("effective_stride.png", effective_stride),
    ("recovery.png", recovery),
    ("budget_per_layer.png", budget_per_layer),
)


def write_plots(groups: list[Group], out_dir: Path) -> list[Path]:
    written = []
    for name, plot in PLOTS:
        path = plot(groups, out_dir / name)
        if path is not None:
            written.append(path)
    return written
