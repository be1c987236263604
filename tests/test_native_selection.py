"""The selection's C kernels (core/native_selection.py, core/native_attention.py; built by core/native_library.py)
give exactly what the PyTorch operators give, are built on first use, and step aside where they cannot run."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from refreshkv.core import native_attention, native_library, native_selection
from refreshkv.core.attention_math import spread_over_spans, top_k
from refreshkv.core.kvstore import gather_tokens
from refreshkv.core.selection import APPENDED, SelectionState
from refreshkv.methods.refreshkv import RefreshKV

needs_compiler = pytest.mark.skipif(native_library._compiler() is None, reason="no C compiler on this machine")


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """The kernels compiled anew, with an empty cache folder."""
    monkeypatch.setenv("REFRESHKV_CACHE", str(tmp_path))
    native_library._library.cache_clear()
    yield tmp_path
    native_library._library.cache_clear()


def reference(monkeypatch, function, *args):
    with monkeypatch.context() as scoped:
        scoped.setenv("REFRESHKV_NATIVE", "0")
        return function(*args)


def tied_scores(generator, shape):
    """Few distinct values (max-pooling makes plateaus), signs, zeros of both signs and infinities."""
    scores = torch.randint(-4, 5, shape, generator=generator).float() / 4
    scores[scores == 0.25] = -0.0
    scores[scores == 1.0] = float("inf")
    scores[scores == -1.0] = float("-inf")
    return scores


@needs_compiler
def test_c_top_k_matches_pytorch_with_ties_and_exclusions(fresh_build, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    for shape in [(1, 1, 7), (2, 3, 50), (1, 3, 1000), (3, 257)]:
        for scores in (tied_scores(generator, shape), torch.randn(shape, generator=generator)):
            n = shape[-1]
            valid = torch.rand((*shape[:-2], 1, n) if len(shape) == 3 else shape, generator=generator) < 0.6
            for k in sorted({1, 2, n // 3, n // 2, n - 1, n}):
                for mask in (None, valid):
                    native = native_selection.top_k_in_order(scores, k, mask)
                    assert native is not None
                    assert torch.equal(native, reference(monkeypatch, top_k, scores, k, mask)), (shape, k)
    assert not (fresh_build / "native").exists()  # built in the process's own folder, never in the cache


@needs_compiler
def test_c_spread_matches_pytorch_for_words_of_any_length(fresh_build, monkeypatch):
    generator = torch.Generator().manual_seed(1)
    for batch, heads, n, length in [(1, 3, 40, 40), (2, 2, 64, 50), (1, 1, 5, 1)]:
        scores = torch.randn(batch, heads, n, generator=generator)
        starts = torch.rand(batch, length, generator=generator) < 0.3
        starts[:, 0] = True
        words = starts.long().cumsum(-1) - 1
        native = native_selection.spread_over_words(scores, words)
        assert native is not None
        assert torch.equal(native, reference(monkeypatch, spread_over_spans, scores, words))
        assert torch.equal(native[..., length:], scores[..., length:])  # decoded tokens keep their own


def test_without_a_compiler_the_selection_says_so_once_and_gives_the_same_indices(fresh_build, monkeypatch):
    scores = torch.tensor([[[0.5, 0.5, float("-inf"), 0.5, 0.9, 0.0, -0.0]]])
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.warns(UserWarning, match="no C compiler"):
        assert native_selection.top_k_in_order(scores, 3) is None
    assert top_k(scores, 3).tolist() == [[[0, 1, 4]]]
    assert not (fresh_build / "native").exists()


@needs_compiler
def test_a_compiler_without_openmp_builds_the_one_thread_library_and_says_so(fresh_build, monkeypatch, tmp_path):
    compiler = tmp_path / "cc-without-openmp"
    compiler.write_text(
        f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && echo "no openmp here" >&2 && exit 1; done\n'
        f'exec {native_library._compiler()} "$@"\n'
    )
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setattr(native_library, "_torch_openmp", lambda: True)
    with pytest.warns(UserWarning, match=r"failed \(no openmp here\): the selection's C runs on one thread"):
        assert native_selection.top_k_in_order(torch.tensor([[0.1, 0.3, 0.2]]), 2).tolist() == [[1, 2]]
    assert Path(native_library._library()._name).name == "selection.so"  # not selection-openmp.so


@needs_compiler
def test_the_c_path_steps_aside_when_turned_off_or_for_k_it_does_not_take(monkeypatch):
    scores = torch.rand(1, 2, 16)
    assert native_selection.top_k_in_order(scores, 0) is None
    assert native_selection.top_k_in_order(scores, 17) is None
    one_row_of_words = torch.zeros(1, 16, dtype=torch.long)
    assert native_selection.spread_over_words(scores.expand(2, 2, 16), one_row_of_words) is None  # broadcast words
    monkeypatch.setenv("REFRESHKV_NATIVE", "0")
    assert native_selection.top_k_in_order(scores, 4) is None
    assert native_selection.spread_over_words(scores, one_row_of_words) is None


@needs_compiler
def test_c_gather_fills_every_slot_as_pytorch_does_from_a_strided_cache(fresh_build):
    generator = torch.Generator().manual_seed(2)
    for dtype, batch in ((torch.float32, 1), (torch.bfloat16, 2)):
        capacity, length, slots, k = 40, 30, 9, 7
        keys = torch.randn(batch, 3, capacity, 8, generator=generator).to(dtype)[:, :, :length]  # C_f's view
        values = torch.randn(batch, 3, capacity, 8, generator=generator).to(dtype)[:, :, :length]
        index = torch.randint(0, length, (batch, 3, k), generator=generator)
        outs = (torch.zeros(batch, 3, slots, 8, dtype=dtype), torch.zeros(batch, 3, slots, 8, dtype=dtype))
        assert native_selection.gather_rows_into(index, keys, values, *outs)
        padded = torch.cat([index, index[..., -1:].expand(batch, 3, slots - k)], -1)
        expected = gather_tokens(padded, keys, values)
        assert torch.equal(outs[0], expected[0]) and torch.equal(outs[1], expected[1])
        with pytest.raises(IndexError, match="outside the 30 tokens"):
            native_selection.gather_rows_into(index.masked_fill(index == index.max(), length), keys, values, *outs)
    wrong_type = torch.zeros(1, 3, 9, 8, dtype=torch.float16)
    assert not native_selection.gather_rows_into(
        index[:1], keys[:1].float(), values[:1].float(), wrong_type, wrong_type
    )


def refreshed_partial(monkeypatch, method, probs, valid, keys, values, spans, slots, native):
    """C_p as `method` refreshes it from window probabilities, with the C path on ("1") or off ("0")."""
    layer = SimpleNamespace(
        state=SimpleNamespace(
            partial=SelectionState.empty_like(keys, slots), question_positions=None, question_scores=None
        ),
        prompt_spans=spans,
        model_type="llama",
        budget=slots - 1,
    )
    with monkeypatch.context() as scoped:
        scoped.setenv("REFRESHKV_NATIVE", native)
        method.selection_rule(layer).refresh(layer, probs, valid, (keys, values))
    partial = layer.state.partial
    return (
        partial.store.keys,
        partial.store.values,
        partial.store.positions,
        partial.scores,
        partial.filled,
        partial.empty,
    )


@needs_compiler
def test_one_c_call_refreshes_the_partial_cache_as_the_pytorch_operators_do(monkeypatch):
    generator = torch.Generator().manual_seed(4)
    taken = []
    original = native_selection.refresh_partial
    monkeypatch.setattr(native_selection, "refresh_partial", lambda *a: taken.append(original(*a)) or taken[-1])
    cases = [
        # batch, group, window, slots, kernel, pooling, aggregation, pads, dtype
        (1, 3, 1, 9, 7, "span", "max", False, torch.float32),
        (1, 3, 1, 9, 7, "centered", "first", False, torch.bfloat16),
        (2, 1, 2, 51, 5, "forward", "max", True, torch.float32),  # k = every token
        (2, 3, 1, 12, 1, "centered", "max", True, torch.bfloat16),
        (2, 2, 3, 20, 3, "span", "max", True, torch.float32),
        (1, 3, 1, 9, 7, "centered", "mean", False, torch.float32),  # pools each head first: left to PyTorch
    ]
    for batch, group, window, slots, kernel, pooling, aggregation, pads, dtype in cases:
        capacity, length, prompt = 64, 50, 40
        keys = torch.randn(batch, 3, capacity, 8, generator=generator).to(dtype)[:, :, :length]  # C_f's view
        values = torch.randn(batch, 3, capacity, 8, generator=generator).to(dtype)[:, :, :length]
        probs = torch.randint(0, 5, (batch, 3, group, window, length), generator=generator).float() / 8  # plateaus
        starts = torch.rand(batch, prompt, generator=generator) < 0.4
        starts[:, 0] = True
        spans = starts.long().cumsum(-1) - 1
        valid = None
        if pads:  # row 0 starts with 6 pads
            valid = (torch.arange(length) >= torch.tensor([6] + [0] * (batch - 1))[:, None]).view(batch, 1, 1, length)
        method = RefreshKV(budget=slots - 1, kernel=kernel, pooling=pooling, aggregation=aggregation)
        arguments = (monkeypatch, method, probs, valid, keys, values, spans, slots)
        calls = len(taken)
        native, reference = refreshed_partial(*arguments, "1"), refreshed_partial(*arguments, "0")
        assert taken[calls:] == ([] if aggregation == "mean" else [True, False])  # C, then PyTorch operators
        for got, expected in zip(native, reference):
            assert torch.equal(got, expected) if isinstance(got, torch.Tensor) else got == expected, pooling


@pytest.fixture
def threads():
    """Sets torch's thread count for the test, restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@needs_compiler
def test_the_c_shares_its_work_between_threads_and_gives_the_same_results(monkeypatch, threads):
    """Long enough for several pieces of positions (1024) and of slots (256) per head, words cut between them; the
    library runs on PyTorch's own OpenMP threads where PyTorch has GNU OpenMP."""
    generator = torch.Generator().manual_seed(5)
    batch, length, prompt, slots = 2, 5000, 4990, 601
    keys = torch.randn(batch, 3, length + 8, 8, generator=generator)[:, :, :length]
    values = torch.randn(batch, 3, length + 8, 8, generator=generator)[:, :, :length]
    probs = torch.rand(batch, 3, 3, 1, length, generator=generator)
    starts = torch.rand(batch, prompt, generator=generator) < 0.3
    starts[:, 0] = True
    spans = starts.long().cumsum(-1) - 1
    valid = (torch.arange(length) >= torch.tensor([0, 37])[:, None]).view(batch, 1, 1, length)
    scores, index = probs[:, :, 0, 0], torch.randint(0, length, (batch, 3, slots - 1), generator=generator)
    refreshes = []  # every token kept shows every score; fewer, the top K
    for kept in (slots - 1, length):
        arguments = (monkeypatch, RefreshKV(budget=kept, kernel=7, pooling="span"), probs, valid, keys, values, spans)
        refreshes.append(((*arguments, kept + 1), refreshed_partial(*arguments, kept + 1, "0")))
    expected_spread = reference(monkeypatch, spread_over_spans, scores, spans)
    expected_top = reference(monkeypatch, top_k, scores, 700, valid.view(batch, 1, length))
    expected_rows = gather_tokens(torch.cat([index, index[..., -1:]], -1), keys, values)
    for count in (1, 2, 3):
        threads(count)
        for arguments, expected in refreshes:
            for got, wanted in zip(refreshed_partial(*arguments, "1"), expected):
                assert torch.equal(got, wanted) if isinstance(got, torch.Tensor) else got == wanted, count
        assert torch.equal(native_selection.spread_over_words(scores, spans), expected_spread), count
        assert torch.equal(native_selection.top_k_in_order(scores, 700, valid.view(batch, 1, length)), expected_top)
        outs = (torch.empty(batch, 3, slots, 8), torch.empty(batch, 3, slots, 8))
        assert native_selection.gather_rows_into(index, keys, values, *outs)
        assert torch.equal(outs[0], expected_rows[0]) and torch.equal(outs[1], expected_rows[1]), count
    if native_library._torch_openmp():
        assert native_library._library()._name.endswith("-openmp.so")


@needs_compiler
def test_a_compiled_selection_calls_the_same_c_as_eager(monkeypatch):
    torch._dynamo.reset()
    library, calls = native_library._library(), []

    class Recording:  # the library, noting which C function each call takes
        def __getattr__(self, name):
            calls.append(name)
            return getattr(library, name)

    monkeypatch.setattr(native_library, "_library", lambda: Recording())
    generator = torch.Generator().manual_seed(3)
    scores, cache = torch.rand(1, 3, 50, generator=generator), torch.randn(2, 1, 3, 50, 8, generator=generator)
    words = (torch.arange(40) // 3)[None]

    def select(scores, keys, values, key_out, value_out):
        index = top_k(spread_over_spans(scores, words), 10)
        assert native_selection.gather_rows_into(index, keys, values, key_out, value_out)
        return index

    each_step = ["spread_over_words", "top_k_in_order", "gather_rows"]
    eager_outs, compiled_outs = torch.zeros(2, 1, 3, 11, 8), torch.zeros(2, 1, 3, 11, 8)
    eager = select(scores, *cache, *eager_outs)
    assert calls == each_step
    compiled = torch.compile(select, fullgraph=True)(scores, *cache, *compiled_outs)
    assert calls == each_step * 2
    assert torch.equal(compiled, eager) and torch.equal(compiled_outs, eager_outs)

    def refresh(per_head, keys, values, *store):  # the refresh of a layer in one call
        assert native_selection.refresh_partial(per_head, False, (3, 3), words, None, 10, keys, values, store)

    def empty_store():  # keys, values, positions, scores of 11 slots
        return *torch.zeros(2, 1, 3, 11, 8), torch.zeros(1, 3, 11, dtype=torch.long), torch.zeros(1, 3, 11)

    per_head, eager_store, compiled_store = torch.rand(1, 3, 2, 50, generator=generator), empty_store(), empty_store()
    refresh(per_head, *cache, *eager_store)
    torch.compile(refresh, fullgraph=True)(per_head, *cache, *compiled_store)
    assert calls[-2:] == ["refresh_partial"] * 2
    assert all(torch.equal(compiled, eager) for compiled, eager in zip(compiled_store, eager_store))
    positions = eager_store[2]
    assert (positions[..., :10] >= 0).all() and (positions[..., 10] == -1).all()  # 10 kept, one slot emptied


@needs_compiler
@pytest.mark.parametrize("carry, floor", [(0.3, 0.0), (1.0, 0.0), (0.3, 0.8)])
def test_a_refresh_carries_the_held_scores_in_c_as_in_pytorch(monkeypatch, carry, floor):
    """Two refreshes in a row, a decoded token and an empty slot in C_p between them, with the question's selection
    as a floor or not: the same C_p either way."""

    generator = torch.Generator().manual_seed(6)
    batch, length, slots = 2, 300, 41
    keys = torch.randn(batch, 3, length, 8, generator=generator)
    values = torch.randn(batch, 3, length, 8, generator=generator)
    first, second = (torch.rand(batch, 3, 2, 1, length, generator=generator) ** 4 * scale for scale in (1, 0.2))
    method = RefreshKV(budget=slots - 1, kernel=5, pooling="centered", carry=carry, question_floor=floor)
    held = []
    for native in ("1", "0"):
        monkeypatch.setenv("REFRESHKV_NATIVE", native)
        state = SimpleNamespace(
            partial=SelectionState.empty_like(keys, slots), question_positions=None, question_scores=None
        )
        layer = SimpleNamespace(state=state, prompt_spans=None, budget=slots - 1, model_type="llama")
        method.selection_rule(layer).select_for_question(layer, first, None, (keys, values))
        partial = layer.state.partial
        partial.store.positions[:, :, -1], partial.scores[:, :, -1] = length - 1, APPENDED + 1  # a decoded token
        partial.store.positions[:, :, 0], partial.scores[:, :, 0] = -1, float("-inf")  # an emptied slot
        method.selection_rule(layer).refresh(layer, second, None, (keys, values))
        held.append((partial.store.positions.clone(), partial.scores.clone()))
    assert torch.equal(held[0][0], held[1][0]) and torch.equal(held[0][1], held[1][1])
    without = RefreshKV(budget=slots - 1, kernel=5, pooling="centered", carry=0.0)
    layer = SimpleNamespace(
        state=SimpleNamespace(
            partial=SelectionState.empty_like(keys, slots), question_positions=None, question_scores=None
        ),
        prompt_spans=None,
        budget=slots - 1,
        model_type="llama",
    )
    without.selection_rule(layer).refresh(layer, second, None, (keys, values))
    assert not torch.equal(layer.state.partial.store.positions, held[0][0])  # the carry changed the selection


@pytest.mark.parametrize("native", ["1", "0"])
def test_a_refresh_leaves_each_token_it_keeps_in_its_slot(monkeypatch, native):
    """C_p holds positions 10, 20, 30, 40 and a decoded 50 in its spare slot; the refresh selects 20, 35, 40 and 50:
    20 and 40 stay where they are, 35 and 50 (the spare slot is past K) take the freed slots 0 and 2 in position
    order, in C as in PyTorch, their keys and values with them."""
    monkeypatch.setenv("REFRESHKV_NATIVE", native)
    length, budget = 60, 4
    keys, values = torch.randn(1, 1, length, 8), torch.randn(1, 1, length, 8)
    probs = torch.full((1, 1, 1, 1, length), 0.001)
    probs[..., [20, 35, 40, 50]] = torch.tensor([0.2, 0.3, 0.1, 0.4])
    partial = SelectionState.empty_like(keys, budget + 1)
    partial.load(keys, values, torch.tensor([[[10, 20, 30, 40, 50]]]), torch.tensor([[[0.5, 0.4, 0.3, 0.2, 3.0]]]))
    layer = SimpleNamespace(
        state=SimpleNamespace(partial=partial, question_positions=None, question_scores=None),
        prompt_spans=None,
        budget=budget,
        model_type="llama",
    )
    RefreshKV(budget=budget, kernel=1, pooling="centered", carry=0.0, question_floor=0.0).selection_rule(layer).refresh(
        layer, probs, None, (keys, values)
    )
    held = [35, 20, 50, 40]
    assert partial.store.positions.tolist() == [[held + [-1]]]
    assert partial.scores[0, 0, :4].tolist() == pytest.approx([0.3, 0.2, 0.4, 0.1])
    assert torch.equal(partial.store.keys[0, 0, :4], keys[0, 0, held])
    assert torch.equal(partial.store.values[0, 0, :4], values[0, 0, held])


@needs_compiler
# dim: products in 16 lanes (16, 64, 80, 128) or one after another (40); value rows summed 64 floats at a time (64,
# 128), in part (16, 40) or both (80); an odd group sums its last head beside itself. With `wide` on an AVX-512 CPU:
# products 16 keys at a time (dims but 40), value rows for 4 query heads at a time (64, 256: Gemma 3; 128 with a
# last set of one)
@pytest.mark.parametrize("dim, group", [(16, 3), (40, 3), (64, 3), (80, 2), (128, 5), (256, 4)])
@pytest.mark.parametrize("wide", [0, 1])
def test_c_attends_to_the_marked_rows_where_they_lie_as_pytorch_does(threads, monkeypatch, dim, group, wide):
    """A full step for some rows of a batch (those that refresh), read from a strided C_f with a padded row, in more
    than one piece of positions, the last a partial tile: the marked rows' output and probabilities are PyTorch's."""
    from refreshkv.core.attention_math import SoftCapped, torch_attend_with_probs

    monkeypatch.setattr(native_attention, "_wide", lambda: wide)

    generator = torch.Generator().manual_seed(7)
    batch, kv_heads, length = 3, 2, 2100
    keys = torch.randn(batch, kv_heads, length + 9, dim, generator=generator)[:, :, :length]
    values = torch.randn(batch, kv_heads, length + 9, dim, generator=generator)[:, :, :length]
    query = torch.randn(batch, 1, kv_heads * group, dim, generator=generator).transpose(1, 2)  # as transformers'
    valid = torch.arange(length) >= torch.tensor([0, 5, 17])[:, None]
    expected_output, expected_probs = torch_attend_with_probs(
        query, keys, values, 0.25, valid.view(batch, 1, 1, length)
    )
    for marked in ([True, False, True], [False, True, False]):
        rows = torch.tensor(marked)
        for count in (1, 2):
            threads(count)
            output, probs = native_attention.attend_rows(query, keys, values, 0.25, valid, rows)
            # sums in spans, of products of dim values, against PyTorch's order, which moves with the CPU's kernels
            # (an Intel Xeon with AMX: 2.5e-6 at dim 128, 9.5e-6 at 256); a wrong loop is off by orders more
            atol = 1e-5 * max(1, dim // 128)
            torch.testing.assert_close(output[rows], expected_output[rows], rtol=0, atol=atol)
            # products in lanes (the Xeon: 2.0e-6 at dim 256)
            torch.testing.assert_close(probs[rows], expected_probs[rows], rtol=0, atol=2e-6 * max(1, dim // 128))
    rows = torch.tensor([True, False, True])
    assert native_attention.attend_rows(query, keys, values, SoftCapped(0.25, 50.0), valid, rows) is None
    assert native_attention.attend_rows(query, keys.bfloat16(), values.bfloat16(), 0.25, valid, rows) is None


@needs_compiler
@pytest.mark.parametrize("dim, group", [(16, 3), (40, 2), (64, 3), (128, 4)])
@pytest.mark.parametrize("wide", [0, 1])
def test_c_attends_each_request_to_its_own_store_in_one_call_as_pytorch_does(threads, monkeypatch, dim, group, wide):
    """Partial steps of several requests at once: each store of its own length (one a partial tile, one of a single
    token), the first slots of a store with room left, as a serving engine's C_p lies; each output is PyTorch's."""
    from refreshkv.core.attention_math import torch_attend_with_probs

    monkeypatch.setattr(native_attention, "_wide", lambda: wide)
    generator = torch.Generator().manual_seed(11)
    kv_heads, lengths = 2, (1100, 37, 1, 64)
    stores = []
    for length in lengths:
        keys, values = torch.randn(2, 1, kv_heads, length + 30, dim, generator=generator)
        stores.append((keys[:, :, :length], values[:, :, :length]))
    queries = torch.randn(len(lengths), kv_heads * group, dim, generator=generator)
    for count in (1, 2):
        threads(count)
        out = torch.full_like(queries, float("nan")) if count == 2 else None  # a served step's rows, written in place
        got = native_attention.attend_stores(queries, stores, 0.25, out=out)
        assert got is not None and (out is None or got is out)  # the C path
        for query, (keys, values), output in zip(queries, stores, got):
            expected, _ = torch_attend_with_probs(query.view(1, -1, 1, dim), keys, values, 0.25, None)
            torch.testing.assert_close(output, expected.view(-1, dim), rtol=0, atol=1e-5 * max(1, dim // 128))
    assert native_attention.attend_stores(queries, [(k.bfloat16(), v.bfloat16()) for k, v in stores], 0.25) is None


@needs_compiler
def test_c_attention_takes_a_mask_per_kv_head_and_runs_as_one_operator_when_compiled():
    """An eviction store's empty slots differ between KV heads: the C masks each head's own, eagerly and as the
    operator a compiled step calls, as PyTorch does."""
    from refreshkv.core.attention_math import torch_attend_with_probs

    generator = torch.Generator().manual_seed(9)
    batch, kv_heads, group, slots, dim = 2, 3, 3, 1100, 64
    keys = torch.randn(batch, kv_heads, slots, dim, generator=generator)
    values = torch.randn(batch, kv_heads, slots, dim, generator=generator)
    query = torch.randn(batch, kv_heads * group, 1, dim, generator=generator)
    valid = torch.rand(batch, kv_heads, slots, generator=generator) > 0.3
    expected_output, expected_probs = torch_attend_with_probs(query, keys, values, 0.125, valid)
    output, probs = native_attention.attend_rows(query, keys, values, 0.125, valid)
    torch.testing.assert_close(output, expected_output, rtol=0, atol=2e-6)
    torch.testing.assert_close(probs, expected_probs, rtol=0, atol=1e-6)
    assert probs[~valid.unsqueeze(2).expand_as(probs)].max() == 0  # each head's own empty slots get nothing

    def step(query, keys, values, valid, length):  # a full cache: its buffers sliced to the tokens held
        return native_attention.attend_rows(query, keys[:, :, :length], values[:, :, :length], 0.125, valid)

    buffers = [torch.cat([t, torch.randn(batch, kv_heads, 50, dim, generator=generator)], 2) for t in (keys, values)]
    compiled = torch.compile(step, fullgraph=True)
    with torch.inference_mode():
        output, probs = compiled(query, *buffers, valid, slots)
        graph = torch._dynamo.explain(step)(query, *buffers, valid, slots)
    torch.testing.assert_close(output, expected_output, rtol=0, atol=2e-6)
    torch.testing.assert_close(probs, expected_probs, rtol=0, atol=1e-6)
    assert "refreshkv.attend_rows" in str(graph.graphs[0].graph)


@needs_compiler
@pytest.mark.parametrize("carry", [0.0, 0.5])
def test_c_refreshes_only_the_marked_rows_as_the_pytorch_rows_path_does(monkeypatch, carry):
    """Rows that disagree at a query check: the rows that refresh get the C's selection, carrying C_p as it was
    before the step's token took a slot (`held`), the others keep C_p as it is, exactly as the PyTorch operators'
    row-by-row refresh and as a refresh of C_p without that token."""
    generator = torch.Generator().manual_seed(8)
    batch, length, slots = 3, 300, 41
    keys = torch.randn(batch, 3, length, 8, generator=generator)
    values = torch.randn(batch, 3, length, 8, generator=generator)
    first, second = (torch.rand(batch, 3, 2, 1, length, generator=generator) for _ in range(2))
    rows = torch.tensor([False, True, True])
    method = RefreshKV(budget=slots - 1, kernel=5, pooling="centered", carry=carry)
    taken, original = [], native_selection.refresh_partial
    monkeypatch.setattr(native_selection, "refresh_partial", lambda *a: taken.append(original(*a)) or taken[-1])
    refreshed = []
    for native, step_token in (("1", True), ("0", True), ("1", False)):
        monkeypatch.setenv("REFRESHKV_NATIVE", native)
        layer = SimpleNamespace(
            state=SimpleNamespace(
                partial=SelectionState.empty_like(keys, slots), question_positions=None, question_scores=None
            ),
            prompt_spans=None,
            budget=slots - 1,
            model_type="llama",
        )
        method.selection_rule(layer).refresh(layer, first, None, (keys, values))
        partial = layer.state.partial
        held = (partial.store.positions.clone(), partial.scores.clone())
        if step_token:  # the step's token took the slot of a selected one, as a partial step's does
            partial.store.positions[:, :, 3], partial.scores[:, :, 3] = length - 1, APPENDED + 1
        before = partial.store.positions.clone()
        method.selection_rule(layer).refresh(layer, second, None, (keys, values), rows, held=held)
        refreshed.append((partial.store.keys, partial.store.positions, partial.scores, partial.filled, partial.empty))
        assert torch.equal(partial.store.positions[0], before[0])  # the row that did not refresh
        assert not torch.equal(partial.store.positions[1:], before[1:])
    assert taken == [True, True, False, False, True, True]  # C, then PyTorch operators, then C
    for got, expected, alone in zip(*refreshed):
        assert torch.equal(got, expected) if isinstance(got, torch.Tensor) else got == expected
        if isinstance(got, torch.Tensor):  # the refreshed rows: as if the step's token had never been in C_p
            assert torch.equal(got[1:], alone[1:])


@needs_compiler
def test_c_writes_a_decoded_token_into_the_slot_pytorch_picks_ties_nans_and_strided_tokens_included(monkeypatch):
    """`SelectionState.put` in one call of C against PyTorch's argmin and scatter: each head's lowest slot (the
    first of equal scores, a NaN before any number), or the first free slot while C_p has room; the token read from
    a strided (B, H, 1, D) view, as a serving engine hands it."""
    generator = torch.Generator().manual_seed(3)
    for trial in range(60):
        batch, heads, slots, dim = 1 + trial % 2, 1 + trial % 3, 2 + trial % 7, 8
        like = torch.randn(batch, heads, 1, dim, generator=generator)
        step = torch.randn(batch, 2 * heads, 3, dim, generator=generator)
        key, value = step[:, ::2, 1:2], step[:, 1::2, 2:3]  # strided, as vLLM's query-key-value split
        scores = tied_scores(generator, (batch, heads, slots))
        if trial % 4 == 0:
            scores[0, -1, slots // 2] = float("nan")
        results = []
        for native in ("1", "0"):
            partial = SelectionState.empty_like(like, slots)
            partial.store.keys.normal_(generator=generator.manual_seed(trial))
            partial.scores.copy_(scores)
            partial.loaded(slots - 1 if trial % 3 == 0 else slots)  # a free slot: the plain write
            with monkeypatch.context() as scoped:
                scoped.setenv("REFRESHKV_NATIVE", native)
                partial.put(partial.scores, key, value, 40 + trial, APPENDED + trial)
            store = partial.store
            results.append((store.keys, store.values, store.positions, partial.scores, partial.filled, partial.empty))
        ours, theirs = results
        for mine, reference_value in zip(ours, theirs):
            if isinstance(mine, torch.Tensor):
                assert torch.equal(mine.nan_to_num(), reference_value.nan_to_num()), trial
                assert torch.equal(mine.isnan(), reference_value.isnan()), trial
            else:
                assert mine == reference_value, trial
        written = (ours[2] == 40 + trial).sum(dim=-1)
        assert bool((written == 1).all()), trial  # one slot per head took the token
