"""Every method on every supported family (tiny random configs), sliding-window layers included.

Reference: transformers' own generation with its eager attention and its own cache (`model.generate`), so the
package's decoding is checked against the library, not against itself.
"""

import pytest
from conftest import FAMILIES, random_prompt, tiny_model
from test_method_contract import left_pad, max_diff, small_budget

import refreshkv
from refreshkv import METHODS, make_policy
from refreshkv.engine.sliding_window import SlidingWindow

NEW = 10
WINDOW = 16  # below the 40-token prompts: the window bites


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request):
    overrides = {"sliding_window": WINDOW} if request.param == "mistral" else {}
    return request.param, tiny_model(request.param, seed=4, **overrides)


def transformers_generation(model, ids, mask=None):
    """transformers' eager attention (soft-capping included) and its own cache: independent of this package."""
    model.set_attn_implementation("eager")
    try:
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    finally:
        model.set_attn_implementation("refreshkv")
    return out.sequences[:, ids.shape[1] :].tolist(), [step.float() for step in out.logits]


@pytest.mark.parametrize("name", sorted(METHODS))
def test_keeping_everything_equals_transformers_beyond_the_sliding_window(family_model, name):
    family, model = family_model
    ids = random_prompt(40, seed=5)
    tokens, logits = transformers_generation(model, ids)
    out = refreshkv.generate(
        model,
        ids,
        method=make_policy(name, **METHODS[name].keep_everything(model.config.max_position_embeddings)),
        max_new_tokens=NEW,
        eos_token_id=[],
        return_logits=True,
    )
    assert out.tokens == tokens
    assert max_diff(out.logits, logits) < 1e-4


@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_padded_batch_equals_its_rows(family_model, name):
    family, model = family_model
    rows = [random_prompt(40, seed=6)[0], random_prompt(29, seed=7)[0]]
    ids, mask = left_pad(rows)
    params = small_budget(name)
    batch = refreshkv.generate(
        model, ids, mask, method=make_policy(name, **params), max_new_tokens=NEW, eos_token_id=[], return_logits=True
    )
    for i, row in enumerate(rows):
        alone = refreshkv.generate(
            model,
            row[None],
            method=make_policy(name, **params),
            max_new_tokens=NEW,
            eos_token_id=[],
            return_logits=True,
        )
        assert batch.tokens[i] == alone.tokens[0]
        assert max_diff([step[i] for step in batch.logits], [step[0] for step in alone.logits]) < 1e-4


def test_sliding_layers_hold_their_window_and_global_layers_run_the_method():
    model = tiny_model("gemma3", seed=4)
    out = refreshkv.generate(
        model,
        random_prompt(40, seed=5),
        method=make_policy("snapkv", budget=8, window=4),
        max_new_tokens=NEW,
        eos_token_id=[],
    )
    kinds = [type(layer.policy).__name__ for layer in out.cache.layers]
    assert kinds == ["SlidingWindow"] * 5 + ["SnapKV"]
    assert all(layer.state.kept(None).shape[-1] == WINDOW for layer in out.cache.layers[:5])
    # a window that never bites: every layer runs the method
    short = refreshkv.generate(
        model,
        random_prompt(5, seed=5),
        method=make_policy("snapkv", budget=8, window=4),
        max_new_tokens=4,
        eos_token_id=[],
    )
    assert not any(isinstance(layer.policy, SlidingWindow) for layer in short.cache.layers)


def test_mistral_beyond_its_window_equals_transformers_with_full():
    model = tiny_model("mistral", sliding_window=WINDOW, seed=1)
    ids = random_prompt(50, seed=2)
    tokens, logits = transformers_generation(model, ids)
    out = refreshkv.generate(model, ids, method="full", max_new_tokens=NEW, eos_token_id=[], return_logits=True)
    assert out.tokens == tokens and max_diff(out.logits, logits) < 1e-4


def test_layer_budgets_are_shared_by_the_layers_that_run_the_method():
    """Gemma 3 (5 sliding layers, 1 global) with 40 prompt tokens: the global layer alone runs PyramidKV / DynamicKV,
    so it gets the whole budget of selected tokens, the per-layer budget SnapKV keeps (K = 8, window 4: 4 selected)."""
    from refreshkv.measure.budget_report import budget_report

    model = tiny_model("gemma3", seed=4)
    kept = {}
    for name in ("snapkv", "pyramidkv", "dynamickv"):
        out = refreshkv.generate(
            model,
            random_prompt(40, seed=5),
            method=make_policy(name, budget=8, window=4),
            max_new_tokens=1,
            eos_token_id=[],
        )
        kept[name] = budget_report(out.cache)["budget_per_layer"]
    assert kept["snapkv"][:5] == [WINDOW] * 5  # the sliding layers hold their window whatever the method
    assert kept["pyramidkv"] == kept["snapkv"] == kept["dynamickv"]
    assert kept["snapkv"][5] == 8
