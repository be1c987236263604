"""A full cache in few bits (core/quantized_store.py, core/full_cache.py) and `refreshkv`/`recycled` over it."""

from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_model

from refreshkv import PolicyError, generate, make_policy
from refreshkv.core import native_library
from refreshkv.core.attention_math import SoftCapped, torch_attend_with_probs
from refreshkv.core.quantized_store import QuantizedFullStore, pack, quantize, unpack
from refreshkv.core.selection import SelectionState
from refreshkv.methods.refreshkv import RefreshKV

needs_compiler = pytest.mark.skipif(native_library._compiler() is None, reason="no C compiler on this machine")


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_each_element_moves_by_at_most_half_its_groups_step(bits):
    x = torch.randn(3, 5, 64) * torch.linspace(0.1, 10, 64)  # groups of very different ranges
    codes, scale, low = quantize(x, bits, dim=1)
    assert codes.max() <= 2**bits - 1 and scale.shape == (3, 1, 64)
    restored = codes.float() * scale + low
    assert ((restored - x).abs() <= scale / 2 + 1e-6 * x.abs().amax()).all()
    constant = torch.full((2, 4, 8), 0.7)
    codes, scale, low = quantize(constant, bits, dim=1)
    assert torch.equal(codes.float() * scale + low, constant)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_packing_round_trips(bits):
    codes = torch.randint(0, 2**bits, (2, 3, 16), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (2, 3, 16 * bits // 8)
    assert torch.equal(unpack(packed, bits), codes)


def _tokens(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, n, 16, generator=g), torch.randn(2, 3, n, 16, generator=g)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_store_reads_back_every_token_within_the_bound_and_the_residual_exactly(bits):
    group = 8
    keys, values = _tokens(29)
    store = QuantizedFullStore(keys[:, :, :1], capacity=12, bits=bits, group_size=group)  # grows while appending
    store.append(keys[:, :, :19], values[:, :, :19])  # 2 groups straight from the prompt, 3 tokens wait
    for t in range(19, 29):
        store.append(keys[:, :, t : t + 1], values[:, :, t : t + 1])
    assert (store.length, store.groups, store.pending) == (29, 3, 5)
    read_keys, read_values = store.view()
    assert read_keys.shape == keys.shape
    assert torch.equal(read_keys[:, :, 24:], keys[:, :, 24:]) and torch.equal(read_values[:, :, 24:], values[:, :, 24:])
    # keys: a step per channel and group of tokens; values: a step per token and group of channels
    key_range = keys[:, :, :24].reshape(2, 3, 3, group, 16)
    key_step = (key_range.amax(3) - key_range.amin(3)) / (2**bits - 1)  # (2, 3, 3, 16)
    key_error = (read_keys[:, :, :24] - keys[:, :, :24]).abs().reshape(2, 3, 3, group, 16)
    assert (key_error <= key_step.unsqueeze(3) / 2 + 1e-5).all()
    value_range = values[:, :, :24].reshape(2, 3, 24, 2, group)
    value_step = (value_range.amax(4) - value_range.amin(4)) / (2**bits - 1)
    value_error = (read_values[:, :, :24] - values[:, :, :24]).abs().reshape(2, 3, 24, 2, group)
    assert (value_error <= value_step.unsqueeze(4) / 2 + 1e-5).all()
    assert store.kept(None)[0, 0].tolist() == list(range(29))
    for start, end in [(0, 4), (3, 20), (16, 29), (25, 29), (22, 27), (0, 29)]:  # spans, across groups and residual
        span_keys, span_values = store.span(start, end)
        assert torch.equal(span_keys, read_keys[:, :, start:end]) and torch.equal(
            span_values, read_values[:, :, start:end]
        )


def test_bytes_reported_are_the_sum_of_every_tensor_held():
    keys, values = _tokens(40)
    for bits in (8, 4, 2):
        store = QuantizedFullStore(keys, capacity=50, bits=bits, group_size=8)
        store.append(keys, values)
        held = [t for t in vars(store).values() if isinstance(t, torch.Tensor)]
        assert store.nbytes() == sum(t.numel() * t.element_size() for t in held)
        dense = 2 * keys.numel() * keys.element_size()
        # 40 tokens: 5 groups; codes bits/8 per element, a scale and a minimum per 8 elements, 8 residual tokens
        codes = 2 * keys.numel() * bits // 8
        steps = 2 * 2 * keys.numel() // 8 * 4
        assert store.attended_bytes() == codes + steps + 2 * 2 * 3 * 8 * 16 * 4
        assert store.attended_bytes() < dense


def _held_store(bits, length=77, dim=32, seed=4):
    """A quantized C_f of 3 rows, 2 KV heads and `length` tokens: whole groups of 8 from a prompt, then one token at a
    time (77 tokens: 9 groups and 5 in the residual)."""
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(3, 2, length, dim, generator=g), torch.randn(3, 2, length, dim, generator=g)
    store = QuantizedFullStore(keys[:, :, :1], capacity=40, bits=bits, group_size=8)
    store.append(keys[:, :, :70], values[:, :, :70])
    for t in range(70, length):
        store.append(keys[:, :, t : t + 1], values[:, :, t : t + 1])
    return store


@needs_compiler
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_a_full_step_reads_the_codes_where_they_lie_as_attention_over_the_dequantized_cache(bits):
    """`attend` (the C over the codes, the residual dense) gives what attending to `view()` gives, up to the order of
    float sums, for the rows asked for, whatever the threads; pads get no attention."""
    store = _held_store(bits)
    assert (store.groups, store.pending) == (9, 5)
    query = torch.randn(3, 6, 1, 32, generator=torch.Generator().manual_seed(5))
    valid = torch.ones(3, 1, 1, 77, dtype=torch.bool)
    valid[1, ..., :10] = False  # a left-padded row
    expected_output, expected_probs = torch_attend_with_probs(query, *store.view(), 0.17, valid)
    before = torch.get_num_threads()
    try:
        for rows, count in ((None, 1), (torch.tensor([False, True, True]), 2)):
            torch.set_num_threads(count)
            output, probs = store.attend(query, 0.17, valid, rows)
            marked = torch.ones(3, dtype=torch.bool) if rows is None else rows
            torch.testing.assert_close(output[marked], expected_output[marked], rtol=0, atol=2e-5)
            torch.testing.assert_close(probs[marked], expected_probs[marked], rtol=0, atol=1e-6)
            assert probs[1, ..., :10].max() == 0
    finally:
        torch.set_num_threads(before)


@needs_compiler
def test_a_full_step_over_codes_steps_aside_where_the_c_cannot(monkeypatch):
    store, query = _held_store(4), torch.randn(3, 6, 1, 32)
    assert store.attend(query, SoftCapped(0.17, 50.0), None) is None  # Gemma 2's soft-capping
    assert _held_store(4, dim=24).attend(torch.randn(3, 6, 1, 24), 0.17, None) is None  # not a multiple of 16
    monkeypatch.setenv("REFRESHKV_NATIVE", "0")
    assert store.attend(query, 0.17, None) is None


@needs_compiler
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_gather_reads_the_tokens_asked_for_exactly_as_view_does_into_the_first_slots(bits):
    store = _held_store(bits)
    index = torch.randint(0, 77, (3, 2, 11), generator=torch.Generator().manual_seed(6))
    index[0, 0, :3] = torch.tensor([0, 71, 76])  # the first token and two of the residual
    slots = (torch.full((3, 2, 14, 32), 7.0), torch.full((3, 2, 14, 32), 7.0))
    assert store.gather(index, slots)
    whole_keys, whole_values = store.view()
    rows = index[..., None].expand(-1, -1, -1, 32)
    assert torch.equal(slots[0][:, :, :11], whole_keys.gather(2, rows))
    assert torch.equal(slots[1][:, :, :11], whole_values.gather(2, rows))
    assert (slots[0][:, :, 11:] == 7).all() and (slots[1][:, :, 11:] == 7).all()
    assert not store.gather(index, (slots[0].bfloat16(), slots[1].bfloat16()))  # another type: nothing written


@needs_compiler
@pytest.mark.parametrize("rows", [None, (False, True, True)])
def test_a_refresh_from_a_quantized_cache_loads_what_a_refresh_from_its_dequantized_tokens_loads(rows):
    """The tokens selected from C_f in codes are dequantized alone (`gather`) into C_p: the same slots, positions,
    scores, keys and values as a refresh reading the whole dequantized C_f, for the rows that refresh."""
    store = _held_store(4)
    probs = torch.rand(3, 2, 3, 1, 77, generator=torch.Generator().manual_seed(7))
    marked = None if rows is None else torch.tensor(rows)
    method = RefreshKV(budget=20, kernel=3, pooling="centered", carry=0.5)
    refreshed = []
    for source in (store, store.view()):
        layer = SimpleNamespace(
            state=SimpleNamespace(
                partial=SelectionState.empty_like(store.residual_keys, 21),
                question_positions=None,
                question_scores=None,
            )
        )
        layer.prompt_spans, layer.budget, layer.model_type = None, 20, "llama"
        method.selection_rule(layer).refresh(layer, probs, None, source, marked)
        partial = layer.state.partial
        kept = partial.store.keys[:, :, :20], partial.store.values[:, :, :20]  # K = 20: the 21st slot is empty
        refreshed.append((*kept, partial.store.positions, partial.scores, partial.filled, partial.empty))
    for from_codes, from_view in zip(*refreshed):
        assert torch.equal(from_codes, from_view) if isinstance(from_codes, torch.Tensor) else from_codes == from_view


@needs_compiler
def test_refreshkv_over_an_int4_cache_decodes_as_over_its_dequantized_tokens(monkeypatch):
    """The whole method: full steps over the codes (the C) against full steps over `view()` (the PyTorch operators):
    the same tokens, logits within float rounding, on a left-padded batch whose rows once disagree at a check."""
    model = tiny_model("llama", layers=2, seed=5)
    ids = torch.randint(3, 128, (2, 90), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    results, calls, attend = [], [], QuantizedFullStore.attend

    def counted(store, query, scaling, valid, rows=None):
        calls.append((rows, attend(store, query, scaling, valid, rows)))
        return calls[-1][1]

    monkeypatch.setattr(QuantizedFullStore, "attend", counted)
    for native in ("1", "0"):
        monkeypatch.setenv("REFRESHKV_NATIVE", native)
        policy = make_policy("refreshkv", budget=24, qc_stride=2, threshold=0.5, full_cache="int4", group_size=8)
        out = generate(model, ids, mask, method=policy, max_new_tokens=10, eos_token_id=[], return_logits=True)
        results.append((out.tokens, torch.stack(out.logits)))
        if native == "1":  # every full step read the codes, one of them for one row of the two
            assert calls and all(result is not None for _, result in calls)
            assert any(rows is not None and rows.tolist() == [False, True] for rows, _ in calls)
    assert results[0][0] == results[1][0]
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=1e-4)


def _decode(model, method, ids, steps=12):
    out = generate(model, ids, method=method, max_new_tokens=steps, return_logits=True)
    return out, torch.stack([step[0] for step in out.logits])


@pytest.mark.parametrize(
    "name, params",
    [
        ("recycled", {"stride": 3}),
        ("refreshkv", {"qc_stride": 2, "threshold": 1.0}),
        ("streamingllm++", {"stride": 3}),
    ],
)
def test_int8_full_cache_at_full_budget_is_full_attention_within_quantization_error(name, params):
    """With every token in C_p and a full step every few steps, the only difference from `full` is int8 rounding of
    C_f (read at full steps and copied into C_p at refreshes): relative error <= 1/510 of each group's range, which
    moves logits of this model by well under 1% of their spread. int4 and int2 move them more, in that order."""
    model = tiny_model("llama", layers=3, seed=2)
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(1))
    full_out, full_logits = _decode(model, "full", ids)
    errors = {}
    for cache in ("int8", "int4", "int2"):
        policy = make_policy(name, budget=1000, full_cache=cache, group_size=8, **params)
        out, logits = _decode(model, policy, ids)
        assert out.cache.full_step_fraction() > 0.25  # C_f was read
        errors[cache] = ((logits - full_logits).abs().max() / full_logits.std()).item()
        if cache == "int8":
            assert out.tokens == full_out.tokens
    assert errors["int8"] < 0.01 < errors["int2"] and errors["int8"] < errors["int4"] < errors["int2"]


@pytest.mark.parametrize("padded", [False, True])
def test_streamingllm_pp_partial_steps_read_spans_of_a_quantized_full_cache(padded):
    """Sinks + recent window dequantized from the spans they occupy: int8 stays within rounding of dense."""
    model = tiny_model("llama", layers=2, seed=3)
    rows = [torch.randint(3, 128, (70,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    ids = torch.stack(rows) if not padded else torch.cat([torch.zeros(1, 70, dtype=torch.long), rows[1][None]])
    mask = None if not padded else torch.cat([torch.zeros(1, 70), torch.ones(1, 70)]).long()
    if padded:
        mask[0, 9:] = 1
        ids[0, 9:] = rows[0][:61]
    logits = {}
    for cache in ("dense", "int8"):
        policy = make_policy("streamingllm++", budget=20, stride=5, full_cache=cache, group_size=8)
        out = generate(model, ids, mask, method=policy, max_new_tokens=8, eos_token_id=[], return_logits=True)
        logits[cache] = torch.stack(out.logits)
    assert ((logits["int8"] - logits["dense"]).abs().max() / logits["dense"].std()) < 0.01


def test_refreshkv_holds_less_with_a_quantized_full_cache_and_counts_it():
    model = tiny_model("llama", layers=2, seed=0)
    ids = torch.randint(3, 128, (1, 96), generator=torch.Generator().manual_seed(0))
    held = {}
    for cache in ("dense", "int8", "int4", "int2"):
        out = generate(
            model, ids, method=make_policy("recycled", budget=12, full_cache=cache, group_size=8), max_new_tokens=4
        )
        state = out.cache.layers[0].state
        assert out.cache.nbytes_per_layer()[0] == state.full.nbytes() + state.partial.nbytes()
        held[cache] = state.full.nbytes()
    assert held["int2"] < held["int4"] < held["int8"] < held["dense"]


@pytest.mark.parametrize(
    "params, message",
    [
        ({"full_cache": "int3"}, "unknown full_cache 'int3'; choose from: dense, int8, int4, int2, offload"),
        ({"group_size": 0}, "group_size must be an integer >= 1"),
    ],
)
def test_bad_full_cache_settings_are_one_line(params, message):
    with pytest.raises(PolicyError, match=message):
        make_policy("refreshkv", **params)


def test_offload_without_a_gpu_names_the_choices():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(PolicyError, match="no CUDA GPU is available; choose from: dense, int8, int4, int2$"):
        make_policy("recycled", full_cache="offload")


def test_group_size_must_divide_the_head_dimension():
    model = tiny_model("llama", layers=2)  # head dimension 16
    ids = torch.randint(3, 128, (1, 20))
    with pytest.raises(PolicyError, match="group_size 12 must divide the head dimension 16; choose from: 8, 16"):
        generate(model, ids, method=make_policy("refreshkv", full_cache="int4", group_size=12), max_new_tokens=2)


def test_bytes_by_device_add_up_to_the_bytes_held():
    model = tiny_model()
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(1))
    for method, params in [("refreshkv", {"full_cache": "int4", "group_size": 8}), ("snapkv", {"window": 4})]:
        stats = generate(model, ids, method=method, budget=16, max_new_tokens=5, **params).stats()
        assert stats["kv_bytes_by_device"] == {"cpu": stats["kv_bytes_full"]}
