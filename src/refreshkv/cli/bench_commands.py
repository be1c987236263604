"""`refreshkv bench` and `refreshkv profile`: decode speed and memory of methods measured in one interleaved run
(measure/bench.py), and one decode step's operators under torch.profiler (measure/profile_step.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from ..runtime.prepare import check_runtime, load_checked
from .options import (
    CompileOpt,
    DeviceOpt,
    DtypeOpt,
    ForceOpt,
    MethodOpt,
    ModelOpt,
    ThreadsOpt,
    WeightLayoutOpt,
    parse_pairs,
)
from .tables import print_table

CONSOLE = Console()


def bench_policies(methods: dict[str, dict]) -> list:
    """The method objects of `bench_methods`' choice (the reference, transformers' own generation, has none)."""
    from ..core.policy import make_policy
    from ..measure.bench_round import REFERENCE, method_of

    return [make_policy(method_of(name), **params) for name, params in methods.items() if name != REFERENCE]


def bench_methods(names: str, budget: int, param: list[str]) -> dict[str, dict]:
    """Method name -> parameters: `budget` for every method that has one, plus `--param METHOD:NAME=VALUE`."""
    from ..core.policy import METHODS
    from ..measure.bench import check_methods
    from ..measure.bench_round import REFERENCE, method_of

    methods = {}
    for name in filter(None, (n.strip() for n in names.split(","))):
        if name == REFERENCE:
            methods[name] = {}
            continue
        method = method_of(name)
        if method not in METHODS:
            raise ValueError(
                f"unknown method '{method}'; choose from: {', '.join(sorted(METHODS))}, {REFERENCE} "
                "(METHOD@TAG names a variant of METHOD)"
            )
        methods[name] = {"budget": budget} if "budget" in METHODS[method].parameters() else {}
    if not methods:
        raise ValueError("--methods is empty; give a comma-separated list, e.g. full,refreshkv")
    for item in param:
        method, sep, pair = item.partition(":")
        if not sep or method not in methods:
            raise ValueError(f"--param expects METHOD:NAME=VALUE with METHOD among --methods, got '{item}'")
        methods[method].update(parse_pairs([pair], "--param"))
    check_methods(methods)
    return methods


def parse_integers(text: str, option: str, minimum: int) -> list[int]:
    """A comma-separated list of integers >= `minimum` (`--lengths`, `--batch`)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{option} expects comma-separated integers, got '{text}'") from None
    if not values or min(values) < minimum:
        raise ValueError(f"{option} expects integers >= {minimum}, got '{text}'")
    return values


def bench_command(
    methods: Annotated[
        str,
        typer.Option(
            help="Comma-separated methods; METHOD@TAG adds a variant with its own --param "
            "(e.g. refreshkv@int4); `transformers` = stock decoding, for reference."
        ),
    ] = "full,refreshkv,recycled,snapkv,streamingllm,h2o",
    lengths: Annotated[str, typer.Option(help="Comma-separated prompt lengths in tokens.")] = "1024,2048,4096,8192",
    new_tokens: Annotated[int, typer.Option(min=2, help="Decode steps per run.")] = 128,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds; every round runs every method once.")] = 3,
    budget: Annotated[int, typer.Option(min=1, help="K for every method with a budget.")] = 1024,
    param: Annotated[list[str], typer.Option("--param", help="METHOD:NAME=VALUE (repeatable).")] = [],
    model: ModelOpt = None,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
    threads: ThreadsOpt = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the results here as JSON.")] = None,
    plot: Annotated[
        Optional[Path],
        typer.Option(
            help="Write a PNG of decode time per token vs length, and beside it NAME-steps.png: histograms of each "
            "method's partial and full step times."
        ),
    ] = None,
    share_prefill: Annotated[
        bool,
        typer.Option(
            help="Prefill once per round for all methods (--no-share-prefill: each alone, which also measures each "
            "method's peak memory)."
        ),
    ] = True,
    compile: CompileOpt = False,
    weight_layout: WeightLayoutOpt = "stored",
    batch: Annotated[
        str,
        typer.Option(
            help="Rows decoded together after one prefill (distinct windows of the book text); comma-separated "
            "sizes run interleaved, e.g. 1,4,8,16."
        ),
    ] = "1",
    memory_cap: Annotated[
        Optional[float],
        typer.Option(
            help="GB (2^30 bytes) for weights + KV + decode activations: each method runs alone at the largest "
            "batch that fits (worked out first; excludes --batch)."
        ),
    ] = None,
    distinct_rows: Annotated[
        Optional[int],
        typer.Option(
            help="Distinct prompts a batch prefills (at most each --batch above 1): repeated to the batch's rows "
            "after the prefill, each copy its own KV, so that B rows cost N prefills (default: every row distinct)."
        ),
    ] = None,
    force: ForceOpt = False,
):
    """Decode speed, memory and distance to the bandwidth floor of methods, interleaved in one run."""
    from tqdm.auto import tqdm

    from ..measure.batch_memory import GB
    from ..measure.bench import check_batching, run_bench
    from ..measure.bench_report import bench_tables, check_plotting, plot_bench, plot_paths
    from ..runtime.output_files import check_output, write_text

    chosen = bench_methods(methods, budget, param)
    length_list = parse_integers(lengths, "--lengths", 16)
    batches = parse_integers(batch, "--batch", 1)
    cap = None if memory_cap is None else memory_cap * GB
    check_batching(batches, cap, distinct_rows)
    if plot is not None:
        check_plotting()
    for output in [json_out, *(plot_paths(plot) if plot is not None else ())]:
        if output is not None:
            check_output(output, "bench output", force)  # before minutes of measuring, not after
    lm, tokenizer, layout = load_checked(
        model, check_runtime(dtype, device, compile, weight_layout, threads), bench_policies(chosen)
    )
    runs = rounds * len(chosen) * len(length_list) * len(set(batches))
    bars = []  # opened once run_bench has checked everything, so that a refusal stays one line

    def progress(done: int) -> None:
        if not bars:
            bars.append(tqdm(total=runs, desc="bench runs", unit="run"))
        bars[0].update(done)

    try:
        result = run_bench(
            lm,
            tokenizer,
            chosen,
            length_list,
            new_tokens,
            rounds,
            progress=progress,
            share_prefill=share_prefill,
            compile=compile,
            batches=batches,
            memory_cap=cap,
            distinct_rows=distinct_rows,
        )
    finally:
        for bar in bars:
            bar.close()
    result["machine"]["weight_layout"] = layout or weight_layout
    for table in bench_tables(result):
        print_table(CONSOLE, table)
    if json_out is not None:
        write_text(json_out, json.dumps(result, indent=1), "--json")
    if plot is not None:
        plot_bench(result, plot)


def profile_command(
    method: MethodOpt = "full",
    length: Annotated[
        int,
        typer.Option(
            help="Context at the profiled step; the prompt is LENGTH - STEP tokens of the packaged book text."
        ),
    ] = 1024,
    step: Annotated[
        int,
        typer.Option(
            min=1,
            help="Decode step to profile, counted from 1 after the prompt (with stride 10, step 20 is a full step).",
        ),
    ] = 20,
    top: Annotated[int, typer.Option(min=1, help="Operators to list, by self CPU time.")] = 10,
    rounds: Annotated[
        int, typer.Option(min=1, help="Fresh generations profiled; each operator's median is shown.")
    ] = 3,
    param: Annotated[
        list[str], typer.Option("--param", help="Method parameter NAME=VALUE, e.g. budget=512 (repeatable).")
    ] = [],
    model: ModelOpt = None,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
    threads: ThreadsOpt = None,
    weight_layout: WeightLayoutOpt = "stored",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
    batch: Annotated[
        int, typer.Option(help="Rows decoded together (distinct windows of the book text), as `bench --batch`.")
    ] = 1,
):
    """Profile one decode step with torch.profiler: the operators it spends its time in."""
    from ..core.policy import make_policy
    from ..measure.bench import bench_prompt, check_batching, machine_facts
    from ..measure.profile_step import profile_step
    from ..runtime.generate import check_length

    policy = make_policy(method, **parse_pairs(param, "--param"))
    check_batching([batch], None)
    if length - step < 16:
        raise ValueError(f"--length {length} leaves fewer than 16 prompt tokens before step {step}")
    lm, tokenizer, layout = load_checked(
        model, check_runtime(dtype, device, weight_layout=weight_layout, threads=threads), [policy]
    )
    check_length(lm, length - step, step)
    prompts = bench_prompt(tokenizer, length - step, batch).to(lm.device)
    result = profile_step(lm, prompts, policy, step, top, rounds)
    result["machine"] = {**machine_facts(lm), "weight_layout": layout or weight_layout}
    if as_json:
        print(json.dumps(result))
        return
    from ..measure.bench_report import layout_note

    machine = result["machine"]
    table = Table(
        title=f"{method}: decode step {step} at {result['context']} tokens, batch {batch} "
        f"({result['full_layers']:g} of {lm.config.num_hidden_layers} layers attended fully)",
        caption=f"{machine['device']}, {machine['cpu']}, {machine['threads']} threads, {dtype}, "
        f"{layout_note(machine['weight_layout'])}; medians of {rounds} rounds: self CPU "
        f"{result['self_cpu_ms']:.1f} ms, wall {result['wall_ms']:.1f} ms under the profiler; "
        f"{result['operator_calls']} operator calls",
    )
    for column in ("operator", "self CPU ms", "share", "calls"):
        table.add_column(column, justify="left" if column == "operator" else "right", no_wrap=column == "operator")
    for op in result["operators"]:
        table.add_row(op["name"], f"{op['self_cpu_ms']:.2f}", f"{100 * op['share']:.1f}%", str(op["calls"]))
    print_table(CONSOLE, table)


def register(app, user_errors) -> None:
    """Add `bench` and `profile` to the CLI app; `user_errors` wraps a command so ValueErrors exit with code 2."""
    app.command("bench")(user_errors(bench_command))
    app.command("profile")(user_errors(profile_command))
