"""Bootstrap intervals, the within-noise mark and the per-method summary of `refreshkv report`, on hand-written rows."""

import json
import math

import pytest

from refreshkv.eval import stats
from refreshkv.eval.report import WITHIN_NOISE, method_summaries, rich_tables, write_report
from refreshkv.eval.summary import budget_frontier, oracle_gaps


def row(task, method, i, score, params=None, ms=1.0, kv=1000, read=500):
    return {
        "run": "r",
        "config": f"{task}-{method}-{params}",
        "id": f"{task}-{i}",
        "task": task,
        "method": method,
        "params": params or {},
        "length": 100,
        "seed": 0,
        "model": "m",
        "score": score,
        "decode_ms_per_token": ms,
        "kv_bytes_full": kv,
        "kv_bytes_attended_mean": read,
        "task_options": {},
        "chat": False,
        "dtype": "float32",
    }


def rows_of(task, method, scores, **fields):
    return [row(task, method, i, s, **fields) for i, s in enumerate(scores)]


def report(tmp_path, rows):
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    groups, _, _ = write_report([path], tmp_path / "rep", plots=False)
    return groups, (tmp_path / "rep" / "summary.md").read_text()


def table_line(markdown, *cells):
    prefix = "| " + " | ".join(map(str, cells)) + " |"
    [line] = [line for line in markdown.splitlines() if line.startswith(prefix)]
    return line


FULL = [1, 0, 1, 1, 0, 1, 1, 0]


def test_a_copy_of_full_is_within_noise_and_a_method_scoring_zero_is_not(tmp_path):
    rows = (
        rows_of("t", "full", FULL, ms=2.0)
        + rows_of("t", "copy", FULL, ms=1.0, read=100)
        + rows_of("t", "zero", [0] * 8, params={"budget": 4})
    )
    groups, markdown = report(tmp_path, rows)
    summary = {g.label: g.summary() for g in groups}
    copy, zero = summary["copy"], summary["zero(budget=4)"]
    assert copy["vs_full"] == 1.0 and copy["vs_full_ci"] == (1.0, 1.0) and copy["vs_full_within_noise"]
    assert copy["speedup"] == 2.0 and copy["kv_read_mb"] == pytest.approx(100 / 2**20)
    assert copy["score"] == 0.625 and copy["score_ci"][0] < 0.625 < copy["score_ci"][1]
    # full scores 1 on 5 of the 8 examples, where zero scores 0: every resample has a ratio of 0
    assert zero["vs_full"] == 0.0 and zero["vs_full_ci"] == (0.0, 0.0) and not zero["vs_full_within_noise"]
    assert not summary["full"]["vs_full_within_noise"] and summary["full"]["vs_full_ci"] is None
    assert table_line(markdown, "t", 100, "copy", 8).count(WITHIN_NOISE) == 1
    assert f"1.000 [1.000, 1.000] {WITHIN_NOISE}" in table_line(markdown, "t", 100, "copy", 8)
    assert WITHIN_NOISE not in table_line(markdown, "t", 100, "zero(budget=4)", 8)
    assert WITHIN_NOISE not in table_line(markdown, "t", 100, "full", 8)
    assert f"{WITHIN_NOISE}: the `vs full` interval contains 1" in markdown
    # the per-method summary comes first, with the same mark
    assert markdown.index("## Per method across tasks") < markdown.index("## Per task")
    assert WITHIN_NOISE in table_line(markdown, "generation", 100, "copy", 1, 8)
    assert WITHIN_NOISE not in table_line(markdown, "generation", 100, "zero(budget=4)", 1, 8)
    assert str(rich_tables(groups)[0].title).startswith("Per method: generation tasks at 100 tokens")


def test_the_interval_is_deterministic_contains_the_point_and_has_the_95_percent_width():
    pairs = [(s, f) for s, f in zip([1, 1, 0, 1, 0, 1, 1, 1, 0, 1, 1, 0], [1, 0, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1])]
    first, second = stats.macro_ratio([pairs]), stats.macro_ratio([pairs])
    assert first == second and first.value == pytest.approx(8 / 9)
    low, high = first.interval
    assert low < first.value < high and first.contains_one
    # 400 fair coin flips: mean 0.5, standard error 0.025, so the 95% interval is about 0.5 +- 1.96 * 0.025
    flips = stats.macro_mean([[i % 2 for i in range(400)]])
    assert flips.value == 0.5
    assert flips.interval[0] == pytest.approx(0.451, abs=0.004) and flips.interval[1] == pytest.approx(0.549, abs=0.004)
    # more examples, narrower interval
    small = stats.macro_mean([[i % 2 for i in range(20)]]).interval
    assert small[1] - small[0] > 3 * (flips.interval[1] - flips.interval[0])


def test_edges_one_example_non_finite_values_and_resamples_where_full_is_zero():
    assert stats.macro_ratio([[(1.0, 1.0)]]) == stats.Estimate(1.0, None)  # one example: no interval, no mark
    assert not stats.macro_ratio([[(1.0, 1.0)]]).contains_one
    assert stats.macro_ratio([[(1.0, 1.0), (math.nan, 1.0), (0.5, 1.0)]]).value == 0.75  # the NaN pair left out
    assert stats.macro_mean([[2.0, math.inf, 4.0]]).value == 3.0
    assert stats.macro_mean([[], [math.nan]]) == stats.Estimate(None)
    # full is 1 on one example of 10: over a third of the resamples miss it, so the ratio is unbounded above
    unbounded = stats.macro_ratio([[(1.0, 1.0)] + [(1.0, 0.0)] * 9])
    assert unbounded.value == 10.0 and 1 < unbounded.interval[0] < 10 and unbounded.interval[1] == math.inf
    assert not unbounded.contains_one


def test_macro_mean_weights_tasks_equally_over_the_tasks_every_method_ran(tmp_path):
    rows = (
        rows_of("a", "full", [1, 1], ms=4.0)
        + rows_of("a", "m", [1, 1], ms=1.0)
        + rows_of("b", "full", [1] * 6, ms=2.0)
        + rows_of("b", "m", [0, 0, 0, 0, 0, 1], ms=1.0)
        + rows_of("c", "full", [0, 0, 0])  # only full ran c: it enters no macro mean
        + rows_of("ppl", "full", [10.0, 20.0])
        + rows_of("ppl", "m", [11.0, 22.0])
        + rows_of("recovery", "full", [0.9])
    )
    groups, markdown = report(tmp_path, rows)
    generation, ppl = method_summaries(groups)
    assert (generation.kind, generation.tasks, generation.left_out) == ("generation", ["a", "b"], ["c"])
    m = {r["method"]: r for r in generation.rows}["m"]
    # tasks weighted equally: (1 + 1/6) / 2, not the pooled 3/8; full's macro mean is 1
    assert m["score"] == pytest.approx(7 / 12) and m["vs_full"] == pytest.approx(7 / 12)
    assert (m["n_tasks"], m["n"]) == (2, 8)
    assert m["score_ci"][0] < 7 / 12 < m["score_ci"][1] and m["vs_full_ci"][0] < 7 / 12 < m["vs_full_ci"][1]
    assert m["decode_ms"] == 1.0 and m["speedup"] == pytest.approx(3.0)  # full: (4 + 2) / 2 ms
    assert m["kv_mb"] == pytest.approx(1000 / 2**20) and m["kv_read_mb"] == pytest.approx(500 / 2**20)
    assert {r["method"]: r for r in generation.rows}["full"]["score"] == 1.0  # c left out for full too
    assert (ppl.kind, ppl.tasks) == ("ppl", ["ppl"])
    assert {r["method"]: r for r in ppl.rows}["m"]["vs_full"] == pytest.approx(1.1)
    assert "generation at L=100, tasks: a, b; left out (not run by every method): c" in markdown
    assert table_line(markdown, "ppl", 100, "m", 1, 2).startswith(
        "| ppl | 100 | m | 1 | 2 | 16.500 [11.000, 22.000] | 1.100 [1.100, 1.100] | "
    )


def test_a_zero_full_mean_gives_no_ratio_and_no_nan(tmp_path):
    groups, markdown = report(tmp_path, rows_of("t", "full", [0, 0, 0]) + rows_of("t", "m", [0, 1, 1]))
    m = next(g for g in groups if g.label == "m").summary()
    assert m["vs_full"] is None and m["vs_full_ci"] is None and not m["vs_full_within_noise"]
    assert m["score"] == pytest.approx(2 / 3)
    assert {r["method"]: r for r in method_summaries(groups)[0].rows}["m"]["vs_full"] is None
    assert "nan" not in markdown.lower() and "inf" not in markdown
    assert table_line(markdown, "t", 100, "m", 3).split(" | ")[5] == "-"


def test_reports_name_files_without_their_folders_or_hashes():
    from refreshkv.eval.report import shown_options

    pinned = '{"paths":["/data/books/emma.txt"],"sha256":["ab12"],"target_tokens":256}'
    assert shown_options(pinned) == '{"paths":["emma.txt"],"target_tokens":256}'
    assert shown_options('{"subtask":"vt"}') == '{"subtask":"vt"}'


def test_score_by_task_puts_full_first_and_leaves_missing_cells_empty(tmp_path):
    rows = (
        rows_of("b", "snapkv", [0, 1])
        + rows_of("b", "full", [1, 1])
        + rows_of("a", "full", [1, 0, 0, 0])
        + rows_of("a", "snapkv", [0, 0, 0, 0], params={"budget": 4})
    )
    _, markdown = report(tmp_path, rows)
    section = markdown.split("## Score by task")[1].split("## Per task")[0]
    assert "| task | L | n | full | snapkv(budget=4) | snapkv |" in section  # tasks and methods in report order
    assert "| a | 100 | 4 | 0.250 | 0.000 |  |" in section
    assert "| b | 100 | 2 | 1.000 |  | 0.500 |" in section


def test_frontier_smallest_budget_at_95_percent_and_each_budget_beside_the_oracle(tmp_path):
    rows = rows_of("a", "full", [1, 1, 1, 1])
    for share, oracle, m in ((0.25, [1, 1, 1, 0], [1, 0, 0, 0]), (0.5, [1, 1, 1, 1], [1, 1, 1, 1])):
        rows += rows_of("a", "oracle", oracle, params={"budget_ratio": share})
        rows += rows_of("a", "m", m, params={"budget_ratio": share})
    kept = [0.2, 0.4, 0.2, 0.4]  # a method without a budget: K / L is the mean share it kept, not the first row's
    rows += [dict(r, budget_ratio=k) for r, k in zip(rows_of("a", "refreekv", [1, 1, 1, 1], params={"t": 1}), kept)]
    groups, markdown = report(tmp_path, rows)
    [summary] = method_summaries(groups)
    gaps = oracle_gaps(summary)
    assert [(r["base"], r["budget_share"]) for r in gaps] == [
        ("oracle", 0.25),
        ("m", 0.25),
        ("refreekv", pytest.approx(0.3)),
        ("oracle", 0.5),
        ("m", 0.5),
    ]
    assert [r["gap"] for r in gaps] == [None, pytest.approx(0.25 - 0.75), None, None, pytest.approx(0.0)]
    assert {r["method"]: r["text"] for r in budget_frontier(summary)} == {
        "m": "L/2",
        "oracle (ceiling)": "L/2",
        "refreekv(t=1)": "L/3.33",  # "t" is no budget parameter of refreekv's: it stays in the curve's name
    }
    assert table_line(markdown, "0.25", "m(budget_ratio=0.25)", 4).endswith("| 0.250 [0.000, 0.750] | -0.500 | - | - |")


def test_frontier_gives_each_variant_of_a_method_its_own_curve(tmp_path):
    """A grid over kernel and budget: one curve per kernel, over the budgets (refreekv: over its threshold)."""
    rows = rows_of("a", "full", [1, 1])
    for share, narrow, wide in ((0.25, [0, 0], [1, 1]), (0.5, [1, 1], [1, 1])):
        rows += rows_of("a", "snapkv", narrow, params={"budget_ratio": share, "kernel": 7})
        rows += rows_of("a", "snapkv", wide, params={"budget_ratio": share, "kernel": 15})
    for threshold, kept in ((0.01, 0.3), (0.05, 0.2)):
        rows += [dict(r, budget_ratio=kept) for r in rows_of("a", "refreekv", [1, 1], params={"threshold": threshold})]
    groups, _ = report(tmp_path, rows)
    [summary] = method_summaries(groups)
    frontier = {r["method"]: (r["shares"], r["text"]) for r in budget_frontier(summary)}
    assert frontier == {
        "refreekv": ([0.2, 0.3], "L/5"),
        "snapkv(kernel=15)": ([0.25, 0.5], "L/4"),
        "snapkv(kernel=7)": ([0.25, 0.5], "L/2"),
    }


def test_frontier_plot_says_where_a_kind_has_no_kl_instead_of_drawing_empty_axes(tmp_path, monkeypatch):
    from refreshkv.eval import plots

    rows = rows_of("ppl", "full", [10.0, 12.0])
    for share in (0.25, 0.5):
        rows += rows_of("ppl", "m", [11.0, 13.0], params={"budget_ratio": share})
    groups, _ = report(tmp_path, rows)
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    plots.frontier(groups, tmp_path / "frontier.png")
    left, right = figures[0].axes
    assert left.lines and not right.lines and not right.axison
    assert [t.get_text() for t in right.texts] == ["no KL to full for ppl rows"]
