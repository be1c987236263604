"""Scorers on hand-written predictions (LongProc HTML->TSV, chain-of-key) and how perplexity windows are made."""

import hashlib
import json
import zlib
from pathlib import Path

import pytest
from conftest import tiny_model
from typer.testing import CliRunner

from refreshkv.eval.config import RunConfig
from refreshkv.eval.metrics import extract_tsv_block, longproc_tsv_f1, normalize_cell
from refreshkv.eval.results_file import ResultsError
from refreshkv.eval.runner import run_eval
from refreshkv.eval.tasks.chain_of_key import chain_score, parse_chain
from refreshkv.eval.tasks.ppl import PerplexityTask


def f1(precision, recall):
    return 2 * precision * recall / (precision + recall)


# ---- LongProc HTML->TSV --------------------------------------------------------------------------

REFERENCE = "Name\tFruit\tYear\nAda Lovelace\tThe Apple\t1815\nAlan Turing\tpear\t1912\nGrace Hopper\ta plum\t1906"


def test_cells_ignore_case_punctuation_articles_and_spaces():
    assert normalize_cell("  The Apple! ") == normalize_cell("apple") == "apple"
    assert normalize_cell("New  York,\tU.S.A.") == "newyorkusa"
    assert normalize_cell("N/A") == "na"
    assert normalize_cell("Theatre") == "theatre"  # an article only as a whole word


def test_a_prediction_equal_up_to_case_articles_and_punctuation_scores_one():
    prediction = "```tsv\nname\tfruit\tyear\nada lovelace\tapple\t1815.\nALAN TURING\tPear!\t1912\ngrace hopper\tthe plum\t1906\n```"
    assert longproc_tsv_f1(prediction, REFERENCE) == 1.0
    assert longproc_tsv_f1(REFERENCE, REFERENCE) == 1.0  # no fence: the whole text


def test_tsv_block_extraction():
    body = "Name\tFruit\tYear\nAda Lovelace\tapple\t1815"
    assert extract_tsv_block(f"Here you go:\n```tsv\n{body}\n```\nHope this helps.") == body
    assert extract_tsv_block(f"```tsv\n{body}") == body  # cut off before the closing fence
    assert extract_tsv_block(f"  {body}\n") == body  # no fence
    # from the first ```tsv to the last ``` after it, as LongProc's greedy match
    assert extract_tsv_block(f"```tsv\n{body}\n```\nmore:\n```\nx\n```") == f"{body}\n```\nmore:\n```\nx"
    # a fence without the tsv tag is not one: its ``` line becomes the header (1 column of 3), score 0
    assert longproc_tsv_f1(f"```\n{REFERENCE}\n```", REFERENCE) == 0.0


def test_first_line_is_always_the_header():
    rows = REFERENCE.split("\n")[1:]
    # without a header the first row is taken as one: 2 rows left, both right
    assert longproc_tsv_f1("\n".join(rows), REFERENCE) == pytest.approx(f1(1, 2 / 3))
    # the header's text does not matter, only its number of columns
    assert longproc_tsv_f1("\n".join(["a\tb\tc", *rows]), REFERENCE) == 1.0
    assert longproc_tsv_f1("\n".join(["a\tb", *rows]), REFERENCE) == 0.0


def test_rows_of_another_width():
    header, ada, alan, grace = REFERENCE.split("\n")
    # a malformed row in the middle becomes an N/A row that matches nothing: P = 3/4, R = 1
    assert longproc_tsv_f1("\n".join([header, ada, "Linus\t1969", alan, grace]), REFERENCE) == pytest.approx(
        f1(3 / 4, 1)
    )
    # a malformed last row is a cut-off line or a closing remark: dropped
    assert longproc_tsv_f1("\n".join([header, ada, alan, grace, "That is all."]), REFERENCE) == 1.0
    # a blank line is a row of no cells: N/A too
    assert longproc_tsv_f1("\n".join([header, ada, "", alan, grace]), REFERENCE) == pytest.approx(f1(3 / 4, 1))
    # the N/A row matches a reference row of N/A cells
    reference = "a\tb\nx\ty\nN/A\tn/a"
    assert longproc_tsv_f1("a\tb\nx\ty\nbroken\nx\ty", reference) == 1.0


def test_rows_are_matched_as_sets_in_any_order():
    header, ada, alan, grace = REFERENCE.split("\n")
    assert longproc_tsv_f1("\n".join([header, grace, alan, ada]), REFERENCE) == 1.0
    # a repeated right row is right each time: P = 1, R = 1/3
    assert longproc_tsv_f1("\n".join([header, ada, ada, ada]), REFERENCE) == pytest.approx(f1(1, 1 / 3))
    # one wrong cell makes the row wrong: P = R = 2/3
    assert longproc_tsv_f1("\n".join([header, ada, alan, "Grace Hopper\tplum\t1907"]), REFERENCE) == pytest.approx(
        2 / 3
    )
    # one extra row: P = 3/4, R = 1
    assert longproc_tsv_f1("\n".join([header, ada, alan, grace, "Linus\tkiwi\t1969"]), REFERENCE) == pytest.approx(
        f1(3 / 4, 1)
    )


def test_quoted_cells_are_read_as_tsv():
    header, ada, alan, grace = REFERENCE.split("\n")
    assert longproc_tsv_f1("\n".join([header, '"Ada Lovelace"\t"The Apple"\t1815', alan, grace]), REFERENCE) == 1.0


@pytest.mark.parametrize("prediction", ["", "I cannot see the page.", "Name\tFruit\tYear", "```tsv\n```"])
def test_predictions_without_rows_score_zero(prediction):
    assert longproc_tsv_f1(prediction, REFERENCE) == 0.0


# ---- chain of key --------------------------------------------------------------------------------

# RefreshKV paper, Table 12: three outputs and their scores
TABLE_12 = [
    (
        (
            "impossible-crawdad, crawdad-vehicle, vehicle-uncertainty, uncertainty-welfare, welfare-outrigger, "
            "outrigger-historical, historical-gator, gator-hugger, hugger-debris, debris-precious"
        ),
        1.0,
    ),
    (
        (
            "annoying-pentagon, pentagon-fit, fit-waggish, waggish-fishery, fishery-mosquito, mosquito-perfume, "
            "perfume-panda, panda-juice, juice-willow, willow-bronco"
        ),
        0.2,
    ),
    (
        (
            "impossible-crawdad, crawdad-vehicle, vehicle-uncertainty, welfare-outrigger, outrigger-historical, "
            "historical-gator, gator-hugger, hugger-debris, debris-precious, uncertainty-welfare"
        ),
        0.3,
    ),
]
# the context holds the keys of the three outputs except those the table marks as absent:
# fit-waggish and the prompt's example chain (waggish-fishery, ...)
KEYS = TABLE_12[0][0].split(", ") + ["annoying-pentagon", "pentagon-fit", "toga-roommate"]
CHAIN = TABLE_12[0][0].split(", ")


def test_chain_of_key_scores_table_12():
    for prediction, expected in TABLE_12:
        assert chain_score(prediction, KEYS, 10) == pytest.approx(expected)
    assert chain_score("Impossible-Crawdad,\ncrawdad-vehicle.", KEYS, 10) == pytest.approx(0.2)
    assert chain_score("", KEYS, 10) == 0.0


@pytest.mark.parametrize(
    "prediction",
    [
        "\n".join(f"{i}. {key}" for i, key in enumerate(CHAIN, 1)),  # numbered list
        "\n".join(f"{i}) {key}" for i, key in enumerate(CHAIN, 1)),
        "\n".join(f"- {key}" for key in CHAIN),  # bullets
        "\n".join(f"* **{key}**" for key in CHAIN),  # Markdown bold
        ", ".join(f'"{key}"' for key in CHAIN) + ".",  # quotes, trailing period
        ", ".join(f"'{key}'" for key in CHAIN),
        "; ".join(f"`{key}`" for key in CHAIN) + "!",
        " -> ".join(CHAIN),  # arrows
        " → ".join(CHAIN),
        " ".join(CHAIN),  # spaces only
        "Chain of ten keys:\n" + ", ".join(key.upper() for key in CHAIN),  # a preamble, upper case
        "Sure! Here is the chain: " + ", ".join(CHAIN) + ". Let me know if you need more.",
        ", ".join(key.replace("-", "\u2013") for key in CHAIN),  # en dashes
        ", ".join(CHAIN + ["extra-key", "more-keys"]),  # only the first ten count
    ],
)
def test_chain_of_key_reads_the_formats_models_write(prediction):
    assert parse_chain(prediction)[:10] == CHAIN
    assert chain_score(prediction, KEYS, 10) == 1.0


def test_chain_of_key_parsing_choices():
    # a hyphenated word in prose counts as a key: before the chain it ends the chain at once
    assert chain_score("A well-known chain: " + ", ".join(CHAIN), KEYS, 10) == 0.0
    # a key of three words is one (wrong) key, not two
    assert parse_chain("impossible-crawdad-vehicle, crawdad-vehicle") == [
        "impossible-crawdad-vehicle",
        "crawdad-vehicle",
    ]
    assert chain_score("impossible-crawdad-vehicle, crawdad-vehicle", KEYS, 10) == 0.0
    # a word outside the chain between keys is skipped; a key not in the context ends the chain
    assert chain_score("impossible-crawdad then crawdad-vehicle then vehicle-pillow", KEYS, 10) == pytest.approx(0.2)


# ---- perplexity windows --------------------------------------------------------------------------


class WordTokenizer:
    """One token per whitespace-separated word, ids 3..127; `bos_token_id` as given (None: no BOS)."""

    def __init__(self, bos_token_id=None):
        self.bos_token_id = bos_token_id

    def encode(self, text, add_special_tokens=True):
        return [3 + zlib.crc32(word.encode()) % 125 for word in text.split()]


def write_words(path: Path, words: int, offset: int = 0) -> Path:
    path.write_text(" ".join(f"word{(i + offset) % 400}" for i in range(words)), encoding="utf-8")
    return path


def test_ppl_windows_start_with_the_bos_token_when_the_tokenizer_has_one(tmp_path):
    book = write_words(tmp_path / "book.txt", 2000)
    text = WordTokenizer().encode(book.read_text())
    for bos in (None, 1):
        tokenizer = WordTokenizer(bos)
        examples = PerplexityTask().build(tokenizer, 300, 5, seed=0, paths=[str(book)], target_tokens=50)
        for example in examples:
            start = int(example["source_id"].rsplit("@", 1)[1])
            ids = example["input_ids"]
            assert len(ids) == 350 and example["target_start"] == 300  # the BOS is one of the 300 context tokens
            if bos is None:
                assert ids == text[start : start + 350]
            else:
                assert ids == [1] + text[start : start + 349]
    # a document must hold the window's text tokens: 299 + 50 with a BOS, 300 + 50 without
    short = write_words(tmp_path / "short.txt", 349)
    assert PerplexityTask().build(WordTokenizer(1), 300, 1, seed=0, paths=[str(short)], target_tokens=50)
    with pytest.raises(ValueError, match="has 350 tokens"):
        PerplexityTask().build(WordTokenizer(), 300, 1, seed=0, paths=[str(short)], target_tokens=50)


def test_ppl_options_pin_absolute_paths_and_contents(tmp_path, monkeypatch):
    book = write_words(tmp_path / "book.txt", 500)
    monkeypatch.chdir(tmp_path)
    options = PerplexityTask().resolve_options({"paths": "book.txt", "target_tokens": 8})
    assert options == {
        "paths": [str(book.resolve())],
        "target_tokens": 8,
        "sha256": [hashlib.sha256(book.read_bytes()).hexdigest()],
    }
    assert PerplexityTask().resolve_options(options) == options  # resolving twice changes nothing
    # the file changed after its configuration was made: refused, one line
    write_words(book, 500, offset=1)
    with pytest.raises(ValueError, match=r"book.txt has changed since its configuration was made"):
        PerplexityTask().build(WordTokenizer(), 60, 1, seed=0, **options)
    with pytest.raises(ValueError, match=r"option 'sha256' needs one hash per path \(1\), got 2"):
        PerplexityTask().build(WordTokenizer(), 60, 1, seed=0, paths=[str(book)], sha256=["a", "b"])


def test_ppl_with_the_same_relative_path_from_two_folders_is_two_configurations(tmp_path, monkeypatch):
    """Issue 10: `paths=book.txt` run from two folders into one --out must not mix the two books."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    write_words(first / "book.txt", 400)
    write_words(second / "book.txt", 400, offset=7)
    out = tmp_path / "ppl.jsonl"
    options = {"paths": ["book.txt"], "target_tokens": 8}

    def ppl_config():
        return RunConfig(task="ppl", method="full", length=60, model="tiny", chat=False, task_options=options)

    model = tiny_model("llama", layers=2, seed=0)
    monkeypatch.chdir(first)
    in_first = ppl_config()
    assert in_first.key() == ppl_config().key()  # the same folder and file: the same configuration (resume)
    run_eval(model, WordTokenizer(), in_first, 1, out, progress=False)
    monkeypatch.chdir(second)
    in_second = ppl_config()
    assert in_second.key() != in_first.key()
    assert in_second.task_options["paths"] == [str((second / "book.txt").resolve())]
    before = out.read_bytes()
    with pytest.raises(ResultsError, match="holds results of another configuration"):
        run_eval(model, WordTokenizer(), in_second, 1, out, progress=False)
    assert out.read_bytes() == before
    # the same folder, the file edited: a new configuration too
    write_words(second / "book.txt", 400, offset=8)
    assert ppl_config().key() != in_second.key()


def test_ppl_rows_record_file_names_so_a_moved_checkout_resumes(tmp_path):
    """The key and the rows name a book by file name and SHA-256: no folder of the machine, the same run elsewhere."""
    here, moved = tmp_path / "here", tmp_path / "moved"
    here.mkdir()
    moved.mkdir()
    write_words(here / "book.txt", 400)
    write_words(moved / "book.txt", 400)

    def ppl_config(folder):
        options = {"paths": [str(folder / "book.txt")], "target_tokens": 8}
        return RunConfig(task="ppl", method="full", length=60, model="tiny", chat=False, task_options=options)

    assert ppl_config(here).key() == ppl_config(moved).key()
    out = tmp_path / "ppl.jsonl"
    model = tiny_model("llama", layers=2, seed=0)
    run_eval(model, WordTokenizer(), ppl_config(here), 2, out, progress=False)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(row["task_options"]["paths"] == ["book.txt"] for row in rows)
    assert str(tmp_path) not in out.read_text()
    run_eval(model, WordTokenizer(), ppl_config(moved), 3, out, progress=False)  # resumes: one more window
    assert len(out.read_text().splitlines()) == 3


def test_ppl_missing_file_is_a_one_line_error_on_the_command_line(tmp_path, monkeypatch):
    from refreshkv.cli.app import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        app, ["eval", "--task", "ppl", "--task-option", "paths=nowhere.txt", "--out", str(tmp_path / "r.jsonl")]
    )
    assert result.exit_code == 2
    assert "task 'ppl': data file nowhere.txt does not exist" in result.output
    assert not (tmp_path / "r.jsonl").exists()
