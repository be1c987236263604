"""A full cache C_f held in few bits (KIVI-style), for methods that read it only at full steps and refreshes.

Quantization is per group, asymmetric, to `bits` in {8, 4, 2}: a group's minimum m and scale s = (max - m) /
(2^bits - 1) give q = round((x - m) / s), read back as q * s + m, so no element moves by more than s / 2
(tests/test_quantized_store.py checks the bound). As KIVI does, keys are grouped per channel over `group_size`
consecutive tokens (key outliers live in channels) and values per token over `group_size` consecutive channels.
The newest tokens wait in full precision until `group_size` of them fill a key group (the residual), so a token is
quantized once, whole groups at a time. Codes are packed 8 / bits to a byte (`pack`).

What is counted (`nbytes`): the packed codes, the scales and minimums (in the model's dtype) and the residual; the
buffers grow by doubling like `FullStore`'s. `view` dequantizes everything held. A full step of refreshkv reads the
codes where they lie instead (`attend`, on the CPU) and dequantizes only the K tokens it selects (`gather`): at 8K with
43 rows, dequantizing first had made each full step take 50 times a partial one (docs/benchmark.md).
"""

from __future__ import annotations

import torch

from .kvstore import LayerState, _bytes, every_position
from .native_quantized import CodedCache, attend_quantized_rows, dequantize_rows

QUANTIZED_BITS = {"int8": 8, "int4": 4, "int2": 2}


def quantize(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 in [0, 2^bits - 1], scale, minimum) of x, one group along `dim`."""
    low = x.amin(dim=dim, keepdim=True)
    scale = (x.amax(dim=dim, keepdim=True) - low) / (2**bits - 1)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: any scale reads it back
    codes = ((x - low) / scale).round_().clamp_(0, 2**bits - 1).to(torch.uint8)
    return codes, scale, low


def pack(codes: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """8 / bits codes per byte along `dim` (size n): byte i holds codes i, i + n/p, i + 2n/p, ... (p = 8 / bits), so
    that unpacking writes p contiguous blocks with one scalar shift each."""
    blocks = codes.chunk(8 // bits, dim=dim)
    packed = blocks[0].clone()
    for j, block in enumerate(blocks[1:], start=1):
        packed |= block << (bits * j)
    return packed


def unpack_into(packed: torch.Tensor, bits: int, out: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Write the codes of `packed` into `out` (any dtype; 8 / bits times packed's size along `dim`)."""
    per_byte = 8 // bits
    for j, block in enumerate(out.chunk(per_byte, dim=dim)):
        codes = packed >> (bits * j) if j else packed
        block.copy_(codes & (2**bits - 1) if j < per_byte - 1 else codes)
    return out


def unpack(packed: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    shape = list(packed.shape)
    shape[dim] *= 8 // bits
    return unpack_into(packed, bits, packed.new_empty(shape), dim)


class QuantizedFullStore(LayerState):
    """C_f in `bits` bits: the FullStore interface that refreshkv / recycled use (append, view, length, bytes)."""

    BUFFERS = (
        "key_codes",
        "key_scale",
        "key_min",
        "value_codes",
        "value_scale",
        "value_min",
        "residual_keys",
        "residual_values",
    )

    def __init__(self, like: torch.Tensor, capacity: int, bits: int, group_size: int):
        batch, heads, _, dim = like.shape
        self.bits, self.group = bits, group_size
        groups = max(1, -(-capacity // group_size))
        # codes of both: (groups, group_size * bits / 8 bytes, D), packed along the tokens of a group
        self.key_codes = like.new_empty(batch, heads, groups, group_size * bits // 8, dim, dtype=torch.uint8)
        self.key_scale = like.new_empty(batch, heads, groups, 1, dim)
        self.key_min = like.new_empty(batch, heads, groups, 1, dim)
        tokens = groups * group_size
        self.value_codes = torch.empty_like(self.key_codes)
        self.value_scale = like.new_empty(batch, heads, tokens, dim // group_size, 1)
        self.value_min = like.new_empty(batch, heads, tokens, dim // group_size, 1)
        self.residual_keys = like.new_empty(batch, heads, group_size, dim)
        self.residual_values = like.new_empty(batch, heads, group_size, dim)
        self.groups = 0  # quantized groups held
        self.pending = 0  # tokens in the residual
        self.length = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        done = 0
        while done < keys.shape[2]:
            if self.pending == 0 and keys.shape[2] - done >= self.group:  # whole groups straight from the input
                whole = (keys.shape[2] - done) // self.group * self.group
                self._quantize(keys[:, :, done : done + whole], values[:, :, done : done + whole])
                done += whole
                continue
            take = min(self.group - self.pending, keys.shape[2] - done)
            self.residual_keys[:, :, self.pending : self.pending + take] = keys[:, :, done : done + take]
            self.residual_values[:, :, self.pending : self.pending + take] = values[:, :, done : done + take]
            self.pending += take
            done += take
            if self.pending == self.group:
                self._quantize(self.residual_keys, self.residual_values)
                self.pending = 0
        self.length += keys.shape[2]

    def _quantize(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize n = a multiple of group_size tokens into the next groups."""
        batch, heads, n, dim = keys.shape
        count = n // self.group
        if self.groups + count > self.key_codes.shape[2]:
            self._grow(max(2 * self.key_codes.shape[2], self.groups + count))
        first, last = self.groups, self.groups + count
        codes, scale, low = quantize(keys.reshape(batch, heads, count, self.group, dim), self.bits, dim=3)
        self.key_codes[:, :, first:last] = pack(codes, self.bits, dim=3)
        self.key_scale[:, :, first:last], self.key_min[:, :, first:last] = scale, low
        tokens = slice(first * self.group, last * self.group)
        codes, scale, low = quantize(values.reshape(batch, heads, n, dim // self.group, self.group), self.bits, dim=4)
        self.value_codes[:, :, first:last] = pack(codes.view(batch, heads, count, self.group, dim), self.bits, dim=3)
        self.value_scale[:, :, tokens], self.value_min[:, :, tokens] = scale, low
        self.groups = last

    def _grow(self, groups: int) -> None:
        for name in ("key_codes", "key_scale", "key_min", "value_codes"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], groups, *old.shape[3:])
            new[:, :, : self.groups] = old[:, :, : self.groups]
            setattr(self, name, new)
        for name in ("value_scale", "value_min"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], groups * self.group, *old.shape[3:])
            new[:, :, : self.groups * self.group] = old[:, :, : self.groups * self.group]
            setattr(self, name, new)

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All tokens, dequantized, followed by the residual: (B, H, length, D) keys and values."""
        return self.span(0, self.length)

    def span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [start, end): the quantized groups they touch, dequantized in place into one new tensor each,
        followed by the residual's part (no concatenation, no temporary of the tensor's size)."""
        batch, heads, _, dim = self.residual_keys.shape
        group, quantized = self.group, self.groups * self.group
        first, last = start // group, min(-(-end // group), self.groups)
        whole = max(last - first, 0) * group  # positions of the whole groups touched
        begin = first * group if whole else start  # position of the new tensors' first entry
        keys = self.residual_keys.new_empty(batch, heads, max(end, begin + whole) - begin, dim)
        values = torch.empty_like(keys)
        if whole:
            self._dequantize(first, last, keys[:, :, :whole], values[:, :, :whole])
        if end > quantized:
            residual = max(start, quantized)
            keys[:, :, residual - begin : end - begin] = self.residual_keys[
                :, :, residual - quantized : end - quantized
            ]
            values[:, :, residual - begin : end - begin] = self.residual_values[
                :, :, residual - quantized : end - quantized
            ]
        return keys[:, :, start - begin : end - begin], values[:, :, start - begin : end - begin]

    def _dequantize(self, first: int, last: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Groups [first, last) into keys and values (B, H, n, D): codes written as floats, then scaled in place
        (separate multiply and add: faster than one addcmul when the scale broadcasts along the last dimension)."""
        batch, heads, n, dim = keys.shape
        keys = unpack_into(self.key_codes[:, :, first:last], self.bits, keys.view(batch, heads, -1, self.group, dim), 3)
        keys.mul_(self.key_scale[:, :, first:last]).add_(self.key_min[:, :, first:last])
        tokens = slice(first * self.group, last * self.group)
        unpack_into(self.value_codes[:, :, first:last], self.bits, values.view(batch, heads, -1, self.group, dim), 3)
        values = values.view(batch, heads, n, dim // self.group, self.group)
        values.mul_(self.value_scale[:, :, tokens]).add_(self.value_min[:, :, tokens])

    def attend(
        self, query: torch.Tensor, scaling: object, valid: torch.Tensor | None, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`attention_math.attend_with_probs` of one query token over every token held, for the batch elements marked
        in `rows` ((B,) bool; all by default; the others' results hold nothing meaningful), computed from the codes
        (native_quantized.attend_quantized_rows). None where the C cannot: then attend over `view()`."""
        marked = torch.ones(query.shape[0], dtype=torch.bool) if rows is None else rows
        tail = (self.residual_keys[:, :, : self.pending], self.residual_values[:, :, : self.pending])
        return attend_quantized_rows(query, self._codes(), scaling, valid, marked.to(query.device), tail)

    def gather(
        self,
        index: torch.Tensor,
        out: tuple[torch.Tensor, torch.Tensor],
        rows: torch.Tensor | None = None,
        held: torch.Tensor | None = None,
    ) -> bool:
        """The keys and values of the tokens at `index` (B, H, k) into the first k slots of `out` (B, H, slots, D),
        read back exactly as `view()` reads them, in one pass of C; only the batch elements marked in `rows` ((B,)
        bool) if given (`held` unused: the codes are read whole rows at a time). False, with nothing written, where
        the C cannot (then gather from `view()`)."""
        residual = (self.residual_keys, self.residual_values)
        return dequantize_rows(index, self._codes(), residual, out, rows)

    def attend_at(
        self, query: torch.Tensor, scaling: object, index: torch.Tensor, valid: torch.Tensor | None
    ) -> torch.Tensor | None:
        return None  # no C over the codes at chosen tokens: gather them (`gather`), then attend

    def _codes(self) -> CodedCache:
        """The codes, scales and minimums held, as the C reads them."""
        keys = (self.key_codes, self.key_scale, self.key_min)
        values = (self.value_codes, self.value_scale, self.value_min)
        return CodedCache(keys, values, self.groups, self.bits)

    def _held(self) -> list[torch.Tensor]:
        tokens = self.groups * self.group
        return [
            self.key_codes[:, :, : self.groups],
            self.key_scale[:, :, : self.groups],
            self.key_min[:, :, : self.groups],
            self.value_codes[:, :, : self.groups],
            self.value_scale[:, :, :tokens],
            self.value_min[:, :, :tokens],
            self.residual_keys,
            self.residual_values,
        ]

    def nbytes(self) -> int:
        """Bytes of every buffer held (codes, scales, minimums, residual), including room not yet filled."""
        return _bytes(*(getattr(self, name) for name in self.BUFFERS))

    def attended_bytes(self) -> int:
        """Bytes a full step reads: the filled groups and the residual."""
        return _bytes(*self._held())

    def kept(self, pads: torch.Tensor | None) -> torch.Tensor:
        return every_position(self.length, self.residual_keys, pads)
