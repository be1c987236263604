"""One forward pass over the prompt that prefills several methods' caches.

During prefill every method (with `shares_prefill`) computes the same causal attention and differs only in what it
keeps. `SharedPrefill` is a transformers `Cache` over several `PolicyCache`s: each layer hands its query, key and
value to every method's `store_prompt`, computes the attention output once, and returns it to the model, so the
first-token logits are shared too. Afterwards each `PolicyCache` decodes on its own, exactly as if it had
prefilled alone (tests/test_shared_prefill.py checks tokens and logits for every registered method).

Memory: every member holds its own state at once (a method that keeps the full cache holds all of it), so the
peak grows with the number of methods; callers cap the group size (`generate_many(max_shared=...)`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from ..core.attention_math import Scaling, prompt_attention
from ..core.policy import PolicyError
from .cache import PolicyCache, PolicyLayer
from .handoff import hand_over


class SharedPrefillLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, layers: list[PolicyLayer]):
        super().__init__()
        self.members = layers
        self.layer_idx = layers[0].layer_idx
        self.pending: torch.Tensor | None = None

    @property
    def methods(self) -> str:
        return "methods " + ", ".join(f"'{layer.cache.policy.name}'" for layer in self.members)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        for layer in self.members:
            layer.advance(key_states)
        hand_over(self, key_states)
        return key_states, value_states

    def attend(self, module, query, key, value, mask, scaling: Scaling, sliding_window: int | None = None) -> Tensor:
        scores: dict = {}  # members whose prompt scores are the same compute them once (SelectionPolicy.score_key)
        for layer in self.members:
            layer.start_prompt(mask, key, sliding_window)
            layer.prompt_scores = scores
            layer.policy.store_prompt(layer, query, key, value, scaling)
            layer.prompt_scores = None
        return prompt_attention(query, key, value, mask, scaling)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.members[0].get_mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.members[0].get_seq_length()

    def get_max_length(self) -> int:
        return -1


class SharedPrefill(Cache):
    """Pass as the cache (`with_cache`) to one forward over the prompt; afterwards decode with each of `caches`."""

    def __init__(self, caches: list[PolicyCache]):
        for cache in caches:
            if not cache.policy.shares_prefill:
                raise PolicyError(f"method '{cache.policy.name}' computes its own prefill; run it alone")
            if cache.layers[0].seen:
                raise PolicyError("a shared prefill needs empty caches (call cache.reset() first)")
        if len({cache.num_layers for cache in caches}) != 1:
            raise PolicyError("caches of a shared prefill must belong to one model")
        self.caches = caches
        super().__init__(layers=[SharedPrefillLayer(list(layers)) for layers in zip(*(c.layers for c in caches))])
