"""One query token's attention in C on the CPU (selection_kernels.c, loaded by native_library.py): a full step's
products, softmax and weighted values for the batch elements that take it, their keys and values read where they lie,
faster there than SDPA; the results are PyTorch's (tests/test_native_selection.py); and the same over one request's
tokens in a serving engine's paged blocks (`attend_paged`). What a query must be for the C to take it is checked here
for native_quantized.py too.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .native_library import BlockStrides, PagedAt, kernels, on_cpu, operator, rows_whole


@functools.cache
def _wide() -> int:
    """1 where the attention's C may run its AVX-512 loops: PyTorch's own kernels are AVX-512 here (not where
    ATEN_CPU_CAPABILITY restricts them to AVX2, so that such a run computes as an AVX2 machine does)."""
    return int(torch.backends.cpu.get_cpu_capability() == "AVX512")


def query_fits(
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
        and on_cpu(query, valid)
    )


def rows_fit(rows: torch.Tensor | None, batch: int) -> bool:
    """`rows` marks batch elements the C can read: None (all of them) or (B,) bool on the CPU."""
    return rows is None or (rows.dtype == torch.bool and rows.shape == (batch,) and on_cpu(rows))


def one_query_rows(
    query: torch.Tensor,
    shape: tuple[int, int, int, int],
    valid: torch.Tensor | None,
    rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """For a query, mask and rows that fit (`query_fits`, `_rows_fit`): the query packed per KV head (B, Hkv, G, D),
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
        and all(rows_whole(source) for source in (keys, values))
        and on_cpu(keys, values)
        and query_fits(query, scaling, (batch, kv_heads, n, dim), valid, per_head=True)
        and rows_fit(rows, batch)
    )
    if not fits:  # before `rows` is made: a GPU's step gets no host tensor from this call
        return None
    if torch.compiler.is_compiling():
        return None if rows is not None else _attend_operator(query, keys, values, scaling, valid)
    return _attend(query, keys, values, scaling, valid, rows)


def _attend(query, keys, values, scaling, valid, rows=None) -> tuple[torch.Tensor, torch.Tensor]:
    batch, kv_heads, n, dim = keys.shape
    every = torch.ones(batch, dtype=torch.bool) if rows is None else rows
    packed, marked, mask = one_query_rows(query, (batch, kv_heads, n, dim), valid, every)
    group = packed.shape[2]
    strides, threads, wide = BlockStrides.of(keys, values), torch.get_num_threads(), _wide()
    logits = torch.empty(batch, kv_heads, group, n)
    kernels().logits_rows(
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
    if kernels().weigh_values_rows(
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


def _attend_where_rows_lie(query, keys, values, scaling, valid):
    """`_attend` with each key and value row whole, as they lie where they are (a cache sliced to its length: blocks
    apart), copied only where the compiler laid them out otherwise."""
    keys, values = (source if rows_whole(source) else source.contiguous() for source in (keys, values))
    return _attend(query, keys, values, scaling, valid)


_attend_operator = operator(
    "attend_rows",
    _attend_where_rows_lie,
    "(Tensor query, Tensor keys, Tensor values, float scaling, Tensor? valid) -> (Tensor, Tensor)",
    lambda query, keys, values, scaling, valid: (
        query.new_empty(query.shape[0], 1, query.shape[1], query.shape[3]),
        query.new_empty(*keys.shape[:2], query.shape[1] // keys.shape[1], keys.shape[2]),
    ),
)


def attend_paged(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_ids: torch.Tensor, length: int, scaling: object
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`attention_math.attend_with_probs` of one request's query token (1, Hq, 1, D) over its first `length` tokens
    in paged blocks, read where they lie: `keys` and `values` (blocks, Hkv, block_size, D) views of the engine's
    cache, a block's keys channel-major and its values token-major (vLLM's CPU layout), `block_ids` its blocks in
    position order. The output (1, 1, Hq, D) and the float32 probabilities (1, Hkv, G, length). None where the C cannot
    (another layout or dtype, a GPU, under torch.compile): then gather the tokens first."""
    blocks, kv_heads, size, dim = keys.shape
    if not (paged_fits(keys, values) and query_fits(query, scaling, (1, kv_heads, length, dim), None, per_head=False)):
        return None
    group = query.shape[1] // kv_heads
    packed = query.reshape(kv_heads, group, dim).contiguous()
    table = block_ids[: -(-length // size)].to(torch.int64).contiguous()
    strides, threads = BlockStrides.of(keys, values), torch.get_num_threads()
    logits = torch.empty(1, kv_heads, group, length)
    paged = (table.data_ptr(), size, length, kv_heads, group, dim)
    kernels().paged_logits(
        packed.data_ptr(), keys.data_ptr(), strides, *paged, scaling, logits.data_ptr(), _wide(), threads
    )
    probs = logits.softmax(dim=-1)
    output = torch.empty_like(packed)
    if kernels().paged_weigh_values(
        probs.data_ptr(), values.data_ptr(), strides, *paged, output.data_ptr(), _wide(), threads
    ):
        raise MemoryError(f"attention: no scratch space for {kv_heads} x {len(table)} blocks")
    return output.reshape(1, 1, kv_heads * group, dim), probs


def attend_paged_at(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_ids: torch.Tensor,
    index: torch.Tensor,
    valid: torch.Tensor | None,
    tokens: int,
    scaling: object,
) -> torch.Tensor | None:
    """`attention_math.decode_attention` of one request's query token (1, Hq, 1, D) over its tokens at `index` (Hkv,
    k; ascending per head, as quest's pages; those at or past `tokens` are none, never read), those where `valid`
    (Hkv, k bool, or None) holds, in paged blocks read where they lie (as `attend_paged`'s): the output (1, 1, Hq, D).
    None where the C cannot (`paged_at_fits`): then gather them first."""
    if not (paged_fits(keys, values) and paged_at_fits(query, index, valid, keys.shape[3], scaling)):
        return None
    output = query.new_empty(1, 1, query.shape[1], query.shape[3])
    attend_paged_many(keys, values, [(query, block_ids, index, valid, tokens, output)], scaling)  # type: ignore[arg-type]
    return output


def paged_at_fits(
    query: torch.Tensor, index: torch.Tensor, valid: torch.Tensor | None, dim: int, scaling: object
) -> bool:
    """Whether `attend_paged_many` takes this request's query and positions beside blocks that `paged_fits`."""
    kv_heads, k = index.shape
    return query_fits(query, scaling, (1, kv_heads, k, dim), valid, per_head=True)


def attend_paged_many(
    keys: torch.Tensor,
    values: torch.Tensor,
    requests: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int, torch.Tensor]],
    scaling: float,
) -> None:
    """`attend_paged_at` of n requests over one layer's paged blocks (that `paged_fits`) in one call, each request
    (query (1, Hq, 1, D), block ids, index (Hkv, k), valid (Hkv, k) or None, its tokens, out: Hq x D float32
    contiguous) one that `paged_at_fits`: every output written into its `out`. IndexError where a token lies outside
    its request's blocks: the C reads no memory outside them."""
    kv_heads, dim = keys.shape[1], keys.shape[3]
    group = requests[0][0].shape[1] // kv_heads
    kept = []  # the tensors the C reads, alive until it has
    described = []
    for query, block_ids, index, valid, tokens, out in requests:
        query, index, table = query.contiguous(), index.to(torch.int64).contiguous(), block_ids.to(torch.int64)
        table = table.contiguous()
        mask = None if valid is None else valid.contiguous()
        kept += [query, index, table, mask]
        address = 0 if mask is None else mask.data_ptr()
        fields = (query.data_ptr(), table.data_ptr(), table.numel(), index.data_ptr(), address, index.shape[1])
        described.append(PagedAt(*fields, tokens, out.data_ptr()))
    at = ((PagedAt * len(described))(*described), len(described))
    width = max(request[2].shape[1] for request in requests)
    sizes = (keys.shape[2], kv_heads, group, dim, width)
    threads, wide = torch.get_num_threads(), _wide()
    logits = torch.empty(len(requests), kv_heads, group, width)
    strides = BlockStrides.of(keys, values)
    if kernels().paged_logits_at(*at, keys.data_ptr(), strides, *sizes, scaling, logits.data_ptr(), wide, threads):
        raise IndexError("attention: a token is outside its request's blocks")
    probs = logits.softmax(dim=-1)
    kernels().paged_weigh_at(*at, probs.data_ptr(), values.data_ptr(), strides, *sizes, wide, threads)


def paged_fits(keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Paged blocks (blocks, Hkv, block_size, D) the C reads: float32 on the CPU, each block's keys channel-major and
    its values token-major (vLLM's CPU layout), eager."""
    size, dim = keys.shape[2:]
    return (
        keys.dtype == values.dtype == torch.float32
        and keys.shape == values.shape
        and keys.stride(2) == 1
        and keys.stride(3) == size
        and values.stride(3) == 1
        and values.stride(2) == dim
        and keys.stride()[:2] == values.stride()[:2]
        and on_cpu(keys, values)
        and not torch.compiler.is_compiling()
    )


def paged_positions(
    index: torch.Tensor, block_ids: torch.Tensor, block_size: int, reader: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (Hkv, k) and a block table as the C reads them (int64, contiguous), every position checked to lie in
    the request's blocks: the C reads no memory outside them (IndexError naming the `reader`)."""
    index, table = index.to(torch.int64).contiguous(), block_ids.to(torch.int64).contiguous()
    if index.numel() and not 0 <= int(index.min()) <= int(index.max()) < table.numel() * block_size:
        raise IndexError(f"{reader}: a position is outside the request's {table.numel()} blocks")
    return index, table


def gather_paged(
    keys: torch.Tensor,
    values: torch.Tensor,
    block_ids: torch.Tensor,
    index: torch.Tensor,
    out: tuple[torch.Tensor, ...],
    held: torch.Tensor | None = None,
) -> bool:
    """Each KV head's tokens at `index` (Hkv, k) of one request's paged blocks (as `attend_paged`'s) into the first k
    slots of `out` (keys, values: (1, Hkv, n >= k, D) float32, each head's slots one after another, as a store's
    slots from some slot on lie). `held` (Hkv, m <= n), where given: the positions of the tokens in `out`'s first m
    slots now (-1: none): a slot that holds the position asked for is left as it is, not read from the blocks again
    (a refresh leaves the tokens it keeps in their slots). False, with nothing written, where the C cannot."""
    heads, k = index.shape
    dim = keys.shape[3]
    slots = out[0].stride(1) // dim
    lies = all(
        o.dtype == torch.float32 and o.stride(3) == 1 and o.stride(2) == dim and o.stride(1) == slots * dim
        for o in out[:2]
    )
    if not (lies and out[0].stride() == out[1].stride() and k <= out[0].shape[2] and paged_fits(keys, values)):
        return False
    index, table = paged_positions(index, block_ids, keys.shape[2], "gather")
    if held is not None:
        held = held.to(torch.int64).contiguous()
        if held.shape[0] != heads or held.shape[1] > out[0].shape[2]:
            raise ValueError(f"gather: held positions {tuple(held.shape)} for {heads} heads of {out[0].shape[2]} slots")
    kernels().paged_gather(
        keys.data_ptr(),
        values.data_ptr(),
        BlockStrides.of(keys, values),
        table.data_ptr(),
        keys.shape[2],
        index.data_ptr(),
        heads,
        k,
        dim,
        slots,
        None if held is None else held.data_ptr(),
        0 if held is None else held.shape[1],
        out[0].data_ptr(),
        out[1].data_ptr(),
    )
    return True


def attend_stores(
    queries: torch.Tensor,
    stores: list[tuple[torch.Tensor, torch.Tensor]],
    scaling: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """`attention_math.decode_attention` of n requests' query tokens (n, Hq, D) each over its own held tokens,
    `stores[r]`: keys and values (1, Hkv, m_r, D), the first m_r slots of a store whose heads' slots lie one after
    another (as a `SlotStore` holds them), in one call: the outputs (n, Hq, D), into `out` where given (contiguous).
    None where the C cannot (a store that lies otherwise, another dtype, a GPU): then attend to each alone."""
    count, query_heads, dim = queries.shape
    kv_heads = stores[0][0].shape[1]
    if not (
        queries.dtype == torch.float32
        and query_heads % kv_heads == 0
        and isinstance(scaling, float)
        and on_cpu(queries)
        and not torch.compiler.is_compiling()
    ):
        return None
    described: list[list[int]] = [[], [], [], []]  # per store: its keys, its values, its heads' stride, its length
    for keys, values in stores:
        shape, stride = keys.shape, keys.stride()
        if not (
            keys.dtype == values.dtype == torch.float32
            and shape == values.shape
            and stride == values.stride()
            and shape[1] == kv_heads
            and shape[3] == dim
            and stride[3] == 1
            and stride[2] == dim
            and keys.device.type == values.device.type == "cpu"
        ):
            return None
        for column, value in zip(described, (keys.data_ptr(), values.data_ptr(), stride[1], shape[2])):
            column.append(value)
    # a C array, not a tensor: a served step calls this at every layer, where making a tensor costs more than this
    table = (ctypes.c_int64 * (4 * len(stores)))(*(value for column in described for value in column))
    column_bytes = 8 * len(stores)
    key_sources, value_sources, head_strides, lengths = (ctypes.addressof(table) + column_bytes * i for i in range(4))
    group, width = query_heads // kv_heads, max(described[3])
    sizes = (count, kv_heads, group, dim, width)
    threads, wide = torch.get_num_threads(), _wide()
    # the positions past a request's tokens are -inf (the C writes them): they weigh 0, as in attention_probs
    logits = queries.new_empty((count, kv_heads, group, width))
    packed = queries.contiguous()
    kernels().logits_stores(
        packed.data_ptr(), key_sources, head_strides, lengths, *sizes, scaling, logits.data_ptr(), wide, threads
    )
    probs = logits.softmax(dim=-1)
    output = torch.empty_like(packed) if out is None else out
    kernels().weigh_stores(
        probs.data_ptr(), value_sources, head_strides, lengths, *sizes, output.data_ptr(), wide, threads
    )
    return output
