"""The partial steps of one layer's served requests, attended in one call.

Each request's method takes its decode step in turn (its schedule, its query check, the new token into C_p); where
the step attends over the tokens the method holds (`MethodLayer.attend_held`), the request layer hands the query and
the held tokens here and returns an output row that `attend` fills: one C call over every request's C_p where it
lies (core/native_attention.py, `attend_stores`), in place of a small attention per request.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.attention_math import decode_attention
from ..core.native_attention import attend_stores


class HeldSteps:
    """Up to `capacity` requests' partial steps at one layer, each query (1, Hq, 1, D)."""

    def __init__(self, capacity: int, query_heads: int, head_dim: int):
        self.outputs = torch.empty(capacity, query_heads, head_dim)
        self.queries: list[Tensor] = []
        self.stores: list[tuple[Tensor, Tensor]] = []

    def __len__(self) -> int:
        return len(self.queries)

    def add(self, query: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        """One request's query and held keys and values (1, Hkv, m, D): the (1, 1, Hq, D) row `attend` fills."""
        row = self.outputs[len(self.queries)].view(1, 1, *self.outputs.shape[1:])
        self.queries.append(query)
        self.stores.append((keys, values))
        return row

    def attend(self, scaling: float) -> Tensor:
        """Every request's attention over its held tokens into its row: the (n, Hq, D) outputs, in the order added."""
        count = len(self.queries)
        if not count:
            return self.outputs[:0]
        queries = torch.cat(self.queries).squeeze(2)
        if attend_stores(queries, self.stores, scaling, out=self.outputs[:count]) is None:
            # the stores lie where the C does not read them: each alone
            for row, (query, (keys, values)) in enumerate(zip(self.queries, self.stores)):
                self.outputs[row] = decode_attention(query, keys, values, scaling).reshape(self.outputs.shape[1:])
        return self.outputs[:count]
