"""`snapkv` (Li et al., 2024): keep the prompt tokens the last `window` prompt queries attend to, decided once.

Per recycled-attention.txt §3.2 and refreshkv.txt A.1: attention of the observation window (the last `window`
prompt tokens) averaged over the window, max-pooled over positions (`kernel`), aggregated over the query heads of a
GQA group (`aggregation`, max as in the seeds); per KV head the top `budget - window` tokens before the window are
kept, plus the window itself. Decoded tokens are appended without eviction (memory K + T, as in the seeds' Table 1).

- The budget counts the window, as SnapKV's own `max_capacity_prompt` does: with budget K the cache holds K prompt
  tokens, so a budget smaller than the window is refused.
- Defaults: window 32, kernel 7 (SnapKV's released setting); the RefreshKV paper's setting (A.1: "observation
  window size 1, kernel size 7", max over the query heads of a group) is `window=1` (`PAPER_SETTING`).
"""

from __future__ import annotations

import dataclasses

import torch

from ..core.attention_math import AGGREGATIONS, attention_probs, selection_scores, top_k
from ..core.policy import PolicyError, check_choice, check_kernel, check_positive, check_window, register
from ..core.selection import SelectionPolicy

WINDOW_SCORE = 1.0  # the observation window is always kept: score above any pooled probability
PAPER_SETTING = {"window": 1, "kernel": 7, "aggregation": "max"}  # refreshkv.txt A.1


@register
@dataclasses.dataclass
class SnapKV(SelectionPolicy):
    name = "snapkv"
    summary = "keep the top-K prompt tokens by the observation window's pooled attention, once at prefill"

    window: int = 32
    kernel: int = 7
    aggregation: str = "max"

    def __post_init__(self):
        super().__post_init__()
        check_positive("window", self.window)
        check_kernel(self.kernel)
        check_choice("aggregation", self.aggregation, AGGREGATIONS)

    def check_prompt(self, shortest):
        check_window("window", self.window, shortest)

    def selected_budget(self, cache) -> int:
        """Prompt tokens chosen per layer on average: the budget less the window, which is always kept."""
        if cache.budget < self.window:
            raise PolicyError(f"budget ({cache.budget}) must hold the observation window ({self.window} tokens)")
        return cache.budget - self.window

    def layer_budget(self, layer) -> int:
        return self.selected_budget(layer.cache)

    def prefix_scores(self, query, key, scaling, valid) -> torch.Tensor:
        """Window attention averaged, pooled and group-aggregated, over the tokens before the window; pads -inf."""
        length = key.shape[2]
        probs = attention_probs(query[:, :, -self.window :], key, scaling, valid, causal_tail=True)
        scores = selection_scores(probs, self.kernel, self.aggregation)
        if valid is not None:
            scores = scores.masked_fill(~valid.view(valid.shape[0], 1, -1), float("-inf"))
        return scores[..., : length - self.window]

    def with_window(self, index, scores, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the observation window (always kept) to the selected prefix tokens."""
        window = torch.arange(length - self.window, length, device=index.device).expand(*index.shape[:2], -1)
        return torch.cat([index, window], dim=-1), torch.cat([scores, torch.full_like(window, WINDOW_SCORE,
                                                                                     dtype=scores.dtype)], dim=-1)

    def select(self, layer, query, key, scaling, valid):
        scores = self.prefix_scores(query, key, scaling, valid)
        index = top_k(scores, min(self.layer_budget(layer), scores.shape[-1]))
        return self.with_window(index, scores.gather(-1, index), key.shape[2])
