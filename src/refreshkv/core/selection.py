"""`SelectionPolicy`: the shared shape of eviction methods, which hold only a selection of the tokens.

At prefill a method's `select` picks, per KV head, which prompt tokens to keep (and their eviction scores); only
those are stored (a `SlotStore` at KV-head size: real memory savings, no masking of evicted tokens). Each decoded
token is then appended; once the store is full it takes the slot of the lowest eviction score. Methods differ in
`select`, in the store's size (`slots`) and in the score given to appended tokens (`appended_score`).
Heads may keep different numbers of tokens: `select` marks unused entries with index -1, which are stored as empty
slots and masked (padding only up to the largest head of the layer).
"""

from __future__ import annotations

import dataclasses

import torch

from .attention_math import decode_attention, prompt_attention
from .kvstore import SlotStore
from .policy import BudgetPolicy

APPENDED = 2.0  # above any attention probability: decoded tokens outrank prompt tokens unless a method says otherwise


@dataclasses.dataclass
class SelectionState:
    store: SlotStore
    scores: torch.Tensor  # (B, Hkv, slots) float32 eviction score; -inf = empty slot
    filled: int  # slots filled in every row and head; below the slot count some must be masked
    empty: int  # empty slots left in every row and head (decoded tokens fill these before anything is evicted)

    def nbytes(self) -> int:
        return self.store.nbytes()

    def grow(self, extra: int) -> None:
        self.store.grow(extra)
        self.scores = torch.cat([self.scores, self.scores.new_full((*self.scores.shape[:2], extra), float("-inf"))], 2)
        self.empty += extra


@dataclasses.dataclass
class SelectionPolicy(BudgetPolicy):
    def select(self, layer, query, key, scaling: float, valid) -> tuple[torch.Tensor, torch.Tensor]:
        """Per KV head: (index (B, Hkv, k) of prompt tokens to keep, -1 = none; their eviction scores (B, Hkv, k))."""
        raise NotImplementedError

    def max_slots(self, layer) -> int | None:
        """Fixed store size of a method that evicts while decoding; None: room for every decoded token."""
        return None

    def slots(self, layer, kept: int) -> int:
        """Initial store size: the kept tokens plus the decoded tokens to come, within `max_slots`."""
        wanted = kept + layer.cache.expected_new_tokens()
        limit = self.max_slots(layer)
        return wanted if limit is None else min(wanted, limit)

    def appended_score(self, layer) -> float:
        return APPENDED + layer.cache.step

    def eviction_scores(self, layer) -> torch.Tensor:
        """(B, Hkv, slots): the decoded token replaces the minimum (empty slots are -inf, so they go first)."""
        return layer.state.scores

    def prefill(self, layer, query, key, value, mask, scaling):
        cache = layer.cache
        index, scores = self.select(layer, query, key, scaling, cache.valid_positions(key.shape[2], key.device))
        kept = index.shape[-1]
        store = SlotStore(key, self.slots(layer, kept))
        store.load(key, value, index.clamp(min=0), index)
        store_scores = torch.full(store.positions.shape, float("-inf"), device=key.device)
        store_scores[..., :kept] = scores.float().masked_fill(index < 0, float("-inf"))
        # With ragged heads (some index -1), mask until every slot has been written once.
        filled = kept if bool((index >= 0).all()) else 0
        layer.state = SelectionState(store, store_scores, filled, empty=store.slots - kept)
        return prompt_attention(query, key, value, mask, scaling)

    def append(self, layer, key, value) -> None:
        """Store the decoded token in the lowest-scored slot (an empty one while there is room).

        A store that runs out of empty slots below its method's `max_slots` doubles (up to that size) instead of
        evicting, so a method that keeps every decoded token never loses one when more come than were announced.
        """
        state: SelectionState = layer.state
        limit = self.max_slots(layer)
        if state.empty == 0 and (limit is None or state.store.slots < limit):
            slots = state.store.slots
            state.grow((2 * slots if limit is None else min(2 * slots, limit)) - slots)
        slot = self.eviction_scores(layer).argmin(dim=-1)
        state.store.put(slot, key, value, layer.seen - 1)
        state.scores.scatter_(-1, slot.unsqueeze(-1), self.appended_score(layer))
        state.filled = min(state.filled + 1, state.store.slots)
        state.empty = max(state.empty - 1, 0)

    def valid_slots(self, layer) -> torch.Tensor | None:
        state: SelectionState = layer.state
        if layer.cache.pads is None and state.filled >= state.store.slots:
            return None
        return state.store.valid(layer.cache.pads)

    def decode(self, layer, query, key, value, scaling):
        self.append(layer, key, value)
        store = layer.state.store
        layer.record(0.0, store.nbytes())
        return decode_attention(query, store.keys, store.values, scaling, self.valid_slots(layer))
