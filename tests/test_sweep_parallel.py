"""Sweeps that share one prefill per example, and data-parallel sweeps under torchrun (2 CPU processes, gloo)."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from test_bad_input import cli as cli_here
from test_eval_runner import NIAH, TOKENIZER, CountCalls, text_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from refreshkv.eval.distributed import Launch, LaunchError, current_launch, rank_file, sweep_files
from refreshkv.eval.sweep import load_sweep, open_results, run_sweep
from refreshkv.runtime.loading import resolve_model_dir

pytest.importorskip("long_context_eval")
pytest.importorskip("wonderwords")

METHODS = """
          - full
          - {name: refreshkv, params: {budget: 16, qc_stride: 2}}
          - {name: snapkv, params: {budget: 16, window: 4}}
"""


def write_sweep(
    folder: Path, doc: Path, model: str = "tiny", out: str = "results.jsonl", examples: int = 2, fidelity: bool = False
) -> Path:
    spec = folder / f"{out}.yaml"
    spec.write_text(
        textwrap.dedent(f"""
        out: {out}
        model: {model}
        chat: false
        fidelity: {str(fidelity).lower()}
        num_examples: {examples}
        lengths: [300]
        tasks:
          - {NIAH}
          - {{name: ppl, options: {{paths: [{doc}], target_tokens: 8}}}}
        methods:""")
        + METHODS
    )
    return spec


def rows_of(paths) -> dict:
    return {(r["config"], r["id"]): r for path in paths for r in map(json.loads, Path(path).read_text().splitlines())}


def test_ranks_share_the_work_left_not_the_whole_sweep(tmp_path):
    """A resumed data-parallel sweep deals the examples still to run among the ranks: rows done by one rank before
    do not leave the other with all of what remains."""
    model, doc = tiny_model("llama", layers=2, seed=0), text_file(tmp_path / "doc.txt")
    spec = write_sweep(tmp_path, doc, out="resumed.jsonl", examples=4)  # 8 prompts (2 tasks x 4), 3 methods each
    sweep = load_sweep(spec)
    first = Launch(rank=0, world=2)
    with open_results(sweep, first) as results:  # a first launch stopped after rank 0's share of two prompts
        run_sweep(sweep, model, TOKENIZER, progress=False, results=results, launch=first)
    done = rows_of(sweep_files(sweep.out))
    assert len(done) == 12  # 4 of the 8 prompts (every other one) x 3 methods
    ran = []
    for rank in (0, 1):
        launch = Launch(rank=rank, world=2)
        with open_results(sweep, launch) as results:
            results.done = set(done)  # both ranks read the rows done before either runs (the command checks it)
            ran.append(run_sweep(sweep, model, TOKENIZER, progress=False, results=results, launch=launch)["ran"])
    assert ran == [6, 6]  # the 4 prompts left, 2 each (with the old every-other-prompt rule: [0, 12])
    assert len(rows_of(sweep_files(sweep.out))) == 24


def test_shared_prefill_sweep_equals_one_prefill_per_method(tmp_path):
    model, doc = tiny_model("llama", layers=3, seed=0), text_file(tmp_path / "doc.txt")
    prompt_calls = CountCalls(model)
    shared = load_sweep(write_sweep(tmp_path, doc, out="shared.jsonl"))
    assert run_sweep(shared, model, TOKENIZER, progress=False) == {"done_before": 0, "ran": 12}
    calls_shared = prompt_calls.calls
    prompt_calls.calls = 0
    alone = load_sweep(write_sweep(tmp_path, doc, out="alone.jsonl"))
    run_sweep(alone, model, TOKENIZER, progress=False, share_prefill=1)
    prompt_calls.remove()
    assert calls_shared < prompt_calls.calls  # forward passes: 4 prefills + decodes vs 12 prefills + decodes
    assert prompt_calls.calls - calls_shared == 8
    together, apart = rows_of([shared.out]), rows_of([alone.out])
    assert together.keys() == apart.keys()
    for key, row in together.items():
        assert row["prediction"] == apart[key]["prediction"]
        assert row["score"] == pytest.approx(apart[key]["score"], rel=1e-5)
        assert row["losses"] == pytest.approx(apart[key]["losses"], abs=1e-5) if "losses" in row else True
        assert (row["prefill_shared_by"], apart[key]["prefill_shared_by"]) == (3, 1)


def test_fidelity_rows_are_the_same_with_one_prefill_or_one_per_method(tmp_path):
    """Every generation row but full's compares the method with full on full's answer; alone, full runs unseen."""
    model, doc = tiny_model("llama", layers=3, seed=0), text_file(tmp_path / "doc.txt")
    shared = load_sweep(write_sweep(tmp_path, doc, out="shared.jsonl", fidelity=True))
    run_sweep(shared, model, TOKENIZER, progress=False)
    alone = load_sweep(write_sweep(tmp_path, doc, out="alone.jsonl", fidelity=True))
    run_sweep(alone, model, TOKENIZER, progress=False, share_prefill=1)
    together, apart = rows_of([shared.out]), rows_of([alone.out])
    generation = [key for key, row in together.items() if row["task"] != "ppl"]
    assert generation
    for key in generation:
        row = together[key]
        assert row["kl_to_full"] == pytest.approx(apart[key]["kl_to_full"], abs=1e-5)
        assert row["top1_agreement"] == apart[key]["top1_agreement"]
        assert row["first_divergence"] == apart[key]["first_divergence"]
        if row["method"] == "full":
            assert (row["kl_to_full"], row["top1_agreement"], row["first_divergence"]) == (0.0, 1.0, None)
        assert row["prefill_shared_by"] == 3 and apart[key]["prefill_shared_by"] == 1


def test_a_method_with_its_own_prefill_runs_alone_with_a_note(tmp_path, capsys):
    from test_shared_prefill import OwnPrefill

    from refreshkv.core.policy import METHODS, register

    register(OwnPrefill)
    try:
        spec = tmp_path / "own.yaml"
        spec.write_text(
            f"out: own.jsonl\nchat: false\nfidelity: false\nnum_examples: 1\nlengths: [300]\ntasks: [{NIAH}]\n"
            "methods: [full, own-prefill, {name: snapkv, params: {budget: 16, window: 4}}]\n"
        )
        run_sweep(load_sweep(spec), tiny_model("llama", layers=3, seed=0), TOKENIZER, progress=False)
    finally:
        del METHODS["own-prefill"]
    assert "note: own-prefill compute(s) their own prefill and run alone" in capsys.readouterr().err
    shared_by = {row["method"]: row["prefill_shared_by"] for row in rows_of([tmp_path / "own.jsonl"]).values()}
    assert shared_by == {"full": 2, "own-prefill": 1, "snapkv": 2}


def test_a_task_runs_its_own_number_of_examples(tmp_path):
    text_file(tmp_path / "doc.txt")
    spec = tmp_path / "counts.yaml"
    spec.write_text(
        textwrap.dedent(f"""
        out: counts.jsonl
        chat: false
        num_examples: 1
        lengths: [300]
        tasks:
          - {{name: {NIAH}, num_examples: 2}}
          - {{name: ppl, options: {{paths: [doc.txt], target_tokens: 8}}, num_examples: 3}}
        methods: [full]
    """)
    )
    sweep = load_sweep(spec)
    assert sweep.counts() == f"{NIAH} x2, ppl x3"
    run_sweep(sweep, tiny_model("llama", layers=3, seed=0), TOKENIZER, progress=False)
    rows = rows_of([tmp_path / "counts.jsonl"]).values()
    assert sorted(row["task"] for row in rows) == ["ppl"] * 3 + [NIAH] * 2
    assert {row["task_options"].get("paths", [None])[0] for row in rows} == {None, "doc.txt"}


def test_a_rank_file_of_another_sweep_is_refused(tmp_path):
    from refreshkv.eval.results_file import ResultsError
    from refreshkv.eval.sweep import open_results

    sweep = load_sweep(write_sweep(tmp_path, text_file(tmp_path / "doc.txt")))
    (tmp_path / "results.rank1.jsonl").write_text('{"run":"sweep-other","config":"c","id":"i"}\n')
    with pytest.raises(ResultsError, match="results.rank1.jsonl holds results of another configuration"):
        open_results(sweep, Launch(0, 2))
    assert not (tmp_path / "results.rank0.jsonl").exists()  # nothing written


def test_launch_environment_and_rank_files(tmp_path):
    assert current_launch({}) == Launch(0, 1, 0)
    assert current_launch({"RANK": "1", "WORLD_SIZE": "2"}) == Launch(1, 2, 1)
    with pytest.raises(LaunchError, match="RANK=2 must be below WORLD_SIZE=2"):
        current_launch({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(LaunchError, match="WORLD_SIZE='two'"):
        current_launch({"WORLD_SIZE": "two"})
    out = tmp_path / "study.jsonl"
    assert rank_file(out, Launch()) == out and rank_file(out, Launch(1, 2)) == tmp_path / "study.rank1.jsonl"
    for name in ("study.rank1.jsonl", "study.rank0.jsonl", "study.ranked.jsonl", "other.rank0.jsonl"):
        (tmp_path / name).write_text("")
    assert sweep_files(out) == [tmp_path / "study.rank0.jsonl", tmp_path / "study.rank1.jsonl"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama saved with the embedded model's tokenizer, loadable by `--model`/`model:`."""
    folder = tmp_path_factory.mktemp("tiny-model")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None), local_files_only=True)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def cli(*args, env=None, module="refreshkv"):
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def test_two_process_sweep_writes_the_rows_of_one_process(tmp_path, model_dir, monkeypatch, capsys):
    """torchrun's two ranks write the rows `refreshkv sweep` writes alone. The one-process commands run in this
    process (`cli_here`: the console entry point), sparing a process start each (~5 s here)."""
    doc = text_file(tmp_path / "doc.txt")
    code, _, err = cli_here(
        monkeypatch, capsys, "sweep", write_sweep(tmp_path, doc, str(model_dir), out="single.jsonl", examples=3)
    )
    assert code == 0, err
    spec = write_sweep(tmp_path, doc, str(model_dir), out="parallel.jsonl", examples=3)
    parallel = cli(
        "--nproc-per-node",
        "2",
        "--master-port",
        free_port(),
        "-m",
        "refreshkv",
        "sweep",
        str(spec),
        module="torch.distributed.run",
    )
    assert parallel.returncode == 0, parallel.stderr
    out = tmp_path / "parallel.jsonl"
    shards = sweep_files(out)
    assert shards == [tmp_path / "parallel.rank0.jsonl", tmp_path / "parallel.rank1.jsonl"]
    assert all(rows_of([shard]) for shard in shards)  # both ranks did work
    one, two = rows_of([tmp_path / "single.jsonl"]), rows_of(shards)
    assert one.keys() == two.keys() and len(one) == 18
    assert all(one[key]["prediction"] == two[key]["prediction"] and one[key]["id"] == two[key]["id"] for key in one)
    # resuming with one process finds nothing left to do; report merges the rank files
    code, stdout, err = cli_here(monkeypatch, capsys, "sweep", spec)
    assert code == 0 and "0 row(s) run, 18 already" in stdout, stdout + err
    assert not out.exists()
    code, _, err = cli_here(monkeypatch, capsys, "report", out, "--no-plots", "--out-dir", tmp_path / "report")
    assert code == 0, err
    assert "| ruler/niah_single_1 | 300 | full | 3 |" in (tmp_path / "report" / "summary.md").read_text()


def test_ranks_with_different_sweeps_stop_with_one_line(tmp_path, model_dir):
    doc = text_file(tmp_path / "doc.txt")
    specs = [write_sweep(tmp_path, doc, str(model_dir), out=f"mismatch{i}.jsonl", examples=1 + i) for i in range(2)]
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port()}
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "refreshkv", "sweep", str(spec)],
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), **env},
        )
        for rank, spec in enumerate(specs)
    ]
    for process in processes:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 2, stderr
        assert stderr.strip().count("\n") == 0 and "rank 1 has sweep" in stderr and "same sweep file" in stderr
    assert not list(tmp_path.glob("mismatch*.jsonl"))


def test_a_method_that_cannot_follow_fulls_answer_fails_the_example_and_writes_nothing(tmp_path):
    """Issue 30: a method whose cache refuses tokens (its own answer's or full's, fed to its second cache for
    fidelity) ends the run in one error line, with no row of the example written, full's included: rows are
    written per example once every method has run, so a resumed run has nothing to undo."""
    from refreshkv.core.policy import METHODS, PolicyError, register
    from refreshkv.methods.snapkv import SnapKV

    class Refusing(SnapKV):
        name = "refusing"

        def decode(self, layer, query, key, value, scaling):
            if layer.step > 2:
                raise PolicyError("method 'refusing' takes at most 2 decoded tokens")
            return super().decode(layer, query, key, value, scaling)

    register(Refusing)
    try:
        spec = tmp_path / "refusing.yaml"
        spec.write_text(
            f"out: refusing.jsonl\nchat: false\nnum_examples: 1\nlengths: [300]\ntasks: [{NIAH}]\n"
            "methods: [full, {name: refusing, params: {budget: 16, window: 4}}]\n"
        )
        with pytest.raises(PolicyError, match="^method 'refusing' takes at most 2 decoded tokens$"):
            run_sweep(load_sweep(spec), tiny_model("llama", layers=3, seed=0), TOKENIZER, progress=False)
    finally:
        del METHODS["refusing"]
    assert not (tmp_path / "refusing.jsonl").exists()
