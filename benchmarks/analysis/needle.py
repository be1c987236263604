"""Failure A (issue 15, item 5): RULER single-needle retrieval under refreshkv / snapkv / streamingllm.

For each RULER niah_single_{1,2,3} example (chat template + answer prefix, as `refreshkv eval` builds them), every
setting is run greedily and scored with RULER's metric; at each decode step the script records, per layer and KV
head, which of the needle value's token positions are in the set the step attends to (RefreshKV: C_p after the new
token is written, or everything on a full step; SnapKV / StreamingLLM: the store). Nothing in src/ is changed:
the policies are subclassed here.

    OMP_NUM_THREADS=1 python benchmarks/analysis/needle.py --lengths 2048 --n 3 --out /tmp/needle.jsonl

Output: one JSONL row per (example, setting) and a summary table on stdout (re-print it with --summary FILE).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import refreshkv  # noqa: E402
from refreshkv.eval.config import RunConfig, find_task  # noqa: E402
from refreshkv.eval.examples import prepare  # noqa: E402
from refreshkv.methods.refreshkv import RefreshKV  # noqa: E402
from refreshkv.methods.snapkv import SnapKV  # noqa: E402
from refreshkv.methods.streamingllm import StreamingLLM  # noqa: E402

MAX_NEW = 40  # a 7-digit needle needs ~9 tokens after the answer prefix; a UUID ~30
# the needle record of the generation in progress (the cache is built inside generate)
REC: dict = {}


class Recorder:
    """Mixin: after each decode step, the coverage of the needle tokens by what the step attended to."""

    def _attended(self, layer) -> torch.Tensor | None:
        """(Hkv, n) positions attended at this step, or None for everything (a full step)."""
        raise NotImplementedError

    def decode(self, layer, query, key, value, scaling):
        out = super().decode(layer, query, key, value, scaling)
        rec = REC.get("current")
        if rec is not None:
            kept = self._attended(layer)
            needle = rec["needle"]
            if kept is None:
                cov = torch.ones(key.shape[1])
            else:
                cov = torch.isin(kept[0], needle).sum(-1).float() / len(needle)  # (Hkv,)
            rec["steps"].setdefault(layer.cache.step, {})[layer.layer_idx] = cov.tolist()
            if layer.cache.step <= 2:  # which tokens around the needle are held: share of KV heads, per position
                around = rec["around"]
                held = torch.ones(len(around)) if kept is None else torch.isin(around, kept[0]).float()
                if kept is not None:
                    held = torch.stack([torch.isin(around, k).float() for k in kept[0]]).mean(0)
                acc = rec["held"].setdefault(layer.cache.step, torch.zeros(len(around)))
                acc += held / layer.cache.num_layers
        return out


class RecSelection(Recorder):
    def _attended(self, layer):
        return layer.state.store.positions


@dataclasses.dataclass
class RecSnapKV(RecSelection, SnapKV):
    pass


@dataclasses.dataclass
class RecStreaming(RecSelection, StreamingLLM):
    pass


@dataclasses.dataclass
class RecRefreshKV(Recorder, RefreshKV):
    full_first: bool = False  # a full step (and refresh) at decode step 1, the first query after the prompt

    def needs_full(self, layer, query):
        if self.full_first and layer.cache.step == 1:
            return True
        return super().needs_full(layer, query)

    def full_step(self, layer, query, scaling, rows=None, held=None):
        layer.was_full = True
        return super().full_step(layer, query, scaling, rows, held)

    def decode(self, layer, query, key, value, scaling):
        layer.was_full = False
        return super().decode(layer, query, key, value, scaling)

    def _attended(self, layer):
        return None if layer.was_full else layer.state.partial.store.positions


SETTINGS = {
    # name: (class, params)
    "full": (None, {}),
    "streamingllm": (RecStreaming, {}),
    "snapkv w32 k7 (default)": (RecSnapKV, {}),
    "snapkv w1 k7 (paper A.1)": (RecSnapKV, {"window": 1}),
    "snapkv w32 k1": (RecSnapKV, {"kernel": 1}),
    "snapkv w1 k1": (RecSnapKV, {"window": 1, "kernel": 1}),
    "snapkv w32 k15": (RecSnapKV, {"kernel": 15}),
    "snapkv w32 k7 mean": (RecSnapKV, {"aggregation": "mean"}),
    "snapkv w32 k7 L/4": (RecSnapKV, {"budget_ratio": 0.25}),
    "refreshkv (default w1 k7 max)": (RecRefreshKV, {}),
    "refreshkv w32": (RecRefreshKV, {"window": 32}),
    "refreshkv k1": (RecRefreshKV, {"kernel": 1}),
    "refreshkv w32 k1": (RecRefreshKV, {"window": 32, "kernel": 1}),
    "refreshkv k15": (RecRefreshKV, {"kernel": 15}),
    "refreshkv mean": (RecRefreshKV, {"aggregation": "mean"}),
    "refreshkv L/4": (RecRefreshKV, {"budget_ratio": 0.25}),
    "refreshkv full@step1": (RecRefreshKV, {"full_first": True}),
}


def needle_positions(tokenizer, example, ids) -> list[int]:
    """Token positions of the needle value(s) in the prompt (via the fast tokenizer's offsets)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": example["prompt"]}], add_generation_prompt=True, tokenize=False
    ) + (example.get("answer_prefix") or "")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == ids, "offsets do not match the runner's encoding"
    positions = []
    for value in example["reference"]:
        start = text.find(value)
        assert start >= 0 and text.find(value, start + 1) < 0, f"needle {value!r} not found once"
        end = start + len(value)
        positions += [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < end and b > start]
    return positions


def run(args):
    torch.set_num_threads(1)
    model, tokenizer = refreshkv.load_model()
    settings = [s for s in SETTINGS if not args.settings or any(k in s for k in args.settings)]
    out = open(args.out, "a")
    for length in args.lengths:
        for sub in args.tasks:
            config = RunConfig(task=f"ruler/{sub}", method="full", length=length)
            items = prepare(model, tokenizer, config, args.n)
            task = find_task(config.task)
            for item in items:
                ex = item.example
                needle = needle_positions(tokenizer, ex, item.input_ids)
                ids = torch.tensor([item.input_ids])
                for name in settings:
                    cls, params = SETTINGS[name]
                    policy = (
                        "full"
                        if cls is None
                        else cls(
                            budget_ratio=params.get("budget_ratio", args.ratio),
                            **{k: v for k, v in params.items() if k != "budget_ratio"},
                        )
                    )
                    around = torch.arange(needle[0] - 4, needle[-1] + 3)
                    rec = REC["current"] = {"needle": torch.tensor(needle), "steps": {}, "around": around, "held": {}}
                    t0 = time.time()
                    res = refreshkv.generate(
                        model, ids, method=policy, max_new_tokens=min(MAX_NEW, ex["max_new_tokens"])
                    )
                    pred = tokenizer.decode(res.tokens[0], skip_special_tokens=True)
                    row = {
                        "task": sub,
                        "length": length,
                        "id": ex["id"],
                        "prompt_tokens": len(item.input_ids),
                        "setting": name,
                        "score": float(task.score(pred, ex)),
                        "prediction": pred[:80],
                        "needle_positions": needle,
                        "budget": res.cache.budget,
                        "full_step_fraction": res.cache.full_step_fraction(),
                        "coverage": {str(k): v for k, v in rec["steps"].items() if k <= 12},
                        "held_around_needle": {
                            str(k): [round(x, 2) for x in v.tolist()] for k, v in rec["held"].items()
                        },
                        "around": [tokenizer.decode([item.input_ids[i]]) for i in around.tolist()],
                        "new_tokens": [tokenizer.decode([t]) for t in res.tokens[0][:12]],
                        "seconds": round(time.time() - t0, 1),
                    }
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    print(
                        f"{sub} L={length} {ex['id'].split('/')[-1]} {name:32s} score={row['score']:.2f} "
                        f"{row['seconds']}s {pred[:40]!r}",
                        flush=True,
                    )
    out.close()
    summary(args.out)


def summary(path):
    rows = [json.loads(line) for line in open(path)]
    by = {}
    for r in rows:
        by.setdefault(r["setting"], []).append(r)
    print(
        "\n| setting | n | accuracy | needle fully held at step 1 (share of layer x KV-head) | at step 2 | "
        "layers with >=1 head holding the whole needle at step 1 | full-step fraction |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in SETTINGS:
        if name not in by:
            continue
        rs = by[name]
        acc = sum(r["score"] for r in rs) / len(rs)
        cells = []
        for step in ("1", "2"):
            covs = [c for r in rs for c in r["coverage"].get(step, {}).values()]
            flat = [v for c in covs for v in c]
            cells.append(f"{sum(v == 1.0 for v in flat) / len(flat):.2f}" if flat else "-")
        layers = [sum(max(c) == 1.0 for c in r["coverage"].get("1", {}).values()) for r in rs]
        lay = f"{sum(layers) / len(layers):.1f}/30" if rs[0]["coverage"] else "-"
        fsf = sum(r["full_step_fraction"] for r in rs) / len(rs)
        print(f"| {name} | {len(rs)} | {acc:.2f} | {cells[0]} | {cells[1]} | {lay} | {fsf:.3f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048])
    parser.add_argument("--tasks", nargs="+", default=["niah_single_1", "niah_single_2", "niah_single_3"])
    parser.add_argument("--n", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=0.125)
    parser.add_argument("--settings", nargs="*", help="substrings of setting names to run (default: all)")
    parser.add_argument("--out", default="/tmp/needle.jsonl")
    parser.add_argument("--summary", help="only print the summary of this JSONL file")
    args = parser.parse_args()
    summary(args.summary) if args.summary else run(args)
