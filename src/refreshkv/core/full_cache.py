"""Where a method that keeps the full cache C_f but reads it only at full steps holds it: `full_cache=`.

- `dense`: a `FullStore` in the model's dtype (the default).
- `int8`, `int4`, `int2`: a `QuantizedFullStore` (KIVI-style groups of `group_size`, quantized_store.py).
- `offload`: an `OffloadedFullStore` in pinned host memory, copied to the GPU at full steps; refused without a GPU.

Used by `refreshkv` and `recycled`, whose partial steps do not read C_f, and `streamingllm++`, whose partial steps
read two spans of it (the sinks and the recent window: K tokens dequantized or copied in per step).
"""

from __future__ import annotations

import torch

from .kvstore import FullStore
from .policy import PolicyError, check_positive
from .quantized_store import QUANTIZED_BITS, QuantizedFullStore

FULL_CACHES = ("dense", *QUANTIZED_BITS, "offload")
DEFAULT_GROUP_SIZE = 32  # KIVI's group size


def check_full_cache(full_cache: str, group_size: int) -> None:
    if full_cache not in FULL_CACHES:
        raise PolicyError(f"unknown full_cache '{full_cache}'; choose from: {', '.join(FULL_CACHES)}")
    check_positive("group_size", group_size)
    if full_cache == "offload" and not torch.cuda.is_available():
        choices = ", ".join(name for name in FULL_CACHES if name != "offload")
        raise PolicyError(
            f"full_cache='offload' moves C_f off a GPU, and no CUDA GPU is available; choose from: {choices}"
        )


def check_group_size(full_cache: str, group_size: int, head_dim: int) -> None:
    """A quantized C_f groups values over `group_size` channels, which must divide the head dimension."""
    if full_cache in QUANTIZED_BITS and (head_dim % group_size or group_size % (8 // QUANTIZED_BITS[full_cache])):
        divisors = [g for g in range(8, head_dim + 1, 8) if head_dim % g == 0]
        raise PolicyError(
            f"group_size {group_size} must divide the head dimension {head_dim}; "
            f"choose from: {', '.join(map(str, divisors))}"
        )


FullCacheStore = FullStore | QuantizedFullStore  # what `make_full_store` gives: the FullStore interface


def make_full_store(like: torch.Tensor, capacity: int, full_cache: str, group_size: int) -> FullCacheStore:
    if full_cache in QUANTIZED_BITS:
        return QuantizedFullStore(like, capacity, QUANTIZED_BITS[full_cache], group_size)
    if full_cache == "offload":
        return OffloadedFullStore(like, capacity)
    return FullStore(like, capacity)


class OffloadedFullStore(FullStore):
    """C_f in pinned host memory. Each decoded token is copied out as it comes (a small copy); a full step copies the
    cache in from pinned memory without blocking the host, which goes on queueing the step's kernels behind it. C_p,
    on the GPU, serves the partial steps. Run once on an H200 (benchmarks/experiments/cuda_check.py): the same logits
    as the dense store; its speed was not timed."""

    def __init__(self, like: torch.Tensor, capacity: int):
        self.device = like.device
        super().__init__(torch.empty(like.shape[0], like.shape[1], 0, like.shape[3], dtype=like.dtype), capacity)
        self._pin()

    def _pin(self) -> None:
        if torch.cuda.is_available():
            self.keys, self.values = self.keys.pin_memory(), self.values.pin_memory()

    def _grow(self, capacity: int) -> None:
        super()._grow(capacity)
        self._pin()

    def span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().span(start, end)
        return keys.to(self.device, non_blocking=True), values.to(self.device, non_blocking=True)
