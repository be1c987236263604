"""lm-evaluation-harness's model type `refreshkv` (refreshkv/lm_eval/) on the embedded SmolLM2: the shipped niah task
under full and under refreshkv with K above the prompt, a multiple choice read from a user's own JSONL that moves
with the method at a small K, the prompts equal to `refreshkv eval`'s, and the one-line refusals."""

import json
import sys

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'refreshkv[lm_eval]')")

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from refreshkv.eval.examples import encode_prompt  # noqa: E402
from refreshkv.lm_eval import TASKS_DIR, ModelArgsError, RefreshKVLM  # noqa: E402
from refreshkv.lm_eval.__main__ import main  # noqa: E402
from refreshkv.lm_eval.task_data import TaskDataError, load  # noqa: E402
from refreshkv.runtime.models import ModelError  # noqa: E402

pytestmark = pytest.mark.embedded

PASSAGE = (
    "Anna keeps bees on the hill behind the mill. Each spring she counts the hives, mends the frames and writes the "
    "numbers in a blue book. The code for the gate is {number}. The river runs past the mill and the road runs past "
    "the river. In summer the honey is dark and in autumn it is pale. "
)


@pytest.fixture(scope="module")
def shipped():
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


@pytest.fixture(scope="module")
def own_data(tmp_path_factory):
    """A multiple-choice task on a user's own JSONL (dataset_path json + data_files), prompts of ~170 tokens."""
    folder = tmp_path_factory.mktemp("own-task")
    docs = [
        {"passage": PASSAGE.format(number=right) * 2, "choices": choices, "label": choices.index(right)}
        for right, choices in (("4821", ["4821", "7390", "1156", "9043"]), ("6604", ["3318", "5527", "6604", "2279"]))
    ]
    (folder / "gate.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (folder / "gate.yaml").write_text(
        "task: gate_code\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'gate.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: \"{{passage}}\\nWhich of these is the code for the gate: {{choices | join(', ')}}?\\nAnswer:\"\n"
        "doc_to_choice: choices\n"
        "doc_to_target: label\n"
        "metric_list:\n  - metric: acc\n"
    )
    return TaskManager(include_path=str(folder), include_defaults=False)


def samples(lm, task: str, manager, limit: int, **options):
    """Each example's responses (its answer, or each choice's (log-likelihood, is greedy)) and the task's metrics."""
    result = lm_eval.simple_evaluate(
        model=lm, tasks=[task], task_manager=manager, limit=limit, log_samples=True, **options
    )
    responses = [[response[0] for response in sample["resps"]] for sample in result["samples"][task]]
    return responses, result["results"][task]


def test_niah_with_k_above_the_prompt_scores_as_full(shipped):
    task, options = "refreshkv_niah_single_1_bare", {"apply_chat_template": True, "gen_kwargs": "max_gen_toks=6"}
    full = samples(RefreshKVLM(method="full", threads=1), task, shipped, 1, **options)
    kept = samples(RefreshKVLM(method="refreshkv", budget=4096, threads=1), task, shipped, 1, **options)
    assert full == kept
    assert full[0][0][0]  # an answer was decoded


def test_loglikelihood_moves_with_the_method_at_a_small_k(own_data):
    full, full_metrics = samples(RefreshKVLM(method="full", threads=1), "gate_code", own_data, 2)
    above, _ = samples(RefreshKVLM(method="refreshkv", budget=4096, threads=1), "gate_code", own_data, 2)
    small, _ = samples(RefreshKVLM(method="refreshkv", budget=16, threads=1), "gate_code", own_data, 2)
    assert above == full
    assert len(full) == 2 and all(len(choices) == 4 for choices in full)
    assert max(abs(a[0] - b[0]) for row, other in zip(full, small) for a, b in zip(row, other)) > 1e-3
    assert 0 <= full_metrics["acc,none"] <= 1


def test_niah_prompts_are_refreshkv_eval_prompts(shipped):
    """lm-eval with --apply_chat_template gives the model the tokens `refreshkv eval` gives it (both forms)."""
    lm = RefreshKVLM(method="full")
    contexts = []
    lm.answer = lambda context, gen_kwargs: contexts.append(context) or ""
    for form in ("bare", "prefixed"):
        contexts.clear()
        lm_eval.simple_evaluate(
            model=lm,
            tasks=[f"refreshkv_niah_multikey_1_{form}"],
            task_manager=shipped,
            limit=2,
            apply_chat_template=True,
        )
        docs = load(f"niah_multikey_1_{form}.jsonl")["test"]
        assert [lm.tok_encode(context) for context in contexts] == [
            encode_prompt(lm.tokenizer, docs[i], chat=True) for i in range(2)
        ]


@pytest.mark.parametrize(
    "args, error, words",
    [
        ({"method": "nosuch"}, ModelArgsError, "unknown method 'nosuch'; choose from:"),
        ({"method": "snapkv", "budgte": 8}, ModelArgsError, "unknown model_args budgte; give model, method"),
        ({"method": "snapkv", "budget": 0}, ModelArgsError, "budget must be an integer >= 1"),
        ({"model": "no-such-model"}, ModelError, "unknown model 'no-such-model'"),
        ({"method": "snapkv", "budget": 9000}, ModelArgsError, "budget (9000) is above the model's context of 8192"),
    ],
)
def test_bad_model_args_are_one_line(args, error, words):
    with pytest.raises(error) as caught:
        RefreshKVLM(**args)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_missing_task_data_names_the_path_looked_in(tmp_path):
    with pytest.raises(TaskDataError, match=f"looked for {tmp_path / 'gone.jsonl'}"):
        load(str(tmp_path / "gone.jsonl"))


def test_command_line_refuses_bad_model_args_in_one_line(monkeypatch, capsys):
    args = ["--model", "refreshkv", "--model_args", "method=snapkv,windw=8", "--tasks", "refreshkv_numbers"]
    monkeypatch.setattr(sys, "argv", ["refreshkv.lm_eval", *args, "--include_path", str(TASKS_DIR)])
    with pytest.raises(SystemExit) as exit:
        main()
    assert exit.value.code == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .startswith("refreshkv.lm_eval: error: unknown model_args windw; give model,")
    )
