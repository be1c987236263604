"""Quest's pages and bounds, and the oracle's exact top-K, on hand-made keys and queries."""

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import random_prompt, tiny_model

from refreshkv import PolicyError, generate, make_policy
from refreshkv.core import native_library, native_selection
from refreshkv.core.kvstore import FullStore
from refreshkv.methods.quest import PagedStore

INF = float("inf")


def keys_of(*rows) -> torch.Tensor:
    """(1, 1, n, D) keys from rows of channel values."""
    return torch.tensor(rows, dtype=torch.float).view(1, 1, len(rows), -1)


def page_ranges(store: PagedStore, pages: int) -> tuple[list, list]:
    """The first row and head's first `pages` pages, each as its channels' lowest and highest keys."""
    return store.lows[0, 0, :, :pages].T.tolist(), store.highs[0, 0, :, :pages].T.tolist()


def test_pages_keep_each_channel_range_and_the_page_being_written_grows():
    keys = keys_of([1, -2], [3, 0], [-1, 5], [2, 2], [0, -4])  # pages of 2: [0,1] [2,3] [4]
    store = PagedStore(FullStore(keys, 8), keys, capacity=8, page_size=2, pads=None)
    store.load_prompt(keys, keys)
    assert store.pages == 3
    assert page_ranges(store, 3) == ([[1, -2], [-1, 2], [0, -4]], [[3, 0], [2, 5], [0, -4]])
    new = keys_of([7, -9])
    store.append(new, new)  # position 5 joins page 2
    assert page_ranges(store, 3)[0][2] == [0, -9] and page_ranges(store, 3)[1][2] == [7, -4]
    assert store.pages == 3


def test_pages_start_at_a_rows_first_real_token_and_pads_never_widen_one():
    keys = keys_of([100, 100], [1, 2], [3, 4], [5, 6])  # position 0 is a pad
    store = PagedStore(FullStore(keys, 6), keys, capacity=6, page_size=2, pads=torch.tensor([1]))
    store.load_prompt(keys, keys)
    assert store.pages == 2
    assert page_ranges(store, 2) == ([[1, 2], [5, 6]], [[3, 4], [5, 6]])
    new = keys_of([0, 9])
    store.append(new, new)  # real token 3 completes page 1
    assert page_ranges(store, 2)[0][1] == [0, 6] and page_ranges(store, 2)[1][1] == [5, 9]


@pytest.mark.parametrize("pads", [[0, 0], [2, 2], [0, 3]])
def test_decoded_tokens_widen_each_rows_page_as_a_prompt_of_them_all_would(pads):
    """Rows that page alike (the same pads: the in-place widening) and rows that do not (a scatter per row): after
    decoded tokens, every page's ranges are those of a store given prompt and tokens at once."""
    torch.manual_seed(5)
    keys = torch.randn(2, 3, 19, 4)
    prompt, decoded = keys[:, :, :11], keys[:, :, 11:]
    pads = torch.tensor(pads)
    stepped = PagedStore(FullStore(prompt, 24), prompt, capacity=24, page_size=4, pads=pads)
    stepped.load_prompt(prompt, prompt)
    for position in range(decoded.shape[2]):
        token = decoded[:, :, position : position + 1]
        stepped.append(token, token)
    whole = PagedStore(FullStore(keys, 24), keys, capacity=24, page_size=4, pads=pads)
    whole.load_prompt(keys, keys)
    assert torch.equal(stepped.lows, whole.lows) and torch.equal(stepped.highs, whole.highs)


def test_the_page_bound_is_an_upper_bound_of_every_query_key_product():
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 64, 8)
    store = PagedStore(FullStore(keys, 64), keys, capacity=64, page_size=8, pads=None)
    store.load_prompt(keys, keys)
    query = torch.randn(1, 4, 1, 8)  # 2 query heads per KV head
    packed = query.view(1, 2, 2, 8)
    for head in range(2):
        for page in range(8):
            page_keys = keys[0, head, page * 8 : (page + 1) * 8]  # (8, D)
            lows, highs = store.lows[0, head, :, page], store.highs[0, head, :, page]
            for q in packed[0, head]:
                bound = torch.maximum(q * lows, q * highs).sum()
                assert bound >= (page_keys @ q).max() - 1e-5


def test_quest_picks_the_pages_with_the_highest_bound_and_the_page_being_written():
    quest = make_policy("quest", budget=4, page_size=2)
    keys = keys_of([0, 0], [0, 0], [5, 0], [0, 0], [0, 1], [0, 0], [-3, 3], [0, 0], [1, 1])  # 5 pages, last partial
    store = PagedStore(FullStore(keys, 12), keys, capacity=12, page_size=2, pads=None)
    store.load_prompt(keys, keys)
    query = torch.tensor([1.0, 1.0]).view(1, 1, 1, 2)
    # bounds (q = [1, 1]: the sum of each page's maxima): page0 0, page1 5, page2 1, page3 3; K/2 = 2 pages
    index, chosen = quest.selected_tokens(store, query, 2)
    assert index.tolist() == [[[2, 3, 6, 7, 8, 9]]] and chosen is None  # pages 1 and 3, then page 4 (written)
    negative = torch.tensor([-1.0, 0.0]).view(1, 1, 1, 2)  # bound = minus each page's minimum of channel 0
    assert quest.selected_tokens(store, negative, 2)[0].tolist() == [[[0, 1, 6, 7, 8, 9]]]


@pytest.mark.skipif(native_library._compiler() is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("aggregation", ["max", "mean"])
@pytest.mark.parametrize("pads", [None, 3])
def test_quests_pages_in_c_are_pytorchs_with_ties_to_the_earlier_page(monkeypatch, aggregation, pads):
    """Small integers make every bound exact, so the tied pages (a page copied twice) must rank alike in both."""
    generator = torch.Generator().manual_seed(0)
    quest = make_policy("quest", budget=32, page_size=4, aggregation=aggregation)
    for keys in (torch.randint(-3, 4, (2, 2, 61, 8), generator=generator).float(), torch.randn(2, 2, 61, 8)):
        keys[:, :, 8:12] = keys[:, :, 20:24]  # pages 2 and 5 alike
        row_pads = None if pads is None else torch.full((2,), pads)
        store = PagedStore(FullStore(keys, 64), keys, capacity=64, page_size=4, pads=row_pads)
        store.load_prompt(keys, keys)
        query = torch.randint(-2, 3, (2, 6, 1, 8), generator=generator).float()  # 3 query heads per KV head
        native, chosen = quest.selected_tokens(store, query, 8)
        assert chosen is None
        with monkeypatch.context() as scoped:
            scoped.setenv("REFRESHKV_NATIVE", "0")
            assert torch.equal(native, quest.selected_tokens(store, query, 8)[0])
    pages = store.pages - 1
    bounds, _ = native_selection.quest_pages(query.view(2, 2, 3, 8), store.lows, store.highs, pages, 8, False, 4, 0)
    packed = query.view(2, 2, 3, 1, 8)
    lows, highs = (ranges[..., :pages].transpose(2, 3)[:, :, None] for ranges in (store.lows, store.highs))
    expected = torch.maximum(packed * lows, packed * highs).sum(-1).amax(2)
    torch.testing.assert_close(bounds, expected)


def test_quest_attends_fully_in_its_dense_layers_and_when_everything_fits():
    model = tiny_model(layers=3)
    out = generate(
        model,
        random_prompt(64),
        method="quest",
        budget=16,
        page_size=4,
        dense_layers=1,
        max_new_tokens=4,
        eos_token_id=[],
    )
    per_layer = out.cache.stats.per_layer()
    assert per_layer[0] == out.cache.step and per_layer[1] == per_layer[2] == 0  # layer 0 dense, others sparse
    full = generate(model, random_prompt(64), method="full", max_new_tokens=4, eos_token_id=[])
    assert out.stats()["kv_bytes_attended_mean"] < full.stats()["kv_bytes_attended_mean"]
    everything = generate(
        model, random_prompt(64), method="quest", budget=128, page_size=4, max_new_tokens=4, eos_token_id=[]
    )
    assert everything.tokens == full.tokens


@pytest.mark.parametrize(
    "params, message",
    [
        ({"budget": 8, "page_size": 16}, "budget (8) must hold at least one page (page_size 16 tokens)"),
        ({"page_size": 0}, "page_size must be an integer >= 1"),
        ({"page_size": 2.5}, "page_size must be an integer >= 1"),
        ({"dense_layers": -1}, "dense_layers must be an integer >= 0"),
        ({"kernel": 3}, "method 'quest' has no parameter kernel"),
    ],
)
def test_quest_bad_parameters_are_one_line(params, message):
    with pytest.raises(PolicyError) as error:
        make_policy("quest", **params)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_budget_ratio_below_one_page_is_refused_with_the_page_size():
    with pytest.raises(PolicyError, match=r"budget \(4 tokens, from budget_ratio 0.125\) must hold at least one page"):
        generate(tiny_model(), random_prompt(32), method="quest", max_new_tokens=2)


def test_oracle_options_it_does_not_take_are_refused():
    for name in ("kernel", "page_size", "stride"):
        with pytest.raises(PolicyError, match=f"method 'oracle' has no parameter {name}"):
            make_policy("oracle", **{name: 3})


def test_the_oracle_attends_to_the_top_k_of_the_current_query_and_the_newest_token():
    """One KV head, one query head: the output is the softmax over the K best logits and the newest token."""
    oracle = make_policy("oracle", budget=2)
    keys = keys_of([1, 0], [0, 3], [2, 0], [0, -1], [0, 0.5])  # the newest token is the last
    values = torch.arange(10, dtype=torch.float).view(1, 1, 5, 2)
    query = torch.tensor([1.0, 1.0]).view(1, 1, 1, 2)
    state = SimpleNamespace(append=lambda k, v: None, view=lambda: (keys, values), length=5, attended_bytes=lambda: 0)
    layer = SimpleNamespace(state=state, budget=2, valid_positions=lambda n, d: None, record=lambda *a: None)
    output = oracle.decode(layer, query, keys[:, :, -1:], values[:, :, -1:], 1.0)
    logits = {1: 3.0, 2: 2.0, 4: 0.5}  # the top 2 of positions 0-3 by q.k (3, 2), and the newest (0.5)
    total = sum(math.exp(v) for v in logits.values())
    expected = sum(math.exp(v) / total * values[0, 0, p] for p, v in logits.items())
    torch.testing.assert_close(output.view(2), expected)


def test_the_oracle_is_labelled_a_ceiling_in_bench_and_report():
    from refreshkv.eval.summary import method_label
    from refreshkv.methods.oracle import Oracle

    assert Oracle.ceiling and not type(make_policy("quest")).ceiling
    assert method_label({"method": "oracle", "params": {"budget": 8}}) == "oracle(budget=8) (ceiling)"
    assert method_label({"method": "quest", "params": {}}) == "quest"
