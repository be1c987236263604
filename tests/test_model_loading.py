"""Offline model loading: local directories, family checks, clear errors."""

import json

import pytest
from conftest import random_prompt, tiny_model
from transformers import AutoTokenizer

from refreshkv import generate, load_model
from refreshkv.runtime.loading import ModelError, resolve_model_dir


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "gemma2", "gemma3"])
def test_local_directory_loads_with_the_policy_attention(tmp_path, monkeypatch, family):
    model = tiny_model(family)
    model.save_pretrained(tmp_path)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *args, **kwargs: "tokenizer")
    loaded, tokenizer = load_model(tmp_path)
    assert tokenizer == "tokenizer"
    assert loaded.config._attn_implementation == "refreshkv"
    ids = random_prompt(20)
    assert (
        generate(loaded, ids, method="full", max_new_tokens=5).tokens
        == generate(model, ids, method="full", max_new_tokens=5).tokens
    )


def test_unsupported_family_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(
        ModelError, match="'gpt2' is not supported; supported: llama, qwen2, qwen3, mistral, phi3, gemma2, gemma3_text"
    ):
        load_model(tmp_path)
    # the multimodal Gemma 3 checkpoints were not tested: refused, not run approximately
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    with pytest.raises(ModelError, match="'gemma3' is not supported"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p / "missing", "does not exist"),
        (lambda p: p, "has no config.json"),
        (lambda p: (p / "weights.bin").write_bytes(b"") or p / "weights.bin", "neither a directory nor a .gguf file"),
    ],
)
def test_bad_model_paths(tmp_path, make, message):
    with pytest.raises(ModelError, match=message):
        resolve_model_dir(make(tmp_path))


@pytest.mark.parametrize(
    "contents, message",
    [
        ({"config.json": None}, "no file named model.safetensors"),  # a model's config without its weights
        ({"config.json": "{not json"}, "not a valid JSON file"),
        ({"config.json": "{}"}, "model_type"),
    ],
)
def test_unloadable_model_directories_are_one_line(tmp_path, contents, message):
    config = tiny_model().config.to_json_string()
    for name, text in contents.items():
        (tmp_path / name).write_text(config if text is None else text)
    with pytest.raises(
        ModelError,
        match=rf"^cannot load the (model|weights) in {tmp_path}.*: .*{message}.*(model directory|safetensors)",
    ) as error:
        load_model(tmp_path)
    assert "\n" not in str(error.value)


def test_a_custom_attention_module_is_refused_before_any_work():
    """A layer whose attention does not call transformers' attention interface would silently skip the method."""
    from refreshkv.runtime.loading import check_attention

    model = tiny_model("llama")
    check_attention(model)  # a stock model passes
    attention = model.model.layers[1].self_attn

    def custom_forward(hidden_states, *args, **kwargs):  # computes something, never the registered function
        return attention.o_proj(attention.v_proj(hidden_states).repeat(1, 1, 2)), None

    attention.forward = custom_forward
    with pytest.raises(ModelError, match="cannot be run by the KV methods: layer 1's attention never used the cache"):
        check_attention(model)
