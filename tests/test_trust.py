"""Issue 50, trust: no code from a model folder, no native library or converted model that is not what this package
wrote, plugins that replace a method said so, and no file written outside the documented places or through a link."""

import json
import os
from pathlib import Path

import pytest
from test_bad_input import assert_one_line_error, cli, report_rows, sweep_file
from test_core import registry  # noqa: F401  (the fixture)

from refreshkv.eval.runner import ResultsFile
from refreshkv.eval.sweep import SweepError, load_sweep
from refreshkv.runtime.output_files import OutputError, replaced

# ---- writes: inside the sweep file's folder or the working directory, never through a link -----------------------


def test_a_sweep_file_cannot_send_its_rows_outside_its_folder_and_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    folder = tmp_path / "sweeps" / "deep"
    folder.mkdir(parents=True)
    body = "lengths: [100]\ntasks: [ppl]\nmethods: [full]\n"
    spec = sweep_file(folder, "out: ../../x.jsonl\n" + body)
    with pytest.raises(SweepError, match=rf"^{spec}: 'out' \.\./\.\./x\.jsonl lies outside .* give --out") as error:
        load_sweep(spec)
    assert "\n" not in str(error.value)
    assert load_sweep(spec, out=tmp_path / "x.jsonl").out == tmp_path / "x.jsonl"  # on the command line: as given
    spec.write_text(f"out: {tmp_path / 'work' / 'r.jsonl'}\n" + body)  # the working directory
    assert load_sweep(spec).out == tmp_path / "work" / "r.jsonl"
    spec.write_text("out: ../deep/sub/r.jsonl\n" + body)  # `..` that stays in the folder
    assert load_sweep(spec).out.resolve() == folder / "sub" / "r.jsonl"


def test_the_repository_sweeps_write_into_the_working_directory(monkeypatch):
    """benchmarks/*.yaml write `../docs/results/...`, run from the repository root."""
    root = Path(__file__).parent.parent
    monkeypatch.chdir(root)
    spec = root / "benchmarks" / "frontier.yaml"
    assert load_sweep(spec.relative_to(root)).out.resolve().is_relative_to(root / "docs" / "results")
    monkeypatch.chdir(root / "benchmarks")  # from elsewhere it leads out of both: refused
    with pytest.raises(SweepError, match="lies outside"):
        load_sweep(spec)


def test_a_results_file_that_is_a_link_is_refused(tmp_path):
    target = tmp_path / "other.jsonl"
    link = tmp_path / "r.jsonl"
    link.symlink_to(target)  # dangling: following it would create the target
    with pytest.raises(ValueError, match=f"^results file {link} is a symbolic link"):
        ResultsFile(link, run="r")
    target.write_text("")
    with pytest.raises(ValueError, match="is a symbolic link"):
        ResultsFile(link, run="r")
    assert target.read_text() == "" and link.is_symlink()


@pytest.mark.parametrize("linked", ["summary.md", "score_vs_decode.png"])
def test_report_refuses_a_linked_file_before_writing_any(tmp_path, monkeypatch, capsys, linked):
    pytest.importorskip("matplotlib")
    results = report_rows(tmp_path / "r.jsonl")
    out_dir, victim = tmp_path / "rep", tmp_path / "precious.txt"
    out_dir.mkdir()
    victim.write_text("keep me")
    (out_dir / linked).symlink_to(victim)
    code, _, err = cli(monkeypatch, capsys, "report", results, "--out-dir", out_dir)
    assert_one_line_error(code, err, f"report file {out_dir / linked} is a symbolic link")
    assert victim.read_text() == "keep me" and sorted(p.name for p in out_dir.iterdir()) == [linked]


def test_a_replaced_file_is_whole_or_untouched(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    with pytest.raises(RuntimeError), replaced(path, "--json") as file:
        file.write(b"half")
        raise RuntimeError("interrupted")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]
    with replaced(path, "--json") as file:
        file.write(b"new")
    assert path.read_text() == "new"
    with pytest.raises(OutputError, match="cannot write --json"):
        with replaced(tmp_path / "missing" / "x.json", "--json"):
            pass


# ---- a plugin that replaces a built-in method: said once, and named wherever methods are listed -------------------


def test_a_replacing_plugin_is_said_once_and_named_in_the_tables(monkeypatch, registry, caplog, capsys, tmp_path):
    import dataclasses

    from conftest import tiny_model
    from test_bad_input import WordTokenizer
    from test_core import load_plugins

    import refreshkv.runtime.loading
    from refreshkv import make_policy

    base = type(make_policy("snapkv"))
    plugin = type("Faster", (base,), {"name": "snapkv", "replaces": True, "__module__": "otherpkg.mod"})
    plugin = dataclasses.dataclass(plugin)
    for _ in range(2):  # a second load of the same plugin says nothing more
        load_plugins(monkeypatch, {("snapkv", "otherpkg"): plugin})
    assert [record.getMessage() for record in caplog.records] == [
        "warning: refreshkv: method 'snapkv' is otherpkg.mod.Faster from package otherpkg, replacing "
        "refreshkv.methods.snapkv.SnapKV"
    ]
    code, out, _ = cli(monkeypatch, capsys, "methods")
    assert code == 0 and "snapkv (from otherpkg)" in out and "oracle (ceiling)" in out

    monkeypatch.setattr(
        refreshkv.runtime.loading, "load_model", lambda *a, **k: (tiny_model("llama", layers=2), WordTokenizer())
    )
    prompt = " ".join(f"w{i}" for i in range(40))
    args = ["generate", "--method", "snapkv", "--budget", "8", "--window", "4", "--compare", "full"]
    code, out, err = cli(monkeypatch, capsys, *args, "--prompt", prompt, "--max-new-tokens", "2")
    assert code == 0, err
    assert "snapkv (from otherpkg)" in out.split("generation")[-1]  # the stats table's column

    rows = [
        {"run": "r", "config": config, "id": f"e{i}", "task": "ppl", "method": method, "params": {}, "length": 40}
        | {"seed": 0, "model": "m", "decode_ms_per_token": 1.0, "kv_bytes_full": 1000, "score": 2.0, "provider": who}
        for config, method, who in (("c", "full", "refreshkv"), ("d", "snapkv", "otherpkg"))
        for i in range(2)
    ]
    results = tmp_path / "r.jsonl"
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))
    code, out, err = cli(monkeypatch, capsys, "report", results, "--no-plots", "--out-dir", tmp_path / "rep")
    assert code == 0, err
    assert "snapkv (from otherpkg)" in out and "snapkv (from otherpkg)" in (tmp_path / "rep" / "summary.md").read_text()
