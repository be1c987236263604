"""The compiled decode step (compiled.py): the step of each method compiles whole (fullgraph: no host sync, no graph
break) and gives the eager tokens; a machine where torch.compile fails gets one line."""

import pytest
import torch
from conftest import random_prompt, tiny_model
from test_bad_input import assert_one_line_error, cli, no_model  # noqa: F401  (fixture)

from refreshkv import compiled, generate
from refreshkv.core.cache import DecodeStats

# The six methods, with K below the prompt and schedules that refresh within the 12 decode steps.
COMPILED_METHODS = {
    "full": {},
    "recycled": {"budget": 8, "stride": 4},
    "refreshkv": {"budget": 8, "qc_stride": 3, "threshold": 0.5},
    "streamingllm": {"budget": 8},
    "snapkv": {"budget": 12, "window": 4},
    "h2o": {"budget": 8},
}


@pytest.fixture(scope="module")
def two_layers():
    return tiny_model("llama", layers=2, seed=3)


@pytest.mark.parametrize("method", COMPILED_METHODS)
def test_compiled_step_equals_eager(two_layers, method):
    ids = random_prompt(40, seed=2, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # rows of different lengths: per-row positions and, for refreshkv, rows that may disagree
    params = COMPILED_METHODS[method]
    eager = generate(two_layers, ids, mask, method=method, max_new_tokens=12, eos_token_id=[], **params)
    fused = generate(two_layers, ids, mask, method=method, max_new_tokens=12, eos_token_id=[], compile=True, **params)
    assert fused.tokens == eager.tokens
    assert fused.cache.stats.per_step(11) == eager.cache.stats.per_step(11)
    if method in ("recycled", "refreshkv"):
        assert sum(eager.cache.stats.per_step(11)) > 0  # the steps compared include full steps


def test_stats_per_layer_and_step_grow_past_the_announced_steps():
    stats = DecodeStats(2, steps=2)
    for step in (1, 2, 3):
        stats.add(0, step, 1.0, 10)
        stats.add(1, step, torch.tensor(0.5), 20)
    assert stats.per_layer() == [3.0, 1.5]
    assert stats.per_step(3) == [1.5, 1.5, 1.5]
    assert stats.attended_bytes() == 90


@pytest.fixture
def broken_compiler(monkeypatch):
    def fail(*args, **kwargs):
        def run(*a, **k):
            raise RuntimeError("Compiler: g++ not found\nlong trace line 2")
        return run

    monkeypatch.setattr(compiled, "_works", [])
    monkeypatch.setattr(torch, "compile", fail)


def test_compile_without_a_working_compiler_is_one_line(broken_compiler, two_layers):
    with pytest.raises(compiled.CompileUnavailable, match=r"^torch.compile does not work on this machine .*g\+\+ not found"
                       r".*; run without --compile") as error:
        generate(two_layers, random_prompt(20), method="full", max_new_tokens=2, compile=True)
    assert "\n" not in str(error.value)


def test_cli_compile_without_a_working_compiler(broken_compiler, no_model, monkeypatch, capsys):
    code, _, err = cli(monkeypatch, capsys, "generate", "--prompt", "hello", "--compile")
    assert_one_line_error(code, err, "torch.compile does not work on this machine", "run without --compile")
