"""`dynamickv` (DynamicKV, Zhou et al.): layer-adaptive budgets decided during prefill (dynamickv.txt §4,
Algorithm 1, Eq. 2-6).

Per layer l, as the prompt passes through it (Alg. 1 lines 13-22):
- A^l = attention of the last `window` (ws) prompt tokens, averaged over the window and max-pooled over positions
  (`kernel`), Eq. 2 / line 16; aggregated over the query heads of a GQA group (`aggregation`, max as in snapkv);
- the layer first keeps its maximum budget B^l = (wt - ws) * r_max tokens per KV head (Eq. 3, line 20), plus the
  window (line 21).
Every `interval` (m) layers (line 24), Update_Buffer_Length (lines 4-11, Eq. 4-6) recomputes the budgets of all
layers processed so far: the global top-((wt - ws) * H * l) entries of the concatenated A^1..A^l are counted per
layer (Eq. 4, Phi), Z = int(B^l * cnt / max(cnt)) (Eq. 5, line 8), and Z is rescaled so that it sums to the total
budget B = (wt - ws) * L (Eq. 6, lines 9-10). Each processed layer's cache is shrunk to its top-Z' tokens (lines
27-30): a new, smaller SlotStore replaces the old one, so the memory is really freed.

Budget mapping: the CLI's `budget` K (BudgetPolicy; default L/8) is wt, the mean tokens per layer window included
(as in snapkv, whose budget counts its window), so wt - ws = K - ws tokens are selected per layer on average and
B = (K - ws) * L selected tokens are distributed over the layers; snapkv and dynamickv with the same K hold the
same number of prompt tokens in total.

Defaults: snapkv's selection (window ws = 32, kernel 7, span pooling; snapkv's defaults, chosen on the selection
dev set) with r_max 5.0. `preset="paper"` (the paper's text gives no values; from the authors' released LongBench
script, run/longbench/pred.py): window ws = 16, kernel 7, centred pooling, r_max ("radio_max") = 5.0. The interval
m = 4 is this package's choice (not in that script). Deviation: that script pools with average pooling by default;
here pooling is max-pooling, as SnapKV's and RefreshKV's selections in the seeds.

Choices where the paper is ambiguous:
- Final normalisation: Alg. 1 updates at l % m == 0 and ends with "update the K/V cache K^c from K^b" (line 33).
  Here the last layer always runs the update too, so the final budgets always come from counts over all L layers
  and sum to B, whatever L % m.
- Intermediate updates normalise to the whole B over the l layers seen so far (line 9 divides by (wt - ws) * L);
  as a layer can only shrink (its evicted tokens are gone), this bounds the prefill's buffered total by B and only
  shrinks once the processed layers together hold more than B.
- Eq. 5's scaling by B^l / max(cnt) cancels in Eq. 6 except for line 8's int(); the normalisation of line 7 and
  the division by l (line 6) cancel entirely. B^l remains the cap of every layer (its buffer size): Eq. 6 alone can
  give a layer more than B^l (or more than the tokens it still holds); the excess is redistributed proportionally
  among the other layers (repeated until no layer exceeds its cap; layers with zero count share leftovers
  uniformly), and rounding uses largest remainders, so the budgets sum to min(B, total capacity) exactly rather
  than to B minus flooring losses. With r_max < 1 the capacity L * B^l is below B.
- Per KV head (like snapkv) every head of a layer keeps the layer's budget; counting uses the KV-head scores
  (H = KV heads). A batch is handled row by row in parallel: budgets are per row, and a layer's store is sized for
  the largest row (the others' slots are empty and masked). Pad positions never count and are never kept.
- Bad input: r_max <= 0 or non-positive window/interval raise a PolicyError; a window larger than the prompt raises
  a PolicyError; a prompt of at most K + ws tokens (wt >= prompt) keeps everything (equals `full`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Self, cast

import torch
from torch import Tensor

from ..core.attention_math import Scaling, ranked
from ..core.policy import PolicyError, check_positive, register
from ..core.selection import SelectionLayer, SelectionState, checked_scores, keep_top
from .snapkv import SnapKV

WINDOW_SCORE = 1.0  # the observation window is always kept: score above any pooled probability


@dataclasses.dataclass
class DynamicState(SelectionState):
    budget: torch.Tensor  # (B,) selected tokens per KV head in each row
    attention: torch.Tensor | None  # (B, Hkv, prefix) A^l, kept until the final update
    selected: int = 0  # slots [0, selected) hold the selected prompt tokens, then the window
    window: int = 0

    @classmethod
    def of(
        cls, held: SelectionState, selected: int, window: int, budget: Tensor, attention: Tensor | None
    ) -> DynamicState:
        """The tokens `held` (selected ones, then the window) as a layer's DynamicState."""
        return cls(held.store, held.scores, held.filled, held.empty, budget, attention, selected, window)

    def prefix_attention(self) -> Tensor:
        """A^l, which every update reads until the final one drops it."""
        assert self.attention is not None, "DynamicKV's final update has dropped A^l"
        return self.attention

    @classmethod
    def align_groups(cls, states: list[Self]) -> None:
        """Row groups prefilled apart (engine/join_rows.py) size their stores for their own largest row: each is
        widened to the widest, with empty slots before the window, as the batch prefilled at once holds them."""
        width = max(state.selected for state in states)
        for state in states:
            state.widen_selection(width)
        super().align_groups(states)

    def widen_selection(self, width: int) -> None:
        """`width` selected slots: empty ones (masked, so `filled` 0) inserted before the window."""
        extra = width - self.selected
        if extra == 0:
            return
        store = self.store
        store.keys, store.values = (_with_empty_slots(t, self.selected, extra, 0.0) for t in (store.keys, store.values))
        store.positions = _with_empty_slots(store.positions, self.selected, extra, -1)
        self.scores = _with_empty_slots(self.scores, self.selected, extra, float("-inf"))
        self.selected, self.filled = width, 0


def _with_empty_slots(tensor: Tensor, at: int, count: int, fill: float) -> Tensor:
    """`tensor` (B, Hkv, slots, ...) with `count` slots holding `fill` inserted at slot `at`."""
    empty = tensor.new_full((*tensor.shape[:2], count, *tensor.shape[3:]), fill)
    return torch.cat([tensor[:, :, :at], empty, tensor[:, :, at:]], dim=2)


def layer_counts(scores: list[Tensor], per_layer: int) -> Tensor:
    """Eq. 4 / Alg. 1 line 6: per row, how many of the global top-(per_layer * H * l) entries of the concatenated
    scores (l tensors (B, H, P), -inf = never selectable) fall in each layer -> (B, l). A count over the layers'
    scores together, not a per-head selection: `ranked`, not `keep_top`."""
    batch = scores[0].shape[0]
    size = scores[0][0].numel()
    gathered = torch.cat([s.reshape(batch, -1) for s in scores], dim=-1)
    k = min(per_layer * scores[0].shape[1] * len(scores), gathered.shape[-1])
    indices = ranked(gathered, k)  # ties to the earlier layer, head and position: the same for a row alone
    values = gathered.gather(-1, indices)
    layer_of = torch.where(torch.isfinite(values), indices // size, len(scores))
    counts = torch.zeros(batch, len(scores) + 1, dtype=torch.long, device=gathered.device)
    counts.scatter_add_(1, layer_of, torch.ones_like(layer_of))
    return counts[:, :-1]


def apportion(weights: Tensor, total: Tensor, caps: Tensor) -> Tensor:
    """Integers (B, l) proportional to `weights` (B, l), each <= `caps` (B, l), summing to min(total, caps.sum()).

    Proportional shares (Eq. 6); a layer whose share reaches its cap gets the cap and the rest is shared again among
    the others; if the uncapped layers all have zero weight they share it uniformly. Largest-remainder rounding.
    """
    weights, caps = weights.double(), caps.long()
    target = torch.minimum(total.long(), caps.sum(-1))
    alloc = torch.zeros_like(weights)
    free = caps > 0
    remaining = target.double()
    for _ in range(weights.shape[-1] + 1):
        w = torch.where(free, weights, 0.0)
        uniform = (w.sum(-1, keepdim=True) <= 0) & free
        w = torch.where(uniform, 1.0, w)
        wsum = w.sum(-1, keepdim=True)
        share = torch.where(wsum > 0, w / wsum.clamp(min=1e-300) * remaining.unsqueeze(-1), 0.0)
        over = free & (share >= caps)
        if not bool(over.any()):
            alloc = torch.where(free, share, alloc)
            break
        alloc = torch.where(over, caps.double(), alloc)
        remaining = remaining - torch.where(over, caps.double(), 0.0).sum(-1)
        free = free & ~over
    base = alloc.floor().long().minimum(caps)
    missing = (target - base.sum(-1)).clamp(min=0)
    room = base < caps
    fraction = torch.where(room, alloc - base, -1.0)
    rank = fraction.argsort(dim=-1, descending=True).argsort(dim=-1)
    return base + ((rank < missing.unsqueeze(-1)) & room).long()


def allocate(counts: Tensor, layer_max: int, total: int, caps: Tensor) -> Tensor:
    """Update_Buffer_Length's budgets Z' (B, l) from the counts (B, l): Eq. 5 with line 8's int(), Eq. 6 to `total`."""
    peak = counts.amax(dim=-1, keepdim=True).clamp(min=1)
    provisional = (layer_max * counts // peak).double()  # Eq. 5: Z = int(B^l * t / max(C))
    return apportion(provisional, torch.full_like(counts[:, 0], total), caps)


def _position_order(positions: Tensor, keep: Tensor) -> Tensor:
    """The order (B, Hkv, k) that sorts the kept entries by position, unused ones last."""
    return torch.where(keep, positions, torch.iinfo(torch.long).max).argsort(dim=-1)


@register
@dataclasses.dataclass
class DynamicKV(SnapKV):
    """DynamicKV: SnapKV's selection with layer budgets reallocated every `interval` layers from global top-k counts.

    Parameters: `budget`: K tokens per KV head (or `budget_ratio`: K as a share of the longest prompt, 1/8 by
    default), the mean per layer, window included; `window` (32) observation window; `kernel` (7)
    max-pooling kernel, `pooling` (span); `aggregation` (max) over a GQA group (snapkv's selection;
    `preset="paper"`: window 16, centred pooling, the authors' script); `r_max` (5.0) a layer's cap as a
    multiple of the mean
    selected budget; `interval` (4) layers between reallocations; `compress_every` (None) as in snapkv, each
    layer back to its prefill share of the budget.
    """

    name = "dynamickv"
    summary = "layer-adaptive budgets: every m layers, reallocate the total budget by global top-k counts"
    # The defaults are snapkv's selection (window 32, span pooling); "paper" is the authors' script's selection.
    presets = {
        "paper": {"window": 16, "kernel": 7, "pooling": "centered", "aggregation": "max", "r_max": 5.0, "interval": 4}
    }

    r_max: float = 5.0
    interval: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("interval", self.interval)
        if (
            isinstance(self.r_max, bool)
            or not isinstance(self.r_max, (int, float))
            or not (self.r_max > 0 and math.isfinite(self.r_max))
        ):
            raise PolicyError(f"r_max must be a number > 0, got {self.r_max!r}")

    def layer_budget(self, layer: SelectionLayer) -> int:
        """B^l = (wt - ws) * r_max with wt - ws = K: what a layer keeps before the first update."""
        return int(self.selected_budget(layer) * self.r_max)

    def prefix_scores(
        self, layer: SelectionLayer, query: Tensor, key: Tensor, scaling: Scaling, valid: Tensor | None
    ) -> Tensor:
        """A^l: SnapKV's scores of the tokens before the window (-inf at pads, which never count in Eq. 4)."""
        scores = checked_scores(self.name, self.score(layer, query, key, scaling, valid), key)
        if valid is not None:
            scores = scores.masked_fill(~valid.view(valid.shape[0], 1, -1), float("-inf"))
        return scores[..., : key.shape[2] - self.window]

    def select(
        self, layer: SelectionLayer, query: Tensor, key: Tensor, scaling: Scaling, valid: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        return self.select_from(self.prefix_scores(layer, query, key, scaling, valid), layer, valid, key.shape[2])

    def select_from(
        self, attention: Tensor, layer: SelectionLayer, valid: Tensor | None, length: int
    ) -> tuple[Tensor, Tensor]:
        """SnapKV's selection from A^l with the layer's maximum budget B^l (`keep_top`): selected tokens in position
        order (-1, for pads, last), then the window."""
        prefix = None if valid is None else valid.view(valid.shape[0], 1, -1)[..., : length - self.window]
        index, kept = keep_top(attention, self.layer_budget(layer), prefix)
        order = _position_order(index, index >= 0)
        index, kept = index.gather(-1, order), kept.gather(-1, order)
        window = torch.arange(length - self.window, length, device=index.device).expand(*index.shape[:2], -1)
        scores = torch.cat([kept, torch.full_like(window, WINDOW_SCORE, dtype=attention.dtype)], -1)
        return torch.cat([index, window], dim=-1), scores

    def store_prompt(self, layer: SelectionLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> None:
        valid = layer.valid_positions(key.shape[2], key.device)
        attention = self.prefix_scores(layer, query, key, scaling, valid)
        index, scores = self.select_from(attention, layer, valid, key.shape[2])
        selected = index.shape[-1] - self.window
        budget = (index[..., :selected] >= 0).sum(-1)[:, 0]  # the same in every head of a row
        held = self.store_selection(layer, key, value, index, scores)
        layer.state = DynamicState.of(held, selected, self.window, budget, attention)
        self.remember_queries(layer, query)
        layers = layer.method_layers()  # the layers that share the budget (not sliding windows)
        depth = layers.index(layer) + 1
        if depth % self.interval == 0 or depth == len(layers):
            self.update(layers[:depth], self.selected_budget(layer), len(layers), final=depth == len(layers))

    def update(self, layers: list[SelectionLayer], per_layer: int, num_layers: int, final: bool) -> Tensor:
        """Update_Buffer_Length over `layers` (Alg. 1 lines 4-11) and shrink their stores (lines 27-30)."""
        states = [cast(DynamicState, layer.state) for layer in layers]  # what store_prompt keeps
        attention = [state.prefix_attention() for state in states]
        if attention[0].shape[-1] == 0:
            return torch.stack([s.budget for s in states], dim=-1)
        counts = layer_counts(attention, per_layer)
        caps = torch.stack([s.budget for s in states], dim=-1)  # what each layer still holds
        layer_max = int(per_layer * self.r_max)
        budgets = allocate(counts, layer_max, per_layer * num_layers, caps)
        for layer, state, budget in zip(layers, states, budgets.unbind(-1)):
            if not torch.equal(budget, state.budget):
                state = self.shrink(layer, state, budget)
                layer.state = state
            if final:
                state.attention = None  # no longer needed
        return budgets

    def shrink(self, layer: SelectionLayer, state: DynamicState, budget: Tensor) -> DynamicState:
        """A new, smaller store holding each head's top-`budget` selected tokens (by A^l) and the window.

        Ranked by `ranked`, not `keep_top`: each row keeps its own number of tokens (`budget`, (B,)), the first of
        one ranking; the tokens are then loaded from the old store as a selection is (`SelectionState.load`)."""
        old = state.store
        selected = state.scores[..., : state.selected]
        width = int(budget.max())
        # Highest scores first, ties to the earlier slot (= earlier position), so the batch's width does not matter.
        chosen = ranked(selected, width)
        keep = (torch.arange(width, device=selected.device) < budget.view(-1, 1, 1)) & torch.isfinite(
            selected.gather(-1, chosen)
        )
        order = _position_order(old.positions.gather(-1, chosen), keep)
        slot_index, keep = chosen.gather(-1, order), keep.gather(-1, order)
        window = torch.arange(state.selected, state.selected + state.window, device=selected.device)
        slot_index = torch.cat([slot_index, window.expand(*slot_index.shape[:2], -1)], dim=-1)
        keep = torch.cat(
            [
                keep,
                torch.ones(*keep.shape[:2], state.window, dtype=torch.bool, device=keep.device),
            ],
            -1,
        )
        held = SelectionState.empty_like(old.keys, self.slots(layer, slot_index.shape[-1]))
        positions = old.positions.gather(-1, slot_index).masked_fill(~keep, -1)
        held.load(old.keys, old.values, slot_index, state.scores.gather(-1, slot_index), positions=positions)
        shrunk = DynamicState.of(held, width, state.window, budget, state.attention)
        shrunk.recent_queries = state.recent_queries
        return shrunk

    def compression_budget(self, layer: SelectionLayer) -> Tensor:
        """Per row: the layer's share of the selected total B = (K - ws) x layers as allocated at prefill, plus the
        window. Where caps left part of B unallocated (a prompt shorter than the budget), the shares are scaled up
        to B, so a budget at or above the prompt and the answer keeps every token."""
        layers = layer.method_layers()
        allocated = torch.stack([cast(DynamicState, other.state).budget for other in layers], -1)  # (B, m)
        total = self.selected_budget(layer) * len(layers)
        spent = allocated.sum(-1)
        own = cast(DynamicState, layer.state).budget
        share = torch.where(spent < total, own * total // spent.clamp(min=1), own)
        share = torch.where(spent == 0, torch.full_like(own, total // len(layers)), share)  # prompt = the window
        return share + self.window
