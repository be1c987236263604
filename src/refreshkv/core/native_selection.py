"""The selection's loops compiled from C (selection_kernels.c, built and loaded by native_library.py) for the CPU:
the top K in position order, the spread of scores over words and the gather of the selected keys and values into a
store, each one pass instead of three to eight PyTorch operators; and a partial cache's whole refresh
(`refresh_partial`: scores from the attention, top K, store filled) in one call instead of about twenty.

Why: a refresh step on an AVX2 CPU cost 1.2-1.27x `full`'s step (issue 33, target 1.15x); what it adds is the
selection, a dozen small operators per layer whose dispatch and passes over memory cost more than their arithmetic.
The results are the PyTorch reference's exactly (core/attention_math.py; tests/test_native_selection.py).
"""

from __future__ import annotations

import torch

from .native_library import BlockStrides, kernels, on_cpu, operator, rows_whole


def top_k_in_order(scores: torch.Tensor, k: int, valid: torch.Tensor | None = None) -> torch.Tensor | None:
    """Indices (..., k) of the k highest `scores` in position order, ties to the earlier position, `valid` (bool,
    broadcastable) excluding positions as `attention_math.ranked` does; None where the C path is not available."""
    if not 0 < k <= scores.shape[-1] or (valid is not None and valid.dtype != torch.bool) or not on_cpu(scores, valid):
        return None
    return _top_k_operator(scores, k, valid) if torch.compiler.is_compiling() else _top_k(scores, k, valid)


def quest_pages(
    query: torch.Tensor,
    lows: torch.Tensor,
    highs: torch.Tensor,
    pages: int,
    k: int,
    mean: bool,
    page_size: int,
    first: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Quest's choice of pages for rows that page alike, in one C pass per row: `query` (B, Hkv, G, D) float32 against
    the first `pages` pages of `lows` and `highs` (B, Hkv, D, pages or more: per channel, the pages side by side),
    each page's bound (per channel the larger of q x lowest and q x highest, summed over channels) aggregated over the
    group by its largest (or `mean`): the bounds (B, Hkv, pages), and the positions (B, Hkv, (k + 1) x page_size) of
    the k pages with the highest bound in page order (ties to the earlier page), then of page `pages` (the one being
    written), page j's being first + j x page_size + t. None where the C path is not available (another device or
    type, under torch.compile)."""
    batch, heads, group, dim = query.shape
    fits = (
        0 < k <= pages
        and query.dtype == lows.dtype == highs.dtype == torch.float32
        and lows.shape == highs.shape
        and lows.shape[:2] == (batch, heads)
        and lows.shape[2] == dim
        and lows.shape[3] >= pages
        and lows.is_contiguous()
        and highs.is_contiguous()
        and not torch.compiler.is_compiling()
        and on_cpu(query, lows, highs)
    )
    if not fits:
        return None
    query = query.contiguous()
    bounds = torch.empty(batch, heads, pages)
    out = torch.empty(batch, heads, (k + 1) * page_size, dtype=torch.long)
    if kernels().quest_pages(
        query.data_ptr(),
        lows.data_ptr(),
        highs.data_ptr(),
        lows.shape[3],
        batch * heads,
        group,
        dim,
        pages,
        k,
        int(mean),
        page_size,
        first,
        bounds.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    ):
        raise MemoryError(f"quest: no scratch space for {pages} pages")
    return bounds, out


def spread_over_words(scores: torch.Tensor, words: torch.Tensor) -> torch.Tensor | None:
    """`attention_math.spread_over_spans` for float32 scores (B, H, n) and words (B, L), L <= n; None where the C
    path is not available."""
    if scores.dtype != torch.float32 or scores.ndim != 3 or not on_cpu(scores, words):
        return None
    if words.shape[0] != scores.shape[0] or words.shape[-1] > scores.shape[-1]:
        return None  # one batch element's words for every row: the reference broadcasts them
    return _spread_operator(scores, words) if torch.compiler.is_compiling() else _spread(scores, words)


def _tokenrows_fit(batch: int, heads: int, k: int, keys, values, key_out, value_out) -> bool:
    """Keys and values (batch, heads, n, D) of one type and shape have rows of D elements one after another, and the
    outs hold k or more slots of them per (batch, head), contiguous, of that type: what the C gathers copy between."""
    return (
        keys.dim() == 4
        and keys.shape[:2] == (batch, heads)
        and keys.shape == values.shape
        and keys.dtype == values.dtype
        and all(rows_whole(source) for source in (keys, values))
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
    if index.dim() != 3 or index.dtype != torch.long or not on_cpu(index, keys, values, key_out, value_out):
        return False
    batch, heads, k = index.shape
    fits = 0 < k and _tokenrows_fit(batch, heads, k, keys, values, key_out, value_out)
    if fits:
        (_gather_operator if torch.compiler.is_compiling() else _gather)(index, keys, values, key_out, value_out)
    return fits


def put_token(
    store,
    scores: torch.Tensor,
    eviction: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    position: int,
    score: float,
    slot: int | None,
) -> bool:
    """`SelectionState.put`'s write in one call of C: one token (key, value (B, H, 1, D)) into slot `slot` of every
    row and head of `store` (a SlotStore), or with `slot` None into each row's lowest slot by `eviction` (B, H, slots;
    the first of equal ones, as `argmin`), with `position` and `score` (into `scores`, (B, H, slots)). False, with
    nothing written, where the C path is not available or a tensor lies otherwise (a compiled step, another type)."""
    keys, values, positions = store.keys, store.values, store.positions
    batch, heads, slots, dim = keys.shape
    fits = (
        not torch.compiler.is_compiling()
        and keys.dtype == values.dtype == key.dtype == value.dtype == scores.dtype == eviction.dtype == torch.float32
        and key.shape == value.shape == (batch, heads, 1, dim)
        and key.stride(3) == value.stride(3) == 1
        and scores.shape == eviction.shape == positions.shape == (batch, heads, slots)
        and positions.dtype == torch.long
        and all(t.is_contiguous() for t in (keys, values, positions, scores, eviction))
        and (slot is None or 0 <= slot < slots)
        and on_cpu(keys, values, positions, scores, eviction, key, value)
    )
    if fits:
        kernels().put_token(
            keys.data_ptr(),
            values.data_ptr(),
            positions.data_ptr(),
            scores.data_ptr(),
            eviction.data_ptr(),
            batch,
            heads,
            slots,
            dim,
            key.data_ptr(),
            value.data_ptr(),
            BlockStrides.of(key, value),
            -1 if slot is None else slot,
            position,
            score,
        )
    return fits


def refresh_partial(
    per_head: torch.Tensor,
    first_only: bool,
    window: tuple[int, int],
    words: torch.Tensor | None,
    valid: torch.Tensor | None,
    k: int,
    keys: torch.Tensor | None,
    values: torch.Tensor | None,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    carry: tuple[float, float] = (0.0, 0.0),
    rows: torch.Tensor | None = None,
    floor: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> bool:
    """A partial cache refreshed in one C call: `attention_math.selection_scores` with max (or `first_only`)
    aggregation and pooling `window` (before, after), spread over `words` (B, L) when given, -inf where `valid`
    (broadcastable to (B, 1, 1, n)) is False, its top k (`top_k`), and those tokens loaded into the first k slots of
    `store` = (keys, values, positions, scores) of a `SelectionState` as its `load` does, a token the store holds
    there staying in its slot (partial_cache.py `held_slot_order`), the slots from k on emptied;
    with `carry` = (share, below) and share > 0, each token the store holds with a score below `below` (the selected
    ones, not the decoded ones) first scores at least share x its score there, and with `floor` = (positions, scores,
    share) ((B, Hkv, slots) each, a selection kept aside) each token there at least share x its score there. With
    `rows` ((B,) bool), only those batch elements are refreshed; the others' store is left as it is.
    `per_head`: each query head's window-mean probabilities (B, Hkv, G, n), float32; keys and values (B, Hkv, n, D),
    or None: the store's positions and scores alone are written, its keys and values are the caller's to gather (a
    C_f that reads where it lies: `FullStore.gather`). False, with nothing written, where the C path is not available
    or a tensor lies otherwise."""
    key_out, value_out, positions, scores = store
    if (
        per_head.dtype != torch.float32
        or per_head.dim() != 4
        or not on_cpu(per_head, keys, values, *store, words, valid)
    ):
        return False
    batch, heads, _, n = per_head.shape
    compiling = torch.compiler.is_compiling()
    fits = (
        0 < k <= n
        and (
            keys is None
            and values is None
            and not compiling
            or keys is not None
            and values is not None
            and _tokenrows_fit(batch, heads, k, keys, values, key_out, value_out)
            and keys.shape[2] == n
        )
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
                and on_cpu(*floor[:2])
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


def _top_k(scores: torch.Tensor, k: int, valid: torch.Tensor | None) -> torch.Tensor:
    values = scores.float().contiguous()
    n, rows = values.shape[-1], values.numel() // values.shape[-1]
    mask = None if valid is None else valid.expand_as(values).contiguous()
    out = torch.empty(*values.shape[:-1], k, dtype=torch.long)
    if kernels().top_k_in_order(
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
    kernels().spread_over_words(
        values.data_ptr(), words.data_ptr(), batch, heads, n, words.shape[-1], out.data_ptr(), torch.get_num_threads()
    )
    return out


def _gather(index, keys, values, key_out, value_out) -> None:
    index = index.contiguous()
    batch, heads, k = index.shape
    failed = kernels().gather_rows(
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
    failed = kernels().refresh_partial(
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
        None if keys is None else keys.data_ptr(),
        None if values is None else values.data_ptr(),
        BlockStrides() if keys is None else BlockStrides.of(keys, values),
        key_out.shape[3] * key_out.element_size(),
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


_top_k_operator = operator(
    "top_k_in_order",
    _top_k,
    "(Tensor scores, int k, Tensor? valid) -> Tensor",
    lambda scores, k, valid: scores.new_empty((*scores.shape[:-1], k), dtype=torch.long),
)
_spread_operator = operator(
    "spread_over_words",
    _spread,
    "(Tensor scores, Tensor words) -> Tensor",
    lambda scores, words: torch.empty_like(scores),
)
_gather_operator = operator(
    "gather_rows",
    _gather,
    "(Tensor index, Tensor keys, Tensor values, Tensor(a!) key_out, Tensor(b!) value_out) -> ()",
    lambda index, keys, values, key_out, value_out: None,
)
_refresh_operator = operator(
    "refresh_partial",
    _refresh,
    "(Tensor per_head, bool first_only, int before, int after, Tensor? words, Tensor? valid, int k, Tensor keys, "
    "Tensor values, Tensor(a!) key_out, Tensor(b!) value_out, Tensor(c!) positions, Tensor(d!) scores, "
    "float carry, float carried_below, Tensor? floor_positions, Tensor? floor_scores, float floor_share) -> ()",
    lambda *arguments: None,
)
