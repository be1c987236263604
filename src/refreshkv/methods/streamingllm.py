"""`streamingllm` (Xiao et al., 2023): attention sinks + a sliding window of recent tokens, everything else evicted.

Per refreshkv.txt A.1 and recycled-attention.txt §3.2: a cache of `sinks` (4) initial tokens and the K - 4 most recent
tokens, K = the budget. The store holds exactly K slots per KV head (fewer if the whole generation fits: a short
prompt with a large budget keeps everything). Each decoded token takes the slot of the oldest non-sink token, so the
window always ends at the current token. Eviction score of a slot = its position (sinks: +inf, never evicted).

Choices:
- With a budget K <= `sinks`, only K - 1 sinks are kept so that the window holds at least the current token.
- With left padding, a row's sinks are its first real tokens (what the row would keep alone); a row with fewer real
  tokens than K keeps all of them and leaves the other slots empty (masked) until decoded tokens fill them.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..core.attention_math import Scaling
from ..core.policy import PolicyError, register
from ..core.selection import SelectionLayer, SelectionPolicy


def check_sinks(value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PolicyError(f"sinks must be an integer >= 0, got {value!r}")


def effective_sinks(sinks: int, budget: int) -> int:
    """Sinks actually kept: at most budget - 1, so the window always holds the current token."""
    return max(0, min(sinks, budget - 1))


def sink_clamps(sinks: int, budget: int) -> list[str]:
    """The warning line where the budget keeps fewer sinks than asked (`effective_sinks`), else none."""
    used = effective_sinks(sinks, budget)
    if used == sinks:
        return []
    return [f"sinks {sinks} does not fit in the budget of {budget} tokens with the current token: keeps {used} sinks"]


def sink_recent_scores(length: int, sinks: int, pads: Tensor | None, batch: int, device: torch.device) -> Tensor:
    """(B, length) float32 keep-priority of each prompt position: +inf for a row's sinks, the position for the
    others, -inf for left padding. Keeping the top K gives sinks + most recent; evicting the minimum the oldest."""
    positions = torch.arange(length, device=device)
    start = torch.zeros(batch, 1, dtype=torch.long, device=device) if pads is None else pads.view(-1, 1)
    relative = positions - start  # (B, L): position within the row's real tokens
    scores = positions.float().expand(batch, -1)
    scores = scores.masked_fill(relative < sinks, float("inf"))
    return scores.masked_fill(relative < 0, float("-inf"))


@register
@dataclasses.dataclass
class StreamingLLM(SelectionPolicy):
    """StreamingLLM: `sinks` initial tokens plus the K - sinks most recent ones; everything else evicted for good.

    Parameters: `budget`: K tokens per KV head (or `budget_ratio`: K as a share of the longest prompt, 1/8 by
    default); `sinks` (4) attention sinks kept at the start; `compress_every` (None: the window slides every step)
    N: the window grows by N tokens, then drops the oldest N at once.
    """

    name = "streamingllm"
    summary = "keep `sinks` initial tokens + the most recent K - sinks tokens; evict the rest for good"

    sinks: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_sinks(self.sinks)

    def clamps(self, length: int, budget: int) -> list[str]:
        return super().clamps(length, budget) + sink_clamps(self.sinks, budget)

    def max_slots(self, layer: SelectionLayer) -> int:
        return layer.budget

    def appended_score(self, layer: SelectionLayer) -> float:
        return float(layer.seen - 1)  # its position: the oldest non-sink token is evicted first

    def score(
        self, layer: SelectionLayer, query: Tensor, key: Tensor, scaling: Scaling, valid: Tensor | None
    ) -> Tensor:
        batch, kv_heads, length, _ = key.shape
        scores = sink_recent_scores(length, effective_sinks(self.sinks, layer.budget), layer.pads, batch, key.device)
        return scores.unsqueeze(1).expand(-1, kv_heads, -1)
