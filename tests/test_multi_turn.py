"""The conversation tasks: one context, its questions asked turn by turn over one cache, one row per turn."""

import functools

import pytest
from conftest import tiny_model
from test_eval_runner import TOKENIZER

from refreshkv.eval.config import RunConfig
from refreshkv.eval.examples import prepare
from refreshkv.eval.report import write_report
from refreshkv.eval.results_file import ResultsFile, read_results
from refreshkv.eval.runner import Job, run_jobs
from refreshkv.eval.summary import turn_summary
from refreshkv.eval.tasks import get_task

LENGTH = 600


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=3, seed=0)


@pytest.mark.parametrize("kind", ["niah", "chain"])
def test_a_conversation_holds_its_needles_once_and_asks_one_per_turn(kind):
    task = get_task(f"multiturn/{kind}")
    [example] = task.build(TOKENIZER, LENGTH, 1, seed=3, needles=4)
    assert len(example["turns"]) == 4 and len(TOKENIZER.encode(example["prompt"])) <= LENGTH
    for turn in example["turns"]:
        sentence = turn["reference"] if kind == "niah" else f"is {turn['reference']}."
        assert example["prompt"].count(sentence) == 1
    if kind == "chain":  # later questions name no key: they depend on the previous answer
        assert [t["question"].count("-") for t in example["turns"]] == [1, 0, 0, 0]
    assert task.score_turn(f"It is {example['turns'][0]['reference'].upper()}.", example["turns"][0]) == 1.0
    assert task.score_turn("no idea", example["turns"][0]) == 0.0


def configs(methods):
    return [
        RunConfig(
            task="multiturn/niah", method=m, length=LENGTH, seed=0, params=p, chat=False, task_options={"needles": 3}
        )
        for m, p in methods
    ]


def test_each_turn_is_a_row_and_a_killed_run_resumes_whole_conversations(model, tmp_path):
    runs = configs([("full", {}), ("snapkv", {"budget": 32, "window": 4})])
    items = prepare(model, TOKENIZER, runs[0], 2)
    out = tmp_path / "turns.jsonl"
    with ResultsFile(out, run="r") as results:
        counts = run_jobs(model, TOKENIZER, [Job(c, items) for c in runs], results, progress=False)
    assert counts == {"done_before": 0, "ran": 4}  # (configuration, conversation) pairs
    rows = read_results(out)[0]
    assert len(rows) == 2 * 2 * 3 and len({r["id"] for r in rows if r["method"] == "full"}) == 6
    assert {r["turn"] for r in rows} == {1, 2, 3} and all(r["turns"] == 3 and r["conversation"] for r in rows)
    first = [r for r in rows if r["turn"] == 1]
    assert all(0 < r["question_tokens"] < r["prompt_tokens"] / 10 for r in first)  # a turn appends its question only
    with ResultsFile(out, run="r") as results:
        assert run_jobs(model, TOKENIZER, [Job(c, items) for c in runs], results, progress=False)["ran"] == 0
    summary = turn_summary(rows)
    assert [s["method"] for s in summary] == ["full", "snapkv(budget=32,window=4)"]
    assert all(s["conversations"] == 2 for s in summary)
    groups, _, written = write_report([out], tmp_path / "report", plots=False)
    assert {g.task for g in groups} == {"multiturn/niah turn 1", "multiturn/niah turn 2", "multiturn/niah turn 3"}
    assert "turn 1 against the later turns" in (tmp_path / "report" / "summary.md").read_text()


def test_a_conversation_too_long_for_the_model_is_refused_before_running(model, monkeypatch):
    """The task leaves room for its turns by an estimate; prepare counts the real tokens and refuses what overflows."""
    task = get_task("multiturn/niah")
    build = task.build

    @functools.wraps(build)  # the same options
    def long_questions(*args, **kwargs):
        examples = build(*args, **kwargs)
        for turn in examples[0]["turns"]:
            turn["question"] *= 20
        return examples

    monkeypatch.setattr(task, "build", long_questions)
    run = RunConfig(task="multiturn/niah", method="full", length=1000, seed=0, chat=False, task_options={"needles": 8})
    with pytest.raises(ValueError, match="a conversation of .* exceeds the model's context of 1024"):
        prepare(model, TOKENIZER, run, 1)


def test_turn_summary_pairs_each_conversations_first_and_later_turns():
    scores = {"a": [1.0, 0.0, 1.0], "b": [0.0, 1.0, 1.0]}  # turn 1, 2, 3 of two conversations
    rows = [
        {
            "task": "multiturn/niah",
            "length": 600,
            "method": "full",
            "params": {},
            "conversation": c,
            "turn": t + 1,
            "score": s,
        }
        for c, turns in scores.items()
        for t, s in enumerate(turns)
    ]
    [summary] = turn_summary(rows)
    assert summary["conversations"] == 2
    assert (summary["turn_1"], summary["later_turns"], summary["later_vs_turn_1"]) == (0.5, 0.75, 1.5)
    low, high = summary["later_vs_turn_1_ci"]
    assert low <= 1.5 <= high and low < high  # resampled over conversations


def test_bare_questions_open_no_answer_and_unknown_forms_are_refused():
    task = get_task("multiturn/niah")
    [prefixed] = task.build(TOKENIZER, LENGTH, 1, seed=3, needles=3)
    [bare] = task.build(TOKENIZER, LENGTH, 1, seed=3, needles=3, question="bare")
    assert all(turn["answer_prefix"] for turn in prefixed["turns"])
    assert [turn["answer_prefix"] for turn in bare["turns"]] == ["", "", ""]
    assert [t["question"] for t in bare["turns"]] == [t["question"] for t in prefixed["turns"]]
    with pytest.raises(ValueError, match=r"unknown question form 'sentence'; choose from: prefixed, bare$"):
        task.build(TOKENIZER, LENGTH, 1, seed=3, question="sentence")
