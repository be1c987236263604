"""The training pattern (train/pattern.py) is exactly what `recycled` decodes from when it never refreshes."""

import pytest
import torch
from conftest import tiny_model

from refreshkv import generate, make_policy
from refreshkv.engine.attention import PATTERN_ARGUMENT
from refreshkv.train.pattern import PartialPattern

PREFIX, SUFFIX = 48, 12


def pattern_logits(model, ids, pattern):
    with torch.no_grad():
        return model(ids[None, : pattern.length], **{PATTERN_ARGUMENT: pattern}).logits[0, pattern.prefix_length - 1 :]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "budget, kernel, window, aggregation", [(8, 7, 1, "max"), (5, 1, 2, "mean"), (10, 3, 1, "first")]
)
def test_training_logits_equal_teacher_forced_recycled_that_never_refreshes(
    family, budget, kernel, window, aggregation
):
    model = tiny_model(family, layers=3, seed=1)
    ids = torch.randint(0, 128, (PREFIX + SUFFIX + 1,), generator=torch.Generator().manual_seed(3))
    pattern = PartialPattern(PREFIX, SUFFIX, budget, kernel=kernel, window=window, aggregation=aggregation)
    # the pattern trains the papers' centred selection
    params = dict(stride=SUFFIX + 1, budget=budget, kernel=kernel, window=window, aggregation=aggregation)
    params["pooling"] = "centered"
    out = generate(
        model,
        ids[None, :PREFIX],
        method=make_policy("recycled", **params),
        forced_tokens=ids[None, PREFIX:],
        return_logits=True,
    )
    decoded = torch.cat(out.logits)  # the prefill's logits, then one per decoded suffix token
    assert out.cache.layers[0].state.full.length == PREFIX + SUFFIX
    torch.testing.assert_close(pattern_logits(model, ids, pattern), decoded, atol=1e-4, rtol=0)
    # the pattern is not plain attention: with K << L the suffix logits move
    with torch.no_grad():
        plain = model(ids[None, : PREFIX + SUFFIX]).logits[0, PREFIX - 1 :]
    assert (plain[1:] - decoded[1:]).abs().max() > 1e-2


def test_suffix_rows_see_the_selection_shrink_and_the_local_band_grow():
    """Hand-made scores: the last prefix token's query picks keys 1 and 3; key 1 scores lower, so it goes first."""
    prefix, suffix, budget = 6, 3, 2
    pattern = PartialPattern(prefix, suffix, budget, kernel=1)
    key = torch.zeros(1, 1, prefix + suffix, 2)
    key[0, 0, 1, 0], key[0, 0, 3, 0] = 3.0, 4.0
    query = torch.zeros(1, 1, prefix + suffix, 2)
    query[0, 0, prefix - 1, 0] = 1.0
    index, visible = pattern.selection(query, key, scaling=1.0)
    assert index.tolist() == [[[1, 3]]]
    # columns: selected key 1, selected key 3, suffix tokens 0..2
    assert visible[0, 0].int().tolist() == [[1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]


def test_pattern_gives_gradients_to_the_selected_keys_only_through_attention():
    model = tiny_model("llama", layers=2, seed=0).train()
    ids = torch.randint(0, 128, (1, PREFIX + SUFFIX), generator=torch.Generator().manual_seed(0))
    loss = model(ids, labels=ids, **{PATTERN_ARGUMENT: PartialPattern(PREFIX, SUFFIX, 8)}).loss
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert torch.isfinite(loss) and all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            dict(prefix_length=8, suffix_length=8, budget=2),
            r"suffix length S \(8\) must be below the prefix length L \(8\)",
        ),
        (dict(prefix_length=8, suffix_length=2, budget=8), r"budget K \(8\) must be below the prefix length L \(8\)"),
        (dict(prefix_length=8, suffix_length=2, budget=2, kernel=4), r"kernel must be an odd integer >= 1, got 4"),
    ],
)
def test_bad_pattern_is_one_line(args, message):
    with pytest.raises(ValueError, match=message):
        PartialPattern(**args)


def test_models_with_sliding_windows_or_soft_capping_are_refused_by_the_pattern():
    pattern = PartialPattern(PREFIX, SUFFIX, 8)
    ids = torch.randint(0, 128, (1, PREFIX + SUFFIX))
    for family in ("gemma2", "gemma3"):
        with pytest.raises(ValueError, match="training pattern needs attention layers without soft-capping"):
            tiny_model(family, seed=0)(ids, **{PATTERN_ARGUMENT: pattern})
