"""What every method does in a sliding-window layer (Mistral v0.1, Gemma 2/3, Phi-3, Qwen2 with sliding windows).

Such a layer attends to its last W tokens only (W = the module's `sliding_window`; the newest W keys, the current
one included, as transformers' mask). The rule, the same for every method: while the generation fits in the window
(prompt + announced new tokens <= W) the window never bites and the layer runs the method like any other; otherwise
the layer keeps exactly its window, whatever the method: `SlidingWindow` below, a ring of W slots that each decoded
token overwrites at position % W. A method thus never holds more than W tokens in such a layer (its budget is capped
by the window, RefreshKV's C_f and C_p included), and `full` equals transformers' generation beyond the window.
The method's compression applies in the global layers, where the long context is. The layer's steps count as full
steps (it attends to everything it can see).
"""

from __future__ import annotations

import dataclasses

import torch

from ..core.attention_math import decode_attention
from ..core.kvstore import SlotStore
from ..core.policy import Policy


@dataclasses.dataclass
class SlidingWindow(Policy):
    name = "sliding window"
    summary = "the last `window` tokens, as the layer itself attends"

    window: int = 4096

    def store_prompt(self, layer, query, key, value, scaling):
        length = key.shape[2]
        store = SlotStore(key, min(self.window, layer.capacity()))
        start = max(0, length - store.slots)
        # position p goes to slot p % slots, so that each decoded token overwrites the oldest one
        kept = torch.arange(start, length, device=key.device).roll(start % store.slots)
        index = kept.view(1, 1, -1).expand(key.shape[0], key.shape[1], -1)
        store.load(key, value, index, index)
        layer.state = store

    def decode(self, layer, query, key, value, scaling):
        store: SlotStore = layer.state
        position = layer.seen - 1
        slot = torch.full(key.shape[:2], position % store.slots, dtype=torch.long, device=key.device)
        store.put(slot, key, value, position)
        layer.record(1.0, store.nbytes())
        return decode_attention(query, store.keys, store.values, scaling, store.valid(layer.pads))
