"""`DecodeStats`: how often each layer of a generation attended to its whole cache, and how many bytes of keys and
values it read, kept on the device (`PolicyCache.stats`, written by `MethodLayer.record`)."""

from __future__ import annotations

import torch


class DecodeStats:
    """Full-attention counts of a generation, accumulated in tensors on the cache's device (so that a compiled step
    holds no Python state that changes from step to step); the readers below wait for the device once. Each layer
    writes only its own tensors: thirty in-place updates of one shared tensor per step made the compiler's
    analysis of the step grow exponentially with the number of layers (minutes at 8 layers)."""

    def __init__(self, num_layers: int, device: torch.device | str | None = None, steps: int = 0):
        # per layer and decode step: share of rows that attended fully
        self.full = [torch.zeros(max(steps, 1), device=device) for _ in range(num_layers)]
        # per layer: bytes of K/V read, summed over steps
        self.attended = [torch.zeros((), dtype=torch.long, device=device) for _ in range(num_layers)]

    def add(self, layer_idx: int, step: int, full_fraction: float | torch.Tensor, attended_bytes: int) -> None:
        full = self.full[layer_idx]
        if step > full.shape[0]:  # more steps than announced: double
            full = self.full[layer_idx] = torch.cat([full, torch.zeros_like(full)])
        full[step - 1] += full_fraction
        self.attended[layer_idx] += attended_bytes

    def per_layer(self) -> list[float]:
        """Steps that attended fully, per layer."""
        return torch.stack(self.full).sum(1).tolist()

    def per_step(self, steps: int, layers: list[int] | None = None) -> list[float]:
        """Layers that attended fully (of `layers`, default all), per decode step."""
        chosen = self.full if layers is None else [self.full[i] for i in layers]
        return torch.stack([full[:steps] for full in chosen]).sum(0).tolist()

    def attended_bytes(self) -> int:
        return int(sum(self.attended))
