"""A batch prefilled a few rows at a time (`generate_many(prefill_rows=...)`, engine/join_rows.py) decodes as the batch
prefilled in one forward: same tokens, logits, statistics and bytes for every method."""

import pytest
import torch
from conftest import forward_shapes, random_prompt, tiny_model
from test_method_contract import left_pad, max_diff, small_budget

import refreshkv
from refreshkv import METHODS, PolicyError, make_policy
from refreshkv.core.kvstore import LayerState
from refreshkv.engine.join_rows import join_states

ALL = sorted(METHODS)
NEW = 10


def policies():
    return [make_policy(name, **small_budget(name)) for name in ALL]


def prompts(kind: str):
    """Five rows of one length, or of five lengths (left-padded): row groups then differ in their padding and in
    how wide their ragged selections are (refreekv's heads, dynamickv's rows)."""
    if kind == "equal":
        return random_prompt(40, seed=5, batch=5), None
    return left_pad([random_prompt(length, seed=seed)[0] for seed, length in enumerate((40, 31, 35, 40, 22))])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("kind", ["equal", "padded"])
def test_every_method_decodes_as_if_prefilled_at_once(family, kind):
    model = tiny_model(family)
    ids, mask = prompts(kind)
    run = dict(max_new_tokens=NEW, eos_token_id=[], return_logits=True)
    at_once = refreshkv.generate_many(model, ids, mask, methods=policies(), **run)
    grouped = refreshkv.generate_many(model, ids, mask, methods=policies(), prefill_rows=2, **run)
    for name, whole, parts in zip(ALL, at_once, grouped):
        assert parts.tokens == whole.tokens, name
        assert max_diff(parts.logits, whole.logits) < 1e-5, name
        assert parts.cache.nbytes_per_layer() == whole.cache.nbytes_per_layer(), name
        assert parts.cache.full_step_fraction() == whole.cache.full_step_fraction(), name
        assert parts.cache.attended_bytes_mean() == whole.cache.attended_bytes_mean(), name


def test_the_methods_share_each_groups_forward():
    model = tiny_model("llama", layers=1)
    shapes = forward_shapes(model)
    refreshkv.generate_many(
        model, random_prompt(30, batch=5), methods=policies(), max_new_tokens=2, eos_token_id=[], prefill_rows=2
    )
    assert shapes[:3] == [(2, 30), (2, 30), (1, 30)]  # then one-token decode steps of every row
    assert all(shape == (5, 1) for shape in shapes[3:]) and len(shapes) == 3 + len(ALL)


class Counted(LayerState):
    """A state with one batch-first tensor and one attribute shared by its rows."""

    def __init__(self, rows: int, shared: int):
        self.keys = torch.arange(rows)
        self.shared = shared


def test_tensors_join_along_the_batch_and_shared_attributes_must_agree():
    joined = join_states([Counted(2, 7), Counted(1, 7)], "layer 0")
    assert joined.keys.tolist() == [0, 1, 0] and joined.shared == 7
    with pytest.raises(PolicyError, match=r"layer 0\.shared differs between the row groups \(7, 8\); prefill") as error:
        join_states([Counted(2, 7), Counted(1, 8)], "layer 0")
    assert "\n" not in str(error.value)


def test_prefill_rows_must_be_positive():
    with pytest.raises(PolicyError, match="prefill_rows"):
        refreshkv.generate(tiny_model("llama", layers=1), random_prompt(20), prefill_rows=0)
