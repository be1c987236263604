"""Scoring helpers shared by the tasks. Every metric returns a float in [0, 1]."""

from __future__ import annotations

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
        from refreshkv.eval.data import EVAL_EXTRA, MissingDataError

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


def _tsv_rows(text: str) -> list[tuple[str, ...]]:
    rows = (tuple(" ".join(cell.split()) for cell in line.split("\t")) for line in text.split("\n"))
    return [row for row in rows if any(row)]


def extract_tsv(prediction: str) -> str:
    """The body of the first ``` fenced block if there is one (with or without a language tag), else all."""
    match = re.search(r"```[^\n]*\n(.*?)(?:```|$)", prediction, flags=re.DOTALL)
    return match.group(1) if match else prediction


def tsv_row_f1(prediction: str, reference: str) -> float:
    """F1 over whole rows: rows compare as tuples of whitespace-normalised cells.

    The reference's first line is its header; it is dropped from the reference, and from the
    prediction when the prediction starts with it. Rows are matched as multisets, so a repeated
    row counts once per occurrence in both.
    """
    expected = _tsv_rows(reference)
    header, expected = expected[0], expected[1:]
    predicted = _tsv_rows(extract_tsv(prediction))
    if predicted and tuple(cell.lower() for cell in predicted[0]) == tuple(cell.lower() for cell in header):
        predicted = predicted[1:]
    if not predicted or not expected:
        return float(predicted == expected)
    matched = sum((Counter(predicted) & Counter(expected)).values())
    if matched == 0:
        return 0.0
    precision, recall = matched / len(predicted), matched / len(expected)
    return 2 * precision * recall / (precision + recall)
