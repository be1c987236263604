"""`refreshkv train`: documents, split, windows, the Trainer run, kill-and-resume, and bad input."""

import json
import os
import random
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from test_bad_input import assert_one_line_error, cli

from refreshkv.texts.documents import read_documents
from refreshkv.train.run import TrainConfig, WindowDataset, train
from refreshkv.train.windows import cut_windows, split_documents

TESTS = Path(__file__).parent


class BosWordTokenizer:
    """One token per word (ids 3..127) and BOS id 1, like the embedded tokenizer's `<|im_start|>`."""

    bos_token_id = 1

    def encode(self, text, add_special_tokens=True):
        return [3 + zlib.crc32(word.encode()) % 125 for word in text.split()]


def write_documents(folder: Path, count: int = 6, words: int = 400) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        rng = random.Random(i)
        (folder / f"doc{i}.txt").write_text(" ".join(f"w{rng.randrange(50)}" for _ in range(words)))
    return folder


def tiny_config(data: Path, **overrides) -> TrainConfig:
    settings = dict(
        data=[str(data)],
        model="tiny",
        prefix_length=48,
        suffix_length=8,
        budget=8,
        steps=12,
        eval_every=4,
        save_every=4,
        dev_windows=4,
        lr=1e-3,
        warmup=2,
    )
    return TrainConfig(**{**settings, **overrides})


def test_documents_from_files_folders_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("one two")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "c.txt").write_text("three")
    (folder / "b.txt").write_text("four")
    (folder / "skip.md").write_text("not read")
    (tmp_path / "d.jsonl").write_text('{"text": "five"}\n\n{"text": "  "}\n{"text": "six"}\n')
    documents = read_documents([tmp_path / "a.txt", folder, tmp_path / "d.jsonl"])
    assert [(d.name, d.text) for d in documents] == [
        ("a.txt", "one two"),
        ("b.txt", "four"),
        ("c.txt", "three"),
        ("d.jsonl:1", "five"),
        ("d.jsonl:4", "six"),
    ]
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"title": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 has no string field 'text'"):
        read_documents([tmp_path / "bad.jsonl"])
    with pytest.raises(ValueError, match="does not exist"):
        read_documents([tmp_path / "missing.txt"])
    (tmp_path / "empty.txt").write_text(" \n")
    with pytest.raises(ValueError, match="holds no text"):
        read_documents([tmp_path / "empty.txt"])


def test_split_is_by_document_80_10_10_and_seeded(tmp_path):
    documents = read_documents([write_documents(tmp_path / "docs", count=20, words=5)])
    splits = split_documents(documents, seed=0)
    assert {k: len(v) for k, v in splits.items()} == {"train": 16, "dev": 2, "test": 2}
    names = [{d.name for d in splits[s]} for s in ("train", "dev", "test")]
    assert set.union(*names) == {d.name for d in documents} and sum(map(len, names)) == 20  # disjoint, complete
    assert split_documents(documents, seed=0) == splits
    assert split_documents(documents, seed=1) != splits
    assert {k: len(v) for k, v in split_documents(documents[:6], seed=0).items()} == {"train": 4, "dev": 1, "test": 1}
    with pytest.raises(ValueError, match="holds 2 document"):
        split_documents(documents[:2], seed=0)


def test_windows_start_with_bos_and_follow_each_other(tmp_path):
    text = " ".join(f"w{i}" for i in range(25))
    documents = read_documents([write_documents(tmp_path / "short", count=1, words=3)])
    (tmp_path / "long.txt").write_text(text)
    documents += read_documents([tmp_path / "long.txt"])
    tokenizer = BosWordTokenizer()
    cut = cut_windows(tokenizer, documents, length=11)
    ids = tokenizer.encode(text)
    assert cut.skipped == 1
    assert cut.windows == [[1] + ids[0:10], [1] + ids[10:20]]  # the last 5 tokens are dropped
    dataset = WindowDataset(cut.windows, prefix_length=8, loss_on="suffix")
    labels = dataset[0]["labels"]
    assert (labels[:8] == -100).all() and labels[8:].tolist() == cut.windows[0][8:]
    assert WindowDataset(cut.windows, 8, "all")[1]["labels"].tolist() == cut.windows[1]


def test_training_lowers_the_dev_loss_and_saves_a_loadable_model(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    metrics = train(
        tiny_model("llama", layers=2),
        BosWordTokenizer(),
        tiny_config(write_documents(tmp_path / "d")),
        out,
        progress=False,
        log=lambda line: None,
    )
    assert metrics["steps"] == 12 and metrics["train_windows"] > 0
    state = json.loads((out / "checkpoints" / "checkpoint-12" / "trainer_state.json").read_text())
    dev = [entry["eval_loss"] for entry in state["log_history"] if "eval_loss" in entry]
    assert len(dev) == 3 and dev[-1] < dev[0] and metrics["dev_loss"] == dev[-1]
    assert json.loads((out / "split" / "documents.json").read_text())["test"]
    reloaded = AutoModelForCausalLM.from_pretrained(out / "model", attn_implementation="refreshkv")
    assert reloaded.config.use_cache


KILLED_RUN = """
import os, signal, sys
from pathlib import Path
from transformers import TrainerCallback
from conftest import tiny_model
from test_train import BosWordTokenizer, tiny_config
from refreshkv.train.run import train

class KillAtStep6(TrainerCallback):  # between checkpoints 4 and 8, like a SIGKILL at any moment
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 6:
            os.kill(os.getpid(), signal.SIGKILL)

train(tiny_model("llama", layers=2), BosWordTokenizer(), tiny_config(Path(sys.argv[1])), Path(sys.argv[2]),
      progress=False, log=lambda line: None, callbacks=[KillAtStep6()])
"""


def run_killed_training(data: Path, out: Path) -> subprocess.CompletedProcess:
    """The run of `train_here` in a process of its own, killed by SIGKILL at step 6 (this package's code: PYTHONPATH
    passes on where it is set)."""
    path = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}
    return subprocess.run(
        [sys.executable, "-c", KILLED_RUN, str(data), str(out)],
        cwd=TESTS,
        capture_output=True,
        text=True,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", **path},
        timeout=300,
    )


def train_here(data: Path, out: Path, resume: bool = False) -> dict:
    return train(
        tiny_model("llama", layers=2),
        BosWordTokenizer(),
        tiny_config(data),
        out,
        resume=resume,
        progress=False,
        log=lambda line: None,
    )


def test_a_killed_run_resumes_to_the_same_dev_loss(tmp_path):
    """A run killed between checkpoints (SIGKILL, in a process of its own) resumes from its folder, here in the test's
    process as `refreshkv train --resume` would in a new one, to the dev loss of a run never stopped; without
    resume it is refused. Only the killed run pays a process start (~5 s each here, the training itself <1 s)."""
    data = write_documents(tmp_path / "d")
    killed = run_killed_training(data, tmp_path / "killed")
    assert killed.returncode == -9, killed.stderr
    assert not (tmp_path / "killed" / "model").exists()
    with pytest.raises(ValueError, match="add --resume"):
        train_here(data, tmp_path / "killed")
    resumed = train_here(data, tmp_path / "killed", resume=True)  # before this test trains anything in its process
    uninterrupted = train_here(data, tmp_path / "whole")
    assert resumed["dev_loss"] == pytest.approx(uninterrupted["dev_loss"], abs=1e-5)


def test_bad_data_and_folders_are_refused_before_anything_is_written(tmp_path):
    model, tokenizer = tiny_model("llama", layers=2), BosWordTokenizer()
    short = write_documents(tmp_path / "short", words=20)  # 21 tokens < L + S = 56
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"no train document holds L \+ S = 56 tokens"):
        train(model, tokenizer, tiny_config(short), out, progress=False, log=lambda line: None)
    assert not out.exists()
    train(
        model,
        tokenizer,
        tiny_config(write_documents(tmp_path / "d"), steps=2),
        out,
        progress=False,
        log=lambda line: None,
    )
    with pytest.raises(ValueError, match=r"holds a different training run \(differs in: lr\)"):
        train(model, tokenizer, tiny_config(tmp_path / "d", steps=2, lr=1e-4), out, resume=True, progress=False)
    with pytest.raises(ValueError, match="without a sliding window shorter than L"):  # Gemma 3: window 16 < 56
        train(tiny_model("gemma3"), tokenizer, tiny_config(tmp_path / "d"), tmp_path / "gemma", progress=False)
    assert not (tmp_path / "gemma").exists()
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty and holds no training run"):
        train(model, tokenizer, tiny_config(tmp_path / "d"), stray, progress=False)


@pytest.mark.parametrize(
    "args, fragments",
    [
        (
            ["--suffix-length", "64", "--prefix-length", "64"],
            ["suffix length S (64) must be below the prefix length L (64)"],
        ),
        (["--budget", "64", "--prefix-length", "64"], ["budget K (64) must be below the prefix length L (64)"]),
        (["--budget", "8", "--budget-ratio", "0.5"], ["either --budget or --budget-ratio"]),
        (["--loss-on", "middle"], ["unknown --loss-on 'middle'; choose from: all, suffix"]),
        (["--device", "cuda"], ["no CUDA GPU"]),
    ],
)
def test_cli_bad_input_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, args, fragments):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    data = write_documents(tmp_path / "d", words=5)
    code, _, err = cli(monkeypatch, capsys, "train", "--data", data, "--out", tmp_path / "out", *args)
    assert_one_line_error(code, err, *fragments)
    assert not (tmp_path / "out").exists()


def test_cli_refuses_missing_or_too_few_documents(tmp_path, monkeypatch, capsys):
    code, _, err = cli(monkeypatch, capsys, "train", "--data", tmp_path / "none.txt", "--out", tmp_path / "out")
    assert_one_line_error(code, err, "data path", "none.txt does not exist")
    data = write_documents(tmp_path / "d", count=2, words=5)
    code, _, err = cli(monkeypatch, capsys, "train", "--data", data, "--out", tmp_path / "out")
    assert_one_line_error(code, err, "holds 2 document(s); a train/dev/test split needs at least 3")
    assert not (tmp_path / "out").exists()
