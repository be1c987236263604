"""A batch decoded from fewer distinct prompts (`generate_many(decode_rows=B)`, `bench --distinct-rows N`): N rows
prefilled, repeated to B rows that each hold their own KV; every copy decodes its original's tokens."""

import pytest
from conftest import forward_shapes, random_prompt, tiny_model
from test_method_contract import left_pad

import refreshkv
from refreshkv import PolicyError, make_policy
from refreshkv.runtime.generate import copied_rows

METHODS = {"full": {}, "snapkv": {"budget": 8, "window": 4}, "refreshkv": {"budget": 12, "qc_stride": 3}}
RUN = dict(max_new_tokens=10, eos_token_id=[])

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_row_r_copies_prompt_r_mod_n_whatever_the_batch():
    assert copied_rows(3, 7, "cpu").tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert copied_rows(4, 4, "cpu").tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("method", METHODS)
def test_every_copy_decodes_the_tokens_of_its_original_alone_and_holds_its_own_kv(method):
    model = tiny_model("llama", layers=2)
    originals = [random_prompt(length, seed=seed)[0] for seed, length in enumerate((40, 31, 35))]
    ids, mask = left_pad(originals)  # padded rows: each copy takes its original's padding
    policy = make_policy(method, **METHODS[method])
    distinct = refreshkv.generate(model, ids, mask, method=policy, **RUN)
    repeated = refreshkv.generate(model, ids, mask, method=policy, decode_rows=7, **RUN)
    for row, tokens in enumerate(repeated.tokens):
        alone = refreshkv.generate(model, originals[row % 3][None], method=policy, **RUN)
        assert tokens == alone.tokens[0], (method, row)
    assert repeated.prompt_tokens == [len(originals[row % 3]) for row in range(7)]
    # seven rows' KV, not three rows' seen seven times
    assert repeated.cache.nbytes_per_layer() == [size * 7 // 3 for size in distinct.cache.nbytes_per_layer()]


def test_the_prefill_takes_the_distinct_rows_and_decoding_the_whole_batch():
    model = tiny_model("llama", layers=1)
    shapes = forward_shapes(model)
    refreshkv.generate(model, random_prompt(30, batch=2), method="full", decode_rows=5, max_new_tokens=3)
    assert shapes == [(2, 30), (5, 1), (5, 1)]


@pytest.mark.parametrize(
    "rows, error, message",
    [(0, PolicyError, "decode_rows must be an integer >= 1, got 0"), (2, ValueError, "decode_rows \\(2\\) is fewer")],
)
def test_fewer_decoded_rows_than_prompts_are_refused(rows, error, message):
    with pytest.raises(error, match=message):
        refreshkv.generate(tiny_model("llama", layers=1), random_prompt(20, batch=3), decode_rows=rows)
