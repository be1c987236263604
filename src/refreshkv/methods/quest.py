"""`quest` (Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", arXiv
2406.10774): the full cache in pages; at every decode step the current query picks the pages to attend to.

Per the paper (§3, Alg. 1): the cache is cut into pages of `page_size` (16) consecutive tokens; each page keeps, per
KV head and channel, the minimum and the maximum of its keys. At a decode step, a page's criticality is an upper
bound of the query-key product of its tokens: per channel the larger of q * min and q * max, summed over channels.
The top K / page_size pages by that bound, plus the page being written, are attended to; nothing is evicted. The
page metadata is updated as each token is appended. The first `dense_layers` (2) layers attend fully, as the paper
keeps its first two layers dense.

Choices where the paper is silent:
- GQA (the paper's models have one query head per KV head): the query heads sharing a KV head select together; a
  page's bound is the largest of their bounds (`aggregation="max"`; `mean` averages them), so one gather serves
  the group.
- Pages start at each row's first real token (a left-padded row pages its tokens as it would alone); the prompt's
  last partial page is "the page being written": decoded tokens fill it, and it is always attended to (it is not
  counted in K). Pads never enter a page's minimum or maximum, and a page of pads only is never selected.
- When every page fits (at most K / page_size + 1), the step attends to the whole cache directly (so a budget that
  keeps everything equals `full`).
- Bytes read per step: the selected pages' keys and values plus every page's minimum and maximum.
- Not the scorer layer's `keep_top` / `SelectionState.load` (selection.py): those keep tokens between steps, and
  Quest keeps every token and chooses pages afresh at each step. Pages are ranked by the shared `top_k` (ties to the
  earlier page, pages a row has not reached excluded); their tokens are gathered into scratch memory reused every
  step (`gather_tokens`'s `out`). On the CPU, where every row pages alike, the bounds, the top pages and their
  positions are one pass of C (`native_selection.quest_pages`): the same ranking, each bound summed over the channels
  in order (PyTorch's matrix product sums in its own order, so a near tie may rank the other way there).
"""

from __future__ import annotations

import dataclasses
from typing import Self

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.attention_math import AGGREGATIONS, Scaling, aggregate_group, decode_attention, pack_queries, top_k
from ..core.contract import MethodLayer
from ..core.full_cache import FullCacheStore
from ..core.kvstore import LayerState, gather_tokens
from ..core.native_selection import quest_pages
from ..core.policy import BudgetPolicy, PolicyError, check_choice, check_positive, ratio_or_default, register


class PagedStore(LayerState):
    """Every token (a `FullStore`) and, per page of `page_size` tokens and KV head, its keys' channel-wise minimum
    and maximum (B, Hkv, D, pages: per channel the pages side by side, so that a step's bounds run along them).
    Pages are counted from each row's first real token (a row's page j holds its real tokens j * page_size ...), so a
    left-padded row pages its tokens as it would alone; pages not yet reached hold +inf / -inf."""

    def __init__(self, full: FullCacheStore, key: Tensor, capacity: int, page_size: int, pads: Tensor | None):
        self.full = full
        self.page_size = page_size
        self.pads = torch.zeros(key.shape[0], dtype=torch.long, device=key.device) if pads is None else pads.clone()
        # read once, at the prompt (decode steps read nothing on the host): with equal padding every row pages alike
        self.fewest_pads = int(self.pads.min())
        self.uniform = self.fewest_pads == int(self.pads.max())
        pages = -(-capacity // page_size)
        self.lows = key.new_full((*key.shape[:2], key.shape[3], pages), float("inf"))
        self.highs = key.new_full((*key.shape[:2], key.shape[3], pages), float("-inf"))
        # scratch for the selected pages' keys and values, gathered into the same memory every step (`gather_tokens`'
        # `out`); not counted in `nbytes`, which is what the method holds between steps
        self.selected_keys = key.new_empty(*key.shape[:2], 0, key.shape[3])
        self.selected_values = key.new_empty(*key.shape[:2], 0, key.shape[3])

    @classmethod
    def align_groups(cls, states: list[Self]) -> None:
        """Row groups prefilled apart (engine/join_rows.py): the fewest pads and uniformity of the joined batch."""
        fewest = min(state.fewest_pads for state in states)
        uniform = all(state.uniform for state in states) and fewest == max(state.fewest_pads for state in states)
        for state in states:
            state.fewest_pads, state.uniform = fewest, uniform

    @property
    def pages(self) -> int:
        """Pages holding at least one token, in the row with the most."""
        return -(-(self.full.length - self.fewest_pads) // self.page_size)

    def load_prompt(self, keys: Tensor, values: Tensor) -> None:
        """The prompt (B, Hkv, L, D, left-padded): stored, and its pages' ranges from each row's real tokens."""
        self.full.append(keys, values)
        batch, heads, length, dim = keys.shape
        aligned = torch.arange(length, device=keys.device) + self.pads.view(-1, 1)  # (B, L) padded position
        real = aligned < length  # the row's real tokens, moved to the front
        index = aligned.clamp(max=length - 1).view(batch, 1, length, 1).expand(-1, heads, -1, dim)
        moved = keys.gather(2, index)
        pages = -(-length // self.page_size)
        shape = (batch, heads, pages, self.page_size, dim)
        padding = (0, 0, 0, pages * self.page_size - length)
        mask = ~real.view(batch, 1, length, 1)
        low = F.pad(moved.masked_fill(mask, float("inf")), padding, value=float("inf")).view(shape).amin(3)
        high = F.pad(moved.masked_fill(mask, float("-inf")), padding, value=float("-inf")).view(shape).amax(3)
        self.lows[..., :pages], self.highs[..., :pages] = low.transpose(2, 3), high.transpose(2, 3)

    def append(self, key: Tensor, value: Tensor) -> None:
        """One decoded token (B, Hkv, 1, D): stored, and its page's range widened (each row's own page)."""
        self.full.append(key, value)
        if self.pages > self.lows.shape[3]:  # more tokens than the capacity announced: double
            self.lows = torch.cat([self.lows, torch.full_like(self.lows, float("inf"))], dim=3)
            self.highs = torch.cat([self.highs, torch.full_like(self.highs, float("-inf"))], dim=3)
        if self.uniform:  # every row writes the same page: widened in place (a served step does so at every layer)
            written, token = (self.full.length - 1 - self.fewest_pads) // self.page_size, key[:, :, 0]
            for bounds, widen in ((self.lows[..., written], torch.minimum), (self.highs[..., written], torch.maximum)):
                widen(bounds, token, out=bounds)
            return
        channels = key.transpose(2, 3)  # (B, Hkv, D, 1)
        page = self.current_pages().view(-1, 1, 1, 1).expand_as(channels)
        self.lows.scatter_reduce_(3, page, channels, "amin")
        self.highs.scatter_reduce_(3, page, channels, "amax")

    def current_pages(self) -> Tensor:
        """(B,) the page each row is writing (its last token's)."""
        return (self.full.length - 1 - self.pads) // self.page_size

    def metadata_bytes(self) -> int:
        """Bytes of the pages' minima and maxima (read in full at every step)."""
        batch, heads, dim, _ = self.lows.shape
        return 2 * batch * heads * dim * self.pages * self.lows.element_size()

    def nbytes(self) -> int:
        return self.full.nbytes() + self.metadata_bytes()

    def kept(self, pads: Tensor | None) -> Tensor:
        return self.full.kept(pads)


PagedLayer = MethodLayer[PagedStore]  # the layer quest works on


@register
@dataclasses.dataclass
class Quest(BudgetPolicy[PagedStore]):
    """Quest: per decode step, the top K / `page_size` pages of the full cache by an upper bound of the query-key
    product (from each page's channel-wise key minimum and maximum), plus the page being written.

    Parameters: `budget`: K tokens per KV head (or `budget_ratio`: K as a share of the longest prompt, 1/8 by
    default), at least one page; `page_size` (16) tokens per page; `dense_layers` (2) bottom layers that attend
    fully; `aggregation` (max) of the page bounds over the query heads of a GQA group.
    """

    name = "quest"
    no_compression = "it keeps the whole cache and chooses the pages each step attends to"
    summary = "full cache in pages; each step attends to the top K/page_size pages by a query-aware upper bound"

    page_size: int = 16
    dense_layers: int = 2
    aggregation: str = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("page_size", self.page_size)
        if not isinstance(self.dense_layers, int) or isinstance(self.dense_layers, bool) or self.dense_layers < 0:
            raise PolicyError(f"dense_layers must be an integer >= 0, got {self.dense_layers!r}")
        check_choice("aggregation", self.aggregation, tuple(a for a in AGGREGATIONS if a != "first"))
        if self.budget is not None and self.budget < self.page_size:
            raise PolicyError(f"budget ({self.budget}) must hold at least one page (page_size {self.page_size} tokens)")

    def check_layers(self, layers: int) -> None:
        if self.dense_layers >= layers:
            raise PolicyError(
                f"dense_layers ({self.dense_layers}) covers every layer of this model ({layers}): that is `full`; "
                f"give dense_layers below {layers}, or use method full"
            )

    def budget_for(self, prompt_length: int) -> int:
        budget = super().budget_for(prompt_length)
        if budget < self.page_size:
            raise PolicyError(
                f"budget ({budget} tokens, from budget_ratio {ratio_or_default(self.budget_ratio)}) must hold at "
                f"least one page (page_size {self.page_size} tokens)"
            )
        return budget

    def store_prompt(self, layer: PagedLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> None:
        full = layer.full_store(key)  # the cache's own store (a serving engine's: its blocks)
        layer.state = PagedStore(full, key, layer.capacity(), self.page_size, layer.pads)
        layer.state.load_prompt(key, value)

    def decode(self, layer: PagedLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> Tensor:
        store = layer.state
        store.append(key, value)
        full = store.full
        selected_pages = layer.budget // self.page_size
        if layer.layer_idx < self.dense_layers or store.pages <= selected_pages + 1:
            layer.record(1.0 if layer.layer_idx < self.dense_layers else 0.0, full.attended_bytes())
            valid = layer.valid_positions(full.length, key.device)
            attended = full.attend(query, scaling, valid)  # where C_f lies otherwise (a serving engine's blocks)
            return decode_attention(query, *full.view(), scaling, valid) if attended is None else attended[0]
        index, chosen = self.selected_tokens(store, query, selected_pages)  # (B, Hkv, k) each
        layer.record(0.0, full.attended_bytes() // full.length * index.shape[-1] + store.metadata_bytes())
        # the page being written runs past the tokens held: a store that attends where C_f lies (an engine's blocks)
        # skips those positions; gathered, read the last token there and mask what is not a token
        chosen_attended = full.attend_at(query, scaling, index, chosen)
        if chosen_attended is not None:
            return chosen_attended
        valid = index < full.length if chosen is None else chosen & (index < full.length)
        return decode_attention(query, *self.gathered(store, index.clamp(max=full.length - 1)), scaling, valid)

    @staticmethod
    def gathered(store: PagedStore, index: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values at `index` (B, Hkv, k), into scratch memory reused from step to step, read where C_f
        holds them (`gather`) or from its `view()`."""
        shape = (*index.shape, store.selected_keys.shape[-1])
        if store.selected_keys.shape != shape:
            store.selected_keys, store.selected_values = (store.selected_keys.new_empty(shape) for _ in range(2))
        out = (store.selected_keys, store.selected_values)
        if not store.full.gather(index, out):
            store.selected_keys, store.selected_values = gather_tokens(index, *store.full.view(), out=out)
        return store.selected_keys, store.selected_values

    def selection(self, layer: PagedLayer, query: Tensor, scaling: Scaling) -> Tensor | None:
        """The step's pages (their tokens' positions); None where the step attends to the whole cache."""
        store = layer.state
        selected_pages = layer.budget // self.page_size
        if layer.layer_idx < self.dense_layers or store.pages <= selected_pages + 1:
            return None
        index, chosen = self.selected_tokens(store, query, selected_pages)
        held = index < store.full.length if chosen is None else chosen & (index < store.full.length)
        return index.masked_fill(~held, -1)

    def selected_tokens(self, store: PagedStore, query: Tensor, selected_pages: int) -> tuple[Tensor, Tensor | None]:
        """(B, Hkv, (selected_pages + 1) * page_size) padded positions, each row's top pages by their bound (page
        order) then the page it is writing, and whether each belongs to a chosen page (None: all do; a padded row
        with fewer pages than selected_pages fills up with pages it does not have); positions past a row's last
        token: the caller."""
        pages = store.pages
        packed = pack_queries(query, store.lows.shape[1])  # (B, Hkv, G, D)
        if store.uniform:  # every row writes page pages - 1: the pages before it compete, all of them written
            top_pages = min(selected_pages, pages - 1)
            mean = self.aggregation == "mean"
            native = quest_pages(
                packed, store.lows, store.highs, pages - 1, top_pages, mean, self.page_size, store.fewest_pads
            )
            if native is not None:  # on the CPU: the bounds, top pages and positions in one pass of C
                return native[1], None
            current = torch.full((query.shape[0],), pages - 1, dtype=torch.long, device=query.device)
            lows, highs, competing = store.lows[..., : pages - 1], store.highs[..., : pages - 1], None
        else:  # per row: the pages before its current page (a row with more pads has fewer)
            current = store.current_pages()
            lows, highs = store.lows[..., :pages], store.highs[..., :pages]
            competing = torch.arange(pages, device=lows.device) < current.view(-1, 1, 1)
            # unreached pages hold +-inf, and 0 x inf would be NaN in the products below
            lows, highs = lows.masked_fill(~competing[:, :, None], 0.0), highs.masked_fill(~competing[:, :, None], 0.0)
        bounds = torch.matmul(packed.clamp(min=0), highs) + torch.matmul(
            packed.clamp(max=0), lows
        )  # (B, Hkv, G, pages): per channel q * max where q >= 0, q * min where q < 0
        bounds = aggregate_group(bounds.float(), self.aggregation)
        top = top_k(bounds, min(selected_pages, bounds.shape[-1]), competing)
        chosen = torch.cat([top, current.view(-1, 1, 1).expand(-1, top.shape[1], 1)], dim=-1)
        offsets = torch.arange(self.page_size, device=chosen.device)
        aligned = (chosen.unsqueeze(-1) * self.page_size + offsets).flatten(-2) + store.pads.view(-1, 1, 1)
        if competing is None:
            return aligned, None
        kept = torch.cat(
            [competing.expand(-1, top.shape[1], -1).gather(-1, top), torch.ones_like(top[..., :1], dtype=torch.bool)],
            dim=-1,
        )
        return aligned, kept.repeat_interleave(self.page_size, dim=-1)
