"""What a run is (`RunConfig`: task x method x parameters x length x seed, and the model), and the checks made on
it before any model loads: the task and its options, the method and its budget at the length."""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import typing
from pathlib import Path

from ..core.policy import BUILT_IN, PROVIDERS, make_policy
from ..runtime.models import DEFAULT_MODEL, NAMED_MODELS
from .recovery import RecoveryTask
from .results_file import is_number, short_hash
from .tasks import TASKS, get_task
from .tasks.multi_turn import MultiTurnTask
from .tasks.ppl import PerplexityTask

EMBEDDED_MODEL = NAMED_MODELS[DEFAULT_MODEL].identity
EXTRA_TASKS = {"recovery": RecoveryTask()}


def all_tasks() -> dict:
    return {**TASKS, **EXTRA_TASKS}


def find_task(name: str):
    if name in EXTRA_TASKS:
        return EXTRA_TASKS[name]
    try:
        return get_task(name)
    except ValueError:
        raise ValueError(f"unknown task '{name}'; choose from: {', '.join(all_tasks())}") from None


def task_kind(task) -> str:
    if isinstance(task, RecoveryTask):
        return "recovery"
    if isinstance(task, PerplexityTask):
        return "ppl"
    if isinstance(task, MultiTurnTask):
        return "conversation"
    return "generation"


def check_task_options(name: str, options: dict) -> None:
    task = find_task(name)
    fixed = {"self", "tokenizer", "length", "num_examples", "seed", "chat"}  # chat: from the run, see `prepare`
    allowed = [p for p in inspect.signature(task.build).parameters if p not in fixed]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"task '{name}' has no option {', '.join(unknown)}; its options: {', '.join(allowed) or 'none'}"
        )
    hints = typing.get_type_hints(task.build)
    for option, value in options.items():
        kinds = typing.get_args(hints.get(option)) or (hints.get(option),)
        expected = next((kind for kind in (int, float) if kind in kinds), None)
        if expected is None or (value is None and type(None) in kinds):
            continue
        if not (is_number(value, integer=expected is int) and math.isfinite(value)):
            raise ValueError(
                f"task '{name}': option {option} must be {'an integer' if expected is int else 'a number'}, "
                f"got {value!r}"
            )
    check_values = getattr(task, "check_options", None)  # a task's own rules for its values (ppl: target_tokens)
    if check_values is not None:
        check_values(options)


def model_identity(path: str | os.PathLike | None) -> str:
    """What rows record as the model: a named model's identity (the default's when None), or the resolved path."""
    named = (
        NAMED_MODELS[DEFAULT_MODEL if path is None else str(path)]
        if path is None or str(path) in NAMED_MODELS
        else None
    )
    return named.identity if named else str(Path(path).resolve())


def check_budget_at_length(policy, length: int) -> None:
    """The method's budget at `length` tokens, checked before any model loads: one the method can use (`budget_for`
    refuses, e.g., a budget_ratio whose K cannot hold snapkv's window; prompts have at most `length` tokens, so what
    is refused here would be on every example), and below the length: a budget of `length` tokens or more keeps
    every token, and the row would be `full`'s under another name (a frontier point that measures nothing)."""
    policy.budget_for(length)
    budget = getattr(policy, "budget", None)
    if budget is not None and budget >= length:
        raise ValueError(
            f"method {policy.name}: budget {budget} is not below the length {length} (it would keep every token, "
            "as full does); give a smaller budget or a budget_ratio"
        )


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What determines a row's result (the number of examples does not: more examples extend a run)."""

    task: str
    method: str
    length: int
    seed: int = 0
    params: dict = dataclasses.field(default_factory=dict)
    task_options: dict = dataclasses.field(default_factory=dict)
    model: str = EMBEDDED_MODEL
    chat: bool = True
    dtype: str = "float32"

    def __post_init__(self):
        # a task whose options name outside state (ppl: files) pins it, so that the key identifies what was run
        resolve = getattr(all_tasks().get(self.task), "resolve_options", None)
        if resolve is not None:
            object.__setattr__(self, "task_options", resolve(self.task_options))

    def fields(self) -> dict:
        """What the key and the rows record (a task may record its options without machine-specific parts). A method
        that a plugin provides (one that replaces a built-in name included) adds its provider, so that its rows never
        count as the built-in's; a built-in method's key is what it always was."""
        record = getattr(all_tasks().get(self.task), "recorded_options", None)
        fields = dataclasses.asdict(self)
        provider = PROVIDERS.get(self.method, BUILT_IN)
        if provider != BUILT_IN:
            fields["provider"] = provider
        return fields if record is None else {**fields, "task_options": record(self.task_options)}

    def key(self) -> str:
        return short_hash(self.fields())

    def label(self) -> str:
        params = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.task} {self.method}{f'({params})' if params else ''} L={self.length}"

    def validate(self, model=None) -> None:
        """Everything that can be checked without the tokenizer: task, options, method, parameters, length."""
        task = find_task(self.task)
        check_task_options(self.task, self.task_options)
        check_budget_at_length(make_policy(self.method, **self.params), self.length)
        if task_kind(task) == "recovery" and self.method != "full":
            raise ValueError(f"task 'recovery' measures attention under 'full', got method '{self.method}'")
        if not isinstance(self.length, int) or isinstance(self.length, bool) or self.length < 1:
            raise ValueError(f"length must be a positive integer, got {self.length!r}")
        limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if limit is not None and self.length >= limit:
            raise ValueError(f"length {self.length} exceeds the model's context of {limit} tokens")
