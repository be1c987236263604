"""`cake` (Qin et al., 2025, "CAKE: Cascading and Adaptive KV Cache Eviction with Layer Preferences", ICLR 2025;
kv-eviction-landscape.txt): layer budgets from how spread and how shifting each layer's attention is, allocated in a
cascade during the prefill, and an eviction indicator that counts attention's variance over time.

Per layer l, from the observation window's attention A (the last `window` queries over the tokens before the window):
- spatial dispersion H_l: the entropy of the attention averaged over the window's queries and the layer's heads;
- temporal shift V_l: the variance of each token's attention across the window's queries, summed over tokens (mean
  over heads);
- preference P_l = H_l^(1/tau1) x V_l^(1/tau2); the layer's share of the total selected budget
  B = (K - window) x layers is P_l / sum(P).
Cascading: as the prompt passes layer m, the budget is shared by preference among layers 1..m only, and every
earlier layer is shrunk to its new share (a layer's tokens once evicted are gone), so the prefill never holds more
than B selected tokens; after the last layer the shares are the final ones.
Eviction indicator of a token, per query head: mean over the window's queries + `gamma` x their variance, max-pooled
over positions (`kernel`), aggregated over the GQA group; each layer keeps its budget's top tokens plus the window.

Choices where the paper is silent or that differ from its released code:
- tau1 = tau2 = 1 by default: the paper tunes them per model and budget (its released configuration lists pairs in
  0.4-2.3); `gamma` 200 is the paper's setting.
- Budgets are integers by largest remainders, capped at the tokens a layer has before its window (the excess shared
  among the others, as in `dynamickv`); a layer whose new share rounds above what it still holds keeps what it
  holds, so the final total can fall a few tokens short of B.
- Per batch row: preferences, budgets and cascade are each row's own (a padded batch equals its rows); every KV head
  of a layer keeps the layer's budget (the paper allocates per layer).
- Pooling is max-pooling (this package's selections; the released code pools by average). `pooling="span"` spreads
  the prompt's pooled indicator over its words as snapkv's does; over held tokens (`compress_every`), which are not
  the prompt's words in order, it pools with the centred kernel.
- `compress_every`: each layer back to its final share (scaled up to B where caps left part unspent), by the
  indicator of the latest `window` queries over the held tokens.
"""

from __future__ import annotations

import dataclasses
from typing import cast

import torch
from torch import Tensor

from ..core.attention_math import Scaling, aggregate_group, attention_probs, pool, spread_if_span
from ..core.policy import PolicyError, is_number, register
from ..core.selection import SelectionLayer, SelectionState, keep_top
from .dynamickv import apportion
from .snapkv import SnapKV


@dataclasses.dataclass
class CakeState(SelectionState):
    preference: torch.Tensor | None = dataclasses.field(default=None, kw_only=True)  # (B,) P_l
    allocated: torch.Tensor | None = dataclasses.field(default=None, kw_only=True)  # (B,) selected tokens held


def check_positive_number(name: str, value: object) -> None:
    if not is_number(value) or value <= 0:
        raise PolicyError(f"{name} must be a number > 0, got {value!r}")


def top_per_row(scores: Tensor, counts: list[int], valid: Tensor | None, keep_last: int = 0) -> Tensor:
    """(B, H, max(counts)) each row's top `counts[b]` of `scores` (B, H, n) in position order (`keep_top`), -1 after."""
    width = min(max(counts), scores.shape[-1])
    index = torch.full((*scores.shape[:2], width), -1, dtype=torch.long, device=scores.device)
    for row, count in enumerate(counts):
        row_valid = None if valid is None else valid[row : row + 1]
        picked, _ = keep_top(scores[row : row + 1], count, row_valid, keep_last)
        index[row, :, : picked.shape[-1]] = picked[0]
    return index


@register
@dataclasses.dataclass
class CAKE(SnapKV):
    """CAKE: layer budgets by preference (attention entropy x temporal variance), allocated in a cascade; tokens by
    mean + gamma x variance of the window's attention.

    Parameters: `budget`: K tokens per KV head per layer on average (or `budget_ratio`: K as a share of the longest
    prompt, 1/8 by default), window included; `window` (32), `kernel` (7) and `pooling` (span), both chosen on the dev
    sets as snapkv's were (`preset="paper"`: the paper's kernel 5, centered), `aggregation` (max) as in snapkv;
    `tau1` (1.0) and `tau2` (1.0) the exponents' temperatures of dispersion and shift; `gamma` (200) the variance's
    weight in the indicator; `compress_every` (None) as in snapkv.
    """

    name = "cake"
    summary = "layer budgets from attention dispersion x temporal shift, cascaded at prefill; mean + variance scores"
    presets = {
        "paper": {
            "window": 32,
            "kernel": 5,
            "pooling": "centered",
            "aggregation": "max",
            "tau1": 1.0,
            "tau2": 1.0,
            "gamma": 200.0,
        }
    }

    kernel: int = 7  # the paper's 5 found fewer needles on the dev sets (docs/results.md)
    tau1: float = 1.0
    tau2: float = 1.0
    gamma: float = 200.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_number("tau1", self.tau1)
        check_positive_number("tau2", self.tau2)
        if not is_number(self.gamma) or self.gamma < 0:
            raise PolicyError(f"gamma must be a number >= 0, got {self.gamma!r}")

    def indicator(self, probs: Tensor) -> Tensor:
        """(B, Hkv, G, w, n) window probabilities -> (B, Hkv, n): mean + gamma x variance over the queries, pooled,
        aggregated over the group (`span` pools as `centered`: held tokens are not the prompt's words in order)."""
        per_head = probs.mean(dim=3) + self.gamma * probs.var(dim=3, unbiased=False)
        return aggregate_group(pool(per_head, self.kernel, self.pooling), self.aggregation)

    def score(
        self, layer: SelectionLayer, query: Tensor, key: Tensor, scaling: Scaling, valid: Tensor | None
    ) -> Tensor:
        """The prompt's indicator, spread over its words with `pooling="span"`."""
        probs = attention_probs(query[:, :, -self.window :], key, scaling, valid, causal_tail=True)
        return spread_if_span(self.indicator(probs), self.pooling, layer.prompt_spans)

    def preference(self, probs: Tensor) -> Tensor:
        """(B,) P_l = H^(1/tau1) x V^(1/tau2) from the window's probabilities over the tokens before the window."""
        before = probs[..., : probs.shape[-1] - self.window].double()
        mean = before.mean(dim=(1, 2, 3))  # (B, P): over heads and queries
        share = mean / mean.sum(-1, keepdim=True).clamp(min=1e-300)
        dispersion = -torch.special.xlogy(share, share).sum(-1)
        shift = before.var(dim=3, unbiased=False).sum(-1).mean(dim=(1, 2))
        return dispersion.clamp(min=0) ** (1 / self.tau1) * shift ** (1 / self.tau2)

    def store_prompt(self, layer: SelectionLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> None:
        length = key.shape[2]
        valid = layer.valid_positions(length, key.device)
        probs = attention_probs(query[:, :, -self.window :], key, scaling, valid, causal_tail=True)
        scores = spread_if_span(self.indicator(probs), self.pooling, layer.prompt_spans)
        scores[..., length - self.window :] = float("inf")  # the window is always kept
        preference = self.preference(probs)
        layers = layer.method_layers()
        done = layers[: layers.index(layer) + 1]
        prefix = length - self.window
        real = torch.full_like(preference, prefix) if layer.pads is None else (prefix - layer.pads).clamp(min=0)
        prior = [cast(CakeState, other.state) for other in done[:-1]]
        weights = torch.stack([cast(Tensor, s.preference) for s in prior] + [preference], dim=-1)
        caps = torch.stack([cast(Tensor, s.allocated) for s in prior] + [real.to(preference.dtype)], dim=-1)
        total = torch.full_like(preference, self.selected_budget(layer) * len(layers))
        budgets = apportion(weights, total, caps)  # (B, layers so far)
        mask = None if valid is None else valid.view(valid.shape[0], 1, -1)
        own = budgets[:, -1]
        index = top_per_row(scores, [b + self.window for b in own.tolist()], mask, self.window)
        held = self.store_selection(layer, key, value, index, scores.gather(-1, index.clamp(min=0)))
        layer.state = CakeState(held.store, held.scores, held.filled, held.empty, preference=preference, allocated=own)
        self.remember_queries(layer, query)
        for other, budget in zip(done[:-1], budgets[:, :-1].unbind(-1)):  # the cascade: earlier layers shrink
            self.shrink(other, budget)

    def shrink(self, layer: SelectionLayer, budget: Tensor) -> None:
        """Keep each row's top `budget` selected tokens of the layer (by their stored indicator) and the window."""
        state = cast(CakeState, layer.state)
        allocated = cast(Tensor, state.allocated)
        budget = torch.minimum(budget, allocated)  # evicted tokens are gone: a layer never grows back
        if torch.equal(budget, allocated):
            return
        valid = state.store.valid(layer.pads)
        slot_index = top_per_row(state.scores, [b + self.window for b in budget.tolist()], valid)
        kept = slot_index.shape[-1]
        state.keep_slots(slot_index, self.slots(layer, kept) - kept)
        state.allocated = budget

    def compression_budget(self, layer: SelectionLayer) -> Tensor:
        """Per row: the layer's final share plus the window, scaled up to the total where caps left part unspent."""
        layers = layer.method_layers()
        allocated = torch.stack([cast(Tensor, cast(CakeState, other.state).allocated) for other in layers], -1)
        total = self.selected_budget(layer) * len(layers)
        spent = allocated.sum(-1)
        own = cast(Tensor, cast(CakeState, layer.state).allocated)
        share = torch.where(spent < total, own * total // spent.clamp(min=1), own)
        share = torch.where(spent == 0, torch.full_like(own, total // len(layers)), share)
        return share + self.window

    def compression_scores(self, layer: SelectionLayer, order: Tensor, scaling: Scaling) -> Tensor:
        keys, real = self.held_tokens(layer, order)
        queries = layer.state.recent_queries
        assert queries is not None, "compression without the observation window's queries"
        return self.indicator(attention_probs(queries, keys, scaling, real, causal_tail=True))
