"""The partial steps of one layer's served requests, attended in one call.

Each request's method takes its decode step in turn (its schedule, its query check, the new token into C_p); where
the step attends over the tokens the method holds (`MethodLayer.attend_held`), the request layer hands the query and
the held tokens here and returns an output row that `attend` fills: one C call over every request's C_p where it
lies (core/native_attention.py, `attend_stores`), in place of a small attention per request, written straight into
the engine's output rows where the held ones follow one another (the engine puts decoded tokens last). So too a step
over some of C_f's tokens where they lie in the engine's blocks (quest's pages, `PagedFullStore.attend_at`): one C
call over every such request (`attend_paged_many`), each output into its own row.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.attention_math import decode_attention
from ..core.native_attention import attend_paged_many, attend_stores, paged_fits


class HeldSteps:
    """The partial steps of a layer's decodes, whose outputs go to rows of `outputs` (rows, Hq, D)."""

    def __init__(self, outputs: Tensor):
        self.outputs = outputs
        self.row = 0  # the output row of the decode taking its step now (the caller sets it before each)
        self.rows: list[int] = []
        self.queries: list[Tensor] = []
        self.stores: list[tuple[Tensor, Tensor]] = []
        self.paged: list[tuple[Tensor, Tensor, Tensor, Tensor | None, int, Tensor]] = []
        self.blocks: tuple[Tensor, Tensor] | None = None  # the layer's paged keys and values, where `paged` reads

    def __len__(self) -> int:
        return len(self.queries) + len(self.paged)

    def add(self, query: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        """The current decode's query (1, Hq, 1, D) and held keys and values (1, Hkv, m, D): its (1, 1, Hq, D) row,
        which `attend` fills."""
        self.rows.append(self.row)
        self.queries.append(query)
        self.stores.append((keys, values))
        return self.outputs[self.row].view(1, 1, *self.outputs.shape[1:])

    def add_paged(
        self,
        query: Tensor,
        blocks: tuple[Tensor, Tensor],
        block_ids: Tensor,
        index: Tensor,
        valid: Tensor | None,
        tokens: int,
    ) -> Tensor | None:
        """The current decode's query (1, Hq, 1, D) over its tokens at `index` (Hkv, k; at or past `tokens`: none)
        of the layer's paged `blocks` (keys, values) where `valid` (Hkv, k, or None) holds, one that
        `paged_at_fits`: its (1, 1, Hq, D) row, which `attend` fills. None where the C does not read these blocks
        (`paged_fits`) or these output rows (float32, one after another), or another request added other blocks
        (one call reads one layer's cache)."""
        if self.blocks is None:
            if not (paged_fits(*blocks) and self.outputs.dtype == torch.float32 and self.outputs.is_contiguous()):
                return None
            self.blocks = blocks
        elif self.blocks[0] is not blocks[0]:
            return None
        row = self.outputs[self.row]
        self.paged.append((query, block_ids, index, valid, tokens, row))
        return row.view(1, 1, *self.outputs.shape[1:])

    def attend(self, scaling: float) -> None:
        """Every added decode's attention into its row. Over held tokens: in one C call, straight into the rows
        where they follow one another (a step where no request refreshes), else through a scratch copy. Over tokens
        in the paged blocks: in one C call, each into its row."""
        if self.paged:
            attend_paged_many(*self.blocks, self.paged, scaling)  # type: ignore[misc]
        count = len(self.queries)
        if not count:
            return
        queries = torch.cat(self.queries).squeeze(2)
        first = self.rows[0]
        in_order = self.rows[-1] - first + 1 == count and self.outputs.dtype == torch.float32
        out = self.outputs[first : first + count] if in_order else queries.new_empty(count, *self.outputs.shape[1:])
        if attend_stores(queries, self.stores, scaling, out=out) is None:
            # the stores lie where the C does not read them: each alone
            for row, (query, (keys, values)) in enumerate(zip(self.queries, self.stores)):
                out[row] = decode_attention(query, keys, values, scaling).reshape(out.shape[1:])
        if not in_order:
            self.outputs.index_copy_(0, torch.tensor(self.rows), out.to(self.outputs.dtype))
