"""What each of the newer training-free methods promises beyond the method contract (test_method_contract.py covers
every registered method: keeping everything equals `full`, padded batches, bytes, bfloat16, one policy object)."""

from types import SimpleNamespace

import pytest
import torch
from conftest import random_prompt, tiny_model

import refreshkv
from refreshkv import make_policy
from refreshkv.core.policy import PolicyError


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=3, seed=7)


def generate(model, ids, name, new=6, **params):
    return refreshkv.generate(model, ids, method=name, max_new_tokens=new, eos_token_id=[], **params)


def held_per_head(out) -> list[torch.Tensor]:
    """Per layer, (B, Hkv) real tokens held, after the prompt (nothing decoded: max_new_tokens 1)."""
    return [(layer.state.kept(out.cache.pads) >= 0).sum(-1) for layer in out.cache.layers]


@pytest.mark.parametrize("name", ["adakv", "defensivekv"])
def test_head_adaptive_budgets_share_the_layers_total(model, name):
    budget, window = 12, 4
    out = generate(model, random_prompt(60, seed=1), name, new=1, budget=budget, window=window)
    for held in held_per_head(out):
        assert int(held.sum()) == 2 * budget  # 2 KV heads: the layer holds what snapkv's would
        assert int(held.min()) >= window + int(0.2 * (budget - window))  # the safeguard and the window
    assert any(len(set(held[0].tolist())) > 1 for held in held_per_head(out))  # heads do differ somewhere


def test_adakv_with_alpha_one_is_snapkv(model):
    ids = random_prompt(50, seed=2)
    snap = generate(model, ids, "snapkv", budget=12, window=4, pooling="centered")
    ada = generate(model, ids, "adakv", budget=12, window=4, alpha=1.0, pooling="centered")
    assert ada.tokens == snap.tokens
    for a, s in zip(ada.cache.layers, snap.cache.layers):
        assert torch.equal(a.state.kept(None).sort(-1).values, s.state.kept(None).sort(-1).values)


def test_defensive_aggregation_is_the_worst_case_floored_at_the_mean():
    from refreshkv.core.attention_math import attention_probs

    torch.manual_seed(0)
    query, key = torch.randn(1, 2, 20, 8), torch.randn(1, 1, 20, 8)
    policy = make_policy("defensivekv", window=4, kernel=1, pooling="centered")
    scores = policy.score(SimpleNamespace(prompt_spans=None), query, key, 8**-0.5, None)
    worst = attention_probs(query[:, :, -4:], key, 8**-0.5, causal_tail=True).amax(dim=(2, 3))
    floor = worst[..., :16].mean(-1, keepdim=True)
    assert torch.allclose(scores, worst.clamp(min=floor))
    assert bool((scores[..., :16] >= floor).all()) and bool((scores == floor).any())


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("adakv", {"alpha": 1.5}, "alpha must be a number in [0, 1]"),
        ("defensivekv", {"alpha": -0.1}, "alpha must be a number in [0, 1]"),
        ("adakv", {"alpha": "x"}, "alpha must be a number in [0, 1]"),
    ],
)
def test_bad_parameters_are_one_line(name, params, message):
    with pytest.raises(PolicyError) as error:
        make_policy(name, **params)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_think_stores_the_kept_channels_only_and_keeps_snapkvs_tokens(model):
    ids = random_prompt(50, seed=3)
    snap = generate(model, ids, "snapkv", new=1, budget=12, window=4)
    thin = generate(model, ids, "think", new=1, budget=12, window=4, prune_ratio=0.5)
    for s, t in zip(snap.cache.layers, thin.cache.layers):
        held = s.state.kept(None).sort(-1).values
        assert torch.equal(t.state.kept(None).sort(-1).values, held[..., -12:])  # snapkv has a slot to spare
        assert t.state.keys.shape[-1] == 8 and t.state.channels.shape == (1, 2, 8)  # 16 channels, half kept
        decoded = t.state.decoded.nbytes()  # room for the one announced token, every channel
        assert t.state.nbytes() - decoded == 12 * 2 * (8 + 16) * 4  # pruned keys, whole values: 12 tokens, 2 heads
        assert decoded == 1 * 2 * (16 + 16) * 4


def test_think_keeps_the_channels_carrying_the_windows_logits():
    policy = make_policy("think", window=2, prune_ratio=0.5)
    window = torch.ones(1, 2, 2, 4)
    window[..., 1] = 3.0  # queries load channel 1 (both query heads of the one KV head)
    keys = torch.ones(1, 1, 5, 4)
    keys[..., 2] = 10.0  # keys load channel 2: the products rank 2, then 1; 0 and 3 go
    assert policy.kept_channels(window, keys, torch.ones(1, 1, 5, dtype=torch.bool)).tolist() == [[[1, 2]]]


@pytest.mark.parametrize(
    "params, message",
    [
        ({"prune_ratio": 1.0}, "prune_ratio must be a number in [0, 1)"),
        ({"token_method": "h2o"}, "unknown token_method 'h2o'; choose from: snapkv, pyramidkv"),
        ({"budget": 8}, "budget (8) must hold the observation window (32 tokens)"),
        ({"compress_every": 4}, "method 'think' cannot compress during decoding"),
    ],
)
def test_think_refuses_bad_parameters_in_one_line(params, message):
    with pytest.raises(PolicyError) as error:
        make_policy("think", **params)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_cake_shares_the_total_by_layer_preference(model):
    budget, window = 12, 4
    out = generate(model, random_prompt(60, seed=4), "cake", new=1, budget=budget, window=window)
    layers = out.cache.layers
    selected = [int(layer.state.allocated) for layer in layers]
    assert sum(selected) == len(layers) * (budget - window)  # the whole selected budget, shared
    for layer, count in zip(layers, selected):
        assert bool(((layer.state.kept(None) >= 0).sum(-1) == count + window).all())  # every head: share + window
    preference = torch.cat([layer.state.preference for layer in layers])
    order = preference.argsort(descending=True).tolist()
    assert [selected[i] for i in order] == sorted(selected, reverse=True)  # more preference, more tokens


def test_cake_preference_is_dispersion_times_shift():
    policy = make_policy("cake", window=2, tau1=0.5, tau2=2.0)
    probs = torch.zeros(1, 1, 1, 2, 6)
    probs[..., 0, :4] = torch.tensor([0.5, 0.5, 0.0, 0.0])  # first query: two tokens
    probs[..., 1, :4] = torch.tensor([0.0, 0.0, 0.5, 0.5])  # second query: the other two
    share = torch.full((4,), 0.25, dtype=torch.float64)
    dispersion = -(share * share.log()).sum()
    shift = torch.tensor(4 * 0.0625, dtype=torch.float64)  # each token's variance over the two queries: 0.25^2
    assert torch.allclose(policy.preference(probs), dispersion**2 * shift**0.5)


def test_cake_span_pooling_raises_a_prompt_word_to_its_best_token():
    """The prompt's indicator (mean + gamma x variance over the window's queries, kernel 1 here) spread over its
    words; over held tokens (`indicator` alone, as compression scores them), each keeps its own."""
    from refreshkv.core.attention_math import attention_probs

    torch.manual_seed(3)
    query, key = torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    probs = attention_probs(query[:, :, -2:], key, 8**-0.5, causal_tail=True)  # the window: the last 2 queries
    own = probs[0, 0, 0].mean(0) + 3.0 * probs[0, 0, 0].var(0, unbiased=False)
    spans = torch.tensor([[0, 1, 1, 2, 2]])  # three words: token 0, tokens 1-2, tokens 3-4
    policy = make_policy("cake", window=2, kernel=1, gamma=3.0, pooling="span")
    words = policy.score(SimpleNamespace(prompt_spans=spans), query, key, 8**-0.5, None)
    expected = torch.stack([own[0], own[1:3].max(), own[1:3].max(), own[3:].max(), own[3:].max()])
    assert torch.allclose(words[0, 0], expected)
    assert torch.allclose(policy.indicator(probs)[0, 0], own)


@pytest.mark.parametrize(
    "params, message",
    [
        ({"tau1": 0}, "tau1 must be a number > 0"),
        ({"tau2": "x"}, "tau2 must be a number > 0"),
        ({"gamma": -1.0}, "gamma must be a number >= 0"),
    ],
)
def test_cake_refuses_bad_parameters_in_one_line(params, message):
    with pytest.raises(PolicyError) as error:
        make_policy("cake", **params)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_kvmerger_merges_a_runs_evicted_tokens_into_its_kept_pivot():
    from refreshkv.methods.kvmerger import merge_into_pivots, merging_sets

    keys = torch.tensor([[1.0, 0.0], [1.0, 0.1], [1.0, 0.3], [0.0, 1.0], [0.1, 1.0]]).view(1, 1, 5, 2)
    values = torch.arange(10.0).view(1, 1, 5, 2)
    sets = merging_sets(keys, None, 0.9)
    assert sets[0, 0].tolist() == [0, 0, 0, 1, 1]  # two runs of similar keys
    scores = torch.tensor([0.1, 0.5, 0.2, 0.3, 0.05]).view(1, 1, 5)
    kept = torch.tensor([False, True, False, False, True]).view(1, 1, 5)  # the first run's pivot (1) is kept
    merged_keys, merged_values = merge_into_pivots(keys, values, sets, scores, kept, None)
    distance = torch.tensor([0.01, 0.04])  # tokens 0 and 2 to the pivot
    weight = torch.exp(-distance / (2 * distance.mean()))
    expected = (values[0, 0, 1] + weight[0] * values[0, 0, 0] + weight[1] * values[0, 0, 2]) / (1 + weight.sum())
    assert torch.allclose(merged_values[0, 0, 1], expected)
    assert torch.equal(merged_values[0, 0, 4], values[0, 0, 4])  # the second run's pivot (3) is evicted: dropped
    assert torch.equal(merged_keys[0, 0, [0, 2, 3, 4]], keys[0, 0, [0, 2, 3, 4]])


def test_kvmerger_refuses_a_similarity_outside_a_cosines_range():
    with pytest.raises(PolicyError, match=r"similarity must be a cosine in \[-1, 1\], got 1.5"):
        make_policy("kvmerger", similarity=1.5)


def test_mikv_leaves_no_token_behind_and_holds_less(model):
    ids = random_prompt(50, seed=5)
    full = generate(model, ids, "full", new=4, return_logits=True)
    out = generate(model, ids, "mikv", new=4, budget=10, window=4, low_bits=8, return_logits=True)
    for layer in out.cache.layers:
        held = layer.state.kept(None)
        assert torch.equal(held[held >= 0].view(2, -1).sort(-1).values[0], torch.arange(50 + 3))  # every token
    assert sum(out.cache.nbytes_per_layer()) < 0.75 * sum(full.cache.nbytes_per_layer())
    assert max((a - b).abs().max().item() for a, b in zip(out.logits, full.logits)) < 0.05  # 8 bits: close


@pytest.mark.parametrize(
    "params, message",
    [
        ({"low_bits": 3}, "low_bits must be one of 8, 4, 2"),
        ({"group_size": 0}, "group_size must be an integer >= 1"),
        ({"compress_every": 2}, "method 'mikv' cannot compress during decoding"),
    ],
)
def test_mikv_refuses_bad_parameters_in_one_line(params, message):
    with pytest.raises(PolicyError) as error:
        make_policy("mikv", **params)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_dapq_moves_the_window_by_ropes_own_rotation():
    from refreshkv.core.rope import rotate_by, unrotate

    inv_freq = 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16)
    content = torch.randn(3, 16)
    at_five = rotate_by(content, 5, inv_freq)  # a query at position 5
    moved = rotate_by(at_five, 7, inv_freq)
    assert torch.allclose(unrotate(moved, torch.full((3,), 12), inv_freq), content, atol=1e-5)  # now at 12


def test_dapq_scores_differ_from_snapkvs_only_by_the_queries_position(model):
    ids = random_prompt(50, seed=6)
    dapq = generate(model, ids, "dapq", new=1, budget=12, window=4)
    snap = generate(model, ids, "snapkv", new=1, budget=12, window=4, pooling="centered")
    kept = [layer.state.kept(None).sort(-1).values[..., -12:] for layer in dapq.cache.layers]
    assert all(bool((k[..., -4:] == torch.arange(46, 50)).all()) for k in kept)  # the window is kept, as snapkv's
    assert any(
        not torch.equal(k, s.state.kept(None).sort(-1).values[..., -12:]) for k, s in zip(kept, snap.cache.layers)
    )


def test_fasa_with_every_chunk_is_the_oracle_and_reads_less_with_fewer(model):
    ids = random_prompt(50, seed=7)
    oracle = generate(model, ids, "oracle", new=6, budget=10)
    every = generate(model, ids, "fasa", new=6, budget=10, window=4, chunk_ratio=1.0)
    few = generate(model, ids, "fasa", new=6, budget=10, window=4, chunk_ratio=0.25)
    assert every.tokens == oracle.tokens  # all chunks: the exact ranking
    assert few.cache.attended_bytes_mean() < every.cache.attended_bytes_mean() < oracle.cache.attended_bytes_mean()
    for layer in few.cache.layers:
        assert layer.state.dims.shape == (1, 2, 4)  # 2 of the 8 chunks of a 16-dimension head, both halves


def test_fasa_calibration_finds_the_chunk_that_carries_the_logits():
    from refreshkv.methods.fasa import chunk_agreement

    torch.manual_seed(1)
    window, key = torch.randn(1, 2, 4, 8) * 0.01, torch.randn(1, 1, 30, 8) * 0.01
    window[..., 1], window[..., 5] = 3.0, 2.0  # chunk 1 (dims 1 and 5) dominates every logit
    key[..., 1], key[..., 5] = torch.randn(30), torch.randn(30)
    assert int(chunk_agreement(window, key, None)[0, 0].argmax()) == 1


@pytest.mark.parametrize(
    "params, message",
    [({"chunk_ratio": 0}, "chunk_ratio must be a number in (0, 1]"), ({"compress_every": 3}, "cannot compress")],
)
def test_fasa_refuses_bad_parameters_in_one_line(params, message):
    with pytest.raises(PolicyError) as error:
        make_policy("fasa", **params)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_lazyeviction_tracks_recurrence_and_evicts_only_every_w_steps(model):
    ids = random_prompt(40, seed=8)
    out = generate(model, ids, "lazyeviction", new=30, budget=12, window=4, compress_every=8)
    for layer in out.cache.layers:
        state = layer.state
        assert state.longest_interval.shape[-1] >= layer.seen  # a record for every position so far
        assert int(state.longest_interval.max()) > 0  # some token came back after a gap
        held = int((state.kept(None) >= 0).sum(-1).max())
        assert held == 12 + (29 % 8)  # back to K at step 24, then 5 decoded tokens appended since


def test_d2o_merges_an_evicted_token_into_its_nearest_kept_key_above_the_mean_best_similarity():
    from refreshkv.methods.d2o import merge_evicted

    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.1], [0.6, 0.8], [-1.0, 0.0]]).view(1, 1, 5, 2)
    values = torch.arange(10.0).view(1, 1, 5, 2)
    kept = torch.tensor([True, True, False, False, False]).view(1, 1, 5)
    real = torch.ones_like(kept)
    merged_keys, merged_values, target = merge_evicted(keys, values, kept, real)
    # best cosines of the evicted tokens: 0.995 (to 0), 0.8 (to 1), 0.0: the threshold is their mean, 0.598
    assert target[0, 0].tolist() == [-1, -1, 0, 1, -1]  # token 4 is below it: dropped
    best = torch.tensor([1.0, 0.1]).div(torch.tensor([1.0, 0.1]).norm())[0]
    for kept_at, evicted_at, cosine in ((0, 2, best), (1, 3, torch.tensor(0.8))):
        weight, own = cosine.exp(), torch.tensor(1.0).exp()  # softmax weights, the kept token's similarity 1
        for merged, tensor in ((merged_values, values), (merged_keys, keys)):
            expected = (own * tensor[0, 0, kept_at] + weight * tensor[0, 0, evicted_at]) / (own + weight)
            assert torch.allclose(merged[0, 0, kept_at], expected)
    assert torch.equal(merged_values[0, 0, 2:], values[0, 0, 2:])  # evicted slots untouched (not held anyway)


def test_d2o_merges_nothing_when_nothing_is_evicted_and_skips_pads():
    from refreshkv.methods.d2o import merge_evicted

    keys, values = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    kept = torch.ones(1, 2, 6, dtype=torch.bool)
    assert merge_evicted(keys, values, kept, kept)[1] is values
    real = torch.tensor([False, False, True, True, True, True]).expand(1, 2, 6)
    kept = real & torch.tensor([False, False, True, False, False, True])
    _, _, target = merge_evicted(keys, values, kept, real)
    assert bool((target[..., :2] == -1).all())  # pads are never merged


def test_d2o_layer_budgets_give_the_denser_layers_more():
    policy = make_policy("d2o", temperature=1.0)
    density = torch.tensor([[0.01, 0.02, 0.04]])  # the first layer's attention is the most uniform
    budgets = policy.layer_budgets(density, torch.tensor([60]), 12)
    # 6 each, the other 18 shared as 1/std = 100 : 50 : 25 -> 10.29, 5.14, 2.57 (largest remainder to the last)
    assert budgets.tolist() == [[16, 11, 9]]
    capped = policy.layer_budgets(density, torch.tensor([14]), 12)
    # the first layer capped at the 14 tokens there are; its excess shared by the others 50 : 25 (6.67, 3.33)
    assert capped.tolist() == [[14, 13, 9]]
    sharp = make_policy("d2o", temperature=1e-3).layer_budgets(density, torch.tensor([60]), 12)
    assert sharp.tolist() == [[24, 6, 6]]  # all 18 shared tokens to the densest layer


def test_d2o_keeps_each_layers_share_in_every_head(model, monkeypatch):
    from refreshkv.methods import d2o

    spreads = iter([0.04, 0.01, 0.02])  # one per layer, bottom first
    monkeypatch.setattr(d2o, "attention_spread", lambda scores, valid: torch.tensor([next(spreads)]))
    out = generate(model, random_prompt(60, seed=9), "d2o", new=1, budget=12)
    budgets = [int(layer.state.allocated) for layer in out.cache.layers]
    assert budgets == [9, 16, 11]
    for held, budget in zip(held_per_head(out), budgets):
        assert held.tolist() == [[budget, budget]]
    for layer, budget in zip(out.cache.layers, budgets):  # H2O's recent half of the layer's budget
        recent = budget - budget // 2
        assert set(range(60 - recent, 60)) <= set(layer.state.kept(None)[0, 0].tolist())


def test_d2o_compresses_back_to_each_layers_budget(model):
    out = generate(model, random_prompt(40, seed=10), "d2o", new=20, budget=12, compress_every=4)
    for layer in out.cache.layers:
        held = (layer.state.kept(None) >= 0).sum(-1)
        assert bool((held == int(layer.state.allocated) + 19 % 4).all())  # back to its budget at step 16, 3 since


@pytest.mark.parametrize(
    "params, message",
    [
        ({"temperature": 0}, "temperature must be a number > 0"),
        ({"temperature": "x"}, "temperature must be a number > 0"),
        ({"aggregation": "median"}, "aggregation"),
        ({"budget": 0}, "budget"),
    ],
)
def test_d2o_refuses_bad_parameters_in_one_line(params, message):
    with pytest.raises(PolicyError) as error:
        make_policy("d2o", **params)
    assert message in str(error.value) and "\n" not in str(error.value)
