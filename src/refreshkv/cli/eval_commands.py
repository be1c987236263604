"""`refreshkv eval`, `sweep` and `report`: run evaluation configurations into JSONL files and summarise them.

See docs/evaluation.md for the JSONL schema, the sweep YAML schema and the resume semantics.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from ..runtime.prepare import check_runtime, load_checked
from .options import (
    DeviceOpt,
    DtypeOpt,
    MethodOpt,
    ModelOpt,
    method_options,
    parse_pairs,
)
from .tables import print_table

CONSOLE = Console()


def register(app, user_errors) -> None:
    """Add the evaluation commands to the CLI app; `user_errors` wraps a command so ValueErrors exit with code 2."""
    app.command("eval")(user_errors(method_options()(eval_command)))
    app.command("sweep")(user_errors(sweep_command))
    app.command("report")(user_errors(report_command))


def eval_command(
    task: Annotated[str, typer.Option(help="Task name, e.g. ruler/niah_single_1, ppl, recovery.")],
    out: Annotated[Path, typer.Option(help="JSONL results file (appended to; re-running resumes).")],
    method: MethodOpt = "full",
    params: Optional[dict] = None,  # the method options (`method_options`)
    task_option: Annotated[
        list[str],
        typer.Option("--task-option", help="Task option NAME=VALUE (repeatable; repeat a name for a list)."),
    ] = [],
    length: Annotated[int, typer.Option(min=1, help="Context length in tokens.")] = 4096,
    num_examples: Annotated[int, typer.Option(min=1, help="Examples to run.")] = 10,
    seed: Annotated[int, typer.Option(help="Seed of the example generator.")] = 0,
    model: ModelOpt = None,
    chat: Annotated[
        bool,
        typer.Option(
            help="Wrap prompts in the model's chat template where it has one (a base model gets the "
            "task's base form; rows record prompt_form)."
        ),
    ] = True,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
    fidelity: Annotated[
        bool,
        typer.Option(
            help="Also feed the method full's answer and record its KL to full, top-1 agreement and first "
            "divergence (a second cache from the same prefill; full runs unseen when the method is not full)."
        ),
    ] = True,
):
    """Run one task x method configuration over examples into a resumable JSONL file."""
    from ..eval.config import RunConfig, model_identity
    from ..eval.results_file import ResultsFile
    from ..eval.runner import run_eval

    params = params or {}
    config = RunConfig(
        task=task,
        method=method,
        length=length,
        seed=seed,
        params=params,
        task_options=parse_pairs(task_option, "--task-option", repeat_as_list=True),
        model=model_identity(model),
        chat=chat,
        dtype=dtype,
    )
    config.validate()
    runtime = check_runtime(dtype, device)
    with ResultsFile(out, run=config.key()) as results:  # refuses a foreign, busy or unwritable file first
        lm, tokenizer, _ = load_checked(model, runtime)
        counts = run_eval(lm, tokenizer, config, num_examples, results, fidelity=fidelity)
    CONSOLE.print(
        f"{counts['ran']} example(s) run, {counts['done_before']} already in {out}; "
        f"config {config.key()} ({config.label()}). Summarise with: refreshkv report {out}",
        highlight=False,
    )


def sweep_command(
    config: Annotated[Path, typer.Argument(help="Sweep YAML file (schema in docs/evaluation.md).")],
    out: Annotated[Optional[Path], typer.Option(help="JSONL results file (overrides `out` in the YAML).")] = None,
    model: Annotated[
        Optional[str], typer.Option(help="Named model, model directory or .gguf (overrides `model` in the YAML).")
    ] = None,
    device: DeviceOpt = "cpu",
    share_prefill: Annotated[
        Optional[int],
        typer.Option(
            min=1,
            help="At most N methods per shared prefill of an example (1: each prefills alone; default: all, "
            "whose caches are held together, so memory grows with N).",
        ),
    ] = None,
):
    """Run methods x parameters x tasks x lengths from a YAML file into one resumable JSONL file.

    Data-parallel: `torchrun --nproc-per-node N -m refreshkv sweep FILE` (or `accelerate launch`); each rank
    runs every N-th example into OUT's rank file (<stem>.rank<r>.jsonl); `refreshkv report OUT` merges them.
    """
    from ..eval.distributed import current_launch
    from ..eval.sweep import load_sweep, run_sweep

    sweep = load_sweep(config, out, model)
    launch = current_launch()
    runtime = check_runtime(sweep.dtype, device)
    for run_config in sweep.configs():
        run_config.validate()
    results = open_agreed_results(sweep, launch, device)
    if launch.is_distributed and device == "cuda":
        runtime = dataclasses.replace(runtime, device=f"cuda:{launch.local_rank}")
    with results:
        lm, tokenizer, _ = load_checked(sweep.model, runtime)
        counts = run_sweep(sweep, lm, tokenizer, results=results, share_prefill=share_prefill, launch=launch)
    CONSOLE.print(
        f"{counts['ran']} row(s) run, {counts['done_before']} already in {results.path} "
        f"({len(sweep.configs())} configurations, {sweep.identity()}). "
        f"Summarise with: refreshkv report {sweep.out}",
        highlight=False,
    )


def open_agreed_results(sweep, launch, device: str):
    """The sweep's results file, opened (refusing a foreign, busy or unwritable file first) once every rank of a
    data-parallel launch agrees that it runs the same sweep and has read the same rows done (before any rank runs:
    the work left is dealt out from them). An error is said after the ranks agree, so that no rank waits for one
    that has stopped."""
    from ..eval.distributed import agree
    from ..eval.results_file import short_hash
    from ..eval.sweep import open_results

    try:
        results = open_results(sweep, launch)
    except (ValueError, OSError) as error:
        results = error
    state = (
        f"an error ({results})"
        if isinstance(results, Exception)
        else f"sweep {sweep.identity()} ({sweep.counts()}; {len(results.done)} rows done, "
        f"{short_hash(sorted(results.done))})"
    )
    try:
        agree(launch, state, device)
    except BaseException:
        if not isinstance(results, Exception):
            results.close()
        raise
    if isinstance(results, Exception):
        raise results
    return results


def report_command(
    results: Annotated[list[Path], typer.Argument(help="One or more JSONL results files.")],
    out_dir: Annotated[
        Optional[Path], typer.Option(help="Folder for the PNGs and summary.md (default: <first file>-report).")
    ] = None,
    plots: Annotated[bool, typer.Option(help="Write PNG plots (needs matplotlib).")] = True,
):
    """Tables (task x method, relative to full) and plots of evaluation results."""
    from ..eval.distributed import sweep_files
    from ..eval.report import rich_tables, write_report

    # a data-parallel sweep's rank files (<stem>.rank<r>.jsonl) come with its file
    paths = list(dict.fromkeys(found for path in results for found in (sweep_files(path) or [path])))
    groups, _, written = write_report(paths, out_dir, plots=plots)
    for table in rich_tables(groups):
        print_table(CONSOLE, table)
    CONSOLE.print(f"wrote {', '.join(str(p) for p in written)}", highlight=False)
