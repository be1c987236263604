"""LongProc's HTML->TSV task (Ye et al. 2025): extract the listed items of a web page as TSV rows.

Options: `data_dir` (the benchmark's html_to_tsv folder: html_to_tsv_{split}.json, prompts.yaml,
webpage/; default: the environment variable REFRESHKV_HTML_TSV_DIR) and `split` ("0.5k", "2k" or
"8k": the expected output length). The data are LongProc's own files (Apache-2.0; the copy we use keeps
the benchmark's LICENSE beside them).

Choices where the benchmark leaves room:
- `length` is a maximum: items whose prompt is longer are skipped. The items are taken in an order
  shuffled by `seed`, so `num_examples` below the split's size gives a seeded sample; fewer examples
  come back when fewer items fit.
- `max_new_tokens` is twice the expected TSV's token count plus 64, so that a verbose but correct
  answer is never cut off.
- Score: LongProc's row F1 (`metrics.longproc_tsv_f1`): the ```tsv block, first line dropped as the
  header, cells normalised (case, punctuation, articles and spaces ignored), set-membership precision
  and recall of whole rows.
"""

from __future__ import annotations

import json
import random

import yaml

from refreshkv.eval.metrics import longproc_tsv_f1
from refreshkv.eval.sources import data_dir as resolve_data_dir
from refreshkv.eval.sources import data_file
from refreshkv.eval.tasks.base import Example, check_distinct, count_tokens, example_id

SPLITS = ("0.5k", "2k", "8k")
DATA_DIR_ENV = "REFRESHKV_HTML_TSV_DIR"


class HtmlToTsvTask:
    name = "html_to_tsv"

    def build(
        self, tokenizer, length: int, num_examples: int, seed: int, data_dir: str | None = None, split: str = "0.5k"
    ) -> list[Example]:
        if split not in SPLITS:
            raise ValueError(f"unknown html_to_tsv split '{split}'; choose from: {', '.join(SPLITS)}")
        root = resolve_data_dir(data_dir, "data_dir", DATA_DIR_ENV, self.name)
        template = yaml.safe_load(data_file(root / "prompts.yaml", self.name).read_text(encoding="utf-8"))[
            "USER_PROMPT"
        ]
        items = json.loads(data_file(root / f"html_to_tsv_{split}.json", self.name).read_text(encoding="utf-8"))
        random.Random(f"{self.name}/{split}/{seed}").shuffle(items)
        examples, shortest = [], None
        for item in items:
            if len(examples) == num_examples:
                break
            prompt = template.format(
                html_str=data_file(root / item["html_path"], self.name).read_text(encoding="utf-8"),
                task_topic=item["task_topic"],
                task_description=item["task_description"],
                filtering_instruction=item["filtering_instruction"],
                tsv_header=item["tsv_header"],
            )
            prompt_tokens = count_tokens(tokenizer, prompt)
            shortest = min(prompt_tokens, shortest or prompt_tokens)
            if prompt_tokens > length:
                continue
            examples.append(
                Example(
                    id=example_id(self.name, length, seed, len(examples)),
                    task=f"{self.name}/{split}",
                    prompt=prompt,
                    reference=item["gt"],
                    max_new_tokens=2 * count_tokens(tokenizer, item["gt"]) + 64,
                    source_id=item["task_id"],
                )
            )
        if not examples and num_examples > 0:
            raise ValueError(
                f"no html_to_tsv {split} item fits in {length} tokens; the shortest prompt has {shortest} tokens"
            )
        check_distinct(self.name, num_examples, len(examples), f"of split {split} that fit in {length} tokens")
        return examples

    def score(self, prediction: str, example: Example) -> float:
        return longproc_tsv_f1(prediction, example["reference"])
