"""`refreshkv eval`, `sweep` and `report`: run evaluation configurations into JSONL files and summarise them.

See docs/evaluation.md for the JSONL schema, the sweep YAML schema and the resume semantics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

DTYPES = ("float32", "bfloat16")


def parse_value(raw: str):
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            continue
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    return raw


def parse_pairs(pairs: list[str], option: str, repeat_as_list: bool = False) -> dict:
    """NAME=VALUE pairs (int, float, true/false or text); with `repeat_as_list` a repeated NAME gives a list."""
    values: dict = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"{option} expects NAME=VALUE, got '{pair}'")
        name = name.replace("-", "_")
        value = parse_value(raw)
        if name in values and repeat_as_list:
            previous = values[name]
            values[name] = (previous if isinstance(previous, list) else [previous]) + [value]
        elif name in values:
            raise ValueError(f"{option} {name} is given twice")
        else:
            values[name] = value
    return values


def check_runtime(dtype: str, device: str):
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype '{dtype}'; choose from: {', '.join(DTYPES)}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown device '{device}'; choose from: cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA GPU is available")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def register(app, user_errors) -> None:
    """Add the evaluation commands to the CLI app; `user_errors` wraps a command so ValueErrors exit with code 2."""
    from rich.console import Console

    console = Console()

    @app.command("eval")
    @user_errors
    def eval_command(
        task: Annotated[str, typer.Option(help="Task name, e.g. ruler/niah_single_1, ppl, recovery.")],
        out: Annotated[Path, typer.Option(help="JSONL results file (appended to; re-running resumes).")],
        method: Annotated[str, typer.Option(help="KV method (see `refreshkv methods`).")] = "full",
        budget: Annotated[Optional[int], typer.Option(help="K: tokens kept/attended per layer and KV head.")] = None,
        budget_ratio: Annotated[Optional[float], typer.Option(help="K as a fraction of the prompt, in (0, 1].")] = None,
        stride: Annotated[Optional[int], typer.Option(help="Fixed schedule: full step every S decode steps.")] = None,
        qc_stride: Annotated[Optional[int], typer.Option(help="Dynamic schedule: compare queries every N steps.")] = None,
        threshold: Annotated[Optional[float], typer.Option(help="Method threshold (refreshkv: query cosine).")] = None,
        kernel: Annotated[Optional[int], typer.Option(help="Max-pooling kernel over positions (odd).")] = None,
        window: Annotated[Optional[int], typer.Option(help="Observation window of prompt queries.")] = None,
        param: Annotated[list[str], typer.Option("--param", help="Other method parameter NAME=VALUE (repeatable).")] = [],
        task_option: Annotated[
            list[str], typer.Option("--task-option", help="Task option NAME=VALUE (repeatable; repeat a name for a list).")
        ] = [],
        length: Annotated[int, typer.Option(min=1, help="Context length in tokens.")] = 4096,
        num_examples: Annotated[int, typer.Option(min=1, help="Examples to run.")] = 10,
        seed: Annotated[int, typer.Option(help="Seed of the example generator.")] = 0,
        model: Annotated[Optional[str], typer.Option(help="Local model dir or .gguf (default: embedded SmolLM2).")] = None,
        chat: Annotated[bool, typer.Option(help="Wrap prompts in the model's chat template.")] = True,
        dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
        device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    ):
        """Run one task x method configuration over examples into a resumable JSONL file."""
        from ..model import load_model
        from .runner import ResultsFile, RunConfig, model_identity, run_eval

        given = dict(budget=budget, budget_ratio=budget_ratio, stride=stride, qc_stride=qc_stride,
                     threshold=threshold, kernel=kernel, window=window)
        params = {**{k: v for k, v in given.items() if v is not None}, **parse_pairs(param, "--param")}
        config = RunConfig(
            task=task, method=method, length=length, seed=seed, params=params,
            task_options=parse_pairs(task_option, "--task-option", repeat_as_list=True),
            model=model_identity(model), chat=chat, dtype=dtype,
        )
        config.validate()
        torch_dtype = check_runtime(dtype, device)
        ResultsFile(out, run=config.key())  # refuse a foreign file before loading anything
        lm, tokenizer = load_model(model, dtype=torch_dtype, device=device)
        counts = run_eval(lm, tokenizer, config, num_examples, out)
        console.print(
            f"{counts['ran']} example(s) run, {counts['done_before']} already in {out}; "
            f"config {config.key()} ({config.label()}). Summarise with: refreshkv report {out}",
            highlight=False,
        )

    @app.command("sweep")
    @user_errors
    def sweep_command(
        config: Annotated[Path, typer.Argument(help="Sweep YAML file (schema in docs/evaluation.md).")],
        out: Annotated[Optional[Path], typer.Option(help="JSONL results file (overrides `out` in the YAML).")] = None,
        device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    ):
        """Run methods x parameters x tasks x lengths from a YAML file into one resumable JSONL file."""
        from ..model import load_model
        from .runner import ResultsFile
        from .sweep import load_sweep, run_sweep

        sweep = load_sweep(config, out)
        torch_dtype = check_runtime(sweep.dtype, device)
        for run_config in sweep.configs():
            run_config.validate()
        ResultsFile(sweep.out, run=sweep.identity())
        lm, tokenizer = load_model(sweep.model, dtype=torch_dtype, device=device)
        counts = run_sweep(sweep, lm, tokenizer)
        console.print(
            f"{counts['ran']} row(s) run, {counts['done_before']} already in {sweep.out} "
            f"({len(sweep.configs())} configurations, {sweep.identity()}). "
            f"Summarise with: refreshkv report {sweep.out}",
            highlight=False,
        )

    @app.command("report")
    @user_errors
    def report_command(
        results: Annotated[list[Path], typer.Argument(help="One or more JSONL results files.")],
        out_dir: Annotated[Optional[Path], typer.Option(help="Folder for the PNGs and summary.md (default: <first file>-report).")] = None,
        plots: Annotated[bool, typer.Option(help="Write PNG plots (needs matplotlib).")] = True,
    ):
        """Tables (task x method, relative to full) and plots of evaluation results."""
        from .report import rich_tables, write_report

        groups, _, written = write_report(results, out_dir, plots=plots)
        for table in rich_tables(groups):
            console.print(table)
        console.print(f"wrote {', '.join(str(p) for p in written)}", highlight=False)
