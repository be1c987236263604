"""`compress_every`: every eviction method brings its cache back to its budget every N decoded tokens
(core/selection.py), so a long answer holds at most K + N tokens per layer; with a budget at or above the prompt and
the answer nothing is dropped (the tokens are `full`'s); methods that keep the whole cache refuse it in one line."""

import pytest
import torch
from conftest import random_prompt, tiny_model
from test_bad_input import assert_one_line_error, cli, no_model  # noqa: F401  (a fixture)

import refreshkv
from refreshkv import METHODS, make_policy
from refreshkv.core.policy import PolicyError
from refreshkv.core.selection import SelectionPolicy

EVICTING = sorted(name for name, cls in METHODS.items() if "compress_every" in cls.parameters())
BUDGET, EVERY, ANSWER = 16, 8, 160  # scaled down from K + 64 after 2,048 tokens: the tiny models' 1,024 positions


def params(name: str, **extra) -> dict:
    return {**({"window": 4} if "window" in METHODS[name].parameters() else {}), **extra}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=3, seed=5)


def generate(model, ids, name, new, **kwargs):
    return refreshkv.generate(model, ids, method=name, max_new_tokens=new, eos_token_id=[], **kwargs)


def test_every_eviction_method_takes_the_option():
    selection = {name for name, cls in METHODS.items() if issubclass(cls, SelectionPolicy)}
    assert set(EVICTING) == selection - {"refreekv", "mikv"}  # no budget to return to; nothing evicted (below)
    assert {"snapkv", "pyramidkv", "dynamickv", "h2o", "tova", "keydiff", "streamingllm"} <= set(EVICTING)


@pytest.mark.parametrize("name", EVICTING)
def test_a_long_answer_holds_at_most_k_plus_n_tokens_per_layer(model, name):
    ids = random_prompt(48, seed=1)
    out = generate(model, ids, name, ANSWER, **params(name, budget=BUDGET, compress_every=EVERY))
    layers = out.cache.layers
    held = [int((layer.state.kept(None) >= 0).sum(-1).max()) for layer in layers]
    # pyramidkv, dynamickv and cake share K across layers: each layer its share, the layers together at most K + N each
    assert sum(held) <= len(layers) * (BUDGET + EVERY), held
    if name not in ("pyramidkv", "dynamickv", "cake"):
        assert max(held) <= BUDGET + EVERY, held
    token_bytes = 2 * 2 * 16 * 4  # keys and values, 2 KV heads, head size 16, float32
    assert sum(out.cache.nbytes_per_layer()) <= len(layers) * (BUDGET + EVERY) * token_bytes
    for layer in layers:  # the newest tokens are held (every method keeps its recent ones or the window)
        assert int(layer.state.kept(None).max()) == layer.seen - 1


@pytest.mark.parametrize("every", [1, 5])
@pytest.mark.parametrize("name", EVICTING)
def test_a_budget_above_the_prompt_and_answer_gives_fulls_tokens(model, name, every):
    ids = random_prompt(30, seed=2)
    full = generate(model, ids, "full", 24)
    out = generate(model, ids, name, 24, **params(name, budget=64, compress_every=every))
    assert out.tokens == full.tokens


def test_compression_keeps_the_batch_equal_to_its_rows(model):
    rows = [random_prompt(40, seed=3)[0], random_prompt(29, seed=4)[0]]
    width = max(len(row) for row in rows)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
    for name in ("snapkv", "h2o", "dynamickv"):
        chosen = params(name, budget=12, compress_every=3)
        batch = generate(model, ids, name, 20, attention_mask=mask, **chosen)
        for i, row in enumerate(rows):
            assert batch.tokens[i] == generate(model, row[None], name, 20, **chosen).tokens[0], name


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "4"])
def test_a_bad_interval_is_one_line(value):
    with pytest.raises(PolicyError, match=r"^compress_every must be an integer >= 1, got"):
        make_policy("snapkv", compress_every=value)


@pytest.mark.parametrize(
    "name", ["full", "quest", "oracle", "streamingllm++", "refreshkv", "recycled", "refreekv", "think"]
)
def test_a_method_that_cannot_compress_says_why(name):
    with pytest.raises(PolicyError) as error:
        make_policy(name, compress_every=4)
    message = str(error.value)
    assert "\n" not in message and f"method '{name}' cannot compress during decoding" in message
    assert message.endswith(f"methods that can: {', '.join(EVICTING)}")


@pytest.mark.parametrize(
    "method, value, message",
    [
        ("snapkv", "0", "compress_every must be an integer >= 1, got 0"),
        ("h2o", "2.5", "compress_every must be an integer >= 1, got 2.5"),
        ("full", "4", "method 'full' cannot compress during decoding (compress_every): it keeps every token"),
    ],
)
def test_the_command_line_refuses_it_before_loading(method, value, message, no_model, monkeypatch, capsys):
    code, _, err = cli(
        monkeypatch, capsys, "generate", "--method", method, "--prompt", "hello", "--param", f"compress_every={value}"
    )
    assert_one_line_error(code, err, message)
