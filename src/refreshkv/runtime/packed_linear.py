"""The `packed` weight layout: every linear weight re-stored in oneDNN's blocked layout, read by oneDNN's kernel.

A decode step multiplies a few rows of activations (one per sequence) by every weight matrix, so on a CPU its time
is mostly the time the matrix product takes to read the weights. PyTorch's default kernel for `F.linear` reads them
well below the machine's bandwidth, and more slowly as rows are added; oneDNN's inner product on a weight in its own
blocked layout reads them near the bandwidth for 1 to 16 rows. Measured on an AMD EPYC with AVX-512 (2 threads,
float32, SmolLM2's 30 layers of weights and its output projection, each product once): 30 ms stored, 22 ms
transposed (the `fastest` layout's best), 13 ms packed for one row; 52, 66 and 19 ms for 16 rows.

The packed tensor is opaque (only oneDNN reads it), so each `nn.Linear` module is replaced by a `PackedLinear` holding
the packed weight; the model's classes are untouched, as a quantizer swaps its modules. An output projection tied to
the input embedding gets a packed copy of its own, since the embedding lookup still reads the dense table: the
weights held grow by that table (SmolLM2 108 MB, Gemma 3 270M 640 MB), the weights a step reads do not.

CPU only, float32 or bfloat16 (the latter where oneDNN has bfloat16 kernels); no autograd. Under torch.compile each
product is an operator of its own (the compiler cannot hold a oneDNN tensor), found by its module's number. Values
are the same, but the products are summed in another order, so logits move by ~1e-4 and greedy tokens can differ from
the stored layout's on near ties, as with `fastest`.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from .inputs import check_model

_MODULES: dict[int, weakref.ref] = {}  # a PackedLinear by its number, for the compiled operator
_NUMBERS = itertools.count()
_OPERATORS = torch.library.Library("refreshkv", "FRAGMENT")
_OPERATORS.define("packed_linear(Tensor x, int module, int out_features) -> Tensor")


def packing_problem(device: str, dtype: torch.dtype) -> str | None:
    """Why the packed layout cannot run with these options, in one line (None: it can)."""
    if device != "cpu":
        return f"the packed weight layout is for the CPU (oneDNN), not {device}; use stored or fastest there"
    if not torch.backends.mkldnn.is_available():
        return "the packed weight layout needs PyTorch built with oneDNN (mkldnn), which this one is not"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the packed weight layout takes float32 or bfloat16 weights, not {dtype}"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "the packed weight layout in bfloat16 needs a CPU with oneDNN's bfloat16 kernels; use float32"
    return None


class PackedLinear(torch.nn.Module):
    """`nn.Linear`'s product, y = x W^T + b, with W held in oneDNN's layout."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.weight = torch.nn.Parameter(packed, requires_grad=False)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.number = next(_NUMBERS)
        _MODULES[self.number] = weakref.ref(self)
        weakref.finalize(self, _MODULES.pop, self.number, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.refreshkv.packed_linear(x, self.number, self.out_features)
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"


def _packed_product(x: torch.Tensor, module: int, out_features: int) -> torch.Tensor:
    linear = _MODULES[module]()
    assert linear is not None, "a compiled step outlived its model"
    return linear.product(x)


def _packed_product_shape(x: torch.Tensor, module: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


_OPERATORS.impl("packed_linear", _packed_product, "CPU")
torch.library.register_fake("refreshkv::packed_linear", _packed_product_shape, lib=_OPERATORS)


def pack_linear_weights(model) -> dict[str, str]:
    """Replace every `nn.Linear` of the model by a `PackedLinear`, in place; returns {"576x576": "packed", ...}
    for the shapes packed. Refuses (ValueError, one line) a model these weights cannot be packed for."""
    check_model(model)
    weight = next(model.parameters())
    problem = packing_problem(weight.device.type, weight.dtype)
    if problem is not None:
        raise ValueError(problem)
    chosen = {}
    with torch.no_grad():
        for name, module in list(model.named_modules()):
            if isinstance(module, torch.nn.Linear):
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, PackedLinear(module))
                chosen[f"{module.out_features}x{module.in_features}"] = "packed"
    return chosen
