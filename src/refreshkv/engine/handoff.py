"""The handoff from a cache layer's `update` to the attention function that transformers calls next.

transformers calls `Cache.update(key, value, layer_idx)` and then the attention function with the query, which a
method needs. So the layer's `update` hands itself over (`hand_over`, per thread), and the attention function
registered as "refreshkv" (attention.py) takes it (`take_handoff`) and calls its `attend`. A handoff that is never
taken (a model whose attention bypasses the registered function) is an error at the next layer
(`check_handoff_taken`), never a silent wrong answer.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch

from ..core.attention_math import Scaling

ATTENTION_NAME = "refreshkv"
_handoff = threading.local()


class AttendingLayer(Protocol):
    """A cache layer that computes its attention itself (`PolicyLayer`; a shared prefill's `SharedPrefillLayer`)."""

    layer_idx: int
    pending: torch.Tensor | None  # the keys its `update` returned, until the attention function takes the layer

    @property
    def methods(self) -> str:
        """The method(s) the layer runs, as an error message names them."""

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: Scaling,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """The attention output (B, q, Hq, D) of this layer's query."""


def hand_over(layer: AttendingLayer, key: torch.Tensor) -> None:
    """Make `layer` the one the next attention call works for."""
    check_handoff_taken()
    layer.pending = key
    _handoff.layer = layer


def take_handoff(key: torch.Tensor) -> AttendingLayer | None:
    """The layer whose `update` produced `key`, if any (plain attention otherwise, e.g. without a PolicyCache)."""
    layer: AttendingLayer | None = getattr(_handoff, "layer", None)
    _handoff.layer = None
    if layer is not None and layer.pending is not key:
        raise RuntimeError(
            f"layer {layer.layer_idx}'s attention received other keys than its cache update returned; "
            f"{layer.methods} cannot run on this model's attention"
        )
    if layer is not None:
        layer.pending = None
    return layer


def check_handoff_taken() -> None:
    missed: AttendingLayer | None = getattr(_handoff, "layer", None)
    if missed is not None:
        _handoff.layer = None
        raise RuntimeError(
            f"layer {missed.layer_idx}'s attention did not go through the '{ATTENTION_NAME}' attention function, so "
            f"{missed.methods} never ran; the model's attention modules must call transformers' attention interface"
        )
