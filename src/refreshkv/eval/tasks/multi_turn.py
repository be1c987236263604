"""Multi-turn tasks: one long context, several questions asked one after another over one cache (issue 32).

- `multiturn/niah`: the haystack holds `needles` (6) sentences "One of the special magic numbers for {key} is:
  {value}." (RULER's niah_multikey sentence, 7-digit values, two-word keys) at evenly spread depths; turn k asks
  for the value of one key, in a shuffled order, with RULER's answer prefix. A turn scores 1 if its value is in the
  answer (RULER's string match).
- `multiturn/chain`: the needles chain keys, "The value of {key_i} is {key_i+1}."; turn 1 asks for the value of the
  first key, every later turn for "the value of the key you just named": the question depends on the previous
  answer, which stays in the context. A turn scores 1 if the next key of the chain is in its answer (a wrong hop
  makes the later turns fail, as a conversation would).

The haystack is the packaged book text (public domain), repeated as needed and cut to the length asked for, the
needles inserted between sentences. Each example is a dict with the context as `prompt` and its `turns` (question,
answer prefix, reference, new tokens); the runner prefills the context once per method and asks the turns in order
(runtime/conversation.py), one row per turn (`turn` = 1..N). Choices: the context is question-agnostic (no question
is prefilled with it: every question, the first too, is appended), the answers stay in the context. Option
`question`: `prefixed` (default) opens each answer with the prefix above; `bare` asks the question alone, so the
model writes its own words before the value, as users' questions are asked.
"""

from __future__ import annotations

import random

from refreshkv.eval.sources import english_words
from refreshkv.eval.tasks.base import Example, building, example_id, fit_to_length
from refreshkv.texts import book_text

MAX_NEW_TOKENS = 24
NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}."
NIAH_QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
NIAH_PREFIX = "The special magic number for {key} mentioned in the provided text is"
CHAIN_NEEDLE = "The value of {key} is {value}."
CHAIN_FIRST = "What is the value of {key} mentioned in the provided text?"
CHAIN_NEXT = "What is the value of the key you just named, as the provided text gives it?"
CHAIN_PREFIX = "The value is"
QUESTION_FORMS = ("prefixed", "bare")


def haystack(words: int, needles: list[str]) -> str:
    """`words` words of the book (repeated), with the needles after sentences at evenly spread depths."""
    book = book_text().split()
    text = [book[i % len(book)] for i in range(words)]
    out, start = [], 0
    for k, needle in enumerate(needles, 1):
        cut = next((i + 1 for i in range(words * k // (len(needles) + 1), words) if text[i].endswith(".")), words)
        out += text[start:cut] + [needle]
        start = cut
    return " ".join(out + text[start:])


class MultiTurnTask:
    """`multiturn/niah` or `multiturn/chain` (see the module docstring); options `needles` (turns), default 6, and
    `question` (prefixed or bare)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.name = f"multiturn/{kind}"

    def build(
        self, tokenizer, length: int, num_examples: int, seed: int, needles: int = 6, question: str = "prefixed"
    ) -> list[Example]:
        self.check_options({"needles": needles, "question": question})
        examples = [
            self._example(tokenizer, length, seed, index, needles) for index in building(num_examples, self.name)
        ]
        if question == "bare":
            for example in examples:
                for turn in example["turns"]:
                    turn["answer_prefix"] = ""
        return examples

    def check_options(self, options: dict) -> None:
        """The option values that the task alone decides, checked before any model is loaded."""
        needles = options.get("needles", 6)
        if not isinstance(needles, int) or isinstance(needles, bool) or not 1 <= needles <= 16:
            raise ValueError(f"task '{self.name}': needles must be an integer in [1, 16], got {needles!r}")
        question = options.get("question", "prefixed")
        if question not in QUESTION_FORMS:
            raise ValueError(
                f"task '{self.name}': unknown question form {question!r}; choose from: {', '.join(QUESTION_FORMS)}"
            )

    def _example(self, tokenizer, length: int, seed: int, index: int, needles: int) -> Example:
        rng = random.Random(f"{self.name}/{seed}/{index}")
        words = list(english_words(self.name))
        rng.shuffle(words)
        keys = [f"{words[2 * i]}-{words[2 * i + 1]}" for i in range(needles + 1)]
        if self.kind == "niah":
            values = [str(rng.randrange(1_000_000, 10_000_000)) for _ in range(needles)]
            sentences = [NIAH_NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)]
            order = list(range(needles))
            rng.shuffle(order)
            turns = [
                {
                    "question": NIAH_QUESTION.format(key=keys[i]),
                    "answer_prefix": NIAH_PREFIX.format(key=keys[i]),
                    "reference": values[i],
                    "max_new_tokens": MAX_NEW_TOKENS,
                }
                for i in order
            ]
        else:
            sentences = [CHAIN_NEEDLE.format(key=keys[i], value=keys[i + 1]) for i in range(needles)]
            rng.shuffle(sentences)  # the chain's links are not in order in the context
            turns = [
                {
                    "question": CHAIN_FIRST.format(key=keys[0]) if i == 0 else CHAIN_NEXT,
                    "answer_prefix": CHAIN_PREFIX,
                    "reference": keys[i + 1],
                    "max_new_tokens": MAX_NEW_TOKENS,
                }
                for i in range(needles)
            ]
        asked = sum(MAX_NEW_TOKENS + 3 * len(t["question"].split()) + 16 for t in turns)  # room for the turns
        if length - asked < 64:
            raise ValueError(
                f"task '{self.name}': length {length} leaves no room for a context besides {needles} turns"
            )
        _, prompt = fit_to_length(lambda n: haystack(n, sentences), tokenizer, length - asked, 20 * length)
        return Example(
            id=example_id(self.name, length, seed, index),
            task=self.name,
            prompt=prompt,
            reference=[t["reference"] for t in turns],
            max_new_tokens=MAX_NEW_TOKENS,
            turns=turns,
        )

    def score_turn(self, prediction: str, turn: dict) -> float:
        """1 if the turn's reference (a number, or a key) is in the answer (case and spaces ignored)."""
        answer = prediction.lower().replace(" ", "")
        return float(turn["reference"].lower() in answer)

    def score(self, prediction: str, example: Example) -> float:
        """A whole conversation's answers joined: the share of its turns answered (for a caller without turns)."""
        return sum(self.score_turn(prediction, turn) for turn in example["turns"]) / len(example["turns"])
