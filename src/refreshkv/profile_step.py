"""One decode step under torch.profiler: the operators a step spends its time in (`refreshkv profile`).

The generation decodes `step` - 1 steps as `generate` does (steps count from 1 after the prompt, as the methods'
schedules do: with `stride` 10, step 20 is a full step), then the profiler records step `step` alone, through the
same cache. The step's wall time is taken inside the profiler, so it includes the profiler's own cost per operator.
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from .core.policy import Policy
from .generate import generate, synchronize


@torch.inference_mode()
def profile_step(model, ids: torch.Tensor, policy: Policy, step: int, top: int = 10) -> dict:
    """Profile decode step `step` of `policy` after the prompt `ids` (one row): the `top` operators by self time."""
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    warm = generate(model, ids, method=policy, max_new_tokens=step, eos_token_id=[])
    token = torch.tensor([warm.tokens[0][-1:]], device=ids.device)  # chosen at step - 1, not yet decoded
    position = torch.tensor([[ids.shape[1] - 1 + step]], device=ids.device)
    device = ids.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        start = time.perf_counter()
        model(token, position_ids=position, past_key_values=warm.cache, use_cache=True)
        synchronize(device)
        wall = time.perf_counter() - start
    events = sorted(profiler.key_averages(), key=lambda event: event.self_cpu_time_total, reverse=True)
    total = sum(event.self_cpu_time_total for event in events)
    return {
        "method": policy.name,
        "step": step,
        "context": ids.shape[1] + step,
        "full_layers": warm.cache.stats.per_step(step)[step - 1],  # layers that attended fully at this step
        "wall_ms": 1000 * wall,
        "self_cpu_ms": total / 1000,
        "operators": [
            {"name": event.key, "self_cpu_ms": event.self_cpu_time_total / 1000, "calls": event.count,
             "share": event.self_cpu_time_total / total}
            for event in events[:top]
        ],
    }
