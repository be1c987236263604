"""`snapkv` (Li et al., 2024): keep the prompt tokens the last `window` prompt queries attend to, decided once.

Per recycled-attention.txt §3.2 and refreshkv.txt A.1: attention of the observation window (the last `window`
prompt tokens) averaged over the window, max-pooled over positions (`kernel`), aggregated over the query heads of a
GQA group (`aggregation`, max as in the seeds); per KV head the top `budget - window` tokens before the window are
kept, plus the window itself. Decoded tokens are appended without eviction (memory K + T, as in the seeds' Table 1).

- The budget counts the window, as SnapKV's own `max_capacity_prompt` does: with budget K the cache holds K prompt
  tokens, so a budget smaller than the window is refused.
- Compression during decoding (`compress_every`, core/selection.py): the observation window slides with the
  answer, as SnapKV applied again at each compression: the last `window` queries (the prompt's last ones, then the
  decoded ones) score the held tokens in position order (averaged, max-pooled over held neighbours, aggregated over
  the group), the last `window` tokens are kept, and each layer is brought back to its budget. Word spans are the
  prompt's alone, so `pooling="span"` pools as `centered` there.
- Defaults: window 32, kernel 7 (SnapKV's released setting), pooled over whole words (`pooling="span"`, this
  package's default: the centred kernel cuts a number the tokenizer spells digit by digit; issue 30); the RefreshKV
  paper's setting (A.1: "observation window size 1, kernel size 7", centred, max over the query heads of a group)
  is `preset="paper"`.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor

from ..core.attention_math import AGGREGATIONS, POOLINGS, Scaling, attention_probs, selection_scores
from ..core.policy import (
    PolicyError,
    check_choice,
    check_kernel,
    check_positive,
    check_window,
    ratio_or_default,
    register,
)
from ..core.selection import SelectionLayer, SelectionPolicy


@register
@dataclasses.dataclass
class SnapKV(SelectionPolicy):
    """SnapKV: the prompt tokens the observation window attends to most (pooled), plus the window, chosen once.

    Parameters: `budget`: K tokens per KV head (or `budget_ratio`: K as a share of the longest prompt, 1/8 by
    default), window included; `window` (32) last prompt tokens whose attention selects (1 in the
    RefreshKV paper's setting); `kernel` (7) max-pooling kernel and `pooling` (span: centred, then whole
    words, engine/spans.py; centered: the papers'; forward: 1 token before a peak,
    kernel - 2 after); `aggregation` (max) over a GQA group; `compress_every` (None: every decoded token kept) N:
    every N decoded tokens the latest `window` queries bring each layer back to its budget.
    """

    name = "snapkv"
    summary = "keep the top-K prompt tokens by the observation window's pooled attention, once at prefill"
    presets = {"paper": {"window": 1, "kernel": 7, "pooling": "centered", "aggregation": "max"}}  # refreshkv.txt A.1

    window: int = 32
    kernel: int = 7
    pooling: str = "span"  # the papers' is "centered" (preset "paper"); span keeps whole words: issue 30
    aggregation: str = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("window", self.window)
        check_kernel(self.kernel)
        check_choice("pooling", self.pooling, POOLINGS)
        check_choice("aggregation", self.aggregation, AGGREGATIONS)
        if self.budget is not None:  # refused when the method is made, before any model loads
            self._holding_the_window(self.budget, "")

    def _holding_the_window(self, budget: int, source: str) -> int:
        if budget < self.window:
            raise PolicyError(f"budget ({budget}{source}) must hold the observation window ({self.window} tokens)")
        return budget

    def budget_for(self, prompt_length: int) -> int:
        """K for the prompt; a budget_ratio that gives fewer tokens than the window is refused."""
        budget = super().budget_for(prompt_length)
        ratio = ratio_or_default(self.budget_ratio)
        return self._holding_the_window(budget, f" tokens: budget_ratio {ratio:g} of {prompt_length} prompt tokens")

    def check_prompt(self, shortest: int) -> None:
        check_window("window", self.window, shortest)

    def selected_budget(self, layer: SelectionLayer) -> int:
        """Prompt tokens chosen per layer on average: the budget less the window, which is always kept."""
        return layer.budget - self.window

    def layer_budget(self, layer: SelectionLayer) -> int:
        return self.selected_budget(layer)

    def score(
        self, layer: SelectionLayer, query: Tensor, key: Tensor, scaling: Scaling, valid: Tensor | None
    ) -> Tensor:
        """The observation window's attention averaged, max-pooled and aggregated over the group."""
        probs = attention_probs(query[:, :, -self.window :], key, scaling, valid, causal_tail=True)
        return selection_scores(probs, self.kernel, self.aggregation, self.pooling, layer.prompt_spans)

    def kept_tokens(self, layer: SelectionLayer) -> int:
        return self.layer_budget(layer) + self.window

    def recent_kept(self, layer: SelectionLayer) -> int:
        return self.window  # the observation window is always kept

    def observed_queries(self, layer: SelectionLayer) -> int:
        return self.window

    def compression_scores(self, layer: SelectionLayer, order: Tensor, scaling: Scaling) -> Tensor:
        """The latest `window` queries' attention over the held tokens in position order, pooled and aggregated."""
        keys, real = self.held_tokens(layer, order)
        queries = layer.state.recent_queries
        assert queries is not None, "compression without the observation window's queries"
        probs = attention_probs(queries, keys, scaling, real, causal_tail=True)
        pooling = "centered" if self.pooling == "span" else self.pooling  # the prompt's words only
        return selection_scores(probs, self.kernel, self.aggregation, pooling)
