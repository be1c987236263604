"""C_f as a serving engine holds it: one request's tokens in the engine's paged blocks, read through the
`FullStore` interface that the methods read C_f by (`view`, `span`, `length`), never copied beside them.

The engine writes every token into its blocks itself (before attention runs), so `append` only counts them. A full
step of refreshkv attends over the blocks where they lie (`attend`, in C on the CPU) and reads the tokens it selects
alone (`gather`); a partial step reads none of C_f. A `span` (the answer so far, a method without the C path) gathers
the blocks that hold it into one (1, Hkv, n, D) tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.kvstore import FullStore
from ..core.native_attention import attend_paged, attend_paged_at, gather_paged, paged_at_fits
from ..core.policy import PolicyError
from .held_steps import HeldSteps


class PagedBlocks:
    """One layer's paged KV cache: `keys` and `values` as (blocks, Hkv, block_size, D) views of the engine's tensor
    (strided as the engine lays them out)."""

    def __init__(self, keys: Tensor, values: Tensor):
        self.keys, self.values = keys, values
        self.block_size = keys.shape[2]

    def gather(self, block_ids: Tensor, start: int, end: int) -> tuple[Tensor, Tensor]:
        """Keys and values (1, Hkv, end - start, D) of positions [start, end) of a request whose block table is
        `block_ids` (its blocks in position order): in one pass of C where it can (`gather_paged`)."""
        heads, dim = self.keys.shape[1], self.keys.shape[3]
        out = (self.keys.new_empty(1, heads, end - start, dim), self.values.new_empty(1, heads, end - start, dim))
        if gather_paged(self.keys, self.values, block_ids, torch.arange(start, end).expand(heads, -1), out):
            return out
        size = self.block_size
        blocks = block_ids[start // size : (end - 1) // size + 1]
        offset = start % size
        spans = []
        for store in (self.keys, self.values):
            # indexing the blocks copies them alone (index_select on a strided view copied the whole cache first)
            held = store[blocks].transpose(0, 1)  # (Hkv, n, size, D)
            spans.append(held.reshape(held.shape[0], -1, held.shape[3])[None, :, offset : offset + end - start])
        return spans[0], spans[1]

    def tokens(self, block_ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values (Hkv, k, D) of each KV head's own positions (Hkv, k) of a request whose block table is
        `block_ids`."""
        blocks, offsets = block_ids[positions // self.block_size], positions % self.block_size
        heads = torch.arange(positions.shape[0]).unsqueeze(1)
        return self.keys[blocks, heads, offsets], self.values[blocks, heads, offsets]

    def write(self, block_ids: Tensor, start: int, keys: Tensor, values: Tensor) -> None:
        """Write keys and values (1, Hkv, n, D) at positions [start, start + n) of a request whose block table is
        `block_ids`, where they lie in the engine's layout."""
        positions = torch.arange(start, start + keys.shape[2])
        blocks, offsets = block_ids[positions // self.block_size], positions % self.block_size
        for store, written in ((self.keys, keys), (self.values, values)):
            store[blocks, :, offsets] = written[0].transpose(0, 1).to(store.dtype)


def cpu_blocks(kv_cache: Tensor) -> PagedBlocks:
    """vLLM's CPU cache of one layer, (blocks, Hkv, block_size, 2 D), as keys and values (blocks, Hkv, block_size, D):
    per block and head its keys lie channel-major (D, block_size), then its values token-major (block_size, D)."""
    size, dim = kv_cache.shape[2], kv_cache.shape[3] // 2
    # views, never copies (a layer's cache is hundreds of MB, and may lie strided in the engine's allocation): the
    # first half of each block's (block_size, 2 D) rows holds its keys, the second its values
    keys = kv_cache[:, :, : size // 2].flatten(-2).unflatten(-1, (dim, size)).transpose(2, 3)
    values = kv_cache[:, :, size // 2 :].flatten(-2).unflatten(-1, (size, dim))
    return PagedBlocks(keys, values)


class PagedFullStore(FullStore):
    """C_f of one request and layer: its tokens in `blocks` at `block_ids` (set anew at every step: a request gains
    blocks as it grows)."""

    def __init__(self, blocks: PagedBlocks, block_ids: Tensor):
        self.blocks, self.block_ids = blocks, block_ids
        self.length = 0
        self.held_steps: HeldSteps | None = None  # where this step's attention over chosen tokens goes, if anywhere

    def append(self, keys: Tensor, values: Tensor) -> None:
        self.length += keys.shape[2]  # the engine wrote them into the blocks

    def span(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        return self.blocks.gather(self.block_ids, start, end)

    def attend(
        self, query: Tensor, scaling: object, valid: Tensor | None, rows: Tensor | None = None
    ) -> tuple[Tensor, Tensor] | None:
        """A full step over the blocks where they lie (native_attention.attend_paged): one request, no mask."""
        if valid is not None:
            return None
        blocks = self.blocks
        return attend_paged(query, blocks.keys, blocks.values, self.block_ids, self.length, scaling)

    def attend_at(self, query: Tensor, scaling: object, index: Tensor, valid: Tensor | None) -> Tensor | None:
        """The chosen tokens alone, attended where they lie (native_attention.attend_paged_at): one request, or with
        `held_steps`, every such request of the layer's step in one call there (the row returned filled then)."""
        keys, values = self.blocks.keys, self.blocks.values
        index, valid = index[0], None if valid is None else valid[0]
        if self.held_steps is not None and paged_at_fits(query, index, valid, keys.shape[3], scaling):
            held = self.held_steps.add_paged(query, (keys, values), self.block_ids, index, valid, self.length)
            if held is not None:
                return held
        return attend_paged_at(query, keys, values, self.block_ids, index, valid, self.length, scaling)

    def gather(
        self, index: Tensor, out: tuple[Tensor, Tensor], rows: Tensor | None = None, held: Tensor | None = None
    ) -> bool:
        """The selected tokens alone into the first k slots of `out`: those `held` in their slots left there (in C),
        the others read from the blocks."""
        if rows is not None and not bool(rows.all()):
            return False
        blocks = self.blocks
        if gather_paged(blocks.keys, blocks.values, self.block_ids, index[0], out, None if held is None else held[0]):
            return True
        for target, read in zip(out, blocks.tokens(self.block_ids, index[0])):
            target[0, :, : index.shape[-1]] = read
        return True

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
