"""The evaluation runner, sweeps, resume semantics, teacher-forced perplexity, attention recovery and reports."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest
import torch
from conftest import random_prompt, tiny_model
from typer.testing import CliRunner

from refreshkv.core.policy import make_policy
from refreshkv.eval.config import RunConfig
from refreshkv.eval.perplexity import continuation_losses, plain_losses, teacher_forced
from refreshkv.eval.recovery import RecoveryProbe
from refreshkv.eval.report import load_results, write_report
from refreshkv.eval.results_file import ResultsError, read_results
from refreshkv.eval.runner import run_eval
from refreshkv.eval.sweep import SweepError, load_sweep, run_sweep
from refreshkv.runtime.generate import generate

TESTS = Path(__file__).parent
pytest.importorskip("long_context_eval")
pytest.importorskip("wonderwords")


class WordTokenizer:
    """One token per whitespace-separated word, ids in the tiny models' vocabulary (3..127)."""

    def encode(self, text, add_special_tokens=True):
        return [3 + zlib.crc32(word.encode()) % 125 for word in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


TOKENIZER = WordTokenizer()
NIAH = "ruler/niah_single_1"


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=3, seed=0)


def config(**overrides):
    fields = dict(task=NIAH, method="full", length=300, seed=0, model="tiny", chat=False)
    return RunConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    return text_file(tmp_path_factory.mktemp("doc") / "doc.txt")


def quick(doc, **overrides):
    """A cheap configuration: perplexity of 8 tokens after 60."""
    return config(
        **{"task": "ppl", "length": 60, "task_options": {"paths": [str(doc)], "target_tokens": 8}, **overrides}
    )


def text_file(path: Path, words: int = 3000) -> Path:
    generator = torch.Generator().manual_seed(0)
    vocabulary = [f"word{i}" for i in range(400)]
    picks = torch.randint(0, len(vocabulary), (words,), generator=generator).tolist()
    path.write_text(" ".join(vocabulary[i] for i in picks), encoding="utf-8")
    return path


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class CountCalls:
    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, *args):
        self.calls += 1

    def remove(self):
        self.handle.remove()


# ---- sweep end to end --------------------------------------------------------------------------------------------


def test_tiny_sweep_writes_jsonl_and_report_with_plots(tmp_path, model):
    spec = tmp_path / "sweep.yaml"
    spec.write_text(
        textwrap.dedent(f"""
        out: results.jsonl
        model: tiny-llama
        chat: false
        num_examples: 2
        lengths: [300]
        tasks: [{NIAH}]
        methods:
          - full
          - {{name: refreshkv, params: {{budget: 16, qc_stride: 2}}}}
    """)
    )
    sweep = load_sweep(spec)
    assert sweep.out == tmp_path / "results.jsonl"
    counts = run_sweep(sweep, model, TOKENIZER, progress=False)
    assert counts == {"done_before": 0, "ran": 4}
    rows = lines(sweep.out)
    assert len(rows) == 4 and {r["method"] for r in rows} == {"full", "refreshkv"}
    for row in rows:
        assert row["run"] == sweep.identity()
        for field in (
            "task",
            "method",
            "params",
            "length",
            "seed",
            "id",
            "prediction",
            "reference",
            "score",
            "prefill_s",
            "decode_ms_per_token",
            "full_step_fraction",
            "kv_bytes_full",
            "kv_bytes_attended_mean",
            "budget_ratio",
            "budget_per_layer",
            "full_steps_per_layer",
            "decode_steps",
            "model",
            "config",
        ):
            assert field in row, field
        assert len(row["full_steps_per_layer"]) == 3 and 0 <= row["score"] <= 1
    full = {r["id"]: r for r in rows if r["method"] == "full"}
    refresh = [r for r in rows if r["method"] == "refreshkv"]
    assert all(r["kv_bytes_attended_mean"] < full[r["id"]]["kv_bytes_attended_mean"] for r in refresh)
    # the sweep is resumable: nothing left to do
    assert run_sweep(load_sweep(spec), model, TOKENIZER, progress=False) == {"done_before": 4, "ran": 0}

    groups, _, written = write_report([sweep.out], tmp_path / "report")
    names = {p.name for p in written}
    assert {"score_vs_decode.png", "effective_stride.png", "summary.md"} <= names
    assert "recovery.png" not in names and "ppl_ratio_by_position.png" not in names
    for path in written:
        assert path.stat().st_size > (1000 if path.suffix == ".png" else 100)
    summary = {g.label: g.summary() for g in groups}
    assert summary["full"]["speedup"] == 1.0 and summary["full"]["kv_vs_full"] == 1.0  # score 0: vs_full undefined
    assert summary["refreshkv(budget=16,qc_stride=2)"]["effective_stride"] >= 1.0
    markdown = (tmp_path / "report" / "summary.md").read_text()
    assert "| ruler/niah_single_1 | 300 | full | 2 |" in markdown and "![score_vs_decode]" in markdown

    result = CliRunner().invoke(_app(), ["report", str(sweep.out), "--out-dir", str(tmp_path / "cli"), "--no-plots"])
    assert result.exit_code == 0, result.output
    assert (
        "ruler/niah_single_1 at 300 tokens" in result.output
        and "full" in result.output
        and (tmp_path / "cli" / "summary.md").exists()
    )


def _app():
    from refreshkv.cli.app import app

    return app


def test_sweep_file_errors_are_one_line(tmp_path):
    spec = tmp_path / "bad.yaml"
    cases = {
        "lengths: [100]\ntasks: [ppl]\nmethods: [full]\nbogus: 1\n": "unknown key(s) bogus; allowed: out",
        "out: r.jsonl\nlengths: [100]\ntasks: [nope]\nmethods: [full]\n": "unknown task 'nope'",
        "out: r.jsonl\nlengths: [100]\ntasks: [ppl]\nmethods: [{name: snapkv, grid: {budget: 8}}]\n": "grid 'budget' must be a non-empty list",
        "out: r.jsonl\nlengths: [100]\ntasks: [ppl]\nmethods: [{name: snapkv, params: {budgt: 8}}]\n": "method 'snapkv' has no parameter budgt",
        "out: r.jsonl\nlengths: [0]\ntasks: [ppl]\nmethods: [full]\n": "'lengths' must be an integer >= 1",
        "out: r.jsonl\nlengths: [100]\ntasks: [ppl]\n": "missing required key 'methods'",
        "lengths: [100]\ntasks: [ppl]\nmethods: [full]\n": "no output file",
        "out: r.jsonl\nlengths: [100]\ntasks: [recovery]\nmethods: [full, streamingllm]\n": "recovery",
        "out: [\n": "not valid YAML",
    }
    for text, message in cases.items():
        spec.write_text(text)
        with pytest.raises(SweepError, match=None) as error:
            load_sweep(spec)
        assert message in str(error.value) and "\n" not in str(error.value) and str(spec) in str(error.value)
    spec.write_text("out: r.jsonl\nlengths: 100\ntasks: [ppl]\nmethods: [{name: snapkv, grid: {budget: [40, 48]}}]\n")
    assert [m for m in load_sweep(spec).methods] == [("snapkv", {"budget": 40}), ("snapkv", {"budget": 48})]


def test_sweep_model_from_the_command_line_replaces_the_files(tmp_path):
    """`sweep --model DIR` runs the same sweep on another model (before/after training): another identity."""
    spec = tmp_path / "s.yaml"
    spec.write_text("out: r.jsonl\nmodel: base\nlengths: [100]\ntasks: [ruler/niah_single_1]\nmethods: [full]\n")
    in_file, given = load_sweep(spec), load_sweep(spec, model="runs/trained")
    assert in_file.model == str(tmp_path / "base") and given.model == "runs/trained"
    assert in_file.identity() != given.identity()


# ---- resume -----------------------------------------------------------------------------------------------------


def test_resume_skips_finished_rows_and_refuses_another_configuration(tmp_path, model):
    out = tmp_path / "r.jsonl"
    counter = CountCalls(model)
    try:
        assert run_eval(model, TOKENIZER, config(), 2, out, progress=False) == {"done_before": 0, "ran": 2}
        first = counter.calls
        assert first > 2
        assert run_eval(model, TOKENIZER, config(), 2, out, progress=False) == {"done_before": 2, "ran": 0}
        assert counter.calls == first  # not a single forward
        assert run_eval(model, TOKENIZER, config(), 3, out, progress=False) == {"done_before": 2, "ran": 1}
        assert first / 2 * 0.5 < counter.calls - first < first  # one example's worth of forwards
    finally:
        counter.remove()
    rows = lines(out)
    assert [r["id"] for r in rows] == [f"{NIAH}/L300/s0/{i}" for i in range(3)]
    before = out.read_bytes()
    with pytest.raises(ResultsError, match="holds results of another configuration"):
        run_eval(model, TOKENIZER, config(method="snapkv", params={"budget": 40}), 2, out, progress=False)
    with pytest.raises(ResultsError, match="another configuration"):
        run_eval(model, TOKENIZER, config(seed=1), 2, out, progress=False)
    assert out.read_bytes() == before
    # the same through the command line: exit code 2, one line, the file untouched (refused before loading a model)
    result = CliRunner().invoke(
        _app(), ["eval", "--task", NIAH, "--method", "snapkv", "--budget", "40", "--length", "300", "--out", str(out)]
    )
    assert result.exit_code == 2 and "another configuration" in result.output
    assert out.read_bytes() == before


def test_truncated_last_line_is_dropped_and_rerun(tmp_path, model, doc):
    out = tmp_path / "r.jsonl"
    run_eval(model, TOKENIZER, quick(doc), 2, out, progress=False)
    complete = out.read_bytes()
    out.write_bytes(complete + complete.splitlines(keepends=True)[0][:57])  # a cut-short third row
    rows, end, torn = read_results(out, warn=False)
    assert len(rows) == 2 and torn and end == len(complete)
    assert len(load_results([out])) == 2  # the report ignores it too
    assert run_eval(model, TOKENIZER, quick(doc), 3, out, progress=False) == {"done_before": 2, "ran": 1}
    rows = lines(out)  # every line parses: the torn tail was cut before the new row
    assert [r["id"][-1] for r in rows] == ["0", "1", "2"]
    assert out.read_bytes().startswith(complete)


def test_malformed_row_names_file_and_line(tmp_path, model, doc):
    out = tmp_path / "r.jsonl"
    run_eval(model, TOKENIZER, quick(doc), 2, out, progress=False)
    good = out.read_text().splitlines()
    out.write_text(good[0] + "\n{not json\n" + good[1] + "\n")
    before = out.read_bytes()
    with pytest.raises(ResultsError, match=rf"^{out}:2: malformed JSONL row"):
        run_eval(model, TOKENIZER, quick(doc), 3, out, progress=False)
    assert out.read_bytes() == before
    result = CliRunner().invoke(_app(), ["report", str(out), "--no-plots"])
    assert result.exit_code == 2 and f"{out}:2: malformed JSONL row" in result.output
    out.write_text(good[0] + "\n" + json.dumps({"run": "x", "config": "y", "id": "z"}) + "\n")
    with pytest.raises(ResultsError, match=rf"{out}:2: row lacks the field\(s\) task"):
        load_results([out])


def test_length_beyond_the_context_and_unknown_task_are_refused(tmp_path, model):
    out = tmp_path / "r.jsonl"
    with pytest.raises(ValueError, match="length 2000 exceeds the model's context of 1024 tokens"):
        run_eval(model, TOKENIZER, config(length=2000), 1, out, progress=False)
    with pytest.raises(
        ValueError, match=r"unknown task 'nope'; choose from: .*ppl, multiturn/niah, multiturn/chain, recovery"
    ):
        run_eval(model, TOKENIZER, config(task="nope"), 1, out, progress=False)
    assert not out.exists()


KILL_SCRIPT = """
import sys, zlib
sys.path.insert(0, {tests!r})
from conftest import tiny_model
from refreshkv.eval.config import RunConfig
from refreshkv.eval.runner import run_eval

config = RunConfig(task="ppl", method="refreshkv", length=100, params={{"budget": 16}}, model="tiny", chat=False,
                   task_options={{"paths": [{text!r}], "target_tokens": 40}})
class Words:
    def encode(self, text, add_special_tokens=True):
        return [3 + zlib.crc32(word.encode()) % 125 for word in text.split()]

run_eval(tiny_model("llama", layers=3, seed=0), Words(), config, {n}, {out!r}, progress=False)
"""


def test_killed_run_resumes_without_losing_or_duplicating_rows(tmp_path):
    out, text = tmp_path / "killed.jsonl", text_file(tmp_path / "doc.txt")
    script = KILL_SCRIPT.format(tests=str(TESTS), text=str(text), n=6, out=str(out))
    process = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 1:
            break
        time.sleep(0.01)
    assert process.poll() is None, process.stderr.read().decode()
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    process.stderr.close()
    killed = lines(out)  # every line parses
    assert 1 <= len(killed) < 6
    # resume in this process, with the same configuration and tokenizer
    resumed = RunConfig(
        task="ppl",
        method="refreshkv",
        length=100,
        params={"budget": 16},
        model="tiny",
        chat=False,
        task_options={"paths": [str(text)], "target_tokens": 40},
    )
    counts = run_eval(tiny_model("llama", layers=3, seed=0), TOKENIZER, resumed, 6, out, progress=False)
    assert counts == {"done_before": len(killed), "ran": 6 - len(killed)}
    rows = lines(out)
    assert [r["id"] for r in rows] == [f"ppl/L100/s0/{i}" for i in range(6)]
    assert rows[: len(killed)] == killed
    assert all(len(r["losses"]) == 40 and r["score"] > 1 for r in rows)


# ---- teacher-forced perplexity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_teacher_forced_full_equals_one_plain_forward(family):
    model = tiny_model(family, layers=3, seed=1)
    ids = random_prompt(160, seed=5)[0]
    forced = teacher_forced(model, ids, 100, make_policy("full"))
    reference = plain_losses(model, ids, 100)
    assert len(forced.losses) == len(reference) == 60
    assert max(abs(a - b) for a, b in zip(forced.losses, reference)) < 1e-4
    assert forced.cache.step == 59  # the last target token is scored, never fed
    # a method with a small budget manages its own caches: different losses, less read per step
    snap = teacher_forced(model, ids, 100, make_policy("snapkv", budget=8, window=4))
    assert max(abs(a - b) for a, b in zip(snap.losses, reference)) > 1e-3
    assert snap.cache.attended_bytes_mean() < forced.cache.attended_bytes_mean()


@pytest.mark.parametrize("method", [{"name": "full"}, {"name": "snapkv", "budget": 8, "window": 4}])
def test_continuations_of_one_context_share_its_prefill_and_score_as_alone(method):
    """Each continuation's losses (and greedy flags) equal teacher forcing it alone after the same context."""
    model = tiny_model("llama", layers=2, seed=1)
    ids = random_prompt(120, seed=6)[0].tolist()
    greedy = generate(model, torch.tensor([ids[:100]]), max_new_tokens=4, eos_token_id=[]).tokens[0]
    continuations = [greedy + ids[104:110], ids[100:103], random_prompt(7, seed=7)[0].tolist()]
    policy = make_policy(method["name"], **{k: v for k, v in method.items() if k != "name"})
    shared = continuation_losses(model, ids[:100], continuations, policy)
    for (losses, greedy), continuation in zip(shared, continuations):
        alone = teacher_forced(model, ids[:100] + continuation, 100, policy).losses
        assert len(losses) == len(greedy) == len(continuation)
        assert max(abs(a - b) for a, b in zip(losses, alone)) < 1e-4
    if method["name"] == "full":  # greedy: the model's own choice after each token, from one plain forward
        with torch.no_grad():
            logits = model(torch.tensor([ids[:100] + continuations[0]])).logits[0, 99:109]
        assert shared[0][1] == (logits.argmax(-1) == torch.tensor(continuations[0])).tolist()
        assert shared[0][1][:4] == [True] * 4  # the model's own answer, then the prompt's tokens


def test_ppl_rows_and_ratio_by_position(tmp_path, model):
    text = text_file(tmp_path / "doc.txt")
    out = tmp_path / "ppl.jsonl"
    options = {"paths": [str(text)], "target_tokens": 64}
    full = config(task="ppl", length=120, task_options=options)
    snap = config(task="ppl", method="snapkv", length=120, params={"budget": 8, "window": 4}, task_options=options)
    run_eval(model, TOKENIZER, full, 2, tmp_path / "full.jsonl", progress=False)
    run_eval(model, TOKENIZER, snap, 2, out, progress=False)
    rows = lines(tmp_path / "full.jsonl")
    ids = TOKENIZER.encode(text.read_text())
    start = int(rows[0]["source_id"].rsplit("@", 1)[1])
    window = ids[start : start + 120 + 64]
    reference = plain_losses(model, window, 120)
    assert max(abs(a - b) for a, b in zip(rows[0]["losses"], reference)) < 1e-4
    assert rows[0]["score"] == pytest.approx(torch.tensor(reference).mean().exp().item(), rel=1e-4)
    groups, _, written = write_report([tmp_path / "full.jsonl", out], tmp_path / "rep")
    assert "ppl_ratio_by_position.png" in {p.name for p in written}
    snap_group = next(g for g in groups if g.method == "snapkv")
    starts, ratios = snap_group.ppl_ratio_by_position()
    assert starts == list(range(0, 64, 4)) and all(r > 0 for r in ratios)
    assert "budget_per_layer.png" in {p.name for p in written}  # snapkv keeps 8 of 120 prompt tokens


# ---- attention recovery -----------------------------------------------------------------------------------------


def test_recovery_is_one_with_a_budget_covering_the_prefix_and_topk_beats_streaming_at_offset_zero(model):
    ids = random_prompt(200, seed=7)[0]
    prefix = RecoveryProbe(top_k=181, steps=5)  # step t sees t + 1 = 181 keys: its top-K is all of them
    result = prefix.result(teacher_forced(model, ids[:190], 180, prefix).cache)
    assert len(result["topk"]) == 3 and all(len(layer) == 6 for layer in result["topk"])
    assert all(abs(v - 1.0) < 1e-5 for layer in result["topk"] for v in layer)
    # StreamingLLM's K-slot cache starts evicting after step t; with K above every step's keys it keeps all
    assert all(abs(layer[0] - 1.0) < 1e-5 and layer[-1] < 1 for layer in result["streaming"])
    everything = RecoveryProbe(top_k=200, steps=5)
    result = everything.result(teacher_forced(model, ids[:190], 180, everything).cache)
    assert all(abs(v - 1.0) < 1e-5 for kind in ("topk", "streaming") for layer in result[kind] for v in layer)
    small = RecoveryProbe(top_k=16, steps=5)
    result = small.result(teacher_forced(model, ids[:190], 180, small).cache)
    for topk, streaming in zip(result["topk"], result["streaming"]):
        assert streaming[0] <= topk[0] + 1e-6
        assert all(0 < v < 1 for v in topk + streaming)


def test_recovery_task_rows_and_plot(tmp_path, model):
    text = text_file(tmp_path / "doc.txt")
    out = tmp_path / "rec.jsonl"
    rec = config(task="recovery", length=150, task_options={"paths": [str(text)], "budget": 16, "steps": 4})
    run_eval(model, TOKENIZER, rec, 2, out, progress=False)
    rows = lines(out)
    assert all(r["recovery"]["k"] == 16 and len(r["recovery"]["topk"][0]) == 5 for r in rows)
    assert all(0 < r["score"] <= 1 for r in rows)
    with pytest.raises(ValueError, match="measures attention under 'full'"):
        run_eval(model, TOKENIZER, config(task="recovery", method="snapkv"), 1, tmp_path / "x.jsonl", progress=False)
    _, _, written = write_report([out], tmp_path / "rep")
    assert "recovery.png" in {p.name for p in written}
    assert "Attention recovery" in (tmp_path / "rep" / "summary.md").read_text()


# ---- the embedded model -----------------------------------------------------------------------------------------


@pytest.mark.embedded
def test_embedded_full_retrieves_the_needle_at_2k(tmp_path):
    from refreshkv.runtime.loading import load_model

    model, tokenizer = load_model()
    out = tmp_path / "niah.jsonl"
    run = RunConfig(task=NIAH, method="full", length=2048, seed=0)
    run_eval(model, tokenizer, run, 1, out, progress=False)
    (row,) = lines(out)
    assert row["prompt_tokens"] > 1800  # RULER counts the chat template, answer prefix and 128 new tokens in L
    assert row["score"] == 1.0, (row["prediction"], row["reference"])


def test_recovery_on_gemma3_is_measured_in_its_global_layers_and_the_report_says_which(tmp_path):
    """Gemma 3's sliding-window layers attend only to their window: recovery is the global layer's (layer 5 of 6)."""
    model = tiny_model("gemma3")
    ids = random_prompt(200, seed=7)[0]
    probe = RecoveryProbe(top_k=16, steps=4)
    result = probe.result(teacher_forced(model, ids[:190], 180, probe).cache)
    assert result["layers"] == [5] and len(result["topk"]) == 1 and len(result["topk"][0]) == 5
    assert all(0 < v < 1 for v in result["topk"][0] + result["streaming"][0])
    text = text_file(tmp_path / "doc.txt")
    rec = config(task="recovery", length=150, task_options={"paths": [str(text)], "budget": 16, "steps": 4})
    run_eval(model, TOKENIZER, rec, 1, tmp_path / "rec.jsonl", progress=False)
    write_report([tmp_path / "rec.jsonl"], tmp_path / "rep")
    summary = (tmp_path / "rep" / "summary.md").read_text()
    assert "Attention recovery, mean over layers 5 (the others are windowed): t=150, K=16" in summary


def test_recovery_on_a_model_whose_every_layer_is_windowed_is_refused_in_one_line():
    model = tiny_model("mistral", sliding_window=16)
    probe = RecoveryProbe(top_k=8, steps=2)
    cache = teacher_forced(model, random_prompt(100, seed=2)[0][:90], 80, probe).cache
    with pytest.raises(ValueError, match="^recovery needs a layer that attends to the whole context; every layer"):
        probe.result(cache)
