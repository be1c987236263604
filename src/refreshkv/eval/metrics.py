"""Scoring helpers shared by the tasks. Every metric returns a float in [0, 1]."""

from __future__ import annotations

import csv
import difflib
import functools
import re
import string
from collections import Counter
from collections.abc import Sequence


def string_recall(prediction: str, references: Sequence[str]) -> float:
    """RULER's "all" metric: share of the references that occur in the prediction, ignoring case."""
    text = prediction.lower()
    return sum(reference.lower() in text for reference in references) / len(references)


def string_any(prediction: str, references: Sequence[str]) -> float:
    """RULER's "part" metric for QA: 1 if any reference occurs in the prediction, ignoring case."""
    text = prediction.lower()
    return float(any(reference.lower() in text for reference in references))


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def qa_f1(prediction: str, reference: str) -> float:
    """Token-level F1 between the normalised prediction and reference."""
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(reference).split()
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


@functools.cache
def _rouge_l_scorer():
    try:
        from rouge_score import rouge_scorer
    except ModuleNotFoundError:
        from refreshkv.eval.sources import EVAL_EXTRA, MissingDataError

        raise MissingDataError(f"ROUGE-L needs the optional package rouge-score: {EVAL_EXTRA}") from None
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure from the `rouge-score` package (its tokenizer; no stemming)."""
    return _rouge_l_scorer().score(reference, prediction)["rougeL"].fmeasure


def classification_accuracy(prediction: str, reference: str, classes: Sequence[str]) -> float:
    """LongBench-style: among the class names found in the prediction, the share that is the reference.

    A class name that is only found because it is part of the reference's own name (e.g. "Person"
    inside "Person description") does not count as a competing match.
    """
    found = [name for name in classes if name in prediction]
    found = [name for name in found if name == reference or name not in reference]
    return 1 / len(found) if reference in found else 0.0


def _numbers_share(prediction: str, expected: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(number == expected for number in numbers) / len(numbers) if numbers else 0.0


def retrieval_accuracy(prediction: str, reference: str) -> float:
    """For "Paragraph N" answers: share of the numbers in the prediction that are N."""
    match = re.search(r"\d+", reference)
    return _numbers_share(prediction, match.group()) if match else 0.0


def count_accuracy(prediction: str, reference: str) -> float:
    """For a count answer: share of the numbers in the prediction that equal it."""
    return _numbers_share(prediction, reference.strip())


def code_edit_similarity(prediction: str, reference: str) -> float:
    """difflib similarity between the reference and the first non-comment line of the prediction.

    Models often open with a Markdown fence or a comment, so those lines are skipped.
    """
    lines = (line for line in prediction.lstrip("\n").split("\n") if not line.lstrip().startswith(("`", "#", "//")))
    first_code_line = next(lines, "")
    return difflib.SequenceMatcher(None, first_code_line, reference).ratio()


def normalize_cell(text: str) -> str:
    """LongProc's cell normalisation: `normalize_answer`, then every space removed ("The Apple" -> "apple")."""
    return normalize_answer(text).replace(" ", "")


def extract_tsv_block(prediction: str) -> str:
    """LongProc's extraction: the text between the first "```tsv" and the last "```" after it.

    Without a closing fence, everything after "```tsv"; without "```tsv" (a bare ``` fence included), the whole
    prediction.
    """
    _, opening, rest = prediction.partition("```tsv")
    if not opening:
        return prediction.strip()
    body, closing, _ = rest.rpartition("```")
    return (body if closing else rest).strip()


def _tsv_table(text: str) -> list[tuple[str, ...]] | None:
    """The normalised rows under the first line (always the header), or None when there are none.

    Lines are read as by Python's csv module with a tab delimiter (a cell starting with a quote may span lines).
    Every row has the header's width: a last row of another width is dropped (a cut-off line or a closing remark)
    and any other such row becomes a row of "N/A" cells, which matches only a reference row of "N/A" cells.
    """
    try:
        header, *rows = csv.reader(text.strip().split("\n"), delimiter="\t")  # a blank text is one empty row
    except csv.Error:  # a cell beyond the csv module's size limit
        return None
    if rows and len(rows[-1]) != len(header):
        rows.pop()
    placeholder = ["N/A"] * len(header)
    table = [tuple(map(normalize_cell, row if len(row) == len(header) else placeholder)) for row in rows]
    return table or None


def longproc_tsv_f1(prediction: str, reference: str) -> float:
    """LongProc's HTML->TSV score (Ye et al. 2025): F1 of set-membership row precision and recall.

    Both texts go through `_tsv_table`, the prediction after `extract_tsv_block`. Precision is the share of
    predicted rows found among the reference rows (a repeated correct row counts each time), recall the share of
    reference rows found among the predicted ones; row order is ignored. A prediction with no row, or whose header
    has another number of columns than the reference's, scores 0 (LongProc's comparison fails on it and scores 0).
    """
    predicted, expected = _tsv_table(extract_tsv_block(prediction)), _tsv_table(reference)
    if predicted is None or expected is None or len(predicted[0]) != len(expected[0]):
        return 0.0
    predicted_rows, expected_rows = set(predicted), set(expected)
    precision = sum(row in expected_rows for row in predicted) / len(predicted)
    recall = sum(row in predicted_rows for row in expected) / len(expected)
    if precision + recall == 0:
        return 0.0
    return 2 * precision * recall / (precision + recall)
