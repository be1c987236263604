"""The C over a full cache held in codes (core/quantized_store.py) on the CPU (selection_kernels.c, loaded by
native_library.py): one query's attention read from the codes instead of dequantized first, and the selected tokens'
keys and values read back from them in one pass.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .native_attention import one_query_rows, query_fits, rows_fit
from .native_library import QuantizedCache, kernels, on_cpu


class CodedCache(NamedTuple):
    """A C_f held in codes (`quantized_store.QuantizedFullStore`) as the C reads it: its keys' and values' (codes,
    scales, minimums), its `groups` filled groups and the `bits` of a code."""

    key_parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    value_parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    groups: int
    bits: int


def attend_quantized_rows(
    query: torch.Tensor,
    codes: CodedCache,
    scaling: object,
    valid: torch.Tensor | None,
    rows: torch.Tensor,
    tail: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`attend_rows` over a C_f held in `codes`, then `tail` = its residual's keys and values (B, Hkv, r, D),
    read from the codes instead of dequantized first: 32 / bits times fewer bytes than the dense keys and values.
    The sums differ from the dequantized attention's in order only. Eager float32 on the CPU; None where the C path is
    not available or a tensor lies otherwise."""
    key_parts, value_parts, groups, bits = codes
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
        and on_cpu(key_codes)
        and not torch.compiler.is_compiling()
        and query_fits(query, scaling, (batch, kv_heads, n, dim), valid, per_head=False)
        and rows_fit(rows, batch)
    )
    if not fits:
        return None
    assert isinstance(scaling, float)  # checked by query_fits
    packed, marked, mask = one_query_rows(query, (batch, kv_heads, n, dim), valid, rows)
    members = packed.shape[2]
    cache = QuantizedCache.of(*codes)
    threads, quantized = torch.get_num_threads(), groups * quant
    logits = torch.empty(batch, kv_heads, members, n)
    kernels().quantized_logits_rows(
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
    if kernels().quantized_weigh_rows(
        probs.data_ptr(), cache, batch, kv_heads, members, n, dim, marked.data_ptr(), output.data_ptr(), threads
    ):
        raise MemoryError(f"attention over a quantized cache: no scratch space for {batch} x {kv_heads} blocks")
    if n > quantized:
        output += torch.matmul(probs[..., quantized:], tail_values)
    return output.reshape(batch, 1, kv_heads * members, dim), probs


def dequantize_rows(
    index: torch.Tensor,
    codes: CodedCache,
    residual: tuple[torch.Tensor, torch.Tensor],
    out: tuple[torch.Tensor, torch.Tensor],
    rows: torch.Tensor | None = None,
) -> bool:
    """The keys and values of the tokens at `index` (B, Hkv, k) of a C_f held in `codes` (`residual`: its residual's
    whole buffers, (B, Hkv, quant, D)), each read back exactly as
    `QuantizedFullStore.view` reads it, into the first k slots of `out` (B, Hkv, slots, D), in one pass; only for the
    batch elements marked in `rows` ((B,) bool) if given. Eager float32 on the CPU; False, with nothing written, where
    the C path is not available or a tensor lies otherwise."""
    key_parts, value_parts, _, bits = codes
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
        and on_cpu(index, key_codes, *out, rows)
    )
    if not fits:
        return False
    cache = QuantizedCache.of(*codes)
    index, (keys, values) = index.contiguous(), out
    marked = None if rows is None else rows.to(torch.uint8).contiguous()
    kernels().dequantize_rows(
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
