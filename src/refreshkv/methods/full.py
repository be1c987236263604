"""`full`: vanilla attention over the whole KV cache (the reference every method is compared with).

It never drops a token, so it takes several new tokens in one step (each attends causally to the ones before it) and
can forget the last ones (`crop`), which is what transformers' assisted decoding does with drafted tokens.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor

from ..core.attention_math import Scaling, decode_attention
from ..core.contract import MethodLayer
from ..core.device_steps import DeviceLayer, attend, write_token
from ..core.kvstore import FullStore, LayerState
from ..core.policy import Policy, register

FullLayer = MethodLayer[FullStore]  # the layer of a method that keeps every token in a FullStore


@register
@dataclasses.dataclass
class Full(Policy[FullStore]):
    """Vanilla attention over every token; no parameters. The reference every method is compared with."""

    name = "full"
    no_compression = "it keeps every token by definition"
    summary = "vanilla attention over every token"

    def store_prompt(self, layer: FullLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> None:
        store = layer.full_store(key)
        assert isinstance(store, FullStore)  # a dense store: the transformers cache's or an engine's
        layer.state = store
        layer.state.append(key, value)

    def decode(self, layer: FullLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> Tensor:
        store = layer.state
        store.append(key, value)
        keys, values = store.view()
        layer.record(1.0, store.attended_bytes())
        return decode_attention(query, keys, values, scaling, layer.valid_positions(store.length, key.device))

    def selection(self, layer: FullLayer, query: Tensor, scaling: Scaling) -> Tensor | None:
        return None  # every step attends to every token

    def extend(self, layer: FullLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> Tensor:
        return self.decode(layer, query, key, value, scaling)  # several tokens attend causally, as in one decode

    def crop(self, layer: FullLayer, tokens: int) -> None:
        layer.state.crop(tokens)

    def runs_on_device(self, states: list[LayerState]) -> bool:
        return all(type(state) is FullStore for state in states)

    def device_step(
        self, layer: DeviceLayer[FullStore], query: Tensor, key: Tensor, value: Tensor, scaling: float
    ) -> Tensor:
        layer.record_full_share(1.0)
        write_token(layer.state, key, value, layer.counters.seen - 1)
        return attend(query, layer.state.keys, layer.state.values, scaling, length=layer.counters.seen)[0]
