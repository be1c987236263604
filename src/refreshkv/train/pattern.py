"""The attention pattern of continued pre-training with RefreshKV (refreshkv.txt §6 and A.1 "Continued pretraining").

A training sequence holds L + S tokens. The first L attend causally to everything before them, as a prefill does.
Each of the last S attends to what `recycled` with a stride above S (a partial cache that is never refreshed) holds
when it decodes that token: C_p chosen per layer and per KV head from the attention of the last `window` prefix
tokens, max-pooled with `kernel` and aggregated over the GQA group (the prefill selection of methods/refreshkv/,
the same functions), plus the suffix tokens decoded so far. The selection is made under no-grad from the forward's
own queries and keys; gradients flow through the selected keys and values.

Choice where the paper is ambiguous: §6 says the last S tokens attend to "the top K tokens identified as well as
local tokens", while its decoding (Fig. 2, line 7), like ours, keeps C_p at K tokens by evicting the lowest-scored
recycled token for each token appended. Training follows the decoding, so that the trained model sees exactly what
it will decode from: suffix token j (1-based) sees the K + 1 - j highest-scored prefix tokens (eviction order: lowest
score first, the earlier position first among equal scores, as C_p's argmin does) and the last min(j, K + 1) suffix
tokens. tests/test_train_pattern.py checks the logits against teacher-forced `recycled` decoding.

Cost: the prefix is one causal SDPA call over L tokens; the suffix is S queries over K gathered + S local keys. No
(L + S)^2 matrix is built beyond what SDPA computes for the prefix. The pattern assumes unpadded sequences of exactly
L + S tokens (training windows always are) and no attention dropout (the supported families train without it).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..core.attention_math import (
    AGGREGATIONS,
    attention_probs,
    pack_queries,
    prompt_attention,
    ranked,
    selection_scores,
    unpack_output,
)
from ..core.kvstore import gather_tokens
from ..core.policy import check_choice, check_kernel, check_positive


@dataclasses.dataclass(frozen=True)
class PartialPattern:
    """RefreshKV's decoding pattern for the last `suffix_length` tokens of `prefix_length + suffix_length`."""

    prefix_length: int
    suffix_length: int
    budget: int
    kernel: int = 7
    window: int = 1
    aggregation: str = "max"

    def __post_init__(self):
        for name in ("prefix_length", "suffix_length", "budget", "window"):
            check_positive(name, getattr(self, name))
        check_kernel(self.kernel)
        check_choice("aggregation", self.aggregation, AGGREGATIONS)
        if self.suffix_length >= self.prefix_length:
            raise ValueError(
                f"suffix length S ({self.suffix_length}) must be below the prefix length L ({self.prefix_length})"
            )
        if self.budget >= self.prefix_length:
            raise ValueError(f"budget K ({self.budget}) must be below the prefix length L ({self.prefix_length})")
        if self.window > self.prefix_length:
            raise ValueError(f"window ({self.window}) is larger than the prefix length L ({self.prefix_length})")

    @property
    def length(self) -> int:
        return self.prefix_length + self.suffix_length

    def attend(self, query, key, value, scaling: float) -> torch.Tensor:
        """Attention output (B, L + S, Hq, D) for query (B, Hq, L + S, D) and key/value (B, Hkv, L + S, D)."""
        if key.shape[2] != self.length:
            raise ValueError(
                f"the training pattern expects sequences of L + S = {self.length} tokens, got {key.shape[2]}"
            )
        prefix = self.prefix_length
        prefix_out = prompt_attention(query[:, :, :prefix], key[:, :, :prefix], value[:, :, :prefix], None, scaling)
        index, visible = self.selection(query, key, scaling)
        kept_keys, kept_values = gather_tokens(index, key, value)
        keys = torch.cat([kept_keys, key[:, :, prefix:]], dim=2)  # (B, Hkv, K + S, D)
        values = torch.cat([kept_values, value[:, :, prefix:]], dim=2)
        kv_heads, group = key.shape[1], query.shape[1] // key.shape[1]
        mask = visible.unsqueeze(2).expand(-1, -1, group, -1, -1).reshape(visible.shape[0], kv_heads, -1, keys.shape[2])
        suffix = F.scaled_dot_product_attention(
            pack_queries(query[:, :, prefix:], kv_heads), keys, values, attn_mask=mask, scale=scaling
        )
        return torch.cat([prefix_out, unpack_output(suffix, query.shape[1])], dim=1)

    @torch.no_grad()
    def selection(self, query, key, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(index (B, Hkv, K) of the selected prefix tokens, visible (B, Hkv, S, K + S) mask of the suffix rows)."""
        prefix, suffix, budget = self.prefix_length, self.suffix_length, self.budget
        window = query[:, :, prefix - self.window : prefix]
        probs = attention_probs(window, key[:, :, :prefix], scaling, causal_tail=True)
        scores = selection_scores(probs, self.kernel, self.aggregation)  # (B, Hkv, L)
        index = ranked(scores, budget).sort(dim=-1).values  # C_p's slots: the top K in position order
        # Eviction rank among the selected: argmin over slots takes the lowest score, then the earliest slot.
        kept = scores.gather(-1, index)
        order = torch.sort(kept, dim=-1, stable=True).indices  # ascending score; ties keep slot (position) order
        eviction_rank = torch.empty_like(order).scatter_(
            -1, order, torch.arange(budget, device=key.device).expand_as(order)
        )
        row = torch.arange(suffix, device=key.device)  # suffix token j = row + 1 has seen `row` evictions
        selected = eviction_rank.unsqueeze(2) >= row.view(1, 1, suffix, 1)  # (B, Hkv, S, K)
        local = torch.arange(suffix, device=key.device)
        band = (local <= row[:, None]) & (local >= row[:, None] - budget)  # the last min(j, K + 1) suffix tokens
        visible = torch.cat([selected, band.expand(*selected.shape[:3], suffix)], dim=-1)
        return index, visible
