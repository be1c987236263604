"""`refreshkv trace`: one generation under one method, with what its selection holds at every step and layer
(measure/trace.py): a JSON file and a PNG heatmap. The prompt is given (`--prompt`, `--prompt-file`) or is an
example of an evaluation task as the runner builds it (`--task`, `--example`, `--length`, `--task-option`), whose
reference is then the default needle."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..runtime.output_files import check_output, write_text
from ..runtime.prepare import check_runtime, load_checked
from .options import (
    DtypeOpt,
    ForceOpt,
    MethodOpt,
    ModelOpt,
    method_options,
    parse_pairs,
    read_prompt,
)


def prompt_text(tokenizer, prompt: str, answer_prefix: str, chat: bool) -> str:
    """The text whose tokens (no special tokens added) are what the model is given, so that characters map to
    tokens: the chat-templated message, or the base model's BOS and the prompt; then the answer prefix."""
    if chat:
        messages = [{"role": "user", "content": prompt}]
        head = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        head = (tokenizer.bos_token or "") + prompt
    return head + answer_prefix


def needle_positions(tokenizer, text: str, needle: str) -> list[int]:
    """The positions of the tokens that spell any occurrence of `needle` in `text`; refused in one line if none."""
    spans = []
    start = text.find(needle)
    while needle and start >= 0:
        spans.append((start, start + len(needle)))
        start = text.find(needle, start + 1)
    if not spans:
        raise ValueError(f"the needle {needle!r} is not in the prompt; give a string the prompt holds (--needle)")
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return [i for i, (a, b) in enumerate(offsets) if any(a < end and b > begin for begin, end in spans)]


def register(app: typer.Typer, user_errors) -> None:
    @app.command()
    @user_errors
    @method_options("budget", "budget_ratio", "stride", "qc_stride", "threshold", "kernel", "window", "preset", "param")
    def trace(
        out: Annotated[Path, typer.Option(help="The trace as JSON (a new file, or --force); beside it, --plot's PNG.")],
        method: MethodOpt = "refreshkv",
        model: ModelOpt = None,
        params: Optional[dict] = None,  # the method options (`method_options`)
        prompt: Annotated[Optional[str], typer.Option(help="Prompt text.")] = None,
        prompt_file: Annotated[Optional[Path], typer.Option(help="UTF-8 file holding the prompt.")] = None,
        chat: Annotated[bool, typer.Option(help="Wrap --prompt in the model's chat template.")] = False,
        task: Annotated[
            Optional[str], typer.Option(help="Trace an example of this evaluation task instead of a prompt.")
        ] = None,
        example: Annotated[int, typer.Option(min=0, help="With --task: the example's index.")] = 0,
        length: Annotated[int, typer.Option(min=16, help="With --task: the example's length in tokens.")] = 4096,
        seed: Annotated[int, typer.Option(help="With --task: the examples' seed.")] = 0,
        task_option: Annotated[
            list[str], typer.Option("--task-option", help="With --task: NAME=VALUE (repeatable).")
        ] = [],
        needle: Annotated[
            Optional[str],
            typer.Option(help="Text whose tokens the trace follows (default with --task: the first reference)."),
        ] = None,
        max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate (at most 1024).")] = 64,
        plot: Annotated[Optional[Path], typer.Option(help="Also write the heatmap here (PNG).")] = None,
        dtype: DtypeOpt = "float32",
        force: ForceOpt = False,
    ):
        """Trace one generation: per decode step and layer, whether it attended fully, the exact attention mass
        and top-K it kept, and whether a needle's tokens are in its selection (JSON, PNG heatmap)."""
        from ..core.policy import make_policy
        from ..measure.trace import check_steps, trace_generation, what_it_shows

        params = params or {}
        policy = make_policy(method, **params)
        check_steps(max_new_tokens)
        for path, what in ((out, "trace file"), (plot, "trace plot")):
            if path is not None:
                check_output(path, what, force)
        options = parse_pairs(task_option, "--task-option", repeat_as_list=True)
        if task is None:
            if options or example:
                raise ValueError("--task-option and --example go with --task")
            text = read_prompt(prompt, prompt_file)
        else:
            from ..eval.config import RunConfig, find_task, task_kind

            if prompt is not None or prompt_file is not None:
                raise ValueError("give --task or a prompt (--prompt, --prompt-file), not both")
            config = RunConfig(task=task, method=method, length=length, seed=seed, params=params, task_options=options)
            config.validate()
            if task_kind(find_task(task)) != "generation":
                raise ValueError(f"task '{task}' is not one generation per example; trace a generation task")
        if plot is not None:
            from ..measure.bench_report import check_plotting

            check_plotting()
        lm, tokenizer, _ = load_checked(model, check_runtime(dtype), [policy])
        if task is None:
            if chat and not tokenizer.chat_template:
                raise ValueError("this model has no chat template (a base model): leave out --chat")
            text = prompt_text(tokenizer, text, "", chat)
        else:
            from ..eval.examples import prepare

            item = prepare(lm, tokenizer, config, example + 1)[example]
            text = prompt_text(
                tokenizer, item.example["prompt"], item.example.get("answer_prefix", ""), item.prompt_form == "chat"
            )
            if needle is None:
                reference = item.example["reference"]
                needle = str(reference[0] if isinstance(reference, list) else reference)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        if task is not None and ids[0].tolist() != item.input_ids:
            raise ValueError("this tokenizer's offsets do not reproduce the runner's tokens; trace a --prompt instead")
        positions = needle_positions(tokenizer, text, needle) if needle else []
        print(what_it_shows(policy))
        result = trace_generation(lm, ids.to(lm.device), policy, max_new_tokens, positions)
        result["needle"] = needle
        write_text(out, json.dumps(result) + "\n", "trace file")
        print(f"answer: {tokenizer.decode(result['tokens'], skip_special_tokens=True)!r}")
        if positions:
            held = [sum(step["needle"]) / len(step["needle"]) for step in result["steps"]]
            print("needle held, per step (mean over layers and KV heads): " + " ".join(f"{h:.2f}" for h in held))
        if plot is not None:
            from ..measure.trace_plot import plot_trace

            plot_trace(result, [tokenizer.decode([token]) for token in result["tokens"]], plot)
