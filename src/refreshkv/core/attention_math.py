"""Attention math for one layer: SDPA calls in the layouts the stores use, and the scores that selection needs
(for the few queries that need them, never an L x L matrix).

Shapes: query (B, Hq, q, D); keys (B, Hkv, n, D). Grouped-query attention is handled by packing the G = Hq / Hkv
query heads of a group next to each other, so every product is one batched matmul against the KV-head-sized cache.

`scaling` is the layer's logit scale: a float, or `SoftCapped` for a layer that soft-caps its logits (Gemma 2). SDPA
cannot soft-cap, so those layers take an explicit softmax path; methods only pass `scaling` through.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from . import native_attention, native_selection

AGGREGATIONS = ("max", "mean", "first")
# How max-pooling spreads an attention peak over positions: `centered` (SnapKV's and the seeds' kernel: kernel // 2
# tokens either side), `forward` (1 token before the peak and kernel - 2 after it: the rest of a span the peak
# starts, e.g. a number read digit by digit) or `span` (centred, then over the whole of every word the pooled window
# touches: engine/spans.py).
POOLINGS = ("centered", "forward", "span")
# Finite, so that a pad query whose keys are all masked gets a uniform row instead of NaN.
_MASKED = torch.finfo(torch.float32).min
# One query token over at least this many keys on the CPU: two matrix products and a float32 softmax take 0.5-0.9x
# the time of SDPA's flash kernel (2 threads, 1K-8K keys, bfloat16 and float32; SDPA is faster below 1K).
EXPLICIT_DECODE_FROM = 1024
# One query over at least this many keys on a GPU: SDPA over the query heads as they are (`enable_gqa`, a mask repeated
# per query head), not packed into rows of their KV head. Per call on an H200 (benchmarks/experiments/cuda_check.py,
# docs/benchmark.md "On a GPU"), both models' head layouts, float32 and bfloat16: at 4K keys and more the unpacked heads
# took 0.1-0.9x the packed rows' time with and without a mask, at 2K 0.5-1.1x, at 1K 0.9-2.1x; over `refreshkv`'s
# 1K-slot partial cache they made its float32 step 1.1-1.7x slower.
GROUPED_DECODE_FROM = 4096


@dataclasses.dataclass(frozen=True)
class SoftCapped:
    """Logits = cap * tanh(q.k * scale / cap), as Gemma 2's attention computes them."""

    scale: float
    cap: float


Scaling = float | SoftCapped  # a layer's logit scale, as attention functions receive it


def logits_of(packed_query: torch.Tensor, keys: torch.Tensor, scaling) -> torch.Tensor:
    """float32 logits (B, Hkv, rows, n) of packed queries against keys.

    Computed as keys times the transposed queries, then transposed (a view): the large operand stays as it lies.
    Queries times transposed keys was 1.2x slower per refresh step in bfloat16 on the CPU (no difference in float32),
    and under torch.compile the transposed keys were copied.
    """
    products = torch.matmul(keys, packed_query.transpose(-1, -2)).transpose(-1, -2).float()
    if isinstance(scaling, SoftCapped):
        return scaling.cap * torch.tanh(products * scaling.scale / scaling.cap)
    return products * scaling


def _explicit_attention(packed_query, keys, values, scaling, mask) -> torch.Tensor:
    """Softmax attention without SDPA (soft-capped layers): mask (bool, broadcastable to the logits) or None."""
    logits = logits_of(packed_query, keys, scaling)
    if mask is not None:
        logits = logits.masked_fill(~mask, _MASKED)
    return torch.matmul(logits.softmax(dim=-1).to(values.dtype), values)


def pack_queries(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, Hq, q, D) -> (B, Hkv, G * q, D), rows ordered (group member, query position)."""
    batch, heads, q_len, dim = query.shape
    return query.reshape(batch, kv_heads, (heads // kv_heads) * q_len, dim)


def unpack_output(output: torch.Tensor, query_heads: int) -> torch.Tensor:
    """(B, Hkv, G * q, D) -> (B, q, Hq, D), the layout transformers expects from an attention function."""
    batch, _, rows, dim = output.shape
    q_len = rows * output.shape[1] // query_heads
    return output.reshape(batch, query_heads, q_len, dim).transpose(1, 2)


def prompt_attention(query, key, value, mask, scaling) -> torch.Tensor:
    """Causal attention over the prompt (mask: transformers' boolean (B, 1, L, L) padding mask, or None). A soft-capped
    layer also takes queries that are the last q of the keys (plain forwards through another cache)."""
    if isinstance(scaling, SoftCapped):
        q_len, n, group = query.shape[2], key.shape[2], query.shape[1] // key.shape[1]
        if mask is None:  # causal, the queries being the last q_len positions
            mask = torch.arange(n, device=key.device) <= (n - q_len + torch.arange(q_len, device=key.device))[:, None]
        rows = mask.reshape(-1, 1, q_len, n).repeat(1, 1, group, 1)  # packed rows: (group member, position)
        output = _explicit_attention(pack_queries(query, key.shape[1]), key, value, scaling, rows)
        return unpack_output(output, query.shape[1])
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=True
    )
    return output.transpose(1, 2)


def decode_attention(query, keys, values, scaling, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The q newest tokens' queries over a KV-head-sized cache that ends with them, without repeating keys per query
    head; with q > 1 (assisted decoding's drafted tokens) each query sees the keys up to itself.

    One query over `EXPLICIT_DECODE_FROM` keys or more on the CPU is computed explicitly (logits, float32 softmax,
    probabilities times values), faster there than SDPA: in float32 by the C of `native_attention.attend_rows`, in
    0.53-0.85x the time of two matrix products (benchmarks/perf/decode_attention.py); in bfloat16 with the logits and
    probabilities rounded to bfloat16 as in transformers' eager attention. On a GPU one query over
    `GROUPED_DECODE_FROM` keys or more takes SDPA over the unpacked heads (`grouped_decode`)."""
    kv_heads, n, q_len = keys.shape[1], keys.shape[2], query.shape[2]
    mask = None if valid is None else valid.reshape(valid.shape[0], -1, 1, n)
    if q_len > 1:
        # Packed rows are ordered (group member, query position): row r is query r % q, at key position n - q + r % q.
        rows = torch.arange(q_len, device=keys.device).repeat(query.shape[1] // kv_heads)
        causal = torch.arange(n, device=keys.device) <= (n - q_len + rows)[:, None]
        mask = causal if mask is None else mask & causal
    on_cpu = keys.device.type == "cpu"
    if isinstance(scaling, SoftCapped) or (q_len == 1 and on_cpu and n >= EXPLICIT_DECODE_FROM):
        native = native_attention.attend_rows(query, keys, values, scaling, valid) if q_len == 1 else None
        if native is not None:
            return native[0]
        output = _explicit_attention(pack_queries(query, kv_heads), keys, values, scaling, mask)
    elif q_len == 1 and not on_cpu and n >= GROUPED_DECODE_FROM:
        return grouped_decode(query, keys, values, scaling, mask)
    else:
        output = F.scaled_dot_product_attention(
            pack_queries(query, kv_heads), keys, values, attn_mask=mask, scale=scaling
        )
    return unpack_output(output, query.shape[1])


def grouped_decode(query, keys, values, scaling, mask: torch.Tensor | None = None) -> torch.Tensor:
    """One query per query head through SDPA with `enable_gqa`; `mask` (B, 1 or Hkv, 1, n) bool, a KV head's row
    repeated for each of its query heads. Returns (B, 1, Hq, D) as `decode_attention`."""
    if mask is not None and mask.shape[1] > 1:
        mask = mask.repeat_interleave(query.shape[1] // mask.shape[1], dim=1)
    output = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2)


def attend_with_probs(query, keys, values, scaling, valid: torch.Tensor | None = None):
    """One query token over a KV-head-sized cache, keeping the probabilities for methods that score with them.

    Returns the attention output (as `decode_attention`) and the float32 probabilities (B, Hkv, G, n): in float32 on
    the CPU from the C of `native_attention.attend_rows`, elsewhere from `torch_attend_with_probs`.
    """
    native = native_attention.attend_rows(query, keys, values, scaling, valid)
    return torch_attend_with_probs(query, keys, values, scaling, valid) if native is None else native


def torch_attend_with_probs(query, keys, values, scaling, valid: torch.Tensor | None = None):
    """`attend_with_probs` in PyTorch's operators (the reference the C is tested against)."""
    probs = attention_probs(query, keys, scaling, valid)  # (B, Hkv, G, 1, n)
    batch, kv_heads, group, _, n = probs.shape
    probs = probs.view(batch, kv_heads, group, n)
    return weighted_values(probs, values), probs


def weighted_values(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query token's attention output (B, 1, Hq, D) from its probabilities (B, Hkv, G, n) over `values`."""
    output = torch.matmul(probs.to(values.dtype), values)  # (B, Hkv, G, D)
    return unpack_output(output, probs.shape[1] * probs.shape[2])


def attention_probs(
    query: torch.Tensor, keys: torch.Tensor, scaling, valid: torch.Tensor | None = None, causal_tail: bool = False
) -> torch.Tensor:
    """Softmax attention of `query` over `keys` in float32: (B, Hkv, G, q, n).

    `valid` (broadcastable to (B, Hkv, 1, n)) masks pads and empty slots. With `causal_tail`, the q queries are the
    last q positions of the key sequence and each one only sees keys up to itself.
    """
    batch, heads, q_len, _ = query.shape
    kv_heads, n = keys.shape[1], keys.shape[2]
    logits = logits_of(pack_queries(query, kv_heads), keys, scaling).view(batch, kv_heads, heads // kv_heads, q_len, n)
    if valid is not None:
        logits = logits.masked_fill(~valid.view(valid.shape[0], -1, 1, 1, n), _MASKED)
    if causal_tail and q_len > 1:
        future = torch.ones(q_len, q_len, dtype=torch.bool, device=keys.device).triu(1)
        logits[..., n - q_len :] = logits[..., n - q_len :].masked_fill(future, _MASKED)
    return logits.softmax(dim=-1)


def pool(scores: torch.Tensor, kernel: int, pooling: str = "centered") -> torch.Tensor:
    """Max-pool over positions (last dim), same length, so a selected token brings its neighbours (SnapKV); with
    `forward` pooling a peak at p lifts p - 1 .. p + kernel - 2 (see POOLINGS); `span` pools as `centered` here
    (its spread over words is `selection_scores`'). A side wider than the scores pools as one of length - 1 does (all
    of that side): a kernel of a billion costs what one as long as the prompt does."""
    if kernel == 1:
        return scores
    shape = scores.shape
    flat = scores.reshape(-1, 1, shape[-1])
    before, after = (min(side, shape[-1] - 1) for side in pool_window(kernel, pooling))
    kernel = before + after + 1
    padded = F.pad(flat, (before, after), value=float("-inf"))
    if torch.compiler.is_compiling():
        # max_pool1d specializes the compiled step on the length (one recompile per full step); windows do not
        return padded.unfold(-1, kernel, 1).amax(-1).view(shape)
    return F.max_pool1d(padded, kernel_size=kernel, stride=1).view(shape)


def pool_window(kernel: int, pooling: str) -> tuple[int, int]:
    """(before, after): a pooled position takes the highest of itself, the `before` positions before it and `after`
    after it."""
    before = 0 if kernel == 1 else kernel - 2 if pooling == "forward" else kernel // 2
    return before, kernel - 1 - before


def window_mean(probs: torch.Tensor, queries_valid: torch.Tensor | None = None) -> torch.Tensor:
    """(B, Hkv, G, w, n) -> (B, Hkv, G, n): each query head's probabilities averaged over the observation window.
    With `queries_valid` ((B, w) bool), over a row's real queries only: a left-padded row's pad queries see nothing
    but pads, so their probabilities are uniform, which would add to every token's score and shrink the row's real
    ones (ranks unchanged, but a score carried to a later refresh would not be the row's own)."""
    if probs.shape[3] == 1:
        return probs[:, :, :, 0]  # a decode step's one query: a view
    if queries_valid is None:
        return probs.mean(dim=3)
    weights = queries_valid.to(probs.dtype)
    weights = weights / weights.sum(dim=-1, keepdim=True)  # a row's last query is its newest token, never a pad
    return (probs * weights[:, None, None, :, None]).sum(dim=3)


def aggregate_group(scores: torch.Tensor, how: str) -> torch.Tensor:
    """(B, Hkv, G, n) -> (B, Hkv, n): one score per KV head from the query heads sharing it."""
    if how == "max":
        return scores.amax(dim=2)
    if how == "mean":
        return scores.mean(dim=2)
    if how == "first":
        return scores[:, :, 0]
    raise ValueError(f"unknown aggregation '{how}'; choose from: {', '.join(AGGREGATIONS)}")


def spread_over_spans(scores: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """`scores` (B, H, n) with each of the first L positions raised to the highest score of its word (`spans`
    (B, L) from `WordTable.spans`); positions from L on (decoded tokens) keep their own score."""
    spread = native_selection.spread_over_words(scores, spans)
    if spread is not None:
        return spread
    length = spans.shape[-1]
    prompt = scores[..., :length]
    words = spans.unsqueeze(1).expand_as(prompt)
    best = prompt.new_full(prompt.shape, float("-inf"))  # at most L words: no need to read their count
    best = best.scatter_reduce(-1, words, prompt, "amax").gather(-1, words)
    return torch.cat([best, scores[..., length:]], dim=-1) if scores.shape[-1] > length else best


def selection_scores(
    probs: torch.Tensor, kernel: int, how: str, pooling: str = "centered", spans: torch.Tensor | None = None
) -> torch.Tensor:
    """Token importance per KV head from window probabilities (B, Hkv, G, w, n).

    Order (a choice the papers leave open): average over the observation window per query head, max-pool over
    positions per query head, then aggregate across the group. `max` and `first` aggregation commute with
    max-pooling exactly, so for them the group is aggregated first (G times fewer rows to pool). `span` pooling
    then raises each prompt token to its word's highest score (`spans`: the prompt's words, (B, L)).
    """
    per_head = window_mean(probs)
    if how in ("max", "first"):
        scores = pool(aggregate_group(per_head, how), kernel, pooling)
    else:
        scores = aggregate_group(pool(per_head, kernel, pooling), how)
    return spread_if_span(scores, pooling, spans)


def spread_if_span(scores: torch.Tensor, pooling: str, spans: torch.Tensor | None) -> torch.Tensor:
    """A prompt's pooled scores (B, H, n) as they are, or with `pooling="span"` spread over its words
    (`spread_over_spans`; `spans`: the prompt's words, (B, L))."""
    if pooling != "span":
        return scores
    if spans is None:
        raise ValueError("span pooling needs the prompt's word spans (MethodLayer.prompt_spans)")
    return spread_over_spans(scores, spans)


# Below the ordering key of every float32 value, -inf included (only a NaN's bits would map to it): where `valid`
# excludes a position.
_EXCLUDED = torch.iinfo(torch.int32).min


def ordering_keys(scores: torch.Tensor) -> torch.Tensor:
    """int32 keys that order like the float32 values of `scores` (any real value, +-inf included; -0.0 = 0.0).

    A float's bits, read as a signed integer, order like the float for non-negative values and backwards for
    negative ones (sign and magnitude): flipping every bit but the sign of the negative ones fixes that. The flip
    mask comes from an arithmetic shift of the sign (all ones where negative), so it stays three int32 operations:
    at 8K keys per head a refresh spent 0.10 ms per layer here with a `where` over int64, 0.08 ms like this.
    """
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def ranked(scores: torch.Tensor, k: int, sorted: bool = True, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Indices (..., k) of the k highest scores, highest first (in no particular order with `sorted=False`).

    Scores may be any real values (+-inf included; NaN is not a score: callers check, see selection.py). `valid`
    (bool, broadcastable to the scores) excludes positions: they rank after every real score, -inf included, so they
    are taken only when k exceeds the valid ones (callers mark those, see `keep_top`).
    Ties, which max-pooling makes common, go to the earlier position, so the choice does not depend on left padding,
    on how many are taken or on the sort kernel. One integer top-k does it: key * n + (n - 1 - position) orders by
    score, then by earlier position (4x faster than a stable sort).
    """
    length = scores.shape[-1]
    keys = ordering_keys(scores)
    if valid is not None:
        keys = keys.masked_fill(~valid, _EXCLUDED)
    tie_break = torch.arange(length - 1, -1, -1, device=scores.device)
    return tie_break.add(keys, alpha=length).topk(k, dim=-1, sorted=sorted).indices


def top_k(scores: torch.Tensor, k: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """`ranked`'s k indices in position order (what a store keeps): on the CPU one pass of C per row
    (core/native_selection.py), else PyTorch operators."""
    native = native_selection.top_k_in_order(scores, k, valid)
    if native is not None:
        return native
    index = ranked(scores, k, sorted=False, valid=valid)
    if index.device.type != "cpu" or torch.compiler.is_compiling():  # a count read on the host; a shape unknown
        return index.sort(dim=-1).values
    # On the CPU, marking the k positions and reading them back in order costs half a sort of them (8K positions,
    # K = 1024: 0.07 against 0.12-0.17 ms per layer, AVX2 EPYC); every row holds exactly k marks.
    marked = torch.zeros(*index.shape[:-1], scores.shape[-1], dtype=torch.bool).scatter_(-1, index, True)
    return marked.nonzero()[:, -1].view(index.shape)
