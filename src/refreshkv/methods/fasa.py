"""`fasa` (FASA: Frequency-aware Sparse Attention, kv-eviction-landscape.txt): the full cache, and at every decode
step a query-aware choice of K tokens predicted from a few RoPE frequency chunks.

RoPE turns each pair of dimensions (i, i + D/2) at its own frequency: a frequency chunk (FC). FASA's finding is that
a small, identifiable subset of "dominant" FCs per head agrees closely with the whole head's attention, so the
partial logits over those dimensions alone are a nearly free proxy for which tokens the query will attend to. Each
decode step, per KV head:
1. the current query's logits over the whole cache, from the dominant FCs' dimensions only (a `chunk_ratio` share
   of the key bytes is read);
2. the K tokens those partial scores rank highest (aggregated over the GQA group), plus the newest token;
3. exact attention over those K + 1 tokens alone (their whole keys and values are read).
Nothing is evicted (like `quest`, the method saves reading, not memory).

Choices where the paper is silent or that differ from it:
- Identifying the dominant FCs: the paper identifies them once per model, offline. Here each layer calibrates at
  prefill from the prompt: for each KV head and FC, the agreement of the FC's partial logits with the full logits of
  the last `window` prompt queries (their Pearson correlation over the real prompt tokens, averaged over the window
  and the group), and the top `chunk_ratio` of FCs are dominant for the rest of the generation.
- `chunk_ratio` 0.25 and `window` 32 are this package's choices.
- Ranking by the partial logits' softmax, aggregated over the group by `aggregation` (max), as `oracle` ranks by the
  exact ones; the chosen tokens' attention is renormalised over them.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..core.attention_math import AGGREGATIONS, Scaling, aggregate_group, logits_of, pack_queries, top_k, unpack_output
from ..core.contract import MethodLayer
from ..core.kvstore import FullStore, LayerState, gather_tokens
from ..core.policy import BudgetPolicy, PolicyError, check_choice, check_positive, check_window, is_number, register


class FasaState(LayerState):
    """Every token (`full`) and each KV head's dominant dimensions (B, Hkv, d), both halves of each dominant FC."""

    def __init__(self, full: FullStore, dims: Tensor):
        self.full, self.dims = full, dims

    def nbytes(self) -> int:
        return self.full.nbytes()

    def kept(self, pads: Tensor | None) -> Tensor:
        return self.full.kept(pads)


FasaLayer = MethodLayer[FasaState]


def chunk_agreement(window: Tensor, key: Tensor, real: Tensor | None) -> Tensor:
    """(B, Hkv, D/2): per KV head and frequency chunk (dims i and i + D/2), the Pearson correlation over the real
    tokens between the chunk's partial logits and the full logits, averaged over the window's queries and the group.
    `window` (B, Hq, w, D), `key` (B, Hkv, L, D), `real` (B, 1, L) bool or None."""
    batch, kv_heads, length, dim = key.shape
    half = dim // 2
    queries = pack_queries(window.float(), kv_heads)  # (B, Hkv, G*w, D)
    keys = key.float()
    weight = torch.ones(batch, 1, 1, length, device=key.device) if real is None else real.float().unsqueeze(2)
    count = weight.sum(-1, keepdim=True).clamp(min=1)

    def centred(logits: Tensor) -> Tensor:  # (B, Hkv, rows, L): minus the mean over the real tokens, pads zeroed
        mean = (logits * weight).sum(-1, keepdim=True) / count
        return (logits - mean) * weight

    full = centred(torch.matmul(queries, keys.transpose(-1, -2)))
    full_norm = full.square().sum(-1).sqrt()
    agreement = []
    for i in range(half):
        pair = [i, i + half]
        partial = centred(torch.matmul(queries[..., pair], keys[..., pair].transpose(-1, -2)))
        correlation = (partial * full).sum(-1) / (partial.square().sum(-1).sqrt() * full_norm).clamp(min=1e-30)
        agreement.append(correlation.mean(-1))
    return torch.stack(agreement, dim=-1)


@register
@dataclasses.dataclass
class FASA(BudgetPolicy[FasaState]):
    """FASA: the full cache; each step the K tokens that the query's dominant RoPE frequency chunks rank highest, plus
    the newest, attended exactly.

    Parameters: `budget`: K tokens per KV head attended per step (or `budget_ratio`: K as a share of the longest
    prompt, 1/8 by default); `chunk_ratio` (0.25) share of the frequency chunks that predict; `window` (32) last prompt
    queries that calibrate which chunks dominate; `aggregation` (max) over a GQA group.
    """

    name = "fasa"
    summary = "full cache; each step's top-K tokens predicted from a few dominant RoPE frequency chunks (query-aware)"
    no_compression = "it keeps the whole cache and chooses the tokens each step attends to"

    chunk_ratio: float = 0.25
    window: int = 32
    aggregation: str = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not is_number(self.chunk_ratio) or not 0 < self.chunk_ratio <= 1:
            raise PolicyError(f"chunk_ratio must be a number in (0, 1], got {self.chunk_ratio!r}")
        check_positive("window", self.window)
        check_choice("aggregation", self.aggregation, AGGREGATIONS)

    def check_prompt(self, shortest: int) -> None:
        check_window("window", self.window, shortest)

    def store_prompt(self, layer: FasaLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> None:
        store = layer.full_store(key)
        assert isinstance(store, FullStore)  # a dense store: the transformers cache's or an engine's
        store.append(key, value)
        valid = layer.valid_positions(key.shape[2], key.device)
        real = None if valid is None else valid.view(valid.shape[0], 1, -1)
        agreement = chunk_agreement(query[:, :, -self.window :], key, real)  # (B, Hkv, D/2)
        half = agreement.shape[-1]
        chunks = top_k(agreement, max(1, round(self.chunk_ratio * half)))  # in order
        layer.state = FasaState(store, torch.cat([chunks, chunks + half], dim=-1))

    def decode(self, layer: FasaLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> Tensor:
        state = layer.state
        state.full.append(key, value)
        keys, values = state.full.view()
        n, kv_heads = keys.shape[2], keys.shape[1]
        packed = pack_queries(query, kv_heads)  # (B, Hkv, G, D)
        valid = layer.valid_positions(n, keys.device)
        if layer.budget + 1 >= n:  # every token fits: plain attention
            logits = logits_of(packed, keys, scaling)
            if valid is not None:
                logits = logits.masked_fill(~valid, float("-inf"))
            layer.record(0.0, state.full.attended_bytes())
            output = torch.matmul(logits.softmax(dim=-1).to(values.dtype), values)
            return unpack_output(output, query.shape[1])
        chosen = self._choose(layer, packed, keys)
        newest = torch.full_like(chosen[..., :1], n - 1)
        index = torch.cat([chosen, newest], dim=-1)  # (B, Hkv, K + 1)
        picked_keys, picked_values = gather_tokens(index, keys, values)
        logits = logits_of(packed, picked_keys, scaling)
        output = torch.matmul(logits.softmax(dim=-1).to(picked_values.dtype), picked_values)
        per_token = 2 * keys.shape[-1] * keys.element_size() * keys.shape[0] * kv_heads  # keys and values
        partial_bytes = state.dims.shape[-1] * keys.element_size() * keys.shape[0] * kv_heads * n
        layer.record(0.0, partial_bytes + per_token * index.shape[-1])
        return unpack_output(output, query.shape[1])

    def _choose(self, layer: FasaLayer, packed: Tensor, keys: Tensor) -> Tensor:
        """(B, Hkv, K) the tokens besides the newest that the dominant chunks' partial logits rank highest."""
        n, dims = keys.shape[2], layer.state.dims  # (B, Hkv, d)
        valid = layer.valid_positions(n, keys.device)
        partial_query = packed.gather(-1, dims.unsqueeze(2).expand(-1, -1, packed.shape[2], -1))
        partial_keys = keys.gather(-1, dims.unsqueeze(2).expand(-1, -1, n, -1))
        partial = torch.matmul(partial_query.float(), partial_keys.float().transpose(-1, -2))  # (B, Hkv, G, n)
        if valid is not None:
            partial = partial.masked_fill(~valid, float("-inf"))
        ranking = aggregate_group(partial.softmax(dim=-1), self.aggregation)[..., : n - 1]  # the newest is kept
        return top_k(ranking, layer.budget, None if valid is None else valid.view(valid.shape[0], 1, -1)[..., :-1])

    def selection(self, layer: FasaLayer, query: Tensor, scaling: Scaling) -> Tensor | None:
        """The step's K chosen tokens and the newest one, recomputed; None when every token fits."""
        keys, _ = layer.state.full.view()
        n = keys.shape[2]
        if layer.budget + 1 >= n:
            return None
        chosen = self._choose(layer, pack_queries(query, keys.shape[1]), keys)
        return torch.cat([chosen, torch.full_like(chosen[..., :1], n - 1)], dim=-1)
