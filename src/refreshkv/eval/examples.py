"""A run's examples, built by its task and encoded for the model (`Prepared`), each checked to fit the model before
anything is run."""

from __future__ import annotations

import dataclasses
import inspect

from tqdm.auto import tqdm

from ..runtime.conversation import TurnFormat
from ..runtime.generate import check_length
from .config import RunConfig, find_task, task_kind
from .tasks.base import encode_user_turn


@dataclasses.dataclass
class Prepared:
    example: dict
    input_ids: list[int]
    prompt_form: str = "chat"  # "chat": the model's chat template; "base": the task's text and answer prefix


def uses_chat(tokenizer, requested: bool) -> bool:
    """Prompts are chat-templated when the run asks for it and the model has a template; a base model (no
    template, e.g. Gemma 3 270M) gets the task's base form, as RULER prompts base models."""
    return requested and getattr(tokenizer, "chat_template", None) is not None


def encode_prompt(tokenizer, example: dict, chat: bool) -> list[int]:
    """The chat-templated user message (or the raw prompt) followed by the example's answer prefix."""
    return encode_user_turn(tokenizer, example["prompt"], example.get("answer_prefix", "") or "", chat)


def prepare(model, tokenizer, config: RunConfig, num_examples: int) -> list[Prepared]:
    """Build and encode the examples, checking that every one fits the model, before anything is run."""
    config.validate(model)
    task = find_task(config.task)
    options = dict(config.task_options)
    chat = uses_chat(tokenizer, config.chat)
    if "chat" in inspect.signature(task.build).parameters:  # its length budget counts the chat template
        options["chat"] = chat
    examples = task.build(tokenizer, config.length, num_examples, config.seed, **options)
    prepared = []
    for example in tqdm(examples, desc=f"{config.task}: encoding examples", unit="ex", delay=2, leave=False):
        if task_kind(task) == "generation":
            ids = encode_prompt(tokenizer, example, chat)
            check_length(model, len(ids), example["max_new_tokens"])
        elif task_kind(task) == "conversation":
            form = TurnFormat(tokenizer, chat)
            ids = form.context(example["prompt"])[0].tolist()
            total = len(ids) + sum(
                form.question(turn["question"], i == 0, answer_prefix=turn["answer_prefix"]).shape[1]
                + turn["max_new_tokens"]
                + 1
                for i, turn in enumerate(example["turns"])
            )
            limit = model.config.max_position_embeddings
            if total > limit:
                raise ValueError(
                    f"task '{config.task}': a conversation of {total} tokens (context, questions and "
                    f"answers) exceeds the model's context of {limit} tokens; give a smaller length"
                )
        else:
            ids = list(example["input_ids"])
            check_length(model, example["target_start"], len(ids) - example["target_start"])  # as `generate` checks
        prepared.append(Prepared(example, ids, "chat" if chat else "base"))
    return prepared
