"""A request inside a serving engine, and each of its layers as the `MethodLayer` a method's hooks receive.

The method's own `store_prompt` and `decode` run on a `RequestLayer` exactly as on a transformers cache layer: the
same selection, pooling, query check, question floor and answer hold, over C_f in the engine's blocks
(`PagedFullStore`). A request is one row (no padding); its state is made at the prefill chunk that ends what the
engine prefilled (the prompt, or for a request the engine recomputed after preempting it, the prompt and its answer
so far: then that is its question) and is dropped with the request. Under tensor parallelism a rank holds some of
the heads: what a method averages over all heads (`mean_over_heads`) is summed over the ranks, so that every rank
takes the same decisions.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from ..core.attention_math import Scaling
from ..core.kvstore import LayerState
from ..core.policy import Policy, PolicyError
from ..core.selection import SelectionState
from .held_steps import HeldSteps
from .paged_store import PagedBlocks, PagedFullStore
from .window_store import WINDOWS, prefix_digests


@dataclasses.dataclass
class ModelFacts:
    """What a method reads of the model: its family, each layer's RoPE inverse frequencies (None: none to undo), and
    the word index of token ids (`pooling="span"`), or None where no method reads it."""

    model_type: str
    rope_inv_freq: list[Tensor | None]
    word_spans: object | None = None  # engine/spans.py's WordTable
    # the sum over the tensor-parallel ranks (None: one rank holds every head) and the number of ranks
    sum_over_ranks: Callable[[Tensor], Tensor] | None = None
    ranks: int = 1


@dataclasses.dataclass
class StepCounts:
    """What the served layers read, summed over decode layer-steps (for `refreshkv serve-bench` and the tests)."""

    layer_steps: int = 0
    full_layer_steps: float = 0.0
    bytes_read: int = 0
    resumed: int = 0  # requests that came back after leaving the batch (preempted, or skipped for a step)


def tokens_left(max_tokens: int | None, context: int, prompt_length: int, decoded: int) -> int:
    """How many tokens a request of `prompt_length` tokens that has `decoded` so far may still decode: the engine
    ends it at its `max_tokens` (None: no limit) or at the model's `context`, whichever comes first."""
    room = context - prompt_length
    return max((room if max_tokens is None else min(max_tokens, room)) - decoded, 0)


@dataclasses.dataclass
class Request:
    """One request of the engine's batch: its method, the tokens prefilled before its first decode, how many it may
    decode, and per layer the queries of its prefill's last tokens (the question's window) and its method state."""

    policy: Policy
    prefilled_ids: list[int]
    new_tokens: int
    model: ModelFacts
    counts: StepCounts
    window_queries: dict[int, Tensor] = dataclasses.field(default_factory=dict)
    layers: dict[int, RequestLayer] = dataclasses.field(default_factory=dict)
    _spans: Tensor | None = None
    _window_digests: list[bytes] | None = None
    # the engine's sampling parameters of the request (weakly: the engine drops them when the request is done) and
    # its running list of answer tokens: a request that leaves the batch and comes back is found by them
    owner: weakref.ref | None = None
    answer: list[int] = dataclasses.field(default_factory=list)
    prompt_length: int = 0  # the prompt's tokens, without the answer (the newest token is at prompt + answer - 1)
    # per layer, the key and value of each token decoded so far as the method's steps made them (one (2, Hkv, 1, D)
    # copy each), and the layers where vLLM's recomputation after a preemption is still to be overwritten with them
    answer_kv: dict[int, list[Tensor]] = dataclasses.field(default_factory=dict)
    to_restore: set[int] = dataclasses.field(default_factory=set)

    @property
    def prefilled(self) -> int:
        return len(self.prefilled_ids)

    @functools.cached_property
    def budget(self) -> int:
        return self.policy.budget_for(self.prefilled)

    @property
    def served(self) -> bool:
        """Whether the method acts: else K holds every token it will have, and the engine's own attention runs."""
        return self.policy.name != "full" and self.budget < self.prefilled + self.new_tokens

    def is_decoding(self, seq_len: int, query_len: int) -> bool:
        """Whether the last token of a batch row of `query_len` tokens ending at `seq_len` is one the method decodes:
        a token after the prefill, once the prompt is stored. A row of several tokens that ends at the newest one is a
        request that comes back after vLLM preempted it: the tokens before the last are recomputed into the blocks by
        vLLM's kernel, and the last is the method's, on the state the request kept (batch_rows.py); an earlier
        chunk of that recomputation is vLLM's alone."""
        if not self.layers or seq_len - 1 < self.prefilled:
            return False
        return query_len == 1 or seq_len == self.prompt_length + len(self.answer)

    def finished(self) -> bool:
        """Whether the request has decoded all it may (its token budget, or a stop token last): a request that
        leaves the batch then is done, not preempted, and its state goes at once."""
        owner = None if self.owner is None else self.owner()
        stops = getattr(owner, "all_stop_token_ids", None) or ()
        decoded = self.prompt_length + len(self.answer) - self.prefilled
        return decoded >= self.new_tokens or bool(self.answer) and self.answer[-1] in stops

    @property
    def window(self) -> int:
        """The question window's width: the last tokens of the prefill whose queries select C_p."""
        return min(max(getattr(self.policy, "window", 1), 1), self.prefilled)

    @property
    def window_digests(self) -> list[bytes]:
        """Where the window's queries are kept for a later prefix-cache hit (window_store.py), by position."""
        if self._window_digests is None:
            self._window_digests = prefix_digests(self.prefilled_ids, self.prefilled - self.window, self.prefilled)
        return self._window_digests

    def keep_window(self, layer_idx: int, queries: Tensor, first: int) -> None:
        """The last `window` queries (1, Hq, w, D) of the prefill so far, from one more chunk of it (1, Hq, n, D)
        whose first token is at position `first`. A first chunk past position 0 follows a prefix found in the
        engine's cache: the window's queries before it are those kept when that prefix was prefilled."""
        earlier = self.window_queries.get(layer_idx)
        window_start = self.prefilled - self.window
        if earlier is None and first > window_start:
            earlier = WINDOWS.get(self.window_digests[: first - window_start], layer_idx)
        joined = queries if earlier is None else torch.cat([earlier, queries], dim=2)
        self.window_queries[layer_idx] = joined[:, :, -self.window :].clone()

    @property
    def spans(self) -> Tensor | None:
        if self._spans is None and self.policy.uses_word_spans():
            if self.model.word_spans is None:
                raise PolicyError(f"method '{self.policy.name}' with pooling='span' needs the model's tokenizer")
            self._spans = self.model.word_spans.spans(torch.tensor([self.prefilled_ids]))  # type: ignore[attr-defined]
        return self._spans

    def come_back(self) -> None:
        """Back in the batch after leaving it. A request that left during its prefill is prefilled anew (its window
        with it). One that had decoded may have been preempted: vLLM then recomputes its tokens with its own
        attention, whose keys and values at the answer's positions are not the ones the method's steps made, so
        those are written back (`restore_answer`; read from its blocks when it left, they could be gone: vLLM zeroes
        the blocks it hands to other requests before the plugin hears of the preemption)."""
        if not self.layers:
            self.window_queries.clear()
        self.to_restore = set(self.answer_kv)

    def restore_answer(self, layer_idx: int, blocks: PagedBlocks, block_ids: Tensor) -> None:
        """Put back, over what vLLM recomputed, the keys and values the method's steps made for the answer so far."""
        if layer_idx in self.to_restore:
            self.to_restore.discard(layer_idx)
            keys, values = torch.cat(self.answer_kv[layer_idx], dim=2).split(1)
            blocks.write(block_ids, self.prefilled, keys, values)

    def store_prompt(self, layer_idx: int, blocks: PagedBlocks, block_ids: Tensor, scaling: float) -> None:
        """The method's prompt hook for this request at one layer, at the prefill chunk that ends its prompt (the
        engine has written every prompt token into its blocks by then): C_p is selected inside the prefill step, so
        the request's first decoded token is an ordinary step of its method, not a stall of the whole batch."""
        if layer_idx not in self.window_queries:
            raise PolicyError("the plugin saw none of this request's prefill (it was switched on mid-request)")
        layer = self.layers[layer_idx] = RequestLayer(self, layer_idx, blocks, block_ids)
        layer.at(blocks, block_ids, self.prefilled)
        keys, values = blocks.gather(block_ids, 0, self.prefilled)
        window = self.window_queries.pop(layer_idx)
        WINDOWS.put(self.window_digests[-window.shape[2] :], layer_idx, window)
        self.policy.store_prompt(layer, window, keys, values, scaling)

    def decode(
        self,
        layer_idx: int,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        scaling: float,
        blocks: PagedBlocks,
        block_ids: Tensor,
        seq_len: int,
        held_steps: HeldSteps | None = None,
    ) -> Tensor:
        """The method's decode step for this request at one layer (query (1, Hq, 1, D), key/value (1, Hkv, 1, D)):
        the attention output (1, 1, Hq, D). With `held_steps`, an attention over the tokens the method holds is
        added there instead, and the output returned is its row, filled by `held_steps.attend`."""
        layer = self.layers.get(layer_idx)
        if layer is None:
            raise PolicyError("the plugin saw none of this request's prefill (it was switched on mid-request)")
        layer.at(blocks, block_ids, seq_len)
        layer.recorded = False
        layer.hold(held_steps)
        self.answer_kv.setdefault(layer_idx, []).append(torch.cat((key, value)))
        output = self.policy.decode(layer, query, key, value, scaling)
        # not kept past the step: it holds the step's queries and output rows (the engine's tensors, those of a step
        # with prefill chunks in it 8K tokens long) and every request's C_p that took its partial step beside this one
        layer.hold(None)
        if not layer.recorded:
            raise PolicyError(f"method '{self.policy.name}' decoded without calling layer.record(...)")
        return output


class RequestLayer:
    """One layer of one request: the `MethodLayer` (core/contract.py) a method's hooks receive inside the engine."""

    prompt_scores = None  # no shared prefill inside the engine
    pads = None  # one request, one row: no padding
    max_pad = 0

    def __init__(self, request: Request, layer_idx: int, blocks: PagedBlocks, block_ids: Tensor):
        # weakly: the request owns its layers, and a cycle between them would keep a finished request's C_p until
        # Python's rare full collection (the engine freezes its own objects, so one comes seldom), which then frees
        # every such request at once, inside some decode step
        self._request = weakref.ref(request)
        self.layer_idx = layer_idx
        self.state: LayerState | None = None
        self.full: PagedFullStore | None = None  # C_f, once a method asked for it
        self.recorded = False
        self.held_steps: HeldSteps | None = None  # where this step's attention over held tokens goes, if anywhere
        self.at(blocks, block_ids, 0)

    @property
    def request(self) -> Request:
        request = self._request()
        if request is None:
            raise PolicyError("a served request's layer was used after its request was released")
        return request

    @property
    def step(self) -> int:
        return self.seen - self.request.prefilled

    @property
    def budget(self) -> int:
        return self.request.budget

    @property
    def model_type(self) -> str:
        return self.request.model.model_type

    @property
    def prompt_spans(self) -> Tensor | None:
        return self.request.spans

    @property
    def rope_inv_freq(self) -> Tensor | None:
        return self.request.model.rope_inv_freq[self.layer_idx]

    def valid_positions(self, length: int, device: torch.device) -> Tensor | None:
        return None

    def positions(self, device: torch.device) -> Tensor:
        return torch.tensor([self.seen - 1], device=device)

    def mean_over_heads(self, per_head: Tensor) -> Tensor:
        model = self.request.model
        if model.sum_over_ranks is None:
            return per_head.mean(dim=1)
        return model.sum_over_ranks(per_head.sum(dim=1).contiguous()) / (per_head.shape[1] * model.ranks)

    def full_store(self, like: Tensor, full_cache: str = "dense", group_size: int | None = None) -> PagedFullStore:
        if full_cache != "dense":
            raise PolicyError("inside vLLM C_f is vLLM's own paged blocks: full_cache must be 'dense'")
        self.full = PagedFullStore(self.blocks, self.block_ids)
        return self.full

    def at(self, blocks: PagedBlocks, block_ids: Tensor, seen: int) -> None:
        """This step's blocks and block table (a request gains blocks as it grows), and its tokens so far."""
        self.blocks, self.block_ids, self.seen = blocks, block_ids, seen
        if self.full is not None:
            self.full.blocks, self.full.block_ids = blocks, block_ids

    def hold(self, held_steps: HeldSteps | None) -> None:
        """Where this step's attention over held tokens, or over chosen tokens of C_f, goes (None: computed here)."""
        self.held_steps = held_steps
        if self.full is not None:
            self.full.held_steps = held_steps

    def capacity(self) -> int:
        return self.request.prefilled + self.request.new_tokens

    def expected_new_tokens(self) -> int:
        return self.request.new_tokens

    def method_layers(self) -> list[RequestLayer]:
        raise PolicyError(f"method '{self.request.policy.name}' shares a budget across layers: not inside vLLM")

    def decode_each(self, decode, query, key, value, scaling):  # type: ignore[no-untyped-def]
        raise PolicyError("inside vLLM every decode step is one token")

    def attend_held(self, held: SelectionState, query: Tensor, scaling: Scaling) -> tuple[Tensor, int]:
        front = held.front(None)
        if self.held_steps is None or front is None:
            return held.attend(query, scaling, None)
        keys, values, read = front
        return self.held_steps.add(query, keys, values), read

    def record(self, full_fraction: float | Tensor, attended_bytes: int) -> None:
        counts = self.request.counts
        counts.layer_steps += 1
        counts.full_layer_steps += float(full_fraction)
        counts.bytes_read += attended_bytes
        self.recorded = True
