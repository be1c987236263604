"""`oracle`: at every decode step each KV head attends to exactly the K tokens the current query attends to most.

The ceiling of every method that attends to K tokens per step (RefreshKV's partial steps, Quest): no stale
selection, no pooling, no page granularity. It computes the current query's attention over the whole cache to
choose, so it reads everything and is never faster than `full`: a quality reference, not a method to deploy
(`bench` and `report` label it so).

Choices:
- The ranking is by the current query's attention probabilities, aggregated over the query heads of a GQA group
  (`aggregation`, max as in refreshkv and snapkv); for one query head this is the order of its logits. The newest
  token is always attended to, besides the K chosen (as in refreshkv's partial cache: K + the new token).
- The chosen tokens' attention is renormalised over them alone (softmax over the K + 1 logits), as a method that
  held only those tokens would compute it.
- Not the scorer layer's `keep_top` / `SelectionState.load` (selection.py): nothing is kept between steps. The shared
  `top_k` ranks; nothing is gathered: the step masks the other logits of the softmax it computes over the whole cache
  anyway, which costs less than gathering the K tokens to attend to them again.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import Tensor

from ..core.attention_math import (
    AGGREGATIONS,
    Scaling,
    aggregate_group,
    logits_of,
    pack_queries,
    top_k,
    unpack_output,
)
from ..core.kvstore import FullStore
from ..core.policy import BudgetPolicy, check_choice, register
from .full import FullLayer


@register
@dataclasses.dataclass
class Oracle(BudgetPolicy[FullStore]):
    """Oracle top-K: every step, per KV head, the K tokens with the highest attention of the current query (over
    the whole cache) plus the newest token. A quality ceiling: it reads the whole cache.

    Parameters: `budget`: K tokens per KV head (or `budget_ratio`: K as a share of the longest prompt, 1/8 by
    default); `aggregation` (max) of the probabilities over the query heads of a GQA group.
    """

    name = "oracle"
    no_compression = "it keeps the whole cache to read each step's exact top K"
    summary = "quality ceiling: each step attends to the exact top-K tokens of the current query (reads everything)"
    ceiling: ClassVar[bool] = True

    aggregation: str = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("aggregation", self.aggregation, AGGREGATIONS)

    def store_prompt(self, layer: FullLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> None:
        store = layer.full_store(key)
        assert isinstance(store, FullStore)  # a dense store: the transformers cache's or an engine's
        layer.state = store
        layer.state.append(key, value)

    def crop(self, layer: FullLayer, tokens: int) -> None:
        layer.state.crop(tokens)

    def decode(self, layer: FullLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> Tensor:
        store = layer.state
        store.append(key, value)
        keys, values = store.view()
        layer.record(0.0, store.attended_bytes())
        logits, chosen = self._choose(layer, query, keys, scaling)
        if chosen is not None:
            keep = torch.zeros_like(logits[:, :, :1], dtype=torch.bool).scatter(-1, chosen.unsqueeze(2), True)
            keep[..., -1] = True
            logits = logits.masked_fill(~keep, float("-inf"))
        output = torch.matmul(logits.softmax(dim=-1).to(values.dtype), values)  # (B, Hkv, G, D)
        return unpack_output(output, query.shape[1])

    def _choose(self, layer: FullLayer, query: Tensor, keys: Tensor, scaling: Scaling) -> tuple[Tensor, Tensor | None]:
        """The current query's float32 logits (B, Hkv, G, n), pads masked, and the K positions (B, Hkv, K) it
        attends to most besides the newest token (None when every token fits)."""
        n = keys.shape[2]
        logits = logits_of(pack_queries(query, keys.shape[1]), keys, scaling)
        valid = layer.valid_positions(n, keys.device)  # (B, 1, 1, n) or None
        if valid is not None:
            logits = logits.masked_fill(~valid, torch.finfo(torch.float32).min)
        if layer.budget + 1 >= n:
            return logits, None
        ranking = aggregate_group(logits.softmax(dim=-1), self.aggregation)[..., : n - 1]  # the newest is kept
        return logits, top_k(
            ranking, layer.budget, None if valid is None else valid.view(valid.shape[0], 1, -1)[..., :-1]
        )

    def selection(self, layer: FullLayer, query: Tensor, scaling: Scaling) -> Tensor | None:
        """The step's K chosen tokens and the newest one; None when every token fits."""
        keys, _ = layer.state.view()
        _, chosen = self._choose(layer, query, keys, scaling)
        if chosen is None:
            return None
        newest = torch.full_like(chosen[..., :1], layer.state.length - 1)
        return torch.cat([chosen, newest], dim=-1)
