"""LongBench (Bai et al. 2024) from its JSONL files: one row per item with input, context, answers,
all_classes, length, dataset and _id.

Option: `path`, a JSONL file (one LongBench dataset or several mixed). Each row's `dataset` picks
its instruction (our own wording after LongBench's per-dataset instructions), its metric and its
output budget (LongBench's per-dataset maximum lengths). Examples are named `longbench/<dataset>`.

Choices where the benchmark leaves room:
- `length` is the maximum prompt length: a longer prompt loses the middle of its context, cut at
  whitespace, keeping as many words as fit (half from the start, half from the end), as LongBench
  cuts the middle of its prompts.
- `num_examples` below the number of rows takes a `seed`-sampled subset, kept in file order.
- For the few-shot datasets (trec, triviaqa, samsum) only the first line of the prediction is
  scored, since the model tends to continue with further made-up examples.
- Score: the best metric value over the reference answers.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from refreshkv.eval import metrics
from refreshkv.eval.sources import data_file
from refreshkv.eval.tasks.base import Example, check_distinct, count_tokens, example_id, fit_to_length


@dataclass(frozen=True)
class _Dataset:
    template: str  # with {context} and {input}
    metric: Callable[..., float]
    max_new_tokens: int
    first_line_only: bool = False


_MULTI_HOP = (
    "Answer the question using the passages below. Give only the answer, with no other words.\n\n"
    "Passages:\n{context}\n\n"
    "Using the passages above, answer the question with only the answer and no other words.\n\n"
    "Question: {input}\nAnswer:"
)

DATASETS = {
    "narrativeqa": _Dataset(
        "Read the story below (a novel or a film script) and answer the question about it as briefly as "
        "you can, ideally in a single phrase, without any explanation.\n\nStory: {context}\n\n"
        "Answer the question about the story as briefly as you can, ideally in a single phrase, without any "
        "explanation.\n\nQuestion: {input}\n\nAnswer:",
        metrics.qa_f1,
        128,
    ),
    "qasper": _Dataset(
        "Read the scientific article below and answer the question about it in a single phrase or sentence. "
        'If the article does not answer it, write "unanswerable". For a yes/no question, write "yes", "no" '
        'or "unanswerable". Give no explanation.\n\nArticle: {context}\n\n'
        "Answer the question about the article in a single phrase or sentence, without explanation; "
        'write "unanswerable" if the article does not answer it.\n\nQuestion: {input}\n\nAnswer:',
        metrics.qa_f1,
        128,
    ),
    "multifieldqa_en": _Dataset(
        "Read the text below and answer the question about it briefly.\n\n{context}\n\n"
        "Using the text above, answer the question briefly, with no other words.\n\nQuestion: {input}\nAnswer:",
        metrics.qa_f1,
        64,
    ),
    "hotpotqa": _Dataset(_MULTI_HOP, metrics.qa_f1, 32),
    "2wikimqa": _Dataset(_MULTI_HOP, metrics.qa_f1, 32),
    "musique": _Dataset(_MULTI_HOP, metrics.qa_f1, 32),
    "gov_report": _Dataset(
        "Below is a report by a government agency. Write a one-page summary of it.\n\nReport:\n{context}\n\n"
        "Now write a one-page summary of the report.\n\nSummary:",
        metrics.rouge_l,
        512,
    ),
    "qmsum": _Dataset(
        "Below is a meeting transcript, followed by a query about it. Answer the query in one or more "
        "sentences.\n\nTranscript:\n{context}\n\nUsing the transcript above, answer the query in one or more "
        "sentences.\n\nQuery: {input}\nAnswer:",
        metrics.rouge_l,
        512,
    ),
    "multi_news": _Dataset(
        "Below are several news articles. Write a one-page summary that covers all of them.\n\nNews:\n{context}\n\n"
        "Now write a one-page summary of all the news above.\n\nSummary:",
        metrics.rouge_l,
        512,
    ),
    "trec": _Dataset(
        "Decide the type of the question. Some labelled example questions come first.\n\n{context}\n{input}",
        metrics.classification_accuracy,
        64,
        first_line_only=True,
    ),
    "triviaqa": _Dataset(
        "Answer the question using the passage. Give only the answer, with no other words. Some worked "
        "examples come first.\n\n{context}\n\n{input}",
        metrics.qa_f1,
        32,
        first_line_only=True,
    ),
    "samsum": _Dataset(
        "Summarize the dialogue in a few sentences. Some worked examples come first.\n\n{context}\n\n{input}",
        metrics.rouge_l,
        128,
        first_line_only=True,
    ),
    "passage_count": _Dataset(
        "Below are several paragraphs, some of which repeat others. Read them all and count how many different "
        "paragraphs there are once duplicates are removed.\n\n{context}\n\n"
        "Answer with the number of different paragraphs only, nothing else.\n\nAnswer: The number of "
        "different paragraphs is:",
        metrics.count_accuracy,
        32,
    ),
    "passage_retrieval_en": _Dataset(
        "Below are numbered paragraphs and then an abstract. Find the paragraph that the abstract summarizes."
        "\n\n{context}\n\nAbstract:\n{input}\n\n"
        'Give the number of that paragraph in the form "Paragraph 1", "Paragraph 2", and so on.\n\nAnswer:',
        metrics.retrieval_accuracy,
        32,
    ),
    "lcc": _Dataset(
        "Complete the code below by writing its next line.\n\n{context}Next line of code:\n",
        metrics.code_edit_similarity,
        64,
    ),
    "repobench-p": _Dataset(
        "Complete the code below by writing its next line; the repository files it uses come first.\n\n"
        "{context}{input}Next line of code:\n",
        metrics.code_edit_similarity,
        64,
    ),
}

REQUIRED_FIELDS = ("input", "context", "answers", "dataset")


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a LongBench JSONL file; a bad row raises ValueError naming file:line."""
    rows = []
    for line_number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{line_number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: malformed JSON: {error.msg}") from None
        if not isinstance(row, dict) or any(field not in row for field in REQUIRED_FIELDS):
            raise ValueError(f"{where}: a LongBench row needs the fields {', '.join(REQUIRED_FIELDS)}")
        if row["dataset"] not in DATASETS:
            raise ValueError(f"{where}: unknown dataset '{row['dataset']}'; choose from: {', '.join(DATASETS)}")
        rows.append(row)
    return rows


def _middle_truncated(template: str, row: dict, tokenizer, length: int) -> str:
    """The prompt, with the middle of the context cut so that it fits in `length` tokens."""
    prompt = template.format(context=row["context"], input=row["input"])
    if count_tokens(tokenizer, prompt) <= length:
        return prompt
    pieces = re.split(r"(?<=\s)(?=\S)", row["context"])  # words with their trailing whitespace

    def render(kept: int) -> str:
        context = "".join(pieces[: (kept + 1) // 2] + pieces[len(pieces) - kept // 2 :])
        return template.format(context=context, input=row["input"])

    return fit_to_length(render, tokenizer, length, len(pieces) - 1)[1]


class LongBenchTask:
    name = "longbench"

    def build(self, tokenizer, length: int, num_examples: int, seed: int, path: str | None = None) -> list[Example]:
        if path is None:
            raise ValueError("task 'longbench' needs the option 'path' (a LongBench JSONL file)")
        rows = read_jsonl(data_file(path, self.name))
        check_distinct(self.name, num_examples, len(rows), f"in {path} (its rows)")
        if num_examples < len(rows):
            chosen = sorted(random.Random(f"{self.name}/{seed}").sample(range(len(rows)), num_examples))
            rows = [rows[i] for i in chosen]
        examples = []
        for index, row in enumerate(rows):
            dataset = DATASETS[row["dataset"]]
            task = f"{self.name}/{row['dataset']}"
            examples.append(
                Example(
                    id=example_id(task, length, seed, index),
                    task=task,
                    prompt=_middle_truncated(dataset.template, row, tokenizer, length),
                    reference={"answers": list(row["answers"]), "all_classes": row.get("all_classes")},
                    max_new_tokens=dataset.max_new_tokens,
                    source_id=str(row.get("_id", "")),
                )
            )
        return examples

    def score(self, prediction: str, example: Example) -> float:
        dataset = DATASETS[example["task"].removeprefix(f"{self.name}/")]
        if dataset.first_line_only:
            prediction = prediction.lstrip("\n").split("\n")[0]
        reference = example["reference"]
        extra = (reference["all_classes"],) if dataset.metric is metrics.classification_accuracy else ()
        return max(dataset.metric(prediction, answer, *extra) for answer in reference["answers"])
