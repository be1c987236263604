"""Decode speed and memory of methods, measured in one run so that machine drift cancels.

A length is the context size at the end of decoding (prompt = length - new tokens). Every round runs every length
and, at each, every method once on the same prompt (the orders change from round to round), by default after one
shared prefill (`generate_many`); a method's figures are medians over rounds. Per-step decode times are kept, so
the median step (a partial step for methods that attend fully only now and then) is reported next to the mean.

The physical floor of a decode step is (weight bytes + KV bytes attended) / memory bandwidth, with the bandwidth
measured once by copying a large tensor: a step cannot be faster than reading what it must read. The pseudo-method
`transformers` times stock transformers decoding (DynamicCache + SDPA) on the same prompt, for reference.

Batches (issue 48): with `batches`, B rows (distinct windows of the book text, `bench_prompt`) decode together after
one prefill, every batch size in every round; tokens/s is B x steps / decode time and the floor per step reads the
weights once and every row's KV. With `memory_cap`, each method runs alone at the largest batch whose run fits under
the cap beside the weights (batch_memory.py). Either way each row's bytes are worked out first, a batch whose one
prefill forward would not fit (under the cap, or in the memory free here) is prefilled a few rows per forward
(`prefill_rows` in the results), and a run that would not fit even so is refused before anything is timed. With
`distinct_rows` N a batch of B rows prefills N distinct rows and decodes B: the N repeated after the prefill, each copy
its own KV (runtime/generate.py `repeat_rows`), so that a large batch costs N prefills, not B.
"""

from __future__ import annotations

import dataclasses
import platform
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch

from ..core.policy import label_notes, make_policy
from ..runtime.generate import check_length
from ..texts import book_text
from .batch_memory import (
    GB,
    available_memory,
    capped_batches,
    check_cap,
    check_fits,
    most_prefill_rows,
    prefilled_rows,
    row_bytes,
)
from .bench_round import REFERENCE, PeakMemory, Run, method_of, run_round


def memory_bandwidth(device: torch.device, megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second moved by a large copy (read + write), best of `repeats`."""
    source = torch.empty(megabytes * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() * source.element_size() / best


def cpu_facts() -> dict:
    """The CPU's model name, its bf16 instructions ("none": bfloat16 is emulated there, slower than float32) and the
    instruction set PyTorch's own kernels use (lower than the CPU's when ATEN_CPU_CAPABILITY restricts it)."""
    name = platform.processor() or "unknown"
    try:
        name = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    checks = (("avx512_bf16", "_is_avx512_bf16_supported"), ("amx", "_is_amx_tile_supported"))
    bf16 = [label for label, check in checks if getattr(torch.cpu, check, lambda: False)()]
    return {"cpu": name, "cpu_bf16": ", ".join(bf16) or "none", "kernels": torch.backends.cpu.get_cpu_capability()}


def machine_facts(model) -> dict:
    """Where a measurement of `model` ran: device (with the GPU's name on CUDA), threads, dtype, torch version and
    the CPU (`cpu_facts`)."""
    gpu = {"gpu": torch.cuda.get_device_name(model.device)} if model.device.type == "cuda" else {}
    return {
        "device": str(model.device),
        **gpu,
        "threads": torch.get_num_threads(),
        "dtype": str(model.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        **cpu_facts(),
    }


def weight_bytes(model) -> int:
    """Bytes of the weights held (a tensor that two modules share counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def weight_bytes_read(model) -> int:
    """Bytes of the weights a decode step reads: those held, less the input embedding table unless it is also the
    output projection's weight (the lookup reads a row per sequence; a packed layout gives the projection a copy)."""
    table = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is table
    return weight_bytes(model) - (0 if tied else table.numel() * table.element_size())


def bench_prompt(tokenizer, length: int, rows: int = 1) -> torch.Tensor:
    """(rows, length): windows of the packaged book text read in a loop (repeated where it is shorter), row r
    starting r / rows of the way through it, so that rows are distinct texts and row 0 is the text's start."""
    ids = tokenizer.encode(book_text(), add_special_tokens=False)
    if rows > len(ids):
        raise ValueError(f"{rows} rows need as many distinct starts; the book text has {len(ids)} tokens")
    loop = ids * (-(-length // len(ids)) + 1)  # long enough from any start
    return torch.tensor([loop[row * len(ids) // rows :][:length] for row in range(rows)])


def is_count(value: object) -> bool:
    """An integer >= 1 (a bool is none)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_batching(batches: list[int], memory_cap: float | None, distinct_rows: int | None = None) -> None:
    """Batch sizes >= 1, or instead of them a cap (bytes) > 0 that chooses each method's batch; distinct rows >= 1
    and, beside batch sizes, no more than any of them but a batch of one (which is its own distinct row)."""
    if not batches or not all(map(is_count, batches)):
        raise ValueError(f"--batch expects integers >= 1, got {batches}")
    if memory_cap is not None and not memory_cap > 0:
        raise ValueError(f"--memory-cap expects a size > 0 GB, got {memory_cap / GB:g}")
    if memory_cap is not None and batches != [1]:
        raise ValueError("--memory-cap chooses each method's batch: leave out --batch")
    if distinct_rows is not None and not is_count(distinct_rows):
        raise ValueError(f"--distinct-rows expects an integer >= 1, got {distinct_rows}")
    smaller = [batch for batch in batches if distinct_rows is not None and 1 < batch < distinct_rows]
    if smaller:
        raise ValueError(
            f"--distinct-rows {distinct_rows} is more than --batch {min(smaller)} holds: give at most {min(smaller)}"
        )


def summarize(runs: list[Run], weights: int, bandwidth: float) -> dict:
    """Medians over rounds of one method at one length and batch, with spread and the physical floor (per step: the
    weights once, every row's KV)."""
    per_step = [r.decode_mean_s for r in runs]
    median_step = statistics.median(per_step)
    batch = runs[0].batch
    attended = statistics.median(r.kv_bytes_attended for r in runs)
    floor = (weights + attended) / bandwidth
    peaks = [r.peak_bytes for r in runs if r.peak_bytes is not None]
    prefill = statistics.median(r.prefill_s for r in runs)
    return {
        "method": runs[0].method,
        # a quality reference (oracle) is labelled, never read as a speed-up; a plugin's method names its package
        "label": runs[0].method + label_notes(method_of(runs[0].method)),
        "length": runs[0].length,
        "batch": batch,
        "prefill_rows": runs[0].prefill_rows,
        "distinct_rows": runs[0].distinct_rows,
        "rounds": len(runs),
        "prefill_s": prefill,
        "prefill_tokens_per_s": runs[0].distinct_rows * (runs[0].length - runs[0].new_tokens) / prefill,
        "decode_ms_per_step": 1000 * median_step,
        "decode_ms_per_token": 1000 * median_step / batch,
        "decode_ms_spread": 1000 * (max(per_step) - min(per_step)),
        "decode_ms_median_step": 1000 * statistics.median(r.decode_median_s for r in runs),
        "tokens_per_s": batch / median_step,
        "full_step_fraction": statistics.median(r.full_step_fraction for r in runs),
        **step_kinds(runs),
        "kv_bytes_held": runs[0].kv_bytes_held,
        "kv_bytes_held_per_row": runs[0].kv_bytes_held / batch,
        "kv_bytes_attended": attended,
        "kv_bytes_attended_per_row": attended / batch,
        "peak_process_bytes": max(peaks) if peaks else None,
        "floor_ms": 1000 * floor,
        "measured_over_floor": median_step / floor,
        "tokens": runs[0].tokens,
    }


def step_kinds(runs: list[Run]) -> dict:
    """Full and partial steps of all rounds: count, median, 90th percentile and every step's time (ms), from which
    `bench --plot` draws the two histograms."""
    summary = {}
    for kind in ("full", "partial"):
        times = sorted(t for r in runs for t in getattr(r, f"{kind}_steps_s"))
        summary[f"{kind}_steps"] = len(times)
        summary[f"{kind}_step_times_ms"] = [round(1000 * t, 3) for t in times]
        summary[f"{kind}_step_ms"] = 1000 * statistics.median(times) if times else None
        summary[f"{kind}_step_p90_ms"] = 1000 * times[int(0.9 * (len(times) - 1))] if times else None
    return summary


def check_methods(methods: dict[str, dict]) -> None:
    """Build every method once, so that a bad parameter fails before a model is loaded or a run is timed."""
    for name, params in methods.items():
        if name != REFERENCE:
            make_policy(method_of(name), **params)


class Unit(NamedTuple):
    """What one round runs after one prefill (or, without a shared prefill, one per method)."""

    batch: int
    names: list[str]  # the methods that decode it
    prefill_rows: int  # rows per prefill forward


def rotated(items: list, by: int) -> list:
    by %= len(items)
    return items[by:] + items[:by]


def plan_units(
    model,
    tokenizer,
    methods: dict[str, dict],
    lengths: list[int],
    new_tokens: int,
    batches: list[int],
    memory_cap: float | None,
    share_prefill: bool,
    distinct_rows: int | None = None,
) -> tuple[dict[int, list[Unit]], dict[int, dict]]:
    """What each length runs, and each method's bytes per row there (batch_memory.py; not worked out for a run of
    one row, which stays as before issue 48). Under `memory_cap` each method is a unit of its own at its largest
    batch. A unit prefills `distinct_rows` of its rows (None: all), as many per forward as fit (under the cap, and in
    the memory free here). A cap below the weights, a method without one row under the cap, and a unit that would not
    fit in the memory free here even one prefill row at a time are refused, before anything is timed."""
    names = list(methods)
    if memory_cap is None and batches == [1]:
        return {length: [Unit(1, names, 1)] for length in lengths}, {}
    weights = weight_bytes(model)
    if memory_cap is not None:
        check_cap(memory_cap, weights)
    # the reference holds what `full` holds (its own cache is no method's: sized as full's)
    policies = {
        name: make_policy("full") if name == REFERENCE else make_policy(method_of(name), **methods[name])
        for name in names
    }
    available = available_memory(model.device)
    together = share_prefill and memory_cap is None
    units, sizes = {}, {}
    for length in lengths:
        prompt = bench_prompt(tokenizer, length - new_tokens).to(model.device)
        rows = sizes[length] = row_bytes(model, prompt, policies, new_tokens)
        if memory_cap is None:
            planned = [(batch, names) for batch in batches]
        else:
            capped = capped_batches(memory_cap, weights, rows, length, distinct_rows)
            planned = [(capped[name], [name]) for name in names]
        units[length] = []
        for batch, unit in planned:
            # rows per prefill forward: as many as fit under the cap (a method alone there) and in the memory free here
            most = prefilled_rows(batch, distinct_rows)
            if memory_cap is not None:
                most = most_prefill_rows(batch, memory_cap - weights, [rows[unit[0]]], distinct_rows)
            decoded = [name for name in unit if name != REFERENCE]  # the reference runs first, its cache then freed
            for group, at_once in ((decoded, together), ([REFERENCE] if REFERENCE in unit else [], False)):
                if group:
                    what = f"{', '.join(group)} at batch {batch} and {length} tokens"
                    fits = check_fits(batch, [rows[name] for name in group], at_once, available, what, distinct_rows)
                    most = min(most, fits)
            units[length].append(Unit(batch, unit, most))
    return units, sizes


def compare_with_full(summaries: list[dict]) -> None:
    """Each summary against `full`'s among them: tokens/s, KV held per row, and (at the same batch) full steps."""
    full = next((s for s in summaries if s["method"] == "full"), None)
    if full is None:
        return
    for summary in summaries:
        summary["speedup_vs_full"] = summary["tokens_per_s"] / full["tokens_per_s"]
        summary["kv_held_vs_full"] = summary["kv_bytes_held_per_row"] / full["kv_bytes_held_per_row"]
        same_batch = summary["batch"] == full["batch"]
        if same_batch and summary["full_step_ms"] is not None and full["full_step_ms"] is not None:
            # issue 13's target: a refresh / full step of a method against a step of full attention
            summary["full_step_vs_full"] = summary["full_step_ms"] / full["full_step_ms"]


def run_bench(
    model,
    tokenizer,
    methods: dict[str, dict],
    lengths: list[int],
    new_tokens: int,
    rounds: int,
    progress=None,
    share_prefill: bool = True,
    compile: bool = False,
    batches: list[int] = (1,),
    memory_cap: float | None = None,
    distinct_rows: int | None = None,
) -> dict:
    """Interleaved benchmark; `methods` maps a method name to its parameters. Returns rows + machine facts.

    Every round runs every length (in turn forwards and backwards) and, at each length, every batch size and
    method (in orders that rotate from round to round), so that a drift of the machine hits all of them alike and
    figures at different lengths compare too (e.g. a method at 8K against `full` at 1K). With `share_prefill` each
    round prefills a batch once for every method (`generate_many`), so the prefill is timed once; peak memory is then
    not measured per method (all caches exist together). With `compile` decode steps run compiled (`transformers`
    stays eager), after one untimed round that compiles the graphs for each length.
    `batches`: rows decoded together (`bench_prompt`); `memory_cap` (bytes; instead of `batches`): each method
    alone at the largest batch that fits under it beside the weights (module doc); `distinct_rows` N: a batch of B
    prefills N distinct rows, repeated to B after the prefill (None: every row distinct). `progress(n)` is called with 0
    once every check has passed, then with the runs each round completed at a length and batch.
    """
    check_methods(methods)
    batches = list(dict.fromkeys(batches))
    check_batching(batches, memory_cap, distinct_rows)
    for length in lengths:
        if length - new_tokens < 16:
            raise ValueError(f"length {length} leaves no room for a prompt before {new_tokens} new tokens")
        check_length(model, length - new_tokens, new_tokens)
    units, sizes = plan_units(
        model, tokenizer, methods, lengths, new_tokens, batches, memory_cap, share_prefill, distinct_rows
    )
    if progress is not None:
        progress(0)  # every check passed
    share_prefill = share_prefill and memory_cap is None
    device = model.device
    bandwidth = memory_bandwidth(device)
    weights = weight_bytes(model)
    weights_read = weight_bytes_read(model)
    peak = PeakMemory(device)
    prompts = {  # each ends at `length`
        (length, batch): bench_prompt(tokenizer, length - new_tokens, prefilled_rows(batch, distinct_rows)).to(device)
        for length in lengths
        for batch, *_ in units[length]
    }
    if compile:
        for length in lengths:
            for batch, unit, prefill_rows in units[length]:
                ids = prompts[length, batch]
                run_round(model, ids, methods, unit, new_tokens, peak, share_prefill, compile, prefill_rows, batch)
    runs: dict[tuple[int, int, str], list[Run]] = {
        (length, batch, name): [] for length in lengths for batch, unit, _ in units[length] for name in unit
    }
    for round_index in range(rounds):
        for length in lengths if round_index % 2 == 0 else lengths[::-1]:
            for batch, unit, prefill_rows in rotated(units[length], round_index):
                order = rotated(unit, round_index)
                ids = prompts[length, batch]
                done = run_round(
                    model, ids, methods, order, new_tokens, peak, share_prefill, compile, prefill_rows, batch
                )
                for run in done:
                    runs[length, batch, run.method].append(run)
                if progress is not None:
                    progress(len(order))
    rows = []
    for length in lengths:
        # `full` is the reference at the same batch, or under a cap at its own
        groups = [units[length]] if memory_cap is not None else [[unit] for unit in units[length]]
        for group in groups:
            summaries = [
                summarize(runs[length, batch, name], weights_read, bandwidth)
                for batch, unit, _ in group
                for name in unit
            ]
            compare_with_full(summaries)
            rows.extend(summaries)
    return {
        "rows": rows,
        "machine": {
            **machine_facts(model),
            "memory_bandwidth_gb_s": bandwidth / 1e9,
            "weight_bytes": weights,
            "weight_bytes_read": weights_read,
            "compile": compile,
            "peak_memory": peak.how(),
        },
        "new_tokens": new_tokens,
        "rounds": rounds,
        "methods": methods,
        "shared_prefill": share_prefill,
        "batches": batches,
        "memory_cap_bytes": memory_cap,
        "distinct_rows": distinct_rows,
        "row_bytes": {
            str(length): {name: dataclasses.asdict(row) for name, row in rows_at.items()}
            for length, rows_at in sizes.items()
        },
    }
