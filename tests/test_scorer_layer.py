"""The shared selection tail (ranked/top_k/keep_top), the score() checks, and the MethodLayer contract."""

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import random_prompt, tiny_model

from refreshkv import PolicyError, generate, make_policy
from refreshkv.core.attention_math import ranked, top_k
from refreshkv.core.contract import MethodLayer
from refreshkv.core.device_steps import DeviceLayer
from refreshkv.core.policy import METHODS
from refreshkv.core.selection import SelectionPolicy, keep_top

SOURCE = Path(__file__).resolve().parents[1] / "src" / "refreshkv"
INF = float("inf")


def test_top_k_ranks_negative_scores_by_value():
    assert top_k(torch.tensor([[-0.3, -0.1, -0.5, -0.9]]), 2).tolist() == [[0, 1]]
    assert ranked(torch.tensor([[-0.3, -0.1, -0.5, -0.9]]), 4).tolist() == [[1, 0, 2, 3]]


def test_top_k_puts_minus_infinity_below_every_real_score():
    assert top_k(torch.tensor([[-1e-7, -INF, 0.5]]), 2).tolist() == [[0, 2]]
    assert ranked(torch.tensor([[-INF, 3.0, INF, -2.0, 0.0, -0.0]]), 6).tolist() == [[2, 1, 4, 5, 3, 0]]


def test_ties_go_to_the_earlier_position_whatever_the_sign():
    assert ranked(torch.tensor([[-2.0, -1.0, -1.0, -1.0, -2.0]]), 3).tolist() == [[1, 2, 3]]
    assert ranked(torch.tensor([[0.0, -0.0, 0.0]]), 2).tolist() == [[0, 1]]  # -0.0 ties with 0.0


def test_excluded_positions_rank_after_minus_infinity():
    scores = torch.tensor([[5.0, -INF, 9.0, 1.0]])
    valid = torch.tensor([[True, True, False, True]])
    assert ranked(scores, 4, valid=valid).tolist() == [[0, 3, 1, 2]]


def test_keep_top_marks_pads_and_keeps_the_recent_window():
    scores = torch.tensor([[[0.75, -3.0, 0.25, -0.5, -7.0]]])  # (B=1, H=1, n=5)
    valid = torch.tensor([[[False, True, True, True, True]]])  # position 0 is a pad
    index, kept = keep_top(scores, 3, valid, keep_last=1)
    assert index.tolist() == [[[2, 3, 4]]]  # the window (4) first, then the best real ones (2, 3); the pad never
    assert kept.tolist() == [[[0.25, -0.5, -7.0]]]  # their own scores, the window's included
    index, kept = keep_top(scores, 5, valid)
    assert index.tolist() == [[[-1, 1, 2, 3, 4]]] and kept[0, 0, 0] == -INF  # more asked than real: -1


def scorer(returned):
    """A registered scorer method whose score() returns `returned(key)` (for the bad-input checks)."""

    @dataclasses.dataclass
    class Broken(SelectionPolicy):
        name = "broken-scorer"
        summary = "test"

        def score(self, layer, query, key, scaling, valid):
            return returned(key)

    return Broken


@pytest.mark.parametrize(
    "returned, message",
    [
        (lambda key: torch.full(key.shape[:3], float("nan")), "returned NaN"),
        (lambda key: torch.zeros(key.shape[:2]), "expected a tensor of shape (batch, kv_heads, prompt_length)"),
        (lambda key: [0.0], "returned list"),
    ],
)
def test_a_bad_score_is_one_line_naming_the_method(returned, message):
    policy = scorer(returned)(budget=4)
    with pytest.raises(PolicyError, match="method 'broken-scorer'") as error:
        generate(tiny_model(), random_prompt(12), method=policy, max_new_tokens=2)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_scorer_with_negative_scores_keeps_the_highest():
    """A score() of -position keeps the earliest tokens: the highest of all-negative scores."""
    policy = scorer(lambda key: -torch.arange(key.shape[2], dtype=torch.float).expand(*key.shape[:3]))(budget=5)
    out = generate(tiny_model(), random_prompt(12), method=policy, max_new_tokens=2)
    kept = out.cache.layers[0].state.kept(None)[0, 0]
    assert sorted(p for p in kept.tolist() if p >= 0)[:5] == [0, 1, 2, 3, 4]


def test_keydiff_keeps_the_distinctive_keys():
    keydiff = METHODS["keydiff"](budget=2)
    key = torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [1.0, -0.1], [-1.0, 0.0]]).view(1, 1, 5, 2)
    scores = keydiff.score(None, None, key, 1.0, None)
    assert keep_top(scores, 2)[0].tolist() == [[[2, 4]]]  # the two keys pointing away from the common direction


def method_sources() -> list[Path]:
    return [
        *sorted((SOURCE / "methods").glob("*.py")),
        SOURCE / "core" / "policy.py",
        SOURCE / "core" / "selection.py",
        SOURCE / "engine" / "sliding_window.py",
    ]


def test_methods_use_only_the_method_layer_contract():
    # a method's device step (Policy.device_step) receives a DeviceLayer: the contract and the step's counters
    members = {
        name
        for contract in (MethodLayer, DeviceLayer)
        for name in [*vars(contract), *contract.__annotations__]
        if not name.startswith("_")
    }
    used = {
        (path.name, node.attr)
        for path in method_sources()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "layer"
    }
    assert used and {attr for _, attr in used} - members == set(), sorted(used)


def test_every_registered_method_class_documents_its_parameters():
    """Each method class has a docstring of its own (not the signature dataclasses writes) naming every parameter."""
    missing = {
        name: [p for p in cls.parameters() if f"`{p}`" not in (vars(cls).get("__doc__") or "")]
        for name, cls in METHODS.items()
    }
    assert {name: params for name, params in missing.items() if params} == {}


def test_forward_pooling_lifts_one_token_before_a_peak_and_kernel_minus_two_after():
    from refreshkv.core.attention_math import pool

    scores = torch.zeros(1, 12)
    scores[0, 3] = 1.0
    assert pool(scores, 5, "forward")[0].tolist() == [0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0]  # 2 .. 3 + 5 - 2
    assert pool(scores, 5)[0].tolist() == [0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]  # centered: 3 - 2 .. 3 + 2
    assert pool(scores, 1, "forward").equal(scores)
    with pytest.raises(PolicyError, match="unknown pooling .backward.; choose from: centered, forward, span"):
        make_policy("refreshkv", pooling="backward")
