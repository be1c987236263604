"""Tables and a plot of `refreshkv bench` results."""

from __future__ import annotations

import functools
from pathlib import Path

from rich.table import Table

from ..runtime.markdown import md_row
from ..runtime.output_files import save_figure

SPEED = (
    ("method", "label", "{}"),
    ("prefill s", "prefill_s", "{:.2f}"),
    ("prefill tok/s", "prefill_tokens_per_s", "{:.0f}"),
    ("ms/tok", "decode_ms_per_token", "{:.1f}"),
    ("range", "decode_ms_spread", "{:.1f}"),
    ("median step", "decode_ms_median_step", "{:.1f}"),
    ("tok/s", "tokens_per_s", "{:.2f}"),
    ("vs full", "speedup_vs_full", "{:.2f}x"),
    ("full share", "full_step_fraction", "{:.3f}"),  # of layer-steps
)
STEPS = (  # full steps (most layers attended fully: refreshes, fixed-stride steps) against partial steps
    ("method", "label", "{}"),
    ("full steps", "full_steps", "{}"),
    ("full step ms", "full_step_ms", "{:.1f}"),
    ("full p90", "full_step_p90_ms", "{:.1f}"),
    ("vs full's step", "full_step_vs_full", "{:.2f}x"),
    ("partial steps", "partial_steps", "{}"),
    ("partial step ms", "partial_step_ms", "{:.1f}"),
    ("partial p90", "partial_step_p90_ms", "{:.1f}"),
)
MEMORY = (
    ("method", "label", "{}"),
    ("KV MB held", "kv_bytes_held", "mb"),
    ("held/full", "kv_held_vs_full", "{:.3f}"),
    ("KV MB read/step", "kv_bytes_attended", "mb"),
    ("peak RSS MB", "peak_process_bytes", "mb"),
    ("floor ms", "floor_ms", "{:.1f}"),
    ("measured/floor", "measured_over_floor", "{:.2f}"),
)
BATCH = (  # issue 48: rows decoded together; the floor reads the weights once and every row's KV
    ("method", "label", "{}"),
    ("batch", "batch", "{}"),
    ("prefill rows", "prefill_rows", "{}"),  # per prefill forward (fewer than the batch where all would not fit)
    ("tok/s", "tokens_per_s", "{:.1f}"),
    ("vs full", "speedup_vs_full", "{:.2f}x"),
    ("ms/step", "decode_ms_per_step", "{:.1f}"),
    ("floor ms/step", "floor_ms", "{:.1f}"),
    ("measured/floor", "measured_over_floor", "{:.2f}"),
    ("KV MB/row", "kv_bytes_held_per_row", "mb"),
    ("KV MB read/row", "kv_bytes_attended_per_row", "mb"),
    ("peak RSS MB", "peak_process_bytes", "mb"),
)
COLUMNS = SPEED + MEMORY[1:] + STEPS[1:]


def _cell(value, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "mb":
        return f"{value / 2**20:.1f}"
    return fmt.format(value)


def layout_note(layout: str | dict) -> str:
    """ "stored weight layout", "packed weight layout", or how many weight shapes `fastest` transposed
    (weight_layout.py)."""
    if isinstance(layout, dict) and "packed" in layout.values():
        return "packed weight layout"
    if isinstance(layout, dict):
        moved = sum(choice == "transposed" for choice in layout.values())
        return f"fastest weight layout ({moved} of {len(layout)} shapes transposed)"
    return f"{layout} weight layout"


def batched(result: dict) -> bool:
    """A run of several rows at once (`--batch` other than 1, or `--memory-cap`)."""
    return result.get("memory_cap_bytes") is not None or result.get("batches", [1]) != [1]


def table_groups(result: dict) -> list[tuple[str, list[dict]]]:
    """(title suffix, rows) per table: one per length, and per batch size where the run had several."""
    groups = []
    for length in sorted({row["length"] for row in result["rows"]}):
        rows = [row for row in result["rows"] if row["length"] == length]
        cap = result.get("memory_cap_bytes")
        if cap is not None:
            groups.append(
                (f"{length} tokens of context, each method at its largest batch under {cap / 2**30:g} GB", rows)
            )
        elif not batched(result):
            groups.append((f"{length} tokens of context", rows))
        else:
            for batch in sorted({row["batch"] for row in rows}):
                chosen = [row for row in rows if row["batch"] == batch]
                groups.append((f"{length} tokens of context, batch {batch}", chosen))
    return groups


def rows_note(result: dict, rows: list[dict]) -> str:
    """What the batches of a throughput table's `rows` are: distinct prompts, or copies of a few (`--distinct-rows`;
    a batch no larger holds only distinct ones)."""
    distinct = result.get("distinct_rows")
    if distinct is None or all(row["batch"] <= distinct for row in rows):
        return "every row a distinct prompt"
    return (
        f"{distinct} distinct prompts a batch, repeated to its rows after the prefill (each copy its own KV; "
        "refreshkv's copies decide their query checks alike)"
    )


def bench_tables(result: dict) -> list[Table]:
    machine = result["machine"]
    cpu = f"{machine['cpu']} (bf16 instructions: {machine['cpu_bf16']}), " if "cpu" in machine else ""
    cpu += f"{machine['kernels']} kernels, " if "kernels" in machine else ""
    device = machine["device"] + (f" ({machine['gpu']})" if "gpu" in machine else "")
    caption = (
        f"{device}, {cpu}{machine['threads']} threads, {machine['dtype']}, "
        f"{'compiled' if machine.get('compile') else 'eager'}, {layout_note(machine.get('weight_layout', 'stored'))}, "
        f"bandwidth {machine['memory_bandwidth_gb_s']:.1f} GB/s, weights {machine['weight_bytes'] / 2**20:.0f} MB, "
        f"{result['new_tokens']} new tokens, median of {result['rounds']} interleaved rounds"
    )
    kinds = [("speed", SPEED), ("full and partial steps", STEPS), ("memory and bandwidth floor", MEMORY)]
    if batched(result):
        kinds.insert(0, ("throughput", BATCH))
        caption += f"; peak RSS: {machine['peak_memory']}" if "peak_memory" in machine else ""
    tables = []
    for where, rows in table_groups(result):
        for kind, columns in kinds:
            captions = {"memory and bandwidth floor": caption, "throughput": rows_note(result, rows)}
            table = Table(title=f"{kind} at {where}", caption=captions.get(kind))
            for label, key, _ in columns:
                if key == "peak_process_bytes" and "gpu" in machine:
                    label = "peak GPU MB"  # torch.cuda.max_memory_allocated, not the process's resident memory
                table.add_column(
                    label, justify="right", no_wrap=key == "label", min_width=14 if key == "label" else None
                )
            for row in rows:
                row = {"label": row["method"], **row}  # results written before labels existed
                table.add_row(*(_cell(row.get(key), fmt) for _, key, fmt in columns))
            tables.append(table)
    return tables


def markdown_table(result: dict) -> str:
    """The same figures as a Markdown table (for the README)."""
    shown = {key for _, key, _ in COLUMNS}
    columns = COLUMNS + (tuple(c for c in BATCH if c[1] not in shown) if batched(result) else ())
    header = ["context", *(label for label, _, _ in columns)]
    lines = [md_row(header), "|" + "---|" * len(header)]
    for row in result["rows"]:
        cells = [str(row["length"])] + [_cell({"label": row["method"], **row}.get(k), fmt) for (_, k, fmt) in columns]
        lines.append(md_row(cells))
    return "\n".join(lines)


def check_plotting() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'refreshkv[eval]'") from None


def series(result: dict, row: dict) -> str:
    """A plotted line: a method, and its batch where a run had several fixed ones."""
    if batched(result) and result.get("memory_cap_bytes") is None:
        return f"{row['method']}, batch {row['batch']}"
    return row["method"]


def plot_paths(path: Path) -> tuple[Path, Path]:
    """The PNGs `plot_bench` writes: `path`, and beside it NAME-steps.png."""
    return path, path.with_name(f"{path.stem}-steps{path.suffix}")


def plot_bench(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(map(functools.partial(series, result), result["rows"])):
        rows = sorted((r for r in result["rows"] if series(result, r) == name), key=lambda r: r["length"])
        axis.plot([r["length"] for r in rows], [r["decode_ms_per_token"] for r in rows], marker="o", label=name)
        if rows[0]["method"] == "full":  # the floor per token: a step's floor shared by its rows
            floors = [r["floor_ms"] / r.get("batch", 1) for r in rows]
            axis.plot([r["length"] for r in rows], floors, "k--", label=f"{name}: bandwidth floor")
    machine = result["machine"]
    axis.set(
        xlabel="context length (tokens)",
        ylabel="decode ms / token",
        title=f"Decode time per token ({machine['device']}, {machine['threads']} threads, {machine['dtype']})",
    )
    lengths = sorted({row["length"] for row in result["rows"]})
    axis.set_xscale("log", base=2)
    axis.set_xticks(lengths, [str(length) for length in lengths])
    axis.set_ylim(bottom=0)
    axis.grid(alpha=0.3)
    axis.legend(loc="upper left", ncol=3, fontsize=8)
    figure.tight_layout()
    save_figure(figure, path, "--plot", dpi=120)
    plt.close(figure)
    plot_step_histograms(result, plot_paths(path)[1])


def plot_step_histograms(result: dict, path: Path) -> None:
    """One panel per method and length: histograms of its partial and full steps' times (the mean hides a few slow
    refreshes among fast partial steps). The `transformers` reference keeps no per-step kinds: no panel."""
    import matplotlib.pyplot as plt

    rows = [row for row in result["rows"] if row.get("partial_step_times_ms") or row.get("full_step_times_ms")]
    figure, axes = plt.subplots(len(rows), 1, figsize=(7, 1.6 * len(rows) + 0.8), sharex=True, squeeze=False)
    times = [t for row in rows for kind in ("partial", "full") for t in row.get(f"{kind}_step_times_ms", [])]
    bins = 40 if not times else [min(times) + i * (max(times) - min(times) + 1e-9) / 40 for i in range(41)]
    for axis, row in zip(axes[:, 0], rows):
        for kind, color in (("partial", "tab:blue"), ("full", "tab:red")):
            steps = row.get(f"{kind}_step_times_ms", [])
            if steps:
                axis.hist(steps, bins=bins, color=color, alpha=0.6, label=f"{kind} steps ({len(steps)})")
        axis.set_ylabel("steps")
        axis.set_title(f"{series(result, row)}, {row['length']} tokens", fontsize=9, loc="left")
        axis.legend(fontsize=7, loc="upper right")
    machine = result["machine"]
    axes[-1, 0].set_xlabel(f"decode step ms ({machine['device']}, {machine['threads']} threads, {machine['dtype']})")
    figure.tight_layout()
    save_figure(figure, path, "--plot", dpi=110)
    plt.close(figure)
