"""`think` (Xu et al., 2024, "ThinK: Thinner Key Cache by Query-Driven Pruning", arXiv 2407.21018;
kv-eviction-landscape.txt): fewer key channels, chosen by the queries, on top of a token selection.

Key channels matter unequally: per KV head, ThinK scores channel c by how much it can contribute to the observation
window's attention logits, ||Q_w[:, c] K[:, c]^T||_F over the window's queries Q_w and the held keys K, and keeps the
top (1 - `prune_ratio`) x D channels of the prompt's held keys; the pruned channels are not stored. A decode step
multiplies its query's kept channels with the pruned keys. ThinK is orthogonal to token eviction: the tokens are
chosen first by `token_method` (snapkv by default, with this method's budget and window), then their keys are
thinned. Values are kept whole, as in the paper's main method.

Choices where the paper is silent or that differ from its released code:
- The Frobenius norm of the rank-one matrix Q_w[:, c] K[:, c]^T is ||Q_w[:, c]|| x ||K[:, c]||, computed that way
  (no window x L product); with grouped-query attention a KV head's score sums its query heads' (the channels of a
  KV head are shared by its group).
- Decoded tokens keep every channel (the paper prunes the prefill's cache); the window is pruned with the rest.
- `prune_ratio` 0.4: the paper's main setting (it reports 0.4 and 0.5).
- `token_method`: a selection made per layer at prefill that appends decoded tokens (`snapkv`, `pyramidkv`, `adakv`,
  `defensivekv`, `keydiff`), or `none` (every prompt token, only the channels pruned). Methods that evict while
  decoding, or that reallocate across layers' states (dynamickv), are not composed; nor is `compress_every`.
- The kept channels are stored in channel order, so with `prune_ratio` 0 the logits are `full`'s up to summation
  order.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..core.attention_math import Scaling, logits_of, pack_queries, top_k, unpack_output
from ..core.contract import MethodLayer
from ..core.kvstore import FullStore, LayerState, every_position
from ..core.policy import (
    METHODS,
    BudgetPolicy,
    PolicyError,
    check_choice,
    check_positive,
    check_window,
    is_number,
    register,
)
from ..core.policy import make_policy as make_method
from ..core.selection import SelectionPolicy, SelectionState

TOKEN_METHODS = ("snapkv", "pyramidkv", "adakv", "defensivekv", "keydiff", "none")


class ThinKState(LayerState):
    """The prompt's held tokens with pruned keys (B, Hkv, S, D') and whole values, their positions (-1 empty) and
    kept channels (B, Hkv, D'); the decoded tokens whole in a `FullStore` from position `first_decoded` on."""

    def __init__(
        self, keys: Tensor, values: Tensor, positions: Tensor, channels: Tensor, first_decoded: int, room: int
    ):
        self.keys, self.values, self.positions, self.channels = keys, values, positions, channels
        self.decoded = FullStore(values[:, :, :0], max(room, 1))  # the announced answer; grows past it
        self.first_decoded = first_decoded

    def nbytes(self) -> int:
        own = sum(t.numel() * t.element_size() for t in (self.keys, self.values))
        return own + self.decoded.nbytes()

    def read_bytes(self) -> int:
        own = sum(t.numel() * t.element_size() for t in (self.keys, self.values))
        return own + self.decoded.attended_bytes()

    def valid(self, pads: Tensor | None) -> Tensor:
        return self.positions >= (0 if pads is None else pads.view(-1, 1, 1))

    def kept(self, pads: Tensor | None) -> Tensor:
        prompt = self.positions.masked_fill(~self.valid(pads), -1)
        decoded = every_position(self.decoded.length, self.positions, None) + self.first_decoded
        return torch.cat([prompt, decoded], dim=-1)


ThinKLayer = MethodLayer[ThinKState]


@register
@dataclasses.dataclass
class ThinK(BudgetPolicy[ThinKState]):
    """ThinK: a token method's selection (snapkv) with each KV head's key channels pruned by the window's queries.

    Parameters: `budget`: K tokens per KV head for the token method (or `budget_ratio`: K as a share of the longest
    prompt, 1/8 by default); `token_method` (snapkv; pyramidkv, adakv, defensivekv, keydiff, or none: every prompt
    token); `prune_ratio` (0.4) share of the key channels pruned; `window` (32) last prompt queries that score the
    channels (and the token method's window).
    """

    name = "think"
    summary = "query-driven pruning of key channels (ThinK) over a token selection (snapkv by default)"
    no_compression = "its pruned keys are chosen once, at prefill, for the prompt's tokens"

    token_method: str = "snapkv"
    prune_ratio: float = 0.4
    window: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("token_method", self.token_method, TOKEN_METHODS)
        if not is_number(self.prune_ratio) or not 0 <= self.prune_ratio < 1:
            raise PolicyError(
                f"prune_ratio must be a number in [0, 1) (the share of key channels pruned), got {self.prune_ratio!r}"
            )
        check_positive("window", self.window)
        self.token_policy()  # its own parameters refused now, before any model loads

    @classmethod
    def keep_everything(cls, context: int) -> dict[str, object]:
        return {"budget": context, "prune_ratio": 0.0}

    def token_policy(self) -> SelectionPolicy | None:
        """The token method, made with this method's budget and window (None for `none`)."""
        if self.token_method == "none":
            return None
        params: dict[str, object] = {"budget": self.budget, "budget_ratio": self.budget_ratio}
        if "window" in METHODS[self.token_method].parameters():
            params["window"] = self.window
        policy = make_method(self.token_method, **params)  # type: ignore[arg-type]
        assert isinstance(policy, SelectionPolicy)
        return policy

    def budget_for(self, prompt_length: int) -> int:
        tokens = self.token_policy()
        return super().budget_for(prompt_length) if tokens is None else tokens.budget_for(prompt_length)

    def uses_word_spans(self) -> bool:
        tokens = self.token_policy()
        return tokens is not None and tokens.uses_word_spans()

    def check_prompt(self, shortest: int) -> None:
        check_window("window", self.window, shortest)
        tokens = self.token_policy()
        if tokens is not None:
            tokens.check_prompt(shortest)

    def store_prompt(self, layer: ThinKLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> None:
        tokens = self.token_policy()
        length = key.shape[2]
        if tokens is None:
            keys, values, positions = key, value, every_position(length, key, layer.pads)
        else:
            selection_layer = layer  # the token method keeps its SelectionState in the layer, read back here
            tokens.store_prompt(selection_layer, query, key, value, scaling)  # type: ignore[arg-type]
            held = selection_layer.state
            assert isinstance(held, SelectionState)
            used = held.used
            keys, values = held.store.keys[:, :, :used], held.store.values[:, :, :used]
            positions = held.store.positions[:, :, :used]
            if layer.pads is not None:
                positions = positions.masked_fill(positions < layer.pads.view(-1, 1, 1), -1)
        channels = self.kept_channels(query[:, :, -self.window :], keys, positions >= 0)
        expand = channels.unsqueeze(2).expand(-1, -1, keys.shape[2], -1)
        layer.state = ThinKState(
            keys.gather(-1, expand), values.clone(), positions.clone(), channels, length, layer.expected_new_tokens()
        )

    def kept_channels(self, window: Tensor, keys: Tensor, real: Tensor) -> Tensor:
        """(B, Hkv, D') the channels kept per KV head, in channel order: the top by sum over the group of
        ||Q_w[:, c]|| x ||K[:, c]|| (the Frobenius norm of channel c's share of the window's logits)."""
        batch, kv_heads, _, dim = keys.shape
        query_norms = window.float().norm(dim=2).view(batch, kv_heads, -1, dim)  # (B, Hkv, G, D)
        key_norms = (keys.float() * real.unsqueeze(-1)).norm(dim=2)  # (B, Hkv, D): held real tokens only
        scores = (query_norms * key_norms.unsqueeze(2)).sum(dim=2)
        return top_k(scores, dim - int(self.prune_ratio * dim))

    def decode(self, layer: ThinKLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> Tensor:
        state = layer.state
        state.decoded.append(key, value)
        kv_heads = key.shape[1]
        packed = pack_queries(query, kv_heads)  # (B, Hkv, G, D)
        thinned = packed.gather(-1, state.channels.unsqueeze(2).expand(-1, -1, packed.shape[2], -1))
        prompt_logits = logits_of(thinned, state.keys, scaling)  # (B, Hkv, G, S)
        prompt_logits = prompt_logits.masked_fill(~state.valid(layer.pads).unsqueeze(2), float("-inf"))
        decoded_keys, decoded_values = state.decoded.view()
        probs = torch.cat([prompt_logits, logits_of(packed, decoded_keys, scaling)], dim=-1).softmax(dim=-1)
        held = state.keys.shape[2]
        output = torch.matmul(probs[..., :held].to(state.values.dtype), state.values)
        output = output + torch.matmul(probs[..., held:].to(decoded_values.dtype), decoded_values)
        layer.record(0.0, state.read_bytes())
        return unpack_output(output, query.shape[1])
