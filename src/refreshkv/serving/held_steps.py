"""The partial steps of one layer's served requests, attended in one call.

Each request's method takes its decode step in turn (its schedule, its query check, the new token into C_p); where
the step attends over the tokens the method holds (`MethodLayer.attend_held`), the request layer hands the query and
the held tokens here and returns an output row that `attend` fills: one C call over every request's C_p where it
lies (core/native_attention.py, `attend_stores`), in place of a small attention per request, written straight into
the engine's output rows where the held ones follow one another (the engine puts decoded tokens last).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.attention_math import decode_attention
from ..core.native_attention import attend_stores


class HeldSteps:
    """The partial steps of a layer's decodes, whose outputs go to rows of `outputs` (rows, Hq, D)."""

    def __init__(self, outputs: Tensor):
        self.outputs = outputs
        self.row = 0  # the output row of the decode taking its step now (the caller sets it before each)
        self.rows: list[int] = []
        self.queries: list[Tensor] = []
        self.stores: list[tuple[Tensor, Tensor]] = []

    def __len__(self) -> int:
        return len(self.queries)

    def add(self, query: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        """The current decode's query (1, Hq, 1, D) and held keys and values (1, Hkv, m, D): its (1, 1, Hq, D) row,
        which `attend` fills."""
        self.rows.append(self.row)
        self.queries.append(query)
        self.stores.append((keys, values))
        return self.outputs[self.row].view(1, 1, *self.outputs.shape[1:])

    def attend(self, scaling: float) -> None:
        """Every added decode's attention over its held tokens into its row: in one C call, straight into the rows
        where they follow one another (a step where no request refreshes), else through a scratch copy."""
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
