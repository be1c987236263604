"""PolicyCache as a transformers Cache: model.generate's decoding modes, reset, crop, and its refusals."""

import pytest
import torch
from conftest import random_prompt, tiny_model

import refreshkv
from refreshkv import PolicyCache, PolicyError, make_policy
from refreshkv.engine.cache_argument import with_cache

NEW = 10
EVERYTHING = {"refreshkv": {"budget": 1024}, "recycled": {"budget": 1024}, "h2o": {"budget": 1024}}


def hf_generate(model, ids, policy=None, **kwargs):
    cache = None if policy is None else PolicyCache(policy, model, max_new_tokens=NEW)
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        **with_cache(model, cache),
        max_new_tokens=NEW,
        eos_token_id=None,
        pad_token_id=0,
        **kwargs,
    )


@pytest.mark.parametrize("name", ["full", "refreshkv", "recycled", "h2o"])
@pytest.mark.parametrize("mode", [{"do_sample": False}, {"do_sample": True, "top_k": 5}, {"num_beams": 2}])
def test_model_generate_modes_equal_plain_transformers(llama, name, mode):
    ids = random_prompt(30, seed=2)
    torch.manual_seed(0)
    plain = hf_generate(llama, ids, **mode)
    torch.manual_seed(0)
    out = hf_generate(llama, ids, make_policy(name, **EVERYTHING.get(name, {})), **mode)
    assert torch.equal(out, plain)


def test_assisted_decoding_with_full(llama):
    ids = random_prompt(30, seed=3)
    assistant = tiny_model("llama", seed=1)
    plain = hf_generate(llama, ids)
    out = hf_generate(llama, ids, make_policy("full"), assistant_model=assistant)
    assert torch.equal(out, plain)
    # refreshkv keeps every token in C_f, so it takes drafted tokens (one full step) and forgets the rejected ones
    kept = hf_generate(llama, ids, make_policy("refreshkv", budget=1024), assistant_model=assistant)
    assert torch.equal(kept, plain)


def test_crop_is_refused_by_a_method_that_drops_tokens(llama):
    cache = PolicyCache(make_policy("snapkv", budget=4, window=2), llama, max_new_tokens=2)
    with torch.no_grad():
        llama(random_prompt(20), **with_cache(llama, cache))
    with pytest.raises(
        PolicyError, match="cannot forget its last tokens .*methods that can: full, oracle, recycled, refreshkv"
    ) as error:
        cache.crop(-2)
    assert "\n" not in str(error.value)


def test_reset_gives_a_fresh_cache(llama):
    ids = random_prompt(30, seed=5)
    policy = make_policy("refreshkv", budget=6)
    cache = PolicyCache(policy, llama, max_new_tokens=NEW)
    first = llama.generate(ids, **with_cache(llama, cache), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.step == 0
    again = llama.generate(ids, **with_cache(llama, cache), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert torch.equal(first, again)


def test_seq_length_and_mask_sizes_follow_the_tokens(llama):
    cache = PolicyCache(make_policy("streamingllm", budget=4), llama, max_new_tokens=3)
    with torch.no_grad():
        llama(random_prompt(20), **with_cache(llama, cache))
        llama(torch.tensor([[5]]), **with_cache(llama, cache), position_ids=torch.tensor([[20]]))
    assert cache.get_seq_length() == 21
    assert cache.get_mask_sizes(1, 0) == (22, 0)


def test_a_model_without_the_package_attention_is_refused_or_switched():
    model = tiny_model("llama", attn_implementation="sdpa")
    with pytest.raises(PolicyError, match="set_attn_implementation") as error:
        PolicyCache(make_policy("full"), model.config)
    assert "\n" not in str(error.value)
    cache = PolicyCache(make_policy("refreshkv", budget=4), model)  # given the model, the cache switches it
    assert model.config._attn_implementation == "refreshkv"
    with torch.no_grad():
        model(random_prompt(20), **with_cache(model, cache))
    assert all(n > 0 for n in cache.nbytes_per_layer())


def test_a_missed_handoff_is_an_error_not_a_wrong_answer(llama):
    cache = PolicyCache(make_policy("full"), llama, max_new_tokens=2)
    llama.set_attn_implementation("sdpa")  # switched behind the cache's back
    try:
        with pytest.raises(RuntimeError, match="did not go through"):
            with torch.no_grad():
                llama(random_prompt(10), **with_cache(llama, cache))
    finally:
        llama.set_attn_implementation("refreshkv")


def test_a_method_that_forgets_to_record_is_caught(llama):
    class Silent(type(make_policy("full"))):
        def decode(self, layer, query, key, value, scaling):
            layer.record = lambda *a: None  # an instance attribute over the method, deleted below
            try:
                return super().decode(layer, query, key, value, scaling)
            finally:
                del layer.record

    with pytest.raises(RuntimeError, match="without calling layer.record"):
        refreshkv.generate(llama, random_prompt(10), method=Silent(), max_new_tokens=3)


def test_an_empty_row_in_the_attention_mask_is_refused(llama):
    ids = random_prompt(8, batch=2)
    mask = torch.ones_like(ids)
    mask[1] = 0
    with pytest.raises(ValueError, match="needs a real token"):
        refreshkv.generate(llama, ids, mask, max_new_tokens=2)


@pytest.mark.parametrize("fidelity", [False, True])
def test_dropped_caches_are_freed_without_the_cycle_collector(llama, fidelity):
    """A cache and its layers form no reference cycle: its tensors go when the last output holding it goes, not at
    Python's next full collection (which, with a model loaded, may be many examples away)."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        methods = ["full", make_policy("refreshkv", budget=8), make_policy("snapkv", budget=8, window=2)]
        outs = refreshkv.generate_many(llama, random_prompt(40), methods=methods, max_new_tokens=4, fidelity=fidelity)
        caches = [weakref.ref(out.cache) for out in outs]
        assert all(cache() is not None for cache in caches)
        del outs
        assert [cache() for cache in caches] == [None] * len(methods)
    finally:
        gc.enable()
