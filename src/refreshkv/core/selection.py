"""`SelectionPolicy`: the shared shape of eviction methods, which hold only a selection of the tokens.

At prefill the method picks, per KV head, which prompt tokens to keep (and their eviction scores); only those are
stored (a `SlotStore` at KV-head size: real memory savings, no masking of evicted tokens). Each decoded token is
then appended; once the store is full it takes the slot of the lowest eviction score.

Most methods only rank tokens: they supply `score()` (any real values per prompt token and KV head) and, where
they keep a number other than K, `kept_tokens()`; the shared `select` checks the scores and keeps the top ones
(`keep_top`: ties to the earlier position, pads never, the last `recent_kept()` tokens always). A method that
chooses otherwise (ReFreeKV's adaptive prefix, DynamicKV's reallocation) overrides `select`. Methods also differ in
the store's size (`max_slots`) and in the score given to appended tokens (`appended_score`); a method that scores
tokens by the current query's attention (H2O, TOVA) overrides `observe`, which then receives the decode step's
probabilities.
Compression during decoding (`compress_every` N, shared by every eviction method): decoded tokens are appended
without eviction, and every N decoded tokens the method's own score (`compression_scores`, over the held tokens in
position order) brings each layer's cache back to its budget (`compression_budget`, K by default), so the cache holds
at most K + N tokens between compressions. N = 1 compresses at every step; None keeps each method's own rule.
Heads may keep different numbers of tokens: `select` marks unused entries with index -1, which are stored as empty
slots and masked (padding only up to the largest head of the layer).
"""

from __future__ import annotations

import dataclasses
from typing import Self

import torch
from torch import Tensor

from . import native_selection
from .attention_math import Scaling, attend_with_probs, decode_attention, top_k
from .contract import MethodLayer
from .device_steps import DeviceLayer, attend
from .full_cache import FullCacheStore
from .kvstore import LayerState, SlotStore, gather_tokens
from .policy import BudgetPolicy, PolicyError, check_positive

APPENDED = 2.0  # above any attention probability: decoded tokens outrank prompt tokens unless a method says otherwise


def keep_top(scores: Tensor, k: int, valid: Tensor | None = None, keep_last: int = 0) -> tuple[Tensor, Tensor]:
    """The shared tail of a selection: per row and KV head, the k highest of `scores` (B, Hkv, n) in position order,
    and their scores.

    Any real scores rank by value, ties to the earlier position. `valid` (bool, broadcastable to the scores) marks
    the positions that may be kept (pads may not): an excluded position is never kept, and where fewer than k are
    valid the entries left over are -1 with score -inf. The last `keep_last` positions are kept whatever their score
    (an observation window, a recent window), with their own scores.
    Returns (index (B, Hkv, min(k, n)), scores (B, Hkv, min(k, n))).
    """
    length = scores.shape[-1]
    ranking = scores
    if keep_last:
        recent = torch.arange(length, device=scores.device) >= length - keep_last
        ranking = scores.masked_fill(recent, float("inf"))
    index = top_k(ranking, min(k, length), valid)
    kept = scores.gather(-1, index)
    if valid is None:
        return index, kept
    real = valid.expand_as(scores).gather(-1, index)
    return index.masked_fill(~real, -1), kept.masked_fill(~real, float("-inf"))


def checked_scores(method: str, scores: object, like: Tensor) -> Tensor:
    """A `score()` result, refused in one line if it is not (B, Hkv, L) real numbers for the prompt `like` keys."""
    expected = tuple(like.shape[:3])
    if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != expected:
        got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise PolicyError(
            f"method '{method}': score() returned {got}; expected a tensor of shape (batch, kv_heads, "
            f"prompt_length) = {expected}"
        )
    if not scores.is_floating_point() or bool(torch.isnan(scores).any()):
        raise PolicyError(
            f"method '{method}': score() returned NaN or non-float scores ({scores.dtype}); expected "
            "real numbers (+-inf allowed)"
        )
    return scores


@dataclasses.dataclass
class SelectionState(LayerState):
    """A store of selected tokens with one eviction score per slot (-inf = empty slot)."""

    store: SlotStore
    scores: torch.Tensor  # (B, Hkv, slots) float32 eviction score
    filled: int  # slots filled in every row and head; below the slot count some must be masked
    empty: int  # empty slots left in every row and head (decoded tokens fill these before anything is evicted)
    # Under `compress_every`: the last queries a method's compression score reads (B, Hq, w, D; None: none kept),
    # and the tokens appended since the last compression.
    recent_queries: torch.Tensor | None = dataclasses.field(default=None, kw_only=True)
    since_compressed: int = dataclasses.field(default=0, kw_only=True)

    @classmethod
    def empty_like(cls, key: Tensor, slots: int) -> SelectionState:
        store = SlotStore(key, slots)
        return cls(store, torch.full(store.positions.shape, float("-inf"), device=key.device), 0, slots)

    def nbytes(self) -> int:
        return self.store.nbytes()

    def kept(self, pads: Tensor | None) -> Tensor:
        return self.store.kept(pads)

    @classmethod
    def align_groups(cls, states: list[Self]) -> None:
        """Row groups prefilled apart (engine/join_rows.py): a ragged selection is as wide as its group's largest head,
        so each is widened to the widest (`widen`), as the batch prefilled at once holds it; `filled` (slots filled
        in every row) is the fewest of the groups'."""
        width = max(state.used for state in states)
        for state in states:
            state.widen(width)
        filled = min(state.filled for state in states)
        for state in states:
            state.filled = filled

    def widen(self, width: int) -> None:
        """`width` slots of selection (`used`): the new ones are holes (masked, so `filled` is 0), and the room left
        for decoded tokens (`empty`) is unchanged."""
        extra = width - self.used
        if extra:
            self.grow(extra)
            self.empty -= extra
            self.filled = 0

    def load(
        self,
        keys: Tensor,
        values: Tensor,
        index: Tensor,
        scores: Tensor,
        ragged: bool = True,
        positions: Tensor | None = None,
    ) -> None:
        """Hold the tokens at `index` (B, Hkv, k; -1 = none) of keys/values with their scores; empty the rest.
        `positions`: the tokens' positions, where `index` counts rows of another store (-1 = none: that entry is
        held empty); by default `index` itself (keys/values are the prompt's).
        `ragged=False`: the caller knows no entry is -1 (a top-k), so the host need not read the index."""
        positions = index if positions is None else positions
        self.store.load(keys, values, index.clamp(min=0) if ragged else index, positions)
        self._scored(positions, scores, ragged)

    def load_gathered(self, full: FullCacheStore, index: Tensor, scores: Tensor, rows: Tensor | None = None) -> bool:
        """`load` of the tokens at `index` (a top k: no entry -1) of a C_f that reads them where it holds them (a
        quantized one dequantized straight into the slots, a serving engine's blocks: `gather`); only in the batch
        elements marked in `rows` ((B,) bool) if given, the others' slots left as they are. False, with nothing
        changed, where that cannot be done."""
        if not full.gather(index, (self.store.keys, self.store.values), rows):
            return False
        self.store.hold(index, rows)
        if rows is None:
            self._scored(index, scores, ragged=False)
            return True
        kept, marked = index.shape[-1], rows.view(-1, 1, 1)
        self.scores[..., :kept] = torch.where(marked, scores.float(), self.scores[..., :kept])
        self.scores[..., kept:].masked_fill_(marked, float("-inf"))
        self.filled = min(self.filled, kept)  # the refreshed rows' slots from k on are empty
        return True

    def _scored(self, positions: Tensor, scores: Tensor, ragged: bool) -> None:
        """The scores of the tokens just loaded at `positions`; the slots after them empty."""
        kept = positions.shape[-1]
        scores = scores.float()
        if ragged:
            scores = scores.masked_fill(positions < 0, float("-inf"))
        self.scores[..., :kept] = scores
        self.scores[..., kept:] = float("-inf")
        # With ragged heads (some entry -1), mask until every slot has been written once.
        self.loaded(kept, kept if not ragged or bool((positions >= 0).all()) else 0)

    def loaded(self, kept: int, filled: int | None = None) -> None:
        """The first `kept` slots were just loaded and the rest emptied; `filled`: of them, the slots filled in every
        row and head (all by default)."""
        self.filled = kept if filled is None else filled
        self.empty = self.store.slots - kept

    @property
    def used(self) -> int:
        """Slots written (from the start) where no ragged selection left holes (`contiguous`)."""
        return self.store.slots - self.empty

    @property
    def contiguous(self) -> bool:
        """The held tokens fill slots 0 .. used - 1 in every row and head (no hole left by a ragged selection)."""
        return self.filled == self.used

    def put(
        self, eviction_scores: Tensor, key: Tensor, value: Tensor, position: int | Tensor, score: float | Tensor
    ) -> None:
        """Write one token into each head's lowest-scored slot (an empty one while there is room). `position` and
        `score` may be one-element tensors (a step replayed from a CUDA graph reads them from the device)."""
        # While slots are free and none is a hole, the lowest is the first free slot everywhere: a plain write (not
        # under torch.compile, where a slot that moves every step would recompile the step, nor with the position on
        # the device, where the host's count of free slots does not follow replayed steps)
        on_host = not isinstance(position, Tensor) and not isinstance(score, Tensor)
        plain = on_host and self.empty and self.contiguous and not torch.compiler.is_compiling()
        if on_host and native_selection.put_token(
            self.store,
            self.scores,
            eviction_scores,
            key,
            value,
            int(position),
            float(score),
            self.used if plain else None,
        ):
            pass  # on the CPU, one call of C (a served step writes a token so at every layer of every request)
        elif plain:
            free = self.used
            self.store.put_at(free, key, value, int(position))
            self.scores[:, :, free].fill_(score)
        else:
            slot = eviction_scores.argmin(dim=-1)
            self.store.put(slot, key, value, position)
            # The score as a tensor: under torch.compile a score computed from the step count is symbolic, which
            # inductor cannot fill a scatter with.
            if isinstance(score, Tensor):
                scores = score.to(self.scores.dtype).expand_as(slot)
            else:
                scores = torch.full_like(slot, score, dtype=self.scores.dtype)
            self.scores.scatter_(-1, slot.unsqueeze(-1), scores.unsqueeze(-1))
        self.filled = min(self.filled + 1, self.store.slots)
        self.empty = max(self.empty - 1, 0)

    def keep_slots(self, slot_index: Tensor, room: int) -> None:
        """Hold only the tokens in slots `slot_index` (B, Hkv, k; -1 = none), in that order, with their scores, in a
        new store of k + `room` slots (the old one is freed): a compression during decoding."""
        old, kept = self.store, slot_index.shape[-1]
        missing = slot_index < 0
        slot_index = slot_index.clamp(min=0)
        positions = old.positions.gather(-1, slot_index).masked_fill(missing, -1)
        scores = self.scores.gather(-1, slot_index)
        self.store = SlotStore(old.keys, kept + room)
        self.scores = torch.full(self.store.positions.shape, float("-inf"), device=self.scores.device)
        self.load(old.keys, old.values, slot_index, scores, ragged=True, positions=positions)

    def front(self, pads: Tensor | None) -> tuple[Tensor, Tensor, int] | None:
        """The held tokens' keys and values where they fill the first `used` slots of every row and head and no row
        is padded, and their bytes; None otherwise (and in a compiled step, whose lengths do not grow)."""
        if pads is not None or not self.contiguous or torch.compiler.is_compiling():
            return None
        used = self.used
        keys, values = self.store.keys[:, :, :used], self.store.values[:, :, :used]
        return keys, values, 2 * keys.numel() * keys.element_size()

    def attend(self, query: Tensor, scaling: Scaling, pads: Tensor | None) -> tuple[Tensor, int]:
        """Attention of `query` over the held tokens, and the bytes read: the slots written alone where they lie in
        front (`front`), else every slot, the empty ones masked."""
        front = self.front(pads)
        if front is not None:
            keys, values, read = front
            return decode_attention(query, keys, values, scaling), read
        store = self.store
        return decode_attention(query, store.keys, store.values, scaling, self.valid(pads)), store.nbytes()

    def valid(self, pads: Tensor | None) -> Tensor | None:
        """(B, Hkv, slots) mask of the slots to attend to, or None when every slot holds a real token."""
        if pads is None and self.filled >= self.store.slots:
            return None
        return self.store.valid(pads)

    def advance(self, steps: int) -> None:
        self.filled = 0  # mask until the slots are known full again
        self.empty = int((self.store.positions < 0).sum(-1).min())

    def grow(self, extra: int) -> None:
        self.store.grow(extra)
        self.scores = torch.cat([self.scores, self.scores.new_full((*self.scores.shape[:2], extra), float("-inf"))], 2)
        self.empty += extra


SelectionLayer = MethodLayer[SelectionState]  # the layer an eviction method works on (contract.py)


@dataclasses.dataclass
class SelectionPolicy(BudgetPolicy[SelectionState]):
    # Every `compress_every` decoded tokens the method's own score brings each layer back to its budget (None: the
    # method's own rule during decoding, e.g. snapkv keeps every decoded token, h2o evicts one per step).
    compress_every: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("compress_every", self.compress_every, allow_none=True)

    def score(
        self, layer: SelectionLayer, query: Tensor, key: Tensor, scaling: Scaling, valid: Tensor | None
    ) -> Tensor:
        """(B, Hkv, L): how much each prompt token is worth keeping, per KV head. Any real values; higher is kept
        first; +inf keeps a token whenever it fits. Pads need no masking (`select` never keeps them), but a score
        computed from attention must mask them among the keys (`valid`, as in `select`)."""
        raise NotImplementedError(f"method '{self.name}' implements neither score() nor select()")

    def score_key(self) -> str:
        """What `score()` depends on besides the prompt: the methods of one shared prefill with equal keys score
        each layer once (a method and the copy that fidelity feeds `full`'s answer; a budget grid of a method whose
        scores do not depend on K, which says so by leaving the budget out). By default every parameter."""
        return repr(self)

    def kept_tokens(self, layer: SelectionLayer) -> int:
        """Prompt tokens to keep per KV head (fewer when the prompt is shorter): K, the cache's budget."""
        return layer.budget

    def recent_kept(self, layer: SelectionLayer) -> int:
        """The last prompt tokens kept whatever their score (an observation or recent window), counted in
        `kept_tokens`."""
        return 0

    def select(
        self, layer: SelectionLayer, query: Tensor, key: Tensor, scaling: Scaling, valid: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Per KV head: (index (B, Hkv, k) of prompt tokens to keep, -1 = none; their eviction scores (B, Hkv, k)).

        `query` (B, Hq, L, D), `key` (B, Hkv, L, D): the whole prompt; `valid` (B, 1, 1, L) bool marks its real
        tokens (None: no padding). By default the top `kept_tokens` by `score` (`keep_top`).
        """
        shared, score_key = layer.prompt_scores, (type(self), self.score_key())
        if shared is not None and score_key in shared:
            scores = shared[score_key]
        else:
            scores = checked_scores(self.name, self.score(layer, query, key, scaling, valid), key)
            if shared is not None:
                shared[score_key] = scores
        mask = None if valid is None else valid.view(valid.shape[0], 1, -1)
        return keep_top(scores, self.kept_tokens(layer), mask, self.recent_kept(layer))

    def max_slots(self, layer: SelectionLayer) -> int | None:
        """Fixed store size of a method that evicts while decoding; None: room for every decoded token."""
        return None

    def slots(self, layer: SelectionLayer, kept: int) -> int:
        """Initial store size: the kept tokens plus the decoded tokens to come, within `max_slots`."""
        if self.compress_every is not None:
            return kept + self.compress_every  # compressed back to the budget before the store is full
        wanted = kept + layer.expected_new_tokens()
        limit = self.max_slots(layer)
        return wanted if limit is None else min(wanted, limit)

    def appended_score(self, layer: SelectionLayer) -> float:
        return APPENDED + layer.step

    def eviction_scores(self, layer: SelectionLayer) -> Tensor:
        """(B, Hkv, slots): the decoded token replaces the minimum (empty slots are -inf, so they go first)."""
        return layer.state.scores

    def observe(self, layer: SelectionLayer, probs: Tensor) -> None:
        """Called after each decode step with the step's attention probabilities (B, Hkv, G, slots), float32.

        Only methods that override it pay for the probabilities; the others attend with one fused SDPA call.
        """

    def store_selection(
        self, layer: SelectionLayer, key: Tensor, value: Tensor, index: Tensor, scores: Tensor
    ) -> SelectionState:
        """A state holding the selected prompt tokens, sized for the decoded tokens to come."""
        state = SelectionState.empty_like(key, self.slots(layer, index.shape[-1]))
        state.load(key, value, index, scores)
        return state

    def store_prompt(self, layer: SelectionLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> None:
        valid = layer.valid_positions(key.shape[2], key.device)
        index, scores = self.select(layer, query, key, scaling, valid)
        layer.state = self.store_selection(layer, key, value, index, scores)
        self.remember_queries(layer, query)

    def append(self, layer: SelectionLayer, key: Tensor, value: Tensor) -> None:
        """Store the decoded token in the lowest-scored slot (an empty one while there is room).

        A store that runs out of empty slots below its method's `max_slots` doubles (up to that size) instead of
        evicting, so a method that keeps every decoded token never loses one when more come than were announced.
        """
        state = layer.state
        # Under compression nothing is evicted between compressions: a store too small (a prompt below the budget,
        # which keeps everything) grows instead.
        limit = None if self.compress_every is not None else self.max_slots(layer)
        if state.empty == 0 and (limit is None or state.store.slots < limit):
            slots = state.store.slots
            state.grow((2 * slots if limit is None else min(2 * slots, limit)) - slots)
        state.put(self.eviction_scores(layer), key, value, layer.seen - 1, self.appended_score(layer))

    def runs_on_device(self, states: list[LayerState]) -> bool:
        """Methods that evict by their stored scores alone (the shared decode, append and eviction rule)."""
        shared = all(
            getattr(type(self), name) is getattr(SelectionPolicy, name)
            for name in ("decode", "append", "observe", "eviction_scores", "appended_score")
        )
        compressing = self.compress_every is not None  # compressions rebuild the store: a host decision
        return shared and not compressing and all(isinstance(state, SelectionState) for state in states)

    def device_step(
        self, layer: DeviceLayer[SelectionState], query: Tensor, key: Tensor, value: Tensor, scaling: float
    ) -> Tensor:
        state, counters = layer.state, layer.counters
        layer.record_full_share(0.0)
        state.put(state.scores, key, value, counters.seen - 1, (APPENDED + counters.step).float())
        return attend(query, state.store.keys, state.store.values, scaling, positions=state.store.positions)[0]

    def decode(self, layer: SelectionLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> Tensor:
        self.append(layer, key, value)
        state = layer.state
        if type(self).observe is SelectionPolicy.observe:
            output, read = state.attend(query, scaling, layer.pads)
            layer.record(0.0, read)
        else:
            layer.record(0.0, state.store.nbytes())
            output, probs = attend_with_probs(
                query, state.store.keys, state.store.values, scaling, state.valid(layer.pads)
            )
            self.observe(layer, probs)
        if self.compress_every is not None:
            self.remember_queries(layer, query)
            state.since_compressed += 1
            # a compiled step defers it to the next eager one (`decides_on_host`: steps N, 2N, ...)
            if state.since_compressed >= self.compress_every and not torch.compiler.is_compiling():
                self.compress(layer, scaling)
        return output

    def decides_on_host(self, step: int) -> bool:
        """The compression steps (every `compress_every`-th) choose from scores read on the host."""
        return self.compress_every is not None and step % self.compress_every == 0

    # ---- compression during decoding (`compress_every`) ----------------------------------------------------------

    def observed_queries(self, layer: SelectionLayer) -> int:
        """How many of the latest queries `compression_scores` reads (`recent_queries`): 0 by default (a method
        that scores by its stored eviction scores or by keys alone); SnapKV's observation window."""
        return 0

    def remember_queries(self, layer: SelectionLayer, query: Tensor) -> None:
        """Under compression, keep the last `observed_queries` queries (the prompt's last ones, then decoded ones)."""
        wanted = self.observed_queries(layer) if self.compress_every is not None else 0
        if wanted <= 0:
            return
        held = layer.state.recent_queries
        queries = query if held is None else torch.cat([held, query], dim=2)
        layer.state.recent_queries = queries[:, :, -wanted:].clone()

    def compression_budget(self, layer: SelectionLayer) -> int | Tensor:
        """Tokens per KV head a compression keeps in this layer: `kept_tokens` (K; PyramidKV its layer's share), or
        a (B,) tensor of per-row budgets (DynamicKV)."""
        return self.kept_tokens(layer)

    def compression_scores(self, layer: SelectionLayer, order: Tensor, scaling: Scaling) -> Tensor:
        """(B, Hkv, n) worth of each held token, higher kept first, for the held slots taken in `order` (B, Hkv, n),
        which is position order (empty slots first). By default the method's eviction scores (H2O's cumulative
        attention with its recent window protected, TOVA's last step's attention, StreamingLLM's positions); a
        method that ranks by the prompt's window (SnapKV) re-scores from `held_tokens` and `recent_queries`."""
        return self.eviction_scores(layer).gather(-1, order)

    def held_tokens(self, layer: SelectionLayer, order: Tensor) -> tuple[Tensor, Tensor]:
        """The held keys (B, Hkv, n, D) in `order` and which of them are real tokens (B, Hkv, n) bool."""
        state = layer.state
        (keys,) = gather_tokens(order, state.store.keys)
        return keys, state.store.valid(layer.pads).gather(-1, order)

    def compress(self, layer: SelectionLayer, scaling: Scaling) -> None:
        """Bring the layer back to `compression_budget` tokens per KV head by `compression_scores`, the last
        `recent_kept` tokens kept whatever their score (SnapKV's window, H2O's recent half); the store is rebuilt
        with room for the next `compress_every` tokens. Nothing is evicted where every head holds at most its
        budget."""
        state = layer.state
        state.since_compressed = 0
        assert self.compress_every is not None
        valid = state.store.valid(layer.pads)
        budget = self.compression_budget(layer)
        most = budget if isinstance(budget, int) else int(budget.max())
        if int(valid.sum(-1).max()) <= (budget if isinstance(budget, int) else int(budget.min())):
            return
        # position order, empty slots and pads first: `keep_top`'s last positions are the newest tokens
        order = state.store.positions.masked_fill(~valid, -1).argsort(dim=-1, stable=True)
        scores = checked_scores(self.name, self.compression_scores(layer, order, scaling), state.store.positions)
        real = valid.gather(-1, order)
        recent = self.recent_kept(layer)
        if isinstance(budget, int):
            index, _ = keep_top(scores, budget, real, recent)
        else:  # per-row budgets: each row its own top-k, the others' entries -1
            index = torch.full((*scores.shape[:2], min(most, scores.shape[-1])), -1, device=scores.device)
            for row, row_budget in enumerate(budget.tolist()):
                picked, _ = keep_top(scores[row : row + 1], int(row_budget), real[row : row + 1], recent)
                index[row, :, : picked.shape[-1]] = picked[0]
        slot_index = torch.where(index >= 0, order.gather(-1, index.clamp(min=0)), -1)
        state.keep_slots(slot_index, self.compress_every)
