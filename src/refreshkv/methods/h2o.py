"""`h2o` (Zhang et al., 2023, Heavy-Hitter Oracle): keep the tokens with the highest cumulative attention + recent ones.

Per refreshkv.txt A.1 / recycled-attention.txt §3.2: K/2 "heavy hitters" (highest cumulative attention score) and
K/2 recent tokens, K = the budget (heavy = K // 2, recent = K - heavy), updated at every decode step as in H2O's
greedy algorithm: the current token attends to the K kept tokens and itself, the probabilities (float32, aggregated
over the query heads of a GQA group with `aggregation`, max as in the seeds) are added to every kept token's
cumulative score, and the lowest-scored token outside the recent window is evicted, bringing the cache back to K.
The store therefore has K + 1 slots per KV head (K kept + the newest token, like refreshkv's partial cache); the
eviction is done lazily at the start of the next step, into the slot the new token is written to, which is the same
decision (scores do not change in between) and needs no second pass.

Prefill: the cumulative score of a prompt token is the attention it receives from every prompt query (H2O's
accumulated attention over the prompt, causal), summed in blocks of `PREFILL_BLOCK` queries so no L x L matrix is
held; the last `recent` prompt tokens are kept as the recent window and the top `heavy` of the others by that score
as heavy hitters. Decoded tokens start at score 0 and are protected while they are among the `recent` newest
tokens, as in H2O.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..core.attention_math import AGGREGATIONS, Scaling, aggregate_group, attention_probs
from ..core.policy import check_choice, register
from ..core.selection import SelectionLayer, SelectionPolicy

PREFILL_BLOCK = 256  # prompt queries scored at once: memory (B, Hq, 256, L) floats


def split_budget(budget: int) -> tuple[int, int]:
    """(heavy hitters, recent window) for a budget of K tokens: K // 2 and the rest."""
    heavy = budget // 2
    return heavy, budget - heavy


def cumulative_attention(query: Tensor, key: Tensor, scaling: Scaling, valid: Tensor | None, how: str) -> Tensor:
    """(B, Hkv, L): attention received from every prompt query, summed per query head, aggregated over the group."""
    length = key.shape[2]
    total: torch.Tensor | None = None
    for start in range(0, length, PREFILL_BLOCK):
        end = min(start + PREFILL_BLOCK, length)
        block_valid = None if valid is None else valid[..., :end]
        probs = attention_probs(query[:, :, start:end], key[:, :, :end], scaling, block_valid, causal_tail=True)
        if valid is not None:  # pad queries attend uniformly to nothing real: they must not add to any score
            probs = probs * valid[..., start:end].view(valid.shape[0], 1, 1, -1, 1)
        summed = torch.nn.functional.pad(probs.sum(dim=3), (0, length - end))  # (B, Hkv, G, L)
        total = summed if total is None else total + summed
    assert total is not None, "an empty prompt"
    return aggregate_group(total, how)


@register
@dataclasses.dataclass
class H2O(SelectionPolicy):
    """H2O: K/2 heavy hitters by cumulative attention plus K/2 recent tokens, updated at every decode step.

    Parameters: `budget`: K tokens per KV head (or `budget_ratio`: K as a share of the longest prompt, 1/8 by
    default); `aggregation` (max) of the probabilities over a GQA group; `compress_every` (None: one token
    evicted per step) N: no eviction for N steps, then the lowest cumulative scores outside the recent half go
    together, back to K.
    """

    name = "h2o"
    summary = "keep K/2 heavy hitters (cumulative attention, updated every step) + K/2 recent tokens"

    aggregation: str = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("aggregation", self.aggregation, AGGREGATIONS)

    def max_slots(self, layer: SelectionLayer) -> int:
        return layer.budget + 1  # K kept + the newest token

    def score(
        self, layer: SelectionLayer, query: Tensor, key: Tensor, scaling: Scaling, valid: Tensor | None
    ) -> Tensor:
        return cumulative_attention(query, key, scaling, valid, self.aggregation)

    def score_key(self) -> str:
        return repr(dataclasses.replace(self, budget=None, budget_ratio=None))  # cumulative attention ignores K

    def recent_kept(self, layer: SelectionLayer) -> int:
        return split_budget(layer.budget)[1]

    def appended_score(self, layer: SelectionLayer) -> float:
        return 0.0  # a decoded token starts with no accumulated attention

    def eviction_scores(self, layer: SelectionLayer) -> Tensor:
        """Cumulative scores, with the recent window protected (empty slots, position -1, stay candidates)."""
        _, recent = split_budget(layer.budget)
        protected = layer.state.store.positions >= max(layer.seen - 1 - recent, 0)
        return layer.state.scores.masked_fill(protected, float("inf"))

    def observe(self, layer: SelectionLayer, probs: Tensor) -> None:
        layer.state.scores += aggregate_group(probs, self.aggregation)
