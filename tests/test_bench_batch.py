"""bench with many rows at once (issue 48): distinct rows, one prefill per batch, the memory cap's arithmetic and the
refusals that come before anything is timed."""

import json

import pytest
import torch
from conftest import forward_shapes, tiny_model
from test_bad_input import WordTokenizer, assert_one_line_error, cli, no_model, tiny_loader  # noqa: F401

import refreshkv
from refreshkv.engine.cache_argument import with_cache
from refreshkv.measure import batch_memory, bench, bench_round
from refreshkv.measure.batch_memory import (
    GB,
    RowBytes,
    capped_batches,
    check_cap,
    check_fits,
    largest_batch,
    most_prefill_rows,
    working_set,
)

MB = 2**20

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_rows_are_distinct_windows_of_the_book_and_row_0_is_the_single_prompt():
    rows = bench.bench_prompt(WordTokenizer(), 300, rows=4)
    assert rows.shape == (4, 300) and len({tuple(row.tolist()) for row in rows}) == 4
    assert rows[0].tolist() == bench.bench_prompt(WordTokenizer(), 300)[0].tolist()


@pytest.mark.parametrize("method, params", [("full", {}), ("refreshkv", {"budget": 12, "qc_stride": 3})])
def test_each_row_of_a_batch_gets_the_tokens_it_gets_alone(method, params):
    model = tiny_model("llama", layers=2)
    rows = bench.bench_prompt(WordTokenizer(), 60, rows=4)
    batch = refreshkv.generate(model, rows, method=method, max_new_tokens=10, eos_token_id=[], **params)
    for i, row in enumerate(rows):
        alone = refreshkv.generate(model, row[None], method=method, max_new_tokens=10, eos_token_id=[], **params)
        assert batch.tokens[i] == alone.tokens[0], (method, i)


def run(monkeypatch, **kwargs):
    monkeypatch.setattr(bench, "memory_bandwidth", lambda device: 1e10)
    methods = {"transformers": {}, "full": {}, "streamingllm": {"budget": 8}}
    model = tiny_model("llama", layers=1)
    return bench.run_bench(model, WordTokenizer(), methods, [40], new_tokens=4, rounds=2, **kwargs)


def test_every_round_runs_every_batch_and_reports_tokens_per_second_of_all_rows(monkeypatch):
    calls = []
    real_round = bench.run_round

    def recording(model, ids, methods, names, *args, **kwargs):
        calls.append((tuple(ids.shape), list(names)))
        return real_round(model, ids, methods, names, *args, **kwargs)

    monkeypatch.setattr(bench, "run_round", recording)
    result = run(monkeypatch, batches=[1, 3])
    methods = ["transformers", "full", "streamingllm"]
    turned = methods[1:] + methods[:1]
    assert calls == [((1, 36), methods), ((3, 36), methods), ((3, 36), turned), ((1, 36), turned)]
    assert [(row["batch"], row["method"]) for row in result["rows"]] == [(1, m) for m in methods] + [
        (3, m) for m in methods
    ]
    for row in result["rows"]:
        assert row["tokens_per_s"] == pytest.approx(1000 * row["batch"] / row["decode_ms_per_step"])
        assert row["kv_bytes_held_per_row"] == row["kv_bytes_held"] / row["batch"]
    full = [row for row in result["rows"] if row["method"] == "full"]
    assert full[1]["kv_bytes_held"] == 3 * full[0]["kv_bytes_held"]
    sizes = result["row_bytes"]["40"]
    assert sizes["full"]["kv"] == full[0]["kv_bytes_held"] and sizes["transformers"] == sizes["full"]
    assert sizes["streamingllm"]["kv"] < sizes["full"]["kv"]


def test_a_run_of_one_row_works_out_no_row_sizes(monkeypatch):
    monkeypatch.setattr(bench, "row_bytes", lambda *args: pytest.fail("one row needs no sizing"))
    assert run(monkeypatch)["row_bytes"] == {}


@pytest.mark.parametrize("distinct", [None, 2])
def test_under_a_cap_each_method_runs_alone_at_its_largest_batch(distinct, monkeypatch):
    model = tiny_model("llama", layers=1)
    cap = bench.weight_bytes(model) + 0.5 * MB
    result = run(monkeypatch, memory_cap=cap, distinct_rows=distinct)
    sizes = result["row_bytes"]["40"]
    room = cap - result["machine"]["weight_bytes"]
    for row in result["rows"]:
        rows = [RowBytes(**sizes[row["method"]])]
        assert row["batch"] == largest_batch(room, rows, distinct) and row["peak_process_bytes"] is not None  # alone
        assert row["prefill_rows"] == most_prefill_rows(row["batch"], room, rows, distinct)
        assert row["distinct_rows"] == (distinct or row["batch"])
        # the whole run, its prefill included
        assert working_set(row["batch"], row["prefill_rows"], rows, distinct) <= room
    batches = {row["method"]: row["batch"] for row in result["rows"]}
    assert batches["streamingllm"] > batches["full"] == batches["transformers"] > 1
    full = next(row for row in result["rows"] if row["method"] == "full")
    assert full["speedup_vs_full"] == 1.0 and not result["shared_prefill"]


def test_the_cap_arithmetic_on_hand_made_sizes():
    row = RowBytes(kv=300 * MB, kv_layer=30 * MB, decode=20 * MB, prefill=1000 * MB)
    room = 6 * GB - 512 * MB  # 5632 MB beside the weights
    # the rows' KV and the largest transient: one row's prefill outweighs 16 rows' decode and their join
    assert working_set(16, 1, [row]) == (16 * 300 + 1000) * MB
    assert working_set(2, 2, [row]) == (2 * 300 + 2 * 1000) * MB  # one forward for the batch: nothing to join
    assert largest_batch(room, [row]) == 15  # 15 x 300 + 1000 <= 5632 < 16 x 300 + 1000 (decode alone: 17)
    assert most_prefill_rows(15, room, [row]) == 1
    cheap = RowBytes(kv=300 * MB, kv_layer=30 * MB, decode=20 * MB, prefill=200 * MB)
    assert largest_batch(room, [cheap]) == 17  # the join bounds it: 17 x (300 + 30) <= 5632 < 18 x 330
    assert most_prefill_rows(17, room, [cheap]) == 2  # 17 x 300 + 2 x 200 <= 5632 < 17 x 300 + 3 x 200
    int4 = RowBytes(kv=60 * MB, kv_layer=6 * MB, decode=32 * MB, prefill=200 * MB)
    assert capped_batches(6 * GB, 512 * MB, {"full": cheap, "refreshkv@int4": int4}, 8192) == {
        "full": 17,
        "refreshkv@int4": 5632 // 92,  # the decode step's transient bounds it
    }
    with pytest.raises(ValueError, match=r"holds no row of full at 8192 tokens .* give at least 1.77 GB"):
        capped_batches(1.5 * GB, 512 * MB, {"full": row, "refreshkv@int4": int4}, 8192)
    with pytest.raises(ValueError, match=r"--memory-cap 0.50 GB does not hold the model's weights \(0.50 GB\)"):
        check_cap(512 * MB, 512 * MB)


def test_copies_made_after_the_prefill_need_only_the_distinct_rows_prefill():
    row = RowBytes(kv=300 * MB, kv_layer=30 * MB, decode=20 * MB, prefill=1000 * MB)
    room = 6 * GB - 512 * MB
    # 16 rows from 4: the decode step holds the most (16 x 320), the prefill 4 x 300 + 1000, the copies 16 x 300 + 4 x 30
    assert working_set(16, 1, [row], distinct=4) == 16 * 320 * MB
    assert working_set(16, 2, [row], distinct=16) == working_set(16, 2, [row])  # every row distinct
    assert largest_batch(room, [row], distinct=4) == 17  # 17 x 320 <= 5632 < 18 x 320 (every row distinct: 15)
    assert most_prefill_rows(17, room, [row], distinct=4) == 4  # no more than the distinct rows
    wide = RowBytes(kv=300 * MB, kv_layer=150 * MB, decode=1 * MB, prefill=10 * MB)
    assert working_set(10, 4, [wide], distinct=4) == (10 * 300 + 4 * 150) * MB  # copying a layer of 4 rows
    assert working_set(10, 2, [wide], distinct=4) == (10 * 300 + 4 * 150) * MB  # joining 4 rows' layer holds less
    assert check_fits(10**6, [row], True, None, "x", distinct=4) == 4  # free memory unknown: all 4 at once


def test_a_run_that_fits_only_in_groups_prefills_as_many_rows_per_forward_as_fit():
    full, small = RowBytes(300 * MB, 30 * MB, 20 * MB, 500 * MB), RowBytes(40 * MB, 4 * MB, 20 * MB, 500 * MB)
    kv = 4 * 340 * MB  # 4 rows of both methods at once (a shared prefill)
    assert check_fits(4, [full, small], True, kv + 4 * 500 * MB, "x") == 4  # all at once
    assert check_fits(4, [full, small], True, kv + 4 * 500 * MB - 1, "x") == 3
    assert check_fits(4, [full, small], True, kv + 500 * MB, "x") == 1
    with pytest.raises(ValueError, match=r"at most 3 rows"):
        check_fits(4, [full, small], True, kv + 500 * MB - 1, "x")
    assert check_fits(4, [full, small], False, 4 * 300 * MB + 4 * 500 * MB, "x") == 4  # one method at a time
    assert check_fits(10**6, [full], True, None, "x") == 10**6  # free memory unknown: not checked


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch", "0"], "--batch expects integers >= 1, got '0'"),
        (["--batch", "1,x"], "--batch expects comma-separated integers"),
        (["--memory-cap", "0"], "--memory-cap expects a size > 0 GB, got 0"),
        (["--memory-cap", "6", "--batch", "4"], "--memory-cap chooses each method's batch: leave out --batch"),
        (["--distinct-rows", "0"], "--distinct-rows expects an integer >= 1, got 0"),
        (
            ["--batch", "1,2,8", "--distinct-rows", "4"],
            "--distinct-rows 4 is more than --batch 2 holds: give at most 2",
        ),
    ],
)
def test_bad_batches_and_caps_are_one_line_before_loading(args, message, no_model, monkeypatch, capsys):  # noqa: F811
    assert_one_line_error(*cli(monkeypatch, capsys, "bench", *args)[::2], message)


def test_distinct_rows_beside_a_batch_of_one_or_a_cap_are_fine():
    for batches, cap in (([1], None), ([1], 6 * GB), ([1, 4, 8], None)):
        bench.check_batching(batches, cap, 4)


def test_profile_refuses_batch_0_before_loading(no_model, monkeypatch, capsys):  # noqa: F811
    code, _, err = cli(monkeypatch, capsys, "profile", "--batch", "0")
    assert_one_line_error(code, err, "--batch expects integers >= 1")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--memory-cap", "0.0001"], "does not hold the model's weights"),
        (["--batch", "1,1000000"], "at most"),
    ],
)
def test_a_cap_below_the_weights_and_a_batch_that_does_not_fit_write_no_json(
    args,
    message,
    tiny_loader,
    tmp_path,
    monkeypatch,
    capsys,  # noqa: F811
):
    monkeypatch.setattr(batch_memory, "available_memory", lambda device: GB)
    monkeypatch.setattr(bench, "memory_bandwidth", lambda device: pytest.fail("refused after the runs began"))
    out = tmp_path / "bench.json"
    common = ["--methods", "full,streamingllm", "--budget", "8", "--lengths", "40", "--new-tokens", "4"]
    code, _, err = cli(monkeypatch, capsys, "bench", *common, *args, "--json", out)
    assert_one_line_error(code, err, message)
    assert not out.exists()


def test_prompts_of_unequal_length_without_a_mask_name_the_padding():
    model = tiny_model("llama", layers=1)
    with pytest.raises(ValueError, match="unequal lengths \\(2 to 3 tokens\\): left-pad") as error:
        refreshkv.generate(model, [[5, 6, 7], [5, 6]])
    assert "\n" not in str(error.value)


def test_a_batched_result_shows_a_throughput_table_per_batch():
    from refreshkv.measure.bench_report import bench_tables, markdown_table

    rows = [{"method": "full", "length": 100, "batch": b, "decode_ms_per_step": 10.0 * b} for b in (1, 8)]
    machine = {"device": "cpu", "threads": 1, "dtype": "float32", "memory_bandwidth_gb_s": 10.0, "weight_bytes": 1}
    result = {"rows": rows, "machine": machine, "new_tokens": 8, "rounds": 1, "batches": [1, 8]}
    tables = bench_tables(result)
    assert tables[0].title == "throughput at 100 tokens of context, batch 1" and tables[4].title.endswith("batch 8")
    assert tables[0].caption == "every row a distinct prompt"
    copied = bench_tables({**result, "distinct_rows": 4})
    assert copied[0].caption == "every row a distinct prompt"  # batch 1
    assert copied[4].caption.startswith("4 distinct prompts a batch, repeated to its rows after the prefill")
    assert "| batch |" in markdown_table(result) and "| batch |" not in markdown_table({**result, "batches": [1]})
    json.dumps(result)


def test_the_cli_writes_each_batchs_rows(tiny_loader, tmp_path, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setattr(bench, "memory_bandwidth", lambda device: 1e10)
    out = tmp_path / "bench.json"
    args = ["--methods", "full,streamingllm", "--budget", "8", "--lengths", "40", "--new-tokens", "4", "--rounds", "1"]
    code, printed, _ = cli(monkeypatch, capsys, "bench", *args, "--batch", "1,2", "--distinct-rows", "1", "--json", out)
    result = json.loads(out.read_text())
    assert code in (0, None) and "throughput at 40 tokens of context, batch 2" in printed
    assert [(row["method"], row["batch"]) for row in result["rows"]] == [
        ("full", 1),
        ("streamingllm", 1),
        ("full", 2),
        ("streamingllm", 2),
    ]
    assert result["batches"] == [1, 2] and set(result["row_bytes"]["40"]) == {"full", "streamingllm"}
    assert result["distinct_rows"] == 1 and {row["distinct_rows"] for row in result["rows"]} == {1}


def test_a_batch_that_fits_only_a_row_per_prefill_forward_is_prefilled_so(monkeypatch):
    monkeypatch.setattr(bench, "memory_bandwidth", lambda device: 1e10)
    methods = {"transformers": {}, "full": {}, "streamingllm": {"budget": 8}}
    model = tiny_model("llama", layers=1)
    at_once = bench.run_bench(model, WordTokenizer(), methods, [40], new_tokens=4, rounds=1, batches=[3])
    monkeypatch.setattr(bench, "check_fits", lambda *args: 1)  # what fits here: one row per prefill forward
    shapes = forward_shapes(model)
    grouped = bench.run_bench(model, WordTokenizer(), methods, [40], new_tokens=4, rounds=1, batches=[3])
    # one row sized (batch_memory.row_bytes), then the reference's prefill and the methods' shared one, a row per forward
    assert [shape for shape in shapes if shape[1] > 1] == [(1, 36)] * 7
    assert [row["prefill_rows"] for row in grouped["rows"]] == [1, 1, 1]
    assert [row["prefill_rows"] for row in at_once["rows"]] == [3, 3, 3]
    assert [row["tokens"] for row in grouped["rows"]] == [row["tokens"] for row in at_once["rows"]]


def test_a_batch_from_fewer_distinct_rows_prefills_those_and_decodes_every_row(monkeypatch):
    monkeypatch.setattr(bench, "memory_bandwidth", lambda device: 1e10)
    methods = {"transformers": {}, "full": {}, "streamingllm": {"budget": 8}}
    model = tiny_model("llama", layers=1)
    every_row = bench.run_bench(model, WordTokenizer(), methods, [40], 4, rounds=1, batches=[5])
    shapes = forward_shapes(model)
    copied = bench.run_bench(model, WordTokenizer(), methods, [40], 4, rounds=1, batches=[5], distinct_rows=2)
    # one row sized (batch_memory.row_bytes), then the reference's prefill and the methods' shared one: 2 rows each
    assert [shape for shape in shapes if shape[1] > 1] == [(1, 36), (2, 36), (2, 36)]
    assert {shape for shape in shapes if shape[1] == 1} == {(5, 1)}  # every decode step reads five rows
    assert copied["distinct_rows"] == 2 and every_row["distinct_rows"] is None
    for ours, theirs in zip(copied["rows"], every_row["rows"]):
        assert (ours["batch"], ours["distinct_rows"], ours["prefill_rows"]) == (5, 2, 2)
        assert ours["prefill_tokens_per_s"] == pytest.approx(2 * 36 / ours["prefill_s"])  # the tokens prefilled
        assert ours["kv_bytes_held"] == theirs["kv_bytes_held"]  # five rows' own KV either way
        assert ours["tokens"] == theirs["tokens"]  # row 0 is the book's start either way


def test_the_references_copies_decode_the_tokens_of_their_originals():
    model = tiny_model("llama", layers=2)
    ids = bench.bench_prompt(WordTokenizer(), 30, rows=2)

    @torch.inference_mode()
    def greedy(ids, decode_rows):
        cache, logits = bench_round.transformers_prefill(model, ids, None, decode_rows)
        assert all(layer.keys.shape[0] == logits.shape[0] for layer in cache.layers)  # each copy its own keys
        tokens = []
        for _ in range(6):
            tokens.append(logits.argmax(dim=-1, keepdim=True))
            logits = model(tokens[-1], **with_cache(model, cache), use_cache=True).logits[:, -1]
        return torch.cat(tokens, dim=1).tolist()

    copies = greedy(ids, 5)
    assert len(copies) == 5
    for row, tokens in enumerate(copies):
        assert tokens == greedy(ids[row % 2][None], None)[0], row
