"""Eviction baselines: streamingllm, streamingllm++, h2o, pyramidkv (and snapkv's selection)."""

import math

import pytest
import torch
from conftest import random_prompt
from transformers import LlamaConfig

import refreshkv
from refreshkv import PolicyCache, PolicyError, make_policy
from refreshkv.methods.pyramidkv import pyramid_budgets

BASELINES = ["streamingllm", "streamingllm++", "h2o", "pyramidkv", "snapkv"]
SMALL_WINDOW = {"snapkv": {"window": 8}, "pyramidkv": {"window": 8}}


def run(model, ids, method, mask=None, **params):
    return refreshkv.generate(model, ids, mask, method=method, return_logits=True, **params)


def max_logit_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits))


def stores(out):
    return [layer.state.store for layer in out.cache.layers]


# -- equivalence with full attention when everything fits --------------------------------------------------------


@pytest.mark.parametrize("method", BASELINES)
def test_large_budget_equals_full(llama, method):
    ids = random_prompt(48, seed=3)
    full = run(llama, ids, "full", max_new_tokens=16)
    out = run(llama, ids, method, max_new_tokens=16, budget=64, **SMALL_WINDOW.get(method, {}))
    assert out.tokens == full.tokens
    assert max_logit_diff(out, full) < 1e-4


@pytest.mark.parametrize("method", ["streamingllm", "h2o", "pyramidkv"])
def test_large_budget_equals_full_qwen2(qwen2, method):
    ids = random_prompt(40, seed=4)
    full = run(qwen2, ids, "full", max_new_tokens=12)
    out = run(qwen2, ids, method, max_new_tokens=12, budget=500, **SMALL_WINDOW.get(method, {}))
    assert out.tokens == full.tokens
    assert max_logit_diff(out, full) < 1e-4


def test_streamingllm_pp_stride_one_equals_full(llama):
    ids = random_prompt(80, seed=5)
    full = run(llama, ids, "full", max_new_tokens=12)
    out = run(llama, ids, "streamingllm++", max_new_tokens=12, budget=8, stride=1)
    assert out.tokens == full.tokens
    assert max_logit_diff(out, full) < 1e-4
    assert out.stats()["full_step_fraction"] == 1.0
    assert out.stats()["kv_bytes_full"] == full.stats()["kv_bytes_full"]


def test_streamingllm_pp_without_full_steps_equals_streamingllm(llama):
    """Its partial step attends to exactly StreamingLLM's cache."""
    ids = random_prompt(60, seed=6)
    stream = run(llama, ids, "streamingllm", max_new_tokens=15, budget=12)
    plus = run(llama, ids, "streamingllm++", max_new_tokens=15, budget=12, stride=1000)
    assert plus.tokens == stream.tokens
    assert max_logit_diff(plus, stream) < 1e-4
    assert plus.stats()["full_step_fraction"] == 0.0
    every_third = run(llama, ids, "streamingllm++", max_new_tokens=15, budget=12, stride=3)
    assert every_third.stats()["full_step_fraction"] == pytest.approx(4 / 14, abs=1e-4)


# -- what is kept ----------------------------------------------------------------------------------------------------


def test_streamingllm_keeps_sinks_and_recent(llama):
    length, budget, new = 50, 12, 9
    out = run(llama, random_prompt(length), "streamingllm", max_new_tokens=new, budget=budget)
    last = length + new - 2  # position of the last token fed to the model
    expected = list(range(4)) + list(range(last - (budget - 4) + 1, last + 1))
    for store in stores(out):
        assert store.slots == budget
        assert store.positions.sort(dim=-1).values.tolist() == [[expected, expected]]


def test_streamingllm_prefill_and_padding(llama):
    ids = random_prompt(30, seed=7, batch=2)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    out = run(llama, ids, "streamingllm", mask=mask, max_new_tokens=1, budget=10, sinks=2)
    positions = stores(out)[0].positions.sort(dim=-1).values
    assert positions[0, 0].tolist() == [5, 6] + list(range(22, 30))
    assert positions[1, 1].tolist() == [0, 1] + list(range(22, 30))


def test_streamingllm_budget_below_sinks(llama):
    out = run(llama, random_prompt(20), "streamingllm", max_new_tokens=6, budget=2)
    assert all(torch.isfinite(logits).all() for logits in out.logits)
    last = 20 + 6 - 2
    assert stores(out)[0].positions.sort(dim=-1).values[0, 0].tolist() == [0, last]  # 1 sink + the current token


def _layer(policy, length, max_new_tokens=8):
    config = LlamaConfig(
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, attn_implementation="refreshkv"
    )
    cache = PolicyCache(policy, config, max_new_tokens)
    layer = cache.layers[0]
    layer.seen = length
    return cache, layer


def _qkv(length, seed=0, batch=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, length, 8, generator=generator) * 2 for heads in (4, 2, 2)]


def _probs(q, k, scaling):
    """Reference softmax attention (B, Hq, q, n) with GQA repeat and the queries at the end of the keys."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = q @ k.transpose(-1, -2) * scaling
    n, m = k.shape[2], q.shape[2]
    future = torch.arange(n)[None, :] > (torch.arange(n - m, n)[:, None])
    return logits.masked_fill(future, float("-inf")).softmax(-1)


def test_snapkv_selection_by_hand():
    policy = make_policy("snapkv", budget=7, window=4, kernel=1, pooling="centered")  # 3 chosen + the window
    q, k, v = _qkv(20, seed=1)
    cache, layer = _layer(policy, 20)
    cache.start(None, k)
    policy.prefill(layer, q, k, v, None, 0.35)
    scores = _probs(q[:, :, -4:], k, 0.35).mean(dim=2).view(1, 2, 2, 20).amax(dim=2)  # mean over window, max in group
    for head in range(2):
        top = scores[0, head, :16].topk(3).indices.sort().values.tolist()
        kept = layer.state.store.positions[0, head, : 3 + 4].tolist()
        assert kept == top + [16, 17, 18, 19]


def test_h2o_prefill_and_eviction_by_hand():
    policy = make_policy("h2o", budget=4)
    q, k, v = _qkv(10, seed=2)
    cache, layer = _layer(policy, 10)
    cache.start(None, k)
    policy.prefill(layer, q, k, v, None, 0.35)
    store, state = layer.state.store, layer.state
    assert store.slots == 5  # K kept + the newest token
    cumulative = _probs(q, k, 0.35).sum(dim=2).view(1, 2, 2, 10).amax(dim=2)  # every prompt query, causal
    for head in range(2):
        heavy = cumulative[0, head, :8].topk(2).indices.sort().values.tolist()
        assert store.positions[0, head, :4].tolist() == heavy + [8, 9]
        assert store.positions[0, head, 4].item() == -1

    # Step 1: the new token takes the empty slot; the output is attention over the 5 tokens; scores accumulate.
    q1, k1, v1 = _qkv(1, seed=3)
    before = state.scores.clone()
    layer.seen, cache.step = 11, 1
    out = policy.decode(layer, q1, k1, v1, 0.35)
    assert store.positions[0, :, 4].tolist() == [10, 10]
    keys = store.keys.repeat_interleave(2, dim=1)
    values = store.values.repeat_interleave(2, dim=1)
    probs = (q1 @ keys.transpose(-1, -2) * 0.35).softmax(-1)
    torch.testing.assert_close(out, (probs @ values).transpose(1, 2), atol=1e-5, rtol=1e-5)
    gained = probs.view(1, 2, 2, 5).amax(dim=2)
    torch.testing.assert_close(state.scores[..., :4], before[..., :4] + gained[..., :4])
    torch.testing.assert_close(state.scores[..., 4], gained[..., 4])

    # Step 2: the lowest cumulative score outside the recent window (now positions 9, 10) is evicted.
    state.scores.copy_(torch.tensor([[[0.5, 0.2, 0.3, 0.1, 0.05], [0.1, 0.3, 0.7, 0.01, 0.9]]]))
    layer.seen, cache.step = 12, 2
    policy.decode(layer, *_qkv(1, seed=4), 0.35)
    assert store.positions[0, 0, 1].item() == 11  # head 0: slot 1 (0.2); slots 3, 4 are lower but recent
    assert store.positions[0, 1, 0].item() == 11  # head 1: slot 0 (0.1)


def test_h2o_keeps_recent_window(llama):
    length, budget, new = 60, 10, 12
    out = run(llama, random_prompt(length), "h2o", max_new_tokens=new, budget=budget)
    last = length + new - 2
    for store in stores(out):
        assert store.slots == budget + 1
        for row in store.positions[0]:
            kept = set(row.tolist())
            assert len(kept) == budget + 1 and min(kept) >= 0
            assert set(range(last - 4, last + 1)) <= kept  # recent K/2 + the newest token


# -- pyramid budgets -------------------------------------------------------------------------------------------------


def test_pyramid_budgets_schedule():
    budgets = pyramid_budgets(32 * 8, 8)
    assert sum(budgets) == 256
    assert all(a > b for a, b in zip(budgets, budgets[1:]))
    assert budgets[-1] == math.floor(32 / 20) and budgets[0] >= 2 * 32 - 32 / 20 - 1
    assert pyramid_budgets(40, 4, beta=1) == [10, 10, 10, 10]
    assert pyramid_budgets(7, 5) == [3, 3, 1, 0, 0]
    capped = pyramid_budgets(300, 3, cap=120)
    assert sum(capped) == 300 and max(capped) <= 120 and capped == sorted(capped, reverse=True)
    assert pyramid_budgets(1000, 3, cap=50) == [50, 50, 50]
    for total in range(0, 200, 7):
        for layers in (1, 2, 5, 32):
            got = pyramid_budgets(total, layers, beta=3.5, cap=40)
            assert sum(got) == min(total, 40 * layers)
            assert got == sorted(got, reverse=True)


def test_pyramidkv_layer_stores(llama):
    length, budget, new, window = 200, 24, 4, 8
    out = run(llama, random_prompt(length), "pyramidkv", max_new_tokens=new, budget=budget, window=window)
    sizes = [store.slots - window - new for store in stores(out)]  # the budget counts the window in every layer
    assert sizes == pyramid_budgets(3 * (budget - window), 3) and sum(sizes) == 3 * (budget - window)
    assert sizes[0] > sizes[1] > sizes[2]


# -- memory --------------------------------------------------------------------------------------------------------


def test_held_bytes(llama):
    ids = random_prompt(400, seed=8)
    full = run(llama, ids, "full", max_new_tokens=8).stats()["kv_bytes_full"]
    for method in ["snapkv", "streamingllm", "h2o", "pyramidkv"]:
        held = run(llama, ids, method, max_new_tokens=8, budget=32, **SMALL_WINDOW.get(method, {}))
        assert held.stats()["kv_bytes_full"] <= full / 6, method
    plus = run(llama, ids, "streamingllm++", max_new_tokens=8, budget=32)
    assert plus.stats()["kv_bytes_full"] == full
    assert plus.stats()["kv_bytes_attended_mean"] < full / 6


def test_short_prompt_large_budget(llama):
    ids = random_prompt(10, seed=9)
    full = run(llama, ids, "full", max_new_tokens=5)
    for method in ["streamingllm", "streamingllm++", "h2o"]:
        out = run(llama, ids, method, max_new_tokens=5, budget=1024)
        assert out.tokens == full.tokens and all(torch.isfinite(x).all() for x in out.logits)
        assert out.stats()["kv_bytes_full"] <= full.stats()["kv_bytes_full"]


def test_budget_ratio(llama):
    out = run(llama, random_prompt(64), "streamingllm", max_new_tokens=3, budget_ratio=0.25)
    assert out.cache.budget == 16 and stores(out)[0].slots == 16


# -- batches ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method,params,short_length",
    [
        ("streamingllm", {}, 30),
        ("streamingllm", {}, 10),  # shorter than the budget: empty slots until decoded tokens fill them
        ("h2o", {}, 30),
        ("h2o", {}, 10),
        ("streamingllm++", {"stride": 4}, 30),
        ("streamingllm++", {"stride": 4}, 10),
        ("pyramidkv", {"window": 8}, 30),
    ],
)
def test_batch_equals_rows(llama, method, params, short_length):
    budget = 8 if method == "pyramidkv" else 16  # pyramidkv: no layer budget capped by the short row's prompt
    short, long = random_prompt(short_length, seed=10), random_prompt(45, seed=11)
    pad = 45 - short_length
    ids = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), short], dim=1), long])
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    batch = run(llama, ids, method, mask=mask, max_new_tokens=14, budget=budget, **params)
    for row, prompt in enumerate([short, long]):
        alone = run(llama, prompt, method, max_new_tokens=14, budget=budget, **params)
        assert batch.tokens[row] == alone.tokens[0], (method, row)
        diff = max((b[row] - a[0]).abs().max().item() for b, a in zip(batch.logits, alone.logits))
        assert diff < 1e-4


# -- bad input -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method,params,words",
    [
        ("streamingllm", {"budget": 0}, "budget"),
        ("h2o", {"budget": -3}, "budget"),
        ("streamingllm++", {"budget_ratio": 1.5}, "budget_ratio"),
        ("pyramidkv", {"budget": 8, "budget_ratio": 0.5}, "budget_ratio"),
        ("pyramidkv", {"kernel": 4}, "odd"),
        ("pyramidkv", {"kernel": 0}, "kernel"),
        ("pyramidkv", {"beta": 0.5}, "beta"),
        ("h2o", {"aggregation": "sum"}, "max, mean, first"),
        ("streamingllm", {"sinks": -1}, "sinks"),
        ("streamingllm++", {"stride": 0}, "stride"),
        ("streamingllm", {"window": 8}, "budget, budget_ratio, compress_every, sinks"),
        ("h2o", {"window": 7}, "budget, budget_ratio, compress_every, aggregation"),
        ("streamingllm++", {"threshold": 0.5}, "sinks, stride"),
    ],
)
def test_bad_parameters(llama, method, params, words):
    with pytest.raises(PolicyError) as error:
        make_policy(method, **params)
    assert words in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(PolicyError):
        refreshkv.generate(llama, random_prompt(20), method=method, max_new_tokens=2, **params)


# refreshkv's window slides with decoding, so a window longer than the prompt is accepted (test_core.py)
@pytest.mark.parametrize("method", ["snapkv", "pyramidkv", "dynamickv"])
def test_window_larger_than_prompt(llama, method):
    with pytest.raises(PolicyError, match="window") as error:
        refreshkv.generate(llama, random_prompt(12), method=method, max_new_tokens=2, window=16)
    assert "\n" not in str(error.value)


# Baselines at their best: pyramidkv and dynamickv select as snapkv does by default (docs/methods.md); `--preset
# paper` gives each paper's own settings.
@pytest.mark.parametrize(
    "method, paper",
    [
        ("pyramidkv", {"window": 32, "kernel": 7, "pooling": "centered", "aggregation": "max", "beta": 20.0}),
        ("dynamickv", {"window": 16, "kernel": 7, "pooling": "centered", "aggregation": "max", "r_max": 5.0}),
    ],
)
def test_the_paper_preset_gives_the_papers_settings_and_the_defaults_are_snapkvs(method, paper):
    preset = make_policy(method, preset="paper")
    assert {name: getattr(preset, name) for name in paper} == paper
    default, snapkv = make_policy(method), make_policy("snapkv")
    selection = ("window", "kernel", "pooling", "aggregation")
    assert [getattr(default, name) for name in selection] == [getattr(snapkv, name) for name in selection]
    assert (default.window, default.kernel, default.pooling) == (32, 7, "span")
    assert make_policy(method, preset="paper", window=8).window == 8  # a parameter beside the preset overrides it


def test_h2o_has_no_preset_its_defaults_are_its_papers():
    h2o = make_policy("h2o")
    assert h2o.presets == {} and h2o.aggregation == "max"
    with pytest.raises(PolicyError, match="has no preset 'paper'"):
        make_policy("h2o", preset="paper")
