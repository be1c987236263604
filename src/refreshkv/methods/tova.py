"""`tova` (Oren et al., 2024, "Transformers are Multi-State RNNs", listed in kv-eviction-landscape.txt): Token
Omission Via Attention. A fixed cache of K tokens per layer; at every decode step the current query's attention
decides alone (no accumulation, unlike H2O): the token it attends to least, averaged over all heads of the layer,
is dropped.

Choices:
- One decision per layer (TOVA's head-averaged score), so every KV head keeps the same positions in the same slots.
- Prefill: the rule applied once, with the last prompt token's attention (the paper applies it token by token; an
  L x L score matrix is not allowed here); it keeps the top K prompt tokens, ties to the earlier position.
- The store has K + 1 slots: the new token is attended with the K kept ones, and the lowest-scored of the K + 1 is
  evicted when the next token takes its slot (the same decision, as in `h2o`).
"""

from __future__ import annotations

import dataclasses

from torch import Tensor

from ..core.attention_math import Scaling, attention_probs
from ..core.policy import register
from ..core.selection import SelectionLayer, SelectionPolicy


def layer_scores(probs: Tensor, valid: Tensor | None) -> Tensor:
    """(B, Hkv, G, n) probabilities -> (B, Hkv, n): the mean over every query head of the layer, in every KV head;
    slots that hold no real token get -inf (they are filled or evicted first, never kept)."""
    scores = probs.mean(dim=(1, 2), keepdim=True)[:, :, 0].expand(-1, probs.shape[1], -1)
    return (
        scores
        if valid is None
        else scores.masked_fill(~valid.view(valid.shape[0], -1, scores.shape[-1]), float("-inf"))
    )


@register
@dataclasses.dataclass
class TOVA(SelectionPolicy):
    """TOVA: the K tokens the current query attends to most (averaged over the layer's heads); one evicted per step.

    Parameters: `budget`: the K tokens a layer keeps after the prefill and between decode steps (its store has K + 1
    slots: each step's token takes the evicted one's) (or `budget_ratio`: K as a share of the longest prompt, 1/8 by
    default); `compress_every` (None: one token evicted per step) N: no eviction for N steps, then the tokens
    the latest query attends to least go together, back to K.
    """

    name = "tova"
    summary = "keep the K tokens the current query attends to most (head-averaged); drop the least every step"

    def max_slots(self, layer: SelectionLayer) -> int:
        return layer.budget + 1  # K kept + the newest token

    def score(
        self, layer: SelectionLayer, query: Tensor, key: Tensor, scaling: Scaling, valid: Tensor | None
    ) -> Tensor:
        return layer_scores(attention_probs(query[:, :, -1:], key, scaling, valid)[:, :, :, 0], valid)

    def observe(self, layer: SelectionLayer, probs: Tensor) -> None:
        layer.state.scores = layer_scores(probs, layer.state.store.valid(layer.pads))
