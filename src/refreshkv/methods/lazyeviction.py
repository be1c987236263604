"""`lazyeviction` (Zhang, Zhang, Ma, Zhang, Guo, 2025, "LazyEviction: Lagged KV Eviction with Attention Pattern
Observation for Efficient Long Reasoning", arXiv 2506.15969; kv-eviction-landscape.txt): for long outputs, evict
late and spare the tokens whose importance recurs.

The paper observes Token Importance Recurrence: in long reasoning many tokens regain attention after many decoding
steps, so evicting on the current step's attention drops tokens that will be needed again. Its two components:
1. recurrence interval tracking: for every held token, the steps at which it is important and the longest interval
   between two of them (its maximum recurrence interval, MRI);
2. lagged, MRI-centric eviction: the cache grows for a window of W decoding steps and is then brought back to its
   budget at once (this package's `compress_every` = W), evicting first the tokens overdue for their recurrence.
The prompt is selected as snapkv selects it (budget K, window kept).

Choices where the paper is silent or that differ from it (the exact scoring is this package's):
- A token is important at a step when the step's attention to it, aggregated over the GQA group (`aggregation`,
  max), is above uniform (1 / the tokens held).
- The eviction score of a held token with MRI m that was last important g steps ago is (m + 1) / (g + 1): high while
  it is within its usual recurrence, low once overdue or never recurring; the last `window` tokens are kept whatever
  their score. Prompt tokens start as important at step 0.
- The tracking is bookkeeping per position (two integers per token and KV head, not counted as KV bytes); evicted
  tokens' entries are never read again.
- W = `compress_every`, 32 by default (None: snapkv with the tracking unused).
"""

from __future__ import annotations

import dataclasses
from typing import cast

import torch
from torch import Tensor

from ..core.attention_math import Scaling, aggregate_group
from ..core.policy import register
from ..core.selection import SelectionLayer, SelectionState
from .snapkv import SnapKV


@dataclasses.dataclass
class RecurrenceState(SelectionState):
    """A selection with, per position and KV head, the last step it was important and its longest interval."""

    last_important: Tensor | None = dataclasses.field(default=None, kw_only=True)  # (B, Hkv, positions) long
    longest_interval: Tensor | None = dataclasses.field(default=None, kw_only=True)  # (B, Hkv, positions) long


@register
@dataclasses.dataclass
class LazyEviction(SnapKV):
    """LazyEviction: snapkv's prompt selection; while decoding, every `compress_every` steps the tokens least likely to
    recur within their maximum recurrence interval are evicted, back to K.

    Parameters: `budget`: K tokens per KV head (or `budget_ratio`: K as a share of the longest prompt, 1/8 by
    default), window included; `compress_every` (32) W, decoding steps between lagged evictions; `window` (32),
    `kernel` (7), `pooling` (span; `preset="paper"`: centered), `aggregation` (max) as in snapkv.
    """

    name = "lazyeviction"
    summary = "lagged eviction every W steps sparing tokens whose attention recurs (maximum recurrence interval)"
    presets = {"paper": {"compress_every": 32, "window": 32, "kernel": 7, "pooling": "centered", "aggregation": "max"}}

    compress_every: int | None = 32

    def store_selection(
        self, layer: SelectionLayer, key: Tensor, value: Tensor, index: Tensor, scores: Tensor
    ) -> SelectionState:
        held = super().store_selection(layer, key, value, index, scores)
        tracked = (*key.shape[:2], key.shape[2] + layer.expected_new_tokens() + 1)
        return RecurrenceState(
            held.store,
            held.scores,
            held.filled,
            held.empty,
            last_important=torch.zeros(tracked, dtype=torch.long, device=key.device),
            longest_interval=torch.zeros(tracked, dtype=torch.long, device=key.device),
        )

    def tracking(self, layer: SelectionLayer) -> tuple[Tensor, Tensor]:
        """The state's per-position records, grown (by doubling) to cover the newest position."""
        state = cast(RecurrenceState, layer.state)
        last, longest = state.last_important, state.longest_interval
        assert last is not None and longest is not None
        if layer.seen > last.shape[-1]:
            extra = max(last.shape[-1], layer.seen - last.shape[-1])
            last = torch.cat([last, last.new_zeros(*last.shape[:2], extra)], dim=-1)
            longest = torch.cat([longest, longest.new_zeros(*longest.shape[:2], extra)], dim=-1)
            state.last_important, state.longest_interval = last, longest
        return last, longest

    def observe(self, layer: SelectionLayer, probs: Tensor) -> None:
        """Record which held tokens this step finds important, and their intervals since they last were."""
        state = layer.state
        last, longest = self.tracking(layer)
        positions = state.store.positions
        valid = state.store.valid(layer.pads)
        step = layer.step
        newest = layer.seen - 1
        last[..., newest] = step  # a decoded token is born important
        attention = aggregate_group(probs, self.aggregation)  # (B, Hkv, slots)
        uniform = 1.0 / valid.sum(-1, keepdim=True).clamp(min=1)
        important = valid & (attention > uniform)
        index = positions.clamp(min=0)
        gap = step - last.gather(-1, index)
        longest.scatter_(
            -1, index, torch.where(important, longest.gather(-1, index).maximum(gap), longest.gather(-1, index))
        )
        last.scatter_(-1, index, torch.where(important, torch.full_like(gap, step), last.gather(-1, index)))

    def compression_scores(self, layer: SelectionLayer, order: Tensor, scaling: Scaling) -> Tensor:
        """(m + 1) / (g + 1) per held token in `order`: m its longest interval, g the steps since it was important."""
        last, longest = self.tracking(layer)
        positions = layer.state.store.positions.gather(-1, order).clamp(min=0)
        gap = (layer.step - last.gather(-1, positions)).clamp(min=0)
        return (longest.gather(-1, positions) + 1).float() / (gap + 1).float()
