"""What the offline task YAMLs call (through tasks/local.py, as lm-eval's `!function local.NAME` needs a file beside
them): `load` reads a task's JSONL into the `test` split, `score_ruler` scores an answer with RULER's metric."""

from __future__ import annotations

import json
from pathlib import Path

DATA_DIR = Path(__file__).parent / "tasks" / "data"


class TaskDataError(FileNotFoundError):
    """A task's data file is missing; the message names the path looked in."""


def load(data_file: str, **metadata):
    """`data_file` (relative to tasks/data/, or absolute) as lm-eval's dataset; `metadata`: what lm-eval passes to
    every custom dataset (its --metadata and the model arguments), not read."""
    import datasets

    path = DATA_DIR / data_file  # an absolute `data_file` stays itself
    if not path.is_file():
        raise TaskDataError(f"task data '{data_file}' not found: looked for {path}")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def score_ruler(doc: dict, results: list[str]) -> dict[str, float]:
    """The answer scored as `refreshkv eval` scores it (RULER's per-sample metric for the example's subtask)."""
    from ..eval.tasks.ruler import RulerTask

    return {"score": RulerTask().score(results[0], doc)}
