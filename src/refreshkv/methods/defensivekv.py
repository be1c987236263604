"""`defensivekv` (Feng, Guo et al., 2025, "Taming the Fragility of KV Cache Eviction in LLM Inference", arXiv
2510.13334; kv-eviction-landscape.txt): importance aggregated by its worst case instead of its mean.

SnapKV-style methods score a prompt token by the observation window's attention averaged over the window's queries,
trusting that what was important stays important. DefensiveKV's defensive aggregation controls the worst case in two
linear-time steps:
1. worst-case risk: a token's score is the highest attention any query of the window (and any query head of its
   group) pays it, after pooling, instead of the mean;
2. adaptive prior-risk correction: scores below the head's mean score are raised to it, so a token no query looked
   at is not taken as certainly useless (the prior is a uniform risk, adapted to the head by its mean).
The tokens are then chosen as `adakv` chooses them (the paper builds on Ada-KV's head-adaptive budgets): the layer's
selected budget, (K - window) per KV head on average, by one joint top-k over its heads, each head keeping at least
`alpha` of the mean, plus the window.

Choices where the paper is silent or that differ from its released code:
- Pooling: max-pooling with this package's `kernel` (7) and `pooling` (span), as snapkv's, chosen on the dev sets
  (`preset="paper"`: the released code's size 5, centred; it found fewer needles there); the released code
  average-pools and renormalises each query's row before the max.
- The released code also reweights scores by the norm of each value projected through the output matrix and first
  keeps each head's tokens up to 90% of its attention mass (both from CriticalKV); neither is part of defensive
  aggregation, and neither is done here.
- The correction's mean is over the real tokens before the window (the window is kept whatever its score).
- Layer-DefensiveKV (budgets across layers too) is not built.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor

from ..core.attention_math import Scaling, aggregate_group, attention_probs, pool, spread_if_span
from ..core.policy import register
from ..core.selection import SelectionLayer
from .adakv import AdaKV


@register
@dataclasses.dataclass
class DefensiveKV(AdaKV):
    """DefensiveKV: each token's worst case over the window's queries, floored at the head's mean; Ada-KV's budgets.

    Parameters: `budget`: K tokens per KV head on average (or `budget_ratio`: K as a share of the longest prompt, 1/8
    by default), window included; `window` (32) last prompt queries; `kernel` (7) and `pooling` (span) of the
    max-pooling over positions, chosen on the dev sets as snapkv's were (`preset="paper"`: kernel 5, centered);
    `aggregation` (max: the worst case over a GQA group, the method's own; mean and first are accepted); `alpha`
    (0.2) as in adakv; `compress_every` (None) as in snapkv.
    """

    name = "defensivekv"
    summary = "worst-case (max over the window's queries) importance floored at the head mean; Ada-KV head budgets"

    presets = {"paper": {"window": 32, "kernel": 5, "pooling": "centered", "aggregation": "max", "alpha": 0.2}}

    def score(
        self, layer: SelectionLayer, query: Tensor, key: Tensor, scaling: Scaling, valid: Tensor | None
    ) -> Tensor:
        """Step 1: the highest pooled probability over the window's queries (and the group); step 2: floored at the
        head's mean over the real tokens before the window."""
        probs = attention_probs(query[:, :, -self.window :], key, scaling, valid, causal_tail=True)
        worst = pool(probs.amax(dim=3), self.kernel, self.pooling)  # (B, Hkv, G, L): the max commutes with pooling
        worst = aggregate_group(worst, self.aggregation)
        prefix = key.shape[2] - self.window
        if prefix > 0:
            before = worst[..., :prefix]
            if valid is None:
                prior = before.mean(dim=-1, keepdim=True)
            else:
                real = valid.view(valid.shape[0], 1, -1)[..., :prefix].to(before.dtype)
                prior = (before * real).sum(-1, keepdim=True) / real.sum(-1, keepdim=True).clamp(min=1)
            worst = worst.clamp(min=prior)
        return spread_if_span(worst, self.pooling, layer.prompt_spans)
