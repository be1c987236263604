"""Key/value storage that every method builds on: preallocated, written in place, stored at KV-head size.

- `FullStore`: the whole sequence, appended one token at a time into a buffer that grows by doubling (a method that
  knows the final length preallocates it exactly), so a decode step never copies the whole cache.
- `SlotStore`: a fixed number of slots per KV head holding a per-head selection of tokens, with each slot's absolute
  position (-1 = empty). Methods overwrite slots in place (scatter) instead of concatenating.

Positions are indices into the (left-padded) input; a slot is valid when its position is >= the row's pad count.

`LayerState` is the base of every per-layer state (a store is one too): it says what it holds (`nbytes`), which
positions it keeps (`kept`), follows beam search (`select_rows`) and joins row groups (engine/join_rows.py), so the
cache never has to look inside it.
"""

from __future__ import annotations

from typing import Self

import torch

from . import native_selection


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def every_position(length: int, like: torch.Tensor, pads: torch.Tensor | None) -> torch.Tensor:
    """(B, H, length) positions 0..length-1 of a store that keeps every token, -1 at left padding."""
    positions = torch.arange(length, device=like.device).expand(*like.shape[:2], -1)
    return positions if pads is None else positions.masked_fill(positions < pads.view(-1, 1, 1), -1)


def gather_tokens(index: torch.Tensor, *tensors: torch.Tensor, out=None) -> list[torch.Tensor]:
    """Each tensor (B, H, n, D) at per-head token indices (B, H, k): (B, H, k, D) each.

    One index_select of whole rows over a flat (rows, D) view of the storage a tensor lies in, which also covers a
    store's filled prefix without copying it: each token is one contiguous copy, 3-5x faster on CPU than `gather`
    with an index expanded over D (a refresh gathers K keys and values per layer). Tensors that lie alike (a
    store's keys and values) share one flat index.
    `out`: one contiguous (B, H, k, D) tensor per input to write into instead of new ones (where the shape and
    dtype match): a fresh tensor of this size is new memory that the CPU first has to fault in, which doubled the
    gather's time on an AVX2 EPYC (0.8 MB per layer; docs/benchmark.md).
    """
    batch, heads, length, dim = tensors[0].shape
    gathered, rows = [], {}
    for number, tensor in enumerate(tensors):
        if tensor.stride(3) != 1 or tensor.stride(2) != dim or tensor.stride(1) % dim or tensor.stride(0) % dim:
            tensor = tensor.contiguous()
        per_batch, per_head = tensor.stride(0) // dim, tensor.stride(1) // dim  # in rows of D
        if (per_batch, per_head) not in rows:
            offsets = torch.arange(heads, device=index.device).mul_(per_head).view(1, heads, 1)
            if batch > 1:  # (one row is the common case: two operations fewer per refreshed layer)
                offsets = offsets + torch.arange(batch, device=index.device).mul_(per_batch).view(-1, 1, 1)
            rows[per_batch, per_head] = (index + offsets).reshape(-1)
        flat = tensor.as_strided(((batch - 1) * per_batch + (heads - 1) * per_head + length, dim), (dim, 1))
        shape = (batch, heads, index.shape[-1], dim)
        target = None if out is None else out[number]
        if target is not None and target.shape == shape and target.dtype == tensor.dtype and target.is_contiguous():
            gathered.append(
                torch.index_select(flat, 0, rows[per_batch, per_head], out=target.view(-1, dim)).view(shape)
            )
        else:
            gathered.append(flat.index_select(0, rows[per_batch, per_head]).view(shape))
    return gathered


_SAME_WIDTH_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of the same width. Moving values this way is exact and, for scatter_ on the
    CPU, much cheaper in bfloat16: scatter_ of a bfloat16 tensor copies all of it (to float and back), 8x the time of
    the integer scatter into a 1K-slot store."""
    return tensor.view(_SAME_WIDTH_INTEGER[tensor.element_size()])


class LayerState:
    """What a method keeps for one layer. The rule that makes `select_rows` generic: every tensor attribute is
    batch-first (one entry per row), and every other attribute is shared by all rows or is itself a LayerState."""

    def nbytes(self) -> int:
        """Bytes of keys and values held."""
        raise NotImplementedError

    def kept(self, pads: torch.Tensor | None) -> torch.Tensor:
        """(B, Hkv, n) positions of the real tokens held per KV head; -1 for an empty slot or left padding."""
        raise NotImplementedError

    def nbytes_by_device(self) -> dict[str, int]:
        """`nbytes` per device ("cpu", "cuda:0"): one device, unless a state holds parts on several (offloading)."""
        return {str(self.kept(None).device): self.nbytes()}

    @classmethod
    def align_groups(cls, states: list[Self]) -> None:
        """Make one layer's states of a batch prefilled in row groups (engine/join_rows.py) agree on the shared
        attributes a state reads from its rows (a count over them, the widest row) as the batch prefilled at once
        would hold them; by default a state has none."""

    def advance(self, steps: int) -> None:
        """Catch the host's counters up with `steps` tokens that device steps (core/device_steps.py) wrote."""
        raise NotImplementedError(f"{type(self).__name__} is not written by device steps")

    def clear_unwritten(self) -> None:
        """Zero what a fixed-size store holds past its tokens, before device steps attend over the whole of it (a
        masked entry weighs 0, and 0 x NaN is NaN); by default a state has no such entries."""

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows `index` (B',) of the batch, in that order (beam search reorders and repeats rows)."""
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.index_select(0, index.to(value.device)))
            elif isinstance(value, LayerState):
                value.select_rows(index)


class FullStore(LayerState):
    def __init__(self, like: torch.Tensor, capacity: int):
        batch, heads, _, head_dim = like.shape
        self.keys = like.new_empty(batch, heads, capacity, head_dim)
        self.values = like.new_empty(batch, heads, capacity, head_dim)
        self.length = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        n = keys.shape[2]
        if self.length + n > self.keys.shape[2]:
            self._grow(max(2 * self.keys.shape[2], self.length + n))
        self.keys[:, :, self.length : self.length + n] = keys
        self.values[:, :, self.length : self.length + n] = values
        self.length += n

    def _grow(self, capacity: int) -> None:
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], capacity, old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.span(0, self.length)

    def attend(
        self, query: torch.Tensor, scaling: object, valid: torch.Tensor | None, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`attention_math.attend_with_probs` of one query token over every token held, computed where the store
        holds them, by a store that holds them otherwise (codes, a serving engine's blocks), for the batch elements
        marked in `rows` ((B,) bool; None: all). None here, and where that store cannot: attend over `view()`."""
        return None

    def gather(
        self,
        index: torch.Tensor,
        out: tuple[torch.Tensor, torch.Tensor],
        rows: torch.Tensor | None = None,
        held: torch.Tensor | None = None,
    ) -> bool:
        """The keys and values of the tokens at `index` (B, H, k) into the first k slots of `out` (B, H, slots, D),
        read where a store that holds them otherwise holds them (only the elements marked in `rows`). `held` (B, H,
        m), where given: the positions of the tokens that `out`'s first m slots hold now, which a store may copy from
        there instead of reading them again. False here, and where that store cannot, with nothing written: gather
        from `view()`."""
        return False

    def attend_at(
        self, query: torch.Tensor, scaling: object, index: torch.Tensor, valid: torch.Tensor | None
    ) -> torch.Tensor | None:
        """`attention_math.decode_attention` of one query token over the tokens at `index` (B, H, k; ascending per
        head; positions at or past `length` are none, and skipped) where `valid` (B, H, k bool, or None) holds,
        computed where a store that holds them otherwise holds them (a serving engine's blocks). None here, and where
        that store cannot: gather them first."""
        return None

    def span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [start, end), ready to attend to."""
        return self.keys[:, :, start:end], self.values[:, :, start:end]

    def crop(self, tokens: int) -> None:
        """Forget the last `tokens` tokens (assisted decoding rejects drafted tokens)."""
        self.length -= tokens

    def advance(self, steps: int) -> None:
        self.length += steps

    def clear_unwritten(self) -> None:
        self.keys[:, :, self.length :].zero_()
        self.values[:, :, self.length :].zero_()

    def nbytes(self) -> int:
        return _bytes(self.keys, self.values)

    def attended_bytes(self) -> int:
        return self.nbytes() * self.length // self.keys.shape[2]

    def kept(self, pads: torch.Tensor | None) -> torch.Tensor:
        return every_position(self.length, self.keys, pads)


class SlotStore(LayerState):
    def __init__(self, like: torch.Tensor, slots: int):
        batch, heads, _, head_dim = like.shape
        self.keys = like.new_zeros(batch, heads, slots, head_dim)
        self.values = like.new_zeros(batch, heads, slots, head_dim)
        self.positions = torch.full((batch, heads, slots), -1, dtype=torch.long, device=like.device)

    @property
    def slots(self) -> int:
        return self.keys.shape[2]

    def load(self, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor, positions: torch.Tensor) -> None:
        """Fill the first index.shape[-1] slots with keys/values gathered at `index` (B, H, n); empty the rest.

        Every slot is gathered in place (the slots past n repeat the last index and are marked empty), without
        gathering rows first and copying them into the slots: a refresh on an AVX2 CPU spent 4.7 ms of a 154 ms
        step at 8K on that copy (docs/benchmark.md). The gathered keys and values must not lie in this store."""
        pad = self.slots - index.shape[-1]
        # On the CPU one copy per row, the padding slots included (core/native_selection.py); else PyTorch's gather.
        if not native_selection.gather_rows_into(index, keys, values, self.keys, self.values):
            self.keys, self.values = gather_tokens(
                torch.cat([index, index[..., -1:].expand(*index.shape[:-1], pad)], -1),
                keys,
                values,
                out=(self.keys, self.values),
            )
        self.hold(positions)

    def hold(self, positions: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """The first positions.shape[-1] slots hold the tokens at `positions` (their keys and values written there);
        the rest are empty. Only in the batch elements marked in `rows` ((B,) bool) if given."""
        kept = positions.shape[-1]
        if rows is None:
            self.positions[..., :kept] = positions
            self.positions[..., kept:] = -1
            return
        marked = rows.view(-1, 1, 1)
        self.positions[..., :kept] = torch.where(marked, positions, self.positions[..., :kept])
        self.positions[..., kept:].masked_fill_(marked, -1)

    def grow(self, extra: int) -> None:
        """Add `extra` empty slots (a store sized for fewer decoded tokens than are coming)."""
        for name in ("keys", "values"):
            old = getattr(self, name)
            setattr(self, name, torch.cat([old, old.new_zeros(*old.shape[:2], extra, old.shape[3])], dim=2))
        self.positions = torch.cat([self.positions, self.positions.new_full((*self.positions.shape[:2], extra), -1)], 2)

    def put(self, slot: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: int | torch.Tensor) -> None:
        """Write one token (keys/values of shape (B, H, 1, D)) into the per-head slots `slot` (B, H); `position` an
        int or a one-element tensor (a step replayed from a CUDA graph reads it from the device)."""
        index = slot.unsqueeze(-1)
        if torch.compiler.is_compiling():  # inductor writes an index_put in place; a scatter_ copied the whole store
            rows = torch.arange(slot.shape[0], device=slot.device)[:, None]
            heads = torch.arange(slot.shape[1], device=slot.device)[None, :]
            for store, token in ((self.keys, keys), (self.values, values)):
                store.index_put_((rows, heads, slot), token[:, :, 0])
        else:
            for store, token in ((self.keys, keys), (self.values, values)):
                as_bits(store).scatter_(2, index.unsqueeze(-1).expand_as(token), as_bits(token))
        # a tensor either way: torch.compile takes it
        held = position.expand_as(index) if isinstance(position, torch.Tensor) else torch.full_like(index, position)
        self.positions.scatter_(2, index, held)

    def put_at(self, slot: int, keys: torch.Tensor, values: torch.Tensor, position: int) -> None:
        """Write one token (B, H, 1, D) into slot `slot` of every row and head (a plain copy, no scatter)."""
        self.keys[:, :, slot : slot + 1] = keys
        self.values[:, :, slot : slot + 1] = values
        self.positions[:, :, slot] = position

    def valid(self, pads: torch.Tensor | None) -> torch.Tensor:
        """(B, H, slots) bool: the slot holds a real token (not empty, not left padding)."""
        return self.positions >= (0 if pads is None else pads.view(-1, 1, 1))

    def nbytes(self) -> int:
        return _bytes(self.keys, self.values)

    def kept(self, pads: torch.Tensor | None) -> torch.Tensor:
        return self.positions.masked_fill(~self.valid(pads), -1)
