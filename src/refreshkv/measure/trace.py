"""What a method's selection holds at every decode step and layer (`refreshkv trace`): one generation, one method.

At each decode step, in each layer that runs the method (Gemma's sliding-window layers keep their window and are left
out), after the method's own step:
- `full`: whether the step attended to every token (the method's own record);
- `mass`: the share of the exact attention that the tokens the step attended to carry, computed on the side from a
  copy of every key (analysis only: the method never sees it); mean over query heads; 1 at a full step;
- `overlap`: the share of the exact top-K (the current query's K highest probabilities, max over a GQA group, the
  newest token aside, as `oracle` chooses) among the tokens attended to, mean over KV heads; 1 at a full step;
- `needle`: the share of the needle's prompt tokens in the method's selection (`Policy.selection`: C_p for
  refreshkv and recycled, the sinks and window for streamingllm++, the tokens held for an eviction method, the
  step's own choice for quest and oracle), mean over KV heads, and `needle_attention`: the exact attention on the
  needle's tokens (the largest over query heads), which says when the model reads it.
A method whose every step attends to everything (`full`) has no selection: every step shows 1. The trace holds
one row of numbers per step and layer, so a generation is refused above `MAX_STEPS` decode steps.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core.attention_math import aggregate_group, attention_probs
from ..core.policy import Policy
from ..engine.cache import PolicyCache, PolicyLayer
from ..runtime.generate import decode, prefill
from ..runtime.generation_settings import DecodeSettings

MAX_STEPS = 1024  # one row per step and layer: a bounded file (about 2 MB at 30 layers) and memory
MEASURES = ("mass", "overlap", "needle", "needle_attention")


def check_steps(max_new_tokens: int) -> None:
    if not 1 <= max_new_tokens <= MAX_STEPS:
        raise ValueError(f"a trace records every step and layer: max_new_tokens must be in [1, {MAX_STEPS}]")


def what_it_shows(policy: Policy) -> str:
    """One line on what the trace's selection is for this method."""
    if type(policy).selection is Policy.selection:
        return (
            f"method '{policy.name}' has no partial cache: its selection is the tokens it holds, which every step "
            "attends to"
        )
    if hasattr(policy, "stride") and hasattr(policy, "sinks"):  # streamingllm++
        return (
            f"method '{policy.name}': its selection is the sinks and recent window that partial steps attend to; "
            "full steps read the whole cache"
        )
    if hasattr(policy, "stride"):  # refreshkv, recycled
        return f"method '{policy.name}': its selection is C_p, which partial steps attend to; full steps read C_f"
    return f"method '{policy.name}': its selection is what each step chose to attend to"


@dataclasses.dataclass
class StepRecord:
    """One decode step: per traced layer, each measure."""

    full: list[bool]
    mass: list[float]
    overlap: list[float]
    needle: list[float]
    needle_attention: list[float]


class Trace:
    """The side computation: every key of the traced layers, and the measures of each step."""

    def __init__(self, needle: list[int]):
        self.needle = torch.tensor(needle, dtype=torch.long)
        self.keys: dict[int, torch.Tensor] = {}
        self.steps: list[StepRecord] = []

    def prompt(self, layer: PolicyLayer, key: torch.Tensor) -> None:
        self.keys[layer.layer_idx] = key.detach().clone()

    def step(self, layer: PolicyLayer, query: torch.Tensor, key: torch.Tensor, scaling) -> None:
        keys = self.keys[layer.layer_idx] = torch.cat([self.keys[layer.layer_idx], key], dim=2)
        n = keys.shape[2]
        probs = attention_probs(query, keys, scaling)[0, :, :, 0]  # (Hkv, G, n): the exact attention
        cache = layer.cache
        if cache.step > len(self.steps):
            self.steps.append(StepRecord([], [], [], [], []))
        record = self.steps[cache.step - 1]
        full = float(cache.stats.full[layer.layer_idx][cache.step - 1]) > 0.5
        selection = cache.policy.selection(layer, query, scaling)
        held = torch.ones(probs.shape[0], n, dtype=torch.bool)
        if selection is not None:
            chosen = selection[0].cpu()  # -1: an empty entry, sent to a spare column that is dropped
            spare = torch.zeros(held.shape[0], n + 1, dtype=torch.bool)
            held = spare.scatter_(1, torch.where(chosen >= 0, chosen, n), True)[:, :n]
        needle = self.needle
        record.needle.append(float(held[:, needle].float().mean()) if len(needle) else 0.0)
        record.needle_attention.append(float(probs[:, :, needle].sum(-1).max()) if len(needle) else 0.0)
        record.full.append(full)
        if full or selection is None:
            record.mass.append(1.0)
            record.overlap.append(1.0)
            return
        record.mass.append(float((probs * held[:, None]).sum(-1).mean()))
        k = min(cache.budget, n - 1)
        top = aggregate_group(probs[None, ..., : n - 1], "max")[0].topk(k, dim=-1).indices  # (Hkv, K)
        record.overlap.append(float(held.gather(1, top).float().mean()))


class TracedLayer(PolicyLayer):
    """A cache layer that hands each of its method's steps to the cache's `Trace` once the method has taken it."""

    def attend(self, module, query, key, value, mask, scaling, sliding_window=None):
        at_prompt = self.state is None
        output = super().attend(module, query, key, value, mask, scaling, sliding_window)
        if not self.cache.windowed[self.layer_idx]:
            if at_prompt:
                self.cache.trace.prompt(self, key)
            else:
                self.cache.trace.step(self, query, key, scaling)
        return output


class TracedCache(PolicyCache):
    layer_type = TracedLayer

    def __init__(self, policy: Policy, model, max_new_tokens: int, trace: Trace):
        super().__init__(policy, model, max_new_tokens)
        self.trace = trace


@torch.inference_mode()
def trace_generation(model, ids: torch.Tensor, policy: Policy, max_new_tokens: int, needle: list[int]) -> dict:
    """Greedy generation of one prompt (1, L) under `policy`, with every step traced; `needle`: the needle's prompt
    positions (may be empty). Returns the trace as a JSON-ready dict (`layers`: the traced layers, bottom first;
    `steps`: per step the token and, per layer, each measure)."""
    check_steps(max_new_tokens)
    if ids.shape[0] != 1:
        raise ValueError(f"a trace follows one prompt, got a batch of {ids.shape[0]}")
    if any(not 0 <= p < ids.shape[1] for p in needle):
        raise ValueError(f"needle positions must lie in the prompt's {ids.shape[1]} tokens")
    trace = Trace(needle)
    cache = TracedCache(policy, model, max_new_tokens, trace)
    mask = torch.ones_like(ids)
    logits, _ = prefill(model, ids, mask, cache)
    eos = model.generation_config.eos_token_id
    eos = torch.tensor([] if eos is None else eos, device=ids.device).flatten()
    out = decode(model, cache, logits, mask, max_new_tokens, DecodeSettings(), eos, None, False, False)
    layers = [layer.layer_idx for layer in cache.method_layers()]
    return {
        "method": policy.name,
        "params": {k: v for k, v in dataclasses.asdict(policy).items()},
        "shows": what_it_shows(policy),
        "prompt_tokens": ids.shape[1],
        "budget": cache.budget,
        "needle_positions": needle,
        "layers": layers,
        "tokens": out.tokens[0],
        "steps": [dataclasses.asdict(record) for record in trace.steps],
    }
