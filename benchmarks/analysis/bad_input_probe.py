"""Bad input at every door: each case's expected outcome beside what it did, one JSONL row per case.

    OMP_NUM_THREADS=1 python benchmarks/analysis/bad_input_probe.py            # from the repository root

Groups (`group` column): `cli` (the `refreshkv` command line, each case a subprocess), `python` (the public API in
this process, on the embedded SmolLM2-135M, loaded once), `lm_eval` (`python -m refreshkv.lm_eval`, a subprocess),
`vllm_server` (requests to vLLM's OpenAI server with the plugin on, one server started for the group) and
`vllm_offline` (`vllm.LLM` in this process); the last two in the vLLM virtualenv. A group is a list of `Case`s in
`CASES` and a runner in `RUNNERS` that returns an `Observed`.

Expected: `refuse` (a one-line refusal naming the argument: the command's last stderr line holds `said`, exit code
`code`, no traceback; in Python a ValueError or TypeError whose one-line message holds `said`), or `result` (exit
code 0, no traceback, and where `said` is given a warning line holding it). A row is `clean` when the observed
outcome is the expected one.

`PROBE_SRC=FOLDER` probes the package in FOLDER (another checkout's src/, its commit in `PROBE_COMMIT`; run the
script with PYTHONPATH=FOLDER so that the python group imports it too; with `--out
docs/results/bad-input-probe/before.jsonl` its rows are what the README compares with); `PROBE_TIMEOUT_S` bounds
each command (600 s).

Output: docs/results/bad-input-probe/rows.jsonl (resumes: a case whose id is there already is skipped; `--again`
runs the unclean ones again and replaces their rows) and that folder's README.md (command, machine, commit, counts,
the unclean cases), rewritten at the end of every run from the rows.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "results" / "bad-input-probe" / "rows.jsonl"
BEFORE = "before.jsonl"  # the same cases on an earlier checkout (PROBE_SRC), beside OUT: the README compares
GROUPS = ("cli", "python", "lm_eval", "vllm_server", "vllm_offline")
TIMEOUT_S = int(os.environ.get("PROBE_TIMEOUT_S", "600"))  # a case that hangs (e.g. a FIFO opened for writing)
SRC = Path(os.environ.get("PROBE_SRC", ROOT / "src"))  # the package probed (another checkout's, to compare)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    group: str
    given: str  # what the case gives, as a person would type it (for the row)
    expected: str  # "refuse" or "result"
    said: str = ""  # a fragment the refusal's line (or the result's warning line) must hold
    code: int = 2  # the exit code a refusal ends with (command lines)
    args: tuple = ()  # cli, lm_eval: the arguments after the program
    call: Callable[[dict], object] | None = None  # python: called with the shared objects (`python_objects`)


@dataclasses.dataclass
class Observed:
    code: int | str | None  # exit code (command lines) or exception class (python; None: returned)
    last_line: str  # the last stderr line, or the exception's message (first line), or the last warning
    lines: int  # lines of the refusal (stderr lines starting "error:", or of the exception's message)
    traceback: bool
    warning: str = ""
    seconds: float = 0.0


# ---- the cases ---------------------------------------------------------------------------------------------------

SCRATCH = Path(tempfile.mkdtemp(prefix="bad-input-probe-"))
FIFO = SCRATCH / "pipe"
FOLDER = SCRATCH / "folder"
A_FILE = SCRATCH / "a-file"
DOC = SCRATCH / "doc.txt"
WORDS = " ".join(f"word{i % 97}" for i in range(120))


def make_scratch() -> None:
    if not FIFO.exists():
        os.mkfifo(FIFO)
    FOLDER.mkdir(exist_ok=True)
    A_FILE.write_text("x")
    DOC.write_text(WORDS)


def cli(id: str, given: str, expected: str, said: str, *args, code: int = 2) -> Case:
    return Case(id, "cli", given, expected, said, code if expected == "refuse" else 0, tuple(map(str, args)))


CONTEXT = "budget (100000) is above the model's context of 8192 tokens"
CLI_CASES = [
    cli(
        "cli-unknown-method",
        "generate --method nosuch",
        "refuse",
        "unknown method 'nosuch'",
        "generate",
        "--method",
        "nosuch",
        "--prompt",
        "hi",
    ),
    cli(
        "cli-budget-above-context",
        "generate --method snapkv --budget 100000",
        "refuse",
        CONTEXT,
        "generate",
        "--method",
        "snapkv",
        "--budget",
        "100000",
        "--prompt",
        "hi",
    ),
    cli(
        "cli-demo-budget-above-context",
        "demo --length 4096 --budget 100000",
        "refuse",
        CONTEXT,
        "demo",
        "--length",
        "4096",
        "--budget",
        "100000",
    ),
    cli(
        "cli-bench-budget-above-context",
        "bench --methods full,snapkv --budget 100000",
        "refuse",
        CONTEXT,
        "bench",
        "--methods",
        "full,snapkv",
        "--budget",
        "100000",
    ),
    cli(
        "cli-budget-zero",
        "generate --method snapkv --budget 0",
        "refuse",
        "budget must be an integer >= 1",
        "generate",
        "--method",
        "snapkv",
        "--budget",
        "0",
        "--prompt",
        "hi",
    ),
    cli(
        "cli-ratio-above-one",
        "generate --method snapkv --budget-ratio 1.5",
        "refuse",
        "budget_ratio must be a number in (0, 1]",
        "generate",
        "--method",
        "snapkv",
        "--budget-ratio",
        "1.5",
        "--prompt",
        "hi",
    ),
    cli(
        "cli-threshold-nan",
        "generate --method refreshkv --threshold nan",
        "refuse",
        "threshold",
        "generate",
        "--method",
        "refreshkv",
        "--threshold",
        "nan",
        "--prompt",
        "hi",
    ),
    cli(
        "cli-even-kernel",
        "generate --method snapkv --kernel 4",
        "refuse",
        "kernel must be an odd integer >= 1",
        "generate",
        "--method",
        "snapkv",
        "--kernel",
        "4",
        "--prompt",
        "hi",
    ),
    cli(
        "cli-unknown-pooling",
        "generate --method snapkv --param pooling=diagonal",
        "refuse",
        "unknown pooling 'diagonal'",
        "generate",
        "--method",
        "snapkv",
        "--param",
        "pooling=diagonal",
        "--prompt",
        "hi",
    ),
    cli(
        "cli-param-not-a-pair",
        "generate --param budget",
        "refuse",
        "--param expects NAME=VALUE",
        "generate",
        "--method",
        "snapkv",
        "--param",
        "budget",
        "--prompt",
        "hi",
    ),
    cli(
        "cli-zero-new-tokens",
        "generate --max-new-tokens 0",
        "refuse",
        "--max-new-tokens",
        "generate",
        "--max-new-tokens",
        "0",
        "--prompt",
        "hi",
    ),
    cli(
        "cli-missing-prompt-file",
        "generate --prompt-file /nonexistent",
        "refuse",
        "does not exist",
        "generate",
        "--prompt-file",
        "/nonexistent/prompt.txt",
    ),
    cli("cli-empty-prompt", "generate --prompt ''", "refuse", "the prompt is empty", "generate", "--prompt", " "),
    cli(
        "cli-prompt-and-file",
        "generate --prompt hi --prompt-file doc",
        "refuse",
        "give exactly one of",
        "generate",
        "--prompt",
        "hi",
        "--prompt-file",
        DOC,
    ),
    cli(
        "cli-unknown-dtype",
        "generate --dtype float64",
        "refuse",
        "unknown dtype 'float64'",
        "generate",
        "--dtype",
        "float64",
        "--prompt",
        "hi",
    ),
    cli(
        "cli-unknown-device",
        "generate --device tpu",
        "refuse",
        "unknown device 'tpu'",
        "generate",
        "--device",
        "tpu",
        "--prompt",
        "hi",
    ),
    cli(
        "cli-top-p-without-sample",
        "generate --top-p 0.5",
        "refuse",
        "apply only when sampling",
        "generate",
        "--top-p",
        "0.5",
        "--prompt",
        "hi",
    ),
    cli(
        "cli-missing-model-folder",
        "generate --model /nonexistent/model",
        "refuse",
        "does not exist",
        "generate",
        "--model",
        "/nonexistent/model",
        "--prompt",
        "hi",
    ),
    cli(
        "cli-unknown-model-name",
        "generate --model nosuch-model",
        "refuse",
        "unknown model 'nosuch-model'",
        "generate",
        "--model",
        "nosuch-model",
        "--prompt",
        "hi",
    ),
    cli(
        "cli-bench-json-fifo",
        "bench --json FIFO --force",
        "refuse",
        "is a FIFO (named pipe), not a regular file",
        "bench",
        "--json",
        FIFO,
        "--force",
        "--lengths",
        "40",
    ),
    cli(
        "cli-bench-json-folder",
        "bench --json FOLDER --force",
        "refuse",
        "is a folder; give a file path",
        "bench",
        "--json",
        FOLDER,
        "--force",
        "--lengths",
        "40",
    ),
    cli(
        "cli-trace-out-fifo",
        "trace --out FIFO",
        "refuse",
        "is a FIFO (named pipe), not a regular file",
        "trace",
        "--out",
        FIFO,
        "--prompt",
        "hi",
    ),
    cli(
        "cli-eval-out-fifo",
        "eval --out FIFO",
        "refuse",
        "is a FIFO (named pipe), not a regular file",
        "eval",
        "--task",
        "ruler/niah_single_1",
        "--length",
        "400",
        "--out",
        FIFO,
    ),
    cli(
        "cli-bench-unknown-method",
        "bench --methods full,nope",
        "refuse",
        "unknown method 'nope'",
        "bench",
        "--methods",
        "full,nope",
    ),
    cli(
        "cli-bench-threads", "bench --threads 100000", "refuse", "threads must be 1 to", "bench", "--threads", "100000"
    ),
    cli(
        "cli-models-unknown-folder",
        "models --folder nosuch",
        "refuse",
        "unknown model 'nosuch'",
        "models",
        "--folder",
        "nosuch",
    ),
    cli(
        "cli-eval-unknown-task",
        "eval --task nosuch",
        "refuse",
        "unknown task",
        "eval",
        "--task",
        "nosuch",
        "--out",
        SCRATCH / "r.jsonl",
    ),
    cli(
        "cli-eval-budget-holds-length",
        "eval --method snapkv --budget 500 --length 400",
        "refuse",
        "budget 500 is not below the length 400",
        "eval",
        "--task",
        "ruler/niah_single_1",
        "--method",
        "snapkv",
        "--budget",
        "500",
        "--length",
        "400",
        "--out",
        SCRATCH / "r.jsonl",
    ),
    cli(
        "cli-eval-task-option-type",
        "eval --task ppl --task-option target_tokens=abc",
        "refuse",
        "target_tokens",
        "eval",
        "--task",
        "ppl",
        "--task-option",
        f"paths={DOC}",
        "--task-option",
        "target_tokens=abc",
        "--length",
        "40",
        "--out",
        SCRATCH / "r.jsonl",
    ),
    cli(
        "cli-eval-examples-beyond-distinct",
        "eval --task ppl --num-examples 1000 (a 120-word file)",
        "refuse",
        "num_examples (--num-examples) 1000 is more than the",
        "eval",
        "--task",
        "ppl",
        "--task-option",
        f"paths={DOC}",
        "--task-option",
        "target_tokens=4",
        "--length",
        "40",
        "--num-examples",
        "1000",
        "--no-chat",
        "--out",
        SCRATCH / "ppl.jsonl",
    ),
    cli("cli-report-missing", "report /nonexistent.jsonl", "refuse", "nonexistent", "report", "/nonexistent/r.jsonl"),
    cli("cli-sweep-missing", "sweep /nonexistent.yaml", "refuse", "nonexistent", "sweep", "/nonexistent/s.yaml"),
    cli(
        "cli-chat-method-twice",
        "chat --method snapkv --method snapkv",
        "refuse",
        "given 2 times",
        "chat",
        "--prompt-file",
        DOC,
        "--method",
        "snapkv",
        "--method",
        "snapkv",
    ),
    cli(
        "cli-clamped-sinks",
        "generate --method streamingllm --budget 2",
        "result",
        "warning: method 'streamingllm': sinks 4 does not fit in the budget of 2 tokens",
        "generate",
        "--method",
        "streamingllm",
        "--budget",
        "2",
        "--prompt",
        WORDS,
        "--max-new-tokens",
        "2",
    ),
    cli(
        "cli-clamped-kernel",
        "generate --method snapkv --kernel 1000000001 --window 4 --budget 8",
        "result",
        "warning: method 'snapkv': kernel 1000000001 is wider than the prompt",
        "generate",
        "--method",
        "snapkv",
        "--kernel",
        "1000000001",
        "--window",
        "4",
        "--budget",
        "8",
        "--prompt",
        WORDS,
        "--max-new-tokens",
        "2",
    ),
    cli(
        "cli-plain-generate",
        "generate --method full --prompt WORDS (control)",
        "result",
        "",
        "generate",
        "--method",
        "full",
        "--prompt",
        WORDS,
        "--max-new-tokens",
        "2",
    ),
]


def python_case(id: str, given: str, expected: str, said: str, call: Callable[[dict], object]) -> Case:
    return Case(id, "python", given, expected, said, call=call)


def api(name: str):
    import refreshkv

    return getattr(refreshkv, name)


PYTHON_CASES = [
    python_case(
        "py-make-policy-list",
        "make_policy(['refreshkv'])",
        "refuse",
        "method must be a method name",
        lambda o: api("make_policy")(["refreshkv"]),
    ),
    python_case(
        "py-make-policy-dict",
        "make_policy({'a': 1})",
        "refuse",
        "method must be a method name",
        lambda o: api("make_policy")({"a": 1}),
    ),
    python_case(
        "py-preset-list",
        "make_policy('refreshkv', preset=['paper'])",
        "refuse",
        "has no preset",
        lambda o: api("make_policy")("refreshkv", preset=["paper"]),
    ),
    python_case(
        "py-budget-text",
        "make_policy('snapkv', budget='8')",
        "refuse",
        "budget must be an integer >= 1",
        lambda o: api("make_policy")("snapkv", budget="8"),
    ),
    python_case(
        "py-budget-bool",
        "make_policy('snapkv', budget=True)",
        "refuse",
        "budget must be an integer",
        lambda o: api("make_policy")("snapkv", budget=True),
    ),
    python_case(
        "py-threshold-nan",
        "make_policy('refreshkv', threshold=nan)",
        "refuse",
        "threshold",
        lambda o: api("make_policy")("refreshkv", threshold=float("nan")),
    ),
    python_case(
        "py-pooling-list",
        "make_policy('snapkv', pooling=['span'])",
        "refuse",
        "unknown pooling",
        lambda o: api("make_policy")("snapkv", pooling=["span"]),
    ),
    python_case(
        "py-method-list",
        "generate(model, ids, method=['full'])",
        "refuse",
        "method must be a method name",
        lambda o: api("generate")(o["model"], o["ids"], method=["full"]),
    ),
    python_case(
        "py-methods-dict",
        "generate_many(model, ids, methods=['full', {'x': 1}])",
        "refuse",
        "methods[1] must be a method name",
        lambda o: api("generate_many")(o["model"], o["ids"], methods=["full", {"x": 1}]),
    ),
    python_case(
        "py-methods-string",
        "generate_many(model, ids, methods='snapkv')",
        "refuse",
        "methods must be a list of methods",
        lambda o: api("generate_many")(o["model"], o["ids"], methods="snapkv"),
    ),
    python_case(
        "py-model-none",
        "generate(None, ids)",
        "refuse",
        "model must be a transformers causal language",
        lambda o: api("generate")(None, o["ids"], method="full"),
    ),
    python_case(
        "py-load-model-int", "load_model(123)", "refuse", "path must be a named model", lambda o: api("load_model")(123)
    ),
    python_case(
        "py-load-model-dtype",
        "load_model(dtype='int8')",
        "refuse",
        "dtype must be a floating torch",
        lambda o: api("load_model")(dtype="int8"),
    ),
    python_case(
        "py-load-model-device",
        "load_model(device='gpu')",
        "refuse",
        "device must be a torch device",
        lambda o: api("load_model")(device="gpu"),
    ),
    python_case(
        "py-settings-dict",
        "generate(model, ids, settings={'max_new_tokens': 2})",
        "refuse",
        "settings must be a GenerationSettings",
        lambda o: api("generate")(o["model"], o["ids"], settings={"max_new_tokens": 2}),
    ),
    python_case(
        "py-unknown-setting",
        "generate_many(model, ids, methods=['full'], max_tokens=2)",
        "refuse",
        "unknown setting max_tokens",
        lambda o: api("generate_many")(o["model"], o["ids"], methods=["full"], max_tokens=2),
    ),
    python_case(
        "py-ids-list",
        "generate(model, ids.tolist())",
        "refuse",
        "must be a torch tensor",
        lambda o: api("generate")(o["model"], o["ids"].tolist()),
    ),
    python_case(
        "py-ids-float",
        "generate(model, ids.float())",
        "refuse",
        "input_ids must hold integer token ids",
        lambda o: api("generate")(o["model"], o["ids"].float()),
    ),
    python_case(
        "py-new-tokens-negative",
        "generate(model, ids, max_new_tokens=-1)",
        "refuse",
        "max_new_tokens must be an integer >= 1",
        lambda o: api("generate")(o["model"], o["ids"], max_new_tokens=-1),
    ),
    python_case(
        "py-budget-above-context",
        "generate(model, ids, method='snapkv', budget=100000)",
        "refuse",
        CONTEXT,
        lambda o: api("generate")(o["model"], o["ids"], method="snapkv", budget=100000),
    ),
    python_case(
        "py-budget-at-context",
        "generate(model, ids, method='snapkv', budget=8192)",
        "result",
        "",
        lambda o: api("generate")(o["model"], o["ids"], method="snapkv", budget=8192, max_new_tokens=2),
    ),
    python_case(
        "py-cache-name",
        "PolicyCache('refreshkv', model)",
        "refuse",
        "PolicyCache takes a method object",
        lambda o: api("PolicyCache")("refreshkv", o["model"]),
    ),
    python_case(
        "py-cache-none",
        "PolicyCache(make_policy('full'), None)",
        "refuse",
        "PolicyCache needs the model",
        lambda o: api("PolicyCache")(api("make_policy")("full"), None),
    ),
    python_case(
        "py-mask-zeros",
        "generate(model, ids, attention_mask=zeros)",
        "refuse",
        "needs a real token",
        lambda o: api("generate")(o["model"], o["ids"], attention_mask=0 * o["ids"]),
    ),
    python_case(
        "py-temperature-zero",
        "generate(model, ids, do_sample=True, temperature=0)",
        "refuse",
        "temperature must be a finite number > 0",
        lambda o: api("generate")(o["model"], o["ids"], do_sample=True, temperature=0),
    ),
    python_case(
        "py-eos-text",
        "generate(model, ids, eos_token_id='2')",
        "refuse",
        "eos_token_id must be a token id",
        lambda o: api("generate")(o["model"], o["ids"], eos_token_id="2"),
    ),
    python_case(
        "py-with-cache-none",
        "with_cache(None, cache)",
        "refuse",
        "model must be a transformers model",
        lambda o: api("with_cache")(None, None),
    ),
    python_case(
        "py-fastest-layout-none",
        "fastest_layout(None)",
        "refuse",
        "model must be a transformers",
        lambda o: api("fastest_layout")(None),
    ),
    python_case(
        "py-clamped-kernel",
        "generate(..., method='snapkv', kernel=1000000001, window=4, budget=8)",
        "result",
        "kernel 1000000001 is wider than the prompt",
        lambda o: api("generate")(
            o["model"], o["ids"], method="snapkv", kernel=1_000_000_001, window=4, budget=8, max_new_tokens=2
        ),
    ),
    python_case(
        "py-clamped-top-k",
        "generate(..., do_sample=True, top_k=10**6)",
        "result",
        "top_k 1000000 is above the vocabulary",
        lambda o: api("generate")(o["model"], o["ids"], do_sample=True, top_k=10**6, max_new_tokens=2),
    ),
]


def lm_eval(id: str, given: str, said: str, *args, code: int = 2) -> Case:
    return Case(id, "lm_eval", given, "refuse", said, code, tuple(map(str, args)))


def tasks_dir() -> str:
    return str(ROOT / "src" / "refreshkv" / "lm_eval" / "tasks")


NUMBERS = ("--tasks", "refreshkv_numbers", "--include_path", tasks_dir(), "--limit", "1")
LM_EVAL_CASES = [
    lm_eval(
        "lm-unknown-method",
        "--model_args method=nosuch",
        "unknown method 'nosuch'",
        "--model_args",
        "method=nosuch",
        *NUMBERS,
    ),
    lm_eval(
        "lm-budget-above-context",
        "--model_args method=snapkv,budget=100000",
        CONTEXT,
        "--model_args",
        "method=snapkv,budget=100000",
        *NUMBERS,
    ),
    lm_eval(
        "lm-unknown-arg",
        "--model_args method=snapkv,budgte=8",
        "unknown model_args budgte",
        "--model_args",
        "method=snapkv,budgte=8",
        *NUMBERS,
    ),
    lm_eval(
        "lm-dtype", "--model_args dtype=float64", "dtype must be one of", "--model_args", "dtype=float64", *NUMBERS
    ),
    lm_eval(
        "lm-unknown-model",
        "--model_args model=nosuch-model",
        "unknown model 'nosuch-model'",
        "--model_args",
        "model=nosuch-model",
        *NUMBERS,
    ),
    lm_eval(
        "lm-even-kernel",
        "--model_args method=snapkv,kernel=4",
        "kernel must be an odd integer",
        "--model_args",
        "method=snapkv,kernel=4",
        *NUMBERS,
    ),
    lm_eval(
        "lm-threads-zero",
        "--model_args threads=0",
        "threads must be an integer >= 1",
        "--model_args",
        "threads=0",
        *NUMBERS,
    ),
    lm_eval(
        "lm-unknown-task",
        "--tasks nosuch_task",
        "unknown task nosuch_task",
        "--tasks",
        "nosuch_task",
        "--include_path",
        tasks_dir(),
    ),
    lm_eval(
        "lm-missing-include-path",
        "--include_path /nonexistent",
        "--include_path /nonexistent/tasks does not",
        "--tasks",
        "refreshkv_numbers",
        "--include_path",
        "/nonexistent/tasks",
    ),
    lm_eval(
        "lm-output-path-under-a-file",
        "--output_path A_FILE/out",
        "cannot be written",
        *NUMBERS,
        "--output_path",
        A_FILE / "out",
    ),
]


def vllm_request(id: str, settings: object, expected: str, said: str = "", raw: bool = False) -> Case:
    """A request to vLLM's OpenAI server whose `vllm_xargs` carry the plugin's settings as JSON text (`raw`: the
    value itself, as a client might send it): a refusal is HTTP 400 whose one-line message holds `said`."""
    given = json.dumps(settings) if raw else f"json.dumps({json.dumps(settings)})"
    return Case(id, "vllm_server", f"vllm_xargs refreshkv={given}", expected, said, 400, (settings, raw))


VLLM_SERVER_CASES = [
    vllm_request("srv-served-recycled", {"method": "recycled", "budget": 64}, "result"),
    vllm_request("srv-served-refreshkv-ratio", {"method": "refreshkv", "budget_ratio": 0.25}, "result"),
    vllm_request("srv-full", {"method": "full"}, "result"),
    vllm_request("srv-budget-above-context", {"method": "refreshkv", "budget": 10**9}, "result"),
    vllm_request("srv-method-list", {"method": ["refreshkv"]}, "refuse", "refreshkv: method must be a method's name"),
    vllm_request("srv-method-object", {"method": {"a": 1}}, "refuse", "refreshkv: method must be a method's name"),
    vllm_request("srv-method-number", {"method": 3}, "refuse", "refreshkv: method must be a method's name"),
    vllm_request("srv-method-null", {"method": None}, "refuse", "refreshkv: method must be a method's name"),
    vllm_request("srv-method-unknown", {"method": "nope"}, "refuse", "method 'nope' is unknown"),
    vllm_request("srv-quest-page-size", {"method": "quest", "page_size": 0}, "refuse", "page_size must be"),
    vllm_request("srv-method-snapkv", {"method": "snapkv"}, "refuse", "vLLM's KV manager frees no blocks"),
    vllm_request("srv-preset-list", {"preset": ["paper"]}, "refuse", "refreshkv:"),
    vllm_request("srv-preset-unknown", {"preset": "nope"}, "refuse", "has no preset 'nope'"),
    vllm_request("srv-budget-string", {"budget": "12"}, "refuse", "budget must be an integer >= 1, got '12'"),
    vllm_request("srv-budget-bool", {"budget": True}, "refuse", "budget must be an integer >= 1, got True"),
    vllm_request("srv-budget-zero", {"budget": 0}, "refuse", "budget must be an integer >= 1, got 0"),
    vllm_request("srv-budget-float", {"budget": 12.5}, "refuse", "budget must be an integer >= 1, got 12.5"),
    vllm_request("srv-budget-nan", {"budget": float("nan")}, "refuse", "budget must be a finite number"),
    vllm_request("srv-ratio-above-one", {"budget_ratio": 2}, "refuse", "budget_ratio must be a number in (0, 1]"),
    vllm_request("srv-ratio-inf", {"budget_ratio": float("inf")}, "refuse", "budget_ratio must be a finite number"),
    vllm_request("srv-stride-zero", {"method": "recycled", "stride": 0}, "refuse", "stride must be an integer >= 1"),
    vllm_request("srv-kernel-huge", {"kernel": 10**9 + 1}, "result"),
    vllm_request("srv-kernel-even", {"kernel": 4}, "refuse", "kernel must be an odd integer >= 1"),
    vllm_request("srv-threshold-string", {"threshold": "0.9"}, "refuse", "threshold must be a cosine similarity"),
    vllm_request("srv-unknown-key", {"windoww": 3}, "refuse", "has no parameter windoww"),
    vllm_request("srv-full-cache-int8", {"full_cache": "int8"}, "refuse", "full_cache must be 'dense'"),
    vllm_request("srv-settings-list", ["refreshkv"], "refuse", "settings must be an object"),
    vllm_request("srv-settings-number", 3, "refuse", "settings must be an object"),
    Case(
        "srv-settings-not-json",
        "vllm_server",
        "vllm_xargs refreshkv='{not json'",
        "refuse",
        "are not JSON",
        400,
        ("{not json", True),
    ),
    vllm_request("srv-settings-object", {"method": "recycled"}, "refuse", "vllm_xargs", raw=True),
]


def vllm_offline(id: str, settings: object, expected: str, said: str = "") -> Case:
    """vllm.LLM(...).generate with the plugin's settings in the sampling parameters' `extra_args`."""
    return Case(id, "vllm_offline", f"extra_args={{'refreshkv': {settings!r}}}", expected, said, args=(settings,))


VLLM_OFFLINE_CASES = [
    vllm_offline("llm-served-recycled", {"method": "recycled", "budget": 64}, "result"),
    vllm_offline("llm-method-list", {"method": ["refreshkv"]}, "refuse", "refreshkv: method must be a method's name"),
    vllm_offline("llm-quest-page-size", {"method": "quest", "page_size": 0}, "refuse", "page_size must be"),
    vllm_offline("llm-budget-string", {"budget": "12"}, "refuse", "budget must be an integer >= 1, got '12'"),
    vllm_offline("llm-settings-json-text", '{"method": "recycled", "stride": 5}', "result"),
    vllm_offline("llm-settings-bad-json", "{not json", "refuse", "are not JSON"),
]

CASES: dict[str, list[Case]] = {
    "cli": CLI_CASES,
    "python": PYTHON_CASES,
    "lm_eval": LM_EVAL_CASES,
    "vllm_server": VLLM_SERVER_CASES,
    "vllm_offline": VLLM_OFFLINE_CASES,
}


# ---- running them ------------------------------------------------------------------------------------------------


def environment() -> dict:
    return {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}


def plain(text: str) -> str:
    """`text` without this machine's paths (the scratch folder, the repository, the home folder)."""
    return text.replace(str(SCRATCH), "$SCRATCH").replace(str(ROOT), ".").replace(str(Path.home()), "~")


def raised(error: Exception, started: float, traceback: bool) -> Observed:
    """What an exception raised in this process showed: its class, its message's first line and line count,
    whether it counts as a traceback, and the seconds since `started`."""
    message = plain(str(error))
    return Observed(
        type(error).__name__,
        message.splitlines()[0] if message else "",
        len(message.splitlines()),
        traceback,
        seconds=round(time.perf_counter() - started, 1),
    )


def run_command(command: list[str]) -> Observed:
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, env=environment(), timeout=TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return Observed("timeout", f"no answer in {TIMEOUT_S} s", 0, False, seconds=TIMEOUT_S)
    lines = [plain(line.strip()) for line in done.stderr.replace("\r", "\n").splitlines() if line.strip()]
    return Observed(
        done.returncode,
        lines[-1] if lines else "",
        sum(1 for line in lines if line.startswith(("error:", "refreshkv.lm_eval: error:"))),
        "Traceback (most recent call last)" in done.stderr,
        next((line for line in lines if line.startswith("warning:")), ""),
        round(time.perf_counter() - started, 1),
    )


def run_cli(case: Case, objects: dict) -> Observed:
    return run_command([sys.executable, "-m", "refreshkv", *case.args])


def run_lm_eval(case: Case, objects: dict) -> Observed:
    return run_command([sys.executable, "-m", "refreshkv.lm_eval", "--model", "refreshkv", *case.args])


def python_objects() -> dict:
    """The embedded model and a 60-token prompt, shared by the python cases."""
    from refreshkv import load_model

    model, tokenizer = load_model()
    ids = tokenizer(WORDS[:400], return_tensors="pt")["input_ids"][:, :60]
    return {"model": model, "tokenizer": tokenizer, "ids": ids}


def run_python(case: Case, objects: dict) -> Observed:
    assert case.call is not None
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            case.call(objects)
        except Exception as error:  # noqa: BLE001 (what it raised is the observation)
            # anything but a ValueError or TypeError reaches the user as a traceback
            return raised(error, started, not isinstance(error, (ValueError, TypeError)))
    shown = [plain(str(w.message)) for w in said]
    return Observed(
        None, shown[-1] if shown else "", 0, False, shown[-1] if shown else "", round(time.perf_counter() - started, 1)
    )


def vllm_server(objects: dict) -> object:
    """One OpenAI server with the plugin on (its engine's method refreshkv), started for the group (in the vLLM
    virtualenv), and an `openai` client for it; stopped at exit."""
    if "client" not in objects:
        import atexit
        import socket

        from openai import OpenAI

        from refreshkv.runtime.loading import resolve_model_dir

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        folder = str(resolve_model_dir("smollm2-135m"))
        config = json.dumps({"refreshkv": {"method": "refreshkv", "budget_ratio": 0.125}})
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--port", str(port)]
        command += ["--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "4096", "--max-num-seqs", "8"]
        command += ["--additional-config", config]
        log = open(SCRATCH / "server.log", "w")  # noqa: SIM115 (open while the server runs)
        env = {**environment(), "VLLM_CPU_KVCACHE_SPACE": "1"}
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        atexit.register(server.terminate)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=600, max_retries=0)
        for _ in range(300):
            try:
                client.models.list()
                break
            except Exception:  # noqa: BLE001 (not up yet)
                if server.poll() is not None:
                    raise RuntimeError((SCRATCH / "server.log").read_text()[-2000:]) from None
                time.sleep(2)
        objects.update(client=client, folder=folder)
    return objects["client"]


def run_vllm_server(case: Case, objects: dict) -> Observed:
    client = vllm_server(objects)
    settings, raw = case.args
    text = settings if raw and isinstance(settings, str) else settings if raw else json.dumps(settings)
    started = time.perf_counter()
    try:
        client.completions.create(  # type: ignore[attr-defined]
            model=objects["folder"],
            prompt=WORDS,
            max_tokens=4,
            temperature=0,
            extra_body={"vllm_xargs": {"refreshkv": text}},
        )
    except Exception as error:  # noqa: BLE001 (what it answered is the observation)
        status = getattr(error, "status_code", type(error).__name__)
        body = getattr(error, "body", None)
        message = (body or {}).get("message", str(error)) if isinstance(body, dict) else str(error)
        lines = [line for line in str(message).splitlines() if line.strip()]
        return Observed(
            status,
            plain(lines[0]) if lines else "",
            len(lines),
            status == 500,
            seconds=round(time.perf_counter() - started, 1),
        )
    return Observed(200, "", 0, False, seconds=round(time.perf_counter() - started, 1))


def run_vllm_offline(case: Case, objects: dict) -> Observed:
    if "llm" not in objects:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM

        from refreshkv.runtime.loading import resolve_model_dir

        objects["llm"] = LLM(
            str(resolve_model_dir("smollm2-135m")),
            dtype="float32",
            enforce_eager=True,
            max_model_len=2048,
            max_num_seqs=4,
            additional_config={"refreshkv": {"method": "refreshkv", "budget_ratio": 0.125}},
        )
    from vllm import SamplingParams

    started = time.perf_counter()
    try:
        params = SamplingParams(max_tokens=4, temperature=0, extra_args={"refreshkv": case.args[0]})
        objects["llm"].generate([WORDS], params, use_tqdm=False)
    except Exception as error:  # noqa: BLE001 (what it raised is the observation)
        # vLLM's own error for a request it refuses is its message alone; anything else a traceback
        refused = isinstance(error, ValueError) or type(error).__name__ == "VLLMValidationError"
        return raised(error, started, not refused)
    return Observed(None, "", 0, False, seconds=round(time.perf_counter() - started, 1))


RUNNERS: dict[str, Callable[[Case, dict], Observed]] = {
    "cli": run_cli,
    "python": run_python,
    "lm_eval": run_lm_eval,
    "vllm_server": run_vllm_server,
    "vllm_offline": run_vllm_offline,
}


def is_clean(case: Case, seen: Observed) -> bool:
    if seen.traceback:
        return False
    if case.expected == "result":
        ended = seen.code in (0, None, 200)
        return ended and (not case.said or case.said in seen.warning)
    if case.group in ("python", "vllm_offline"):
        return (
            seen.code in ("ValueError", "TypeError", "PolicyError", "ModelError", "VLLMValidationError")
            and seen.lines == 1
            and (case.said in seen.last_line)
        )
    return seen.code == case.code and seen.lines == 1 and case.said in seen.last_line


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def machine() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def commit() -> str:
    """The commit probed: `PROBE_COMMIT` where PROBE_SRC is another checkout, else this repository's HEAD."""
    if os.environ.get("PROBE_COMMIT"):
        return os.environ["PROBE_COMMIT"]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
    return "unknown"


def write_readme(path: Path, rows: list[dict]) -> None:
    counts = {group: [r for r in rows if r["group"] == group] for group in GROUPS}
    unclean = [r for r in rows if not r["clean"]]
    before = {r["id"]: r for r in read_rows(path.with_name(BEFORE))}
    was = {  # "-" where the earlier checkout ran none of the group's cases
        group: sum(not before[r["id"]]["clean"] for r in found if r["id"] in before)
        if any(r["id"] in before for r in found)
        else "-"
        for group, found in counts.items()
    }
    base = next(iter(before.values()), {}).get("commit", "?")
    lines = [
        "# Bad input at every door",
        "",
        "Each row: one bad (or control) input, the outcome the project's rule expects (a one-line refusal naming the "
        "argument, exit code 2 on a command line; or a result, with a warning line where a value is used clamped) "
        "and the outcome observed (exit code or exception, last stderr line or message, whether a traceback "
        "appeared). Made by:",
        "",
        "```bash",
        "OMP_NUM_THREADS=1 python benchmarks/analysis/bad_input_probe.py   # from the repository root; resumes",
        "```",
        "",
        f"Machine: {machine()}. Commit: {commit()} (the rows' `commit` says which commit ran each).",
        "",
        f"{BEFORE}: the same cases on the package as it was before this probe's fixes (commit {base}; "
        f"`PROBE_SRC=<its src> PROBE_COMMIT={base} PYTHONPATH=<its src> PROBE_TIMEOUT_S=90 python "
        f"benchmarks/analysis/bad_input_probe.py --out docs/results/bad-input-probe/{BEFORE}`), for comparison.",
        "",
        f"| group | cases | clean | not clean | not clean at {base} |",
        "|---|---|---|---|---|",
        *(
            f"| {group} | {len(found)} | {sum(r['clean'] for r in found)} | {sum(not r['clean'] for r in found)} | "
            f"{was[group]} |"
            for group, found in counts.items()
        ),
        "",
        "`vllm_server` and `vllm_offline` run in the vLLM virtualenv (docs/serving.md): `python "
        "benchmarks/analysis/bad_input_probe.py --group vllm_server --group vllm_offline`; the server's requests "
        "carry the settings as JSON text in `vllm_xargs`, its refusals are HTTP 400 (`code`).",
        "",
        "Not clean: " + (", ".join(f"`{r['id']}`" for r in unclean) if unclean else "none") + ".",
        "",
        f"Not clean at {base}: " + (", ".join(f"`{i}`" for i, r in before.items() if not r["clean"]) or "none") + ".",
        "",
    ]
    wrapped = [
        line
        if line.startswith(("|", "`", "#"))
        else textwrap.fill(line, 120, break_on_hyphens=False, break_long_words=False)
        for line in lines
    ]
    path.with_name("README.md").write_text("\n".join(wrapped))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--group", choices=GROUPS, action="append", help="only these groups (repeatable)")
    parser.add_argument("--again", action="store_true", help="run the cases whose rows are not clean again")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = read_rows(args.out)
    if args.again:
        rows = [row for row in rows if row["clean"]]
        args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    done = {row["id"] for row in rows}
    make_scratch()
    objects: dict = {}
    here = commit()
    for group in args.group or GROUPS:
        todo = [case for case in CASES[group] if case.id not in done]
        if group == "python" and todo:
            objects = python_objects()
        for case in todo:
            seen = RUNNERS[case.group](case, objects)
            row = {
                "id": case.id,
                "group": case.group,
                "given": case.given,
                "expected": case.expected,
                "expected_line": case.said,
                "expected_code": case.code if case.group != "python" else None,
                **dataclasses.asdict(seen),
                "clean": is_clean(case, seen),
                "commit": here,
            }
            with args.out.open("a") as file:
                file.write(json.dumps(row) + "\n")
            rows.append(row)
            print(f"{'ok ' if row['clean'] else 'NOT'} {case.id}: {seen.code} {seen.last_line[:120]}", flush=True)
    if args.out.name != BEFORE:
        write_readme(args.out, rows)
    print(f"{sum(r['clean'] for r in rows)} of {len(rows)} clean; {args.out}")


if __name__ == "__main__":
    main()
