"""One decode step under torch.profiler: the operators a step spends its time in (`refreshkv profile`).

The generation decodes `step` - 1 steps as `generate` does (steps count from 1 after the prompt, as the methods'
schedules do: with `stride` 10, step 20 is a full step), then the profiler records step `step` alone, through the
same cache; this is repeated in a few fresh generations and each operator's median kept. The step's wall time is
taken inside the profiler, so it includes the profiler's own cost per operator. Operators are ranked by their
time on the CPU: on a GPU that is what the host spends issuing them, not the kernels' time (which the profiler also
records; not reported here, as no GPU was available to test it).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from ..core.policy import Policy
from ..engine.cache_argument import with_cache
from ..runtime.generate import generate, synchronize


@torch.inference_mode()
def profile_once(
    model, ids: torch.Tensor, policy: Policy, step: int
) -> tuple[dict[str, tuple[float, int]], float, float]:
    """Self CPU ms and calls per operator of decode step `step`, its wall ms, and its count of full-attention layers."""
    warm = generate(model, ids, method=policy, max_new_tokens=step, eos_token_id=[])
    token = torch.tensor([row[-1:] for row in warm.tokens], device=ids.device)  # chosen at step - 1, not yet decoded
    position = torch.full_like(token, ids.shape[1] - 1 + step)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ids.device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        start = time.perf_counter()
        model(token, position_ids=position, **with_cache(model, warm.cache), use_cache=True)
        synchronize(ids.device)
        wall = time.perf_counter() - start
    operators = {event.key: (event.self_cpu_time_total / 1000, event.count) for event in profiler.key_averages()}
    return operators, 1000 * wall, warm.cache.stats.per_step(step)[step - 1]


def profile_step(model, ids: torch.Tensor, policy: Policy, step: int, top: int = 10, rounds: int = 3) -> dict:
    """Profile decode step `step` of `policy` after the prompts `ids` (rows of one length, decoded together), in
    `rounds` fresh generations: the `top` operators by median self time over rounds (one step's profile varies by
    10-20% between runs). Their calls do not grow with the rows: a step has no loop over them (issue 48)."""
    if step < 1 or rounds < 1:
        raise ValueError(f"step and rounds must be >= 1, got {step} and {rounds}")
    runs = [profile_once(model, ids, policy, step) for _ in range(rounds)]
    names = {name for operators, _, _ in runs for name in operators}
    median_ms = {name: statistics.median(ops.get(name, (0.0, 0))[0] for ops, _, _ in runs) for name in names}
    ranked = sorted(names, key=median_ms.get, reverse=True)
    total = sum(median_ms.values())
    return {
        "method": policy.name,
        "step": step,
        "batch": ids.shape[0],
        "context": ids.shape[1] + step,
        "rounds": rounds,
        "full_layers": runs[0][2],  # layers that attended fully at this step
        "wall_ms": statistics.median(wall for _, wall, _ in runs),
        "self_cpu_ms": total,
        "operator_calls": sum(calls for _, calls in runs[0][0].values()),  # the same at any batch: no loop over rows
        "operators": [
            {
                "name": name,
                "self_cpu_ms": median_ms[name],
                "calls": runs[0][0].get(name, (0.0, 0))[1],
                "share": median_ms[name] / total,
            }
            for name in ranked[:top]
        ],
    }
