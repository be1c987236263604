"""One prefill for several methods (engine/shared_prefill.py, `generate_many`) equals each method run alone."""

import dataclasses

import pytest
import torch
from conftest import random_prompt, tiny_model
from test_method_contract import left_pad, max_diff, small_budget

import refreshkv
from refreshkv import METHODS, PolicyCache, PolicyError, make_policy
from refreshkv.engine.cache_argument import with_cache
from refreshkv.engine.shared_prefill import SharedPrefill
from refreshkv.measure.budget_report import budget_report
from refreshkv.methods.full import Full

NEW = 10
ALL = sorted(METHODS)


def policies():
    return [make_policy(name, **small_budget(name)) for name in ALL]


def prompt_forwards(model):
    """A list that records the length of every forward pass of `model` over more than one token."""
    lengths = []

    def record(_, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        if ids.shape[1] > 1:
            lengths.append(ids.shape[1])

    model.register_forward_pre_hook(record, with_kwargs=True)
    return lengths


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_every_method_equals_running_alone_on_a_padded_batch(request, family):
    model = request.getfixturevalue(family)
    ids, mask = left_pad([random_prompt(40, seed=5)[0], random_prompt(31, seed=6)[0]])
    shared = refreshkv.generate_many(
        model, ids, mask, methods=policies(), max_new_tokens=NEW, eos_token_id=[], return_logits=True
    )
    for name, out in zip(ALL, shared):
        alone = refreshkv.generate(
            model, ids, mask, method=name, max_new_tokens=NEW, eos_token_id=[], return_logits=True, **small_budget(name)
        )
        assert out.tokens == alone.tokens, name
        assert max_diff(out.logits, alone.logits) < 1e-5, name
        assert out.prefill_shared_by == len(ALL)
        kept, kept_alone = budget_report(out.cache), budget_report(alone.cache)
        assert kept["budget_per_layer"] == kept_alone["budget_per_layer"], name


def test_one_forward_pass_prefills_every_method():
    model = tiny_model("llama")
    lengths = prompt_forwards(model)
    refreshkv.generate_many(model, random_prompt(40), methods=policies(), max_new_tokens=3, eos_token_id=[])
    assert lengths == [40]


def test_sampling_draws_as_alone(llama):
    ids = random_prompt(40, seed=7)
    sample = dict(do_sample=True, top_k=20, seed=11, max_new_tokens=NEW, eos_token_id=[])
    outs = refreshkv.generate_many(llama, ids, methods=["full", make_policy("refreshkv", budget=8)], **sample)
    assert outs[0].tokens == refreshkv.generate(llama, ids, method="full", **sample).tokens
    assert outs[1].tokens == refreshkv.generate(llama, ids, method="refreshkv", budget=8, **sample).tokens


@dataclasses.dataclass
class OwnPrefill(Full):
    """A method whose prompt output is not plain attention (stands for a chunked-prefill method)."""

    name = "own-prefill"
    shares_prefill = False

    def prefill(self, layer, query, key, value, mask, scaling):
        return 2 * super().prefill(layer, query, key, value, mask, scaling)


def test_a_method_with_its_own_prefill_runs_alone(llama):
    model = tiny_model("llama")
    lengths = prompt_forwards(model)
    ids = random_prompt(40, seed=8)
    own, full, snap = refreshkv.generate_many(
        model,
        ids,
        methods=[OwnPrefill(), "full", make_policy("snapkv", budget=8, window=4)],
        max_new_tokens=NEW,
        eos_token_id=[],
        return_logits=True,
    )
    assert lengths == [40, 40]  # the two sharing methods together, the other alone
    assert (own.prefill_shared_by, full.prefill_shared_by, snap.prefill_shared_by) == (1, 2, 2)
    alone = refreshkv.generate(model, ids, method=OwnPrefill(), max_new_tokens=NEW, eos_token_id=[], return_logits=True)
    assert own.tokens == alone.tokens and max_diff(own.logits, alone.logits) < 1e-5
    with pytest.raises(PolicyError, match="own-prefill.*run it alone"):
        SharedPrefill([PolicyCache(OwnPrefill(), llama), PolicyCache(make_policy("full"), llama)])


def test_shared_prefill_refuses_used_caches(llama):
    cache = PolicyCache(make_policy("full"), llama)
    refreshkv.generate(llama, random_prompt(12), method=make_policy("full"), max_new_tokens=2)  # another cache
    llama(random_prompt(12), **with_cache(llama, cache), use_cache=True)
    with pytest.raises(PolicyError, match="empty caches"):
        SharedPrefill([cache, PolicyCache(make_policy("full"), llama)])
    assert torch.is_tensor(cache.layers[0].state.view()[0])


def test_members_with_equal_score_keys_score_each_layer_once(llama, monkeypatch):
    """h2o's cumulative attention does not depend on K: a budget grid (and the copies fidelity adds) score once per
    layer; snapkv's scores depend on its window, so two windows score twice. Tokens equal each method alone."""
    calls = []
    for method in (refreshkv.methods.h2o.H2O, refreshkv.methods.snapkv.SnapKV):
        original = method.score
        monkeypatch.setattr(
            method, "score", lambda self, *args, original=original: calls.append(self.name) or original(self, *args)
        )
    ids = random_prompt(40, seed=8)
    methods = [make_policy("h2o", budget=b) for b in (8, 16, 24)]
    methods += [make_policy("snapkv", budget=8, window=w) for w in (1, 2)]
    outs = refreshkv.generate_many(llama, ids, methods=["full", *methods], max_new_tokens=NEW, fidelity=True)
    layers = llama.config.num_hidden_layers
    assert calls.count("h2o") == layers and calls.count("snapkv") == 2 * layers
    for policy, out in zip(methods, outs[1:]):
        alone = refreshkv.generate(llama, ids, method=policy, max_new_tokens=NEW)
        assert out.tokens == alone.tokens, policy
