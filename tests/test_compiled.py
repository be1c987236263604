"""The compiled decode step (runtime/compiled.py): refreshkv's per-row decision under compile, the statistics it keeps in tensors,
and one line where torch.compile fails. Every method's compiled step: test_method_contract.py."""

import pytest
import torch
from conftest import random_prompt, tiny_model
from test_bad_input import assert_one_line_error, cli, no_model  # noqa: F401  (fixture)

from refreshkv import generate, make_policy
from refreshkv.core import attention_math
from refreshkv.engine.cache_argument import cache_keyword
from refreshkv.engine.decode_stats import DecodeStats
from refreshkv.runtime import compiled


@pytest.fixture(scope="module")
def two_layers():
    return tiny_model("llama", layers=2, seed=3)


@pytest.mark.parametrize("host_reads_free", [("cpu",), ()], ids=["qc-steps-eager", "qc-steps-compiled"])
def test_compiled_dynamic_schedule_with_rows_that_disagree(two_layers, host_reads_free, monkeypatch):
    """QC steps with a threshold that sends some rows, not all, to full attention: run eagerly on the CPU, or (as on
    a GPU) compiled, the decision applied per row with torch.where instead of read on the host (every method's
    compiled step is checked in test_method_contract.py)."""
    monkeypatch.setattr(compiled, "HOST_READS_FREE", host_reads_free)
    ids = random_prompt(40, seed=2, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    params = {"budget": 8, "qc_stride": 3, "threshold": 0.5}
    eager = generate(two_layers, ids, mask, method="refreshkv", max_new_tokens=12, eos_token_id=[], **params)
    fused = generate(
        two_layers, ids, mask, method="refreshkv", max_new_tokens=12, eos_token_id=[], compile=True, **params
    )
    assert fused.tokens == eager.tokens
    assert fused.cache.stats.per_step(11) == eager.cache.stats.per_step(11)
    assert sum(eager.cache.stats.per_step(11)) > 0  # the steps compared include full steps


def test_compiled_qc_steps_run_eagerly_on_the_cpu(two_layers, monkeypatch):
    """Only the QC steps (3, 6, 9 with qc_stride 3) leave the compiled forward."""
    import sys

    generate_module = sys.modules["refreshkv.runtime.generate"]
    steps = []

    def counted(model):
        forward = compiled.compiled_forward(model)
        return lambda *args, **kwargs: steps.append(kwargs[cache_keyword(model)].step + 1) or forward(*args, **kwargs)

    monkeypatch.setattr(generate_module, "compiled_forward", counted)
    generate(
        two_layers,
        random_prompt(40, seed=2),
        method="refreshkv",
        budget=8,
        qc_stride=3,
        max_new_tokens=12,
        eos_token_id=[],
        compile=True,
    )
    assert steps == [1, 2, 4, 5, 7, 8, 10, 11]
    assert [step for step in range(1, 12) if make_policy("refreshkv", qc_stride=3).decides_on_host(step)] == [3, 6, 9]
    assert not any(make_policy("recycled", stride=3).decides_on_host(step) for step in range(1, 12))


def test_the_explicit_decode_attention_compiles_and_equals_eager_and_sdpa(two_layers, monkeypatch):
    """One query over EXPLICIT_DECODE_FROM keys or more is attended explicitly (lowered here so that the tiny model's
    cache crosses it mid-generation: a guard, then the other graph); compiled and eager agree with SDPA's tokens."""
    ids = random_prompt(40, seed=2, batch=2)
    settings = {"method": "full", "max_new_tokens": 12, "eos_token_id": [], "return_logits": True}
    sdpa = generate(two_layers, ids, **settings)
    monkeypatch.setattr(attention_math, "EXPLICIT_DECODE_FROM", 45)
    eager = generate(two_layers, ids, **settings)
    fused = generate(two_layers, ids, compile=True, **settings)
    assert fused.tokens == eager.tokens == sdpa.tokens
    assert max((a - b).abs().max().item() for a, b in zip(eager.logits, sdpa.logits)) > 0  # the explicit path ran
    assert max((a - b).abs().max().item() for a, b in zip(eager.logits, sdpa.logits)) < 1e-4


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
    with pytest.raises(
        compiled.CompileUnavailable,
        match=r"^torch.compile does not work on this machine .*g\+\+ not found"
        r".*; run without --compile",
    ) as error:
        generate(two_layers, random_prompt(20), method="full", max_new_tokens=2, compile=True)
    assert "\n" not in str(error.value)


def test_cli_compile_without_a_working_compiler(broken_compiler, no_model, monkeypatch, capsys):
    code, _, err = cli(monkeypatch, capsys, "generate", "--prompt", "hello", "--compile")
    assert_one_line_error(code, err, "torch.compile does not work on this machine", "run without --compile")


def test_past_dynamos_graph_limit_a_compiled_generation_stops_in_one_line(two_layers, monkeypatch):
    """A process that meets more new graphs than dynamo allows (methods x prompt lengths x schedules) gets one line
    saying what to do, not dynamo's traceback."""

    def past_the_limit(function, **options):
        def run(*args, **kwargs):
            raise torch._dynamo.exc.FailOnRecompileLimitHit("Hard failure due to fullgraph=True")

        return run

    monkeypatch.setattr(compiled, "_works", [""])
    monkeypatch.setattr(torch, "compile", past_the_limit)
    with pytest.raises(compiled.CompileUnavailable, match=r"reached its limit of \d+ graphs .* without --compile$"):
        generate(two_layers, random_prompt(20), method="full", max_new_tokens=3, compile=True)
