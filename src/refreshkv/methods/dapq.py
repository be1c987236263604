"""`dapq` (Tian, Su, Li, Zhang, 2026, "Where Matters More Than What: Decoding-aligned KV Cache Compression via
Position-aware Pseudo Queries", arXiv 2603.11564; kv-eviction-landscape.txt): SnapKV's selection, observed by pseudo
queries placed where the answer will be.

SnapKV scores the prompt by its last `window` queries, which sit at the prompt's end; the answer's queries will sit
after it. The paper finds that a query's position decides its attention pattern more than its content, so it builds
pseudo queries at the positions of the tokens to be decoded and lets them observe. Here each of the window's queries
keeps its content and is rotated `window` positions further (RoPE's rotations add), so the window of queries at
positions L - w .. L - 1 becomes pseudo queries at L .. L + w - 1, the first w decoded positions; they attend to
every prompt token (all lie before them), and their attention is averaged, pooled and aggregated as snapkv's, which
then keeps its budget plus the window.

Choices where the paper is silent or that differ from it:
- Content: the window's own queries (the paper forms pseudo tokens and runs them through the model at future
  position ids; at one attention layer, the window's queries moved in position are what a layer can build alone).
- A layer whose RoPE the package cannot undo (`MethodLayer.rope_inv_freq` None: partial rotary) observes with the
  window unmoved, which is snapkv's selection.
- Pooling `span`, window 32 and kernel 7: snapkv's defaults, chosen on the dev sets as snapkv's were;
  `preset="paper"` pools with the centred kernel of SnapKV's released settings.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor

from ..core.attention_math import Scaling, attention_probs, selection_scores
from ..core.policy import register
from ..core.rope import rotate_by
from ..core.selection import SelectionLayer
from .snapkv import SnapKV


@register
@dataclasses.dataclass
class DapQ(SnapKV):
    """DapQ: snapkv's selection observed by the window's queries moved to the first decoded positions.

    Parameters: `budget`: K tokens per KV head (or `budget_ratio`: K as a share of the longest prompt, 1/8 by
    default), window included; `window` (32) queries moved `window` positions ahead; `kernel` (7), `pooling`
    (span; `preset="paper"`: centered), `aggregation` (max) as in snapkv; `compress_every` (None) as in snapkv.
    """

    name = "dapq"
    summary = "snapkv's selection scored by pseudo queries at the answer's positions (the window moved ahead by RoPE)"
    presets = {"paper": {"window": 32, "kernel": 7, "pooling": "centered", "aggregation": "max"}}

    def score(
        self, layer: SelectionLayer, query: Tensor, key: Tensor, scaling: Scaling, valid: Tensor | None
    ) -> Tensor:
        window = query[:, :, -self.window :]
        inv_freq = layer.rope_inv_freq
        if inv_freq is None:
            probs = attention_probs(window, key, scaling, valid, causal_tail=True)
        else:
            pseudo = rotate_by(window, self.window, inv_freq).to(window.dtype)
            probs = attention_probs(pseudo, key, scaling, valid)  # every prompt token precedes them
        return selection_scores(probs, self.kernel, self.aggregation, self.pooling, layer.prompt_spans)
