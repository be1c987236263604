"""The selection's loops compiled from C (selection_kernels.c) for the CPU: the top K in position order, the spread
of scores over words and the gather of the selected keys and values into a store, each one pass instead of three to
eight PyTorch operators; and a partial cache's whole refresh (`refresh_partial`: scores from the attention, top K,
store filled) in one call instead of about twenty.

Why: a refresh step on an AVX2 CPU cost 1.2-1.27x `full`'s step (issue 33, target 1.15x); what it adds is the
selection, a dozen small operators per layer whose dispatch and passes over memory cost more than their arithmetic.
The results are the PyTorch reference's exactly (core/attention_math.py; tests/test_native_selection.py).

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
    for function in (library.top_k_in_order, library.gather_rows, library.refresh_partial):
        function.restype = status
    library.logits_rows.argtypes = [pointer, pointer, BlockStrides, size, size, size, size, size, ctypes.c_float]
    library.logits_rows.argtypes += [pointer, status, pointer, pointer, status, status]
    library.weigh_values_rows.argtypes = [pointer, pointer, BlockStrides, size, size, size, size, size, pointer]
    library.weigh_values_rows.argtypes += [pointer, status, status]
    library.logits_rows.restype, library.weigh_values_rows.restype = None, status
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


@functools.cache
def _wide() -> int:
    """1 where the attention's C may run its AVX-512 loops: PyTorch's own kernels are AVX-512 here (not where
    ATEN_CPU_CAPABILITY restricts them to AVX2, so that such a run computes as an AVX2 machine does)."""
    return int(torch.backends.cpu.get_cpu_capability() == "AVX512")


def _on_cpu(*tensors: torch.Tensor | None) -> bool:
    return all(tensor.device.type == "cpu" for tensor in tensors if tensor is not None) and _available()


def top_k_in_order(scores: torch.Tensor, k: int, valid: torch.Tensor | None = None) -> torch.Tensor | None:
    """Indices (..., k) of the k highest `scores` in position order, ties to the earlier position, `valid` (bool,
    broadcastable) excluding positions as `attention_math.ranked` does; None where the C path is not available."""
    if not 0 < k <= scores.shape[-1] or (valid is not None and valid.dtype != torch.bool) or not _on_cpu(scores, valid):
        return None
    return _top_k_operator(scores, k, valid) if torch.compiler.is_compiling() else _top_k(scores, k, valid)


def spread_over_words(scores: torch.Tensor, words: torch.Tensor) -> torch.Tensor | None:
    """`attention_math.spread_over_spans` for float32 scores (B, H, n) and words (B, L), L <= n; None where the C
    path is not available."""
    if scores.dtype != torch.float32 or scores.ndim != 3 or not _on_cpu(scores, words):
        return None
    if words.shape[0] != scores.shape[0] or words.shape[-1] > scores.shape[-1]:
        return None  # one batch element's words for every row: the reference broadcasts them
    return _spread_operator(scores, words) if torch.compiler.is_compiling() else _spread(scores, words)


def _rows_whole(source: torch.Tensor) -> bool:
    """Each token's row of a (B, H, n, D) cache lies whole, one after another: the C reads (B, H) blocks apart."""
    return source.stride(3) == 1 and source.stride(2) == source.shape[3]


def _token_rows_fit(batch: int, heads: int, k: int, keys, values, key_out, value_out) -> bool:
    """Keys and values (batch, heads, n, D) of one type and shape have rows of D elements one after another, and the
    outs hold k or more slots of them per (batch, head), contiguous, of that type: what the C gathers copy between."""
    return (
        keys.dim() == 4
        and keys.shape[:2] == (batch, heads)
        and keys.shape == values.shape
        and keys.dtype == values.dtype
        and all(_rows_whole(source) for source in (keys, values))
        and all(
            out.dtype == keys.dtype
            and out.shape[:2] == (batch, heads)
            and out.shape[2] >= k
            and out.shape[3] == keys.shape[3]
            and out.is_contiguous()
            for out in (key_out, value_out)
        )
        and key_out.shape == value_out.shape
    )


def gather_rows_into(index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_out, value_out) -> bool:
    """`kvstore.gather_tokens(index padded with its last entry to the slots, keys, values, out=(key_out,
    value_out))` as one copy per row: keys and values (B, H, n, D) with rows of D elements one after another, the
    outs (B, H, slots, D) contiguous of the same type. False, with nothing written, where the C path is not available
    or a tensor lies otherwise; an index outside the n tokens raises IndexError."""
    if index.dim() != 3 or index.dtype != torch.long or not _on_cpu(index, keys, values, key_out, value_out):
        return False
    batch, heads, k = index.shape
    fits = 0 < k and _token_rows_fit(batch, heads, k, keys, values, key_out, value_out)
    if fits:
        (_gather_operator if torch.compiler.is_compiling() else _gather)(index, keys, values, key_out, value_out)
    return fits


def refresh_partial(
    per_head: torch.Tensor,
    first_only: bool,
    window: tuple[int, int],
    words: torch.Tensor | None,
    valid: torch.Tensor | None,
    k: int,
    keys: torch.Tensor,
    values: torch.Tensor,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    carry: tuple[float, float] = (0.0, 0.0),
    rows: torch.Tensor | None = None,
    floor: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> bool:
    """A partial cache refreshed in one C call: `attention_math.selection_scores` with max (or `first_only`)
    aggregation and pooling `window` (before, after), spread over `words` (B, L) when given, -inf where `valid`
    (broadcastable to (B, 1, 1, n)) is False, its top k in position order (`top_k`), and those tokens loaded into
    `store` = (keys, values, positions, scores) of a `SelectionState` as its `load` does, the slots from k on emptied;
    with `carry` = (share, below) and share > 0, each token the store holds with a score below `below` (the selected
    ones, not the decoded ones) first scores at least share x its score there, and with `floor` = (positions, scores,
    share) ((B, Hkv, slots) each, a selection kept aside) each token there at least share x its score there. With
    `rows` ((B,) bool), only those batch elements are refreshed; the others' store is left as it is.
    `per_head`: each query head's window-mean probabilities (B, Hkv, G, n), float32; keys and values (B, Hkv, n, D).
    False, with nothing written, where the C path is not available or a tensor lies otherwise."""
    key_out, value_out, positions, scores = store
    if (
        per_head.dtype != torch.float32
        or per_head.dim() != 4
        or not _on_cpu(per_head, keys, values, *store, words, valid)
    ):
        return False
    batch, heads, _, n = per_head.shape
    compiling = torch.compiler.is_compiling()
    fits = (
        0 < k <= n
        and _token_rows_fit(batch, heads, k, keys, values, key_out, value_out)
        and keys.shape[2] == n
        and all(t.shape == key_out.shape[:3] and t.is_contiguous() for t in (positions, scores))
        and positions.dtype == torch.long
        and scores.dtype == torch.float32
        and (words is None or (words.dim() == 2 and words.shape[0] == batch and words.shape[1] <= n))
        and (valid is None or (valid.dtype == torch.bool and valid.numel() == batch * n))
        and (rows is None or (rows.dtype == torch.bool and rows.shape == (batch,) and not compiling))
        and (
            floor is None
            or (
                floor[0].dtype == torch.long
                and floor[1].dtype == torch.float32
                and floor[0].shape == floor[1].shape == (batch, heads, floor[0].shape[-1])
                and _on_cpu(*floor[:2])
            )
        )
    )
    if fits:
        share, below = float(carry[0]), float(carry[1])
        held, held_scores, held_share = (None, None, 0.0) if floor is None else floor
        floor_arguments = (held, held_scores, float(held_share))
        arguments = (
            per_head,
            first_only,
            min(window[0], n - 1),  # past either end is padding: a wider window pools as one that fits
            min(window[1], n - 1),
            words,
            valid,
            k,
            keys,
            values,
            *store,
            share,
            below,
            *floor_arguments,
        )
        if rows is not None:  # eager only: the rows that refresh were read on the host (RefreshKV._needs_full)
            _refresh(*arguments, rows)
        else:
            (_refresh_operator if compiling else _refresh)(*arguments)
    return fits


def _query_fits(
    query: torch.Tensor, scaling: object, shape: tuple[int, int, int, int], valid: torch.Tensor | None, per_head: bool
) -> bool:
    """Whether the C attention takes this query and mask beside a cache of `shape` (B, Hkv, n, D): one float32 query
    token (B, Hq, 1, D) on the CPU, a plain float `scaling`, `valid` bool with B x n elements (B x Hkv x n too where
    the kernel takes a mask `per_head`) or None."""
    batch, kv_heads, n, dim = shape
    return (
        isinstance(scaling, float)
        and query.dim() == 4
        and query.shape[0] == batch
        and query.shape[2] == 1
        and query.shape[3] == dim
        and query.shape[1] % kv_heads == 0
        and query.dtype == torch.float32
        and (
            valid is None
            or valid.dtype == torch.bool
            and (valid.numel() == batch * n or per_head and valid.numel() == batch * kv_heads * n)
        )
        and _on_cpu(query, valid)
    )


def _rows_fit(rows: torch.Tensor | None, batch: int) -> bool:
    """`rows` marks batch elements the C can read: None (all of them) or (B,) bool on the CPU."""
    return rows is None or (rows.dtype == torch.bool and rows.shape == (batch,) and _on_cpu(rows))


def _one_query_rows(
    query: torch.Tensor,
    shape: tuple[int, int, int, int],
    valid: torch.Tensor | None,
    rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """For a query, mask and rows that fit (`_query_fits`, `_rows_fit`): the query packed per KV head (B, Hkv, G, D),
    `rows` as bytes and the mask (B, n) or (B, Hkv, n), or None, all contiguous."""
    batch, kv_heads, n, dim = shape
    packed = query.reshape(batch, kv_heads, query.shape[1] // kv_heads, dim).contiguous()
    mask = None if valid is None else valid.reshape(batch, -1, n).squeeze(1).contiguous()
    return packed, rows.to(torch.uint8).contiguous(), mask


def attend_rows(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: object,
    valid: torch.Tensor | None,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`attention_math.attend_with_probs` for the batch elements marked in `rows` ((B,) bool; None: all) only, their
    keys and values (B, Hkv, n, D) read where they lie: the output (B, 1, Hq, D) and the float32 probabilities (B, Hkv,
    G, n), whose unmarked rows hold nothing meaningful. Gathering the marked rows first would read and write them once
    more than attending to them does. Float32 on the CPU, a plain float `scaling`, `valid` (bool, B x n or B x Hkv x n
    elements) or None; None where the C path is not available or a tensor lies otherwise. Under torch.compile every
    row, as one operator (the compiler's own products and softmax took 3x its time at 8 rows)."""
    batch, kv_heads, n, dim = keys.shape
    fits = (
        keys.dtype == values.dtype == torch.float32
        and keys.shape == values.shape
        and all(_rows_whole(source) for source in (keys, values))
        and _on_cpu(keys, values)
        and _query_fits(query, scaling, (batch, kv_heads, n, dim), valid, per_head=True)
        and _rows_fit(rows, batch)
    )
    if not fits:  # before `rows` is made: a GPU's step gets no host tensor from this call
        return None
    if torch.compiler.is_compiling():
        return None if rows is not None else _attend_operator(query, keys, values, scaling, valid)
    return _attend(query, keys, values, scaling, valid, rows)


def _attend(query, keys, values, scaling, valid, rows=None) -> tuple[torch.Tensor, torch.Tensor]:
    batch, kv_heads, n, dim = keys.shape
    every = torch.ones(batch, dtype=torch.bool) if rows is None else rows
    packed, marked, mask = _one_query_rows(query, (batch, kv_heads, n, dim), valid, every)
    group = packed.shape[2]
    strides, threads, wide = BlockStrides.of(keys, values), torch.get_num_threads(), _wide()
    logits = torch.empty(batch, kv_heads, group, n)
    _kernels().logits_rows(
        packed.data_ptr(),
        keys.data_ptr(),
        strides,
        batch,
        kv_heads,
        group,
        n,
        dim,
        scaling,
        None if mask is None else mask.data_ptr(),
        int(mask is not None and mask.dim() == 3),
        marked.data_ptr(),
        logits.data_ptr(),
        wide,
        threads,
    )
    probs = logits.softmax(dim=-1)  # PyTorch's softmax, as attention_probs; the unmarked rows' are never read
    output = torch.empty_like(packed)
    if _kernels().weigh_values_rows(
        probs.data_ptr(),
        values.data_ptr(),
        strides,
        batch,
        kv_heads,
        group,
        n,
        dim,
        marked.data_ptr(),
        output.data_ptr(),
        wide,
        threads,
    ):
        raise MemoryError(f"attention: no scratch space for {batch} x {kv_heads} blocks")
    return output.reshape(batch, 1, kv_heads * group, dim), probs


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


def attend_quantized_rows(
    query: torch.Tensor,
    key_parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    value_parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    groups: int,
    bits: int,
    scaling: object,
    valid: torch.Tensor | None,
    rows: torch.Tensor,
    tail: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`attend_rows` over a C_f held in codes (`quantized_store.QuantizedFullStore`: its keys' and values' (codes,
    scales, minimums) and its `groups` filled groups, then `tail` = the residual's keys and values (B, Hkv, r, D)),
    read from the codes instead of dequantized first: 32 / bits times fewer bytes than the dense keys and values.
    The sums differ from the dequantized attention's in order only. Eager float32 on the CPU; None where the C path is
    not available or a tensor lies otherwise."""
    (key_codes, key_scales, key_minimums), (value_codes, value_scales, value_minimums) = key_parts, value_parts
    batch, kv_heads, stored, byte_rows, dim = key_codes.shape
    tail_keys, tail_values = tail
    quant = byte_rows * 8 // bits
    n = groups * quant + tail_keys.shape[2]
    fits = (
        key_scales.dtype == value_scales.dtype == tail_keys.dtype == torch.float32
        and all(part.is_contiguous() for part in (*key_parts, *value_parts))
        and value_codes.shape == key_codes.shape
        and dim % 16 == 0  # the C sums LANES floats side by side
        and key_scales.shape == key_minimums.shape == (batch, kv_heads, stored, 1, dim)
        and value_scales.shape == value_minimums.shape == (batch, kv_heads, stored * quant, dim // quant, 1)
        and _on_cpu(key_codes)
        and not torch.compiler.is_compiling()
        and _query_fits(query, scaling, (batch, kv_heads, n, dim), valid, per_head=False)
        and _rows_fit(rows, batch)
    )
    if not fits:
        return None
    assert isinstance(scaling, float)  # checked by _query_fits
    packed, marked, mask = _one_query_rows(query, (batch, kv_heads, n, dim), valid, rows)
    members = packed.shape[2]
    cache = QuantizedCache.of(key_parts, value_parts, groups, bits)
    threads, quantized = torch.get_num_threads(), groups * quant
    logits = torch.empty(batch, kv_heads, members, n)
    _kernels().quantized_logits_rows(
        packed.data_ptr(),
        cache,
        batch,
        kv_heads,
        members,
        n,
        dim,
        scaling,
        None if mask is None else mask.data_ptr(),
        marked.data_ptr(),
        logits.data_ptr(),
        threads,
    )
    if n > quantized:  # the residual's few tokens, dense
        recent = torch.matmul(packed, tail_keys.transpose(2, 3)) * scaling
        if mask is not None:
            recent.masked_fill_(~mask[:, None, None, quantized:], torch.finfo(torch.float32).min)
        logits[..., quantized:] = recent
    probs = logits.softmax(dim=-1)  # the unmarked rows' are never read
    output = torch.empty_like(packed)
    if _kernels().quantized_weigh_rows(
        probs.data_ptr(), cache, batch, kv_heads, members, n, dim, marked.data_ptr(), output.data_ptr(), threads
    ):
        raise MemoryError(f"attention over a quantized cache: no scratch space for {batch} x {kv_heads} blocks")
    if n > quantized:
        output += torch.matmul(probs[..., quantized:], tail_values)
    return output.reshape(batch, 1, kv_heads * members, dim), probs


def dequantize_rows(
    index: torch.Tensor,
    key_parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    value_parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    groups: int,
    bits: int,
    residual: tuple[torch.Tensor, torch.Tensor],
    out: tuple[torch.Tensor, torch.Tensor],
    rows: torch.Tensor | None = None,
) -> bool:
    """The keys and values of the tokens at `index` (B, Hkv, k) of a C_f held in codes (as `attend_quantized_rows`
    takes it; `residual`: its residual's whole buffers, (B, Hkv, quant, D)), each read back exactly as
    `QuantizedFullStore.view` reads it, into the first k slots of `out` (B, Hkv, slots, D), in one pass; only for the
    batch elements marked in `rows` ((B,) bool) if given. Eager float32 on the CPU; False, with nothing written, where
    the C path is not available or a tensor lies otherwise."""
    key_codes, key_scales = key_parts[0], key_parts[1]
    batch, kv_heads, stored, byte_rows, dim = key_codes.shape
    residual_keys, residual_values = residual
    quant = byte_rows * 8 // bits
    fits = (
        not torch.compiler.is_compiling()
        and index.dim() == 3
        and index.shape[:2] == (batch, kv_heads)
        and index.dtype == torch.long
        and key_scales.dtype == value_parts[1].dtype == residual_keys.dtype == torch.float32
        and all(part.is_contiguous() for part in (*key_parts, *value_parts, residual_keys, residual_values))
        and residual_keys.shape == residual_values.shape == (batch, kv_heads, quant, dim)
        and all(
            target.dtype == torch.float32
            and target.is_contiguous()
            and target.shape[:2] == (batch, kv_heads)
            and target.shape[2] >= index.shape[2]
            and target.shape[3] == dim
            for target in out
        )
        and out[0].shape == out[1].shape
        and (rows is None or (rows.dtype == torch.bool and rows.shape == (batch,)))
        and _on_cpu(index, key_codes, *out, rows)
    )
    if not fits:
        return False
    cache = QuantizedCache.of(key_parts, value_parts, groups, bits)
    index, (keys, values) = index.contiguous(), out
    marked = None if rows is None else rows.to(torch.uint8).contiguous()
    _kernels().dequantize_rows(
        cache,
        residual_keys.data_ptr(),
        residual_values.data_ptr(),
        index.data_ptr(),
        batch,
        kv_heads,
        index.shape[2],
        dim,
        keys.shape[2],
        None if marked is None else marked.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        torch.get_num_threads(),
    )
    return True


# The C calls. Under torch.compile each is an operator of its own (torch.library), opaque to the compiler, so that a
# compiled step calls the same C as an eager one.


def _kernels() -> ctypes.CDLL:
    """The built library: the C calls run only where `_available()` found it."""
    library = _library()
    assert library is not None
    return library


def _top_k(scores: torch.Tensor, k: int, valid: torch.Tensor | None) -> torch.Tensor:
    values = scores.float().contiguous()
    n, rows = values.shape[-1], values.numel() // values.shape[-1]
    mask = None if valid is None else valid.expand_as(values).contiguous()
    out = torch.empty(*values.shape[:-1], k, dtype=torch.long)
    if _kernels().top_k_in_order(
        values.data_ptr(),
        None if mask is None else mask.data_ptr(),
        rows,
        n,
        k,
        out.data_ptr(),
        torch.get_num_threads(),
    ):
        raise MemoryError(f"top k: no scratch space for {n} scores")
    return out


def _spread(scores: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    values, words = scores.contiguous(), words.to(torch.long).contiguous()
    batch, heads, n = values.shape
    out = torch.empty_like(values)
    _kernels().spread_over_words(
        values.data_ptr(), words.data_ptr(), batch, heads, n, words.shape[-1], out.data_ptr(), torch.get_num_threads()
    )
    return out


def _gather(index, keys, values, key_out, value_out) -> None:
    index = index.contiguous()
    batch, heads, k = index.shape
    failed = _kernels().gather_rows(
        keys.data_ptr(),
        values.data_ptr(),
        BlockStrides.of(keys, values),
        keys.shape[2],
        index.data_ptr(),
        batch,
        heads,
        k,
        keys.shape[3] * keys.element_size(),
        key_out.shape[2],
        key_out.data_ptr(),
        value_out.data_ptr(),
        torch.get_num_threads(),
    )
    if failed:
        raise IndexError(f"gather: an index is outside the {keys.shape[2]} tokens held")


def _refresh(
    per_head,
    first_only,
    before,
    after,
    words,
    valid,
    k,
    keys,
    values,
    key_out,
    value_out,
    positions,
    scores,
    carry,
    carried_below,
    floor_positions=None,
    floor_scores=None,
    floor_share=0.0,
    rows=None,
):
    per_head = per_head.contiguous()
    batch, heads, group, n = per_head.shape
    words = None if words is None else words.to(torch.long).contiguous()
    valid = None if valid is None else valid.reshape(batch, n).contiguous()
    marked = None if rows is None else rows.to(torch.uint8).contiguous()
    if floor_positions is None or floor_scores is None or floor_share <= 0:
        floor_positions, floor_scores, floor_share = None, None, 0.0
    else:
        floor_positions, floor_scores = floor_positions.contiguous(), floor_scores.contiguous()
    failed = _kernels().refresh_partial(
        per_head.data_ptr(),
        batch,
        heads,
        group,
        n,
        first_only,
        before,
        after,
        None if words is None else words.data_ptr(),
        0 if words is None else words.shape[1],
        None if valid is None else valid.data_ptr(),
        k,
        keys.data_ptr(),
        values.data_ptr(),
        BlockStrides.of(keys, values),
        keys.shape[3] * keys.element_size(),
        key_out.shape[2],
        key_out.data_ptr(),
        value_out.data_ptr(),
        positions.data_ptr(),
        scores.data_ptr(),
        carry,
        carried_below,
        None if floor_positions is None else floor_positions.data_ptr(),
        None if floor_scores is None else floor_scores.data_ptr(),
        0 if floor_positions is None else floor_positions.shape[-1],
        floor_share,
        None if marked is None else marked.data_ptr(),
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError(f"refresh: no scratch space for {n} tokens")


# Defined on a plain torch.library.Library, not with torch.library.custom_op: a compiled step calls the operator once
# per layer, and a call through custom_op's wrappers cost 62 us more than the eager step's call of the same C, this way
# 5 us (benchmarks/experiments/operator_overhead.py: 8K tokens, 2 threads, AVX2 kernels; 1.7 ms of a compiled refresh
# step at 8K). The alias annotations (a!) in a schema name what an operator writes. Kept alive with the module: the
# operators live as long as this object.
_OPERATORS = torch.library.Library("refreshkv", "DEF")


def _operator(name: str, function, schema: str, fake):
    """`function` as the operator `refreshkv::name` for torch.compile, its outputs' shapes given by `fake`."""
    _OPERATORS.define(name + schema)
    _OPERATORS.impl(name, function, "CPU")
    torch.library.register_fake(f"refreshkv::{name}", fake, lib=_OPERATORS)
    return getattr(torch.ops.refreshkv, name).default


_top_k_operator = _operator(
    "top_k_in_order",
    _top_k,
    "(Tensor scores, int k, Tensor? valid) -> Tensor",
    lambda scores, k, valid: scores.new_empty((*scores.shape[:-1], k), dtype=torch.long),
)
_spread_operator = _operator(
    "spread_over_words",
    _spread,
    "(Tensor scores, Tensor words) -> Tensor",
    lambda scores, words: torch.empty_like(scores),
)
_gather_operator = _operator(
    "gather_rows",
    _gather,
    "(Tensor index, Tensor keys, Tensor values, Tensor(a!) key_out, Tensor(b!) value_out) -> ()",
    lambda index, keys, values, key_out, value_out: None,
)
_refresh_operator = _operator(
    "refresh_partial",
    _refresh,
    "(Tensor per_head, bool first_only, int before, int after, Tensor? words, Tensor? valid, int k, Tensor keys, "
    "Tensor values, Tensor(a!) key_out, Tensor(b!) value_out, Tensor(c!) positions, Tensor(d!) scores, "
    "float carry, float carried_below, Tensor? floor_positions, Tensor? floor_scores, float floor_share) -> ()",
    lambda *arguments: None,
)


def _attend_where_rows_lie(query, keys, values, scaling, valid):
    """`_attend` with each key and value row whole, as they lie where they are (a cache sliced to its length: blocks
    apart), copied only where the compiler laid them out otherwise."""
    keys, values = (source if _rows_whole(source) else source.contiguous() for source in (keys, values))
    return _attend(query, keys, values, scaling, valid)


_attend_operator = _operator(
    "attend_rows",
    _attend_where_rows_lie,
    "(Tensor query, Tensor keys, Tensor values, float scaling, Tensor? valid) -> (Tensor, Tensor)",
    lambda query, keys, values, scaling, valid: (
        query.new_empty(query.shape[0], 1, query.shape[1], query.shape[3]),
        query.new_empty(*keys.shape[:2], query.shape[1] // keys.shape[1], keys.shape[2]),
    ),
)
