"""The `refreshkv` command line. Bad input ends with one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import functools
import json
import sys
import warnings
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table
from typer.exceptions import TyperException

from ..core.policy import label_notes
from ..runtime.generation_settings import GenerationSettings
from ..runtime.output_files import WriteFailed
from ..runtime.prepare import check_runtime, load_checked
from .bench_commands import register as register_bench_commands
from .chat_command import register as register_chat_command
from .demo import MIN_LENGTH as DEMO_MIN_LENGTH
from .eval_commands import register as register_eval_commands
from .options import (
    BudgetOpt,
    CompileOpt,
    DeviceOpt,
    DtypeOpt,
    MethodOpt,
    ModelOpt,
    WeightLayoutOpt,
    method_options,
    read_prompt,
)
from .tables import print_table
from .trace_command import register as register_trace_command
from .train_commands import register as register_train_commands

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
out = Console()


def print_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


def fail(message: str) -> None:
    print_error(message)
    raise typer.Exit(2)


def user_errors(command):
    """Turn the library's input errors (ValueError and subclasses) into one line and exit code 2, and a write the
    system refused (a full disk: `WriteFailed`) into one line and exit code 1."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (ValueError, FileNotFoundError) as error:
            fail(str(error).splitlines()[0] if str(error) else type(error).__name__)
        except WriteFailed as error:
            print_error(str(error))
            raise typer.Exit(1) from None

    return wrapper


def encode(tokenizer, text: str, chat: bool):
    import torch

    if chat and not tokenizer.chat_template:
        raise ValueError(
            "this model has no chat template (a base model): leave out --chat to pass the prompt as plain text"
        )
    if chat:
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    else:
        ids = torch.tensor([tokenizer.encode(text)])
    return ids


def run_generations(model, tokenizer, ids, methods: list[tuple[str, dict]], settings: GenerationSettings) -> list[dict]:
    """Each (method, parameters) on the same prompt, with one shared prefill (`generate_many`)."""
    from ..core.policy import BUILT_IN, PROVIDERS, make_policy
    from ..measure.budget_report import budget_report
    from ..runtime.generate import generate_many

    policies = [make_policy(method, **params) for method, params in methods]
    outs = generate_many(model, ids.to(model.device), methods=policies, settings=settings)
    results = []
    for (method, params), result in zip(methods, outs):
        stats = result.stats()
        kept = budget_report(result.cache)
        results.append(
            {
                "method": method,
                "provider": PROVIDERS.get(method, BUILT_IN),
                "params": params,
                "text": tokenizer.decode(result.tokens[0], skip_special_tokens=True),
                **{k: v[0] if k in ("new_tokens", "prompt_tokens") else v for k, v in stats.items()},
                "budget_ratio": round(kept["budget_ratio"], 4),
                "budget_per_layer": kept["budget_per_layer"],
                "budget_per_head": kept["budget_per_head"],
                "ratio_per_layer": kept["ratio_per_layer"],
            }
        )
    return results


STAT_ROWS = (
    ("prompt tokens", "prompt_tokens"),
    ("new tokens", "new_tokens"),
    ("budget K", "budget"),
    ("kept prompt ratio", "budget_ratio"),
    ("prefill s (shared)", "prefill_s"),
    ("decode ms/token", "decode_ms_per_token"),
    ("full-step fraction", "full_step_fraction"),
    ("KV MB held", "kv_bytes_full"),
    ("KV MB attended/step", "kv_bytes_attended_mean"),
    ("finds the number", "finds_the_number"),  # the demo's needle
)


def stats_table(results: list[dict]) -> Table:
    table = Table(title="generation")
    table.add_column("")
    for result in results:
        table.add_column(result["method"] + label_notes(result["method"], result["provider"]), justify="right")
    for label, key in STAT_ROWS:
        if key not in results[0]:
            continue
        values = [r[key] for r in results]
        if key.startswith("kv_bytes"):
            values = [f"{v / 2**20:.1f}" for v in values]
        if key == "budget":  # 0: the method has no budget (full)
            values = [v or "-" for v in values]
        table.add_row(label, *map(str, values))
    return table


def show(results: list[dict], as_json: bool) -> None:
    if as_json:
        payload = results[0] if len(results) == 1 else {"runs": results}
        print(json.dumps(payload))
        return
    from ..measure.budget_report import budget_table

    for result in results:
        out.rule(f"[bold]{result['method'] + label_notes(result['method'], result['provider'])}[/bold]")
        out.print(result["text"], markup=False, highlight=False)
        if len(set(result["budget_per_layer"])) > 1:  # layer-adaptive methods: show what each layer kept
            print_table(out, budget_table(result, title=f"{result['method']}: kept prompt tokens"))
    print_table(out, stats_table(results))


@app.command()
@user_errors
@method_options()
def generate(
    method: MethodOpt = "refreshkv",
    model: ModelOpt = None,
    params: Optional[dict] = None,  # the method options (`method_options`)
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate.")] = 64,
    prompt: Annotated[Optional[str], typer.Option(help="Prompt text.")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(help="UTF-8 file holding the prompt.")] = None,
    chat: Annotated[bool, typer.Option(help="Wrap the prompt in the model's chat template.")] = False,
    compare: Annotated[Optional[str], typer.Option(help="Also run this method (e.g. full) on the same prompt.")] = None,
    sample: Annotated[bool, typer.Option(help="Sample instead of greedy decoding.")] = False,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (> 0; with --sample).")] = 1.0,
    top_p: Annotated[
        Optional[float], typer.Option(help="Nucleus sampling: keep tokens up to this mass, in (0, 1] (with --sample).")
    ] = None,
    seed: Annotated[Optional[int], typer.Option()] = None,
    eos_check_every: Annotated[
        Optional[int],
        typer.Option(
            min=1, help="Check every N steps whether the generation has ended (default: 1 on the CPU, 8 on a GPU)."
        ),
    ] = None,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
    compile: CompileOpt = False,
    weight_layout: WeightLayoutOpt = "stored",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
):
    """Generate from a prompt with a KV method and report its speed and KV memory."""
    from ..core.policy import make_policy

    params = params or {}
    policies = [make_policy(method, **params)]  # validate before loading anything
    if compare is not None:
        policies.append(make_policy(compare))
    settings = GenerationSettings(  # checked by the API's own rules, before anything loads
        max_new_tokens=max_new_tokens,
        do_sample=sample,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        eos_check_every=eos_check_every,
        compile=compile,
        progress=True,
    )
    text = read_prompt(prompt, prompt_file)
    lm, tokenizer, _ = load_checked(model, check_runtime(dtype, device, compile, weight_layout), policies)
    ids = encode(tokenizer, text, chat)
    methods = [(method, params)] + ([(compare, {})] if compare is not None else [])
    show(run_generations(lm, tokenizer, ids, methods, settings), as_json)


@app.command()
@user_errors
def demo(
    length: Annotated[
        int, typer.Option(min=DEMO_MIN_LENGTH, help="Prompt length in tokens (book text with the needle + question).")
    ] = 4096,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 16,
    budget: BudgetOpt = None,
    model: ModelOpt = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
):
    """The main job: a 7-digit number hidden in a long book passage, asked for with `full`, `refreshkv`, `snapkv`
    and `streamingllm` (K = L/8 unless --budget); each answer beside its decode time and KV memory."""
    from ..core.policy import make_policy
    from ..runtime.generate import check_length
    from .demo import METHODS, demo_prompt, found

    methods = [(name, {} if budget is None or name == "full" else {"budget": budget}) for name in METHODS]
    policies = [make_policy(name, **params) for name, params in methods]  # validate before loading anything
    lm, tokenizer, _ = load_checked(model, check_runtime(), policies)
    ids = demo_prompt(tokenizer, length)
    check_length(lm, ids.shape[1], max_new_tokens)
    results = run_generations(
        lm, tokenizer, ids, methods, GenerationSettings(max_new_tokens=max_new_tokens, progress=True)
    )
    for result in results:
        result["finds_the_number"] = found(result["text"])
    show(results, as_json)


# listed by --help in the order registered: after `demo`, before `methods`
register_bench_commands(app, user_errors)


@app.command()
def methods():
    """List the KV methods with their parameters and defaults."""
    from ..core.policy import BUILT_IN, METHODS, PROVIDERS

    table = Table(title="KV methods")
    for column in ("method", "parameters (default)", "presets (--preset NAME)", "what it does", "package"):
        table.add_column(column)
    for name in sorted(METHODS):
        cls = METHODS[name]
        params = ", ".join(f"{k}={'-' if v is None else v}" for k, v in cls.parameters().items()) or "-"
        presets = "; ".join(
            f"{preset}: " + ", ".join(f"{k}={v}" for k, v in values.items()) for preset, values in cls.presets.items()
        )
        table.add_row(name + label_notes(name), params, presets or "-", cls.summary, PROVIDERS.get(name, BUILT_IN))
    print_table(out, table)


@app.command()
@user_errors
def models(
    folder: Optional[str] = typer.Option(
        None,
        "--folder",
        metavar="NAME",
        help="print only the converted model folder of a named model (converting it on first use), e.g. for "
        "`vllm serve $(refreshkv models --folder smollm2-135m)`",
    ),
):
    """List the named models (--model NAME): installed or not, context, layers, the layers the methods act on."""
    from ..runtime.models import DEFAULT_MODEL, NAMED_MODELS

    if folder is not None:
        from ..runtime.loading import named_model_dir

        if folder not in NAMED_MODELS:
            raise ValueError(f"unknown model '{folder}'; the named models: {', '.join(NAMED_MODELS)}")
        print(named_model_dir(NAMED_MODELS[folder]))
        return

    table = Table(title="named models (--model NAME; a local model folder or a .gguf file works too)")
    for column in ("name", "installed", "context", "layers", "the methods act on", "what it is"):
        table.add_column(column)
    for name, model in NAMED_MODELS.items():
        installed = "yes" if model.installed() else f"no: {model.install}"
        label = f"{name} (default)" if name == DEFAULT_MODEL else name
        table.add_row(label, installed, f"{model.context:,}", str(model.layers), model.method_layers, model.summary)
    print_table(out, table)


register_chat_command(app, user_errors)
register_eval_commands(app, user_errors)
register_train_commands(app, user_errors)
register_trace_command(app, user_errors)


def main() -> None:
    """Console entry point: usage errors (bad option values, unknown options) also end in one line, exit code 2;
    a library's warning is one line too."""
    warnings.formatwarning = lambda message, category, *args, **kwargs: f"warning: {message}\n"
    try:
        code = app(standalone_mode=False)
    except TyperException as error:  # typer's own click: usage errors carry exit code 2
        if error.format_message():  # empty for `refreshkv` alone: the help has been printed instead
            print_error(error.format_message())
        code = getattr(error, "exit_code", 2)
    except typer.Abort:  # end of input at a prompt
        code = 130
    if code == 130:  # typer turns Ctrl-C (KeyboardInterrupt) into exit code 130, without a word
        print_error("interrupted")
    sys.exit(code or 0)
