"""`MethodLayer`: everything a method may read and write of the layer it works on, and nothing else.

A method's hooks (`store_prompt`, `decode`, `select`, `score`, ...) receive one layer of the cache as a
`MethodLayer`; `PolicyLayer` (engine/cache.py) implements it. Methods use only these members (the type checker holds
them to it, and tests/test_scorer_layer.py reads every method's source), so the cache's internals can change without
touching a method.

Shapes: B rows (left-padded), Hkv KV heads. Positions are indices into the padded input: a row's real tokens start
at `pads[b]`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch
from torch import Tensor

from .attention_math import Scaling
from .kvstore import FullStore, LayerState

if TYPE_CHECKING:
    from .quantized_store import QuantizedFullStore
    from .selection import SelectionState

State = TypeVar("State", bound=LayerState)
"""What a method keeps for a layer: `Policy[State]` hooks receive `MethodLayer[State]` (e.g. a `SelectionState`)."""


class MethodLayer(Protocol[State]):
    layer_idx: int
    """The model layer (0 = the bottom one)."""

    state: State
    """What the method keeps for this layer: set by `store_prompt` (before it, None), read and replaced by the method
    freely in every later hook."""

    prompt_scores: dict | None
    """While a shared prefill stores the prompt: prompt scores already computed at this layer by its other methods,
    by `score_key` (SelectionPolicy.select reads and fills it); None otherwise."""

    @property
    def seen(self) -> int:
        """Tokens this layer has processed, left padding included: the newest token's position is `seen - 1`."""

    @property
    def step(self) -> int:
        """Decode steps taken after the prompt: 0 while the prompt is stored, 1 at the first decoded token."""

    @property
    def budget(self) -> int:
        """K, the tokens the method keeps (or attends to) per KV head, resolved for this generation from its
        `budget`/`budget_ratio` and the longest prompt; 0 for a method without a budget."""

    @property
    def pads(self) -> Tensor | None:
        """(B,) left-padding tokens per row; None when no row is padded."""

    @property
    def max_pad(self) -> int:
        """The largest entry of `pads` (0 without padding)."""

    @property
    def model_type(self) -> str:
        """The model family (`llama`, `qwen2`, ...), for defaults that depend on it."""

    @property
    def prompt_spans(self) -> Tensor | None:
        """(B, prompt length) word index of each prompt token (engine/spans.py) when the method asked for word spans
        (`Policy.uses_word_spans`); None otherwise."""

    @property
    def rope_inv_freq(self) -> Tensor | None:
        """This layer's RoPE inverse frequencies, None where the package cannot undo the model's RoPE."""

    def valid_positions(self, length: int, device: torch.device) -> Tensor | None:
        """(B, 1, 1, length) bool: True at the real tokens among the first `length` positions; None without
        padding (every position is real)."""

    def positions(self, device: torch.device) -> Tensor:
        """(B or 1,) RoPE position of the newest token in each row (0 at a row's first real token)."""

    def mean_over_heads(self, per_head: Tensor) -> Tensor:
        """(B, q, D): `per_head` (B, Hq, q, D) averaged over every query head of the layer. A tensor-parallel rank of
        a serving engine holds some of the heads and sums with the other ranks, so that a decision read from this
        mean (refreshkv's query check) is the same on every rank."""

    def full_store(
        self, like: Tensor, full_cache: str = "dense", group_size: int | None = None
    ) -> FullStore | QuantizedFullStore:
        """An empty store for every token of this layer (C_f), shaped like `like` (B, Hkv, L, D): the transformers
        cache makes one that grows (`make_full_store`: dense, quantized or offloaded); a serving engine gives a view
        of the blocks it already writes (refreshkv.serving). `group_size`: a quantized store's groups (None: KIVI's 32).
        A method that keeps every token takes its store from here."""

    def capacity(self) -> int:
        """Tokens a store needs to hold the prompt and every announced decoded token (stores grow beyond it)."""

    def expected_new_tokens(self) -> int:
        """Decoded tokens announced for this generation (`max_new_tokens`, or a guess when none was given)."""

    def method_layers(self) -> list[MethodLayer[State]]:
        """The layers that run the method, bottom first (sliding-window layers whose window bites do not): a
        method that shares a budget across layers (PyramidKV, DynamicKV) spans these."""

    def decode_each(
        self,
        decode: Callable[[MethodLayer[State], Tensor, Tensor, Tensor, Scaling], Tensor],
        query: Tensor,
        key: Tensor,
        value: Tensor,
        scaling: Scaling,
    ) -> Tensor:
        """`decode(layer, query, key, value, scaling)` for each of several new tokens in turn, as if they came one per
        step (`Policy.extend`'s default); the step's statistics are the mean over the tokens. Returns (B, q, Hq, D)."""

    def attend_held(self, held: SelectionState, query: Tensor, scaling: Scaling) -> tuple[Tensor, int]:
        """`held.attend(query, scaling, pads)`: the newest query token's attention over the tokens a method holds, and
        the bytes read. A serving engine runs those of every request in its batch as one call after their steps
        (serving/held_steps.py): the output it returns is filled then, so a method returns it as it is."""

    def record(self, full_fraction: float | Tensor, attended_bytes: int) -> None:
        """Once per decode step: the share of rows that attended to the whole cache (0.0-1.0, or a 0-d tensor
        decided on the device) and the bytes of keys and values read."""
