"""The serving model (measure/serving_sim.py) on a hand-made bench result: costs read, steps interpolated, refreshes
modelled, and small schedules worked out by hand."""

import json
import math
from pathlib import Path

import pytest

from refreshkv.measure.serving_sim import Workload, at_batch, bench_costs, simulate, simulate_bench, step_seconds

MB = 2**20
WEIGHTS = 100 * MB


def row(method, batch, step_ms, kv_mb, full_ms=None, partial_ms=None, fraction=1.0):
    """A bench row at 1100 tokens of context (1000 prompt tokens, prefilled at 1000 tokens/s)."""
    return {
        "method": method,
        "length": 1100,
        "batch": batch,
        "decode_ms_per_step": step_ms,
        "full_step_ms": full_ms,
        "partial_step_ms": partial_ms,
        "full_step_fraction": fraction,
        "kv_bytes_held_per_row": kv_mb * MB,
        "kv_bytes_attended_per_row": kv_mb * MB,
        "prefill_tokens_per_s": 1000.0,
    }


BENCH = {
    "machine": {"weight_bytes": WEIGHTS},
    "new_tokens": 100,
    "rows": [
        row("full", 1, 10.0, 50, full_ms=10.0),
        row("full", 4, 22.0, 50, full_ms=22.0),
        row("snapkv", 1, 6.0, 10, partial_ms=6.0, fraction=0.0),
        row("snapkv", 4, 9.0, 10, partial_ms=9.0, fraction=0.0),
        row("refreshkv", 1, 8.0, 55, full_ms=10.0, partial_ms=6.0, fraction=0.1),
        row("refreshkv", 4, 16.0, 55, full_ms=22.0, partial_ms=9.0, fraction=0.1),
    ],
    "row_bytes": {"1100": {"full": {"decode": 0}, "snapkv": {"decode": 2 * MB}, "refreshkv": {"decode": 0}}},
}


def workload(**changes):
    base = dict(rate=math.inf, requests=3, prompt_tokens=1000, output_tokens=3, replicas=1, memory_bytes=WEIGHTS)
    return Workload(**{**base, **changes})


def test_a_bench_result_gives_each_methods_costs():
    length, costs = bench_costs(BENCH)
    assert length == 1100 and list(costs) == ["full", "snapkv", "refreshkv"]
    assert costs["full"].batches == (1, 4) and costs["full"].step_s == (0.010, 0.022)
    assert costs["refreshkv"].refreshes and not costs["snapkv"].refreshes and not costs["full"].refreshes
    assert costs["snapkv"].row_bytes == 12 * MB  # its KV and the decode step's transient
    with pytest.raises(ValueError, match=r"measured lengths \[1100\], not 8192"):
        bench_costs(BENCH, 8192)


def test_steps_between_beyond_and_from_one_measured_batch():
    assert at_batch((1, 4), (0.010, 0.022), 2, WEIGHTS, 50 * MB) == pytest.approx(0.014)
    assert at_batch((1, 4), (0.010, 0.022), 8, WEIGHTS, 50 * MB) == pytest.approx(0.038)  # the last line, extended
    # one batch measured: scaled like its bytes, (100 + 3 x 50) / (100 + 50) MB
    assert at_batch((1,), (0.010,), 3, WEIGHTS, 50 * MB) == pytest.approx(0.010 * 250 / 150)


def test_refreshes_measured_left_out_aligned_or_on_any_rows_refresh():
    refreshkv = bench_costs(BENCH)[1]["refreshkv"]
    assert step_seconds(refreshkv, 4, "measured", WEIGHTS) == pytest.approx(0.016)
    assert step_seconds(refreshkv, 4, "none", WEIGHTS) == pytest.approx(0.009)
    assert step_seconds(refreshkv, 4, "aligned", WEIGHTS) == pytest.approx(0.009 + 0.1 * 0.013)
    assert step_seconds(refreshkv, 4, "any-row", WEIGHTS) == pytest.approx(0.009 + (1 - 0.9**4) * 0.013)
    results = simulate_bench(BENCH, workload(memory_bytes=WEIGHTS + 200 * MB))
    assert [(r["method"], r["refresh"]) for r in results] == [("full", "measured"), ("snapkv", "measured")] + [
        ("refreshkv", mode) for mode in ("measured", "none", "aligned", "any-row")
    ]


def test_a_replica_fills_its_memory_then_admits_as_requests_finish():
    full = bench_costs(BENCH)[1]["full"]
    # two requests fit: both prefilled (1 s each; first tokens at 1 and 2 s), two steps of 2 rows (14 ms each);
    # then the third: prefilled by 3.028 s, two steps of one row (10 ms each)
    result = simulate(full, workload(memory_bytes=WEIGHTS + 100 * MB), "measured", WEIGHTS)
    assert result["largest_batch"] == 2 and result["mean_batch"] == 1.5
    assert result["latency_p50_s"] == pytest.approx(2.028) and result["latency_p99_s"] == pytest.approx(3.048)
    assert result["first_token_p50_s"] == pytest.approx(2.0) and result["first_token_p99_s"] == pytest.approx(3.028)
    assert result["output_tokens_per_s"] == pytest.approx(9 / 3.048)


def test_replicas_share_the_requests():
    full = bench_costs(BENCH)[1]["full"]
    # the first and third request on one replica (as above, done at 2.028 s), the second alone on the other
    result = simulate(full, workload(memory_bytes=WEIGHTS + 100 * MB, replicas=2), "measured", WEIGHTS)
    assert result["output_tokens_per_s"] == pytest.approx(9 / 2.028)


def test_requests_arriving_apart_are_served_alone():
    full = bench_costs(BENCH)[1]["full"]
    slow = workload(rate=0.01, requests=20, memory_bytes=WEIGHTS + 100 * MB, seed=3)
    result = simulate(full, slow, "measured", WEIGHTS)  # ~100 s apart: each alone, 1 s of prefill and two steps
    assert result["latency_p50_s"] == pytest.approx(1.02) and result["latency_p99_s"] == pytest.approx(1.02)
    assert simulate(full, slow, "measured", WEIGHTS) == result  # the seed fixes the arrivals


def test_a_replica_that_holds_no_request_is_refused_in_one_line():
    full = bench_costs(BENCH)[1]["full"]
    with pytest.raises(ValueError, match=r"full: a replica of 0.14 GB holds the weights \(0.10 GB\) and no request"):
        simulate(full, workload(memory_bytes=WEIGHTS + 40 * MB), "measured", WEIGHTS)


def test_a_committed_single_row_bench_is_read_too():
    path = Path(__file__).resolve().parents[1] / "docs" / "results" / "bench-smollm2" / "avx2.json"
    result = json.loads(path.read_text())
    length, costs = bench_costs(result)
    assert length == 8192 and all(cost.batches == (1,) for cost in costs.values())
    served = simulate(costs["snapkv"], workload(memory_bytes=2 * 2**30), "measured", result["machine"]["weight_bytes"])
    assert served["largest_batch"] > 1 and served["output_tokens_per_s"] > 0
