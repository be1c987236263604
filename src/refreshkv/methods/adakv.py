"""`adakv` (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient
LLM Inference", arXiv 2407.11550; kv-eviction-landscape.txt): SnapKV's scores, with the layer's budget shared among
its heads instead of split evenly.

A layer keeps the same number of selected tokens as snapkv, (K - window) per KV head on average, but chooses them as
one top-((K - window) x Hkv) over the scores of all its KV heads together, so a head whose attention is spread out
gets more tokens and a concentrated head fewer (the paper's head-wise adaptive allocation, which minimises an upper
bound of the eviction loss). A safeguard gives every head at least `alpha` x (K - window) of its own best tokens
first; the joint top-k then places the rest. Every head also keeps the observation window, as in snapkv.

Choices where the paper is silent or that differ from its released code:
- Scores: snapkv's (this package's window, kernel, pooling and group aggregation; the paper pairs Ada-KV with SnapKV
  and PyramidKV). With grouped-query attention a KV head's score is the group's aggregate (`aggregation`, max), and
  budgets are shared among KV heads (the paper's GQA support shares among KV heads too).
- Safeguard `alpha` 0.2: the value of the authors' released code; the paper's text argues for it without a number.
- Heads keep different numbers of tokens: the store is as wide as the largest head of the layer, the other heads'
  extra slots empty and masked (as `refreekv`'s), so the memory held is that of the largest head. The bytes a step
  reads are the same; real per-head memory needs a ragged store, not built.
- Joint ranking ties go to the earlier head and position, so a padded batch keeps what its rows keep alone.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..core.attention_math import Scaling, ranked
from ..core.policy import PolicyError, is_number, register
from ..core.selection import SelectionLayer, checked_scores
from .snapkv import SnapKV


def check_alpha(value: object) -> None:
    if not is_number(value) or not 0 <= value <= 1:
        raise PolicyError(
            f"alpha must be a number in [0, 1] (the share of the mean budget every head keeps), got {value!r}"
        )


def adaptive_keep(scores: Tensor, per_head: int, floor: int, valid: Tensor | None) -> Tensor:
    """(B, H, P) bool: per row, each head's top `floor` tokens, then the top of the rest over all heads together, up
    to `per_head` x H tokens in all; never a position `valid` ((B, 1, P) or None) excludes."""
    batch, heads, length = scores.shape
    if valid is not None:
        scores = scores.masked_fill(~valid, float("-inf"))
    keep = torch.zeros_like(scores, dtype=torch.bool)
    if floor:
        keep.scatter_(-1, ranked(scores, min(floor, length)), True)
    rest = per_head * heads - keep[0].sum().item() if floor else per_head * heads
    if rest > 0:
        flat = scores.masked_fill(keep, float("-inf")).reshape(batch, -1)
        free = (~keep).reshape(batch, -1)
        chosen = ranked(flat, min(int(rest), flat.shape[-1]), valid=free)
        keep.view(batch, -1).scatter_(-1, chosen, True)
    return keep if valid is None else keep & valid


@register
@dataclasses.dataclass
class AdaKV(SnapKV):
    """Ada-KV over SnapKV: a layer's selected budget, (K - window) x KV heads, placed by one joint top-k.

    Parameters: `budget`: K tokens per KV head on average (or `budget_ratio`: K as a share of the longest prompt, 1/8
    by default), window included; `window` (32), `kernel` (7), `pooling` (span), `aggregation` (max) as in
    snapkv, chosen on the dev sets as snapkv's were (`preset="paper"`: the centred kernel of SnapKV's released code);
    `alpha` (0.2) share of the mean selected budget every head keeps of its own; `compress_every` (None) as in
    snapkv (each head back to K).
    """

    name = "adakv"
    summary = "SnapKV's scores, the layer's budget shared among its heads by one joint top-k (head-adaptive)"
    presets = {"paper": {"window": 32, "kernel": 7, "pooling": "centered", "aggregation": "max", "alpha": 0.2}}

    alpha: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        check_alpha(self.alpha)

    def select(
        self, layer: SelectionLayer, query: Tensor, key: Tensor, scaling: Scaling, valid: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        length = key.shape[2]
        prefix_length = length - self.window
        scores = checked_scores(self.name, self.score(layer, query, key, scaling, valid), key)
        per_head = min(self.selected_budget(layer), prefix_length)
        mask = None if valid is None else valid.view(valid.shape[0], 1, -1)[..., :prefix_length]
        keep = adaptive_keep(scores[..., :prefix_length], per_head, int(self.alpha * per_head), mask)
        width = max(int(keep.sum(-1).max()), 1)
        positions = torch.arange(prefix_length, device=key.device)
        index = torch.where(keep, positions, prefix_length).sort(dim=-1).values[..., :width]
        index = index.masked_fill(index >= prefix_length, -1)
        window = torch.arange(prefix_length, length, device=key.device).expand(*index.shape[:2], -1)
        index = torch.cat([index, window], dim=-1)
        kept = scores.gather(-1, index.clamp(min=0)).masked_fill(index < 0, float("-inf"))
        return index, kept
