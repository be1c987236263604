"""benchmarks/analysis/long_output.py: the row builder's KL to `full` and tokens held, on hand-made cases and a tiny
random model."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_prompt, tiny_model

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("long_output", ROOT / "benchmarks" / "analysis" / "long_output.py")
long_output = sys.modules["long_output"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(long_output)


def test_kl_per_token_on_a_hand_made_case():
    reference = torch.log(torch.tensor([[0.5, 0.5], [0.25, 0.75]]))
    logits = torch.log(torch.tensor([[0.9, 0.1], [0.25, 0.75]])) + 3.0  # a shift of the logits changes nothing
    kl, agree = long_output.kl_per_token(reference, logits, chunk=1)
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl[0] == pytest.approx(expected, abs=1e-6) and kl[1] == pytest.approx(0.0, abs=1e-6)
    assert agree == [True, True]  # 0.5/0.5 ties break to the first token, as 0.9 does
    assert long_output.buckets([1.0, 3.0, 5.0], size=2) == [2.0, 5.0]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=3, seed=5)


def test_full_against_itself_is_zero_and_holds_every_token(model):
    prompt, targets = random_prompt(40, seed=1), random_prompt(30, seed=2)
    reference = long_output.reference_of(model, prompt, targets)
    row = long_output.measure(model, prompt, targets, "full", {}, reference)
    assert row["kl_mean"] == 0.0 and row["top1_agree"] == 1.0 and len(row["kl"]) == 30
    assert row["held_per_layer"] == [40 + 30 - 1] * 3  # the last forced token is never fed


@pytest.mark.parametrize("name", ["snapkv", "h2o", "streamingllm", "pyramidkv"])
def test_a_bounded_method_holds_what_its_store_keeps_and_diverges(model, name):
    prompt, targets = random_prompt(60, seed=3), random_prompt(50, seed=4)
    reference = long_output.reference_of(model, prompt, targets)
    params = {"budget": 16, "compress_every": 8, **({"window": 4} if name in ("snapkv", "pyramidkv") else {})}
    row = long_output.measure(model, prompt, targets, name, params, reference)
    out = long_output.decode(model, prompt, targets, long_output.make_policy(name, **params))
    by_store = [int((layer.state.kept(None) >= 0).sum(-1).max()) for layer in out.cache.layers]
    assert row["held_per_layer"] == by_store
    assert sum(by_store) <= 3 * (16 + 8)  # pyramidkv's layers share it; the others each hold at most K + N
    if name != "pyramidkv":
        assert row["held_max"] <= 16 + 8
    assert row["kl_mean"] > 0 and len(row["kl_buckets"]) == 1
    assert row["kl_mean"] == pytest.approx(sum(row["kl"]) / 50, abs=1e-4)
