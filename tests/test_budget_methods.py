"""dynamickv and refreekv (methods with per-layer / per-head budgets) and budget_report."""

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import random_prompt, tiny_model

from refreshkv import PolicyError, generate, make_policy
from refreshkv.measure.budget_report import budget_report, budget_table
from refreshkv.methods.dynamickv import allocate, apportion, layer_counts
from refreshkv.methods.refreekv import kept_counts, position_ranking


@pytest.fixture(scope="module")
def deep():
    return tiny_model("llama", layers=5, seed=3)


def max_logit_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits))


def padded_batch(rows):
    length = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, length - len(r) :] = r
        mask[i, length - len(r) :] = 1
    return ids, mask


# ---------------------------------------------------------------- refreekv


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_refreekv_threshold_zero_equals_full(family):
    model = tiny_model(family, layers=4)
    ids = random_prompt(96)
    full = generate(model, ids, method="full", max_new_tokens=6, return_logits=True)
    out = generate(
        model,
        ids,
        method="refreekv",
        threshold=0.0,
        max_new_tokens=6,
        return_logits=True,
    )
    assert out.tokens == full.tokens
    assert max_logit_diff(out, full) < 1e-4
    assert budget_report(out.cache)["budget_ratio"] == 1.0


def test_refreekv_ratio_monotone_in_threshold_and_bottom_layers_whole(deep):
    ids = random_prompt(160)
    ratios = []
    for t in [0.0, 0.001, 0.01, 0.05, 0.1, 0.3, 0.6, 0.9]:
        report = budget_report(generate(deep, ids, method="refreekv", threshold=t, max_new_tokens=1).cache)
        assert report["budget_per_layer"][:2] == [
            160.0,
            160.0,
        ]  # Appendix B: first two layers kept whole
        ratios.append(report["budget_ratio"])
    assert all(b <= a for a, b in itertools.pairwise(ratios))
    assert ratios[0] == 1.0 and ratios[-1] < 0.6
    report = budget_report(generate(deep, ids, method="refreekv", threshold=0.3, keep_layers=0, max_new_tokens=1).cache)
    assert report["budget_per_layer"][0] < 160


def test_position_ranking():
    assert position_ranking(8, 2, None, "cpu").tolist() == [[0, 1, 7, 6, 5, 4, 3, 2]]
    pads = torch.tensor([0, 3, 7])
    assert position_ranking(8, 2, pads, "cpu").tolist() == [
        [0, 1, 7, 6, 5, 4, 3, 2],
        [3, 4, 7, 6, 5, 0, 1, 2],  # pads ranked last
        [7, 0, 1, 2, 3, 4, 5, 6],
    ]


def naive_prune_count(ranked, t):
    """Eq. 1 / 3 literally: 1-based index of the first ranked position with 1 - ||A~_i|| / ||A|| <= T."""
    total = math.sqrt(sum(x * x for x in ranked))
    for i in range(1, len(ranked) + 1):
        if 1 - math.sqrt(sum(x * x for x in ranked[:i])) / total <= t:
            return i
    return len(ranked)


def test_kept_counts_on_hand_made_rows():
    row = torch.tensor([0.5, 0.1, 0.3, 0.05, 0.05, 0.0, 0.0, 0.0])
    # squares .25 .01 .09 .0025 .0025 (sum .355): the loss 1 - sqrt(C_i / .355) is .161, .144, .0071 after 1, 2, 3
    assert kept_counts(row.square(), 0.01).item() == 3
    assert kept_counts(row.square(), 0.15).item() == 2
    assert kept_counts(row.square(), 0.2).item() == 1
    assert kept_counts(row.square(), 0.5).item() == 1
    assert kept_counts(row.square(), 0.0).item() == 8
    generator = torch.Generator().manual_seed(0)
    rows = torch.rand(20, 30, generator=generator) ** 4
    for t in [0.001, 0.01, 0.05, 0.2]:
        counts = kept_counts(rows.square(), t)
        assert counts.tolist() == [naive_prune_count(r.tolist(), t) for r in rows]


def fake_layer(length, layer_idx=2, pads=None):
    return SimpleNamespace(layer_idx=layer_idx, seen=length, pads=pads)  # the MethodLayer members refreekv reads


def test_refreekv_select_on_hand_made_attention():
    policy = make_policy("refreekv", threshold=0.12)
    # uniform attention of the last query: keep c = ceil(n (1 - T)^2) ranked positions = 78 of 100
    n = 100
    query, key = torch.zeros(1, 1, n, 4), torch.randn(1, 1, n, 4)
    index, _ = policy.select(fake_layer(n), query, key, 1.0, None)
    assert index[0, 0].tolist() == [0, 1, 2, 3] + list(range(26, 100))
    # one strongly attended middle position pulls the kept prefix of the ranking down to it
    n = 50
    query, key = torch.zeros(1, 1, n, 4), torch.zeros(1, 1, n, 4)
    query[..., 0], key[0, 0, 10, 0] = 1.0, 10.0
    index, _ = make_policy("refreekv", threshold=0.01).select(fake_layer(n), query, key, 1.0, None)
    assert index[0, 0].tolist() == [0, 1, 2, 3] + list(range(10, 50))
    # bottom layers keep everything
    index, _ = policy.select(fake_layer(n, layer_idx=1), query, key, 1.0, None)
    assert index[0, 0].tolist() == list(range(n))


def test_refreekv_gqa_reductions():
    n = 60
    query, key = torch.zeros(1, 2, n, 4), torch.zeros(1, 1, n, 4)
    query[0, 1, :, 0] = 1.0
    key[0, 0, 40, 0] = 12.0  # query head 1 looks at position 40, query head 0 is uniform
    counts = {}
    for how in ("norm", "max"):
        index, _ = make_policy("refreekv", threshold=0.05, aggregation=how).select(fake_layer(n), query, key, 1.0, None)
        counts[how] = int((index >= 0).sum())
    uniform = math.ceil(n * 0.95**2)  # head 0 alone
    focused = 4 + (n - 1 - 40) + 1  # head 1 alone: up to position 40 in the ranking
    assert counts["max"] == max(uniform, focused)
    assert focused <= counts["norm"] <= counts["max"]


def test_refreekv_padded_batch_matches_single_rows(deep):
    rows = [random_prompt(120, seed=5)[0], random_prompt(80, seed=6)[0]]
    ids, mask = padded_batch(rows)
    batch = generate(deep, ids, mask, method="refreekv", threshold=0.1, max_new_tokens=5)
    report = budget_report(batch.cache)
    assert report["prompt_tokens"] == [120, 80]
    for i, row in enumerate(rows):
        single = generate(deep, row[None], method="refreekv", threshold=0.1, max_new_tokens=5)
        assert batch.tokens[i] == single.tokens[0]
        single_report = budget_report(single.cache)
        assert single_report["budget_per_layer"][:2] == [len(row)] * 2


def test_refreekv_memory_and_exact_attention_over_kept_keys(deep):
    ids = random_prompt(200)
    full = generate(deep, ids, method="full", max_new_tokens=4)
    captured = {}
    policy = make_policy("refreekv", threshold=0.4)
    prefill, decode = policy.prefill, policy.decode

    def spy_prefill(layer, query, key, value, mask, scaling):
        if layer.layer_idx == 3:
            captured["prompt"] = (key.clone(), value.clone())
        return prefill(layer, query, key, value, mask, scaling)

    def spy_decode(layer, query, key, value, scaling):
        output = decode(layer, query, key, value, scaling)
        if layer.layer_idx == 3 and "step" not in captured:
            store = layer.state.store
            captured["step"] = (
                query.clone(),
                output.clone(),
                store.keys.clone(),
                store.values.clone(),
                store.positions.clone(),
                key.clone(),
                scaling,
            )
        return output

    object.__setattr__(policy, "prefill", spy_prefill)
    object.__setattr__(policy, "decode", spy_decode)
    out = generate(deep, ids, method=policy, max_new_tokens=4)
    per_layer = budget_report(out.cache)["budget_per_head"]
    assert any(len(set(heads)) > 1 for heads in per_layer)  # ragged: heads of a layer keep different counts
    for layer, heads in zip(out.cache.layers, per_layer):
        assert layer.state.store.slots == max(heads) + 4  # padded only up to the largest head (+ decoded tokens)
    assert out.stats()["kv_bytes_full"] < 0.8 * full.stats()["kv_bytes_full"]

    query, output, keys, values, positions, new_key, scaling = captured["step"]
    prompt_keys, prompt_values = captured["prompt"]
    groups = query.shape[1] // keys.shape[1]
    for h in range(query.shape[1]):
        g = h // groups
        valid = positions[0, g] >= 0
        pos = positions[0, g][valid]
        prompt_part = pos < prompt_keys.shape[2]
        # the kept prompt keys are the layer's original keys at their positions
        torch.testing.assert_close(keys[0, g][valid][prompt_part], prompt_keys[0, g, pos[prompt_part]])
        torch.testing.assert_close(values[0, g][valid][prompt_part], prompt_values[0, g, pos[prompt_part]])
        decoded = pos == prompt_keys.shape[2]
        assert int(decoded.sum()) == 1  # the decoded token is in the cache
        torch.testing.assert_close(keys[0, g][valid][decoded][0], new_key[0, g, 0])
        probs = ((keys[0, g][valid] @ query[0, h, 0]) * scaling).softmax(-1)
        manual = probs @ values[0, g][valid]
        torch.testing.assert_close(output[0, 0, h], manual, atol=1e-5, rtol=1e-5)


def test_refreekv_bad_input_and_short_prompts(llama):
    for bad in (-0.1, 1.0, 1.5, True, "x"):
        with pytest.raises(PolicyError, match="threshold"):
            make_policy("refreekv", threshold=bad)
    with pytest.raises(PolicyError, match="no parameter budget"):
        make_policy("refreekv", budget=8)
    with pytest.raises(PolicyError, match="sink"):
        make_policy("refreekv", sink=0)
    with pytest.raises(PolicyError, match="aggregation"):
        make_policy("refreekv", aggregation="mean")
    with pytest.raises(PolicyError) as error:
        generate(llama, random_prompt(3), method="refreekv", max_new_tokens=2)
    assert "sink (4) is larger than the prompt (3 tokens)" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(PolicyError, match="rows"):
        generate(llama, random_prompt(8), method="refreekv", rows=9, max_new_tokens=2)
    # a prompt of sink tokens keeps everything; a padded row shorter than sink is refused like the row alone
    out = generate(llama, random_prompt(4), method="refreekv", threshold=0.9, max_new_tokens=2)
    assert budget_report(out.cache)["budget_ratio"] == 1.0
    ids, mask = padded_batch([random_prompt(40)[0], random_prompt(3, seed=2)[0]])
    with pytest.raises(PolicyError, match="sink"):
        generate(llama, ids, mask, method="refreekv", threshold=0.9, max_new_tokens=2)


# ---------------------------------------------------------------- dynamickv


def test_layer_counts_and_allocation_follow_eq_4_to_6():
    scores = [
        torch.tensor([[[0.9, 0.1, 0.0, 0.0]]]),
        torch.tensor([[[0.5, 0.4, 0.3, 0.2]]]),
    ]
    assert layer_counts(scores, 2).tolist() == [[1, 3]]  # top-4 of all entries: .9 | .5 .4 .3
    scores[1][0, 0, 3] = float("-inf")  # a pad is never counted
    assert layer_counts(scores, 4).tolist() == [[4, 3]]
    # Eq. 5: Z = int(B^l t / max) = [100, 33]; Eq. 6: Z * 40 / 133 = [30.08, 9.92] -> [30, 10], sum 40
    caps = torch.tensor([[100, 100]])
    assert allocate(torch.tensor([[3, 1]]), 100, 40, caps).tolist() == [[30, 10]]
    # Z = [20, 6, 0, 13], Z' = Z * 40 / 39 = [20.5, 6.2, 0, 13.3]: layer 0 is capped at B^l = 20, the other 20 tokens
    # are shared 6 : 13 -> [6.3, 13.7] -> [6, 14]
    caps = torch.full((1, 4), 20)
    assert allocate(torch.tensor([[6, 2, 0, 4]]), 20, 40, caps).tolist() == [[20, 6, 0, 14]]
    # total above the capacity: every layer full; zero-weight layers share leftovers
    assert apportion(torch.tensor([[1.0, 0.0]]), torch.tensor([50]), torch.tensor([[10, 30]])).tolist() == [[10, 30]]
    assert apportion(
        torch.tensor([[1.0, 0.0, 0.0]]),
        torch.tensor([30]),
        torch.tensor([[10, 30, 30]]),
    ).tolist() == [[10, 10, 10]]


@pytest.mark.parametrize("interval", [1, 2, 4])
def test_dynamickv_budgets_sum_to_global_budget(deep, interval):
    ids = random_prompt(256)
    budget, window = 24, 8  # 16 selected per layer on average + the window
    out = generate(
        deep,
        ids,
        method="dynamickv",
        budget=budget,
        window=window,
        interval=interval,
        r_max=2.0,
        max_new_tokens=4,
    )
    budgets = [int(layer.state.budget) for layer in out.cache.layers]
    assert sum(budgets) == (budget - window) * out.cache.num_layers
    assert max(budgets) <= int((budget - window) * 2.0)  # B^l with r_max = 2
    report = budget_report(out.cache)
    assert [round(b) - window for b in report["budget_per_layer"]] == budgets
    # stores really shrank: each holds its layer's selection, the window and the decoded tokens, nothing more
    for layer, b in zip(out.cache.layers, budgets):
        assert layer.state.store.slots == b + window + 4
        assert layer.state.attention is None
    snap = generate(deep, ids, method="snapkv", budget=budget, window=window, max_new_tokens=4)
    assert out.stats()["kv_bytes_full"] == snap.stats()["kv_bytes_full"]  # same total memory as snapkv at K


def test_dynamickv_intermediate_update_shrinks_earlier_layers(deep):
    ids = random_prompt(256)
    seen = []
    policy = make_policy("dynamickv", budget=24, window=8, interval=2, r_max=4.0)  # 16 selected per layer
    update = policy.update

    def spy(layers, per_layer, num_layers, final):
        before = [int(layer.state.budget) for layer in layers]
        budgets = update(layers, per_layer, num_layers, final)
        seen.append((before, budgets[0].tolist(), final))
        return budgets

    object.__setattr__(policy, "update", spy)
    generate(deep, ids, method=policy, max_new_tokens=2)
    assert [len(b) for b, _, _ in seen] == [2, 4, 5] and [f for _, _, f in seen] == [
        False,
        False,
        True,
    ]
    for before, after, _ in seen:
        assert all(a <= b for a, b in zip(after, before))  # a layer only ever shrinks
        assert sum(after) == min(sum(before), 16 * 5)  # Eq. 6 normalises to the whole budget B = (wt - ws) L


def test_dynamickv_large_budget_equals_full(deep):
    ids = random_prompt(100)
    full = generate(deep, ids, method="full", max_new_tokens=6, return_logits=True)
    for budget in (100, 500):
        out = generate(
            deep,
            ids,
            method="dynamickv",
            budget=budget,
            max_new_tokens=6,
            return_logits=True,
        )
        assert out.tokens == full.tokens
        assert max_logit_diff(out, full) < 1e-4
        assert budget_report(out.cache)["budget_ratio"] == 1.0
    short = generate(
        deep,
        random_prompt(20),
        method="dynamickv",
        budget=24,
        window=20,
        max_new_tokens=2,
    )
    assert budget_report(short.cache)["budget_ratio"] == 1.0  # only the window: the whole prompt


def test_dynamickv_padded_batch_matches_single_rows(deep):
    rows = [random_prompt(150, seed=7)[0], random_prompt(90, seed=8)[0]]
    ids, mask = padded_batch(rows)
    batch = generate(
        deep,
        ids,
        mask,
        method="dynamickv",
        budget=12,
        window=8,
        interval=2,
        max_new_tokens=5,
    )
    for i, row in enumerate(rows):
        single = generate(
            deep,
            row[None],
            method="dynamickv",
            budget=12,
            window=8,
            interval=2,
            max_new_tokens=5,
        )
        assert batch.tokens[i] == single.tokens[0]
        assert [int(layer.state.budget[i]) for layer in batch.cache.layers] == [
            int(layer.state.budget) for layer in single.cache.layers
        ]


def test_dynamickv_bad_input(llama):
    for bad in (0, -1.0, float("nan"), "2"):
        with pytest.raises(PolicyError, match="r_max"):
            make_policy("dynamickv", r_max=bad)
    with pytest.raises(PolicyError, match="interval"):
        make_policy("dynamickv", interval=0)
    with pytest.raises(PolicyError) as error:
        generate(llama, random_prompt(12), method="dynamickv", max_new_tokens=2)
    assert "window (32) is larger than the prompt (12 tokens)" in str(error.value)  # snapkv's window
    with pytest.raises(PolicyError, match="must hold the observation window"):
        generate(llama, random_prompt(40), method="dynamickv", budget=8, max_new_tokens=2)


# ---------------------------------------------------------------- budget_report


def test_budget_report_for_other_methods(llama):
    ids = random_prompt(64)
    for method, params in (("full", {}), ("refreshkv", {"budget": 8})):
        report = budget_report(generate(llama, ids, method=method, max_new_tokens=3, **params).cache)
        assert report["budget_ratio"] == 1.0 and report["budget_per_layer"] == [64.0] * 3
    report = budget_report(generate(llama, ids, method="snapkv", budget=16, window=8, max_new_tokens=3).cache)
    assert report["budget_per_layer"] == [16.0] * 3 and report["budget_ratio"] == 16 / 64
    assert report["budget_per_head"] == [[16.0, 16.0]] * 3
    table = budget_table(report)
    assert table.row_count == 3
