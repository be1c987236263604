"""`h2o` (Zhang et al., 2023, Heavy-Hitter Oracle): keep the tokens with the highest cumulative attention + recent ones.

Per refreshkv.txt A.1 / recycled-attention.txt §3.2: K/2 "heavy hitters" (highest cumulative attention score) and
K/2 recent tokens, K = the budget (heavy = K // 2, recent = K - heavy), updated at every decode step as in H2O's
greedy algorithm: the current token attends to the K kept tokens and itself, the probabilities (float32, aggregated
over the query heads of a GQA group with `aggregation`, max as in the seeds) are added to every kept token's
cumulative score, and the lowest-scored token outside the recent window is evicted, bringing the cache back to K.
The store therefore has K + 1 slots per KV head (K kept + the newest token, like refreshkv's partial cache); the
eviction is done lazily at the start of the next step, into the slot the new token is written to, which is the same
decision (scores do not change in between) and needs no second pass.

Prefill (a choice: an L x L score matrix is not allowed and the seeds recompute scores for the current query only):
the cumulative scores of prompt tokens are initialised with the attention of the last `window` prompt queries
(summed over those queries, causal); the last `recent` prompt tokens are kept as the recent window and the top
`heavy` of the others by that score as heavy hitters. Decoded tokens start at score 0 and are protected while they
are among the `recent` newest tokens, as in H2O.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core.attention_math import AGGREGATIONS, aggregate_group, attention_probs, unpack_output
from ..core.policy import PolicyError, check_choice, check_positive, register
from ..core.selection import SelectionPolicy, SelectionState


def split_budget(budget: int) -> tuple[int, int]:
    """(heavy hitters, recent window) for a budget of K tokens: K // 2 and the rest."""
    heavy = budget // 2
    return heavy, budget - heavy


@register
@dataclasses.dataclass
class H2O(SelectionPolicy):
    name = "h2o"
    summary = "keep K/2 heavy hitters (cumulative attention, updated every step) + K/2 recent tokens"

    window: int = 32
    aggregation: str = "max"

    def __post_init__(self):
        super().__post_init__()
        check_positive("window", self.window)
        check_choice("aggregation", self.aggregation, AGGREGATIONS)

    def max_slots(self, layer) -> int:
        return layer.cache.budget + 1  # K kept + the newest token

    def select(self, layer, query, key, scaling, valid):
        length = key.shape[2]
        pads = layer.cache.pads
        shortest = length - (0 if pads is None else int(pads.max()))
        if self.window > shortest:
            raise PolicyError(f"window ({self.window}) is larger than the prompt ({shortest} tokens)")
        probs = attention_probs(query[:, :, -self.window :], key, scaling, valid, causal_tail=True)
        cumulative = aggregate_group(probs.sum(dim=3), self.aggregation)  # (B, Hkv, L)
        budget = layer.cache.budget
        _, recent = split_budget(budget)
        positions = torch.arange(length, device=key.device)
        priority = cumulative.masked_fill(positions >= length - recent, float("inf"))
        if valid is not None:
            priority = priority.masked_fill(~valid.view(valid.shape[0], 1, -1), float("-inf"))
        keep = min(budget, length)
        index = priority.topk(keep, dim=-1).indices.sort(dim=-1).values
        index = index.masked_fill(priority.gather(-1, index) == float("-inf"), -1)
        return index, cumulative.gather(-1, index.clamp(min=0))

    def appended_score(self, layer) -> float:
        return 0.0  # a decoded token starts with no accumulated attention

    def eviction_scores(self, layer) -> torch.Tensor:
        """Cumulative scores, with the recent window protected (empty slots, position -1, stay candidates)."""
        _, recent = split_budget(layer.cache.budget)
        protected = layer.state.store.positions >= max(layer.seen - 1 - recent, 0)
        return layer.state.scores.masked_fill(protected, float("inf"))

    def decode(self, layer, query, key, value, scaling):
        self.append(layer, key, value)
        state: SelectionState = layer.state
        store = state.store
        probs = attention_probs(query, store.keys, scaling, self.valid_slots(layer))  # (B, Hkv, G, 1, n)
        batch, kv_heads, group, _, slots = probs.shape
        probs = probs.view(batch, kv_heads, group, slots)
        output = torch.matmul(probs.to(store.values.dtype), store.values)  # (B, Hkv, G, D)
        state.scores += aggregate_group(probs, self.aggregation)
        layer.record(0.0, store.nbytes())
        return unpack_output(output, query.shape[1])
