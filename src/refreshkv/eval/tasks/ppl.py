"""Perplexity windows over plain-text documents.

Options: `paths` (UTF-8 text files, one document each, or JSONL files with a document per line in `text`, as
`refreshkv train` writes its test split; required), `target_tokens` (default 256) and `sha256` (the files'
SHA-256, one per path; recorded automatically, see `resolve_options` and `recorded_options`). Each example is a
window of `length` context tokens followed by `target_tokens` scored tokens: `input_ids` holds the window and
`target_start` (= length) the index of the first scored token. The runner computes the losses;
`score_losses` turns them into a perplexity.

Choices:
- Every window starts with the tokenizer's BOS token when it defines one (`bos_token_id`), followed
  by text from a random token of a document; the BOS is the first of the `length` context tokens.
  A window thus always opens with the token the model's tokenizer marks a sequence start with, which
  is what StreamingLLM's sink tokens and BOS-trained models (Llama 3) rely on, whatever text it cuts
  into. Windows are not placed at chapter starts: chapters of the books we use hold about 1K (Bible)
  to 4K (Austen) tokens, so a 4K-token window runs past its chapter anyway, and chapter starts would
  give few distinct windows and need a heading format per file. The embedded SmolLM2-Instruct's BOS is
  `<|im_start|>` (id 1, which opens every ChatML turn); a model whose BOS is its EOS gets that token; a
  tokenizer without a BOS (Qwen2) gets none.
- Each window picks its document with probability proportional to the number of windows the
  document can hold, then a uniformly random start, both from `seed`; documents shorter than a
  window are skipped. Each document is encoded whole, once, without special tokens.
- `prompt` is empty (the model reads `input_ids`) and `max_new_tokens` is 0.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from pathlib import Path

from refreshkv.eval.sources import data_file
from refreshkv.eval.tasks.base import Example, building, check_distinct, example_id
from refreshkv.texts.documents import read_documents


def _as_list(value: Sequence[str] | str) -> list[str]:
    """One option value or a list of them (`--task-option paths=a.txt` gives a plain string)."""
    return [value] if isinstance(value, str) else list(value)


class PerplexityTask:
    name = "ppl"

    def resolve_options(self, options: dict) -> dict:
        """`options` as the configuration key records them: `paths` absolute, `sha256` their contents' hashes.

        Relative paths name different files from different folders, and a file can be edited between
        runs; with both in the key such runs are different configurations, never mixed in one.
        A `sha256` given by the caller is kept, and `build` refuses files that no longer match it.
        """
        if not options.get("paths"):
            return options  # `build` reports the missing option
        paths = [str(Path(data_file(path, self.name)).resolve()) for path in _as_list(options["paths"])]
        hashes = options.get("sha256") or [hashlib.sha256(Path(path).read_bytes()).hexdigest() for path in paths]
        return {**options, "paths": paths, "sha256": hashes}

    def recorded_options(self, options: dict) -> dict:
        """`options` as configuration keys and result rows record them: file names and contents, not folders.

        The SHA-256 already tells files apart, so a checkout moved elsewhere resumes its runs, and a
        committed results file names no folder of the machine that wrote it.
        """
        if not options.get("paths"):
            return options
        return {**options, "paths": [Path(path).name for path in _as_list(options["paths"])]}

    def check_options(self, options: dict) -> None:
        """The option values `build` could only refuse after the model loads (the runner checks them first)."""
        target = options.get("target_tokens", 256)
        if not isinstance(target, int) or isinstance(target, bool) or target < 1:
            raise ValueError(f"task 'ppl': option target_tokens must be an integer >= 1, got {target!r}")

    def build(
        self,
        tokenizer,
        length: int,
        num_examples: int,
        seed: int,
        paths: Sequence[str] | str | None = None,
        target_tokens: int = 256,
        sha256: Sequence[str] | str | None = None,
    ) -> list[Example]:
        if not paths:
            raise ValueError("task 'ppl' needs the option 'paths' (a list of UTF-8 text files)")
        self.check_options({"target_tokens": target_tokens})
        paths = _as_list(paths)
        hashes = None if sha256 is None else _as_list(sha256)
        if hashes is not None and len(hashes) != len(paths):
            raise ValueError(f"task 'ppl': option 'sha256' needs one hash per path ({len(paths)}), got {len(hashes)}")
        bos = getattr(tokenizer, "bos_token_id", None)
        prefix = [] if bos is None else [bos]
        text_tokens = length + target_tokens - len(prefix)  # text tokens per window
        documents = []  # (name, token ids) of the documents that hold at least one window
        for index, path in enumerate(paths):
            data = data_file(path, self.name).read_bytes()
            if hashes is not None and hashlib.sha256(data).hexdigest() != hashes[index]:
                raise ValueError(
                    f"task 'ppl': {path} has changed since its configuration was made (SHA-256 differs); "
                    "run the command again to make a new configuration"
                )
            for document in read_documents([path]):
                ids = tokenizer.encode(document.text, add_special_tokens=False)
                if len(ids) >= text_tokens:
                    documents.append((document.name, list(ids)))
        if not documents:
            raise ValueError(f"task 'ppl': no document in {paths} has {text_tokens} tokens")
        starts_per_document = [len(ids) - text_tokens + 1 for _, ids in documents]
        check_distinct(self.name, num_examples, sum(starts_per_document), f"of {text_tokens} tokens in {paths}")
        rng = random.Random(f"{self.name}/{seed}")
        examples = []
        for index in building(num_examples, self.name):
            name, ids = rng.choices(documents, weights=starts_per_document)[0]
            start = rng.randrange(len(ids) - text_tokens + 1)
            examples.append(
                Example(
                    id=example_id(self.name, length, seed, index),
                    task=self.name,
                    prompt="",
                    reference=None,
                    max_new_tokens=0,
                    input_ids=prefix + ids[start : start + text_tokens],
                    target_start=length,
                    source_id=f"{name}@{start}",  # the document by file name (and line), as rows record it
                )
            )
        return examples

    def score(self, prediction: str, example: Example) -> float:
        raise NotImplementedError("ppl examples are scored from token losses: use PerplexityTask.score_losses")

    @staticmethod
    def score_losses(losses: Sequence[float]) -> float:
        """Perplexity: exp of the mean negative log-likelihood (in nats) of the scored tokens."""
        return math.exp(sum(losses) / len(losses))
