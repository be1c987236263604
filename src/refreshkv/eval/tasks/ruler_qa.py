"""RULER's question answering (qa.py), beside ruler_prompts.py's other families: a question of SQuAD or HotpotQA (read
from the wheel's data/synthetic/json/) asked over its golden documents among distractors, the distractors being the
filler units that ruler.py fits to the length.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from refreshkv.eval.sources import MissingDataError, ruler_json, ruler_script_string
from refreshkv.eval.tasks.ruler_prompts import Frame, Prompt, family_constants


@dataclass(frozen=True)
class _Question:
    text: str
    answers: tuple[str, ...]
    golden: tuple[int, ...]  # documents that go into every context
    same_article: tuple[int, ...] = ()  # SQuAD: the article's other paragraphs, the first distractors


@dataclass(frozen=True)
class _QaSet:
    documents: tuple[str, ...]
    questions: tuple[_Question, ...]


@functools.cache
def _squad() -> _QaSet:
    articles = ruler_json("squad.json")["data"]
    documents = sorted({paragraph["context"] for article in articles for paragraph in article["paragraphs"]})
    index = {document: i for i, document in enumerate(documents)}
    questions = []
    for article in articles:
        article_documents = [index[paragraph["context"]] for paragraph in article["paragraphs"]]
        for paragraph in article["paragraphs"]:
            own = index[paragraph["context"]]
            others = tuple(i for i in article_documents if i != own)
            for qa in paragraph["qas"]:
                if not qa["is_impossible"]:
                    answers = tuple(answer["text"] for answer in qa["answers"])
                    questions.append(_Question(qa["question"], answers, (own,), others))
    return _QaSet(tuple(documents), tuple(questions))


@functools.cache
def _hotpotqa() -> _QaSet:
    items = ruler_json("hotpotqa.json")
    documents = sorted({f"{title}\n{''.join(sentences)}" for item in items for title, sentences in item["context"]})
    index = {document: i for i, document in enumerate(documents)}
    questions = tuple(
        # all ten paragraphs of the item, its supporting ones and its own distractors
        _Question(item["question"], (item["answer"],), tuple(index[f"{t}\n{''.join(s)}"] for t, s in item["context"]))
        for item in items
    )
    return _QaSet(tuple(documents), questions)


def question_answering(args: dict, frame: Frame, tokenizer, length: int, rng: random.Random) -> Prompt:
    family = family_constants("qa")
    qa_sets = {"squad": _squad, "hotpotqa": _hotpotqa}
    if args["dataset"] not in qa_sets:
        raise MissingDataError(f"RULER QA dataset '{args['dataset']}' of synthetic.yaml is not implemented here")
    qa_set = qa_sets[args["dataset"]]()
    question = rng.choice(qa_set.questions)
    same_article = list(question.same_article)
    rng.shuffle(same_article)
    used = {*question.golden, *question.same_article}
    others = [i for i in range(len(qa_set.documents)) if i not in used]
    rng.shuffle(others)
    distractors = same_article + others
    document_form = ruler_script_string("qa.py", "DOCUMENT_PROMPT")
    shuffle_seed = str(rng.random())
    template = frame.wrap(family["template"])

    def render(n: int) -> str:
        documents = [qa_set.documents[i] for i in (*question.golden, *distractors[:n])]
        random.Random(shuffle_seed).shuffle(documents)
        context = "\n\n".join(document_form.format(i=i, document=document) for i, document in enumerate(documents, 1))
        return template.format(context=context, query=question.text)

    return Prompt(
        render=render,
        max_units=len(distractors),
        references=list(question.answers),
        answer_prefix=family["answer_prefix"],
    )
