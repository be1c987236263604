"""`refreshkv trace`: what a method's selection holds at every step and layer, measured against exact attention."""

import json

import pytest
import torch
from conftest import random_prompt, tiny_model
from test_bad_input import assert_one_line_error, cli, no_model  # noqa: F401  (a fixture)

from refreshkv import make_policy
from refreshkv.cli.trace_command import needle_positions
from refreshkv.measure.trace import MAX_STEPS, trace_generation, what_it_shows

STEPS = 8


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, seed=3)


def trace(model, method, needle=(), **params):
    return trace_generation(model, random_prompt(60, seed=4), make_policy(method, **params), STEPS, list(needle))


def measure(result, name):
    return torch.tensor([step[name] for step in result["steps"]])  # (steps, layers)


def test_full_attends_to_everything_at_every_step(model):
    result = trace(model, "full", needle=[10, 11])
    assert len(result["steps"]) == STEPS - 1 and result["layers"] == [0, 1]  # the first token comes from the prefill
    for name in ("mass", "overlap", "needle"):
        assert (measure(result, name) == 1).all()
    assert measure(result, "full").all()


def test_the_oracle_attends_to_exactly_the_top_k_and_a_small_partial_cache_misses_mass(model):
    oracle = trace(model, "oracle", budget=8)
    assert torch.allclose(measure(oracle, "overlap"), torch.ones(STEPS - 1, 2))
    recycled = trace(model, "recycled", budget=8, stride=4)
    full = measure(recycled, "full")
    assert full[3].all() and not full[:3].any()  # decode step 4 of the fixed schedule is full
    mass, overlap = measure(recycled, "mass"), measure(recycled, "overlap")
    assert (mass[~full] < 1).all() and (overlap[~full] < 1).all() and (mass[full] == 1).all()
    # the oracle's K tokens carry more of the exact attention than a selection made steps ago
    assert measure(oracle, "mass")[~full].mean() > mass[~full].mean()


def test_the_needle_share_is_the_share_of_its_tokens_in_the_selection(model):
    ids = random_prompt(60, seed=4)
    policy = make_policy("snapkv", budget=20, window=4)
    result = trace_generation(model, ids, policy, 2, [0, 1, 57, 58])
    from refreshkv.engine.cache import PolicyCache
    from refreshkv.engine.cache_argument import with_cache

    cache = PolicyCache(policy, model, max_new_tokens=1)
    with torch.no_grad():
        model(ids, **with_cache(model, cache))
    for layer, share in zip(cache.layers, result["steps"][0]["needle"]):
        kept = cache.layers[layer.layer_idx].state.kept(None)[0]  # (Hkv, slots)
        expected = sum(float(torch.isin(torch.tensor([0, 1, 57, 58]), row).float().mean()) for row in kept) / 2
        assert share == pytest.approx(expected)
    assert result["steps"][0]["needle"][0] >= 0.5  # the window's own tokens (57, 58) are always kept


def test_the_first_token_counts_as_held_while_the_store_has_empty_slots(model):
    # a budget above the prompt's 60 tokens keeps every one of them, and the store has room (empty slots, -1 in the
    # selection) for the tokens still to be decoded at every step
    result = trace(model, "snapkv", needle=[0], budget=64)
    assert (measure(result, "needle") == 1).all()
    assert torch.allclose(measure(result, "mass"), torch.ones(STEPS - 1, 2))  # every token held: all the attention


def test_what_the_trace_shows_is_said_per_kind_of_method():
    assert "C_p" in what_it_shows(make_policy("refreshkv"))
    assert "no partial cache" in what_it_shows(make_policy("snapkv"))
    assert "each step chose" in what_it_shows(make_policy("quest"))


def test_a_long_trace_and_a_needle_not_in_the_prompt_are_refused_in_one_line(model):
    with pytest.raises(
        ValueError, match=rf"^a trace records every step and layer: max_new_tokens must be in \[1, {MAX_STEPS}\]$"
    ):
        trace_generation(model, random_prompt(20), make_policy("full"), MAX_STEPS + 1, [])

    class Offsets:
        def __call__(self, text, add_special_tokens, return_offsets_mapping):
            return {"offset_mapping": [(i, i + 1) for i in range(len(text))]}  # one character a token

    assert needle_positions(Offsets(), "ab 4532516. cd", "4532516") == list(range(3, 10))
    with pytest.raises(ValueError, match=r"^the needle '999' is not in the prompt; give a string the prompt holds"):
        needle_positions(Offsets(), "ab 4532516. cd", "999")


def test_the_json_holds_one_row_per_step_and_traced_layer(model, tmp_path):
    result = trace(model, "refreshkv", needle=[5], budget=8, qc_stride=2)
    text = json.dumps(result)
    assert len(json.loads(text)["steps"]) == STEPS - 1
    assert all(len(step[name]) == 2 for step in result["steps"] for name in ("full", "mass", "overlap", "needle"))


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--prompt", "hi", "--max-new-tokens", "5000"], "max_new_tokens must be in [1, 1024]"),
        (["--prompt", "hi", "--example", "3"], "--task-option and --example go with --task"),
        (["--task", "ruler/niah_single_1", "--prompt", "hi"], "give --task or a prompt"),
        (["--task", "ruler/niah_single_1", "--task-option", "question=last"], "unknown question form 'last'"),
        (["--prompt", "hi", "--method", "nope"], "unknown method 'nope'"),
        (["--prompt", "hi", "--out", "missing/t.json"], "cannot write trace file missing/t.json (No such file"),
    ],
)
def test_trace_bad_input_is_one_line_before_the_model_loads(monkeypatch, capsys, no_model, tmp_path, args, fragment):
    monkeypatch.chdir(tmp_path)
    out = [] if "--out" in args else ["--out", "t.json"]
    code, _, err = cli(monkeypatch, capsys, "trace", *out, *args)
    assert_one_line_error(code, err, fragment)
    assert not (tmp_path / "t.json").exists()
