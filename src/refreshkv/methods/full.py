"""`full`: vanilla attention over the whole KV cache (the reference every method is compared with).

It never drops a token, so it takes several new tokens in one step (each attends causally to the ones before it) and
can forget the last ones (`crop`), which is what transformers' assisted decoding does with drafted tokens.
"""

from __future__ import annotations

import dataclasses

from ..core.attention_math import decode_attention
from ..core.kvstore import FullStore
from ..core.policy import Policy, register


@register
@dataclasses.dataclass
class Full(Policy):
    """Vanilla attention over every token; no parameters. The reference every method is compared with."""

    name = "full"
    summary = "vanilla attention over every token"

    def store_prompt(self, layer, query, key, value, scaling):
        layer.state = FullStore(key, layer.capacity())
        layer.state.append(key, value)

    def decode(self, layer, query, key, value, scaling):
        store: FullStore = layer.state
        store.append(key, value)
        keys, values = store.view()
        layer.record(1.0, store.attended_bytes())
        return decode_attention(query, keys, values, scaling, layer.valid_positions(store.length, key.device))

    def selection(self, layer, query, scaling):
        return None  # every step attends to every token

    def extend(self, layer, query, key, value, scaling):
        return self.decode(layer, query, key, value, scaling)  # several tokens attend causally, as in one decode

    def crop(self, layer, tokens):
        layer.state.crop(tokens)
