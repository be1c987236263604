"""bench tells full steps from partial steps (issue 13: what a refresh costs against a step of full attention)."""

from conftest import random_prompt, tiny_model

import refreshkv
from refreshkv.measure.bench import step_kinds
from refreshkv.measure.bench_report import plot_bench
from refreshkv.measure.bench_round import Run, split_steps


def test_the_cache_counts_the_layers_that_attended_fully_at_each_step(llama):
    out = refreshkv.generate(
        llama,
        random_prompt(40),
        method=refreshkv.make_policy("recycled", stride=3, budget=8),
        max_new_tokens=8,
        eos_token_id=[],
    )
    assert out.cache.stats.per_step(out.cache.step) == [0.0, 0.0, 3.0, 0.0, 0.0, 3.0, 0.0]  # steps 3 and 6 are full
    full = refreshkv.generate(llama, random_prompt(40), method="full", max_new_tokens=4, eos_token_id=[])
    assert full.cache.stats.per_step(full.cache.step) == [3.0, 3.0, 3.0]
    assert len(out.step_s) == len(out.cache.stats.per_step(out.cache.step))


def test_steps_are_split_by_how_many_layers_attended_fully():
    times = [0.10, 0.11, 0.30, 0.12, 0.20]
    layers = [0.0, 0.0, 30.0, 0.0, 3.0]  # the last: a few layers only (dynamic schedule), in neither list
    assert split_steps(times, layers, num_layers=30) == ([0.30], [0.10, 0.11, 0.12])
    runs = [
        Run("recycled", 100, 5, 1.0, 0.1, 0.1, 0.2, 1, 1.0, None, [0.30, 0.32], [0.10, 0.11, 0.12]),
        Run("recycled", 100, 5, 1.0, 0.1, 0.1, 0.2, 1, 1.0, None, [0.34], [0.13]),
    ]
    kinds = step_kinds(runs)
    assert kinds["full_steps"] == 3 and abs(kinds["full_step_ms"] - 320) < 1e-9
    assert kinds["partial_steps"] == 4 and abs(kinds["partial_step_ms"] - 115) < 1e-9
    assert abs(kinds["partial_step_p90_ms"] - 120) < 1e-9
    assert kinds["full_step_times_ms"] == [300.0, 320.0, 340.0] and kinds["partial_step_times_ms"] == [
        100.0,
        110.0,
        120.0,
        130.0,
    ]


def test_bench_plot_writes_the_step_histograms_beside_it(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    row = {
        "method": "recycled",
        "length": 100,
        "decode_ms_per_token": 120.0,
        "floor_ms": 20.0,
        "full_step_times_ms": [300.0, 320.0],
        "partial_step_times_ms": [100.0, 110.0, 120.0],
    }
    reference = {"method": "transformers", "length": 100, "decode_ms_per_token": 130.0, "floor_ms": 20.0}
    result = {
        "rows": [
            reference,
            row,
            {**row, "method": "full", "full_step_times_ms": [150.0, 160.0, 170.0, 180.0], "partial_step_times_ms": []},
        ],
        "machine": {"device": "cpu (test)", "threads": 1, "dtype": "float32"},
    }
    panels = []
    subplots = plt.subplots
    monkeypatch.setattr(plt, "subplots", lambda *args, **kwargs: panels.append(args) or subplots(*args, **kwargs))
    plot_bench(result, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").stat().st_size > 0 and (tmp_path / "bench-steps.png").stat().st_size > 0
    assert panels[-1][0] == 2  # one panel per row with step times: none for the transformers reference


def test_every_round_runs_every_length_and_method_in_changing_orders(monkeypatch):
    """Lengths are interleaved like methods, so that a method at one length compares with `full` at another."""
    from test_bad_input import WordTokenizer

    from refreshkv.measure import bench

    calls = []
    real_round = bench.run_round

    def recording(model, ids, methods, names, *args, **kwargs):
        calls.append((ids.shape[1], list(names)))
        return real_round(model, ids, methods, names, *args, **kwargs)

    monkeypatch.setattr(bench, "run_round", recording)
    monkeypatch.setattr(bench, "memory_bandwidth", lambda device: 1e10)
    model = tiny_model("llama", layers=1)
    methods = {"full": {}, "streamingllm": {"budget": 8}}
    result = bench.run_bench(model, WordTokenizer(), methods, [40, 60], new_tokens=4, rounds=3)
    assert calls == [
        (36, ["full", "streamingllm"]),
        (56, ["full", "streamingllm"]),
        (56, ["streamingllm", "full"]),
        (36, ["streamingllm", "full"]),
        (36, ["full", "streamingllm"]),
        (56, ["full", "streamingllm"]),
    ]
    assert [(row["length"], row["method"], row["rounds"]) for row in result["rows"]] == [
        (40, "full", 3),
        (40, "streamingllm", 3),
        (60, "full", 3),
        (60, "streamingllm", 3),
    ]


def test_the_markdown_table_names_each_column_once():
    from refreshkv.measure.bench_report import markdown_table

    row = {"method": "full", "length": 100, "decode_ms_per_token": 120.0}
    header = markdown_table({"rows": [row]}).splitlines()[0].strip("| ").split(" | ")
    assert len(header) == len(set(header))


def test_a_gpu_run_names_its_gpu_and_its_memory_column_a_cpu_run_its_cpu():
    from refreshkv.measure.bench_report import bench_tables

    row = {"method": "full", "length": 100, "decode_ms_per_token": 12.0}
    common = {"threads": 16, "dtype": "bfloat16", "memory_bandwidth_gb_s": 4000.0, "weight_bytes": 2**28}
    gpu = {"device": "cuda:0", "gpu": "NVIDIA H200", **common}
    cpu = {"device": "cpu", "cpu": "AMD EPYC", "cpu_bf16": "none", "kernels": "AVX2", **common}
    memory = [bench_tables({"rows": [row], "machine": m, "new_tokens": 8, "rounds": 1})[2] for m in (gpu, cpu)]
    captions = [table.caption for table in memory]
    assert [table.columns[4].header for table in memory] == ["peak GPU MB", "peak RSS MB"]
    assert captions[0].startswith("cuda:0 (NVIDIA H200), 16 threads, bfloat16")
    assert captions[1].startswith("cpu, AMD EPYC (bf16 instructions: none), AVX2 kernels, 16 threads")
