"""Registry of the evaluation tasks, by name.

`ruler` builds the 13 RULER subtasks round-robin (or one, with the option `subtask`), and each is
also registered as `ruler/<subtask>`; the others are `chain_of_key`, `html_to_tsv`, `longbench`,
`ppl` and the conversations `multiturn/niah` and `multiturn/chain`. See each module's docstring for its options.
"""

from __future__ import annotations

from refreshkv.eval.tasks.base import Example, Task
from refreshkv.eval.tasks.chain_of_key import ChainOfKeyTask
from refreshkv.eval.tasks.html_to_tsv import HtmlToTsvTask
from refreshkv.eval.tasks.longbench import LongBenchTask
from refreshkv.eval.tasks.multi_turn import MultiTurnTask
from refreshkv.eval.tasks.ppl import PerplexityTask
from refreshkv.eval.tasks.ruler import SUBTASKS, RulerTask

TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        RulerTask(),
        *(RulerTask(subtask) for subtask in SUBTASKS),
        ChainOfKeyTask(),
        HtmlToTsvTask(),
        LongBenchTask(),
        PerplexityTask(),
        MultiTurnTask("niah"),
        MultiTurnTask("chain"),
    )
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task '{name}'; choose from: {', '.join(TASKS)}")
    return TASKS[name]


__all__ = ["TASKS", "Example", "Task", "get_task"]
