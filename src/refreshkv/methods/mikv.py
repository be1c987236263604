"""`mikv` (Yang et al., 2024, "No Token Left Behind: Reliable KV Cache Compression via Importance-Aware Mixed
Precision Quantization", arXiv 2402.18096; kv-eviction-landscape.txt): what eviction would drop is kept, in few bits.

Eviction loses the evicted tokens' contribution for good (and with it, the paper shows, safety and context). MiKV
keeps the important tokens in full precision and every other token in low precision:
- importance: H2O's (K/2 heavy hitters by cumulative attention over the prompt, K/2 recent), per KV head;
- the other prompt tokens are quantized per token, asymmetric, to `low_bits` bits in groups of `group_size`
  channels, their codes packed into bytes;
- outlier-aware keys: key channels with outliers would dominate a token's range, so before quantizing, each key
  channel c is scaled by s_c = sqrt(max |Q_c| / max |K_c|) (the prompt's window queries against the prompt's keys,
  per KV head) and every query is divided by s, which leaves q.k unchanged (channel balancing);
- a decode step attends to both parts in one softmax.

Choices where the paper is silent or that differ from it:
- Decoded tokens stay in full precision (the paper also demotes tokens that lose importance while decoding; not
  built), so `compress_every` is refused.
- `low_bits` 4 and `group_size` the head dimension (one group per token): the paper reports several low precisions;
  bits are 8, 4 or 2 here, what the packed codes allow.
- The balancing queries are the last `window` (32) prompt queries.
- Per-token groups make each token's codes its own: a padded batch equals its rows.
"""

from __future__ import annotations

import dataclasses
from typing import Self

import torch
from torch import Tensor

from ..core.attention_math import AGGREGATIONS, Scaling, logits_of, pack_queries, unpack_output
from ..core.policy import PolicyError, check_choice, check_positive, check_window, register
from ..core.quantized_store import pack, quantize, unpack
from ..core.selection import SelectionLayer, SelectionPolicy, SelectionState
from .h2o import cumulative_attention, split_budget

LOW_BITS = (8, 4, 2)


@dataclasses.dataclass
class MixedState(SelectionState):
    """The important tokens in full precision (the SelectionState's store, decoded tokens appended there) and the
    others quantized per token: packed codes (B, Hkv, E, D * bits / 8), scales and minimums (B, Hkv, E, groups, 1),
    positions (B, Hkv, E) (-1: none), and each KV head's key channel balance (B, Hkv, D)."""

    bits: int = dataclasses.field(default=8, kw_only=True)
    key_codes: Tensor | None = dataclasses.field(default=None, kw_only=True)
    key_scale: Tensor | None = dataclasses.field(default=None, kw_only=True)
    key_min: Tensor | None = dataclasses.field(default=None, kw_only=True)
    value_codes: Tensor | None = dataclasses.field(default=None, kw_only=True)
    value_scale: Tensor | None = dataclasses.field(default=None, kw_only=True)
    value_min: Tensor | None = dataclasses.field(default=None, kw_only=True)
    low_positions: Tensor | None = dataclasses.field(default=None, kw_only=True)
    balance: Tensor | None = dataclasses.field(default=None, kw_only=True)

    @classmethod
    def align_groups(cls, states: list[Self]) -> None:
        """Row groups prefilled apart (engine/join_rows.py): besides the selection, each group's low-precision
        tokens are as many as its rows evicted most; the groups' are made as many as the widest's, the added entries
        empty (position -1, masked; codes and scales 0), as the batch prefilled at once holds them."""
        super().align_groups(states)
        widest = max(state.low_positions.shape[2] for state in states if state.low_positions is not None)
        for state in states:
            assert state.low_positions is not None  # set at the prompt
            extra = widest - state.low_positions.shape[2]
            if extra == 0:
                continue
            for name in ("key_codes", "key_scale", "key_min", "value_codes", "value_scale", "value_min"):
                held = getattr(state, name)
                if held is not None:
                    setattr(state, name, torch.cat([held, held.new_zeros(*held.shape[:2], extra, *held.shape[3:])], 2))
            empty = state.low_positions.new_full((*state.low_positions.shape[:2], extra), -1)
            state.low_positions = torch.cat([state.low_positions, empty], dim=2)

    def low_tensors(self) -> list[Tensor]:
        tensors = [self.key_codes, self.key_scale, self.key_min, self.value_codes, self.value_scale]
        tensors += [self.value_min, self.balance]
        return [t for t in tensors if t is not None]

    def nbytes(self) -> int:
        return super().nbytes() + sum(t.numel() * t.element_size() for t in self.low_tensors())

    def low_valid(self, pads: Tensor | None) -> Tensor:
        assert self.low_positions is not None
        return self.low_positions >= (0 if pads is None else pads.view(-1, 1, 1))

    def kept(self, pads: Tensor | None) -> Tensor:
        assert self.low_positions is not None
        low = self.low_positions.masked_fill(~self.low_valid(pads), -1)
        return torch.cat([super().kept(pads), low], dim=-1)

    def dequantized(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The low-precision tokens' (balanced) keys and values, (B, Hkv, E, D)."""
        assert self.key_codes is not None and self.value_codes is not None
        out = []
        for codes, scale, low in (
            (self.key_codes, self.key_scale, self.key_min),
            (self.value_codes, self.value_scale, self.value_min),
        ):
            assert scale is not None and low is not None
            groups = scale.shape[-2]
            dim = codes.shape[-1] * 8 // self.bits
            codes = unpack(codes, self.bits).view(*codes.shape[:3], groups, dim // groups)
            out.append((codes.to(scale.dtype) * scale + low).flatten(-2).to(dtype))
        return out[0], out[1]


def quantize_tokens(x: Tensor, bits: int, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per token, groups of `group_size` channels: (packed codes (..., D * bits / 8), scale, minimum (..., groups,
    1))."""
    grouped = x.float().view(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    codes, scale, low = quantize(grouped, bits, dim=-1)
    return pack(codes.flatten(-2), bits), scale.to(x.dtype), low.to(x.dtype)


@register
@dataclasses.dataclass
class MiKV(SelectionPolicy):
    """MiKV: H2O's important tokens in full precision, every other prompt token quantized to `low_bits`.

    Parameters: `budget`: K important tokens per KV head (or `budget_ratio`: K as a share of the longest prompt, 1/8
    by default); `low_bits` (4; 8 or 2) of the other tokens; `group_size` (None: the head dimension) channels per
    quantization group; `window` (32) last prompt queries that balance key channels; `aggregation` (max) of the
    cumulative attention over a GQA group.
    """

    name = "mikv"
    summary = "H2O's important tokens in full precision, every other prompt token kept in low precision (4 bits)"
    no_compression = "the tokens it would evict are kept in low precision, and decoded tokens stay in full precision"

    low_bits: int = 4
    group_size: int | None = None
    window: int = 32
    aggregation: str = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.compress_every is not None:
            raise PolicyError(f"method 'mikv' cannot compress during decoding: {self.no_compression}")
        if self.low_bits not in LOW_BITS or isinstance(self.low_bits, bool):
            raise PolicyError(f"low_bits must be one of 8, 4, 2, got {self.low_bits!r}")
        check_positive("group_size", self.group_size, allow_none=True)
        check_positive("window", self.window)
        check_choice("aggregation", self.aggregation, AGGREGATIONS)

    @classmethod
    def parameters(cls) -> dict[str, object]:
        params = super().parameters()
        params.pop("compress_every")  # refused with its reason (`no_compression`)
        return params

    def check_prompt(self, shortest: int) -> None:
        check_window("window", self.window, shortest)

    def score(
        self, layer: SelectionLayer, query: Tensor, key: Tensor, scaling: Scaling, valid: Tensor | None
    ) -> Tensor:
        return cumulative_attention(query, key, scaling, valid, self.aggregation)

    def score_key(self) -> str:
        return f"cumulative attention, {self.aggregation}"  # what `h2o` computes too

    def recent_kept(self, layer: SelectionLayer) -> int:
        return split_budget(layer.budget)[1]

    def store_prompt(self, layer: SelectionLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> None:
        batch, kv_heads, length, dim = key.shape
        group = self.group_size or dim
        if dim % group or (group * self.low_bits) % 8:
            raise PolicyError(f"group_size ({group}) must divide the head dimension ({dim}) into whole bytes of codes")
        valid = layer.valid_positions(length, key.device)
        index, scores = self.select(layer, query, key, scaling, valid)
        held = self.store_selection(layer, key, value, index, scores)
        # the others, real ones first in position order, then pads and the important ones (-1)
        important = torch.zeros(key.shape[:3], dtype=torch.bool, device=key.device)
        important.scatter_(-1, index.clamp(min=0), index >= 0)
        real = torch.ones_like(important) if valid is None else valid.view(batch, 1, length).expand_as(important)
        low = real & ~important
        positions = torch.arange(length, device=key.device).expand_as(low)
        order = torch.where(low, positions, length + positions).argsort(dim=-1)[..., : int(low.sum(-1).max())]
        low_positions = torch.where(low.gather(-1, order), order, -1)
        balance = self.key_balance(query[:, :, -self.window :], key, real)
        expand = order.unsqueeze(-1).expand(-1, -1, -1, dim)
        low_keys = key.gather(2, expand) * balance.unsqueeze(2).to(key.dtype)
        key_codes, key_scale, key_min = quantize_tokens(low_keys, self.low_bits, group)
        value_codes, value_scale, value_min = quantize_tokens(value.gather(2, expand), self.low_bits, group)
        layer.state = MixedState(
            held.store,
            held.scores,
            held.filled,
            held.empty,
            bits=self.low_bits,
            key_codes=key_codes,
            key_scale=key_scale,
            key_min=key_min,
            value_codes=value_codes,
            value_scale=value_scale,
            value_min=value_min,
            low_positions=low_positions,
            balance=balance,
        )

    @staticmethod
    def key_balance(window: Tensor, key: Tensor, real: Tensor) -> Tensor:
        """(B, Hkv, D) s_c = sqrt(max |Q_c| / max |K_c|): queries over the window and the group, keys over the real
        prompt tokens; 1 where a channel is zero on either side."""
        batch, kv_heads, _, dim = key.shape
        queries = window.float().abs().reshape(batch, kv_heads, -1, dim).amax(dim=2)
        keys = (key.float().abs() * real.unsqueeze(-1)).amax(dim=2)
        ratio = queries / keys.clamp(min=1e-30)
        return torch.where((queries > 0) & (keys > 0), ratio.sqrt(), torch.ones_like(ratio))

    def decode(self, layer: SelectionLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> Tensor:
        self.append(layer, key, value)
        state = layer.state
        assert isinstance(state, MixedState) and state.balance is not None
        store = state.store
        packed = pack_queries(query, key.shape[1])  # (B, Hkv, G, D)
        full_valid = state.valid(layer.pads)
        full_logits = logits_of(packed, store.keys, scaling)
        if full_valid is not None:
            full_logits = full_logits.masked_fill(~full_valid.unsqueeze(2), float("-inf"))
        low_keys, low_values = state.dequantized(store.values.dtype)
        balanced = packed / state.balance.unsqueeze(2).to(packed.dtype)  # q / s . k s = q . k
        low_logits = logits_of(balanced, low_keys, scaling)
        low_logits = low_logits.masked_fill(~state.low_valid(layer.pads).unsqueeze(2), float("-inf"))
        probs = torch.cat([full_logits, low_logits], dim=-1).softmax(dim=-1)
        slots = store.slots
        output = torch.matmul(probs[..., :slots].to(store.values.dtype), store.values)
        output = output + torch.matmul(probs[..., slots:].to(low_values.dtype), low_values)
        layer.record(0.0, state.nbytes())
        return unpack_output(output, query.shape[1])

    def runs_on_device(self, states: list) -> bool:
        return False
