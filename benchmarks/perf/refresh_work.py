"""The selection work of one refresh, per layer, without the model: what a full step of `refreshkv` / `recycled`
adds to `full`'s step (pooled scores, the top K, C_p gathered from C_f), timed over many repetitions so that a
change of a tenth of a millisecond shows through a noisy machine's step times.

    python benchmarks/perf/refresh_work.py --length 8192 --budget 1024 --threads 2 [--against OTHER_CHECKOUT/src]

Shapes are SmolLM2-135M's (3 KV heads, 3 query heads each, head size 64, 30 layers); the words for span pooling
come from its tokenizer over the package's public-domain book (the embedded model). Prints the median ms per layer
and per step (x layers) for each pooling. `--against` times another checkout's code in the same process,
alternating blocks of repetitions with this one's (its package is imported under another name from a copy);
`--pytorch-too` this code with its C kernels off (core/native_selection.py), likewise.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from refreshkv.engine.spans import WordTable
from refreshkv.runtime.loading import resolve_model_dir
from refreshkv.texts import book_text

KV_HEADS, GROUP, HEAD_DIM, LAYERS = 3, 3, 64, 30
BLOCKS = 20  # alternations of the codes compared


def prompt_spans(length: int) -> torch.Tensor:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(), local_files_only=True)
    ids = tokenizer(book_text(), return_tensors="pt").input_ids[:, :length]
    if ids.shape[1] < length:
        ids = ids.repeat(1, -(-length // ids.shape[1]))[:, :length]
    return WordTable.of(tokenizer).spans(ids)


def refresher(package: str, pooling: str, length: int, budget: int, spans, native: str = "1"):
    """A function that runs `repeats` refreshes of one layer with `package`'s code (its C kernels off with `native`
    "0") and returns their times (ms)."""
    method_module = importlib.import_module(f"{package}.methods.refreshkv")
    selection = importlib.import_module(f"{package}.core.selection")
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=generator)
    values = torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=generator)
    probs = torch.rand(1, KV_HEADS, GROUP, 1, length, generator=generator).softmax(-1)
    method = method_module.RefreshKV(budget=budget, pooling=pooling)
    state = method_module.RefreshState(None, selection.SelectionState.empty_like(keys, budget + 1), None)
    layer = type("Layer", (), {"prompt_spans": spans, "state": state, "budget": budget, "model_type": "llama"})()

    def refresh():
        if hasattr(method, "selection_rule"):  # the rule in one home (methods/refreshkv/partial_cache.py)
            method.selection_rule(layer).refresh(layer, probs, None, (keys, values))
        elif hasattr(method, "_selection_scores"):  # checkouts before the refresh in one C call took scores
            method._refresh(state, method._selection_scores(layer, probs), None, (keys, values))
        else:
            method._refresh(layer, probs, None, (keys, values))

    def run(repeats: int) -> list[float]:
        os.environ["REFRESHKV_NATIVE"] = native  # read at each call: the C kernels on or off for these repetitions
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            refresh()
            times.append((time.perf_counter() - start) * 1e3)
        return times

    return run


def import_other(source: Path) -> str:
    """The other checkout's `refreshkv` package, copied and importable as `refreshkv_other`."""
    if not (source / "refreshkv" / "__init__.py").is_file():
        sys.exit(f"error: --against {source}: no refreshkv package there; give a checkout's src folder")
    folder = Path(tempfile.mkdtemp())
    shutil.copytree(source / "refreshkv", folder / "refreshkv_other")  # its imports inside are relative
    sys.path.insert(0, str(folder))
    return "refreshkv_other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2000, help="refreshes timed per code and pooling")
    parser.add_argument("--against", type=Path, help="another checkout's src folder, timed alternately")
    parser.add_argument(
        "--pytorch-too", action="store_true", help="also time this code with its C kernels off, alternately"
    )
    args = parser.parse_args()
    if not 0 < args.budget < args.length:
        sys.exit(f"error: --budget must be in [1, --length), got {args.budget}")
    torch.set_num_threads(args.threads)
    packages = {"this": "refreshkv"}
    if args.against:
        packages["against"] = import_other(args.against)
    spans = prompt_spans(args.length - 32)  # the last 32 tokens stand for decoded ones, scored on their own
    for pooling in ("centered", "span"):
        runs = {
            name: refresher(package, pooling, args.length, args.budget, spans) for name, package in packages.items()
        }
        if args.pytorch_too:
            runs["pytorch"] = refresher("refreshkv", pooling, args.length, args.budget, spans, native="0")
        times = {name: [] for name in runs}
        for run in runs.values():
            run(50)  # warm-up
        for _ in range(BLOCKS):
            for name, run in runs.items():
                times[name] += run(max(1, args.repeats // BLOCKS))
        for name, measured in times.items():
            median = statistics.median(measured)
            print(
                f"{name:8s} pooling={pooling:8s} {median:.3f} ms per layer, {median * LAYERS:.1f} ms per refresh "
                f"step ({LAYERS} layers)"
            )


if __name__ == "__main__":
    main()
