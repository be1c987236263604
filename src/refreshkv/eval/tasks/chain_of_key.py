"""Chain-of-key, the synthetic task of the RefreshKV paper (appendix A.6, Tables 11 and 12).

The context lists shuffled keys of W words joined by '-' ("Name of key: toga-roommate ..."); the
model must write a chain of T keys from the context where each key starts with the previous key's
last word. Options: `words` (W, default 2) and `chain_length` (T, default 10).

Choices where the paper leaves room:
- Keys are laid out as cycles over distinct words (wonderwords nouns, adjectives and verbs): in a
  cycle w0 w1 ... the keys are w0-w1, w1-w2, ..., and the last key ends with w0. Every word starts
  exactly one key, so every key has exactly one successor, as the paper requires, and a chain
  of any length can start anywhere. Cycles hold 2T keys (the last one up to 4T - 1), so a valid
  chain of T keys never repeats a key. The vocabulary (about 8,000 words) caps the context at
  roughly 8,000 / (W - 1) keys, i.e. about 70k tokens for W = 2.
- The prompt is Table 11's wording, including its "comma.You" spacing; its example chain is not the
  paper's fixed one but T keys of W words drawn from words that are not in the context, so that it
  fits any W and T. T is spelled out in "Chain of ten keys:" up to twenty.
- Scoring reads the predicted chain as the prediction's words joined by '-' (`parse_chain`), so list
  numbers, bullets, quotes, Markdown emphasis, trailing punctuation, a preamble without hyphenated
  words and any separator (comma, line break, space, arrow) are ignored, as is case; only the first T
  keys count. Every hyphenated word counts, so a hyphenated word in prose (e.g. "well-known") before or
  inside the chain ends it, as any key that is not in the context does.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from refreshkv.eval.sources import english_words
from refreshkv.eval.tasks.base import Example, building, example_id, fit_to_length

PROMPT = (
    "You are given many keys composed of a few words. Your task is to generate a chain of {count} keys such that "
    "the first word of the current key is the last word of the previous key. Separate the keys with comma. "
    "Example: {example}. You must generate keys that are in the context. DO NOT REPEAT THE EXAMPLE. "
    "Context:{context} "
    "You are given many keys composed of a few words. Your task is to generate a chain of {count} keys such that "
    "the first word of the current key is the last word of the previous key. Separate the keys with comma."
    "You must generate keys that are in the context. Chain of {count_word} keys:"
)

NUMBER_WORDS = (
    *("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"),
    *("eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"),
)


def keys_along(words: Sequence[str], words_per_key: int, cyclic: bool) -> list[str]:
    """Consecutive keys over `words`, each starting with the previous key's last word.

    With `cyclic`, the last key ends with the first word, closing the cycle.
    """
    step = words_per_key - 1
    stop = len(words) if cyclic else len(words) - step
    ring = list(words) + list(words[:step])
    return ["-".join(ring[start : start + words_per_key]) for start in range(0, stop, step)]


def _cycle_keys(words: Sequence[str], num_keys: int, words_per_key: int, cycle_keys: int) -> list[str]:
    """`num_keys` keys in cycles of `cycle_keys` keys; the remainder joins the last cycle."""
    step = words_per_key - 1
    num_cycles = max(num_keys // cycle_keys, 1)
    keys = []
    for cycle in range(num_cycles):
        first = cycle * cycle_keys
        last = num_keys if cycle == num_cycles - 1 else first + cycle_keys
        keys += keys_along(words[first * step : last * step], words_per_key, cyclic=True)
    return keys


# Context keys are plain ASCII letter words joined by '-'; models also write Unicode hyphens or an en dash.
KEY_PATTERN = re.compile(r"[a-z]+(?:-[a-z]+)+", flags=re.IGNORECASE)
DASHES = str.maketrans({"\u2010": "-", "\u2011": "-", "\u2013": "-"})


def parse_chain(prediction: str) -> list[str]:
    """The keys of a predicted chain, in order and lower case: every run of letter words joined by '-'."""
    return [key.lower() for key in KEY_PATTERN.findall(prediction.translate(DASHES))]


def chain_score(prediction: str, keys: Sequence[str], chain_length: int) -> float:
    """Length of the valid prefix of the predicted chain, divided by `chain_length`.

    A key is valid if it is in the context (`keys`) and, after the first, starts with the previous
    key's last word.
    """
    context_keys = {key.lower() for key in keys}
    predicted = parse_chain(prediction)[:chain_length]
    valid = 0
    for previous, key in zip([None, *predicted], predicted):
        if key not in context_keys or (previous is not None and key.split("-")[0] != previous.split("-")[-1]):
            break
        valid += 1
    return valid / chain_length


class ChainOfKeyTask:
    name = "chain_of_key"

    def build(
        self, tokenizer, length: int, num_examples: int, seed: int, words: int = 2, chain_length: int = 10
    ) -> list[Example]:
        if words < 2 or chain_length < 1:
            raise ValueError(f"chain_of_key needs words >= 2 and chain_length >= 1, got {words} and {chain_length}")
        return [
            self._example(tokenizer, length, seed, index, words, chain_length)
            for index in building(num_examples, self.name)
        ]

    def _example(self, tokenizer, length: int, seed: int, index: int, words: int, chain_length: int) -> Example:
        rng = random.Random(f"{self.name}/{seed}/{index}")
        vocabulary = list(english_words(self.name))
        rng.shuffle(vocabulary)
        example_words = chain_length * (words - 1) + 1
        example_chain = ", ".join(keys_along(vocabulary[:example_words], words, cyclic=False))
        context_words = vocabulary[example_words:]
        cycle_keys = 2 * chain_length
        max_extra_keys = len(context_words) // (words - 1) - cycle_keys
        order_seed = str(rng.random())

        def keys_for(extra_keys: int) -> list[str]:
            keys = _cycle_keys(context_words, cycle_keys + extra_keys, words, cycle_keys)
            random.Random(order_seed).shuffle(keys)
            return keys

        extra_keys, prompt = fit_to_length(
            lambda n: self._prompt(keys_for(n), example_chain, chain_length), tokenizer, length, max_extra_keys
        )
        if extra_keys == max_extra_keys:
            raise ValueError(
                f"chain_of_key cannot reach {length} tokens: the word list only makes "
                f"{max_extra_keys + cycle_keys} keys of {words} words"
            )
        return Example(
            id=example_id(self.name, length, seed, index),
            task=self.name,
            prompt=prompt,
            reference={"keys": sorted(keys_for(extra_keys)), "chain_length": chain_length},
            max_new_tokens=4 * words * chain_length + 16,  # room for words of several tokens
        )

    @staticmethod
    def _prompt(keys: Sequence[str], example_chain: str, chain_length: int) -> str:
        count_word = NUMBER_WORDS[chain_length] if chain_length < len(NUMBER_WORDS) else str(chain_length)
        context = "".join(f"Name of key: {key} " for key in keys).rstrip()
        return PROMPT.format(count=chain_length, example=example_chain, context=context, count_word=count_word)

    def score(self, prediction: str, example: Example) -> float:
        reference = example["reference"]
        return chain_score(prediction, reference["keys"], reference["chain_length"])
