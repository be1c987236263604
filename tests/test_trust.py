"""Issue 50, trust: no code from a model folder, no native library or converted model that is not what this package
wrote, plugins that replace a method said so, and no file written outside the documented places or through a link."""

import json
import os
import sys
from pathlib import Path

import pytest
from test_bad_input import FullDisk, assert_one_line_error, cli, doc, no_model, report_rows, sweep_file, tiny_loader  # noqa: F401
from test_core import registry  # noqa: F401  (the fixture)

from refreshkv.eval.results_file import ResultsFile
from refreshkv.eval.sweep import SweepError, load_sweep
from refreshkv.runtime.output_files import OutputError, WriteFailed, write_bytes

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
    """benchmarks/sweeps/*.yaml write `../../docs/results/...`, run from the repository root."""
    root = Path(__file__).parent.parent
    monkeypatch.chdir(root)
    spec = root / "benchmarks" / "sweeps" / "frontier.yaml"
    assert load_sweep(spec.relative_to(root)).out.resolve().is_relative_to(root / "docs" / "results")
    monkeypatch.chdir(root / "benchmarks" / "sweeps")  # from elsewhere it leads out of both: refused
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


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_bench_refuses_a_linked_output_before_measuring(tmp_path, no_model, monkeypatch, capsys, option):  # noqa: F811
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench.png"
    linked = out if option == "--json" else tmp_path / "bench-steps.png"  # --plot also writes NAME-steps.png
    linked.symlink_to(tmp_path / "elsewhere")
    code, _, err = cli(monkeypatch, capsys, "bench", "--methods", "full", option, out)
    assert_one_line_error(code, err, f"bench output {linked} is a symbolic link")
    assert not (tmp_path / "elsewhere").exists()


def test_a_replaced_file_is_whole_or_untouched(tmp_path, monkeypatch):
    import refreshkv.runtime.output_files as output_files

    path = tmp_path / "out.json"
    path.write_text("old")
    with monkeypatch.context() as full:
        real = os.fdopen
        full.setattr(output_files.os, "fdopen", lambda fd, mode: FullDisk(real(fd, mode), room=2))
        with pytest.raises(
            WriteFailed, match=rf"^cannot write --json {path}: No space left on device \(4 bytes needed"
        ):
            write_bytes(path, b"half", "--json")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]
    write_bytes(path, b"new", "--json")
    assert path.read_text() == "new"
    with pytest.raises(OutputError, match="cannot write --json"):
        write_bytes(tmp_path / "missing" / "x.json", b"", "--json")


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

    from rich.console import Console

    from refreshkv.measure import bench
    from refreshkv.measure.bench_report import bench_tables

    monkeypatch.setattr(bench, "memory_bandwidth", lambda device: 1e10)
    methods = {"full": {}, "snapkv": {"budget": 8, "window": 4}}
    result = bench.run_bench(tiny_model("llama", layers=1), WordTokenizer(), methods, [40], new_tokens=3, rounds=1)
    console = Console(width=300, record=True)
    for table in bench_tables(result):
        console.print(table)
    assert "snapkv (from otherpkg)" in console.export_text()

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


# ---- code from a model folder never runs -------------------------------------------------------------------------


def folder_with_code(tmp_path) -> tuple[Path, Path]:
    """A tiny model folder whose config names a class in its own modeling file, which leaves a mark when imported."""
    from conftest import tiny_model

    folder, mark = tmp_path / "model", tmp_path / "code-ran"
    tiny_model().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "own"  # no class of transformers: only the folder's code would read it
    config["auto_map"] = {"AutoConfig": "modeling_own.OwnConfig", "AutoModelForCausalLM": "modeling_own.OwnModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_own.py").write_text(f"open({str(mark)!r}, 'w').close()\n")
    return folder, mark


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_model_folder_with_its_own_code_is_refused_without_a_prompt(tmp_path, monkeypatch, capsys, command):
    """transformers asked "run the custom code? [y/N]" on stdout; a "y" from stdin ran the folder's file."""
    import io

    folder, mark = folder_with_code(tmp_path)
    capsys.readouterr()  # what saving the folder printed
    document = tmp_path / "doc.txt"
    document.write_text("some text")
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\ny\n"))
    args = ["--prompt", "hi"] if command == "generate" else ["--prompt-file", document, "--method", "full"]
    code, out, err = cli(monkeypatch, capsys, command, "--model", folder, *args)
    assert_one_line_error(code, err, f"model folder {folder} asks to run its own code (config.json has auto_map")
    assert "never runs code from a model folder" in err and "[y/N]" not in out + err and not mark.exists()


def test_transformers_is_told_never_to_run_a_folders_code(tmp_path, monkeypatch):
    """Past the folder check (a config that needs code some other way), transformers refuses rather than asks."""
    import io

    import refreshkv.runtime.loading
    from refreshkv.runtime.loading import ModelError, load_model

    folder, mark = folder_with_code(tmp_path)
    monkeypatch.setattr(refreshkv.runtime.loading, "refuse_custom_code", lambda folder: None)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\ny\n"))
    with pytest.raises(ModelError, match=f"^cannot load the model in {folder}: .*contains custom code") as error:
        load_model(folder)
    assert "\n" not in str(error.value) and not mark.exists()


# ---- the compiled selection library: loaded only as this package built it ----------------------------------------


def test_a_planted_native_library_with_a_forged_record_never_runs(tmp_path, monkeypatch):
    """An attacker who can write the cache folder plants a library whose constructor writes a marker, with a record
    beside it holding its SHA-256 and the source's: the process builds its own library, in its own folder."""
    import hashlib
    import subprocess
    import tempfile

    import torch

    from refreshkv.core import native_library, native_selection

    compiler = native_library._compiler()
    if compiler is None:
        pytest.skip("no C compiler on this machine")
    cache, scratch = tmp_path / "cache", tmp_path / "tmp"
    (cache / "native").mkdir(parents=True)
    scratch.mkdir()
    monkeypatch.setenv("REFRESHKV_CACHE", str(cache))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    mark = tmp_path / "planted-ran"
    planted = tmp_path / "planted.c"
    planted.write_text(
        f'#include <stdio.h>\n__attribute__((constructor)) static void run(void) {{ fclose(fopen("{mark}", "w")); }}\n'
    )
    code = native_library.SOURCE.read_bytes()
    source = hashlib.sha256(code).hexdigest()
    # the names a cached library had: keyed by the source's, the compiler's and the machine's identity
    identity = hashlib.sha256(code + compiler.encode() + os.uname().machine.encode()).hexdigest()[:16]
    for name in (f"selection-{identity}", f"selection-{identity}-openmp", "selection", "selection-openmp"):
        library = cache / "native" / f"{name}.so"
        subprocess.run([compiler, "-shared", "-fPIC", str(planted), "-o", str(library)], check=True)
        record = {"source_sha256": source, "library_sha256": hashlib.sha256(library.read_bytes()).hexdigest()}
        library.with_suffix(".json").write_text(json.dumps(record))
    native_library._library.cache_clear()
    try:
        assert native_selection.top_k_in_order(torch.tensor([[0.1, 0.3, 0.2]]), 2).tolist() == [[1, 2]]
        assert native_library._library() is not None  # the C path ran: this process's own build
    finally:
        native_library._library.cache_clear()
    assert not mark.exists()
    assert list(scratch.iterdir()) == []  # its private build folder is gone once the library is loaded


# ---- the converted-model cache: used only as its conversion wrote it ---------------------------------------------


@pytest.fixture
def recorded_conversion(tmp_path, monkeypatch):
    """A private cache, a GGUF and a conversion that writes a config and 1 MB of weights (no transformers)."""
    import refreshkv.runtime.loading

    monkeypatch.setenv("REFRESHKV_CACHE", str(tmp_path / "cache"))
    calls = []

    def convert(gguf, target):
        calls.append(gguf)
        target.mkdir()
        (target / "config.json").write_text(json.dumps({"model_type": "llama", "rope_theta": 10000.0}))
        (target / "model.safetensors").write_bytes(bytes(range(256)) * 4096)

    monkeypatch.setattr(refreshkv.runtime.loading, "_convert_gguf", convert)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"x" * 100)
    return gguf, calls


TAMPERING = {
    "a config value": "config.json is not the file its conversion wrote",
    "weights overwritten in place, mtime restored": "model.safetensors is not the file its conversion wrote",
    "a file added": r"other files than its conversion wrote \(modeling_own.py\)",
    "a file removed": r"other files than its conversion wrote \(model.safetensors\)",
    "the record removed": "no record of the files its conversion wrote",
}


@pytest.mark.parametrize("tamper", TAMPERING)
def test_a_changed_conversion_is_converted_again_never_used(recorded_conversion, monkeypatch, tamper):
    """A changed rope_theta changed the output, and overwritten weights printed " changing changing"; both silently."""
    import refreshkv.runtime.cache_folder
    from refreshkv.runtime import conversion_record
    from refreshkv.runtime.loading import resolve_model_dir

    gguf, calls = recorded_conversion
    target = resolve_model_dir(gguf)
    digests = []
    real = refreshkv.runtime.cache_folder.hashlib.file_digest
    monkeypatch.setattr(
        refreshkv.runtime.cache_folder.hashlib, "file_digest", lambda f, name: digests.append(f) or real(f, name)
    )
    assert resolve_model_dir(gguf) == target and len(calls) == 1
    assert [Path(f.name).name for f in digests] == ["config.json"]  # intact: the weights only stat'ed
    config, weights = target / "config.json", target / "model.safetensors"
    if tamper == "a config value":
        config.write_text(config.read_text().replace("10000.0", "20000.0"))
    elif tamper == "weights overwritten in place, mtime restored":
        before = weights.stat()
        with weights.open("r+b") as file:
            file.seek(4096)
            file.write(b"\0" * 409600)
        os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    elif tamper == "a file added":
        (target / "modeling_own.py").write_text("")
    elif tamper == "a file removed":
        weights.unlink()
    else:
        (target / conversion_record.RECORD).unlink()
    with pytest.warns(UserWarning, match=rf"model in {target} is not used: .*{TAMPERING[tamper]}.*converting the GGUF"):
        assert resolve_model_dir(gguf) == target
    assert len(calls) == 2 and json.loads(config.read_text())["rope_theta"] == 10000.0
    assert conversion_record.problem(target) is None


def test_a_tampered_config_with_a_forged_hash_memo_is_never_used(recorded_conversion, monkeypatch):
    """rope_theta changed in place (same size), and a memo forged in hashes/ for the changed file's path, inode, size,
    mtime and ctime holding the recorded SHA-256: the config is hashed anew, found changed, and converted again."""
    import hashlib

    from refreshkv.runtime import conversion_record
    from refreshkv.runtime.loading import resolve_model_dir

    gguf, calls = recorded_conversion
    target = resolve_model_dir(gguf)
    config = target / "config.json"
    recorded = json.loads((target / conversion_record.RECORD).read_text())["files"]["config.json"]["sha256"]
    config.write_text(config.read_text().replace("10000.0", "90000.0"))
    stat = config.stat()
    identity = f"{config.resolve()}|{stat.st_ino}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}"
    memo = Path(os.environ["REFRESHKV_CACHE"]) / "hashes" / hashlib.sha256(identity.encode()).hexdigest()[:32]
    assert memo.parent.is_dir()  # the memos of the conversion's own hashes
    memo.write_text(recorded)
    with pytest.warns(UserWarning, match=r"config.json is not the file its conversion wrote") as said:
        assert resolve_model_dir(gguf) == target
    assert len(said) == 1 and "\n" not in str(said[0].message)
    assert len(calls) == 2 and json.loads(config.read_text())["rope_theta"] == 10000.0


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_cache_folder_another_user_may_write_is_refused_in_one_line(recorded_conversion, mode):
    from refreshkv.runtime.loading import resolve_model_dir
    from refreshkv.runtime.models import ModelError

    gguf, calls = recorded_conversion
    target = resolve_model_dir(gguf)
    target.parent.chmod(mode)
    with pytest.raises(ModelError, match=rf"^the model cache .* may be written by another user .*mode {mode:o}\)"):
        resolve_model_dir(gguf)
    assert len(calls) == 1


def test_the_cache_folder_variable_empty_means_the_default_and_a_tilde_is_home(monkeypatch, tmp_path):
    from refreshkv.core.cache_root import cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("REFRESHKV_CACHE", "")
    assert cache_dir() == tmp_path / ".cache" / "refreshkv"
    monkeypatch.setenv("REFRESHKV_CACHE", "~/x")
    assert cache_dir() == tmp_path / "x"


def test_a_replacing_plugins_rows_never_count_as_the_built_ins(
    tmp_path, doc, tiny_loader, monkeypatch, registry, capsys
):
    """A built-in snapkv eval, then the same eval under a plugin replacing snapkv, said "1 run, 2 already"."""
    import dataclasses

    from test_bad_input import ppl_eval_args
    from test_core import load_plugins

    from refreshkv import make_policy
    from refreshkv.eval.config import RunConfig

    out = tmp_path / "r.jsonl"
    args = ppl_eval_args(doc, out, "--method", "snapkv", "--budget", "8", "--window", "4", "--num-examples", "2")
    code, _, err = cli(monkeypatch, capsys, *args)
    assert code == 0, err
    built_in = RunConfig(task="ppl", method="snapkv", length=40).key()
    plugin = type("Faster", (type(make_policy("snapkv")),), {"name": "snapkv", "replaces": True})
    load_plugins(monkeypatch, {("snapkv", "otherpkg"): dataclasses.dataclass(plugin)})
    assert RunConfig(task="ppl", method="snapkv", length=40).key() != built_in
    assert RunConfig(task="ppl", method="full", length=40).fields().get("provider") is None  # built-in keys as before
    code, _, err = cli(monkeypatch, capsys, *args)
    assert_one_line_error(code, err, f"{out} holds results of another configuration")
    other = tmp_path / "plugin.jsonl"
    code, _, err = cli(monkeypatch, capsys, *ppl_eval_args(doc, other, *args[len(ppl_eval_args(doc, out)) :]))
    assert code == 0, err
    rows = [json.loads(line) for line in other.read_text().splitlines()]
    assert len(rows) == 2 and {row["provider"] for row in rows} == {"otherpkg"}
