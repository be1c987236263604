"""The partial cache C_p of `refreshkv` and `recycled`, and the one rule that fills it, whatever holds C_f.

A refresh rebuilds C_p from attention probabilities over C_f (the prefill's window, a full step's query): scores
pooled, aggregated over a GQA group and spread over words (`selection_scores`), where each token C_p holds scores at
least `carry` x its score there and each token the question's window selected at least `question_floor` x its score
there; then the top K, in C_p's first K slots. With `keep_decoded` the answer so far is held after the K. C_f may
be the transformers cache's store, a quantized one, static decoding's fixed-size buffers or a paged engine's blocks
(refreshkv.serving): it is read through the `FullCacheStore` interface (`view`, `span`, `length`; `attend` and
`gather` where it reads in place).

Choices where the papers are silent:
- Tokens appended by partial steps are never evicted before recycled ones (the papers evict "the recycled token with
  the lowest score"); if all recycled tokens are gone, the oldest appended token goes first.
- A full step's own token is a candidate for the refreshed C_p. With rows of a batch on different schedules, only the
  rows that take a full step are refreshed.
- A token that stays selected keeps its slot; the new ones take the slots freed, in position order
  (`held_slot_order`). The partial steps sum over C_p in slot order and evict the first of equal scores by slot, so
  this order is part of the method's arithmetic, the same on every path; it lets a C_f in a serving engine's blocks
  copy only the new tokens at a refresh, none of the held ones moved.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch
from torch import Tensor

from ...core import native_selection
from ...core.attention_math import pool_window, selection_scores, window_mean
from ...core.contract import MethodLayer
from ...core.full_cache import FullCacheStore
from ...core.kvstore import FullStore, LayerState, gather_tokens
from ...core.selection import APPENDED, SelectionState, keep_top  # APPENDED: decoded tokens outrank recycled ones


@dataclasses.dataclass
class RefreshState(LayerState):
    full: FullCacheStore  # C_f: dense, quantized, offloaded (core/full_cache.py) or an engine's own storage
    partial: SelectionState | None  # C_p: K slots + the newest (keep_decoded: + the answer's); None while K holds all
    # (B, D) compared query of the last full step (dynamic schedule only; None until a question's first check with
    # anchor="answer")
    anchor: torch.Tensor | None
    # with `question_floor`: (B, Hkv, C_p's slots) positions and scores that the last question's window selected
    question_positions: Tensor | None = None
    question_scores: Tensor | None = None
    answer_start: int = 0  # position of the first token after the last question (its answer's first)

    def nbytes(self) -> int:
        return self.full.nbytes() + (self.partial.nbytes() if self.partial is not None else 0)

    def nbytes_by_device(self) -> dict[str, int]:
        total = Counter(self.full.nbytes_by_device())
        total.update(self.partial.nbytes_by_device() if self.partial is not None else {})
        return dict(total)

    def kept(self, pads: Tensor | None) -> Tensor:
        return self.full.kept(pads)

    def advance(self, steps: int) -> None:
        self.full.advance(steps)
        if self.partial is not None:
            self.partial.advance(steps)

    def clear_unwritten(self) -> None:
        self.full.clear_unwritten()


RefreshLayer = MethodLayer[RefreshState]  # the layer refreshkv works on: C_f, C_p and the schedule's state


def answer_scores(positions: Tensor, answer_start: int) -> Tensor:
    """The eviction scores of the answer's tokens at `positions`, as `put` scored each at the step that decoded it
    (eager and static decoding hold the answer alike)."""
    return (APPENDED + 1 + positions - answer_start).float()


def copy_rows(target: Tensor, source: Tensor, rows: Tensor | None) -> None:
    """Copy `source` into `target` (batch first) in place, only in `rows` ((B,) bool) if given."""
    target.copy_(source if rows is None else torch.where(rows.view(-1, *[1] * (target.ndim - 1)), source, target))


def carried(held: tuple[Tensor, Tensor], scores: Tensor, share: float) -> Tensor:
    """`scores` (B, Hkv, n), where each token C_p holds (`held`: its positions and scores, (B, Hkv, slots)) scores at
    least `share` x its score there; decoded tokens, never scored, and empty slots (position -1) carry nothing."""
    positions, previous = held
    selected = (positions >= 0) & (previous < APPENDED) & (positions < scores.shape[-1])
    floor = torch.where(selected, previous * share, float("-inf"))
    return scores.scatter_reduce(-1, positions.clamp(min=0) * selected, floor, reduce="amax")


def held_slot_order(index: Tensor, held: Tensor, n: int) -> Tensor:
    """The slot each of the k selected positions `index` (B, Hkv, k; ascending) fills, as the order (B, Hkv, k) that
    puts them there (slot j takes `index.gather(-1, order)[..., j]`): a position that `held` (the positions C_p's
    first k slots hold, -1: none) holds stays in its slot, the others take the slots left in slot order, in position
    order (selection_kernels.c `keep_held_slots`). No host read: a compiled step runs it on the device."""
    k = index.shape[-1]
    slots = torch.arange(k, device=index.device).expand_as(index)
    known = (held >= 0) & (held < n)
    slot_of = torch.full((*index.shape[:2], n + 1), -1, dtype=torch.long, device=index.device)
    slot_of.scatter_(-1, torch.where(known, held, n), torch.where(known, slots, -1))
    stays_at = slot_of.gather(-1, index)
    stays = stays_at >= 0
    taken = torch.zeros_like(index).scatter_add_(-1, stays_at.clamp(min=0), stays.long()) > 0
    # the i-th selected token that moves takes the i-th slot left
    movers_first = torch.argsort(stays.int(), dim=-1, stable=True)
    free_first = torch.argsort(taken.int(), dim=-1, stable=True)
    target = torch.empty_like(index).scatter_(-1, movers_first, free_first)
    target = torch.where(stays, stays_at, target)
    return torch.empty_like(index).scatter_(-1, target, slots)


@dataclasses.dataclass(frozen=True)
class SelectionRule:
    """How a refresh scores and keeps tokens: the method's selection parameters, resolved for one layer."""

    kernel: int
    pooling: str
    aggregation: str
    carry: float  # share of its score in C_p that a held token keeps
    question_floor: float  # share of its score in the question's selection that a token keeps until the next question

    def refresh(
        self,
        layer: RefreshLayer,
        probs: Tensor,
        valid: Tensor | None,
        full_kv: FullCacheStore | tuple[Tensor, Tensor],
        rows: Tensor | None = None,
        carry: bool = True,
        held: tuple[Tensor, Tensor] | None = None,
        before: int | None = None,
    ) -> int:
        """Rebuild C_p from window probabilities (B, Hkv, G, w, n) over C_f's keys and values `full_kv` (read once
        per full step), or over a C_f that reads its selected tokens alone where it holds them (a quantized one, an
        engine's blocks: `gather`); only `rows` (B,) bool if
        given; with `before`, from the tokens before that position alone; without `carry`, from these probabilities
        alone (a new question). `held`: C_p's positions and scores before this step's token took a slot, which a
        refreshed row carries. Returns the tokens selected (k).

        On the CPU, one call of C does all of it, the top K and the load of C_p (core/native_selection.py: a dozen
        PyTorch operators per layer fewer); elsewhere, for `mean` aggregation and for some rows under torch.compile,
        PyTorch operators, with the same result."""
        partial = layer.state.partial
        assert partial is not None  # a refresh rebuilds C_p
        # the tokens C_p's slots hold before the refresh rewrites its positions: a C_f that gathers the selected
        # tokens itself reads none that stayed in their slots
        slot_positions = None if isinstance(full_kv, tuple) else partial.store.positions.clone()
        n = probs.shape[-1]
        k = min(layer.budget, n if before is None else before)
        words = layer.prompt_spans if self.pooling == "span" else None
        store = (partial.store.keys, partial.store.values, partial.store.positions, partial.scores)
        queries_valid = None if valid is None else valid.reshape(valid.shape[0], -1)[:, -probs.shape[3] :]
        if before is not None and before < n:  # the tokens from `before` on are no candidates
            earlier = torch.arange(n, device=probs.device) < before
            valid = earlier.view(1, 1, 1, n) if valid is None else valid & earlier
            valid = valid.expand(probs.shape[0], 1, 1, n).contiguous()
        per_head = window_mean(probs, queries_valid)  # averaged once, whichever path scores it
        carry_share = self.carry if carry else 0.0
        if rows is not None and held is not None and carry_share > 0:
            # A refreshed row carries C_p as it was before the step's token took a slot (`held`): its positions and
            # scores go back into the store, which the refresh rewrites whole, so the C reads the carry from there.
            for target, source in zip((partial.store.positions, partial.scores), held):
                copy_rows(target, source, rows)
        floor = self.question_selection(layer.state) if carry else None
        if self.aggregation != "mean":
            # a C_f that reads where it lies (codes, an engine's blocks) gathers the tokens the C selects itself
            keys, values = full_kv if isinstance(full_kv, tuple) else (None, None)
            window, first_only = pool_window(self.kernel, self.pooling), self.aggregation == "first"
            if native_selection.refresh_partial(
                per_head,
                first_only,
                window,
                words,
                valid,
                k,
                keys,
                values,
                store,
                (carry_share, APPENDED),
                rows,
                floor,
            ):
                if not isinstance(full_kv, tuple):
                    gather_selected(full_kv, partial, k, rows, slot_positions)
                if rows is None:
                    partial.loaded(k)
                else:  # the other rows keep their slots; the refreshed ones' from k on are empty
                    partial.filled = min(partial.filled, k)
                return k
        scores = selection_scores(per_head.unsqueeze(3), self.kernel, self.aggregation, self.pooling, words)
        if valid is not None:
            scores = scores.masked_fill(~valid.view(valid.shape[0], 1, -1), float("-inf"))
        if carry_share > 0:
            scores = carried((partial.store.positions, partial.scores), scores, carry_share)
        if floor is not None:
            positions, floor_scores, share = floor
            scores = carried((positions, floor_scores), scores, share)
        index, kept = keep_top(scores, k)  # pads scored -inf: a top k, no entry -1
        order = held_slot_order(index, partial.store.positions[..., :k], n)
        index, kept = index.gather(-1, order), kept.gather(-1, order)
        if not isinstance(full_kv, tuple) and partial.load_gathered(full_kv, index, kept, rows):
            return k
        keys, values = full_kv if isinstance(full_kv, tuple) else full_kv.view()
        refreshed = partial if rows is None else SelectionState.empty_like(keys, partial.store.slots)
        refreshed.load(keys, values, index, kept, ragged=False)
        if rows is None:
            return k
        for target, source in (
            (partial.store.keys, refreshed.store.keys),
            (partial.store.values, refreshed.store.values),
            (partial.store.positions, refreshed.store.positions),
            (partial.scores, refreshed.scores),
        ):
            copy_rows(target, source, rows)
        partial.filled = min(partial.filled, refreshed.filled)
        return k

    def select_for_question(
        self, layer: RefreshLayer, probs: Tensor, valid: Tensor | None, full_kv: tuple[Tensor, Tensor]
    ) -> None:
        """C_p selected by the window of a new question (the prompt, a conversation's next turn), nothing carried;
        with a question floor, kept aside as the floor of the refreshes until the next question."""
        self.refresh(layer, probs, valid, full_kv, carry=False)
        state: RefreshState = layer.state
        if self.question_floor > 0 and state.partial is not None:
            state.question_positions = state.partial.store.positions.clone()
            state.question_scores = state.partial.scores.clone()

    def question_selection(self, state: RefreshState) -> tuple[Tensor, Tensor, float] | None:
        """The question's selection that a refresh keeps as a floor and the share of its scores kept, or None."""
        if self.question_floor == 0 or state.question_positions is None or state.question_scores is None:
            return None
        return state.question_positions, state.question_scores, self.question_floor


def gather_selected(
    full: FullCacheStore, partial: SelectionState, k: int, rows: Tensor | None, held: Tensor | None = None
) -> None:
    """The keys and values of the k tokens C_p's first slots hold (just selected) into those slots, read from a C_f
    that holds them otherwise (`gather`; `held`: the positions of the tokens the slots' keys and values are still of,
    which it may leave where they are), or where it cannot, from its `view()` (only `rows` if given)."""
    store = partial.store
    index, out = store.positions[..., :k], (store.keys, store.values)
    if full.gather(index, out, rows, held):
        return
    for target, source in zip(out, gather_tokens(index, *full.view())):
        copy_rows(target[:, :, :k], source, rows)


def hold_answer(layer: RefreshLayer, kept: int, rows: Tensor | None) -> None:
    """`keep_decoded`: after a refresh that selected `kept` tokens before the answer, the answer so far (the tokens
    decoded since the last question, the newest as many as fit) goes into the slots after them, as decoded tokens
    (only `rows`, (B,) bool, if given)."""
    state: RefreshState = layer.state
    partial = state.partial
    assert partial is not None  # a refresh has C_p
    end = state.full.length
    start = max(state.answer_start, end - (partial.store.slots - kept))
    if start >= end:
        return
    store, taken = partial.store, slice(kept, kept + end - start)
    positions = torch.arange(start, end, device=store.positions.device).expand(*store.positions.shape[:2], -1)
    scores = answer_scores(positions, state.answer_start)
    held = [(store.positions[:, :, taken], positions), (partial.scores[:, :, taken], scores)]
    if not state.full.gather(positions, (store.keys[:, :, taken], store.values[:, :, taken]), rows):
        keys, values = state.full.span(start, end)  # a C_f that does not read in place
        held += [(store.keys[:, :, taken], keys), (store.values[:, :, taken], values)]
    for target, source in held:
        copy_rows(target, source, rows)
    if rows is None:
        partial.loaded(kept + end - start)
    else:  # the refreshed rows' slots after the answer are empty; the others' as they were
        partial.empty = min(partial.empty, store.slots - kept - (end - start))


def hold_answer_on_device(state: RefreshState, kept: int, seen: Tensor, rows: Tensor | None) -> None:
    """`hold_answer` where the host does not know how far the answer has come (a step replayed from a CUDA graph):
    the whole span it may take is copied from C_f and the positions not yet decoded (>= `seen`) are left empty
    (zeros: C_f holds whatever its allocation held there, which a masked slot must not carry in)."""
    partial, full, start = state.partial, state.full, state.answer_start
    assert partial is not None and isinstance(full, FullStore)  # static decoding refreshes C_p from a dense C_f
    keys, values = full.keys, full.values
    room = min(partial.store.slots - kept, keys.shape[2] - start)
    store, taken = partial.store, slice(kept, kept + room)
    positions = torch.arange(start, start + room, device=seen.device)
    decoded = positions < seen
    shape = (*keys.shape[:2], room)
    scores = torch.where(decoded, answer_scores(positions, start), float("-inf"))
    answer = decoded.view(1, 1, room, 1)
    for target, source in (
        (store.keys[:, :, taken], torch.where(answer, keys[:, :, start : start + room], 0)),
        (store.values[:, :, taken], torch.where(answer, values[:, :, start : start + room], 0)),
        (store.positions[:, :, taken], torch.where(decoded, positions, -1).expand(shape)),
        (partial.scores[:, :, taken], scores.expand(shape)),
    ):
        copy_rows(target, source, rows)
