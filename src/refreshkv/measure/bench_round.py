"""One round of `refreshkv bench` (bench.py) at one length and batch: each method's run on the same prompt, after
one shared prefill or each after its own, timed step by step (`Run`), and stock transformers decoding
(`transformers`: DynamicCache + SDPA) for reference; a run measured alone reads its peak memory (`PeakMemory`)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from ..core.policy import make_policy
from ..engine.cache_argument import with_cache
from ..runtime.generate import generate, generate_many, repeat_rows, synchronize
from .batch_memory import proc_bytes

REFERENCE = "transformers"  # not a method: stock transformers decoding, benchmarked for reference


def method_of(label: str) -> str:
    """The method a bench entry runs: `refreshkv@int4` is `refreshkv` with its own --param settings (a variant)."""
    return label.split("@", 1)[0]


class PeakMemory:
    """Peak resident memory of one run: the process's high-water mark reset before it (Linux), or CUDA's peak."""

    def __init__(self, device: torch.device):
        self.device = device
        self.resettable = True  # False once the kernel refused a reset: the peaks are then the process's so far

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.resettable = False

    def how(self) -> str:
        """How the peaks were read, for the results (weights and the process's own memory included on the CPU)."""
        if self.device.type == "cuda":
            return "torch.cuda.max_memory_allocated, reset before each run measured alone"
        if not self.resettable:
            return "the process's VmHWM, not resettable here: the highest since the process started"
        return "the process's VmHWM (/proc/self/status), reset before each run measured alone"

    def peak_bytes(self) -> int | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return proc_bytes("/proc/self/status", "VmHWM")


@dataclasses.dataclass
class Run:
    method: str
    length: int
    new_tokens: int
    prefill_s: float
    decode_mean_s: float
    decode_median_s: float
    full_step_fraction: float
    kv_bytes_held: int
    kv_bytes_attended: float
    peak_bytes: int | None
    full_steps_s: list[float] = dataclasses.field(default_factory=list)  # steps where most layers attended fully
    partial_steps_s: list[float] = dataclasses.field(default_factory=list)  # steps where no layer did
    tokens: list[int] = dataclasses.field(default_factory=list)  # greedy tokens (compare eager with --compile runs)
    batch: int = 1  # rows decoded together
    prefill_rows: int = 1  # rows per prefill forward
    distinct_rows: int = 1  # rows prefilled, the others copies of them


def split_steps(step_s: list[float], full_layers: list[float], num_layers: int) -> tuple[list[float], list[float]]:
    """Decode-step times of full steps (at least half the layers attended fully) and of partial steps (none did).

    A refresh or a fixed-stride full step involves every layer at once; mixed steps (the dynamic schedule sending
    a few layers to full attention) are in neither list.
    """
    full = [t for t, layers in zip(step_s, full_layers) if layers >= num_layers / 2]
    partial = [t for t, layers in zip(step_s, full_layers) if layers == 0]
    return full, partial


def run_round(
    model,
    ids,
    methods: dict[str, dict],
    names: list[str],
    new_tokens,
    peak: PeakMemory,
    share_prefill: bool,
    compile: bool = False,
    prefill_rows: int | None = None,
    decode_rows: int | None = None,
) -> list[Run]:
    """One run of each of `names`, in that order, prefilled `prefill_rows` rows per forward (None: all at once), the
    rows of `ids` repeated to `decode_rows` after the prefill (None: `ids`'s rows decode).
    Shared: one prefill for all (its time in every Run, peak memory unattributable); otherwise each method prefills
    alone and its peak memory is its own."""
    runs = {}
    if REFERENCE in names:
        runs[REFERENCE] = run_transformers_once(model, ids, new_tokens, peak, prefill_rows, decode_rows)
    policies = {name: make_policy(method_of(name), **methods[name]) for name in names if name != REFERENCE}
    decoding = dict(
        max_new_tokens=new_tokens, eos_token_id=[], compile=compile, prefill_rows=prefill_rows, decode_rows=decode_rows
    )
    if share_prefill and policies:
        outs = generate_many(model, ids, methods=list(policies.values()), **decoding)
        runs.update((name, run_from(name, ids, new_tokens, out, None)) for name, out in zip(policies, outs))
    else:
        for name, policy in policies.items():
            peak.reset()
            out = generate(model, ids, method=policy, **decoding)
            runs[name] = run_from(name, ids, new_tokens, out, peak.peak_bytes())
    for run in runs.values():
        run.prefill_rows = prefill_rows or run.distinct_rows
    return [runs[name] for name in names]


def run_from(method: str, ids, new_tokens: int, result, peak_bytes: int | None) -> Run:
    stats = result.stats()
    full_steps, partial_steps = split_steps(
        result.step_s,
        result.cache.stats.per_step(result.cache.step, [layer.layer_idx for layer in result.cache.method_layers()]),
        len(result.cache.method_layers()),
    )
    return Run(
        method=method,
        length=ids.shape[1] + new_tokens,
        new_tokens=new_tokens,
        prefill_s=result.prefill_s,
        decode_mean_s=statistics.fmean(result.step_s),
        decode_median_s=statistics.median(result.step_s),
        full_step_fraction=stats["full_step_fraction"],
        kv_bytes_held=stats["kv_bytes_full"],
        kv_bytes_attended=stats["kv_bytes_attended_mean"],
        peak_bytes=peak_bytes,
        full_steps_s=full_steps,
        partial_steps_s=partial_steps,
        tokens=result.tokens[0],
        batch=len(result.tokens),
        distinct_rows=ids.shape[0],
    )


def transformers_prefill(model, ids, rows: int | None, decode_rows: int | None) -> tuple[DynamicCache, torch.Tensor]:
    """Stock transformers' prefill of `ids`, `rows` rows per forward (None: all at once): each group into a
    DynamicCache of its own, joined into the first one layer at a time (keys and values concatenated along the batch,
    each group's layer dropped once moved), as `prefill_in_groups` does for the methods, then repeated to
    `decode_rows` rows (None: as many as `ids`) as `repeat_rows` repeats theirs. Returns it and the logits."""
    rows = rows or ids.shape[0]
    caches, logits = [], []
    for start in range(0, ids.shape[0], rows):
        caches.append(DynamicCache(config=model.config))
        chosen = ids[start : start + rows]
        logits.append(model(chosen, **with_cache(model, caches[-1]), use_cache=True, logits_to_keep=1).logits[:, -1])
    if len(caches) > 1:
        for layers in zip(*(cache.layers for cache in caches)):
            layers[0].keys = torch.cat([layer.keys for layer in layers])
            layers[0].values = torch.cat([layer.values for layer in layers])
            for layer in layers[1:]:
                layer.keys = layer.values = None
    logits, _, _ = repeat_rows(caches[:1], torch.cat(logits), torch.ones_like(ids), decode_rows or ids.shape[0])
    return caches[0], logits


def run_transformers_once(
    model, ids, new_tokens, peak: PeakMemory, prefill_rows: int | None, decode_rows: int | None = None
) -> Run:
    """Stock transformers decoding (DynamicCache + SDPA): the reference the project's speed targets quote."""
    peak.reset()
    device = ids.device
    with torch.inference_mode():
        start = time.perf_counter()
        cache, logits = transformers_prefill(model, ids, prefill_rows, decode_rows)
        synchronize(device)
        prefill_s = time.perf_counter() - start
        step_s = []
        for _ in range(new_tokens - 1):
            token = logits.argmax(dim=-1, keepdim=True)
            start = time.perf_counter()
            logits = model(token, **with_cache(model, cache), use_cache=True).logits[:, -1]
            synchronize(device)
            step_s.append(time.perf_counter() - start)
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return Run(
        REFERENCE,
        ids.shape[1] + new_tokens,
        new_tokens,
        prefill_s,
        statistics.fmean(step_s),
        statistics.median(step_s),
        1.0,
        held,
        held,
        peak.peak_bytes(),
        batch=logits.shape[0],
        distinct_rows=ids.shape[0],
    )
