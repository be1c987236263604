"""Decode steps with the per-step numbers on the device (runtime/static_decode.py): the same tokens, logits and
refresh decisions as the package's eager decoding, on the CPU (where the steps run without graphs); the Triton
kernel against PyTorch's attention where Triton is installed (its interpreter runs it on the CPU)."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import random_prompt, tiny_model

from refreshkv import generate, make_policy
from refreshkv.core.device_steps import only_if
from refreshkv.core.kvstore import FullStore
from refreshkv.core.policy import PolicyError
from refreshkv.runtime.generate import decode, prefill
from refreshkv.runtime.generation_settings import DecodeSettings
from refreshkv.runtime.static_decode import StaticCache, StaticDecoder

NEW = 20
METHODS = [
    ("full", {}),
    ("snapkv", {"budget": 40}),
    ("recycled", {"budget": 16, "stride": 4}),
    ("refreshkv", {"budget": 16}),  # word spans, QC every 10 steps
    ("refreshkv", {"budget": 16, "qc_stride": 2, "threshold": 0.98, "pooling": "centered"}),  # rows disagree
    ("refreshkv", {"budget": 16, "qc_stride": 2, "threshold": 0.98, "keep_decoded": True}),  # the answer held
]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=3)


def static_run(model, name, params, prompt, new_tokens=NEW, announced=None, **options):
    """`new_tokens` static steps from a cache told of `announced` new tokens (by default as many)."""
    cache = StaticCache(make_policy(name, **params), model, max_new_tokens=announced or new_tokens)
    with torch.inference_mode():
        logits, _ = prefill(model, prompt, torch.ones_like(prompt), cache)
        for layer in cache.layers:  # what a reused allocation may hold where no token was written yet
            full = getattr(layer.state, "full", layer.state)
            if isinstance(full, FullStore):
                full.keys[:, :, full.length :] = float("nan")
                full.values[:, :, full.length :] = float("nan")
        out = StaticDecoder(model, cache, logits, new_tokens, keep_logits=True, **options).run(graphs=False)
    return cache, out


@pytest.mark.parametrize("name, params", METHODS)
def test_static_steps_decode_as_eager(model, name, params, one_thread):
    prompt = random_prompt(96, batch=2)  # two distinct rows: the query check may decide each its own way
    settings = {"max_new_tokens": NEW, "return_logits": True, "eos_token_id": []}  # static steps do not stop at EOS
    eager = generate(model, prompt, method=make_policy(name, **params), **settings)
    _, out = static_run(model, name, params, prompt)
    assert out.tokens == eager.tokens
    assert torch.allclose(out.logits, torch.stack(eager.logits), atol=1e-4)
    assert out.full_share == pytest.approx(eager.cache.full_step_fraction())
    kinds = {"full": {"plain"}, "snapkv": {"plain"}, "recycled": {"partial", "full"}}
    assert set(out.kinds) == kinds.get(name, {"partial", "check"})


def state_tensors(state, found=None) -> dict[str, int]:
    """Where each tensor of a layer state lies (name -> data pointer), nested states included."""
    found = {} if found is None else found
    for name, value in vars(state).items():
        if isinstance(value, torch.Tensor):
            found[f"{id(state)}.{name}"] = value.data_ptr()
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            state_tensors(value, found)
    return found


@pytest.mark.parametrize("name, params", METHODS)
def test_static_steps_write_every_state_in_place(model, name, params, one_thread):
    """A step replayed from a CUDA graph writes into the memory it was captured with: a state tensor that a step
    replaced by a new one (instead of writing into it) would be read stale by every later replay."""
    cache = StaticCache(make_policy(name, **params), model, max_new_tokens=NEW)
    with torch.inference_mode():
        logits, _ = prefill(model, random_prompt(96, batch=2), torch.ones(2, 96, dtype=torch.long), cache)
    before = [state_tensors(layer.state) for layer in cache.layers]
    StaticDecoder(model, cache, logits, NEW).run(graphs=False)
    assert [state_tensors(layer.state) for layer in cache.layers] == before


def test_rows_decide_apart_at_a_query_check(model, one_thread):
    """With a high threshold some QC steps refresh one row and not the other (the case `torch.where` joins)."""
    name, params = METHODS[-1]
    _, out = static_run(model, name, params, random_prompt(96, batch=2))
    # per layer and check step, the share of rows that refreshed: 0.5 somewhere means the rows disagreed
    assert 0 < out.full_share < 0.5


@pytest.mark.parametrize("name, params", [METHODS[0], METHODS[3]])
def test_the_cache_goes_on_eagerly_after_static_steps(model, name, params, one_thread):
    prompt = random_prompt(96, seed=4)
    whole = generate(model, prompt, method=make_policy(name, **params), max_new_tokens=3 * NEW - 1, eos_token_id=[])
    # the cache is told of every token the eager run decodes: keep_decoded sizes C_p by them
    cache, out = static_run(model, name, params, prompt, new_tokens=2 * NEW, announced=3 * NEW - 1)
    with torch.inference_mode():
        rest = decode(
            model,
            cache,
            out.logits[-1],  # the last step's logits: its token is the eager loop's first
            torch.ones(1, 96 + 2 * NEW - 1, dtype=torch.long),  # the prompt and the tokens fed so far
            NEW,
            DecodeSettings(),
            torch.tensor([], dtype=torch.long),
            None,
            False,
            False,
        )
    assert out.tokens[0][:-1] + rest.tokens[0] == whole.tokens[0]


def test_a_refresh_runs_only_where_a_row_drifted():
    ran = []
    for flag in (False, True):
        only_if(torch.tensor(flag), lambda flag=flag: ran.append(flag), conditional=True)
    assert ran == [True]


def test_compiled_static_steps_decode_as_eager(model, one_thread):
    prompt = random_prompt(64)
    eager = generate(model, prompt, method="full", max_new_tokens=8, eos_token_id=[])
    _, out = static_run(model, "full", {}, prompt, new_tokens=8, compile=True)
    assert out.tokens == eager.tokens


@pytest.mark.parametrize(
    "name, params, change, message",
    [
        ("streamingllm", {"budget": 16}, None, "evict by their stored scores; got 'streamingllm'"),
        ("full", {}, "padded", "rows of one length, without padding"),
        ("full", {}, "longer", "holds the 4 new tokens announced to the cache; 5 asked for"),
        ("full", {}, "not prefilled", "prefill the StaticCache first"),
        ("full", {}, "graphs", "CUDA graphs need a CUDA device"),
    ],
)
def test_what_static_decoding_refuses(model, name, params, change, message):
    cache = StaticCache(make_policy(name, **params), model, max_new_tokens=4)
    prompt = random_prompt(40)
    mask = torch.ones_like(prompt)
    if change == "padded":
        mask[:, :3] = 0
    with torch.inference_mode(), pytest.raises((PolicyError, ValueError), match=message):
        logits = torch.zeros(1, 128) if change == "not prefilled" else prefill(model, prompt, mask, cache)[0]
        decoder = StaticDecoder(model, cache, logits, 5 if change == "longer" else 4)
        decoder.run(graphs=change == "graphs")


TRITON_CHECK = """
import torch
from refreshkv.core import triton_decode
from refreshkv.core.attention_math import torch_attend_with_probs

torch.manual_seed(0)
batch, query_heads, kv_heads, n = 3, 6, 2, 300
query = torch.randn(batch, query_heads, 1, 16)
keys, values = torch.randn(batch, kv_heads, n, 16), torch.randn(batch, kv_heads, n, 16)
positions = torch.where(torch.rand(batch, kv_heads, n) < 0.3, -1, 7)
rows = torch.tensor([True, False, True])
assert triton_decode.available(query, keys)
assert not triton_decode.available(torch.zeros(1, 4, 1, 96), torch.zeros(1, 2, 8, 96))  # head size: PyTorch's path
for where, valid in (
    ({"length": torch.tensor([257])}, (torch.arange(n) < 257).view(1, 1, n)),
    ({"positions": positions}, positions >= 0),
):
    out, probs = triton_decode.one_query_attention(query, keys, values, 0.25, **where, rows=rows, keep_logits=True)
    reference, reference_probs = torch_attend_with_probs(query, keys, values, 0.25, valid)
    assert torch.allclose(out[rows], reference[rows], atol=1e-5), where.keys()
    assert torch.allclose(probs[rows], reference_probs[rows], atol=1e-6), where.keys()
# compiled, the kernel is an operator that torch.compile calls as it is
length = torch.tensor([257])
compiled = torch.compile(
    lambda q, k, v: triton_decode.one_query_attention(q, k, v, 0.25, length=length)[0] * 2, fullgraph=True
)
assert torch.equal(compiled(query, keys, values), triton_decode.one_query_attention(query, keys, values, 0.25, length=length)[0] * 2)
print("same")
"""


def test_triton_kernel_attends_as_pytorch():
    """The split-K kernel against PyTorch's attention in float32, by length and by slot positions, with rows chosen
    by a flag, keeping the probabilities, and under torch.compile: on the CPU through Triton's interpreter, which must be on before Triton
    is imported (a process of its own). Skipped where Triton is not installed (it is not a dependency)."""
    pytest.importorskip("triton")
    environment = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=environment, capture_output=True, text=True)
    if "only 0-dimensional arrays can be converted to Python scalars" in result.stderr:
        pytest.skip("Triton's interpreter (3.6) cannot run with numpy 2.4 or newer here")
    assert result.stdout.strip() == "same", result.stderr[-2000:]
