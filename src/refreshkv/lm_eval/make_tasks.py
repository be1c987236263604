"""`python -m refreshkv.lm_eval.make_tasks`: the offline tasks' data (tasks/data/*.jsonl), made by the package's own
task code with the default model's tokenizer, so that `refreshkv eval` builds the same examples:

- `niah_<subtask>_<form>.jsonl`: RULER's niah_single_1, niah_multikey_1 and niah_multivalue (eval/tasks/ruler.py)
  with `question` bare (no answer prefix) or prefixed, sized for the chat template: `refreshkv eval --task
  ruler/<subtask> --length 2048 --seed 0 --task-option question=<form> --task-option max_new_tokens=32` builds
  example i of the file as its example i.
- `numbers.jsonl`: a multiple choice over a long passage: niah_single_2's essay with its one number (built as
  above, question bare, max_new_tokens 64, which leaves room for the choices), then "which of these four numbers
  appeared in the text", the choices being the number and three other 7-digit numbers absent from the text.
- `keyed_numbers.jsonl`: a multiple choice that needs the right needle: niah_multikey_1's prefixed examples (above),
  the continuation of the answer prefix chosen among the four numbers the text holds, one per key (the asked key's
  is right; the other three are its distractor needles').
"""

from __future__ import annotations

import json
import random
import re

from ..eval.tasks.ruler import RulerTask
from ..runtime.loading import load_model
from .task_data import DATA_DIR

NIAH = ("niah_single_1", "niah_multikey_1", "niah_multivalue")
FORMS = ("bare", "prefixed")
LENGTH, EXAMPLES, SEED, NEW_TOKENS = 2048, 20, 0, 32
CHOICES_ROOM = 64  # tokens the numbers task keeps free for its question and choices
NEEDLE_VALUE = re.compile(r"One of the special magic numbers for [\w-]+ is: (\d+)\.")  # RULER's needle sentence


def niah(tokenizer, subtask: str, form: str, new_tokens: int = NEW_TOKENS) -> list[dict]:
    return RulerTask(subtask).build(tokenizer, LENGTH, EXAMPLES, SEED, question=form, max_new_tokens=new_tokens)


def numbers(tokenizer) -> list[dict]:
    """Each niah_single_2 example with four numbers to choose from (`choices`) and the right one's index (`label`)."""
    docs = []
    for index, example in enumerate(niah(tokenizer, "niah_single_2", "bare", CHOICES_ROOM)):
        right = example["reference"][0]
        rng = random.Random(f"numbers/{SEED}/{index}")
        choices = {right}
        while len(choices) < 4:
            candidate = str(rng.randrange(1_000_000, 10_000_000))
            if candidate not in example["prompt"]:
                choices.add(candidate)
        ordered = sorted(choices)
        rng.shuffle(ordered)
        label = ordered.index(right)
        docs.append({"id": example["id"], "prompt": example["prompt"], "choices": ordered, "label": label})
    return docs


def keyed_numbers(tokenizer) -> list[dict]:
    """Each niah_multikey_1 example (prefixed) with the text's four needle numbers to choose from, in the text's order
    (`choices`), and the asked key's index (`label`)."""
    docs = []
    for example in niah(tokenizer, "niah_multikey_1", "prefixed"):
        values = NEEDLE_VALUE.findall(example["prompt"])
        right = example["reference"][0]
        if len(values) != 4 or len(set(values)) != 4 or right not in values:
            raise ValueError(f"{example['id']}: expected four distinct needle numbers, one of them {right}: {values}")
        docs.append({**example, "choices": values, "label": values.index(right)})
    return docs


def write(name: str, docs: list[dict]) -> None:
    with (DATA_DIR / name).open("w", encoding="utf-8") as file:
        for doc in docs:
            file.write(json.dumps(doc, ensure_ascii=False) + "\n")


def main() -> None:
    _, tokenizer = load_model()
    for subtask in NIAH:
        for form in FORMS:
            write(f"{subtask}_{form}.jsonl", niah(tokenizer, subtask, form))
    write("numbers.jsonl", numbers(tokenizer))
    write("keyed_numbers.jsonl", keyed_numbers(tokenizer))


if __name__ == "__main__":
    main()
