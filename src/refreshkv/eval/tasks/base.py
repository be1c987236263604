"""What an evaluation task is, the example dicts it produces, and prompt sizing in tokens."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable
from typing import Any, NotRequired, Protocol, TypedDict


class Example(TypedDict):
    """One evaluation item; a plain JSON-serialisable dict at run time."""

    id: str  # unique and stable for (task, length, seed, index)
    task: str  # e.g. "ruler/niah_single_1"
    prompt: str  # the full user message; the runner applies the chat template
    reference: Any  # whatever the task's scorer needs
    max_new_tokens: int
    answer_prefix: NotRequired[str]  # appended after the assistant turn's start, as RULER does
    input_ids: NotRequired[list[int]]  # ppl only: context followed by the tokens to score
    target_start: NotRequired[int]  # ppl only: index of the first scored token in input_ids
    source_id: NotRequired[str]  # the benchmark's own id of the item, when it has one
    turns: NotRequired[list[dict]]  # a conversation's questions (question, answer_prefix, reference, max_new_tokens)


class Task(Protocol):
    """A task; a `build` that takes a `chat` argument is told by the runner whether prompts get the chat template.
    A task may also have `check_options(options)`, which the runner calls before any model loads to refuse option
    values that `build` could only refuse later (ppl's `target_tokens`)."""

    name: str

    def build(self, tokenizer, length: int, num_examples: int, seed: int, **options) -> list[Example]: ...

    def score(self, prediction: str, example: Example) -> float: ...


def building(num_examples: int, task: str) -> Iterable[int]:
    """The indices of the examples a task builds, with a progress bar on stderr once building has taken 2 s (many
    examples at a long length take minutes before the first one runs)."""
    from tqdm.auto import tqdm

    return tqdm(range(num_examples), desc=f"{task}: building examples", unit="ex", delay=2, leave=False)


def check_distinct(task: str, num_examples: int, distinct: int, what: str) -> None:
    """Refuse more examples than the task can make distinct (`what`: where they come from), in one line."""
    if num_examples > distinct:
        raise ValueError(
            f"task '{task}': num_examples (--num-examples) {num_examples} is more than the {distinct} distinct "
            f"examples {what}; give at most {distinct}"
        )


def example_id(task: str, length: int, seed: int, index: int) -> str:
    return f"{task}/L{length}/s{seed}/{index}"


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def encode_user_turn(tokenizer, prompt: str, answer_prefix: str, chat: bool) -> list[int]:
    """The tokens the model is given: the chat-templated user message (or the raw prompt) and the answer prefix."""
    if chat:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; use --no-chat")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer.encode(text + answer_prefix, add_special_tokens=False))
    return list(tokenizer.encode(prompt + answer_prefix))


def fit_to_length(
    render: Callable[[int], str],
    tokenizer,
    length: int,
    max_units: int,
    count: Callable[[str], int] | None = None,
) -> tuple[int, str]:
    """The largest n in [0, max_units] whose prompt `render(n)` fits in `length` tokens, and that prompt.

    `count` says how many of the `length` tokens a prompt uses (default: its own tokens); a task whose budget
    also holds the chat template and the generated tokens passes its own.

    `render(n)` is a prompt holding n filler units (words, sentences, documents...), so its token
    count grows about linearly with n: interpolation finds n in a few tokenizer calls even for long
    prompts; after a few steps we fall back to bisection in case the growth is far from linear.
    """
    if count is None:
        count = functools.partial(count_tokens, tokenizer)
    prompt = render(0)
    tokens_zero = tokens_lo = count(prompt)
    if tokens_zero > length:
        raise ValueError(f"length {length} is too small: the prompt needs {tokens_zero} tokens without any filler")
    lo, hi = 0, max_units + 1  # render(lo) fits; render(hi) does not (or is out of range)
    tokens_hi = None
    for step in itertools.count():
        if hi - lo <= 1:
            return lo, prompt
        if step >= 8:
            n = (lo + hi) // 2
        elif tokens_hi is not None:
            n = lo + int((length - tokens_lo) * (hi - lo) / (tokens_hi - tokens_lo))
        elif lo == 0:
            n = 16  # a small probe to learn the tokens per unit
        else:  # extrapolate a little past the target so that the next step has a bracket
            per_unit = max(tokens_lo - tokens_zero, 1) / lo
            n = lo + int(1.02 * (length - tokens_lo) / per_unit) + 1
        n = min(max(n, lo + 1), hi - 1)
        candidate = render(n)
        tokens = count(candidate)
        if tokens <= length:
            lo, tokens_lo, prompt = n, tokens, candidate
        else:
            hi, tokens_hi = n, tokens
