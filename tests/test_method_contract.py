"""The method contract, run over every registered method: adding a method file adds its coverage here.

docs/adding-a-method.md states the contract; each test below checks one promise of it.
"""

import pytest
import torch
from conftest import random_prompt, tiny_model

import refreshkv
from refreshkv import METHODS, Policy, PolicyCache, make_policy
from refreshkv.core.policy import PolicyError
from refreshkv.engine.cache_argument import with_cache
from refreshkv.runtime.generate import prefill
from refreshkv.runtime.static_decode import StaticCache, StaticDecoder

NEW = 12
ALL = sorted(METHODS)
OPTIONS = {
    "refreshkv+carry": {"carry": 1.0},
    "recycled+carry": {"carry": 0.5},
    "refreshkv+no_question_floor": {"question_floor": 0.0},
    "refreshkv+papers_partial_cache": {"keep_decoded": False},  # C_p of K + 1 on the dynamic schedule
    "refreshkv+answer_anchor": {"anchor": "answer"},
    "snapkv+compress_every": {"compress_every": 3},  # compression during decoding (core/selection.py)
}  # values not the default, held too
CASES = ALL + sorted(OPTIONS)


def method(case: str) -> str:
    """The registered method of a case (a method, or a method with an option of OPTIONS)."""
    return case.split("+")[0]


def small_budget(case: str) -> dict:
    """A budget well below the prompt, windows that fit short prompts, and a layer that selects, for methods that
    take them."""
    params = METHODS[method(case)].parameters()
    chosen = {"budget": 8} if "budget" in params else {}
    if "window" in params:
        chosen["window"] = 4
    if "page_size" in params:
        chosen["page_size"] = 4  # two pages of the budget
    if "dense_layers" in params:
        chosen["dense_layers"] = 0  # quest selects in every layer (its default of 2 is every layer of these models)
    return {**chosen, **OPTIONS.get(case, {})}


def run(model, ids, method, mask=None, **params):
    return refreshkv.generate(
        model, ids, mask, method=method, max_new_tokens=NEW, eos_token_id=[], return_logits=True, **params
    )


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
    return ids, mask


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.fixture(scope="module")
def bf16_llama():
    return tiny_model("llama").to(torch.bfloat16)


@pytest.fixture(scope="module")
def two_layers():
    return tiny_model("llama", layers=2, seed=3)


@pytest.mark.parametrize("name", CASES)
def test_the_compiled_step_compiles_whole_and_equals_eager(two_layers, name):
    """`compile=True` compiles each decode step with fullgraph=True, so a host read or a graph break fails here;
    rows of different lengths; the default schedules of recycled and refreshkv reach a full step within NEW steps."""
    ids, mask = left_pad([random_prompt(40, seed=2)[0], random_prompt(34, seed=4)[0]])
    eager = run(two_layers, ids, method(name), mask, **small_budget(name))
    torch._dynamo.reset()  # each method's graphs alone: all of them on one model pass dynamo's limit of graphs
    fused = run(two_layers, ids, method(name), mask, compile=True, **small_budget(name))
    assert fused.tokens == eager.tokens
    assert fused.cache.stats.per_step(NEW - 1) == eager.cache.stats.per_step(NEW - 1)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("name", CASES)
def test_keeping_everything_equals_full(request, family, name):
    model = request.getfixturevalue(family)
    ids = random_prompt(40, seed=3)
    full = run(model, ids, "full")
    out = run(
        model,
        ids,
        method(name),
        **METHODS[method(name)].keep_everything(model.config.max_position_embeddings),
        **OPTIONS.get(name, {}),
    )
    assert out.tokens == full.tokens
    assert max_diff(out.logits, full.logits) < 1e-4


@pytest.mark.parametrize("name", CASES)
def test_a_padded_batch_equals_its_rows(llama, name):
    rows = [random_prompt(47, seed=5)[0], random_prompt(33, seed=6)[0]]
    ids, mask = left_pad(rows)
    batch = run(llama, ids, method(name), mask, **small_budget(name))
    for i, row in enumerate(rows):
        alone = run(llama, row[None], method(name), **small_budget(name))
        assert batch.tokens[i] == alone.tokens[0]
        assert max_diff([logits[i] for logits in batch.logits], [logits[0] for logits in alone.logits]) < 1e-4
        pad = ids.shape[1] - len(row)
        for in_batch, by_itself in zip(batch.cache.layers, alone.cache.layers):
            kept = in_batch.state.kept(batch.cache.pads)[i]
            shifted = torch.where(kept >= 0, kept - pad, -1)
            assert torch.equal(
                shifted.sort(-1).values[:, -by_itself.state.kept(None).shape[-1] :],
                by_itself.state.kept(None)[0].sort(-1).values,
            )


@pytest.fixture(scope="module")
def packed_two_layers():
    from refreshkv.runtime.packed_linear import pack_linear_weights

    model = tiny_model("llama", layers=2, seed=3)
    pack_linear_weights(model)
    return model


@pytest.mark.parametrize("name", CASES)
def test_packed_weights_decode_what_the_stored_ones_do(two_layers, packed_two_layers, name):
    """`--weight-layout packed` swaps every linear module; a method reads no weight itself, so its tokens stay."""
    ids, mask = left_pad([random_prompt(40, seed=2)[0], random_prompt(34, seed=4)[0]])
    stored = run(two_layers, ids, method(name), mask, **small_budget(name))
    packed = run(packed_two_layers, ids, method(name), mask, **small_budget(name))
    assert packed.tokens == stored.tokens
    assert max_diff(packed.logits, stored.logits) < 1e-4


@pytest.mark.parametrize("name", CASES)
def test_kept_positions_bytes_and_full_step_fraction_are_consistent(llama, name):
    rows = [random_prompt(30, seed=7)[0], random_prompt(24, seed=8)[0]]
    ids, mask = left_pad(rows)
    out = run(llama, ids, method(name), mask, **small_budget(name))
    pads = out.cache.pads
    for layer in out.cache.layers:
        kept = layer.state.kept(pads)
        for row in range(kept.shape[0]):
            for head in kept[row]:
                real = head[head >= 0]
                assert len(real.unique()) == len(real)  # no position twice
                assert bool((real >= pads[row]).all()) and bool((real < layer.seen).all())
    assert 0 < out.cache.attended_bytes_mean() <= sum(out.cache.nbytes_per_layer())
    assert 0.0 <= out.cache.full_step_fraction() <= 1.0


@pytest.mark.parametrize("name", CASES)
def test_runs_in_bfloat16(bf16_llama, name):
    out = run(bf16_llama, random_prompt(40, seed=9), method(name), **small_budget(name))
    assert all(torch.isfinite(logits).all() for logits in out.logits)
    assert len(out.tokens[0]) == NEW


def greedy_steps(model, ids, cache):
    """Greedy decoding one forward at a time, yielding each token, so two generations can be interleaved."""
    logits = model(ids, **with_cache(model, cache)).logits[:, -1]
    for step in range(NEW):
        token = logits.argmax(-1)
        yield int(token)
        logits = model(
            token[:, None],
            **with_cache(model, cache),
            position_ids=torch.tensor([[ids.shape[1] + step]]),
        ).logits[:, -1]


@pytest.mark.parametrize("name", CASES)
def test_one_policy_object_serves_any_number_of_generations(llama, name):
    policy = make_policy(method(name), **small_budget(name))
    first, second = random_prompt(40, seed=10), random_prompt(36, seed=11)
    fresh = [run(llama, ids, make_policy(method(name), **small_budget(name))).tokens[0] for ids in (first, second)]
    assert [run(llama, ids, policy).tokens[0] for ids in (first, second)] == fresh
    with torch.no_grad():
        caches = [PolicyCache(policy, llama, max_new_tokens=NEW) for _ in range(2)]
        interleaved = list(zip(greedy_steps(llama, first, caches[0]), greedy_steps(llama, second, caches[1])))
    assert [[a for a, _ in interleaved], [b for _, b in interleaved]] == fresh


@pytest.mark.parametrize("name", ALL)
def test_a_method_computing_its_own_prefill_does_not_share_it(name):
    # generate_many hands every sharing method plain attention's prompt output; one that changes it must run alone
    assert METHODS[name].prefill is Policy.prefill or not METHODS[name].shares_prefill


@pytest.mark.parametrize("name", CASES)
def test_static_steps_decode_as_eager_or_are_refused_in_one_line(llama, name):
    """runtime/static_decode.py (the steps a CUDA graph replays) runs a method exactly as eager decoding does, or
    refuses it before decoding, in one line."""
    ids = random_prompt(40, seed=12, batch=2)
    eager = run(llama, ids, method(name), **small_budget(name))
    cache = StaticCache(make_policy(method(name), **small_budget(name)), llama, max_new_tokens=NEW)
    with torch.inference_mode():
        logits, _ = prefill(llama, ids, torch.ones_like(ids), cache)
    try:
        decoder = StaticDecoder(llama, cache, logits, NEW, keep_logits=True)
    except PolicyError as error:
        assert "\n" not in str(error) and "static decoding" in str(error)
        return
    out = decoder.run(graphs=False)
    assert out.tokens == eager.tokens
    assert max_diff(list(out.logits), eager.logits) < 1e-4
