"""C_f as a serving engine holds it: one request's tokens in the engine's paged blocks, read through the
`FullStore` interface that the methods read C_f by (`view`, `span`, `length`), never copied beside them.

The engine writes every token into its blocks itself (before attention runs), so `append` only counts them. A read
gathers the blocks that hold a span into one (1, Hkv, n, D) tensor: a full step of refreshkv reads all of C_f this
way, a partial step none of it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.kvstore import FullStore
from ..core.policy import PolicyError


class PagedBlocks:
    """One layer's paged KV cache: `keys` and `values` as (blocks, Hkv, block_size, D) views of the engine's tensor
    (strided as the engine lays them out)."""

    def __init__(self, keys: Tensor, values: Tensor):
        self.keys, self.values = keys, values
        self.block_size = keys.shape[2]

    def gather(self, block_ids: Tensor, start: int, end: int) -> tuple[Tensor, Tensor]:
        """Keys and values (1, Hkv, end - start, D) of positions [start, end) of a request whose block table is
        `block_ids` (its blocks in position order)."""
        size = self.block_size
        blocks = block_ids[start // size : (end - 1) // size + 1]
        offset = start % size
        spans = []
        for store in (self.keys, self.values):
            # indexing the blocks copies them alone (index_select on a strided view copied the whole cache first)
            held = store[blocks].transpose(0, 1)  # (Hkv, n, size, D)
            spans.append(held.reshape(held.shape[0], -1, held.shape[3])[None, :, offset : offset + end - start])
        return spans[0], spans[1]

    def write(self, block_ids: Tensor, start: int, keys: Tensor, values: Tensor) -> None:
        """Write keys and values (1, Hkv, n, D) at positions [start, start + n) of a request whose block table is
        `block_ids`, where they lie in the engine's layout."""
        positions = torch.arange(start, start + keys.shape[2])
        blocks, offsets = block_ids[positions // self.block_size], positions % self.block_size
        for store, written in ((self.keys, keys), (self.values, values)):
            store[blocks, :, offsets] = written[0].transpose(0, 1).to(store.dtype)


class PagedFullStore(FullStore):
    """C_f of one request and layer: its tokens in `blocks` at `block_ids` (set anew at every step: a request gains
    blocks as it grows)."""

    def __init__(self, blocks: PagedBlocks, block_ids: Tensor):
        self.blocks, self.block_ids = blocks, block_ids
        self.length = 0

    def append(self, keys: Tensor, values: Tensor) -> None:
        self.length += keys.shape[2]  # the engine wrote them into the blocks

    def span(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        return self.blocks.gather(self.block_ids, start, end)

    def crop(self, tokens: int) -> None:
        raise PolicyError("a request's tokens in vLLM's blocks are vLLM's to forget")

    def advance(self, steps: int) -> None:
        raise PolicyError("static decoding does not run inside vLLM")

    def clear_unwritten(self) -> None:
        raise PolicyError("static decoding does not run inside vLLM")

    def _token_bytes(self) -> int:
        keys = self.blocks.keys
        return 2 * keys.shape[1] * keys.shape[3] * keys.element_size()

    def nbytes(self) -> int:
        return self.length * self._token_bytes()

    def attended_bytes(self) -> int:
        return self.nbytes()

    def kept(self, pads: Tensor | None) -> Tensor:
        heads = self.blocks.keys.shape[1]
        return torch.arange(self.length, device=self.block_ids.device).expand(1, heads, self.length)
