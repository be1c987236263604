"""`PolicyCache`: a transformers `Cache` whose layers hand their work to a KV method (a `Policy`).

transformers calls `Cache.update(key, value, layer_idx)` and then the attention function with the query. Methods need
the query (to score tokens), so `PolicyLayer.update` only records the new key/value and hands the layer over to the
attention function registered in attention.py, which calls `PolicyLayer.attend`; the policy stores, selects and
attends. The same object therefore works in this library's decode loop and in `model.generate(past_key_values=...)`
for a model loaded with `attn_implementation="refreshkv"`.
"""

from __future__ import annotations

import threading

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .policy import Policy

_handoff = threading.local()
DEFAULT_NEW_TOKENS = 256


def take_handoff(key: torch.Tensor) -> PolicyLayer | None:
    """The layer whose `update` produced `key`, if any (plain attention otherwise, e.g. without a PolicyCache)."""
    layer = getattr(_handoff, "layer", None)
    _handoff.layer = None
    if layer is not None and layer.pending is key:
        return layer
    return None


class PolicyLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, cache: PolicyCache, layer_idx: int):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.seen = 0  # tokens processed, counting left padding
        self.state = None  # the policy's per-layer state, set at prefill
        self.pending = None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.layer_idx == 0 and self.seen > 0:
            self.cache.step += 1
        self.seen += key_states.shape[2]
        self.pending = key_states
        _handoff.layer = self
        return key_states, value_states

    def attend(self, module, query, key, value, mask, scaling: float) -> torch.Tensor:
        self.pending = None
        policy = self.cache.policy
        if self.state is None:
            if self.layer_idx == 0:
                self.cache.start(mask, key)
            return policy.prefill(self, query, key, value, mask, scaling)
        if query.shape[2] != 1:
            raise ValueError(f"method '{policy.name}' decodes one token per step after the prompt, got {query.shape[2]}")
        return policy.decode(self, query, key, value, scaling)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def record(self, full_fraction: float, attended_bytes: int) -> None:
        """Statistics of one decode step of this layer: share of rows that attended fully, bytes of K/V read."""
        stats = self.cache.stats
        stats.full_steps[self.layer_idx] += full_fraction
        stats.attended_bytes += attended_bytes


class DecodeStats:
    def __init__(self, num_layers: int):
        self.full_steps = [0.0] * num_layers
        self.attended_bytes = 0


class PolicyCache(Cache):
    """The KV cache of one generation under `policy`. `max_new_tokens` lets stores preallocate their final size."""

    def __init__(self, policy: Policy, config, max_new_tokens: int | None = None):
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.num_layers = text_config.num_hidden_layers
        super().__init__(layers=[PolicyLayer(self, i) for i in range(self.num_layers)])
        self.policy = policy
        self.max_new_tokens = max_new_tokens
        self.step = 0  # decode steps taken after the prompt
        self.pads: torch.Tensor | None = None  # (B,) left-pad count per row, None without padding
        self.prompt_length = 0
        self.budget = 0
        self.stats = DecodeStats(self.num_layers)

    def start(self, mask: torch.Tensor | None, key: torch.Tensor) -> None:
        """Read the prompt's padding from the prefill mask and resolve the method's budget."""
        length = key.shape[2]
        self.prompt_length = length
        if mask is not None:
            last_row = mask[:, 0, -1, :].to(torch.bool)
            pads = (~last_row).sum(-1)
            positions = torch.arange(length, device=mask.device)
            if not torch.equal(last_row, positions >= pads[:, None]):
                raise ValueError("padding must be on the left (tokenizer.padding_side = 'left')")
            if int(pads.max()) > 0:
                self.pads = pads
                self.prompt_length = length - int(pads.min())
        budget_for = getattr(self.policy, "budget_for", None)
        self.budget = budget_for(self.prompt_length) if budget_for else 0

    def expected_new_tokens(self) -> int:
        """Decoded tokens to make room for: `max_new_tokens`, or a guess when it was not given (stores grow)."""
        return self.max_new_tokens if self.max_new_tokens is not None else DEFAULT_NEW_TOKENS

    def capacity(self) -> int:
        """Slots a store needs to hold every token of this generation (grows beyond if the hint was short)."""
        return self.layers[0].seen + self.expected_new_tokens()

    def valid_positions(self, length: int, device) -> torch.Tensor | None:
        """(B, 1, 1, length) bool mask of real tokens among the first `length` positions, None without padding."""
        if self.pads is None:
            return None
        return (torch.arange(length, device=device) >= self.pads[:, None]).view(-1, 1, 1, length)

    def nbytes_per_layer(self) -> list[int]:
        return [layer.state.nbytes() if layer.state is not None else 0 for layer in self.layers]

    def full_step_fraction(self) -> float:
        return sum(self.stats.full_steps) / (self.num_layers * self.step) if self.step else 0.0

    def attended_bytes_mean(self) -> float:
        return self.stats.attended_bytes / self.step if self.step else 0.0
