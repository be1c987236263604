"""How each linear weight lies in memory, chosen for one-token products by measuring the device's kernels.

A decode step multiplies one token's activations by every weight matrix, so its time is mostly the time the
matrix-vector kernels take to read the weights. A linear weight (out, in) can lie row-major, as checkpoints store
it, or as the transpose of a row-major (in, out) matrix; both are the same tensor to the model (`F.linear` sees
the same values), but the kernel behind each layout differs, and which is faster depends on the CPU, the BLAS
library and the dtype. Measured on an AMD EPYC with AVX-512 (MKL, 2 threads): float32 products read the transposed
layout 1.3-1.7x faster for most of the embedded model's shapes, bfloat16 ones the stored layout 1.3-2x faster.
So `weight_layout="fastest"` times both layouts per weight shape on the model's device and re-stores a shape's
weights only where the transposed layout is clearly faster (`MARGIN`); a near tie keeps the checkpoint's layout,
so that a noisy timing rarely changes the choice between runs. "packed" (packed_linear.py, CPU only) re-stores
every linear weight in oneDNN's own layout instead, which reads faster than either at one row and at a batch.

The values do not change, but the kernels add the products in another order: float32 logits move by ~1e-4, so
greedy tokens can differ from the stored layout's on near ties. "stored" is therefore the default; the quality
figures of this repository use it. Tied weights (the embedding and the output projection) are one tensor and
move together; the embedding lookup reads the strided rows at no measurable cost.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from .inputs import check_model
from .packed_linear import pack_linear_weights

LAYOUTS = ("stored", "fastest", "packed")
MARGIN = 0.9  # the transposed layout must take at most 90% of the stored layout's time to be chosen
REPEATS = 5
SAMPLE_BYTES = 128 * 2**20  # weights timed per shape: enough to stream from memory, as a decode step does


def check_weight_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown weight layout '{layout}'; choose from: {', '.join(LAYOUTS)}")


def set_weight_layout(model, layout: str) -> dict[str, str]:
    """ "stored": leave the weights as loaded ({}); "fastest": `fastest_layout`, "packed": `pack_linear_weights`;
    the choices per shape are returned."""
    check_weight_layout(layout)
    if layout == "packed":
        return pack_linear_weights(model)
    return fastest_layout(model) if layout == "fastest" else {}


def linear_weights(model) -> dict[tuple[int, int], list[torch.Tensor]]:
    """The weights of the model's linear layers grouped by (out, in) shape (a tied weight once)."""
    groups: dict[tuple[int, int], list[torch.Tensor]] = {}
    seen = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            rows, cols = module.weight.shape
            groups.setdefault((rows, cols), []).append(module.weight)
    return groups


def transposed(weight: torch.Tensor) -> torch.Tensor:
    """The same (out, in) values, lying as a row-major (in, out) matrix."""
    return weight.detach().t().contiguous().t()


def product_seconds(weights: list[torch.Tensor]) -> float:
    """Time of one-token products with every weight in `weights`, once each."""
    x = torch.ones(1, weights[0].shape[1], dtype=weights[0].dtype, device=weights[0].device)
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    start = time.perf_counter()
    for weight in weights:
        F.linear(x, weight)
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - start


def transposed_is_faster(sample: list[torch.Tensor]) -> bool:
    """Best of `REPEATS` timings per layout, taken in turns so that a drift of the machine hits both alike."""
    copies = [transposed(weight) for weight in sample]
    stored_s = transposed_s = float("inf")
    for _ in range(REPEATS):
        stored_s = min(stored_s, product_seconds(sample))
        transposed_s = min(transposed_s, product_seconds(copies))
    return transposed_s <= MARGIN * stored_s


def fastest_layout(model) -> dict[str, str]:
    """Re-store the linear weights of each shape whose one-token product is faster transposed, in place.

    Returns the choice per shape, e.g. {"49152x576": "transposed", "192x576": "stored"}. Each shape is timed on
    the weights it has, up to `SAMPLE_BYTES` of them (the transposed copies of that sample are the only extra
    memory, besides one matrix at a time while re-storing).
    """
    check_model(model)
    chosen = {}
    with torch.no_grad():
        for (rows, cols), weights in linear_weights(model).items():
            sample, size = [], 0
            for weight in weights:
                if size >= SAMPLE_BYTES:
                    break
                sample.append(weight)
                size += weight.numel() * weight.element_size()
            faster = transposed_is_faster(sample)
            if faster:
                for weight in weights:
                    weight.data = transposed(weight)
            chosen[f"{rows}x{cols}"] = "transposed" if faster else "stored"
    return chosen
