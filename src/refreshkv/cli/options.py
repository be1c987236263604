"""Command-line options shared by every command: method parameters, NAME=VALUE pairs, dtype and device (checked by
runtime/prepare.py)."""

from __future__ import annotations

import functools
import inspect
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Optional

import typer

ModelOpt = Annotated[
    Optional[str],
    typer.Option(
        help="A named model (smollm2-135m, the default; gemma3-270m: see `refreshkv models`), a local model "
        "directory or a .gguf file."
    ),
]
MethodOpt = Annotated[str, typer.Option(help="KV method (see `refreshkv methods`).")]
BudgetOpt = Annotated[Optional[int], typer.Option(help="Tokens kept/attended per layer and KV head (K).")]
RatioOpt = Annotated[
    Optional[float], typer.Option(help="K as a fraction of the prompt length, in (0, 1] (papers: 0.125).")
]
StrideOpt = Annotated[Optional[int], typer.Option(help="Fixed schedule: a full-attention step every S decode steps.")]
QcOpt = Annotated[Optional[int], typer.Option(help="Dynamic schedule: compare queries every N steps (default 10).")]
ThresholdOpt = Annotated[
    Optional[float], typer.Option(help="refreshkv: full step when query cosine < s (default 0.85); refreekv: T.")
]
KernelOpt = Annotated[Optional[int], typer.Option(help="Max-pooling kernel over positions (odd).")]
WindowOpt = Annotated[
    Optional[int], typer.Option(help="Observation window: last prompt tokens whose attention selects.")
]
AggOpt = Annotated[Optional[str], typer.Option(help="GQA aggregation of scores: max, mean or first.")]
PresetOpt = Annotated[
    Optional[str],
    typer.Option(help="A named parameter set of the method, e.g. paper (the seed paper's; `refreshkv methods`)."),
]
ParamOpt = Annotated[list[str], typer.Option("--param", help="Any other method parameter, NAME=VALUE (repeatable).")]
DtypeOpt = Annotated[str, typer.Option(help="float32 or bfloat16.")]
DeviceOpt = Annotated[str, typer.Option(help="cpu or cuda.")]
ThreadsOpt = Annotated[
    Optional[int], typer.Option(min=1, help="torch CPU threads, at most the CPU cores this process may use.")
]
WeightLayoutOpt = Annotated[
    str,
    typer.Option(
        help="stored (as the checkpoint lies), fastest (each weight shape's layout timed on this machine; "
        "see runtime/weight_layout.py) or packed (oneDNN's layout, CPU only; runtime/packed_linear.py)."
    ),
]
ForceOpt = Annotated[bool, typer.Option(help="Replace output files that exist (otherwise refused before any work).")]
CompileOpt = Annotated[
    bool,
    typer.Option(
        help="Run decode steps under torch.compile (opt-in: the first steps pay for compilation; see compiled.py)."
    ),
]


def parse_value(raw: str):
    """A command-line value as int, finite float, true/false, or text (which a numeric parameter then refuses)."""
    for kind in (int, float):
        try:
            value = kind(raw)
        except ValueError:
            continue
        if math.isfinite(value):
            return value
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    return raw


def parse_pairs(pairs: list[str], option: str, repeat_as_list: bool = False) -> dict:
    """NAME=VALUE pairs; with `repeat_as_list` a repeated NAME gives a list, otherwise it is an error."""
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


# The method options, defined once: name -> (typer annotation, default). `method_options` gives them to a command.
METHOD_OPTIONS: dict[str, tuple[object, object]] = {
    "budget": (BudgetOpt, None),
    "budget_ratio": (RatioOpt, None),
    "stride": (StrideOpt, None),
    "qc_stride": (QcOpt, None),
    "threshold": (ThresholdOpt, None),
    "kernel": (KernelOpt, None),
    "window": (WindowOpt, None),
    "aggregation": (AggOpt, None),
    "preset": (PresetOpt, None),
    "param": (ParamOpt, []),
}


def method_params(param: Sequence[str] = (), **given) -> dict:
    """The method parameters given on the command line: the options in `given` that are set (unset ones are left
    to the method's defaults), and the --param NAME=VALUE pairs; a parameter given both ways is refused."""
    given = {k: v for k, v in given.items() if v is not None}
    extra = parse_pairs(list(param), "--param")
    both = sorted(set(given) & set(extra))
    if both:
        name = both[0]
        raise ValueError(f"{name} is given both as --{name.replace('_', '-')} and as --param {name}; give it once")
    return {**given, **extra}


def method_options(*names: str):
    """Give a command the method options `names` (all of METHOD_OPTIONS when none are named), in place of its
    `params` parameter: typer sees each option in the command's signature, and the command receives what was given
    as one dict, `params` (`method_params`)."""
    chosen = names or tuple(METHOD_OPTIONS)

    def decorate(command):
        signature = inspect.signature(command, eval_str=True)
        own = list(signature.parameters.values())
        at = [p.name for p in own].index("params")
        options = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=METHOD_OPTIONS[name][1], annotation=kind)
            for name in chosen
            for kind in [METHOD_OPTIONS[name][0]]
        ]
        keyword_only = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        parameters = keyword_only[:at] + options + keyword_only[at + 1 :]

        @functools.wraps(command)
        def with_params(**values):
            given = {name: values.pop(name) for name in chosen}
            return command(**values, params=method_params(**given))

        with_params.__signature__ = signature.replace(parameters=parameters)
        with_params.__annotations__ = {p.name: p.annotation for p in parameters}
        return with_params

    return decorate


def read_prompt(prompt: Optional[str], prompt_file: Optional[Path], what: str = "prompt") -> str:
    """The prompt given as text, or read once from a file: a regular file, a pipe (`<(command)`, a FIFO) or, for
    `-`, standard input; `what` names it in a refusal (chat's document)."""
    if (prompt is None) == (prompt_file is None):
        raise ValueError("give exactly one of --prompt TEXT or --prompt-file FILE")
    if prompt_file is not None:
        if str(prompt_file) == "-":
            data = sys.stdin.buffer.read()
        elif prompt_file.is_file() or prompt_file.is_fifo():
            try:
                data = prompt_file.read_bytes()
            except OSError as error:
                raise ValueError(f"prompt file '{prompt_file}' cannot be read ({error.strerror or error})") from None
        else:
            problem = "is not a file or a pipe" if prompt_file.exists() else "does not exist"
            raise ValueError(f"prompt file '{prompt_file}' {problem}; give a UTF-8 text file, a pipe, or - for stdin")
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"prompt file '{prompt_file}' is not UTF-8 text (byte {error.start})") from None
    if not prompt.strip():
        raise ValueError(f"the {what} is empty" + (f" ({prompt_file})" if prompt_file is not None else ""))
    return prompt
