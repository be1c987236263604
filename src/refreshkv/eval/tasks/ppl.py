"""Perplexity windows over plain-text documents.

Options: `paths` (UTF-8 text files, required) and `target_tokens` (default 256). Each example is a
window of `length` context tokens followed by `target_tokens` scored tokens, cut from one document:
`input_ids` holds the window and `target_start` (= length) the index of the first scored token.
The runner computes the losses; `score_losses` turns them into a perplexity.

Choices: each window picks its document with probability proportional to the number of windows
the document can hold, then a uniformly random start, both from `seed`; documents shorter than a
window are skipped. Each document is encoded whole, once. `prompt` is empty (the model reads
`input_ids`) and `max_new_tokens` is 0.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from refreshkv.eval.data import data_file
from refreshkv.eval.tasks.base import Example, example_id


class PerplexityTask:
    name = "ppl"

    def build(
        self,
        tokenizer,
        length: int,
        num_examples: int,
        seed: int,
        paths: Sequence[str] | None = None,
        target_tokens: int = 256,
    ) -> list[Example]:
        if not paths:
            raise ValueError("task 'ppl' needs the option 'paths' (a list of UTF-8 text files)")
        if isinstance(paths, str):
            paths = [paths]
        window = length + target_tokens
        documents = []  # (path, token ids) of the documents that hold at least one window
        for path in paths:
            ids = tokenizer.encode(data_file(path, self.name).read_text(encoding="utf-8"), add_special_tokens=False)
            if len(ids) >= window:
                documents.append((str(path), list(ids)))
        if not documents:
            raise ValueError(f"task 'ppl': no document in {list(map(str, paths))} has {window} tokens")
        starts_per_document = [len(ids) - window + 1 for _, ids in documents]
        rng = random.Random(f"{self.name}/{seed}")
        examples = []
        for index in range(num_examples):
            path, ids = rng.choices(documents, weights=starts_per_document)[0]
            start = rng.randrange(len(ids) - window + 1)
            examples.append(
                Example(
                    id=example_id(self.name, length, seed, index),
                    task=self.name,
                    prompt="",
                    reference=None,
                    max_new_tokens=0,
                    input_ids=ids[start : start + window],
                    target_start=length,
                    source_id=f"{path}@{start}",
                )
            )
        return examples

    def score(self, prediction: str, example: Example) -> float:
        raise NotImplementedError("ppl examples are scored from token losses: use PerplexityTask.score_losses")

    @staticmethod
    def score_losses(losses: Sequence[float]) -> float:
        """Perplexity: exp of the mean negative log-likelihood (in nats) of the scored tokens."""
        return math.exp(sum(losses) / len(losses))
