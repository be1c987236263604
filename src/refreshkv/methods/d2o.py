"""`d2o` (Wan et al., 2024, "D2O: Dynamic Discriminative Operations for Efficient Long-Context Inference of Large
Language Models", arXiv 2406.13035, ICLR 2025): layer budgets from how dense each layer's prompt attention is, and
H2O's eviction in each layer with the evicted tokens merged into their most similar kept token when similar enough.

Layer level: layers whose attention is spread densely over the prompt lose more by eviction, so they keep more. The
paper measures a layer's density by the variance of its attention; here, per batch row, a layer's statistic is the
standard deviation over the real prompt tokens of each token's share of the layer's cumulative attention (H2O's
score, normalized to sum 1, mean over KV heads), and the layer's weight is std^(-1/`temperature`): low variance (dense,
uniform attention) gets more. Every layer keeps at least K // 2 (at least 1); the rest of the total K x layers is
shared in proportion to the weights.

Token level, per KV head: H2O's selection within the layer's budget b (b // 2 heavy hitters by cumulative attention
over the prompt, the last b - b // 2 tokens recent). Each evicted token e is compared with every kept token c by the
cosine of their keys u(e, c); its nearest kept token c* = argmax_c u(e, c). The threshold is the paper's
initialization of its exponential moving average at the prompt, tau_0 = the mean over the evicted tokens of
max_c u(e, c); a token with max_c u(e, c) >= tau_0 is merged into c*, the others are dropped. Merging, the paper's
weights (a softmax over the similarities in which the kept token counts its similarity 1 to itself): at a kept
token c with merged tokens E_c,
    k_c <- w_c k_c + sum_{e in E_c} w_e k_e  (values alike),  w_e = exp(u(e, c)) / Z,  w_c = exp(1) / Z,
    Z = exp(1) + sum_{e in E_c} exp(u(e, c)).

Decoded tokens are appended without eviction (as snapkv and kvmerger); `compress_every` evicts by the stored scores
back to each layer's budget, without merging. The paper evicts one token per decoding step, merging it and moving
its threshold as tau_t = `beta` max(U_t) + (1 - `beta`) tau_(t-1); that per-step merging is not done here, and
`beta` is therefore not a parameter.

Sources: the paper's abstract and overview (budgets from the variance of each layer's attention; eviction plus merging
under a moving-average similarity threshold), and its threshold and merge weights (Eq. 9-12) as restated in public
code that cites them; the paper's own layer formula was not at hand, so the layer statistic below is this package's.

Choices where the paper is silent or that differ from it:
- The floor of K // 2 per layer (the paper states no least budget; without one a layer of sharp attention could
  be left with no token).
- The density statistic (std of the cumulative-attention shares, not the variance of the raw attention map) and
  the weight std^(-1/temperature), temperature 1 by default; budgets are integers by largest remainders, capped at
  each row's real prompt length, the excess shared among the other layers (`dynamickv`'s `apportion`).
- Budgets are allocated once every layer has seen the prompt: each layer holds its whole prompt until the last layer
  of the method has stored its own, then every layer is cut to its budget (the prefill holds the full cache for that
  moment, as `full` does).
- Per batch row: statistics, budgets, thresholds and merges are each row's own (a padded batch equals its rows);
  every KV head of a layer keeps the layer's budget; the threshold tau_0 is each KV head's own.
- Cumulative attention aggregated over a GQA group by `aggregation` (max), as `h2o`; a merged token keeps its
  position and its score.
- Under `compress_every`, each row back to its layer's budget, the last half of the batch's smallest budget in the
  layer protected (H2O's recent window); decoded tokens are scored as in snapkv.
"""

from __future__ import annotations

import dataclasses
import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.attention_math import AGGREGATIONS, Scaling
from ..core.policy import PolicyError, check_choice, is_number, register
from ..core.selection import SelectionLayer, SelectionPolicy, SelectionState, checked_scores, keep_top
from .dynamickv import apportion
from .h2o import cumulative_attention, split_budget

SIMILARITY_BLOCK = 1024  # evicted tokens compared at once: memory (B, Hkv, 1024, L) floats


@dataclasses.dataclass
class D2OState(SelectionState):
    density: Tensor | None = dataclasses.field(default=None, kw_only=True)  # (B,) std of the attention shares
    allocated: Tensor | None = dataclasses.field(default=None, kw_only=True)  # (B,) the layer's budget
    prompt: tuple[Tensor, Tensor, Tensor] | None = dataclasses.field(default=None, kw_only=True)  # keys, values, scores


def attention_spread(scores: Tensor, valid: Tensor | None) -> Tensor:
    """(B,) the std over the real tokens of each token's share of the cumulative attention `scores` (B, Hkv, L),
    mean over the KV heads."""
    real = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid.view(valid.shape[0], 1, -1)
    real = real.expand_as(scores)
    mass = scores.double().masked_fill(~real, 0.0)
    share = mass / mass.sum(-1, keepdim=True).clamp(min=1e-300)
    count = real.sum(-1, keepdim=True).clamp(min=1)
    mean = share.sum(-1, keepdim=True) / count
    variance = ((share - mean).square() * real).sum(-1) / count.squeeze(-1)
    return variance.sqrt().mean(-1)


def merge_evicted(keys: Tensor, values: Tensor, kept: Tensor, real: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """D2O's compensation: keys and values (B, Hkv, L, D) with each evicted real token whose best key cosine to a
    kept token reaches the head's threshold merged into that kept token; `kept`, `real` (B, Hkv, L) bool. Also
    returns each token's merge target (B, Hkv, L), -1 for a token not merged."""
    length = keys.shape[2]
    evicted = real & ~kept
    target = torch.full(kept.shape, -1, dtype=torch.long, device=keys.device)
    if not bool(evicted.any()) or not bool(kept.any()):
        return keys, values, target
    unit = F.normalize(keys.float(), dim=-1)
    best = torch.full(kept.shape, float("-inf"), device=keys.device)
    nearest = torch.zeros_like(target)
    for start in range(0, length, SIMILARITY_BLOCK):
        end = min(start + SIMILARITY_BLOCK, length)
        cosine = unit[:, :, start:end] @ unit.transpose(-1, -2)  # (B, Hkv, block, L)
        cosine = cosine.masked_fill(~kept.unsqueeze(-2), float("-inf"))
        best[..., start:end], nearest[..., start:end] = cosine.max(-1)
    count = evicted.sum(-1, keepdim=True)
    threshold = torch.where(evicted, best, 0.0).sum(-1, keepdim=True) / count.clamp(min=1)  # tau_0 per head
    merged = evicted & (best >= threshold)
    if not bool(merged.any()):
        return keys, values, target
    target = torch.where(merged, nearest, -1)
    weight = torch.where(merged, best.clamp(max=1.0).exp(), 0.0)  # exp(u(e, c*))
    into = nearest.masked_fill(~merged, 0)
    total = torch.full_like(weight, math.e).scatter_add(-1, into, weight)  # at each kept token: Z
    out = []
    for tensor in (keys, values):
        summed = (tensor.float() * math.e).scatter_add(
            -2, into.unsqueeze(-1).expand_as(tensor), tensor.float() * weight.unsqueeze(-1)
        )
        combined = summed / total.unsqueeze(-1)
        out.append(torch.where(kept.unsqueeze(-1), combined, tensor.float()).to(tensor.dtype))
    return out[0], out[1], target


def heavy_and_recent(scores: Tensor, budgets: list[int], real: Tensor) -> Tensor:
    """(B, Hkv, max(budgets)) per row: H2O's selection within the row's budget b (b // 2 heavy hitters by `scores`,
    the last b - b // 2 real tokens), in position order; -1 after a row's own."""
    width = min(max(budgets), scores.shape[-1])
    index = torch.full((*scores.shape[:2], width), -1, dtype=torch.long, device=scores.device)
    for row, budget in enumerate(budgets):
        picked, _ = keep_top(scores[row : row + 1], budget, real[row : row + 1], split_budget(budget)[1])
        index[row, :, : picked.shape[-1]] = picked[0]
    return index


@register
@dataclasses.dataclass
class D2O(SelectionPolicy):
    """D2O: layer budgets by attention density (denser layers keep more); H2O's eviction per layer, each evicted
    token merged into its most similar kept key (softmax weights) when its similarity reaches the mean best one.

    Parameters: `budget`: K tokens per KV head per layer on average (or `budget_ratio`: K as a share of the longest
    prompt, 1/8 by default); `temperature` (1.0) of the layer weights std^(-1/temperature); `aggregation` (max) of
    the cumulative attention over a GQA group; `compress_every` (None: decoded tokens appended) N: every N decoded
    tokens each layer back to its budget by the stored scores, without merging.
    """

    name = "d2o"
    summary = "layer budgets by attention density; H2O eviction with evicted tokens merged into similar kept keys"

    temperature: float = 1.0
    aggregation: str = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not is_number(self.temperature) or not self.temperature > 0:
            raise PolicyError(f"temperature must be a number > 0, got {self.temperature!r}")
        check_choice("aggregation", self.aggregation, AGGREGATIONS)

    def score(
        self, layer: SelectionLayer, query: Tensor, key: Tensor, scaling: Scaling, valid: Tensor | None
    ) -> Tensor:
        return cumulative_attention(query, key, scaling, valid, self.aggregation)

    def score_key(self) -> str:
        # the cumulative attention depends on neither K nor the temperature
        return repr(dataclasses.replace(self, budget=None, budget_ratio=None, temperature=1.0))

    def layer_budgets(self, density: Tensor, count: Tensor, budget: int) -> Tensor:
        """(B, layers) integer budgets from the layers' spreads `density` (B, layers) and each row's real prompt
        tokens `count` (B,): K // 2 (at least 1) each, the rest of K x layers in proportion to
        std^(-1/temperature), each at most `count`."""
        floor = count.clamp(max=max(1, budget // 2)).unsqueeze(-1).expand_as(density)
        caps = count.unsqueeze(-1).expand_as(density) - floor
        total = (budget * density.shape[-1] - floor.sum(-1)).clamp(min=0)
        # std^(-1/temperature), the denser (lower spread) weighing more, scaled so the largest is 1 (no overflow at
        # a small temperature)
        exponent = -density.double().clamp(min=1e-12).log() / self.temperature
        weights = (exponent - exponent.amax(-1, keepdim=True)).exp()
        return floor + apportion(weights, total, caps)

    def store_prompt(self, layer: SelectionLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> None:
        length = key.shape[2]
        valid = layer.valid_positions(length, key.device)
        scores = self.select_scores(layer, query, key, scaling, valid)
        empty = SelectionState.empty_like(key, 0)  # nothing held until the budgets are known
        density = attention_spread(scores, valid)
        layer.state = D2OState(empty.store, empty.scores, 0, 0, density=density, prompt=(key, value, scores))
        layers = layer.method_layers()
        if layers.index(layer) != len(layers) - 1:
            return  # the budgets need every layer's density
        real = torch.ones(key.shape[:3], dtype=torch.bool, device=key.device)
        if valid is not None:
            real = real & valid.view(valid.shape[0], 1, -1)
        density = torch.stack([cast(Tensor, cast(D2OState, other.state).density) for other in layers], dim=-1)
        budgets = self.layer_budgets(density, real[:, 0].sum(-1), layer.budget)
        for other, own in zip(layers, budgets.unbind(-1)):
            self.cut(other, own, real)

    def select_scores(
        self, layer: SelectionLayer, query: Tensor, key: Tensor, scaling: Scaling, valid: Tensor | None
    ) -> Tensor:
        shared, score_key = layer.prompt_scores, (type(self), self.score_key())
        if shared is not None and score_key in shared:
            return shared[score_key]
        scores = checked_scores(self.name, self.score(layer, query, key, scaling, valid), key)
        if shared is not None:
            shared[score_key] = scores
        return scores

    def cut(self, layer: SelectionLayer, budget: Tensor, real: Tensor) -> None:
        """The layer down to its budget per row: H2O's selection, the evicted tokens merged or dropped."""
        state = cast(D2OState, layer.state)
        assert state.prompt is not None, "a layer without its prompt"
        key, value, scores = state.prompt
        index = heavy_and_recent(scores, [int(b) for b in budget.tolist()], real)
        kept = torch.zeros(key.shape[:3], dtype=torch.bool, device=key.device)
        kept.scatter_(-1, index.clamp(min=0), index >= 0)
        key, value, _ = merge_evicted(key, value, kept & real, real)
        held = self.store_selection(layer, key, value, index, scores.gather(-1, index.clamp(min=0)))
        layer.state = D2OState(
            held.store, held.scores, held.filled, held.empty, density=state.density, allocated=budget
        )

    def recent_kept(self, layer: SelectionLayer) -> int:
        allocated = getattr(layer.state, "allocated", None)
        budget = layer.budget if allocated is None else int(cast(Tensor, allocated).min())
        return split_budget(budget)[1]

    def compression_budget(self, layer: SelectionLayer) -> int | Tensor:
        return cast(Tensor, cast(D2OState, layer.state).allocated)
