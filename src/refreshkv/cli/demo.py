"""The demo prompt: the opening chapters of Pride and Prejudice (public domain, packaged) and a question on them."""

from __future__ import annotations

from ..texts import book_text

QUESTION = (
    "\n\nQuestion: what is the name of the young man who has taken Netherfield Park, and how much does he earn a year?"
)
# The lengths demo_prompt accepts with the embedded tokenizer, for `refreshkv demo --length`: the chat template and
# question take 57 tokens, at least 16 book tokens follow them, and the packaged text holds 6577.
MIN_LENGTH, MAX_LENGTH = 73, 6634


def demo_prompt(tokenizer, length: int):
    """Chat-formatted token ids of about `length` tokens: as much of the book as fits, then the question."""
    book = tokenizer.encode(book_text(), add_special_tokens=False)
    overhead = len(_chat_ids(tokenizer, QUESTION)[0])
    if length - overhead < 16:
        raise ValueError(f"demo length must be at least {overhead + 16} tokens")
    if length - overhead > len(book):
        raise ValueError(f"demo length must be at most {len(book) + overhead} tokens (the packaged text's size)")
    excerpt = tokenizer.decode(book[: length - overhead])
    return _chat_ids(tokenizer, excerpt + QUESTION)


def _chat_ids(tokenizer, text: str):
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
