"""`streamingllm++` (recycled-attention.txt §3.2): StreamingLLM's window on most steps, full attention every S steps.

The baseline that matches Recycled Attention in memory and compute: the full cache is kept (memory L + T, like
`recycled`/`refreshkv`); decode step t attends to all of it when t % `stride` == 0 (steps S, 2S, ..., as in
`recycled`), and otherwise to StreamingLLM's cache: the `sinks` first tokens plus the K - sinks most recent tokens,
ending at the current one (K = the budget). Nothing is evicted, so the window simply slides over the full cache.

Choices:
- `stride` defaults to 10, the stride the seeds use for StreamingLLM++ and Recycled Attention in the language
  modelling experiments (recycled-attention.txt Table 4; refreshkv.txt Table 8 "stride as 10").
- A partial step reads two slices of the full store, the sinks and the recent window, concatenated (K tokens copied,
  the same order of work as attending to them); the rest of the cache is not touched. With left padding a row's
  sinks are its first real tokens, gathered with a (B, Hkv, sinks) index; positions that would be counted twice
  (short rows) or are padding are masked.
- With a budget K <= `sinks`, only K - 1 sinks are used so that the window holds at least the current token.
- `full_cache` (core/full_cache.py) may hold the full cache in 8/4/2 bits or off the GPU; a partial step then
  dequantizes (or copies in) only the two spans it reads.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..core.attention_math import Scaling, decode_attention
from ..core.contract import MethodLayer
from ..core.full_cache import DEFAULT_GROUP_SIZE, FullCacheStore, check_full_cache, check_group_size
from ..core.kvstore import gather_tokens
from ..core.policy import BudgetPolicy, check_positive, register
from .streamingllm import check_sinks, effective_sinks, sink_clamps

FullCacheLayer = MethodLayer[FullCacheStore]  # the layer streamingllm++ works on: its full cache, however held


@register
@dataclasses.dataclass
class StreamingLLMPlusPlus(BudgetPolicy[FullCacheStore]):
    """StreamingLLM++: the full cache; StreamingLLM's window on most steps, full attention every `stride` steps.

    Parameters: `budget`: K tokens per KV head (or `budget_ratio`: K as a share of the longest prompt, 1/8 by
    default); `sinks` (4); `stride` (10) steps between full steps; `full_cache` (dense) and
    `group_size` (32) how the full cache is held, as in refreshkv.
    """

    name = "streamingllm++"
    no_compression = "its full steps read the whole cache, which it keeps"
    summary = "full cache; StreamingLLM's sinks + recent window on most steps, full attention every `stride` steps"

    sinks: int = 4
    stride: int = 10
    full_cache: str = "dense"
    group_size: int = DEFAULT_GROUP_SIZE

    def __post_init__(self) -> None:
        super().__post_init__()
        check_sinks(self.sinks)
        check_positive("stride", self.stride)
        check_full_cache(self.full_cache, self.group_size)

    def clamps(self, length: int, budget: int) -> list[str]:
        return super().clamps(length, budget) + sink_clamps(self.sinks, budget)

    def store_prompt(self, layer: FullCacheLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> None:
        check_group_size(self.full_cache, self.group_size, key.shape[-1])
        full = layer.full_store(key, self.full_cache, self.group_size)
        full.append(key, value)
        layer.state = full

    def decode(self, layer: FullCacheLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> Tensor:
        full = layer.state
        full.append(key, value)
        length = full.length
        budget = layer.budget
        if layer.step % self.stride == 0 or (layer.pads is None and length <= budget):
            # Full step (or the whole sequence fits in the window: the same keys either way).
            keys, values = full.view()
            layer.record(1.0 if layer.step % self.stride == 0 else 0.0, full.attended_bytes())
            return decode_attention(query, keys, values, scaling, layer.valid_positions(length, key.device))
        keys, values, valid = self._window(full, layer.pads, layer.max_pad, effective_sinks(self.sinks, budget), budget)
        layer.record(0.0, full.attended_bytes() * keys.shape[2] // length)
        return decode_attention(query, keys, values, scaling, valid)

    def selection(self, layer: FullCacheLayer, query: Tensor, scaling: Scaling) -> Tensor | None:
        """The (B, Hkv, sinks + window) positions a partial step attends to (-1: a padded or twice-counted one), as
        `_window` reads them; None at a full step, or where the window holds the whole sequence."""
        full, budget = layer.state, layer.budget
        length = full.length
        if layer.step % self.stride == 0 or (layer.pads is None and length <= budget):
            return None
        sinks = effective_sinks(self.sinks, budget)
        device = query.device
        recent = torch.arange(max(0, length - (budget - sinks)), length, device=device)
        pads = torch.zeros(query.shape[0], dtype=torch.long, device=device) if layer.pads is None else layer.pads
        sink_pos = pads.view(-1, 1) + torch.arange(sinks, device=device)  # (B, s)
        sink_pos = sink_pos.masked_fill(sink_pos >= length, -1)
        recent_pos = recent.expand(pads.shape[0], -1).masked_fill(recent < pads.view(-1, 1) + sinks, -1)
        positions = torch.cat([sink_pos, recent_pos], dim=1)
        heads = full.span(0, 1)[0].shape[1]
        return positions[:, None].expand(-1, heads, -1)

    @staticmethod
    def _window(
        full: FullCacheStore, pads: Tensor | None, max_pad: int, sinks: int, budget: int
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Keys/values of the sinks followed by the recent window, and a (B, 1, 1, n) validity mask (or None)."""
        length = full.length
        start = max(0, length - (budget - sinks))
        recent_k, recent_v = full.span(start, length)
        if pads is None:
            if sinks == 0:
                return recent_k, recent_v, None
            sink_k, sink_v = full.span(0, sinks)  # length > budget here, so sinks and window do not overlap
            return torch.cat([sink_k, recent_k], dim=2), torch.cat([sink_v, recent_v], dim=2), None
        head_k, head_v = full.span(0, min(max_pad + sinks, length))  # every row's sinks lie in here
        device = recent_k.device
        sink_pos = pads.view(-1, 1) + torch.arange(sinks, device=device)  # (B, s)
        sink_valid = sink_pos < length
        index = sink_pos.clamp(max=head_k.shape[2] - 1).view(-1, 1, sinks).expand(-1, head_k.shape[1], -1)
        sink_k, sink_v = gather_tokens(index, head_k, head_v)
        keys, values = torch.cat([sink_k, recent_k], dim=2), torch.cat([sink_v, recent_v], dim=2)
        recent_valid = torch.arange(start, length, device=device) >= (pads.view(-1, 1) + sinks)  # no pads, no sinks
        valid = torch.cat([sink_valid, recent_valid], dim=1)
        return keys, values, valid.view(valid.shape[0], 1, 1, -1)
