"""The serving plugin's parts that need no engine: C_f read from paged blocks, the batch's rows followed through the
engine's changes, a request's method run over paged storage as over the transformers cache, and its settings."""

import ctypes
import ctypes.util
import gc
import os
import weakref
from types import SimpleNamespace

import pytest
import torch
from conftest import random_prompt

from refreshkv import PolicyCache, make_policy, with_cache
from refreshkv.core.policy import PolicyError
from refreshkv.serving.batch_rows import BatchRows
from refreshkv.serving.paged_store import PagedBlocks, PagedFullStore, cpu_blocks
from refreshkv.serving.plugin_config import served_policy
from refreshkv.serving.request_layer import ModelFacts, Request, StepCounts, tokens_left


def paged(keys: torch.Tensor, values: torch.Tensor, block_size: int, order: list[int], layout: str = "rows"):
    """(1, Hkv, L, D) keys and values written into blocks `order` (a block table), as (blocks, Hkv, size, D): each
    token's row whole ("rows"), or as vLLM's CPU cache lays them ("vllm_cpu": a block's keys channel-major, read where
    they lie by the C)."""
    heads, length, dim = keys.shape[1:]
    count = -(-length // block_size)
    if layout == "vllm_cpu":
        blocks = cpu_blocks(torch.full((max(order) + 1, heads, block_size, 2 * dim), float("nan")))
        store_k, store_v = blocks.keys, blocks.values
    else:
        store_k = torch.full((max(order) + 1, heads, block_size, dim), float("nan"))
        store_v = store_k.clone()
    for i, block in enumerate(order[:count]):
        span = slice(i * block_size, min((i + 1) * block_size, length))
        store_k[block, :, : span.stop - span.start] = keys[0, :, span]
        store_v[block, :, : span.stop - span.start] = values[0, :, span]
    return PagedBlocks(store_k, store_v), torch.tensor(order)


@pytest.mark.parametrize("layout", ["rows", "vllm_cpu"])
def test_a_span_of_paged_blocks_reads_as_the_tokens_written(layout):
    keys, values = torch.randn(1, 2, 37, 4), torch.randn(1, 2, 37, 4)
    blocks, table = paged(keys, values, 8, [5, 0, 3, 7, 1], layout)
    for start, end in ((0, 37), (3, 30), (8, 16), (36, 37)):
        read_k, read_v = blocks.gather(table, start, end)
        assert torch.equal(read_k, keys[:, :, start:end]) and torch.equal(read_v, values[:, :, start:end])
    new_k, new_v = torch.randn(1, 2, 12, 4), torch.randn(1, 2, 12, 4)
    blocks.write(table, 6, new_k, new_v)  # across three blocks, where they lie
    read_k, read_v = blocks.gather(table, 0, 37)
    assert torch.equal(read_k[:, :, 6:18], new_k) and torch.equal(read_v[:, :, 6:18], new_v)
    assert torch.equal(read_k[:, :, 18:], keys[:, :, 18:]) and torch.equal(read_v[:, :, :6], values[:, :, :6])


@pytest.mark.parametrize(
    "method, params",
    [
        ("refreshkv", {"budget": 12}),
        ("refreshkv", {"budget": 12, "preset": "paper", "qc_stride": 3}),
        # a refresh at every query check: full steps read C_f from the blocks, keep the answer and the question floor
        ("refreshkv", {"budget": 12, "qc_stride": 2, "threshold": 1.0}),
        ("refreshkv", {"budget": 12, "qc_stride": 3, "threshold": 0.5, "anchor": "window"}),
        ("recycled", {"budget": 12, "stride": 2}),
        ("streamingllm++", {"budget": 12, "stride": 3}),
        ("oracle", {"budget": 12}),
        # pages of 8 tokens (inside vLLM, a page is the engine's block where page_size equals the block size)
        ("quest", {"budget": 16, "page_size": 8, "dense_layers": 1}),
        ("fasa", {"budget": 12}),
    ],
)
@pytest.mark.parametrize("layout", ["rows", "vllm_cpu"])
def test_a_request_over_paged_blocks_decodes_as_the_transformers_cache(llama, monkeypatch, method, params, layout):
    """The method's own hooks on a `RequestLayer` over blocks give the transformers cache's outputs, step by step."""
    from refreshkv.engine.cache import PolicyLayer

    calls: dict[int, list] = {}  # per layer: (query, key, value, output) of the prompt and of each decode step
    attend = PolicyLayer.attend

    def recorded(self, module, query, key, value, mask, scaling, sliding_window=None):
        output = attend(self, module, query, key, value, mask, scaling, sliding_window)
        calls.setdefault(self.layer_idx, []).append((query, key, value, output, scaling))
        return output

    monkeypatch.setattr(PolicyLayer, "attend", recorded)
    spans: list[tuple[int, int]] = []  # the spans of C_f gathered out of the blocks during a decode step
    gather = PagedBlocks.gather
    monkeypatch.setattr(
        PagedBlocks, "gather", lambda self, ids, start, end: spans.append((start, end)) or gather(self, ids, start, end)
    )
    policy, length, new = make_policy(method, **params), 40, 8
    ids = random_prompt(length)
    cache = PolicyCache(policy, llama, max_new_tokens=new)
    with torch.no_grad():
        logits = llama(ids, **with_cache(llama, cache)).logits[:, -1:]
        for step in range(new - 1):
            position = torch.tensor([[length + step]])
            logits = llama(logits.argmax(-1), **with_cache(llama, cache), position_ids=position).logits
    request = Request(
        policy, ids[0].tolist(), new, ModelFacts(cache.model_type, cache.rope_inv_freq, cache.word_table), StepCounts()
    )
    assert request.served
    for layer_idx, steps in calls.items():
        keys = torch.cat([call[1] for call in steps], dim=2)
        values = torch.cat([call[2] for call in steps], dim=2)
        request.keep_window(layer_idx, steps[0][0], 0)
        prompt_blocks = paged(keys[:, :, :length], values[:, :, :length], 16, [3, 0, 2], layout)
        request.store_prompt(layer_idx, *prompt_blocks, steps[0][4])
        for step, (query, key, value, expected, scaling) in enumerate(steps[1:], start=1):
            seen = length + step
            blocks, table = paged(keys[:, :, :seen], values[:, :, :seen], 16, [3, 0, 2, 1, 4], layout)
            spans.clear()
            got = request.decode(layer_idx, query, key, value, scaling, blocks, table, seen)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
            if layout == "vllm_cpu" and method in ("refreshkv", "recycled", "quest"):  # C_f read where it lies
                assert all(end - start <= new for start, end in spans), spans
    state = request.layers[0].state
    assert isinstance(state if method in ("oracle", "streamingllm++") else state.full, PagedFullStore)
    assert request.counts.layer_steps == len(calls) * (new - 1)


@pytest.mark.parametrize(
    "method, params",
    [
        ("refreshkv", {"qc_stride": 2, "threshold": 0.99, "pooling": "centered"}),
        ("recycled", {"stride": 3, "pooling": "centered"}),
        ("quest", {"page_size": 8, "dense_layers": 0}),
    ],
)
def test_the_partial_steps_of_a_batch_attend_in_one_call_as_each_alone(method, params):
    """Requests of different lengths at one layer, in one cache of vLLM's CPU layout: their partial steps (quest's:
    every step, over its pages where they lie) handed to one `HeldSteps` call give what each request's step alone
    gives; refreshes stay their own. Each step finds in the blocks only the tokens so far (NaN after them)."""
    from refreshkv.serving.held_steps import HeldSteps

    torch.manual_seed(3)
    heads, kv_heads, dim, new = 6, 2, 16, 7
    facts = ModelFacts("llama", [1.0 / 10000 ** (torch.arange(0, dim, 2) / dim)])
    prompts = [torch.randn(2, 1, kv_heads, length + new, dim) for length in (50, 83, 64)]
    blocks = cpu_blocks(torch.full((30, kv_heads, 16, 2 * dim), float("nan")))
    tables = [torch.randperm(30, generator=torch.Generator().manual_seed(9))[10 * i : 10 * i + 10] for i in range(3)]

    def write(request: int, start: int, end: int) -> None:
        keys, values = prompts[request]
        blocks.write(tables[request], start, keys[:, :, start:end], values[:, :, start:end])

    def requests():
        made = []
        for i, (keys, _) in enumerate(prompts):
            length = keys.shape[2] - new
            write(i, 0, length)
            request = Request(make_policy(method, budget=16, **params), [0] * length, new, facts, StepCounts())
            request.prompt_length = length
            request.keep_window(0, torch.randn(1, heads, 32, dim, generator=torch.Generator().manual_seed(length)), 0)
            request.store_prompt(0, blocks, tables[i], 0.25)
            made.append(request)
        return made

    alone, together = requests(), requests()
    held_counts = []
    for step in range(1, new):
        held = HeldSteps(torch.full((len(prompts), heads, dim), float("nan")))
        rows, expected = [], []
        for row, (request, twin, (keys, values)) in enumerate(zip(alone, together, prompts)):
            held.row = row
            seen = keys.shape[2] - new + step
            write(row, seen - 1, seen)
            query = torch.randn(1, heads, 1, dim, generator=torch.Generator().manual_seed(seen))
            new_kv = (keys[:, :, seen - 1 : seen], values[:, :, seen - 1 : seen])
            expected.append(request.decode(0, query, *new_kv, 0.25, blocks, tables[row], seen))
            rows.append(twin.decode(0, query, *new_kv, 0.25, blocks, tables[row], seen, held))
        held_counts.append(len(held))
        held.attend(0.25)
        for got, want in zip(rows, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    if method == "quest":
        assert set(held_counts) == {len(prompts)}
    else:  # the partial steps were held, the refreshes not
        assert max(held_counts) == len(prompts) and min(held_counts) < len(prompts), held_counts


def test_a_released_request_frees_its_state_without_the_garbage_collector():
    """A request owns its layers and each layer refers to its request weakly: the last reference gone, its C_p goes at
    once (in a cycle it would wait for Python's full collection, which vLLM's frozen heap makes rare, and then free
    every finished request at once inside one decode step)."""
    torch.manual_seed(4)
    keys, values = torch.randn(1, 2, 60, 16), torch.randn(1, 2, 60, 16)
    facts = ModelFacts("llama", [1.0 / 10000 ** (torch.arange(0, 16, 2) / 16)])
    request = Request(make_policy("refreshkv", budget=16, pooling="centered"), [0] * 60, 8, facts, StepCounts())
    request.prompt_length = 60
    request.keep_window(0, torch.randn(1, 6, 32, 16), 0)
    request.store_prompt(0, *paged(keys, values, 16, list(range(4)), "vllm_cpu"), 0.25)
    layer, state = weakref.ref(request.layers[0]), weakref.ref(request.layers[0].state)
    gc.disable()
    try:
        del request
        assert layer() is None and state() is None
    finally:
        gc.enable()


def test_the_memory_of_released_requests_goes_back_to_the_system():
    """Blocks as large as a C_p layer store, freed between small survivors, stay in glibc's heap (the server's RSS
    stayed at its peak); the trim when the last request's state went gives them back. Trims come every 16 releases
    while requests still run, and once when the last goes."""
    from refreshkv.serving import heap

    if heap._malloc_trim() is None or not os.path.exists("/proc/self/statm"):
        pytest.skip("glibc's malloc_trim and /proc are Linux's")

    def rss_mb() -> float:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = (
        ctypes.c_void_p,
        [ctypes.c_size_t],
        [ctypes.c_void_p],
    )
    # M_MMAP_THRESHOLD as glibc raises it once a block that large was freed; M_TRIM_THRESHOLD so high that no free
    # trims the heap's top itself: only a trim gives pages back (both to glibc's defaults after)
    libc.mallopt(-3, 8 * 2**20)
    libc.mallopt(-1, 2**30)
    heap._malloc_trim()(0)  # what earlier tests left free in the heap goes first
    before = rss_mb()
    held, survivors = [], []  # 300 blocks of 1 MB, touched, between blocks that stay (as the window store's)
    for _ in range(300):
        held.append(libc.malloc(2**20))
        ctypes.memset(held[-1], 1, 2**20)
        survivors.append(libc.malloc(2**12))
    for block in held:
        libc.free(block)
    freed = rss_mb()
    assert freed > before + 250  # kept in the heap
    trimmed = heap.FreedHeap()
    trimmed.after_update(released=3, holding=0)
    assert trimmed.trims == 1 and rss_mb() < before + 50, (before, freed, rss_mb())
    for block in survivors:
        libc.free(block)
    libc.mallopt(-1, 128 * 2**10)
    libc.mallopt(-3, 128 * 2**10)
    counted = heap.FreedHeap()
    for holding in range(40, 0, -1):
        counted.after_update(released=1, holding=holding)
    assert counted.trims == 2  # at the 16th and 32nd release
    counted.after_update(released=1, holding=0)
    assert counted.trims == 3
    counted.after_update(released=0, holding=0)
    assert counted.trims == 3  # nothing went since


def test_a_full_step_over_vllms_cpu_blocks_attends_and_gathers_where_they_lie():
    """The C reads vLLM's CPU layout in place: PyTorch's attention over the gathered tokens, and the selected tokens."""
    from refreshkv.core.attention_math import attend_with_probs
    from refreshkv.core.native_attention import attend_paged, gather_paged

    torch.manual_seed(0)
    keys, values = torch.randn(1, 3, 300, 64), torch.randn(1, 3, 300, 64)
    blocks, table = paged(keys, values, 32, [4, 9, 0, 7, 2, 5, 1, 3, 6, 8], "vllm_cpu")
    query = torch.randn(1, 9, 1, 64)
    attended = attend_paged(query, blocks.keys, blocks.values, table, 300, 0.125)
    assert attended is not None  # the C path, not a fallback
    expected = attend_with_probs(query, keys, values, 0.125, None)
    for got, want in zip(attended, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    index = torch.tensor([[0, 31, 32, 299], [5, 6, 200, 100], [299, 0, 64, 65]])
    out = torch.zeros(1, 3, 6, 64), torch.zeros(1, 3, 6, 64)
    assert gather_paged(blocks.keys, blocks.values, table, index, out)
    heads = torch.arange(3).unsqueeze(1)
    assert torch.equal(out[0][0, :, :4], keys[0, heads, index]) and torch.equal(
        out[1][0, :, :4], values[0, heads, index]
    )
    assert not out[0][0, :, 4:].any()  # the slots after k untouched
    for outside in (320, -1):  # past the request's 10 blocks of 32 tokens, or before them: refused, nothing written
        wrong = index.clone()
        wrong[2, 1] = outside
        with pytest.raises(IndexError, match="outside the request's 10 blocks"):
            gather_paged(blocks.keys, blocks.values, table, wrong, (torch.zeros(1, 3, 6, 64), out[1]))
    assert torch.equal(out[1][0, :, :4], values[0, heads, index])


@pytest.mark.parametrize("seed", range(6))
def test_a_refresh_over_vllms_cpu_blocks_reads_only_the_tokens_not_already_in_their_slots(seed):
    """The slots hold tokens (and empty slots); the new selection leaves some in their slots (a refresh keeps a token
    in its slot), asks for a held one in another slot and for new ones. Those in their slots are left as they are
    (the blocks are wrong at exactly their positions, so a token read again would show); the others, and every
    token without `held`, come from the blocks."""
    from refreshkv.core.native_attention import gather_paged

    generator = torch.Generator().manual_seed(seed)
    heads, length, dim, slots, k = 3, 700, 64, 90, 50
    keys, values = torch.randn(1, heads, length, dim, generator=generator), torch.randn(1, heads, length, dim)
    held = torch.stack([torch.randperm(length, generator=generator)[:80] for _ in range(heads)])
    held[:, 70:] = -1  # empty slots
    stays = torch.rand(heads, k, generator=generator) < 0.6
    fresh_positions = torch.stack(
        [row[~torch.isin(row, held[h])][:k] for h, row in enumerate(torch.randperm(length).expand(heads, -1))]
    )
    index = torch.where(stays, held[:, :k], fresh_positions)
    index[:, 7] = held[:, 60]  # a held token asked for in another slot: read from the blocks
    stays[:, 7] = False
    heads_at = torch.arange(heads).unsqueeze(1)
    out = torch.zeros(1, heads, slots, dim), torch.zeros(1, heads, slots, dim)
    filled = held.clamp(min=0)
    out[0][0, :, :80], out[1][0, :, :80] = keys[0, heads_at, filled], values[0, heads_at, filled]
    in_place = torch.zeros(heads, length, dtype=torch.bool)
    in_place[heads_at.expand(-1, k)[stays], index[stays]] = True
    wrong_keys, wrong_values = keys.clone(), values.clone()
    wrong_keys[0][in_place], wrong_values[0][in_place] = float("nan"), float("nan")
    blocks, table = paged(wrong_keys, wrong_values, 32, list(range(21))[::-1] + [21], "vllm_cpu")
    assert gather_paged(blocks.keys, blocks.values, table, index, out, held)
    assert torch.equal(out[0][0, :, :k], keys[0, heads_at, index])
    assert torch.equal(out[1][0, :, :k], values[0, heads_at, index])
    fresh = torch.zeros(1, heads, slots, dim), torch.zeros(1, heads, slots, dim)
    assert gather_paged(blocks.keys, blocks.values, table, index, fresh)  # without `held`: every token read again
    assert torch.isnan(fresh[0][0, :, :k]).any(dim=-1).equal(stays)


@pytest.mark.parametrize("wide", [0, 1])
def test_quests_pages_are_attended_where_they_lie_in_vllms_cpu_blocks(monkeypatch, wide):
    """Pages of 16 tokens chosen per head (runs that cross no block, the page being written past the last token, a
    position masked) attended over vLLM's CPU layout in place: PyTorch's attention over the same tokens gathered.
    The positions past the tokens are never read (NaN there)."""
    from refreshkv.core import native_attention
    from refreshkv.core.attention_math import decode_attention

    monkeypatch.setattr(native_attention, "_wide", lambda: wide)
    torch.manual_seed(2)
    keys, values = torch.randn(1, 3, 1000, 64), torch.randn(1, 3, 1000, 64)
    blocks, table = paged(keys, values, 128, [7, 2, 0, 5, 1, 3, 6, 4], "vllm_cpu")  # NaN past token 999
    pages = torch.stack([torch.randperm(62)[:20].sort().values for _ in range(3)])
    index = torch.cat(
        [(pages.unsqueeze(-1) * 16 + torch.arange(16)).flatten(-2), 992 + torch.arange(16).expand(3, -1)], -1
    )
    chosen = torch.ones_like(index, dtype=torch.bool)
    chosen[1, 5] = False
    query = torch.randn(1, 9, 1, 64)
    got = native_attention.attend_paged_at(query, blocks.keys, blocks.values, table, index, chosen, 1000, 0.125)
    valid, index = chosen & (index < 1000), index.clamp(max=999)
    heads = torch.arange(3).unsqueeze(1)
    gathered = keys[0, heads, index].unsqueeze(0), values[0, heads, index].unsqueeze(0)
    want = decode_attention(query, *gathered, 0.125, valid.unsqueeze(0))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    outside = torch.cat([index[:, :-1], torch.full((3, 1), 1024)], dim=1)  # past the 8 blocks, and a token
    with pytest.raises(IndexError, match="outside"):
        native_attention.attend_paged_at(query, blocks.keys, blocks.values, table, outside, None, 1100, 0.125)


def test_the_batch_rows_follow_removals_additions_and_moves():
    rows = BatchRows()
    a, b, c = (SimpleNamespace(owner=None, answer=[]) for _ in range(3))  # no engine parameters: never parked
    rows.update([], [(0, a), (1, b), (2, None)], [])
    assert rows.rows == {0: a, 1: b} and rows.count() == 2
    rows.update([0], [(0, c)], [(1, 2, False)])  # a finished, c took its row, b moved one way
    assert rows.rows == {0: c, 2: b}
    rows.update([], [], [(0, 2, True)])  # swapped
    assert rows.rows == {0: b, 2: c}
    rows.update([0, 2], [], [])
    assert rows.count() == 0


def test_a_request_that_leaves_the_batch_is_parked_until_the_engine_drops_its_parameters():
    """vLLM removes a preempted (or skipped) request from its batch and adds it again later with the same sampling
    parameters and answer list: it comes back with its state; once the engine drops the parameters it is gone."""

    class Params:  # stands for vLLM's SamplingParams: held by the engine while the request lives
        pass

    rows, params, answer = BatchRows(), Params(), [5, 6]
    back = []
    request = SimpleNamespace(
        owner=weakref.ref(params), answer=answer, come_back=lambda: back.append(1), finished=lambda: False
    )
    rows.update([], [(3, request)], [])
    rows.update([3], [], [])  # preempted
    assert rows.rows == {} and rows.count() == 1
    assert rows.resume(Params(), answer) is None and rows.resume(params, [5, 6]) is None  # not the same request
    assert rows.resume(params, answer) is request and rows.count() == 0 and back == [1]
    rows.update([], [(1, request)], [])
    rows.update([1], [], [])  # finished: the engine drops its parameters
    del params
    gc.collect()
    assert rows.count() == 0


def test_a_request_that_finished_is_not_parked():
    """A request that leaves having decoded all it may (its max_tokens, or the model's context), or with a stop token
    last, is done: its state goes at once, whether or not the engine still holds its parameters."""

    class Params:  # stands for vLLM's SamplingParams: held by the engine while the request lives
        all_stop_token_ids = {2}

    params, facts = Params(), ModelFacts("llama", [None])
    # (max_tokens, the answer when the request leaves, whether it is parked): the engine's context is 13 tokens, so
    # one with room for 5 more ends at its third token as one whose max_tokens is 3
    for max_tokens, answer, parked in ((3, [5, 6], 1), (3, [5, 6, 7], 0), (3, [5, 2], 0), (5, [5, 6, 7], 0)):
        new_tokens = tokens_left(max_tokens, 13, 10, 0)
        request = Request(make_policy("refreshkv", budget=4), [1] * 10, new_tokens, facts, StepCounts())
        request.owner, request.answer, request.prompt_length = weakref.ref(params), answer, 10
        rows = BatchRows()
        rows.update([], [(0, request)], [])
        rows.update([0], [], [])
        assert len(rows.parked) == parked, answer
    assert tokens_left(None, 13, 10, 1) == 2 and tokens_left(8, 13, 10, 4) == 0


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"method": "nope"}, "method 'nope' is unknown; inside vLLM choose from: fasa, full, oracle, quest"),
        ({"method": "snapkv"}, "is an eviction method: vLLM's KV manager frees no blocks in the middle of a request"),
        ({"method": "quest", "page_size": 0}, "page_size must be an integer >= 1, got 0"),
        ({"method": ["refreshkv"]}, 'method must be a method\'s name, got ["refreshkv"]; inside vLLM choose from'),
        ({"method": {"a": 1}}, 'method must be a method\'s name, got {"a": 1}'),
        ({"method": None}, "method must be a method's name, got null"),
        ({"preset": "nope"}, "method 'refreshkv' has no preset 'nope'; its presets: paper"),
        ({"method": "refreshkv", "budget": 0}, "budget must be an integer >= 1, got 0"),
        ({"budget": "12"}, "budget must be an integer >= 1, got '12'"),
        ({"budget": True}, "budget must be an integer >= 1, got True"),
        ({"budget": [12]}, "budget must be an integer >= 1, got [12]"),
        ({"budget": float("nan")}, "budget must be a finite number, got nan"),
        ({"budget_ratio": float("inf")}, "budget_ratio must be a finite number, got inf"),
        ({"budget_ratio": "0.1"}, "budget_ratio must be a number in (0, 1], got '0.1'"),
        ({"method": "recycled", "stride": 2.5}, "stride must be an integer >= 1, got 2.5"),
        ({"threshold": float("nan")}, "threshold must be a finite number, got nan"),
        ({"kernel": 1e9}, "kernel must be an odd integer >= 1, got 1000000000.0"),
        ({"window": {"a": 1}}, "window must be an integer >= 1, got {'a': 1}"),
        ({"keep_decoded": "yes"}, "keep_decoded must be true or false, got 'yes'"),
        ({"method": "refreshkv", "budget": 9000}, "budget (9000) is above the model's context of 8192 tokens"),
        ({"method": "refreshkv", "full_cache": "int8"}, "full_cache must be 'dense'"),
        ({"method": "refreshkv", "windoww": 3}, "method 'refreshkv' has no parameter windoww"),
        ("{not json", "the 'refreshkv' settings are not JSON"),
        (["refreshkv"], "the 'refreshkv' settings must be an object"),
        (3, "the 'refreshkv' settings must be an object such as"),
    ],
)
def test_what_the_plugin_refuses_at_start_or_in_a_request(settings, message):
    """The engine's settings and a request's go through one check (`served_policy`): every bad value, of any type,
    is one PolicyError line (a request's: HTTP 400), never another exception (a 500)."""
    with pytest.raises(PolicyError) as refused:
        served_policy(settings, context=8192)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_the_plugin_serves_each_full_cache_method():
    assert served_policy({"method": "refreshkv", "budget_ratio": 0.125}).name == "refreshkv"
    assert served_policy('{"method": "recycled", "stride": 5}').stride == 5
    assert served_policy({"method": "refreshkv", "preset": "paper"}).window == 1
