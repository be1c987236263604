"""Caches prefilled in groups of rows, joined into one batch cache that decodes as if prefilled in one forward.

A prefill's transient grows with rows x prompt length (hidden states, projections, scores), so a large batch of long
prompts is prefilled a few rows at a time (`generate_many(prefill_rows=...)`, issue 48's memory cap) and joined
before decoding: the decode step stays one batched step, with no per-row work.

States join generically through the rule `LayerState.select_rows` relies on (kvstore.py): every tensor attribute is
batch-first (concatenated along the batch), every other attribute is shared by all rows (kept, where every group
agrees) or is itself a LayerState (joined alike). A state whose shared attributes are read from its rows (a count
over them, the widest row) first makes its groups agree (`LayerState.align_groups`). Anything else the groups
disagree on is refused in one line: those rows must be prefilled in one forward.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.kvstore import LayerState
from ..core.policy import PolicyError
from .cache import PolicyCache


def refuse(what: str) -> PolicyError:
    return PolicyError(f"cannot join caches prefilled in row groups: {what}; prefill these rows in one forward")


def join_states(values: list[Any], where: str) -> Any:
    """One layer's states of the row groups (or one attribute of them, at path `where`) as one, in the groups'
    order: tensors concatenated along the batch, states joined attribute by attribute into the first group's."""
    first = values[0]
    if any(type(value) is not type(first) for value in values):
        raise refuse(f"{where} is {', '.join(type(value).__name__ for value in values)} in the row groups")
    if isinstance(first, torch.Tensor):
        if any(value.shape[1:] != first.shape[1:] or value.dtype != first.dtype for value in values):
            shapes = ", ".join(f"{tuple(value.shape)} {value.dtype}" for value in values)
            raise refuse(f"{where} is {shapes} in the row groups")
        return torch.cat(values)
    if isinstance(first, LayerState):
        type(first).align_groups(values)
        if any(list(vars(value)) != list(vars(first)) for value in values):
            raise refuse(f"{where} ({type(first).__name__}) holds different attributes in the row groups")
        for name in vars(first):
            setattr(first, name, join_states([getattr(value, name) for value in values], f"{where}.{name}"))
        return first
    if any(value != first for value in values):
        raise refuse(f"{where} differs between the row groups ({', '.join(map(repr, values))})")
    return first


def joined_pads(caches: list[PolicyCache]) -> torch.Tensor | None:
    """(B,) left pads of the joined batch: a group without padding has none (None where no group has any)."""
    if all(cache.pads is None for cache in caches):
        return None
    return torch.cat(
        [
            cache.pads
            if cache.pads is not None
            else torch.zeros(cache.batch_rows(), dtype=torch.long, device=cache.device())
            for cache in caches
        ]
    )


def join_caches(caches: list[PolicyCache]) -> PolicyCache:
    """`caches[0]`, holding every cache's rows in order. All must have prefilled rows of one padded length under one
    policy, and be joined right after their prefill (before any decode step). Layers move one at a time and each
    part's layer is dropped once moved, so the join needs one layer of the batch beyond what the parts hold
    (measure/batch_memory.py counts it)."""
    first = caches[0]
    method = f"method '{first.policy.name}'"
    join_states([cache.policy for cache in caches], method)
    join_states([cache.budget for cache in caches], f"{method}: the budget")
    join_states([cache.layers[0].seen for cache in caches], f"{method}: the tokens seen")
    join_states([cache.windowed for cache in caches], f"{method}: the sliding-window layers")
    first.pads = joined_pads(caches)
    first.max_pad = max(cache.max_pad for cache in caches)
    first.prompt_length = max(cache.prompt_length for cache in caches)
    # read by every group alike (one policy): each group's tensor, or None in all
    first.prompt_spans = join_states([cache.prompt_spans for cache in caches], f"{method}: the prompt's word spans")
    for i, layer in enumerate(first.layers):
        if layer.state is not None:
            layer.state = join_states([cache.layers[i].state for cache in caches], f"{method}: layer {i}'s state")
        for cache in caches[1:]:
            cache.layers[i].state = None
    return first
