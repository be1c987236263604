"""The cache reaches every model call under the name the installed transformers takes: no deprecation warning."""

import inspect
import warnings

import pytest
import torch
from conftest import random_prompt, tiny_model

from refreshkv import PolicyCache, generate, generate_many, make_policy
from refreshkv.engine.cache_argument import NEW_NAME, OLD_NAME, cache_keyword
from refreshkv.measure.bench_round import PeakMemory, run_transformers_once
from refreshkv.measure.profile_step import profile_once
from refreshkv.runtime.loading import check_attention


def cache_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if OLD_NAME in str(w.message) or "cache_params" in str(w.message)]


def test_the_keyword_is_the_one_the_installed_forward_takes():
    llama = tiny_model()
    parameters = inspect.signature(type(llama).forward).parameters
    assert cache_keyword(llama) in parameters
    assert cache_keyword(llama) == (NEW_NAME if NEW_NAME in parameters else OLD_NAME)


def test_no_call_of_the_package_warns_about_the_cache_argument():
    llama = tiny_model()
    ids = random_prompt(40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(llama, ids, method="refreshkv", budget=8, max_new_tokens=4)
        generate_many(llama, ids, methods=["full", make_policy("snapkv", budget=8, window=4)], max_new_tokens=4)
        cache = PolicyCache(make_policy("h2o", budget=8), llama, max_new_tokens=4)
        llama.generate(ids, **{cache_keyword(llama): cache}, max_new_tokens=4, do_sample=False, pad_token_id=0)
        check_attention(llama)
        run_transformers_once(llama, ids, 3, PeakMemory(torch.device("cpu")), None)
        profile_once(llama, ids, make_policy("full"), 2)
    assert cache_warnings(caught) == []


def test_the_old_keyword_would_be_caught():
    """The check above can fail: where transformers renamed the argument, passing the old name warns."""
    llama = tiny_model()
    if cache_keyword(llama) == OLD_NAME:
        pytest.skip("this transformers takes past_key_values: there is no deprecation to catch")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llama(random_prompt(8), **{OLD_NAME: None}, use_cache=False)
    assert cache_warnings(caught)
