"""`pooling="span"` (engine/spans.py): words from the tokenizer's table, scores spread over words, whole words kept."""

import pytest
import torch
from conftest import random_prompt, tiny_model

from refreshkv import PolicyCache, PolicyError, generate, make_policy
from refreshkv.core.attention_math import selection_scores, spread_over_spans
from refreshkv.engine.cache_argument import with_cache
from refreshkv.engine.spans import WordTable


class StubTokenizer:
    """Token i's text: '▁w' (starts a word) for even i, 'w' (continues one) for odd i; id 0 is special."""

    name_or_path = "stub"
    all_special_ids = [0]

    def __len__(self):
        return 128

    def convert_ids_to_tokens(self, ids):
        return ["▁w" if i % 2 == 0 else "w" for i in ids]


def test_word_table_reads_space_markers_and_special_tokens():
    table = WordTable.of(StubTokenizer())
    assert table.starts[:4].tolist() == [True, False, True, False]
    assert table.special[:3].tolist() == [True, False, False]


def test_words_start_at_word_starts_after_special_tokens_and_every_max_span_tokens():
    table = WordTable.of(StubTokenizer())
    ids = torch.tensor([[3, 2, 5, 7, 0, 9, 11, 13, 15, 17, 4]])
    #                   w  ▁w w  w  sp w  w   w   w   w   ▁w
    # a leading continuation is a word; a token after a special token starts one; 5 continuations cut at 3
    assert table.spans(ids, max_span=3).tolist() == [[0, 1, 1, 1, 2, 3, 3, 3, 4, 4, 5]]
    with pytest.raises(PolicyError, match="token ids outside the tokenizer's 128 entries"):
        table.spans(torch.tensor([[1, 128]]))


def test_spread_over_spans_raises_each_prompt_word_to_its_best_score_and_leaves_decoded_tokens():
    scores = torch.tensor([[[0.1, 0.5, 0.2, 0.0, 0.3, 0.9, 0.05]]])  # 5 prompt tokens, 2 decoded
    spans = torch.tensor([[0, 0, 0, 1, 2]])
    spread = spread_over_spans(scores, spans)
    assert torch.allclose(spread, torch.tensor([[[0.5, 0.5, 0.5, 0.0, 0.3, 0.9, 0.05]]]))


def test_span_pooling_keeps_the_whole_word_the_centred_kernel_cuts():
    probs = torch.zeros(1, 1, 1, 1, 16)
    probs[..., 4] = 1.0  # a peak just before a 7-token word at 5 .. 11
    spans = torch.tensor([[0, 1, 2, 3, 4, 5, 5, 5, 5, 5, 5, 5, 6, 7, 8, 9]])
    centred = selection_scores(probs, 3, "max")[0, 0]
    assert (centred > 0).nonzero().flatten().tolist() == [3, 4, 5]  # the word's first token only
    span = selection_scores(probs, 3, "max", "span", spans)[0, 0]
    assert (span > 0).nonzero().flatten().tolist() == [3, 4, 5, 6, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("method", ["refreshkv", "snapkv"])
def test_span_pooling_at_full_budget_gives_full_tokens(method):
    model, ids = tiny_model(), random_prompt(40)
    expected = generate(model, ids, method="full", max_new_tokens=8).tokens
    policy = make_policy(method, budget=64, pooling="span", **({"window": 1} if method == "snapkv" else {}))
    cache = PolicyCache(policy, model, max_new_tokens=8, tokenizer=StubTokenizer())
    out = model.generate(ids, max_new_tokens=8, do_sample=False, **with_cache(model, cache))
    assert out[:, ids.shape[1] :].tolist() == expected
    assert cache.prompt_spans.tolist() == WordTable.of(StubTokenizer()).spans(ids).tolist()


def test_span_pooling_keeps_words_whole_in_a_small_budget():
    model, ids = tiny_model(), random_prompt(64)
    cache = PolicyCache(make_policy("snapkv", budget=24, window=1, pooling="span"), model, 4, StubTokenizer())
    model.generate(ids, max_new_tokens=1, do_sample=False, **with_cache(model, cache))
    words = cache.prompt_spans[0]
    for layer in cache.layers:
        for positions in layer.state.store.positions[0]:
            kept = set(positions[(positions >= 0) & (positions < ids.shape[1] - 1)].tolist())  # the window apart
            cut = [
                w for w in words[sorted(kept)].unique() if not set((words == w).nonzero().flatten().tolist()) <= kept
            ]
            assert len(cut) <= 1  # words are kept whole, but for the one the budget's last slots cut


def test_span_pooling_is_the_default_and_the_paper_preset_keeps_the_centred_kernel():
    names = ("refreshkv", "recycled", "snapkv", "pyramidkv", "dynamickv")
    assert [make_policy(name).pooling for name in names] == ["span"] * len(names)
    assert {make_policy(name, preset="paper").pooling for name in names} == {"centered"}


def test_the_default_reads_words_from_the_tokenizer_beside_the_model():
    from transformers import AutoTokenizer

    model, ids = tiny_model(), random_prompt(40)
    cache = PolicyCache(make_policy("snapkv", budget=16, window=1), model, 2)
    model.generate(ids, max_new_tokens=2, do_sample=False, **with_cache(model, cache))
    saved = AutoTokenizer.from_pretrained(model.config._name_or_path)
    assert cache.prompt_spans.tolist() == WordTable.of(saved).spans(ids).tolist()
    assert cache.prompt_spans.tolist() == WordTable.of(StubTokenizer()).spans(ids).tolist()  # the same words


def test_span_pooling_refuses_a_config_a_missing_tokenizer_and_embeddings(tmp_path):
    model, ids = tiny_model(), random_prompt(40)
    policy = make_policy("refreshkv", budget=16, pooling="span")
    with pytest.raises(PolicyError, match="build the cache from the model"):
        PolicyCache(policy, model.config)
    model.config._name_or_path = str(tmp_path)  # a folder without a tokenizer
    with pytest.raises(PolicyError, match="pooling=.span. needs the model.s tokenizer.*or choose pooling=.centered."):
        PolicyCache(policy, model)
    cache = PolicyCache(policy, model, 4, StubTokenizer())
    embeds = model.get_input_embeddings()(ids)
    with pytest.raises(PolicyError, match="needs the prompt's token ids: pass input_ids"):
        model.generate(inputs_embeds=embeds, max_new_tokens=2, do_sample=False, **with_cache(model, cache))
