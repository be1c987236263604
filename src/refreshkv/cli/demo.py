"""The demo: a 7-digit number hidden in the middle of a long book passage, asked for at the end.

The passage is the packaged opening of Pride and Prejudice (public domain), repeated to the length asked for; the
needle sentence sits at half depth. A chat model gets the passage and the question as a user turn and the answer's
opening words as the start of its reply; a base model (no chat template, e.g. Gemma 3 270M) gets the same text as a
completion. Every method's answer is shown beside its cost, so quality and speed are seen together.
"""

from __future__ import annotations

from ..eval.tasks.base import encode_user_turn, fit_to_length
from ..texts import book_text

NUMBER = "7290413"
NEEDLE = f"The special magic number is {NUMBER}."
QUESTION = "\n\nQuestion: what is the special magic number mentioned in the text above?"
ANSWER_PREFIX = "The special magic number mentioned in the text above is"
METHODS = ("full", "refreshkv", "snapkv", "streamingllm")
MIN_LENGTH = 128  # prompt tokens: the question, the answer prefix and some text around the needle


def passage(words: int) -> str:
    """`words` words of the book (repeated as needed) with the needle sentence after the sentence at half length."""
    book = book_text().split()
    text = [book[i % len(book)] for i in range(words)]
    middle = next((i + 1 for i in range(words // 2, words) if text[i].endswith(".")), words)
    return " ".join(text[:middle] + [NEEDLE] + text[middle:])


def demo_prompt(tokenizer, length: int):
    """(1, n) token ids, n <= `length`: as much passage as fits, then the question and the answer's opening words
    (chat-templated where the tokenizer has a template)."""
    import torch

    chat = getattr(tokenizer, "chat_template", None) is not None
    answer = ANSWER_PREFIX if chat else "\n" + ANSWER_PREFIX  # a reply starts its own turn; a completion a new line

    def count(prompt: str) -> int:
        return len(encode_user_turn(tokenizer, prompt, answer, chat))

    if length < MIN_LENGTH:
        raise ValueError(f"demo length must be at least {MIN_LENGTH} tokens, got {length}")
    _, prompt = fit_to_length(lambda words: passage(words) + QUESTION, tokenizer, length, 10 * length, count)
    if NUMBER not in prompt:
        raise ValueError(f"demo length must be at least {MIN_LENGTH} tokens (the needle did not fit in {length})")
    return torch.tensor([encode_user_turn(tokenizer, prompt, answer, chat)])


def found(answer: str) -> bool:
    return NUMBER in answer.replace(" ", "")
