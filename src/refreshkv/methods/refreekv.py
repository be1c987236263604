"""`refreekv` (ReFreeKV, Ni et al.): threshold-free pruning; each layer and KV head keeps as many prompt tokens as
its attention needs, decided once after prefill (refreekv.txt §2.2, §2.3, Algorithm 1, Appendix B).

1. Initial ranking (§2.2): the first `sink` (m = 4) positions, then the rest from the end backwards,
   X^ = {x_1..x_m, x_n, x_{n-1}, ..., x_{m+1}}.
2. Reduced attention row (Eq. 2): the attention of the last `rows` (k = 1) prompt queries, averaged over the rows
   that can see each position (the causal analogue of Eq. 2's division by the count of non-zero entries).
3. Uni-Metric (Eq. 1, 3): along the ranking, the cumulative square sum gives ||A~_i||_F; the kept prefix ends at the
   first ranked position i with 1 - ||A~_i||_F / ||A||_F <= T (`threshold`, 1 % by default).
4. Bottom layers (Appendix B): the first `keep_layers` (2) layers keep their whole cache.

Choices where the paper is silent or not directly applicable:
- GQA (the paper prunes per attention head; the cache here is per KV head). `aggregation="norm"` (default): the
  group's G reduced rows are stacked into a G x n matrix and the Uni-Metric is its Frobenius norm, i.e. squares are
  summed over the group before the cumulative sum (Eq. 3 on the stacked rows). `aggregation="max"`: each query head
  applies the criterion to its own row and the KV head keeps the longest of the group's prefixes (every query head's
  own guarantee holds; never fewer tokens than "norm" would keep for the most demanding head).
- Numerics: the criterion is evaluated in the equivalent form "remaining square mass <= (1 - (1 - T)^2) * total"
  (suffix sums in float64), so positions whose attention is tiny but non-zero are never lost to rounding of a
  cumulative sum that has saturated. T = 0 (no loss allowed) keeps every token, even ones whose probability
  underflowed to exactly 0, so `threshold=0` equals `full`.
- Left padding: the ranking is per row over its real tokens (the first m real tokens, then from the end); pads are
  ranked last with zero score and never kept. A row with at most m real tokens keeps everything.
- Bad input: `sink` or `rows` larger than the shortest prompt of the batch raises a PolicyError;
  `budget`/`budget_ratio` are not parameters (the threshold sets the budget), and the cache's reported `budget` is 0.
- Ragged budgets: heads keep different numbers of tokens; indices are padded with -1 up to the largest head of the
  layer (the store is that size plus room for the decoded tokens, SelectionPolicy masks the empty slots). Kept
  tokens are stored in position order; their eviction score is their reduced attention (nothing is evicted while the
  store has room for every decoded token).
- `select` is not `keep_top`'s top-k by score: each head keeps a prefix of a fixed ranking (by position, not by
  score), as long as its criterion asks. The tokens it returns are loaded by the scorer layer
  (`SelectionPolicy.store_selection`, `SelectionState.load`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..core.attention_math import Scaling, attention_probs
from ..core.policy import PolicyError, check_choice, check_positive, check_window, register
from ..core.selection import SelectionLayer, SelectionPolicy

GROUP_REDUCTIONS = ("norm", "max")


def position_ranking(length: int, sink: int, pads: Tensor | None, device: torch.device) -> Tensor:
    """(B or 1, length) positions in ranked order: the first `sink` real tokens, the rest backwards, then the pads."""
    positions = torch.arange(length, device=device)
    pad = torch.zeros(1, 1, dtype=torch.long, device=device) if pads is None else pads.view(-1, 1)
    relative = positions - pad  # (B, length)
    key = torch.where(relative < sink, relative, sink + (length - 1 - positions))
    key = torch.where(relative < 0, 2 * length + positions, key)  # pads last
    return key.argsort(dim=-1)


def kept_counts(ranked_squares: Tensor, threshold: float) -> Tensor:
    """Kept prefix length along the last dim of ranked squared scores: 1 + the first i with 1 - ||A~_i||/||A|| <= T.

    1 - sqrt(C_i / S) <= T  <=>  S - C_i <= (1 - (1 - T)^2) S, with C_i the cumulative and S the total square sum.
    """
    length = ranked_squares.shape[-1]
    if threshold == 0:
        return torch.full(
            ranked_squares.shape[:-1],
            length,
            dtype=torch.long,
            device=ranked_squares.device,
        )
    squares = ranked_squares.double()
    suffix = squares.flip(-1).cumsum(-1).flip(-1)  # suffix[i] = mass at ranked positions >= i
    total = suffix[..., :1]
    remaining = torch.cat([suffix[..., 1:], torch.zeros_like(total)], dim=-1)  # mass after keeping 0..i
    done = remaining <= (1 - (1 - threshold) ** 2) * total
    return done.int().argmax(dim=-1) + 1  # the last entry is always done (remaining = 0)


def reduced_rows(probs: Tensor) -> Tensor:
    """Eq. 2: (B, Hkv, G, k, n) attention of the last k queries -> (B, Hkv, G, n), each position's mean over the
    rows that can see it (the last k positions are seen by fewer rows under the causal mask)."""
    k, n = probs.shape[-2], probs.shape[-1]
    seen_by = torch.full((n,), k, dtype=probs.dtype, device=probs.device)
    seen_by[n - k :] = torch.arange(k, 0, -1, dtype=probs.dtype, device=probs.device)
    return probs.sum(dim=-2) / seen_by


@register
@dataclasses.dataclass
class ReFreeKV(SelectionPolicy):
    """ReFreeKV: per layer and KV head, ranked tokens kept until the attention norm loss is within T; no budget.

    Parameters: `threshold` (0.01) T; `sink` (4) initial tokens ranked first; `rows` (1) last prompt queries whose
    attention is reduced; `keep_layers` (2) bottom layers that keep everything; `aggregation` (norm) over a GQA
    group.
    """

    name = "refreekv"
    summary = "threshold-free: per layer and head keep ranked tokens until the attention norm loss is <= T"
    budget_parameters = ("threshold",)
    no_compression = "it has no budget to bring a layer back to (its threshold decides, once, at prefill)"

    threshold: float = 0.01
    sink: int = 4
    rows: int = 1
    keep_layers: int = 2
    aggregation: str = "norm"

    def __post_init__(self) -> None:
        if self.budget is not None or self.budget_ratio is not None:
            raise PolicyError("refreekv sets its budget from the threshold T; do not give budget or budget_ratio")
        if (
            isinstance(self.threshold, bool)
            or not isinstance(self.threshold, (int, float))
            or not (0 <= self.threshold < 1)
        ):
            raise PolicyError(f"threshold must be a number in [0, 1), got {self.threshold!r}")
        check_positive("sink", self.sink)
        check_positive("rows", self.rows)
        if isinstance(self.keep_layers, bool) or not isinstance(self.keep_layers, int) or self.keep_layers < 0:
            raise PolicyError(f"keep_layers must be an integer >= 0, got {self.keep_layers!r}")
        check_choice("aggregation", self.aggregation, GROUP_REDUCTIONS)
        if self.compress_every is not None:
            raise PolicyError(f"method 'refreekv' cannot compress during decoding: {self.no_compression}")

    @classmethod
    def parameters(cls) -> dict[str, object]:
        params = super().parameters()
        params.pop("budget")
        params.pop("budget_ratio")
        params.pop("compress_every")  # refused with its reason (`no_compression`)
        return params

    def check_prompt(self, shortest: int) -> None:
        check_window("sink", self.sink, shortest)
        check_window("rows", self.rows, shortest)

    @classmethod
    def keep_everything(cls, context: int) -> dict[str, object]:
        return {"threshold": 0.0}

    def budget_for(self, prompt_length: int) -> int:
        return 0  # no preset budget: the threshold decides

    def select(
        self, layer: SelectionLayer, query: Tensor, key: Tensor, scaling: Scaling, valid: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        batch, kv_heads, length = key.shape[0], key.shape[1], key.shape[2]
        pads = layer.pads
        if layer.layer_idx < self.keep_layers:
            index = torch.arange(length, device=key.device).expand(batch, kv_heads, length)
            return index, torch.ones(index.shape, device=key.device)

        probs = attention_probs(query[:, :, -self.rows :], key, scaling, valid, causal_tail=True)
        reduced = reduced_rows(probs)  # (B, Hkv, G, n)
        if valid is not None:
            reduced = reduced.masked_fill(~valid.view(batch, 1, 1, length), 0.0)
        ranking = position_ranking(length, self.sink, pads, key.device)  # (B or 1, n)
        ranked = reduced.gather(-1, ranking.view(-1, 1, 1, length).expand_as(reduced))
        if self.aggregation == "norm":
            counts = kept_counts(ranked.square().sum(dim=2), self.threshold)
        else:
            counts = kept_counts(ranked.square(), self.threshold).amax(dim=2)
        # Pads are never kept; a row with at most `sink` real tokens (a very short prompt) keeps all of them.
        real = torch.full((1, 1), length, device=key.device) if pads is None else (length - pads).view(-1, 1)
        counts = torch.where(real <= self.sink, real, counts.minimum(real))

        width = int(counts.max())
        candidates = ranking[..., :width].view(-1, 1, width).expand(batch, kv_heads, width)
        keep = torch.arange(width, device=key.device) < counts.unsqueeze(-1)
        order_key = torch.where(keep, candidates, 2 * length)
        index = order_key.sort(dim=-1).values  # kept positions in position order, unused entries last
        index = index.masked_fill(index >= length, -1)
        scores = reduced.mean(dim=2).gather(-1, index.clamp(min=0))
        return index, scores
