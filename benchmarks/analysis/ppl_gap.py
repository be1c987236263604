"""Failure B (issue 15, item 5): RefreshKV's perplexity gap on the book task, token by token.

Teacher-forced losses (as `refreshkv eval --task ppl`) of `target` tokens after `length` context tokens of a book, for
several settings; for RefreshKV the script also records, per decode step and layer, whether the layer took a full
step (refresh) and how many of the most recent tokens C_p holds after the step (local context). Nothing in src/ is
changed: the policy is subclassed here.

    OMP_NUM_THREADS=1 python benchmarks/analysis/ppl_gap.py --length 2048 --n 2 --out /tmp/ppl2k.jsonl
    OMP_NUM_THREADS=1 python benchmarks/analysis/ppl_gap.py --length 4096 --budget 512 --target 128 \
        --n 2 --settings full snapkv-w1 "refreshkv default" "refreshkv k1" --out /tmp/ppl4k.jsonl
    python benchmarks/analysis/ppl_gap.py --summary /tmp/ppl2k.jsonl

Output: one JSONL row per (example, setting) with the losses and the per-step refresh record; the summary prints
perplexity per setting, excess loss over `full` by position bin, and RefreshKV's excess by steps since the layer
majority's last refresh.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import refreshkv  # noqa: E402
from refreshkv.core.policy import make_policy  # noqa: E402
from refreshkv.eval.perplexity import teacher_forced  # noqa: E402
from refreshkv.eval.tasks.ppl import PerplexityTask  # noqa: E402
from refreshkv.methods.refreshkv import RefreshKV  # noqa: E402

# the repository's public-domain books (data/books)
BOOK = str(Path(__file__).resolve().parents[2] / "data" / "books" / "austen-persuasion.txt")
RECENT = 16
REC: dict = {}


@dataclasses.dataclass
class RecRefreshKV(RefreshKV):
    """RefreshKV that records, per step and layer: full step or not, and which of the last RECENT tokens C_p holds."""

    def full_step(self, layer, query, scaling, rows=None, held=None):
        layer.was_full = True
        return super().full_step(layer, query, scaling, rows, held)

    def decode(self, layer, query, key, value, scaling):
        layer.was_full = False
        out = super().decode(layer, query, key, value, scaling)
        rec = REC.get("current")
        if rec is not None:
            cur = layer.state.full.length - 1  # the token just written
            recent = torch.arange(cur - RECENT, cur)  # the RECENT tokens before it
            held = torch.isin(recent, layer.state.partial.store.positions[0]).float()  # any head
            per_head = torch.stack([torch.isin(recent, p) for p in layer.state.partial.store.positions[0]]).float()
            step = layer.cache.step
            rec["full"].setdefault(step, [0] * layer.cache.num_layers)[layer.layer_idx] = int(layer.was_full)
            # share of KV heads holding the previous token (t-1), and the mean number of the last RECENT held
            rec["prev"].setdefault(step, [0.0] * layer.cache.num_layers)[layer.layer_idx] = (
                per_head[:, -1].mean().item()
            )
            rec["recent"].setdefault(step, [0.0] * layer.cache.num_layers)[layer.layer_idx] = (
                per_head.sum(-1).mean().item()
            )
            # prompt tokens still in C_p (mean over KV heads) and share of KV heads holding the first token (sink)
            positions = layer.state.partial.store.positions[0]
            rec["prompt_held"].setdefault(step, [0.0] * layer.cache.num_layers)[layer.layer_idx] = (
                ((positions >= 0) & (positions < layer.cache.prompt_length)).sum(-1).float().mean().item()
            )
            rec["sink"].setdefault(step, [0.0] * layer.cache.num_layers)[layer.layer_idx] = (
                (positions == 0).any(-1).float().mean().item()
            )
            del held
        return out


SETTINGS = {
    "full": ("full", {}),
    "streamingllm": ("streamingllm", {}),
    "snapkv": ("snapkv", {}),  # window 32, kernel 7 (defaults)
    "snapkv-w1": ("snapkv", {"window": 1}),  # the paper's setting (A.1)
    "refreshkv default": (RecRefreshKV, {}),
    "refreshkv never-refresh": (RecRefreshKV, {"threshold": -1.0}),  # C_p of K+1 never rebuilt
    "refreshkv k1": (RecRefreshKV, {"kernel": 1}),
    "refreshkv mean": (RecRefreshKV, {"aggregation": "mean"}),
    "refreshkv post_rope": (RecRefreshKV, {"query": "post_rope"}),
    "refreshkv stride10": (RecRefreshKV, {"stride": 10}),
    "refreshkv 2K": (RecRefreshKV, {"budget_scale": 2}),  # C_p of 2K: the tokens snapkv holds at the end
    "refreshkv 1.5K": (RecRefreshKV, {"budget_scale": 1.5}),  # C_p of 1.5K: snapkv's mean over the window
}


def make(name, budget):
    cls, params = SETTINGS[name]
    params = dict(params)
    scale = params.pop("budget_scale", 1)
    b = int(budget * scale)
    if isinstance(cls, str):
        return make_policy(cls, **params) if cls == "full" else make_policy(cls, budget=b, **params)
    return cls(budget=b, **params)


def run(args):
    torch.set_num_threads(1)
    model, tokenizer = refreshkv.load_model()
    task = PerplexityTask()
    examples = task.build(tokenizer, args.length, args.n, 0, paths=[args.book], target_tokens=args.target)
    budget = args.budget or math.ceil(args.ratio * args.length)
    settings = [s for s in SETTINGS if not args.settings or s in args.settings]
    with open(args.out, "a") as out:
        for ex in examples:
            for name in settings:
                rec = REC["current"] = {"full": {}, "prev": {}, "recent": {}, "prompt_held": {}, "sink": {}}
                t0 = time.time()
                forced = teacher_forced(model, ex["input_ids"], ex["target_start"], make(name, budget))
                row = {
                    "id": ex["id"],
                    "source": ex["source_id"],
                    "length": args.length,
                    "budget": budget,
                    "setting": name,
                    "ppl": PerplexityTask.score_losses(forced.losses),
                    "losses": [round(v, 5) for v in forced.losses],
                    "full_step_fraction": forced.cache.full_step_fraction(),
                    "full": {str(k): v for k, v in rec["full"].items()},
                    "prev": {str(k): v for k, v in rec["prev"].items()},
                    "recent": {str(k): v for k, v in rec["recent"].items()},
                    "prompt_held": {str(k): v for k, v in rec["prompt_held"].items()},
                    "sink": {str(k): v for k, v in rec["sink"].items()},
                    "seconds": round(time.time() - t0, 1),
                }
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(
                    f"{ex['id']} {name:24s} ppl={row['ppl']:.2f} full={row['full_step_fraction']:.3f} "
                    f"{row['seconds']}s",
                    flush=True,
                )
    summary(args.out)


def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def summary(path):
    rows = [json.loads(line) for line in open(path)]
    full = {r["id"]: r["losses"] for r in rows if r["setting"] == "full"}
    by = {}
    for r in rows:
        by.setdefault(r["setting"], []).append(r)
    n_tok = len(rows[0]["losses"])
    bins = [(a, min(a + n_tok // 4, n_tok)) for a in range(0, n_tok, n_tok // 4)]
    print(f"L={rows[0]['length']} K={rows[0]['budget']} T={n_tok} examples={len(full)}")
    print(
        "| setting | ppl (pooled) | excess nats/token | "
        + " | ".join(f"excess t={a}-{b - 1}" for a, b in bins)
        + " | full-step fraction | C_p holds t-1 (share of KV heads) | of last 16 held |"
    )
    print("|---" * (6 + len(bins)) + "|")
    for name, rs in by.items():
        losses = [v for r in rs for v in r["losses"]]
        ex = [[a - b for a, b in zip(r["losses"], full[r["id"]])] for r in rs if r["id"] in full]
        cells = [f"{mean(v for e in ex for v in e[a:b]):+.3f}" for a, b in bins]
        prev = [v for r in rs for s in r.get("prev", {}).values() for v in s]
        recent = [v for r in rs for s in r.get("recent", {}).values() for v in s]
        print(
            f"| {name} | {math.exp(mean(losses)):.2f} | {mean(v for e in ex for v in e):+.3f} | "
            + " | ".join(cells)
            + f" | {mean(r['full_step_fraction'] for r in rs):.3f} | "
            + (f"{mean(prev):.3f} | {mean(recent):.1f} |" if prev else "- | - |")
        )
    print(
        "\nRefreshKV's C_p: prompt tokens held (mean over layers and KV heads) / share of KV heads holding token 0, "
        "by decode step"
    )
    for name, rs in by.items():
        if not rs[0].get("prompt_held"):
            continue
        steps = sorted(int(k) for k in rs[0]["prompt_held"])
        marks = [s for s in (1, len(steps) // 4, len(steps) // 2, 3 * len(steps) // 4, len(steps)) if s in steps]
        print(
            f"  {name}: "
            + ", ".join(
                f"step {s}: {mean(v for r in rs for v in r['prompt_held'][str(s)]):.0f} / "
                f"{mean(v for r in rs for v in r['sink'][str(s)]):.2f}"
                for s in marks
            )
        )
    # RefreshKV: excess by steps since the layer's last refresh, per layer-weighted: a step's "staleness" is the
    # mean over layers of steps since that layer's last full step (prefill = step 0).
    print(
        "\nExcess loss over full by staleness (mean over layers of steps since each layer's last refresh; "
        "the loss of target j is computed at decode step j, j=0 at prefill)"
    )
    for name, rs in by.items():
        if not rs[0].get("full"):
            continue
        buckets = {}
        for r in rs:
            if r["id"] not in full:
                continue
            layers = len(next(iter(r["full"].values())))
            last = [0] * layers
            for j, (a, b) in enumerate(zip(r["losses"], full[r["id"]])):
                if j == 0:
                    stale = 0.0  # prefill logits: full attention
                else:
                    flags = r["full"][str(j)]
                    last = [j if f else seen for f, seen in zip(flags, last)]
                    stale = mean(j - seen for seen in last)
                key = (
                    "0 (this step full everywhere)"
                    if stale == 0
                    else (
                        "<2"
                        if stale < 2
                        else "2-5"
                        if stale < 5
                        else "5-10"
                        if stale < 10
                        else "10-20"
                        if stale < 20
                        else "20-50"
                        if stale < 50
                        else ">=50"
                    )
                )
                buckets.setdefault(key, []).append(a - b)
        order = ["0 (this step full everywhere)", "<2", "2-5", "5-10", "10-20", "20-50", ">=50"]
        print(
            f"  {name}: "
            + ", ".join(f"{k}: {mean(buckets[k]):+.3f} (n={len(buckets[k])})" for k in order if k in buckets)
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--target", type=int, default=256)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--ratio", type=float, default=0.125)
    parser.add_argument("--budget", type=int)
    parser.add_argument("--book", default=BOOK)
    parser.add_argument("--settings", nargs="*")
    parser.add_argument("--out", default="/tmp/ppl_gap.jsonl")
    parser.add_argument("--summary")
    args = parser.parse_args()
    summary(args.summary) if args.summary else run(args)
