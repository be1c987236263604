"""What a method's decode step reads when every per-step number lives on the device (runtime/static_decode.py), so
that the step is captured once as a CUDA graph and replayed.

A step replayed from a graph reruns the kernels captured, with the arguments they had then: a cache length, a
position or a step count written as a Python number would stay what it was at capture. So a device step reads them
from `Counters` (device tensors the step advances), every store keeps its fixed size, and attention reads which
entries count from the device (`attend`: core/triton_decode.py on a GPU, PyTorch's attention over the whole buffer
with a mask elsewhere). A method runs such steps by implementing `Policy.device_step` on a `DeviceLayer`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from . import triton_decode
from .attention_math import attend_with_probs, decode_attention
from .contract import MethodLayer, State
from .kvstore import FullStore


@dataclasses.dataclass
class Counters:
    """What a step reads and advances on the device: tokens held, counting the current one, and the step number."""

    seen: Tensor  # (1,) int64
    step: Tensor  # (1,) int64


class DeviceLayer(MethodLayer[State], Protocol[State]):
    """A `MethodLayer` whose decode step runs on fixed-size stores and device counters."""

    @property
    def counters(self) -> Counters:
        """The step's device counters (shared by every layer)."""

    @property
    def kind(self) -> str:
        """The kind of step being run or captured (`Policy.device_step_kind`), fixed per graph."""

    @property
    def conditional(self) -> bool:
        """Whether a body run only where some row needs it becomes a conditional graph node (`only_if`)."""

    def record_full_share(self, share: float | Tensor) -> None:
        """The share of rows that attended fully at this step (a number or a 0-d device tensor)."""


def attend(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    scaling: float,
    *,
    length: Tensor | None = None,
    positions: Tensor | None = None,
    rows: Tensor | None = None,
    expect: bool = True,
    keep_probs: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """One query token over a whole fixed-size store, of which the first `length` entries count or the slots whose
    `positions` are >= 0. Where the Triton kernel runs only the rows whose `rows` flag is `expect` are computed;
    elsewhere every row is (the caller keeps the ones it wants). Returns the output (B, 1, Hq, D) and, with
    `keep_probs`, the float32 probabilities (B, Hkv, G, n)."""
    if triton_decode.available(query, keys):
        return triton_decode.one_query_attention(
            query, keys, values, scaling, length, positions, rows, expect, keep_probs
        )
    if length is not None:
        valid = (torch.arange(keys.shape[2], device=keys.device) < length).view(1, 1, -1)
    else:
        assert positions is not None  # one of the two says which entries count
        valid = positions >= 0
    if keep_probs:
        return attend_with_probs(query, keys, values, scaling, valid)
    return decode_attention(query, keys, values, scaling, valid), None


def write_token(full: FullStore, key: Tensor, value: Tensor, position: Tensor) -> None:
    """The decoded token's key and value into a fixed-size store at `position` (a device index)."""
    full.keys.index_copy_(2, position, key)
    full.values.index_copy_(2, position, value)


def only_if(flag: Tensor, body: Callable[[], None], conditional: bool) -> None:
    """Run `body` where `flag` (a one-element bool tensor) holds. Eagerly the flag is read on the host; in a CUDA
    graph being captured, with `conditional`, the body becomes a conditional node that the graph skips on the device
    (torch.cuda.CUDAGraph.begin_capture_to_if_node), else it always runs, as it does under torch.compile. Skipping
    changes nothing: the body only writes the rows whose flags are set."""
    capturing = flag.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing and conditional:
        graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
        graph.begin_capture_to_if_node(flag)
        try:
            body()
        finally:
            graph.end_capture_to_conditional_node()
    elif capturing or torch.compiler.is_compiling() or bool(flag):
        body()
