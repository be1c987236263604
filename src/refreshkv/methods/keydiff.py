"""`keydiff` (Park et al., 2025, arXiv 2504.15364): keep the keys least like the average key, decided at prefill.

Per KV head, the anchor is the mean of the prompt's unit-length keys (real tokens only); a token's score is minus
the cosine of its key with the anchor, so the top K are the most distinctive keys. No attention is computed.
Choices: the whole prompt is scored at once (the paper scores it block by block as it streams in); decoded tokens
are appended without eviction, as `snapkv` does; under `compress_every` the same score over the held keys (their
own mean as the anchor) brings the cache back to K, which is the paper's streaming eviction applied every N tokens.
As in the paper's rule, keys are scored as the cache holds them (after RoPE) and nothing is protected: no sink, no
recent window. The rule keeps a token only for a key far from the anchor, which is not what the model attends to in two
cases (docs/results.md, "The newer methods" and "Long outputs"; benchmarks/analysis/keydiff_positions.py): a first
token whose key lies near the anchor is dropped though it is the attention sink (Gemma 3's <bos> in two of its three
global layers, in the paper's block-by-block order too), and under `compress_every` the newest decoded tokens, whose
keys resemble each other, are the first evicted, so decoding goes on with little recent context.
The file is the scorer-layer example of docs/adding-a-method.md.
"""

from __future__ import annotations

import dataclasses

import torch.nn.functional as F
from torch import Tensor

from ..core.attention_math import Scaling
from ..core.policy import register
from ..core.selection import SelectionLayer, SelectionPolicy


@register
@dataclasses.dataclass
class KeyDiff(SelectionPolicy):
    """KeyDiff: the K prompt keys least similar to the mean key, per KV head.

    Parameters: `budget`: the K prompt keys kept per KV head, chosen once after the prefill; decoded tokens are added
    beside them (or `budget_ratio`: K as a share of the longest prompt, 1/8 by default); `compress_every` (None)
    N: every N decoded tokens the held keys least like their mean are kept, back to K.
    """

    name = "keydiff"
    summary = "keep the K prompt keys least similar (cosine) to the mean key, per KV head; no attention needed"

    def score(
        self, layer: SelectionLayer, query: Tensor, key: Tensor, scaling: Scaling, valid: Tensor | None
    ) -> Tensor:
        real = None if valid is None else valid.view(valid.shape[0], 1, -1)  # pads add nothing to the anchor
        return distinctness(key, real)

    def compression_scores(self, layer: SelectionLayer, order: Tensor, scaling: Scaling) -> Tensor:
        keys, real = self.held_tokens(layer, order)
        return distinctness(keys, real)  # empty slots add nothing to the anchor


def distinctness(keys: Tensor, real: Tensor | None = None) -> Tensor:
    """KeyDiff's score of each of `keys` (..., n, D): minus the cosine of its key with the anchor, the mean of the
    unit keys of the tokens where `real` (..., n bool, broadcastable; None: all) holds."""
    unit = F.normalize(keys.float(), dim=-1)
    if real is not None:
        unit = unit * real.unsqueeze(-1)
    anchor = F.normalize(unit.sum(dim=-2, keepdim=True), dim=-1)
    return -(unit * anchor).sum(-1)
