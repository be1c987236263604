"""Long outputs under a bounded cache: 2,048 decoded tokens, each eviction method with `compress_every`, against `full`.

SmolLM2-135M-Instruct reads `--prompt` tokens of a public-domain book (data/books, its README: license) as plain text,
then decodes `--decode` tokens:
- `forced`: teacher-forced on the book's own continuation (the next `--decode` tokens of the book);
- `free`: teacher-forced on `full`'s own greedy continuation of the same prompt (each method is fed `full`'s answer,
  so the KL is measured at the same positions; `full`'s free tokens are recomputed, deterministic on one thread).
Every eviction method (those that take `compress_every`) runs at each K of `--budgets` with `compress_every` N
(`--every`, 64: the long-output target is K + 64 tokens per layer, and N = 64 brings each layer back to K once per
64 tokens, so it never holds more; a smaller N scores the cache more often for the same bound). `refreshkv` runs
with `keep_decoded=False` (its C_p bounded at K + 1; its C_f holds every token, so its memory is not bounded).

Per method and K one JSONL row: KV tokens held per layer at the end (the most any KV head of the layer holds;
`held_max`, `held_mean` over layers), KV bytes held, KL(full || method) per output token (nats; the whole curve in
`kl`, its mean per 256-token bucket in `kl_buckets`, `kl_mean`), the share of tokens where the method's greedy choice
is `full`'s (`top1_agree`), decode ms/token, and where it ran (`machine`, `threads`, `timing`, `command`,
`commit`). Rows already in --out (same mode, method, params) are skipped: a killed run resumes.

    OMP_NUM_THREADS=1 python benchmarks/analysis/long_output.py --mode forced
    OMP_NUM_THREADS=1 python benchmarks/analysis/long_output.py --mode free
    python benchmarks/analysis/long_output.py --summary docs/results/long-output/smollm2-forced.jsonl
    python benchmarks/analysis/long_output.py --plot docs/results/long-output/smollm2-forced.jsonl \
        docs/results/long-output/smollm2-forced.png
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import refreshkv  # noqa: E402
from refreshkv import METHODS, make_policy  # noqa: E402

BOOK = ROOT / "data" / "books" / "austen-pride-and-prejudice.txt"
BOOK_OFFSET = 20_000  # tokens into the book: past the front matter, in the middle of the story
BUCKET = 256
# every method that takes compress_every, the classic ones first (a partial run has them)
FIRST = ("snapkv", "pyramidkv", "h2o", "streamingllm", "tova", "dynamickv", "adakv", "keydiff")
EVICTING = [name for name in FIRST if "compress_every" in METHODS[name].parameters()] + sorted(
    name for name, cls in METHODS.items() if "compress_every" in cls.parameters() and name not in FIRST
)
TIMING = "1 thread, beside another job on the same 2-core machine: ms/token is not a quiet measurement"


class Reference(NamedTuple):
    """`full`'s log-probabilities over the vocabulary at each output position, and its decode speed."""

    logprobs: torch.Tensor  # (N, vocab) float32
    decode_ms_per_token: float
    held: list[int]
    kv_bytes: int


def held_tokens(cache) -> list[int]:
    """Per layer, the most tokens any KV head holds (the positions its store keeps); `seen` for a full layer."""
    held = []
    for layer in cache.layers:
        state = getattr(layer, "state", None)
        kept = getattr(state, "kept", None)
        if callable(kept):
            held.append(int((kept(None) >= 0).sum(-1).max()))
        else:
            held.append(int(layer.seen))
    return held


def kl_per_token(reference: torch.Tensor, logits: torch.Tensor, chunk: int = 256) -> tuple[list[float], list[bool]]:
    """KL(p_ref || p_method) in nats at each position, and whether both greedy choices agree.
    `reference`: (N, V) log-probabilities; `logits`: (N, V) raw logits of the method."""
    kl, agree = [], []
    for start in range(0, reference.shape[0], chunk):
        ref = reference[start : start + chunk].float()
        mine = torch.log_softmax(logits[start : start + chunk].float(), dim=-1)
        kl += (ref.exp() * (ref - mine)).sum(-1).clamp_min(0.0).tolist()
        agree += (ref.argmax(-1) == mine.argmax(-1)).tolist()
    return kl, agree


def buckets(values: list[float], size: int = BUCKET) -> list[float]:
    return [round(sum(part) / len(part), 5) for part in (values[i : i + size] for i in range(0, len(values), size))]


def decode(model, prompt: torch.Tensor, targets: torch.Tensor, policy):
    """Teacher-forced decode of `targets` (1, N) after `prompt` (1, L) under `policy`: the output with its logits."""
    return refreshkv.generate(model, prompt, method=policy, forced_tokens=targets, return_logits=True)


def reference_of(model, prompt: torch.Tensor, targets: torch.Tensor) -> Reference:
    out = decode(model, prompt, targets, make_policy("full"))
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    return Reference(logprobs, out.decode_ms_per_token, held_tokens(out.cache), sum(out.cache.nbytes_per_layer()))


def measure(model, prompt: torch.Tensor, targets: torch.Tensor, name: str, params: dict, reference: Reference) -> dict:
    """One row's measurements: `name` with `params` teacher-forced on `targets`, against `reference`."""
    out = decode(model, prompt, targets, make_policy(name, **params))
    logits = torch.cat(out.logits)
    kl, agree = kl_per_token(reference.logprobs, logits)
    del logits, out.logits
    held = held_tokens(out.cache)
    return {
        "held_per_layer": held,
        "held_max": max(held),
        "held_mean": round(sum(held) / len(held), 1),
        "kv_bytes_held": sum(out.cache.nbytes_per_layer()),
        "kv_bytes_full": reference.kv_bytes,
        "kl_mean": round(sum(kl) / len(kl), 5),
        "kl_buckets": buckets(kl),
        "kl": [round(value, 5) for value in kl],
        "top1_agree": round(sum(agree) / len(agree), 4),
        "decode_ms_per_token": round(out.decode_ms_per_token, 2),
        "full_decode_ms_per_token": round(reference.decode_ms_per_token, 2),
    }


def book_tokens(tokenizer, prompt: int, decoded: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = tokenizer(BOOK.read_text(encoding="utf-8"), return_tensors="pt")["input_ids"][0]
    start = BOOK_OFFSET
    if start + prompt + decoded > ids.shape[0]:
        raise SystemExit(f"{BOOK.name} has {ids.shape[0]} tokens; need {start + prompt + decoded}")
    return ids[None, start : start + prompt], ids[None, start + prompt : start + prompt + decoded]


def settings(budgets: list[int], every: int, methods: list[str]) -> list[tuple[str, dict]]:
    runs = [("full", {})]
    for name in methods:  # each method at every K before the next method: a partial run has whole methods
        for budget in budgets:
            if name == "refreshkv":
                runs.append((name, {"budget": budget, "keep_decoded": False}))
            else:
                runs.append((name, {"budget": budget, "compress_every": every}))
    return runs


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def summary(path: Path) -> str:
    rows = read_rows(path)
    lines = [
        "| method | K | KV tokens held per layer, max (mean) | KV MB held | mean KL to `full` | KL, last 256 tokens | "
        "top-1 = `full`'s | decode ms/token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda r: (r["params"].get("budget", 0), r["kl_mean"])):
        budget = row["params"].get("budget", "-")
        lines.append(
            f"| `{row['method']}` | {budget} | {row['held_max']} ({row['held_mean']:g}) | "
            f"{row['kv_bytes_held'] / 2**20:.1f} | {row['kl_mean']:.3f} | {row['kl_buckets'][-1]:.3f} | "
            f"{row['top1_agree']:.2f} | {row['decode_ms_per_token']:.1f} |"
        )
    return "\n".join(lines)


def plot(path: Path, out: Path) -> None:
    """KL to `full` per 256-token bucket along the output, one panel per K, one line per method."""
    from refreshkv.eval.plots import _pyplot, _save

    rows = [row for row in read_rows(path) if row["method"] != "full"]
    budgets = sorted({row["params"]["budget"] for row in rows})
    plt = _pyplot()
    names = sorted({row["method"] for row in rows})
    colours = {name: plt.get_cmap("tab20")(i % 20) for i, name in enumerate(names)}  # the same in every panel
    fig, axes = plt.subplots(1, len(budgets), figsize=(6 * len(budgets), 4.5), sharey=True, squeeze=False)
    for axis, budget in zip(axes[0], budgets):
        for row in sorted((r for r in rows if r["params"]["budget"] == budget), key=lambda r: r["kl_mean"]):
            ends = [BUCKET * (i + 1) for i in range(len(row["kl_buckets"]))]
            style = "--" if names.index(row["method"]) % 2 else "-"
            colour = colours[row["method"]]
            axis.plot(ends, row["kl_buckets"], style, marker="o", markersize=3, color=colour, label=row["method"])
        axis.set_title(f"K = {budget}, compress_every {rows[0]['params'].get('compress_every', '-')}")
        axis.set_xlabel("decoded tokens (end of each 256-token bucket)")
        axis.set_yscale("log")
    axes[0][0].set_ylabel("mean KL(full || method), nats")
    axes[0][-1].legend(fontsize=7, ncol=2)
    _save(fig, out)


def commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "status", "--porcelain", "src"], capture_output=True, text=True, cwd=ROOT)
    return result.stdout.strip() + ("+src changes" if dirty.stdout.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("forced", "free"), default="forced")
    parser.add_argument("--out", type=Path, help="JSONL rows (default docs/results/long-output/smollm2-MODE.jsonl)")
    parser.add_argument("--prompt", type=int, default=2048, help="book tokens read before decoding")
    parser.add_argument("--decode", type=int, default=2048, help="tokens decoded")
    parser.add_argument("--budgets", default="512,256", help="K values, comma-separated")
    parser.add_argument("--every", type=int, default=64, help="compress_every N")
    parser.add_argument("--methods", default=",".join([*EVICTING, "refreshkv"]), help="comma-separated")
    parser.add_argument("--summary", type=Path, help="print the table of this file and stop")
    parser.add_argument("--plot", type=Path, nargs=2, metavar=("ROWS", "PNG"), help="plot KL along the output")
    args = parser.parse_args()
    if args.plot:
        plot(*args.plot)
        return
    if args.summary:
        print(summary(args.summary))
        return
    torch.set_num_threads(1)
    out = args.out or ROOT / "docs" / "results" / "long-output" / f"smollm2-{args.mode}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    budgets = [int(value) for value in args.budgets.split(",")]
    runs = settings(budgets, args.every, args.methods.split(","))
    shape = {"mode": args.mode, "prompt_tokens": args.prompt, "decoded": args.decode}
    done = {
        (row["method"], json.dumps(row["params"], sort_keys=True))
        for row in read_rows(out)
        if all(row[key] == value for key, value in shape.items())
    }
    todo = [(name, params) for name, params in runs if (name, json.dumps(params, sort_keys=True)) not in done]
    if not todo:
        print(summary(out))
        return
    model, tokenizer = refreshkv.load_model()
    prompt, targets = book_tokens(tokenizer, args.prompt, args.decode)
    if args.mode == "free":
        free = refreshkv.generate(model, prompt, method="full", max_new_tokens=args.decode, eos_token_id=[])
        targets = torch.tensor(free.tokens[0])[None]
    reference = reference_of(model, prompt, targets)
    from refreshkv.measure.bench import cpu_facts

    facts = {
        "model": "smollm2-135m",
        "book": f"data/books/{BOOK.name}",
        "book_offset_tokens": BOOK_OFFSET,
        "machine": cpu_facts()["cpu"],
        "threads": torch.get_num_threads(),
        "timing": TIMING,
        "command": "python benchmarks/analysis/long_output.py " + shlex.join(sys.argv[1:]),
        "commit": commit(),
    }
    for name, params in todo:
        started = time.time()
        if name == "full":
            measured = {
                "held_per_layer": reference.held,
                "held_max": max(reference.held),
                "held_mean": round(sum(reference.held) / len(reference.held), 1),
                "kv_bytes_held": reference.kv_bytes,
                "kv_bytes_full": reference.kv_bytes,
                "kl_mean": 0.0,
                "kl_buckets": [0.0] * len(buckets([0.0] * args.decode)),
                "kl": [],
                "top1_agree": 1.0,
                "decode_ms_per_token": round(reference.decode_ms_per_token, 2),
                "full_decode_ms_per_token": round(reference.decode_ms_per_token, 2),
            }
        else:
            measured = measure(model, prompt, targets, name, params, reference)
        row = {**shape, "method": name, "params": params, **measured, **facts}
        row["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        with out.open("a", encoding="utf-8") as file:
            file.write(json.dumps(row) + "\n")
        print(
            f"{name} {params}: held max {row['held_max']}, KL {row['kl_mean']:.4f}, "
            f"{row['decode_ms_per_token']} ms/token ({time.time() - started:.0f} s)",
            flush=True,
        )
    print(summary(out))


if __name__ == "__main__":
    main()
