"""The selection's C (selection_kernels.c) built and loaded for the CPU: the library, the C's structures, whether a
call may take the C path, and the torch.library on which each C call is an operator of its own for torch.compile.
What the C computes is called from native_selection.py (the selection), native_attention.py (one query's attention)
and native_quantized.py (a full cache held in codes).

The C file is compiled by each process, on first use, with the system's C compiler (`$CC`, else `cc`; under two seconds)
into a private temporary folder (mode 0700, made by this process) and loaded with ctypes; the folder is removed once the
library is loaded. Nothing is read from the cache folder: a library kept there, and any record vouching for it, could be
written by whoever can write that folder, so no file this process did not build ever runs. Where it cannot be (no
compiler, a failed build; a GPU tensor), the callers use the PyTorch operators, which give the same results; a missing
compiler or a failed build is said once, as a warning. Where PyTorch runs on GNU OpenMP it is built with OpenMP and each
call shares its work between `torch.get_num_threads()` of PyTorch's own threads (`_torch_openmp`): alone, a refresh's C
used one of the cores while the others waited for it. REFRESHKV_NATIVE=0 turns the C path off (to compare the two; a
compiled step reads it when it is traced). Under torch.compile the C calls are torch.library operators.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("selection_kernels.c")


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _without_c(why: str) -> None:
    message = f"refreshkv: {why}: the selection runs on PyTorch operators, slower on the CPU (same results)"
    warnings.warn(message, stacklevel=4)  # the caller of the selection that first needed the C


class BlockStrides(ctypes.Structure):
    """The C's BlockStrides: byte strides between the (batch, head) blocks of keys and of values."""

    _fields_ = [(name, ctypes.c_int64) for name in ("key_batch", "key_head", "value_batch", "value_head")]

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor) -> BlockStrides:
        size = keys.element_size()
        return cls(keys.stride(0) * size, keys.stride(1) * size, values.stride(0) * size, values.stride(1) * size)


class PagedAt(ctypes.Structure):
    """The C's PagedAt: one request's query, block table, positions, mask and output (addresses) and their counts."""

    _fields_ = [(name, ctypes.c_int64) for name in ("query", "table", "blocks", "index", "valid", "k", "tokens", "out")]


class QuantizedPart(ctypes.Structure):
    """The C's QuantizedPart: where a quantized C_f's codes, scales and minimums of keys (or values) lie."""

    _fields_ = [("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("minimums", ctypes.c_void_p)]


class QuantizedCache(ctypes.Structure):
    """The C's QuantizedCache: a quantized C_f's keys and values, its groups (held, filled), quant and bits."""

    _fields_ = [("keys", QuantizedPart), ("values", QuantizedPart)]
    _fields_ += [(name, ctypes.c_int64) for name in ("stored", "groups", "quant", "bits")]

    @classmethod
    def of(cls, key_parts, value_parts, groups: int, bits: int) -> QuantizedCache:
        """Where the (codes, scales, minimums) of keys and of values lie, `groups` of them filled."""
        stored, byte_rows = key_parts[0].shape[2], key_parts[0].shape[3]
        pointers = [QuantizedPart(*(part.data_ptr() for part in parts)) for parts in (key_parts, value_parts)]
        return cls(*pointers, stored, groups, byte_rows * 8 // bits, bits)


def _torch_openmp() -> bool:
    """PyTorch runs its threads on GNU OpenMP (libgomp), loaded in this process. A library built with `-fopenmp` then
    shares that runtime: the dynamic loader matches its need of libgomp.so.1 to the copy already loaded, so its loops
    run on PyTorch's thread pool and follow `torch.set_num_threads`. Another runtime (LLVM's libomp on macOS, Intel's)
    would bring a second pool competing for the same cores: no OpenMP then (one thread)."""
    try:
        with open("/proc/self/maps") as maps:
            return any("libgomp" in line for line in maps)
    except OSError:
        return False


def _build(compiler: str, flags: list[str], folder: Path) -> ctypes.CDLL | str:
    """The library compiled with `flags` into `folder` (this process's own) and loaded, or why not."""
    target = folder / ("selection-openmp.so" if flags else "selection.so")
    command = [compiler, "-O3", "-std=c11", "-shared", "-fPIC", *flags, str(SOURCE), "-o", str(target)]
    built = subprocess.run(command, capture_output=True, text=True)
    if built.returncode != 0:
        last_line = (built.stderr.strip().splitlines() or ["no message"])[-1]
        return f"compiling {SOURCE.name} failed ({last_line})"
    try:
        return ctypes.CDLL(str(target))
    except OSError as error:
        return f"loading the compiled {SOURCE.name} failed ({error})"


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use in a folder only this process made, with OpenMP where PyTorch's
    runtime is GNU OpenMP (else, or if that build fails, without: one thread); None where they cannot be built at
    all (said once)."""
    compiler = _compiler()
    if compiler is None:
        _without_c("no C compiler (set $CC or install cc)")
        return None
    folder = Path(tempfile.mkdtemp(prefix="refreshkv-native-"))  # mode 0700: no other user can write into it
    try:
        if _torch_openmp():
            library = _build(compiler, ["-fopenmp"], folder)
            if not isinstance(library, str):
                return _declared(library)
            warnings.warn(f"refreshkv: {library}: the selection's C runs on one thread", stacklevel=3)
        library = _build(compiler, [], folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # a loaded library stays mapped; nothing is left behind
    if isinstance(library, str):
        _without_c(library)
        return None
    return _declared(library)


def _declared(library: ctypes.CDLL) -> ctypes.CDLL:
    """The library with its functions' argument and result types."""
    pointer, size, status = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.top_k_in_order.argtypes = [pointer, pointer, size, size, size, pointer, status]
    library.spread_over_words.argtypes = [pointer, pointer, size, size, size, size, pointer, status]
    library.gather_rows.argtypes = [pointer, pointer, BlockStrides, size, pointer, size, size, size, size, size]
    library.gather_rows.argtypes += [pointer, pointer, status]
    library.refresh_partial.argtypes = [pointer, size, size, size, size, status, size, size, pointer, size, pointer]
    library.refresh_partial.argtypes += [size, pointer, pointer, BlockStrides, size, size, pointer, pointer, pointer]
    library.refresh_partial.argtypes += [pointer, ctypes.c_float, ctypes.c_float, pointer, pointer, size]
    library.refresh_partial.argtypes += [ctypes.c_float, pointer, status]
    library.put_token.argtypes = [pointer, pointer, pointer, pointer, pointer, size, size, size, size, pointer, pointer]
    library.put_token.argtypes += [BlockStrides, size, size, ctypes.c_float]
    library.put_token.restype = None
    library.quest_pages.argtypes = [pointer, pointer, pointer, size, size, size, size, size, size, status, size, size]
    library.quest_pages.argtypes += [pointer, pointer, status]
    for function in (library.top_k_in_order, library.gather_rows, library.refresh_partial, library.quest_pages):
        function.restype = status
    library.logits_rows.argtypes = [pointer, pointer, BlockStrides, size, size, size, size, size, ctypes.c_float]
    library.logits_rows.argtypes += [pointer, status, pointer, pointer, status, status]
    library.weigh_values_rows.argtypes = [pointer, pointer, BlockStrides, size, size, size, size, size, pointer]
    library.weigh_values_rows.argtypes += [pointer, status, status]
    library.logits_rows.restype, library.weigh_values_rows.restype = None, status
    paged = [pointer, pointer, BlockStrides, pointer, size, size, size, size, size]
    library.paged_logits.argtypes = [*paged, ctypes.c_float, pointer, status, status]
    library.paged_weigh_values.argtypes = [*paged, pointer, status, status]
    library.paged_logits.restype, library.paged_weigh_values.restype = None, status
    library.paged_gather.argtypes = [pointer, pointer, BlockStrides, pointer, size, pointer, size, size, size, size]
    library.paged_gather.argtypes += [pointer, size, pointer, pointer]
    library.paged_gather.restype = None
    at: list[Any] = [pointer, size]  # n requests' PagedAt
    library.paged_logits_at.argtypes = [*at, pointer, BlockStrides, size, size, size, size, size, ctypes.c_float]
    library.paged_logits_at.argtypes += [pointer, status, status]
    library.paged_weigh_at.argtypes = [*at, pointer, pointer, BlockStrides, size, size, size, size, size, status]
    library.paged_weigh_at.argtypes += [status]
    library.paged_logits_at.restype, library.paged_weigh_at.restype = status, None
    stores: list[Any] = [pointer, pointer, pointer, pointer, size, size, size, size, size]  # n requests' stores
    library.logits_stores.argtypes = stores + [ctypes.c_float, pointer, status, status]
    library.weigh_stores.argtypes = stores + [pointer, status, status]
    library.logits_stores.restype = library.weigh_stores.restype = None
    quantized = [pointer, QuantizedCache, size, size, size, size, size]
    library.quantized_logits_rows.argtypes = [*quantized, ctypes.c_float, pointer, pointer, pointer, status]
    library.quantized_weigh_rows.argtypes = [*quantized, pointer, pointer, status]
    library.quantized_logits_rows.restype, library.quantized_weigh_rows.restype = None, status
    library.dequantize_rows.argtypes = [QuantizedCache, pointer, pointer, pointer, size, size, size, size, size]
    library.dequantize_rows.argtypes += [pointer, pointer, pointer, status]
    library.dequantize_rows.restype = None
    return library


@torch.compiler.assume_constant_result
def _available() -> bool:
    """The C path is on and built. Under torch.compile it is read once, while tracing: a constant of the graph."""
    return os.environ.get("REFRESHKV_NATIVE", "1") != "0" and _library() is not None


def on_cpu(*tensors: torch.Tensor | None) -> bool:
    """Every tensor given lies on the CPU and the C path is available."""
    return all(tensor.device.type == "cpu" for tensor in tensors if tensor is not None) and _available()


def rows_whole(source: torch.Tensor) -> bool:
    """Each token's row of a (B, H, n, D) cache lies whole, one after another: the C reads (B, H) blocks apart."""
    return source.stride(3) == 1 and source.stride(2) == source.shape[3]


# The C calls. Under torch.compile each is an operator of its own (torch.library), opaque to the compiler, so that a
# compiled step calls the same C as an eager one.


def kernels() -> ctypes.CDLL:
    """The built library: the C calls run only where `_available()` found it."""
    library = _library()
    assert library is not None
    return library


# Defined on a plain torch.library.Library, not with torch.library.custom_op: a compiled step calls the operator once
# per layer, and a call through custom_op's wrappers cost 62 us more than the eager step's call of the same C, this way
# 5 us (benchmarks/experiments/operator_overhead.py: 8K tokens, 2 threads, AVX2 kernels; 1.7 ms of a compiled refresh
# step at 8K). The alias annotations (a!) in a schema name what an operator writes. Kept alive with the module: the
# operators live as long as this object.
_OPERATORS = torch.library.Library("refreshkv", "DEF")


def operator(name: str, function, schema: str, fake):
    """`function` as the operator `refreshkv::name` for torch.compile, its outputs' shapes given by `fake`."""
    _OPERATORS.define(name + schema)
    _OPERATORS.impl(name, function, "CPU")
    torch.library.register_fake(f"refreshkv::{name}", fake, lib=_OPERATORS)
    return getattr(torch.ops.refreshkv, name).default
