"""RULER's 13 synthetic tasks (Hsieh et al. 2024), reimplemented from the paper's task definitions.

Task names: `ruler` builds the 13 subtasks round-robin (example i is subtask i mod 13) unless the
option `subtask` picks one; each subtask is also registered as `ruler/<subtask>`. Every example's
`task` field is `ruler/<subtask>`, which is what `score` dispatches on.

Choices where the paper leaves room:
- Filler is sized in units (noise sentences, essay words, needle lines, listed words, document
  words) and the unit count is searched so that the prompt is as long as possible within `length`
  tokens, so it lands within a unit of the target.
- Needles go at uniformly random depths; in essays they move forward to the next sentence end.
  The essay text starts at a random word and wraps around at its end.
- Keys are "adjective-noun" pairs from wonderwords or UUIDs; values are 7-digit numbers or UUIDs;
  all keys and values of an example are distinct.
- vt: one chain, 4 hops (5 variables of 5 capital letters, a 5-digit value), in the noise
  haystack, statements in chain order.
- cwe: 10 common words repeated 30 times among words repeated 3 times; when the common words alone
  would fill more than half of `length`, 2 and 1 times instead, so that short contexts still hold
  many other words. No few-shot example.
- fwe: 5-letter coded words with deterministic Zipf counts (alpha 2: the word of rank r appears
  floor(n / (H r^2)) times), shuffled; the answer is the 3 most frequent. n is at least the smallest
  total that makes them strictly more frequent than the 4th (shorter lengths are rejected).
- qa: the golden paragraph(s) (SQuAD: the question's paragraph; HotpotQA: the paragraphs named by its
  supporting facts) at random depths among shuffled distractor paragraphs of the same dataset; the
  last distractor is cut at a word boundary to reach the length. Unanswerable SQuAD questions and
  HotpotQA questions whose answer is not written in the golden paragraphs (yes/no) are skipped, so
  every answer really occurs in the context.
Scores: recall of the references in the prediction (case-insensitive); qa: 1 if any reference occurs.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from refreshkv.eval.data import english_words, ruler_json, wonderwords_list
from refreshkv.eval.metrics import string_any, string_recall
from refreshkv.eval.tasks.base import Example, count_tokens, example_id, fit_to_length

SUBTASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@dataclass(frozen=True)
class _Prompt:
    """One example before sizing: `render(n)` is the prompt with n filler units."""

    render: Callable[[int], str]
    max_units: int
    references: list[str]
    max_new_tokens: int
    answer_prefix: str


# ---- keys, values and haystacks ----------------------------------------------------------------


def _distinct(make: Callable[[], str], count: int, taken: set[str]) -> list[str]:
    """`count` new strings from `make`, distinct from each other and from `taken` (which grows)."""
    made = []
    while len(made) < count:
        item = make()
        if item not in taken:
            taken.add(item)
            made.append(item)
    return made


def _maker(kind: str, rng: random.Random) -> Callable[[], str]:
    if kind == "words":
        adjective_list, noun_list = wonderwords_list("adjective", "ruler"), wonderwords_list("noun", "ruler")
        return lambda: f"{rng.choice(adjective_list)}-{rng.choice(noun_list)}"
    if kind == "numbers":
        return lambda: str(rng.randrange(1_000_000, 10_000_000))
    return lambda: str(uuid.UUID(int=rng.getrandbits(128), version=4))


@dataclass(frozen=True)
class _Haystack:
    unit: Callable[[int], str]  # the i-th filler unit
    max_units: int
    separator: str


@functools.cache
def _essay_words() -> tuple[str, ...]:
    return tuple(ruler_json("PaulGrahamEssays.json")["text"].split())


def _noise_haystack(length: int) -> _Haystack:
    return _Haystack(lambda i: NOISE, max_units=length, separator=" ")


def _essay_haystack(length: int, rng: random.Random) -> _Haystack:
    words = _essay_words()
    start = rng.randrange(len(words))
    # a word is at least one token, so `length` words never fit in `length` tokens
    return _Haystack(lambda i: words[(start + i) % len(words)], max_units=length, separator=" ")


def _insert_at_depths(units: list[str], needles: Sequence[str], depths: Sequence[float]) -> list[str]:
    """Insert each needle at its relative depth, moved forward to just after a sentence end."""
    positions = []
    for depth in depths:
        position = round(depth * len(units))
        while 0 < position < len(units) and not units[position - 1].endswith((".", "!", "?")):
            position += 1
        positions.append(position)
    result = list(units)
    # from the back, so earlier positions stay valid; equal positions keep the needles' order
    for position, needle in sorted(zip(positions, needles), key=lambda item: item[0], reverse=True):
        result.insert(position, needle)
    return result


def _render_needles(
    haystack: _Haystack, needles: Sequence[str], depths: Sequence[float], template: str
) -> Callable[[int], str]:
    def render(n: int) -> str:
        units = _insert_at_depths([haystack.unit(i) for i in range(n)], needles, depths)
        return template.format(context=haystack.separator.join(units))

    return render


# ---- needle in a haystack --------------------------------------------------------------------


@dataclass(frozen=True)
class _NiahSpec:
    haystack: str  # "noise", "essay" or "needles" (the filler is itself made of needle lines)
    key_kind: str  # "words" or "uuids"
    value_kind: str  # "numbers" or "uuids"
    num_keys: int = 1  # keys with a needle in the context; the first `num_queries` are asked for
    num_values: int = 1  # needles (values) per key
    num_queries: int = 1


NIAH = {
    "niah_single_1": _NiahSpec("noise", "words", "numbers"),
    "niah_single_2": _NiahSpec("essay", "words", "numbers"),
    "niah_single_3": _NiahSpec("essay", "words", "uuids"),
    "niah_multikey_1": _NiahSpec("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": _NiahSpec("needles", "words", "numbers"),
    "niah_multikey_3": _NiahSpec("needles", "uuids", "uuids"),
    "niah_multivalue": _NiahSpec("essay", "words", "numbers", num_values=4),
    "niah_multiquery": _NiahSpec("essay", "words", "numbers", num_keys=4, num_queries=4),
}

NIAH_TEMPLATE = (
    "Some special magic {noun} are hidden within the following text. Make sure to memorize them; "
    "I will quiz you about the {noun} afterwards.\n{{context}}\n"
    "What are all the special magic {noun} for {query} mentioned in the provided text?"
)


def _needle(key: str, value: str, noun: str) -> str:
    return f"One of the special magic {noun} for {key} is: {value}."


def _join_names(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + ", and " + names[-1]


def _niah(spec: _NiahSpec, length: int, rng: random.Random) -> _Prompt:
    noun = spec.value_kind
    taken: set[str] = set()
    keys = _distinct(_maker(spec.key_kind, rng), spec.num_keys, taken)
    values = [_distinct(_maker(spec.value_kind, rng), spec.num_values, taken) for _ in keys]
    needles = [_needle(key, value, noun) for key, key_values in zip(keys, values) for value in key_values]
    if spec.haystack == "needles":
        # a needle line is at least eight tokens, so length // 8 + 1 lines never fit
        count = length // 8 + 1
        filler_keys = _distinct(_maker(spec.key_kind, rng), count, taken)
        filler_values = _distinct(_maker(spec.value_kind, rng), count, taken)
        lines = [_needle(key, value, noun) for key, value in zip(filler_keys, filler_values)]
        haystack = _Haystack(lines.__getitem__, max_units=count, separator="\n")
    elif spec.haystack == "essay":
        haystack = _essay_haystack(length, rng)
    else:
        haystack = _noise_haystack(length)
    query = _join_names(keys[: spec.num_queries])
    template = NIAH_TEMPLATE.format(noun=noun, query=query)
    multiple = spec.num_values > 1 or spec.num_queries > 1
    return _Prompt(
        render=_render_needles(haystack, needles, [rng.random() for _ in needles], template),
        max_units=haystack.max_units,
        references=[value for key_values in values[: spec.num_queries] for value in key_values],
        max_new_tokens=128 if multiple else 64,  # a UUID alone is about 25 tokens
        answer_prefix=f" The special magic {noun} for {query} mentioned in the provided text are",
    )


# ---- variable tracking -------------------------------------------------------------------------

VT_TEMPLATE = (
    "Memorize and track the chain of variable assignments hidden in the following text.\n\n{{context}}\n"
    "Question: Find all variables that are assigned the value {value} in the text above."
)


def _variable_tracking(length: int, rng: random.Random, hops: int = 4) -> _Prompt:
    names = _distinct(lambda: "".join(rng.choices(string.ascii_uppercase, k=5)), hops + 1, set())
    value = str(rng.randrange(10_000, 100_000))
    statements = [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in itertools.pairwise(names)]
    depths = sorted(rng.random() for _ in statements)  # statements appear in chain order
    haystack = _noise_haystack(length)
    return _Prompt(
        render=_render_needles(haystack, statements, depths, VT_TEMPLATE.format(value=value)),
        max_units=haystack.max_units,
        references=names,
        max_new_tokens=64,
        answer_prefix=(
            f" Answer: According to the chain of variable assignments in the text above, the variables "
            f"assigned the value {value} are:"
        ),
    )


# ---- common and frequent words extraction --------------------------------------------------------

CWE_TEMPLATE = (
    "Below is a numbered list of words. Some of the words appear more often than the others; "
    "memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the list above?"
)


def _shuffled_text(entries: list[str], rng_seed: str, numbered: bool) -> str:
    random.Random(rng_seed).shuffle(entries)
    return " ".join(f"{i}. {word}" for i, word in enumerate(entries, 1)) if numbered else " ".join(entries)


def _common_words(tokenizer, length: int, rng: random.Random) -> _Prompt:
    vocabulary = list(english_words("ruler"))
    rng.shuffle(vocabulary)
    common, rare = vocabulary[:10], vocabulary[10:]
    shuffle_seed = str(rng.random())

    def renderer(common_repeats: int, rare_repeats: int) -> Callable[[int], str]:
        def render(n: int) -> str:
            entries = common * common_repeats + rare[:n] * rare_repeats
            return CWE_TEMPLATE.format(context=_shuffled_text(entries, shuffle_seed, numbered=True))

        return render

    render = renderer(30, 3)
    if count_tokens(tokenizer, render(0)) > length / 2:
        render = renderer(2, 1)
    return _Prompt(
        render=render,
        max_units=len(rare),
        references=common,
        max_new_tokens=128,
        answer_prefix=" Answer: The top 10 words that appear most often in the list are:",
    )


FWE_TEMPLATE = (
    "Read the following coded text and track how often each coded word appears. Find the three most "
    "frequent coded words.\n{context}\n"
    "Question: Do not provide any explanation. What are the three most frequent words in the coded text above?"
)
FWE_ALPHA = 2.0
FWE_VOCABULARY = 1000


def _zipf_counts(total: int) -> list[int]:
    weights = [rank**-FWE_ALPHA for rank in range(1, FWE_VOCABULARY + 1)]
    weight_sum = sum(weights)
    return [math.floor(total * weight / weight_sum) for weight in weights]


@functools.cache
def _fwe_min_total() -> int:
    """The fewest words for which the top 3 are strictly more frequent than the 4th."""
    for total in itertools.count(1):
        counts = _zipf_counts(total)
        if counts[2] > counts[3]:
            return total


def _frequent_words(length: int, rng: random.Random) -> _Prompt:
    # equal-length words, so that no coded word contains another
    coded = _distinct(lambda: "".join(rng.choices(string.ascii_lowercase, k=5)), FWE_VOCABULARY, set())
    shuffle_seed = str(rng.random())

    def render(n: int) -> str:
        # n counts words beyond the minimum, so even the shortest text has a well-defined top 3
        counts = _zipf_counts(_fwe_min_total() + n)
        entries = [word for word, count in zip(coded, counts) for _ in range(count)]
        return FWE_TEMPLATE.format(context=_shuffled_text(entries, shuffle_seed, numbered=False))

    return _Prompt(
        render=render,
        # rounding down drops less than one word per rank, and a word is at least one token
        max_units=length + FWE_VOCABULARY,
        references=coded[:3],
        max_new_tokens=64,
        answer_prefix=" Answer: According to the coded text above, the three most frequent words are:",
    )


# ---- question answering ----------------------------------------------------------------------------

QA_TEMPLATE = (
    "Read the documents below and answer the question that follows using only them. "
    "Reply with the answer alone, no other words.\n\n{context}\n\n"
    "Using only the documents above, answer the question. Reply with the answer alone, no other words.\n\n"
    "Question: {question}"
)


@dataclass(frozen=True)
class _QaSet:
    paragraphs: tuple[str, ...]
    questions: tuple[tuple[str, tuple[str, ...], tuple[int, ...]], ...]  # question, answers, golden indices


@functools.cache
def _squad() -> _QaSet:
    paragraphs, questions = [], []
    for article in ruler_json("squad.json")["data"]:
        for paragraph in article["paragraphs"]:
            index = len(paragraphs)
            paragraphs.append(paragraph["context"])
            for qa in paragraph["qas"]:
                answers = tuple(dict.fromkeys(answer["text"] for answer in qa["answers"]))
                if answers:  # unanswerable questions have none
                    questions.append((qa["question"], answers, (index,)))
    return _QaSet(tuple(paragraphs), tuple(questions))


@functools.cache
def _hotpotqa() -> _QaSet:
    index_of: dict[str, int] = {}
    questions = []
    for item in ruler_json("hotpotqa.json"):
        supporting = {title for title, _ in item["supporting_facts"]}
        golden = []
        for title, sentences in item["context"]:
            text = f"{title}\n{''.join(sentences).strip()}"
            index = index_of.setdefault(text, len(index_of))
            if title in supporting:
                golden.append(index)
        questions.append((item["question"], (item["answer"],), tuple(golden)))
    paragraphs = tuple(index_of)
    answerable = tuple(
        (question, answers, golden)
        for question, answers, golden in questions
        if answers[0].lower() in " ".join(paragraphs[i] for i in golden).lower()
    )
    return _QaSet(paragraphs, answerable)


def _question_answering(qa_set: _QaSet, length: int, rng: random.Random) -> _Prompt:
    question, answers, golden = rng.choice(qa_set.questions)
    distractors = [i for i in range(len(qa_set.paragraphs)) if i not in golden]
    rng.shuffle(distractors)
    golden_depths = [rng.random() for _ in golden]

    def render(n: int) -> str:
        """The golden paragraphs among distractors totalling n words."""
        documents, words_left = [], n
        for index in distractors:
            if words_left <= 0:
                break
            words = qa_set.paragraphs[index].split()
            documents.append(qa_set.paragraphs[index] if len(words) <= words_left else " ".join(words[:words_left]))
            words_left -= len(words)
        golden_texts = [qa_set.paragraphs[i] for i in golden]
        documents = _insert_at_depths(documents, golden_texts, golden_depths)
        context = "\n\n".join(f"Document {i}:\n{text}" for i, text in enumerate(documents, 1))
        return QA_TEMPLATE.format(context=context, question=question)

    return _Prompt(
        render=render,
        max_units=length,  # a word is at least one token
        references=list(answers),
        max_new_tokens=32,
        answer_prefix=" Answer:",
    )


# ---- the task --------------------------------------------------------------------------------------


def _prompt_for(subtask: str, tokenizer, length: int, rng: random.Random) -> _Prompt:
    if subtask in NIAH:
        return _niah(NIAH[subtask], length, rng)
    if subtask == "vt":
        return _variable_tracking(length, rng)
    if subtask == "cwe":
        return _common_words(tokenizer, length, rng)
    if subtask == "fwe":
        return _frequent_words(length, rng)
    return _question_answering(_squad() if subtask == "qa_1" else _hotpotqa(), length, rng)


def _check_subtask(subtask: str) -> str:
    if subtask not in SUBTASKS:
        raise ValueError(f"unknown ruler subtask '{subtask}'; choose from: {', '.join(SUBTASKS)}")
    return subtask


class RulerTask:
    """RULER; `ruler` runs all subtasks round-robin, `ruler/<subtask>` one of them."""

    def __init__(self, subtask: str | None = None):
        self.subtask = subtask and _check_subtask(subtask)
        self.name = f"ruler/{subtask}" if subtask else "ruler"

    def build(self, tokenizer, length: int, num_examples: int, seed: int, subtask: str | None = None) -> list[Example]:
        if subtask is not None and self.subtask is not None and subtask != self.subtask:
            raise ValueError(f"task '{self.name}' cannot build subtask '{subtask}'; use the task 'ruler/{subtask}'")
        chosen = subtask or self.subtask
        subtasks = [_check_subtask(chosen)] if chosen else list(SUBTASKS)
        examples = []
        for index in range(num_examples):
            name = subtasks[index % len(subtasks)]
            task = f"ruler/{name}"
            # one generator per example, so that an example does not depend on the ones before it
            rng = random.Random(f"{task}/{seed}/{index}")
            prompt = _prompt_for(name, tokenizer, length, rng)
            units, text = fit_to_length(prompt.render, tokenizer, length, prompt.max_units)
            if units == prompt.max_units:  # the word lists or the QA set are exhausted
                raise ValueError(f"{task} cannot reach {length} tokens: it runs out of filler text")
            examples.append(
                Example(
                    id=example_id(task, length, seed, index),
                    task=task,
                    prompt=text,
                    reference=prompt.references,
                    max_new_tokens=prompt.max_new_tokens,
                    answer_prefix=prompt.answer_prefix,
                )
            )
        return examples

    def score(self, prediction: str, example: Example) -> float:
        if example["task"] in ("ruler/qa_1", "ruler/qa_2"):
            return string_any(prediction, example["reference"])
        return string_recall(prediction, example["reference"])
