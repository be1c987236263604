"""Scorers on hand-written predictions: LongProc HTML->TSV and chain-of-key."""

import pytest

from refreshkv.eval.metrics import extract_tsv_block, longproc_tsv_f1, normalize_cell
from refreshkv.eval.tasks.chain_of_key import chain_score, parse_chain


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
    assert longproc_tsv_f1("\n".join([header, ada, "Linus\t1969", alan, grace]), REFERENCE) == pytest.approx(f1(3 / 4, 1))
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
    assert longproc_tsv_f1("\n".join([header, ada, alan, "Grace Hopper\tplum\t1907"]), REFERENCE) == pytest.approx(2 / 3)
    # one extra row: P = 3/4, R = 1
    assert longproc_tsv_f1("\n".join([header, ada, alan, grace, "Linus\tkiwi\t1969"]), REFERENCE) == pytest.approx(f1(3 / 4, 1))


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
    assert parse_chain("impossible-crawdad-vehicle, crawdad-vehicle") == ["impossible-crawdad-vehicle", "crawdad-vehicle"]
    assert chain_score("impossible-crawdad-vehicle, crawdad-vehicle", KEYS, 10) == 0.0
    # a word outside the chain between keys is skipped; a key not in the context ends the chain
    assert chain_score("impossible-crawdad then crawdad-vehicle then vehicle-pillow", KEYS, 10) == pytest.approx(0.2)
