"""lm-evaluation-harness's model type `refreshkv` (refreshkv/lm_eval/) on the embedded SmolLM2, with short tasks on a
user's own JSONL: generation under full and under refreshkv with K above the prompt, a multiple choice that moves with
the method at a small K, full equal to lm-eval's own `hf` model; the shipped niah tasks' prompts equal to
`refreshkv eval`'s; the one-line refusals."""

import json
import shutil
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
    """Two tasks on a user's own JSONL, prompts of ~170 tokens: a multiple choice (dataset_path json + data_files),
    and the same passages asked as a niah question, scored by RULER's metric (the shipped tasks' local.py beside)."""
    folder = tmp_path_factory.mktemp("own-task")
    docs = [
        {
            "passage": PASSAGE.format(number=right) * 2,
            "choices": choices,
            "label": choices.index(right),
            "task": "ruler/niah_single_1",
            "reference": [right],
        }
        for right, choices in (("4821", ["4821", "7390", "1156", "9043"]), ("6604", ["3318", "5527", "6604", "2279"]))
    ]
    (folder / "gate.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    data = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'gate.jsonl'}\ntest_split: test\n"
    (folder / "gate.yaml").write_text(
        f"task: gate_code\n{data}"
        "output_type: multiple_choice\n"
        "doc_to_text: \"{{passage}}\\nWhich of these is the code for the gate: {{choices | join(', ')}}?\\nAnswer:\"\n"
        "doc_to_choice: choices\n"
        "doc_to_target: label\n"
        "metric_list:\n  - metric: acc\n"
    )
    shutil.copy(TASKS_DIR / "local.py", folder)
    (folder / "gate_answer.yaml").write_text(
        f"task: gate_answer\n{data}"
        "output_type: generate_until\n"
        'doc_to_text: "{{passage}}\\nWhat is the code for the gate?"\n'
        "doc_to_target: label\n"
        "generation_kwargs:\n  until: []\n  max_gen_toks: 12\n"
        "process_results: !function local.score_ruler\n"
        "metric_list:\n  - metric: score\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return TaskManager(include_path=str(folder), include_defaults=False)


def samples(lm, task: str, manager, limit: int, **options):
    """Each example's responses (its answer, or each choice's (log-likelihood, is greedy)) and the task's metrics."""
    result = lm_eval.simple_evaluate(
        model=lm, tasks=[task], task_manager=manager, limit=limit, log_samples=True, **options
    )
    responses = [[response[0] for response in sample["resps"]] for sample in result["samples"][task]]
    return responses, result["results"][task]


def test_generation_with_k_above_the_prompt_scores_as_full(own_data):
    options = {"apply_chat_template": True}
    full = samples(RefreshKVLM(method="full", threads=1), "gate_answer", own_data, 2, **options)
    kept = samples(RefreshKVLM(method="refreshkv", budget=4096, threads=1), "gate_answer", own_data, 2, **options)
    assert full == kept
    assert all(answer[0] for answer in full[0])  # answers were decoded
    assert full[1]["score,none"] == 1.0  # both answers hold their code: RULER's metric through local.score_ruler


def test_loglikelihood_moves_with_the_method_at_a_small_k(own_data):
    full, full_metrics = samples(RefreshKVLM(method="full", threads=1), "gate_code", own_data, 2)
    above, _ = samples(RefreshKVLM(method="refreshkv", budget=4096, threads=1), "gate_code", own_data, 2)
    small, _ = samples(RefreshKVLM(method="refreshkv", budget=16, threads=1), "gate_code", own_data, 2)
    assert above == full
    assert len(full) == 2 and all(len(choices) == 4 for choices in full)
    assert max(abs(a[0] - b[0]) for row, other in zip(full, small) for a, b in zip(row, other)) > 1e-3
    assert 0 <= full_metrics["acc,none"] <= 1


def test_full_equals_lm_evals_hf_model_and_rolling_moves_with_the_method(own_data):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from refreshkv.runtime.loading import resolve_model_dir

    hf = HFLM(pretrained=str(resolve_model_dir("smollm2-135m")), device="cpu", dtype="float32")
    full = RefreshKVLM(method="full", threads=1, target_tokens=20)
    ours, theirs = samples(full, "gate_code", own_data, 2)[0], samples(hf, "gate_code", own_data, 2)[0]
    assert max(abs(a[0] - b[0]) for row, other in zip(ours, theirs) for a, b in zip(row, other)) < 1e-3
    document = [Instance("loglikelihood_rolling", {}, (PASSAGE.format(number=4821) * 3,), 0)]
    rolling = full.loglikelihood_rolling(document, disable_tqdm=True)[0]
    assert rolling == pytest.approx(hf.loglikelihood_rolling(document, disable_tqdm=True)[0], abs=1e-3)
    snapkv = RefreshKVLM(method="snapkv", budget=8, window=4, threads=1, target_tokens=20)
    assert abs(snapkv.loglikelihood_rolling(document, disable_tqdm=True)[0] - rolling) > 1


@pytest.fixture
def registry():
    """The method registry as it was, restored after the test."""
    from refreshkv.core.policy import METHODS, PROVIDERS

    saved = dict(METHODS), dict(PROVIDERS)
    yield
    METHODS.clear(), METHODS.update(saved[0])
    PROVIDERS.clear(), PROVIDERS.update(saved[1])


def test_a_plugin_method_runs_by_name_with_its_parameters(registry):
    """A method another package registers (as the entry-point loader does) is a model_args method like the others."""
    import dataclasses

    from lm_eval.api.instance import Instance

    from refreshkv.core.policy import make_policy, register

    register(dataclasses.dataclass(type("Plugin", (type(make_policy("snapkv")),), {"name": "plugin-snap"})), "somepkg")
    request = [Instance("loglikelihood", {}, (PASSAGE.format(number=4821) + "The code for the gate is", " 4821"), 0)]
    plugin = RefreshKVLM(method="plugin-snap", budget=40, window=8, threads=1)
    snapkv = RefreshKVLM(method="snapkv", budget=40, window=8, threads=1)
    full = RefreshKVLM(method="full", threads=1)
    scores = [lm.loglikelihood(request, disable_tqdm=True)[0][0] for lm in (plugin, snapkv, full)]
    assert scores[0] == scores[1] != scores[2]


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


def test_keyed_numbers_choose_among_the_texts_needles_after_the_asked_keys_prefix():
    """Each choice is a needle number of the text (the four keys'), the right one the asked key's: the prompt and
    prefix are niah_multikey_1's prefixed example of the same index."""
    keyed, prefixed = load("keyed_numbers.jsonl")["test"], load("niah_multikey_1_prefixed.jsonl")["test"]
    assert len(keyed) == len(prefixed) == 20
    for doc, niah in zip(keyed, prefixed):
        assert (doc["prompt"], doc["answer_prefix"], doc["reference"]) == (
            niah["prompt"],
            niah["answer_prefix"],
            niah["reference"],
        )
        assert len(set(doc["choices"])) == 4 and doc["choices"][doc["label"]] == doc["reference"][0]
        assert all("special magic numbers for" in doc["prompt"].split(choice)[0][-80:] for choice in doc["choices"])


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


def test_command_line_refuses_in_one_line(monkeypatch, capsys, tmp_path):
    """Bad model arguments, and a task whose data file is not there (the path is named)."""
    (tmp_path / "gone.yaml").write_text(
        f"task: gone\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'gone.jsonl'}\n"
        'test_split: test\noutput_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: x\n'
    )
    for args, said in (
        (["method=snapkv,windw=8", "refreshkv_numbers", TASKS_DIR], "unknown model_args windw; give model,"),
        (["method=full,threads=1", "gone", tmp_path], f"Unable to find '{tmp_path / 'gone.jsonl'}'"),
        (["method=full", "nosuch_task", TASKS_DIR], "unknown task nosuch_task; list the tasks with: python -m "),
    ):
        model_args, task, folder = args
        command = ["--model", "refreshkv", "--model_args", model_args, "--tasks", task, "--include_path", str(folder)]
        monkeypatch.setattr(sys, "argv", ["refreshkv.lm_eval", *command])
        with pytest.raises(SystemExit) as exit:
            main()
        assert exit.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1].startswith(f"refreshkv.lm_eval: error: {said}")


@pytest.mark.parametrize("invoked", [["-m"], ["python"]])
def test_without_lm_eval_the_package_says_what_to_install(monkeypatch, capsys, invoked):
    """`python -m refreshkv.lm_eval` ends in one line; an import raises ModuleNotFoundError naming the extra."""
    for name in [name for name in sys.modules if name == "lm_eval" or name.startswith("lm_eval.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    for name in [name for name in sys.modules if name.startswith("refreshkv.lm_eval")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "argv", invoked)
    needs = "refreshkv.lm_eval needs lm-eval: pip install 'refreshkv[lm_eval]'"
    with pytest.raises(SystemExit if invoked == ["-m"] else ModuleNotFoundError) as caught:
        import refreshkv.lm_eval  # noqa: F401
    if invoked == ["-m"]:
        assert caught.value.code == 2 and capsys.readouterr().err == f"refreshkv.lm_eval: error: {needs}\n"
    else:
        assert str(caught.value) == needs


def lm_eval_cli(monkeypatch, capsys, *args) -> tuple[int, str]:
    """(exit code, stderr) of `python -m refreshkv.lm_eval ARGS`, in this process."""
    monkeypatch.setattr(sys, "argv", ["refreshkv.lm_eval", *map(str, args)])
    with pytest.raises(SystemExit) as exit:
        main()
    return exit.value.code, capsys.readouterr().err


@pytest.fixture
def executed(monkeypatch):
    """lm-eval's run replaced (its task index takes seconds): records that it started, runs `then` if set."""
    from lm_eval._cli import HarnessCLI

    calls = {"then": None, "ran": 0}

    def execute(self, args):
        calls["ran"] += 1
        if calls["then"] is not None:
            calls["then"]()

    monkeypatch.setattr(HarnessCLI, "execute", execute)
    return calls


def test_paths_that_cannot_work_are_refused_before_the_run(monkeypatch, capsys, tmp_path, executed):
    base = ["--model", "refreshkv", "--tasks", "refreshkv_numbers"]
    code, err = lm_eval_cli(monkeypatch, capsys, *base, "--include_path", tmp_path / "nowhere")
    assert code == 2 and err.splitlines()[-1] == (
        f"refreshkv.lm_eval: error: --include_path {tmp_path / 'nowhere'} does not exist; give a folder (or YAML "
        "file) of task configs"
    )
    (tmp_path / "a-file").write_text("x")
    out = tmp_path / "a-file" / "results"
    code, err = lm_eval_cli(monkeypatch, capsys, *base, "--include_path", TASKS_DIR, "--output_path", out)
    assert code == 2 and err.splitlines()[-1] == (
        f"refreshkv.lm_eval: error: --output_path {out} cannot be written (its folder is not writable); give another"
    )
    assert executed["ran"] == 0
    code, err = lm_eval_cli(monkeypatch, capsys, *base, "--output_path", tmp_path / "new" / "results")
    assert code == 0 and executed["ran"] == 1  # a folder still to be made under a writable one


def test_ctrl_c_and_results_not_saved_end_in_one_line_never_exit_0(monkeypatch, capsys, tmp_path, executed):
    import logging

    def interrupted():
        raise KeyboardInterrupt

    executed["then"] = interrupted
    code, err = lm_eval_cli(monkeypatch, capsys, "--model", "refreshkv", "--tasks", "x")
    assert code == 130 and err.splitlines()[-1] == "refreshkv.lm_eval: interrupted"

    def not_saved():  # what lm-eval's evaluation tracker logs when a write fails, and then carries on
        tracker = logging.getLogger("lm_eval.loggers.evaluation_tracker")
        tracker.warning("Could not save sample results")
        tracker.info(repr(OSError(28, "No space left on device")))

    executed["then"] = not_saved
    code, err = lm_eval_cli(monkeypatch, capsys, "--model", "refreshkv", "--tasks", "x", "--output_path", tmp_path)
    assert code == 1 and err.splitlines()[-1] == (
        f"refreshkv.lm_eval: error: lm-eval did not save what it was asked to save under {tmp_path}: Could not save "
        "sample results (OSError(28, 'No space left on device'))"
    )
