"""`kvmerger` (Wang, Jin, Yu, Zhang, 2024, "Model Tells You Where to Merge: Adaptive KV Cache Merging for LLMs on
Long-Context Tasks", arXiv 2407.08454; kv-eviction-landscape.txt): tokens that eviction would drop are merged into a
kept neighbour with similar keys instead.

The paper observes that key states of nearby tokens are highly similar within a sequence. Per KV head:
- merging sets: maximal runs of consecutive prompt tokens whose adjacent keys have cosine >= `similarity`;
- selection: H2O's (K/2 heavy hitters by cumulative attention over the prompt, K/2 recent tokens);
- each set's pivot is its token of highest cumulative attention; where the pivot is kept, the set's evicted tokens
  are merged into it with Gaussian-kernel weights w_i = exp(-||k_i - k_p||^2 / (2 sigma^2)) (w_p = 1): the pivot's
  key and value become the weighted means. Evicted tokens of a set whose pivot is evicted are dropped.
Decoded tokens are appended without eviction (as snapkv); `compress_every` evicts by the stored scores without
merging.

Choices where the paper is silent or that differ from it:
- `similarity` 0.8: the paper derives a threshold per layer from the similarity distribution it observes on its
  models; one threshold for every layer here.
- sigma^2: the mean squared key distance of the set's members to its pivot (the weights are then scale-free); a set
  whose members equal the pivot merges with weight 1.
- Selection and pivots by H2O's cumulative attention (this package's `h2o` prefill), aggregated over a GQA group by
  `aggregation` (max).
- Sets never cross a left pad (pads belong to no set).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.attention_math import AGGREGATIONS, Scaling
from ..core.policy import PolicyError, check_choice, is_number, register
from ..core.selection import SelectionLayer, SelectionPolicy
from .h2o import cumulative_attention, split_budget


def merging_sets(keys: Tensor, valid: Tensor | None, similarity: float) -> Tensor:
    """(B, H, L) set number of each token: a new set starts wherever adjacent keys' cosine is below `similarity` (or
    at a pad)."""
    unit = F.normalize(keys.float(), dim=-1)
    linked = (unit[:, :, 1:] * unit[:, :, :-1]).sum(-1) >= similarity
    if valid is not None:
        real = valid.view(valid.shape[0], 1, -1)
        linked = linked & real[..., 1:] & real[..., :-1]
    starts = torch.cat([torch.ones_like(linked[..., :1]), ~linked], dim=-1)
    return starts.long().cumsum(-1) - 1


def merge_into_pivots(
    keys: Tensor, values: Tensor, sets: Tensor, scores: Tensor, kept: Tensor, valid: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Keys and values with each kept pivot replaced by the Gaussian-weighted mean of itself and its set's evicted
    tokens; `kept` (B, H, L) bool."""
    length = keys.shape[2]
    real = torch.ones_like(kept) if valid is None else valid.view(valid.shape[0], 1, -1).expand_as(kept)
    ranking = scores.masked_fill(~real, float("-inf"))
    best = torch.full_like(ranking, float("-inf")).scatter_reduce(-1, sets, ranking, "amax", include_self=True)
    positions = torch.arange(length, device=keys.device).expand_as(sets)
    first_best = torch.where(ranking == best.gather(-1, sets), positions, length)
    pivot_of_set = torch.full_like(sets, length).scatter_reduce(-1, sets, first_best, "amin", include_self=True)
    pivot = pivot_of_set.gather(-1, sets).clamp(max=length - 1)  # (B, H, L): each token's set pivot
    pivot_kept = kept.gather(-1, pivot)
    merged = real & ~kept & pivot_kept  # evicted tokens that go into a kept pivot
    if not bool(merged.any()):
        return keys, values
    pivot_keys = keys.float().gather(-2, pivot.unsqueeze(-1).expand(*pivot.shape, keys.shape[-1]))
    distance = (keys.float() - pivot_keys).square().sum(-1)  # (B, H, L)
    member = merged.float()
    spread = torch.zeros_like(distance).scatter_add(-1, pivot, distance * member)
    count = torch.zeros_like(distance).scatter_add(-1, pivot, member)
    sigma2 = (spread / count.clamp(min=1)).gather(-1, pivot)
    weight = torch.where(sigma2 > 0, torch.exp(-distance / (2 * sigma2.clamp(min=1e-30))), 1.0) * member
    denominator = 1.0 + torch.zeros_like(weight).scatter_add(-1, pivot, weight)  # at each pivot: 1 + its weights
    out = []
    for tensor in (keys, values):
        total = tensor.float().clone()  # every token counts itself once (w_p = 1 for a pivot)
        total.scatter_add_(-2, pivot.unsqueeze(-1).expand_as(total), tensor.float() * weight.unsqueeze(-1))
        out.append((total / denominator.unsqueeze(-1)).to(tensor.dtype))
    return out[0], out[1]


@register
@dataclasses.dataclass
class KVMerger(SelectionPolicy):
    """KVMerger: H2O's prompt selection, each evicted token merged into its similar-key run's pivot when kept.

    Parameters: `budget`: K tokens per KV head (or `budget_ratio`: K as a share of the longest prompt, 1/8 by
    default); `similarity` (0.8) cosine of adjacent keys that links them into a merging set; `aggregation` (max) of
    the cumulative attention over a GQA group; `compress_every` (None: decoded tokens appended) as in snapkv, without
    merging.
    """

    name = "kvmerger"
    summary = "H2O's prompt selection; evicted tokens merged (Gaussian weights) into their similar-key run's pivot"

    similarity: float = 0.8
    aggregation: str = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not is_number(self.similarity) or not -1 <= self.similarity <= 1:
            raise PolicyError(f"similarity must be a cosine in [-1, 1], got {self.similarity!r}")
        check_choice("aggregation", self.aggregation, AGGREGATIONS)

    def score(
        self, layer: SelectionLayer, query: Tensor, key: Tensor, scaling: Scaling, valid: Tensor | None
    ) -> Tensor:
        return cumulative_attention(query, key, scaling, valid, self.aggregation)

    def recent_kept(self, layer: SelectionLayer) -> int:
        return split_budget(layer.budget)[1]

    def store_prompt(self, layer: SelectionLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> None:
        valid = layer.valid_positions(key.shape[2], key.device)
        index, scores = self.select(layer, query, key, scaling, valid)
        kept = torch.zeros(key.shape[:3], dtype=torch.bool, device=key.device)
        kept.scatter_(-1, index.clamp(min=0), index >= 0)
        prompt_scores = self.score(layer, query, key, scaling, valid)
        sets = merging_sets(key, valid, self.similarity)
        key, value = merge_into_pivots(key, value, sets, prompt_scores, kept, valid)
        layer.state = self.store_selection(layer, key, value, index, scores)
        self.remember_queries(layer, query)
