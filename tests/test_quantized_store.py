"""A full cache in few bits (core/quantized_store.py, core/full_cache.py) and `refreshkv`/`recycled` over it."""

import pytest
import torch
from conftest import tiny_model

from refreshkv import PolicyError, generate, make_policy
from refreshkv.core.quantized_store import QuantizedFullStore, pack, quantize, unpack


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
