"""Weight layouts (weight_layout.py, packed_linear.py) and one profiled decode step (profile_step.py)."""

import json

import pytest
import torch
from conftest import random_prompt, tiny_model
from test_bad_input import WordTokenizer, assert_one_line_error, cli, no_model, tiny_loader  # noqa: F401  (fixtures)

from refreshkv import generate, make_policy
from refreshkv.measure.bench import weight_bytes, weight_bytes_read
from refreshkv.measure.profile_step import profile_step
from refreshkv.runtime import weight_layout
from refreshkv.runtime.packed_linear import PackedLinear, packing_problem


def lies_transposed(weight: torch.Tensor) -> bool:
    return weight.stride() == (1, weight.shape[0])


def fake_timing(monkeypatch, transposed_share: dict[int, float]):
    """Time a group as 1.0 in the stored layout and as `transposed_share[out_features]` transposed."""

    def seconds(weights):
        share = transposed_share.get(weights[0].shape[0], 1.0)
        return share if lies_transposed(weights[0]) else 1.0

    monkeypatch.setattr(weight_layout, "product_seconds", seconds)


def test_fastest_layout_moves_the_shapes_measured_faster_and_keeps_the_values(monkeypatch):
    model = tiny_model("llama", layers=2, tie_word_embeddings=True)
    before = {name: weight.clone() for name, weight in model.named_parameters()}
    ids = random_prompt(30)
    stored = generate(model, ids, method="full", max_new_tokens=8, eos_token_id=[], return_logits=True)
    # 128 rows: the tied output projection and the MLP's up/gate (intermediate 128); 64 rows: q, o, down
    fake_timing(monkeypatch, {128: 0.5, 64: 0.95})  # 0.95: within the margin, so a near tie keeps the layout
    chosen = weight_layout.set_weight_layout(model, "fastest")
    assert chosen == {"64x64": "stored", "32x64": "stored", "128x64": "transposed", "64x128": "stored"}
    assert lies_transposed(model.model.layers[0].mlp.up_proj.weight)
    assert not lies_transposed(model.model.layers[0].self_attn.q_proj.weight)
    assert model.lm_head.weight is model.model.embed_tokens.weight and lies_transposed(model.lm_head.weight)
    for name, weight in model.named_parameters():
        assert torch.equal(weight, before[name])
    moved = generate(model, ids, method="full", max_new_tokens=8, eos_token_id=[], return_logits=True)
    assert moved.tokens == stored.tokens
    for a, b in zip(moved.logits, stored.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_stored_layout_leaves_the_model_alone(monkeypatch):
    model = tiny_model("llama", layers=1)
    fake_timing(monkeypatch, {128: 0.1, 64: 0.1, 32: 0.1})
    assert weight_layout.set_weight_layout(model, "stored") == {}
    assert not any(lies_transposed(w) for w in model.parameters() if w.ndim == 2)


def test_the_real_timing_runs_on_tiny_weights():
    seconds = weight_layout.product_seconds([torch.randn(8, 4), torch.randn(8, 4)])
    assert 0 < seconds < 1


def test_bad_weight_layout_is_one_line_before_loading(no_model, monkeypatch, capsys):
    code, _, err = cli(monkeypatch, capsys, "generate", "--prompt", "hello", "--weight-layout", "fast")
    assert_one_line_error(code, err, "unknown weight layout 'fast'; choose from: stored, fastest, packed")


def test_profile_step_records_the_asked_step():
    model = tiny_model("llama", layers=2)
    ids = random_prompt(30)
    full_step = profile_step(model, ids, make_policy("recycled", stride=4, budget=8), step=8, top=5, rounds=2)
    partial_step = profile_step(model, ids, make_policy("recycled", stride=4, budget=8), step=7, top=5, rounds=1)
    assert (full_step["full_layers"], partial_step["full_layers"]) == (2, 0)
    assert full_step["context"] == 38 and full_step["rounds"] == 2 and len(full_step["operators"]) == 5
    times = [op["self_cpu_ms"] for op in full_step["operators"]]
    assert times == sorted(times, reverse=True) and times[0] > 0
    assert {op["name"] for op in full_step["operators"]} & {"aten::mm", "aten::bmm", "aten::matmul"}


def test_profile_cli_prints_json(tiny_loader, monkeypatch, capsys):
    code, out, err = cli(
        monkeypatch,
        capsys,
        "profile",
        "--method",
        "refreshkv",
        "--param",
        "budget=16",
        "--length",
        "60",
        "--step",
        "10",
        "--top",
        "3",
        "--json",
    )
    assert code == 0, err
    result = json.loads(out)
    assert result["method"] == "refreshkv" and result["context"] == 60 and len(result["operators"]) == 3
    assert result["machine"]["weight_layout"] == "stored"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--length", "20", "--step", "10"], "--length 20 leaves fewer than 16 prompt tokens before step 10"),
        (["--param", "stride=0"], "stride must be an integer >= 1"),
        (["--weight-layout", "rows"], "unknown weight layout 'rows'"),
    ],
)
def test_profile_bad_input_is_one_line_before_loading(args, message, no_model, monkeypatch, capsys):
    code, _, err = cli(monkeypatch, capsys, "profile", "--method", "recycled", *args)
    assert_one_line_error(code, err, message)


def test_packed_layout_gives_the_stored_layouts_tokens_for_one_row_and_a_batch():
    model = tiny_model("llama", layers=2, tie_word_embeddings=True)
    rows = random_prompt(30, batch=2)
    stored = [
        generate(model, ids, method="refreshkv", max_new_tokens=8, eos_token_id=[], return_logits=True)
        for ids in (rows[:1], rows)
    ]
    read_before = weight_bytes_read(model)
    chosen = weight_layout.set_weight_layout(model, "packed")
    assert chosen == {"64x64": "packed", "32x64": "packed", "128x64": "packed", "64x128": "packed"}
    assert all(not isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.weight.is_mkldnn
    # the embedding lookup keeps its dense table; the output projection reads a packed copy of it
    assert not model.model.embed_tokens.weight.is_mkldnn
    assert weight_bytes_read(model) == read_before < weight_bytes(model)
    packed = [
        generate(model, ids, method="refreshkv", max_new_tokens=8, eos_token_id=[], return_logits=True)
        for ids in (rows[:1], rows)
    ]
    for before, after in zip(stored, packed):
        assert after.tokens == before.tokens
        for a, b in zip(after.logits, before.logits):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_packed_linear_takes_bias_and_batched_prompts():
    linear = torch.nn.Linear(24, 40)
    x = torch.randn(3, 7, 24).transpose(0, 1)  # not contiguous
    torch.testing.assert_close(PackedLinear(linear)(x), linear(x), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no oneDNN bfloat16 kernels here")
def test_packed_layout_in_bfloat16_is_the_stored_product():
    linear = torch.nn.Linear(64, 96, bias=False).to(torch.bfloat16)
    x = torch.randn(4, 1, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(PackedLinear(linear)(x), linear(x), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "device, dtype, message",
    [
        ("cuda", torch.float32, "the packed weight layout is for the CPU (oneDNN), not cuda"),
        ("cpu", torch.float16, "takes float32 or bfloat16 weights, not torch.float16"),
    ],
)
def test_packing_problems_are_named(device, dtype, message):
    assert message in packing_problem(device, dtype)
    assert packing_problem("cpu", torch.float32) is None


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_packed_layout_compiles_to_the_eager_tokens(family):
    model = tiny_model(family, layers=2, tie_word_embeddings=True)
    weight_layout.set_weight_layout(model, "packed")
    ids = random_prompt(30, batch=2)
    runs = [
        generate(model, ids, method=method, max_new_tokens=6, eos_token_id=[], return_logits=True, compile=compile)
        for method in (make_policy("full"), make_policy("snapkv", budget=16, window=4))
        for compile in (False, True)
    ]
    for eager, compiled in (runs[:2], runs[2:]):
        assert compiled.tokens == eager.tokens
        for a, b in zip(compiled.logits, eager.logits):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_step_reads_the_output_projection_not_an_untied_input_table():
    model = tiny_model("llama", layers=1, tie_word_embeddings=False)
    table = model.model.embed_tokens.weight
    assert weight_bytes_read(model) == weight_bytes(model) - table.numel() * table.element_size()
    tied = tiny_model("llama", layers=1, tie_word_embeddings=True)
    assert weight_bytes_read(tied) == weight_bytes(tied)
