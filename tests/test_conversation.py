"""A conversation over one cache: questions appended through each method, answers decoded, nothing re-prefilled."""

import pytest
import torch
from conftest import random_prompt, tiny_model

from refreshkv import METHODS, PolicyCache, PolicyError, generate, make_policy
from refreshkv.engine.cache_argument import with_cache
from refreshkv.runtime.conversation import Conversation

NEW = 6


@pytest.fixture(scope="module")
def llama():
    return tiny_model(layers=3)


def ids(length, seed):
    return random_prompt(length, seed=seed)


def small(name: str) -> dict:
    params = METHODS[name].parameters()
    chosen = {"budget": 16} if "budget" in params else {}
    chosen.update({"window": 4} if "window" in params else {})
    chosen.update({"page_size": 4} if "page_size" in params else {})
    return chosen


def test_full_answers_each_turn_as_a_fresh_generation_of_the_whole_history(llama):
    context, first, second = ids(60, 1), ids(8, 2), ids(7, 3)
    talk = Conversation(llama, context, "full", eos_token_id=[])
    one = talk.ask(first, NEW)
    assert one.tokens == generate(llama, torch.cat([context, first], 1), max_new_tokens=NEW, eos_token_id=[]).tokens[0]
    two = talk.ask(second, NEW)
    history = torch.cat([context, first, torch.tensor([one.tokens]), second], 1)
    assert two.tokens == generate(llama, history, max_new_tokens=NEW, eos_token_id=[]).tokens[0]
    assert talk.tokens_held == history.shape[1] + NEW - 1  # the last answer token is chosen, not yet fed


def test_dropped_answers_leave_only_the_questions(llama):
    context, first, second = ids(60, 1), ids(8, 2), ids(7, 3)
    talk = Conversation(llama, context, "full", keep_answers=False, eos_token_id=[])
    talk.ask(first, NEW)
    two = talk.ask(second, NEW)
    history = torch.cat([context, first, second], 1)
    assert two.tokens == generate(llama, history, max_new_tokens=NEW, eos_token_id=[]).tokens[0]
    with pytest.raises(PolicyError, match="method 'snapkv' cannot forget its answers .*methods that can: .*full"):
        Conversation(llama, context, "snapkv", keep_answers=False)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_takes_questions_without_prefilling_the_context_again(llama, name, monkeypatch):
    lengths = []
    forward = llama.forward
    monkeypatch.setattr(
        llama,
        "forward",
        lambda input_ids=None, **kw: lengths.append(input_ids.shape[1]) or forward(input_ids=input_ids, **kw),
    )
    talk = Conversation(llama, ids(60, 1), name, eos_token_id=[], **small(name))
    for seed in (2, 3, 4):
        turn = talk.ask(ids(8, seed), NEW)
        assert len(turn.tokens) == NEW and turn.time_to_first_token_s > 0
    assert (
        lengths.count(60) == 1 and max(lengths[1:]) <= 9
    )  # the context once; then a question (+ the last answer token)
    assert talk.tokens_held == 60 + 3 * 8 + 2 + 3 * (NEW - 1)


@pytest.mark.parametrize("name", ["refreshkv", "recycled"])
def test_refreshkv_rebuilds_its_partial_cache_from_each_question(llama, name):
    # window 1: on these random weights the question's last token looks at the question itself
    talk = Conversation(llama, ids(80, 1), name, budget=8, window=1, eos_token_id=[])
    talk.ask(ids(6, 2), 2)
    steps = talk.cache.step
    question = ids(6, 3)
    talk.ask(question, 2)
    layer = talk.cache.layers[1]
    full_steps = talk.cache.stats.full[1]
    assert full_steps[steps].item() == 1.0  # the question's forward was a full step of every layer
    held = set(layer.state.partial.store.positions[0, 0].tolist())
    assert held & set(range(80 + 6 + 1, 80 + 6 + 1 + 6))  # C_p holds tokens of the new question


def test_keep_decoded_holds_each_answer_so_far_through_refreshes(llama):
    """keep_decoded: after each question, the refreshes (threshold 1: at every QC step) select before the answer and
    keep the answer whole beside them; the previous answers are context, selected or not."""
    talk = Conversation(
        llama, ids(80, 1), "refreshkv", budget=8, keep_decoded=True, threshold=1.0, qc_stride=2, eos_token_id=[]
    )
    for seed in (2, 3, 4):
        talk.ask(ids(6, seed), NEW)
        state = talk.cache.layers[1].state
        answer = set(range(state.answer_start, state.full.length))
        assert len(answer) == NEW - 1
        for head in state.partial.store.positions[0]:
            held = set(head.tolist()) - {-1}
            assert answer <= held and len(held - answer) == 8


def test_the_question_agnostic_and_question_aware_modes_differ_for_a_prefill_time_method(llama):
    context, question = ids(80, 1), ids(8, 2)
    agnostic = Conversation(llama, context, "snapkv", budget=16, window=4, eos_token_id=[])
    aware = Conversation(llama, context, "snapkv", budget=16, window=4, question_aware=True, eos_token_id=[])
    assert aware.tokens_held == 0 and agnostic.tokens_held == 80
    one = aware.ask(question, NEW)
    fresh = generate(
        llama,
        torch.cat([context, question], 1),
        method="snapkv",
        budget=16,
        window=4,
        max_new_tokens=NEW,
        eos_token_id=[],
    )
    assert one.tokens == fresh.tokens[0]  # aware: the question is in the prefill snapkv selects from
    agnostic.ask(question, NEW)


def test_several_methods_share_one_prefill_and_each_equals_its_own_conversation(llama):
    context, question = ids(60, 1), ids(8, 2)
    names = ["full", "refreshkv", "streamingllm"]
    together = Conversation.several(llama, context, [make_policy(n, **small(n)) for n in names], eos_token_id=[])
    for name, talk in zip(names, together):
        alone = Conversation(llama, context, name, eos_token_id=[], **small(name))
        assert talk.ask(question, NEW).tokens == alone.ask(question, NEW).tokens, name


def test_a_turn_past_the_context_window_is_refused_and_the_conversation_goes_on(llama):
    talk = Conversation(llama, ids(1000, 1), "full", eos_token_id=[])
    with pytest.raises(ValueError, match="exceeds the model's context of 1024"):
        talk.ask(ids(20, 2), 10)
    assert talk.tokens_held == 1000
    assert len(talk.ask(ids(5, 3), 4).tokens) == 4


def test_model_generate_continues_a_carried_cache_for_every_method(llama):
    """One rule for every method: a cache passed to another model.generate continues its conversation."""
    for name in sorted(METHODS):
        cache = PolicyCache(make_policy(name, **small(name)), llama)
        first = llama.generate(
            ids(50, 1), **with_cache(llama, cache), max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        history = torch.cat([first, ids(6, 2)], 1)
        again = llama.generate(
            history, **with_cache(llama, cache), max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert again.shape[1] == history.shape[1] + 4, name
        assert cache.get_seq_length() == history.shape[1] + 3, name
        if name == "full":
            fresh = llama.generate(history, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
            assert torch.equal(again, fresh)


def test_refreshkv_whose_budget_holds_every_token_decodes_as_full(llama):
    """K >= prompt + announced tokens: no partial cache, full's tokens and bytes; more tokens than announced: a
    partial cache from then on."""
    prompt = ids(40, 5)
    full = generate(llama, prompt, method="full", max_new_tokens=8, eos_token_id=[])
    everything = generate(llama, prompt, method="refreshkv", budget=64, max_new_tokens=8, eos_token_id=[])
    assert everything.tokens == full.tokens and everything.cache.layers[0].state.partial is None
    assert everything.stats()["kv_bytes_attended_mean"] == full.stats()["kv_bytes_attended_mean"]
    cache = PolicyCache(make_policy("refreshkv", budget=44), llama, max_new_tokens=2)  # 40 + 2 fit; 10 come
    tokens = llama.generate(
        prompt, **with_cache(llama, cache), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert tokens.shape[1] == 50 and cache.layers[0].state.partial is not None


def tensors_in(value, depth: int = 3) -> list[torch.Tensor]:
    """The tensors an object holds, a few attributes deep (a layer's state, its stores)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth == 0 or not hasattr(value, "__dict__"):
        return []
    return [t for item in vars(value).values() for t in tensors_in(item, depth - 1)]


@pytest.mark.parametrize("together", [False, True])
def test_the_context_prefill_keeps_no_autograd_graph(llama, together):
    """A prefill outside inference mode holds every layer's activations for a backward pass (GBs at 4K)."""
    context = ids(40, 4)
    talks = Conversation.several(llama, context, ["full", "h2o"]) if together else [Conversation(llama, context)]
    for talk in talks:
        held = [t for layer in talk.cache.layers for t in tensors_in(layer.state)]
        assert held and not any(t.requires_grad for t in held)


def test_each_turn_reports_its_own_decode_time_per_step(llama, monkeypatch):
    """The cache counts the steps of every turn; a turn's ms/token divides its decode time by its own steps."""
    import refreshkv.runtime.conversation as conversation

    real = conversation.decode

    def ten_ms_a_step(model, cache, *args):
        before = cache.step
        out = real(model, cache, *args)
        out.decode_s = 0.010 * (cache.step - before)
        return out

    monkeypatch.setattr(conversation, "decode", ten_ms_a_step)
    talk = Conversation(llama, ids(50, 5), "refreshkv", budget=16, window=4, eos_token_id=[])
    turns = [talk.ask(ids(6, seed), NEW) for seed in (6, 7, 8)]
    assert [round(turn.decode_ms_per_token, 6) for turn in turns] == [10.0, 10.0, 10.0]
