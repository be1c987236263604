"""One query token over a fixed-size KV buffer in Triton, for decode steps replayed as CUDA graphs.

A captured step cannot slice a cache to its current length (the length would be baked into the graph), so it attends
over the whole buffer and reads which entries count from the device: a length (C_f: the first `length` entries) or
per-slot positions (C_p and eviction stores: a slot counts when its position is >= 0). Split-K ("flash decoding"):
each program reads one chunk of one KV head for the query heads of its group, so a long buffer fills the GPU with one
query; a second kernel combines the chunks. Chunks past the length and empty slots are not read, so the bytes read
follow what counts, not the buffer's size.

`rows` ((B,) bool) with `expect`: only the rows whose flag equals `expect` are computed (the others' outputs are left
unwritten): a step whose rows decide on the device between two paths reads each row's path only.
`keep_logits`: also the float32 probabilities (B, Hkv, G, n) over the whole buffer (0 where an entry does not count),
which a refresh scores tokens with.

Used only where Triton runs (a CUDA device, or `TRITON_INTERPRET=1` in tests) and the heads fit; `available` says
whether they do.
"""

from __future__ import annotations

import dataclasses
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: PyTorch's attention serves (runtime/static_decode.py)
    triton = None

BLOCK_G = 16  # query heads of a group, padded up to what tl.dot takes


@dataclasses.dataclass
class Tuning:
    """Launch shape of the split kernel (benchmarks/experiments/cuda_graphs.py times the choices on a GPU)."""

    block_n: int = 64  # keys per inner iteration
    programs: int = 1024  # split programs per call, about: several per multiprocessor at any batch
    warps: int = 4


TUNING = Tuning()


def available(query: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether the kernels run for this query (B, Hq, 1, D) over these keys (B, Hkv, n, D): Triton is there, and the
    head size is a power of two and a KV head has at most BLOCK_G query heads."""
    if triton is None or not (query.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    head_dim = query.shape[-1]
    return query.shape[1] // keys.shape[1] <= BLOCK_G and head_dim & (head_dim - 1) == 0


if triton is not None:

    @triton.jit
    def _split_kernel(
        query,
        keys,
        values,
        length,
        positions,
        rows,
        out_parts,
        max_parts,
        sum_parts,
        logits,
        scale,
        slots,
        chunk,
        splits,
        group,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_kh,
        stride_vb,
        stride_vh,
        stride_pb,
        stride_ph,
        KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BY_LENGTH: tl.constexpr,
        HAS_ROWS: tl.constexpr,
        EXPECT: tl.constexpr,
        KEEP_LOGITS: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        row_head = tl.program_id(0)
        split = tl.program_id(1)
        row = row_head // KV_HEADS
        head = row_head % KV_HEADS
        start = split * chunk
        end = tl.minimum(start + chunk, slots)
        if BY_LENGTH:
            end = tl.minimum(end, tl.load(length))
        if HAS_ROWS:
            active = tl.load(rows + row).to(tl.int32) == EXPECT
            end = tl.where(active, end, start)
        heads = tl.arange(0, BLOCK_G)
        dims = tl.arange(0, HEAD_DIM)
        in_group = heads < group
        q = tl.load(
            query + row * stride_qb + head * stride_qh + heads[:, None] * HEAD_DIM + dims[None, :],
            mask=in_group[:, None],
            other=0.0,
        )
        best = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        key_base = keys + row * stride_kb + head * stride_kh
        value_base = values + row * stride_vb + head * stride_vh
        for first in range(start, end, BLOCK_N):
            index = first + tl.arange(0, BLOCK_N)
            inside = index < end
            if BY_LENGTH:
                counts = inside
            else:
                held = tl.load(positions + row * stride_pb + head * stride_ph + index, mask=inside, other=-1)
                counts = inside & (held >= 0)
            k = tl.load(key_base + index[:, None] * HEAD_DIM + dims[None, :], mask=counts[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
            scores = tl.where(counts[None, :], scores, float("-inf"))
            if KEEP_LOGITS:
                target = logits + (row_head * group + heads[:, None]) * slots + index[None, :]
                tl.store(target, scores, mask=in_group[:, None] & inside[None, :])
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            pivot = tl.where(new_best == float("-inf"), 0.0, new_best)
            weights = tl.exp(scores - pivot[:, None])
            rescale = tl.exp(best - pivot)
            v = tl.load(value_base + index[:, None] * HEAD_DIM + dims[None, :], mask=counts[:, None], other=0.0)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            total = total * rescale + tl.sum(weights, axis=1)
            best = new_best
        part = (row_head * BLOCK_G + heads) * splits + split
        written = in_group
        if HAS_ROWS:
            written = written & active
        tl.store(max_parts + part, best, mask=written)
        tl.store(sum_parts + part, total, mask=written)
        tl.store(out_parts + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=written[:, None])

    @triton.jit
    def _combine_kernel(
        out_parts,
        max_parts,
        sum_parts,
        rows,
        output,
        log_sums,
        splits,
        group,
        KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_G: tl.constexpr,
        HAS_ROWS: tl.constexpr,
        EXPECT: tl.constexpr,
    ):
        row_head = tl.program_id(0)
        row = row_head // KV_HEADS
        heads = tl.arange(0, BLOCK_G)
        dims = tl.arange(0, HEAD_DIM)
        written = heads < group
        count = splits
        if HAS_ROWS:
            active = tl.load(rows + row).to(tl.int32) == EXPECT
            written = written & active
            count = tl.where(active, splits, 0)
        parts = (row_head * BLOCK_G + heads) * splits
        best = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for split in range(0, count):
            best = tl.maximum(best, tl.load(max_parts + parts + split, mask=written, other=float("-inf")))
        pivot = tl.where(best == float("-inf"), 0.0, best)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        for split in range(0, count):
            weight = tl.exp(tl.load(max_parts + parts + split, mask=written, other=float("-inf")) - pivot)
            total += weight * tl.load(sum_parts + parts + split, mask=written, other=0.0)
            chunk = tl.load(out_parts + (parts + split)[:, None] * HEAD_DIM + dims[None, :], mask=written[:, None])
            acc += weight[:, None] * chunk
        result = acc / tl.where(total > 0, total, 1.0)[:, None]
        target = output + (row_head * group + heads[:, None]) * HEAD_DIM + dims[None, :]
        tl.store(target, result.to(output.dtype.element_ty), mask=written[:, None])
        tl.store(log_sums + row_head * group + heads, pivot + tl.log(total), mask=written)


def _splits(programs_per_split: int, slots: int) -> tuple[int, int]:
    """(chunk, splits): chunks of a multiple of `block_n` keys, about `TUNING.programs` programs in all."""
    block = TUNING.block_n
    wanted = max(1, min(TUNING.programs // max(programs_per_split, 1), triton.cdiv(slots, block)))
    chunk = block * triton.cdiv(triton.cdiv(slots, wanted), block)
    return chunk, triton.cdiv(slots, chunk)


def one_query_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    length: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    expect: bool = True,
    keep_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`query` (B, Hq, 1, D) over `keys`/`values` (B, Hkv, n, D), contiguous, of which the first `length` (a
    one-element int64 tensor) count, or the slots whose `positions` (B, Hkv, n) are >= 0. Returns the output
    (B, 1, Hq, D) and, with `keep_logits`, the float32 probabilities (B, Hkv, G, n) (0 where an entry does not count).
    With `rows`, only rows whose flag is `expect` are written.

    A custom operator, so that torch.compile calls it as it is and fuses the work around it (inductor's own
    compilation of the kernels failed on an H200 with torch 2.11 and Triton 3.6: docs/results/cuda-h200/graphs/)."""
    output, probs = _attention_op(query, keys, values, scaling, length, positions, rows, expect, keep_logits)
    return output, probs if keep_logits else None


@torch.library.custom_op("refreshkv::one_query_attention", mutates_args=())
def _attention_op(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    length: torch.Tensor | None,
    positions: torch.Tensor | None,
    rows: torch.Tensor | None,
    expect: bool,
    keep_logits: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`one_query_attention`'s launch; without `keep_logits` the second result is empty."""
    batch, query_heads, _, head_dim = query.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = query_heads // kv_heads
    if group > BLOCK_G or head_dim & (head_dim - 1) or (length is None) == (positions is None):
        raise ValueError(
            f"one_query_attention takes up to {BLOCK_G} query heads per KV head, a power-of-two head size and "
            f"either a length or positions; got {group}, {head_dim}"
        )
    if any(t.stride(3) != 1 or t.stride(2) != head_dim for t in (keys, values)):
        raise ValueError("one_query_attention reads keys and values stored token after token (B, Hkv, n, D)")
    query = query.reshape(batch, kv_heads, group, head_dim).contiguous()
    chunk, splits = _splits(batch * kv_heads, slots)
    device = query.device
    out_parts = torch.empty(batch * kv_heads * BLOCK_G * splits, head_dim, device=device, dtype=torch.float32)
    max_parts = torch.empty(batch * kv_heads * BLOCK_G * splits, device=device, dtype=torch.float32)
    sum_parts = torch.empty_like(max_parts)
    logits = torch.empty(batch, kv_heads, group, slots, device=device, dtype=torch.float32) if keep_logits else None
    placeholder = max_parts  # a pointer for arguments a variant does not read
    _split_kernel[(batch * kv_heads, splits)](
        query,
        keys,
        values,
        length if length is not None else placeholder,
        positions if positions is not None else placeholder,
        rows if rows is not None else placeholder,
        out_parts,
        max_parts,
        sum_parts,
        logits if logits is not None else placeholder,
        float(scaling),
        slots,
        chunk,
        splits,
        group,
        query.stride(0),
        query.stride(1),
        keys.stride(0),
        keys.stride(1),
        values.stride(0),
        values.stride(1),
        positions.stride(0) if positions is not None else 0,
        positions.stride(1) if positions is not None else 0,
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_G=BLOCK_G,
        BLOCK_N=TUNING.block_n,
        BY_LENGTH=length is not None,
        HAS_ROWS=rows is not None,
        EXPECT=int(expect),
        KEEP_LOGITS=keep_logits,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",  # float32 caches exactly, as eager computes them
        num_warps=TUNING.warps,
    )
    output = torch.empty(batch, kv_heads, group, head_dim, device=device, dtype=query.dtype)
    log_sums = torch.empty(batch, kv_heads, group, device=device, dtype=torch.float32)
    _combine_kernel[(batch * kv_heads,)](
        out_parts,
        max_parts,
        sum_parts,
        rows if rows is not None else placeholder,
        output,
        log_sums,
        splits,
        group,
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_G=BLOCK_G,
        HAS_ROWS=rows is not None,
        EXPECT=int(expect),
    )
    output = output.view(batch, query_heads, 1, head_dim).transpose(1, 2)
    if logits is None:
        return output, log_sums.new_empty(0)
    probs = torch.exp(logits - log_sums[..., None])
    if length is not None:
        counts = torch.arange(slots, device=device) < length
    else:
        assert positions is not None  # one of the two, checked above
        counts = positions[:, :, None] >= 0
    return output, probs.masked_fill(~counts, 0.0)


@_attention_op.register_fake
def _(query, keys, values, scaling, length, positions, rows, expect, keep_logits):
    batch, query_heads, _, head_dim = query.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    output = query.new_empty(batch, query_heads, 1, head_dim).transpose(1, 2)
    shape = (batch, kv_heads, query_heads // kv_heads, slots) if keep_logits else (0,)
    return output, query.new_empty(shape, dtype=torch.float32)
