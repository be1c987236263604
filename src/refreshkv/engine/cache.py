"""`PolicyCache`: a transformers `Cache` whose layers hand their work to a KV method (a `Policy`).

transformers calls `Cache.update(key, value, layer_idx)` and then the attention function with the query. Methods need
the query (to score tokens), so `PolicyLayer.update` only records the new key/value and hands the layer over to the
attention function registered in attention.py, which calls `PolicyLayer.attend`; the policy stores, selects and
attends (the handoff: handoff.py). The same object therefore works in this library's decode loop and in
`model.generate(cache=...)` (`past_key_values=` before transformers 5.24; engine/cache_argument.py):
built from a model, the cache switches it to the "refreshkv" attention (which is plain SDPA without a PolicyCache);
built from a config, it refuses one whose model would not hand it the layers.

Layers run the cache's method, except sliding-window layers whose window the generation outgrows: those keep their
window, whatever the method (sliding_window.py).

Beam search (`reorder_cache`, `batch_repeat_interleave`, `batch_select_indices`) reorders every layer's state
(`LayerState.select_rows`); `reset` empties the cache for a new generation; `crop` is done by the method (only
`full` can: the others have dropped tokens). A cache that holds tokens takes only tokens that continue them (a
conversation's next turn); a new prompt given to it is refused until `reset` (continuation.py).
"""

from __future__ import annotations

import warnings
import weakref
from collections import Counter
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from ..core.attention_math import Scaling
from ..core.contract import MethodLayer
from ..core.full_cache import DEFAULT_GROUP_SIZE, FullCacheStore, make_full_store
from ..core.kvstore import LayerState
from ..core.policy import Policy, PolicyError, check_budget_fits, check_positive, croppable_methods, shorten
from ..core.rope import inverse_frequencies
from ..core.selection import SelectionState
from .continuation import ContinuationCheck
from .decode_stats import DecodeStats
from .handoff import ATTENTION_NAME, hand_over
from .sliding_window import SlidingWindow
from .spans import PromptTokenWatch, WordTable, word_table_for

DEFAULT_NEW_TOKENS = 256


def _of_cache(name: str) -> property:
    """A member of the MethodLayer contract that every layer of a generation shares: its cache's `name`."""
    return property(lambda layer: getattr(layer.cache, name))


class PolicyLayer(CacheLayerMixin):
    """One layer of a `PolicyCache`: transformers' cache layer, and the `MethodLayer` (contract.py) its method
    works on."""

    is_sliding = False

    def __init__(self, cache: PolicyCache, layer_idx: int):
        super().__init__()
        # A weak reference: a cycle cache <-> layers would keep every tensor of a dropped cache until Python's
        # cyclic collector runs, which with a model loaded is rare (a 4K sweep grew by GBs per example).
        self._cache = weakref.ref(cache)
        self.layer_idx = layer_idx
        self.seen = 0  # tokens processed, counting left padding
        self.state: LayerState | None = None  # the policy's LayerState, set at prefill
        # the cache's method, or the window of a sliding-window layer (sliding_window.py)
        self.policy: Policy = cache.policy
        self.window: int | None = None  # the layer's sliding window, if it has one
        self.pending: torch.Tensor | None = None
        self.recorded = False
        self.record_share = 1.0  # below 1 while several new tokens share one step (`decode_each`)
        # during a shared prefill: its members' prompt scores at this layer, by score_key
        self.prompt_scores: dict | None = None
        self.read_a_question = False  # the last forward was a block of new tokens its method read as a question

    @property
    def cache(self) -> PolicyCache:
        cache = self._cache()
        assert cache is not None, "a layer is used only while its cache exists"
        return cache

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]  # transformers: a class attribute; here, per method
        return type(self.cache.policy).crop is not Policy.crop

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    @property
    def methods(self) -> str:
        return f"method '{self.cache.policy.name}'"

    def advance(self, key_states: torch.Tensor) -> None:
        """Count the tokens this forward adds (and, at layer 0, a decode step)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, key_states)
        if self.layer_idx == 0 and self.seen > 0:
            self.cache.step += 1
        self.seen += key_states.shape[2]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.advance(key_states)
        hand_over(self, key_states)
        return key_states, value_states

    def start_prompt(self, mask: torch.Tensor | None, key: torch.Tensor, sliding_window: int | None) -> None:
        """Before the method sees the prompt: layer 0 reads the padding and checks the prompt (once per cache); a
        sliding-window layer whose window will bite keeps its window instead of running the method."""
        if self.layer_idx == 0:
            self.cache.start(mask, key)
        expected = self.cache.layer_windows[self.layer_idx]
        if sliding_window != expected:
            raise PolicyError(
                f"layer {self.layer_idx}'s attention uses sliding_window={sliding_window} where its config says "
                f"{expected}; the package cannot reproduce this model's attention"
            )
        self.window = sliding_window
        windowed = self.cache.windowed[self.layer_idx]
        self.policy = SlidingWindow(sliding_window) if windowed and sliding_window is not None else self.cache.policy

    def attend(self, module, query, key, value, mask, scaling: Scaling, sliding_window: int | None = None) -> Tensor:
        if self.state is None:
            self.start_prompt(mask, key, sliding_window)
            return self.policy.prefill(self, query, key, value, mask, scaling)
        policy = self.policy
        if self.window is not None and self.seen > self.window and not isinstance(policy, SlidingWindow):
            raise ValueError(
                f"the generation went past layer {self.layer_idx}'s sliding window ({self.window} tokens) after "
                f"fewer new tokens were announced; give max_new_tokens to the cache (PolicyCache(..., max_new_tokens))"
            )
        self.recorded = False
        step = policy.decode if query.shape[2] == 1 else policy.extend
        output = step(self, query, key, value, scaling)
        self.read_a_question = query.shape[2] > 1 and policy.read_a_question(self)
        if not self.recorded:
            raise RuntimeError(f"method '{policy.name}' decoded without calling layer.record(...)")
        return output

    def decode_each(self, decode, query, key, value, scaling):
        """`decode` for each of several new tokens in turn, as if they came one per step (`Policy.extend`'s
        default): `seen` counts up token by token, and the step's statistics are the mean over the tokens."""
        count, end = query.shape[2], self.seen
        outputs = []
        self.record_share = 1 / count
        try:
            for i in range(count):
                self.seen = end - count + i + 1
                self.recorded = False
                one = slice(i, i + 1)
                outputs.append(decode(self, query[:, :, one], key[:, :, one], value[:, :, one], scaling))
                if not self.recorded:
                    raise RuntimeError(f"method '{self.policy.name}' decoded without calling layer.record(...)")
        finally:
            self.seen, self.record_share = end, 1.0
        return torch.cat(outputs, dim=1)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.seen, self.state, self.pending, self.window = 0, None, None, None
        self.read_a_question = False
        self.policy = self.cache.policy
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state.select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            rows = torch.arange(self.cache.batch_rows(), device=self.cache.device())
            self.state.select_rows(rows.repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.state is not None:
            self.state.select_rows(torch.as_tensor(indices, device=self.cache.device()).long())

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if self.read_a_question:  # a block of new tokens, then forgetting some of it: assisted decoding's drafts
            raise PolicyError(
                f"method '{self.policy.name}' reads a block of new tokens as a new question (its selection is rebuilt "
                "from them), so assisted decoding's drafts would change its schedule; decode one token at a time, or "
                f"use a method that takes drafted tokens one by one: {', '.join(croppable_methods(drafts=True))}"
            )
        if tokens_to_remove == 0 or self.state is None:
            return
        self.policy.crop(self, -tokens_to_remove)
        self.seen += tokens_to_remove

    # -- the MethodLayer contract (contract.py): what a method reads of its generation ---------------------------
    step = _of_cache("step")
    budget = _of_cache("budget")
    pads = _of_cache("pads")
    max_pad = _of_cache("max_pad")
    model_type = _of_cache("model_type")
    prompt_spans = _of_cache("prompt_spans")

    @property
    def rope_inv_freq(self) -> torch.Tensor | None:
        return self.cache.rope_inv_freq[self.layer_idx]

    def valid_positions(self, length: int, device) -> torch.Tensor | None:
        return self.cache.valid_positions(length, device)

    def positions(self, device) -> torch.Tensor:
        return self.cache.positions(self.seen, device)

    def mean_over_heads(self, per_head: torch.Tensor) -> torch.Tensor:
        return per_head.mean(dim=1)

    def full_store(self, like, full_cache: str = "dense", group_size: int | None = None) -> FullCacheStore:
        return make_full_store(like, self.capacity(), full_cache, group_size or DEFAULT_GROUP_SIZE)

    def capacity(self) -> int:
        return self.cache.capacity()

    def expected_new_tokens(self) -> int:
        return self.cache.expected_new_tokens()

    def method_layers(self) -> list[MethodLayer[Any]]:
        return list(self.cache.method_layers())

    def attend_held(self, held: SelectionState, query: Tensor, scaling: Scaling) -> tuple[Tensor, int]:
        return held.attend(query, scaling, self.pads)

    def record(self, full_fraction: float | torch.Tensor, attended_bytes: int) -> None:
        """Statistics of one decode step of this layer: share of rows that attended fully (a 0-d tensor when rows
        decided on the device), bytes of K/V read. Kept in device tensors: recording never waits for the device."""
        self.cache.stats.add(self.layer_idx, self.cache.step, full_fraction * self.record_share, attended_bytes)
        self.recorded = True


def layer_windows(text_config) -> list[int | None]:
    """Each layer's sliding window from the config: per layer type (Gemma, Qwen2), else one for all (Mistral, Phi-3)."""
    window = getattr(text_config, "sliding_window", None)
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is None:
        return [window] * text_config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in layer_types]


class PolicyCache(Cache):
    """The KV cache of one generation under `policy`. `max_new_tokens` lets stores preallocate their final size.

    `model_or_config`: a model (switched to the "refreshkv" attention implementation, which is plain SDPA whenever
    no PolicyCache is passed) or its config (which must already use that implementation).
    `tokenizer`: for a method that reads word spans (`pooling="span"`) when the model's folder holds none.
    """

    layer_type = PolicyLayer  # a subclass may watch each layer's attention (measure/trace.py)
    layers: list[PolicyLayer]  # type: ignore[assignment]  # transformers types any cache's; these are layer_type's
    counting_on_device = False  # True while decode steps count tokens on the device (runtime/static_decode.py)

    def __init__(self, policy: Policy, model_or_config, max_new_tokens: int | None = None, tokenizer=None):
        if not isinstance(policy, Policy):
            raise PolicyError(
                f"PolicyCache takes a method object, e.g. make_policy('refreshkv', budget=1024); got "
                f"{type(policy).__name__}"
            )
        check_positive("max_new_tokens", max_new_tokens, allow_none=True)
        if hasattr(model_or_config, "set_attn_implementation"):
            if model_or_config.config._attn_implementation != ATTENTION_NAME:
                model_or_config.set_attn_implementation(ATTENTION_NAME)
            config = model_or_config.config
            weakref.finalize(self, ContinuationCheck(model_or_config, self).close)  # a new prompt is not a next turn
        elif hasattr(model_or_config, "get_text_config") or hasattr(model_or_config, "num_hidden_layers"):
            config = model_or_config
        else:
            raise PolicyError(
                "PolicyCache needs the model (a transformers model, e.g. from refreshkv.load_model()) or its config, "
                f"got {type(model_or_config).__name__} {shorten(model_or_config)}"
            )
        if getattr(config, "_attn_implementation", None) != ATTENTION_NAME:
            raise PolicyError(
                f"the model uses attn_implementation={getattr(config, '_attn_implementation', None)!r}; a PolicyCache "
                f"needs '{ATTENTION_NAME}': pass the model itself (PolicyCache(policy, model)), call "
                f"model.set_attn_implementation('{ATTENTION_NAME}'), or load it with refreshkv.load_model"
            )
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.num_layers = text_config.num_hidden_layers
        policy.check_layers(self.num_layers)
        check_budget_fits(policy, getattr(text_config, "max_position_embeddings", None))
        self.model_type = text_config.model_type  # some methods' defaults depend on the family (e.g. a threshold)
        layer_types = getattr(text_config, "layer_types", None) or [None] * self.num_layers
        # per layer (layer types may rotate differently); None: no RoPE the package can undo
        self.rope_inv_freq = [inverse_frequencies(model_or_config, layer_type) for layer_type in layer_types]
        self.layer_windows = layer_windows(text_config)
        self.policy = policy
        super().__init__(layers=[self.layer_type(self, i) for i in range(self.num_layers)])
        self.word_table: WordTable | None = None
        if policy.uses_word_spans():
            if not hasattr(model_or_config, "get_input_embeddings"):
                raise PolicyError(
                    f"method '{policy.name}' with pooling='span' reads the prompt's token ids: build the cache from "
                    "the model (PolicyCache(policy, model)), not from its config"
                )
            self.word_table = word_table_for(config, tokenizer)
            self._model = weakref.ref(model_or_config)
        self.token_watch: PromptTokenWatch | None = None
        self.max_new_tokens = max_new_tokens
        self.reset()

    def reset(self) -> None:
        """Empty the cache for a new generation (same policy, same announced length)."""
        for layer in self.layers:
            layer.reset()
        self.step = 0  # decode steps taken after the prompt
        self.pads: torch.Tensor | None = None  # (B,) left-pad count per row, None without padding
        self.max_pad = 0
        self.prompt_length = 0  # the longest row's real prompt
        self.budget = 0
        self.windowed = [False] * self.num_layers  # sliding-window layers whose window bites: they keep the window
        self.stats = DecodeStats(self.num_layers)
        self.prompt_spans: torch.Tensor | None = None  # (B, L) word index per prompt token, for `pooling="span"`
        self._close_token_watch()
        if self.word_table is not None:  # watch the next forward's token ids (this generation's prompt)
            self.token_watch = PromptTokenWatch(self._model())
            weakref.finalize(self, self.token_watch.close)

    def _close_token_watch(self) -> None:
        if self.token_watch is not None:
            self.token_watch.close()
            self.token_watch = None

    def start(self, mask: torch.Tensor | None, key: torch.Tensor) -> None:
        """Read the prompt's padding from the prefill mask, check the prompt against the method, resolve its budget."""
        length = key.shape[2]
        self.prompt_length = length
        shortest = length
        if mask is not None:
            # A token sees itself unless it is padding: the diagonal marks real tokens, in causal and sliding masks.
            real = mask[:, 0].to(torch.bool).diagonal(dim1=-2, dim2=-1)
            pads = (~real).sum(-1)
            positions = torch.arange(length, device=mask.device)
            if not torch.equal(real, positions >= pads[:, None]):
                raise ValueError("padding must be on the left (tokenizer.padding_side = 'left')")
            if int(pads.max()) > 0:
                self.pads = pads
                self.max_pad = int(pads.max())
                self.prompt_length = length - int(pads.min())
                shortest = length - int(pads.max())
        self.policy.check_prompt(shortest)
        if self.word_table is not None:
            self.prompt_spans = self._read_prompt_spans(self.word_table, key)
        self.stats = DecodeStats(self.num_layers, key.device, self.expected_new_tokens())
        total = length + self.expected_new_tokens()
        self.windowed = [window is not None and total > window for window in self.layer_windows]
        self.budget = self.policy.budget_for(self.prompt_length)
        for note in self.policy.clamps(length, self.budget):  # a value used in place of the one given, said once
            warnings.warn(f"method '{self.policy.name}': {note}", stacklevel=2)

    def _read_prompt_spans(self, word_table: WordTable, key: torch.Tensor) -> torch.Tensor:
        ids = self.token_watch.ids if self.token_watch is not None else None
        self._close_token_watch()
        if ids is None or tuple(ids.shape) != (key.shape[0], key.shape[2]):
            raise PolicyError(
                f"method '{self.policy.name}' with pooling='span' needs the prompt's token ids: pass input_ids "
                "(not inputs_embeds), one prompt per cache"
            )
        return word_table.spans(ids.to(key.device))

    def method_layers(self) -> list[PolicyLayer]:
        """The layers that run the method (all but sliding-window layers whose window bites), bottom first."""
        return [layer for layer, windowed in zip(self.layers, self.windowed) if not windowed]

    def positions(self, seen: int, device) -> torch.Tensor:
        """(B or 1,) RoPE position of the token at index `seen` - 1 in each row (0 at a row's first real token)."""
        pads = self.pads if self.pads is not None else torch.zeros(1, dtype=torch.long, device=device)
        return seen - 1 - pads

    def device(self) -> torch.device:
        return next(layer.state for layer in self.layers if layer.state is not None).kept(None).device

    def batch_rows(self) -> int:
        return next(layer.state for layer in self.layers if layer.state is not None).kept(None).shape[0]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        rows = self.pads if self.pads is not None else self.prompt_spans
        if rows is not None:
            self._select_rows(torch.arange(rows.shape[0], device=rows.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._select_rows(torch.as_tensor(indices).long())

    def _select_rows(self, rows: torch.Tensor) -> None:
        """The per-row prompt facts follow the rows' states (beam search)."""
        if self.pads is not None:
            self.pads = self.pads.index_select(0, rows.to(self.pads.device))
        if self.prompt_spans is not None:
            self.prompt_spans = self.prompt_spans.index_select(0, rows.to(self.prompt_spans.device))

    def expected_new_tokens(self) -> int:
        """Decoded tokens to make room for: `max_new_tokens`, or a guess when it was not given (stores grow)."""
        return self.max_new_tokens if self.max_new_tokens is not None else DEFAULT_NEW_TOKENS

    def capacity(self) -> int:
        """Slots a store needs to hold every token of this generation (grows beyond if the hint was short)."""
        return self.layers[0].seen + self.expected_new_tokens()

    def valid_positions(self, length: int, device) -> torch.Tensor | None:
        """(B, 1, 1, length) bool mask of real tokens among the first `length` positions, None without padding."""
        if self.pads is None:
            return None
        return (torch.arange(length, device=device) >= self.pads[:, None]).view(-1, 1, 1, length)

    def nbytes_per_layer(self) -> list[int]:
        return [layer.state.nbytes() if layer.state is not None else 0 for layer in self.layers]

    def nbytes_by_device(self) -> dict[str, int]:
        """Bytes held per device, all layers (C_f offloaded to the host counts under "cpu")."""
        total: Counter[str] = Counter()
        for layer in self.layers:
            if layer.state is not None:
                total.update(layer.state.nbytes_by_device())
        return dict(total)

    def full_step_fraction(self) -> float:
        """Share of the method's layer-steps that attended fully. Sliding-window layers whose window bites attend to
        their window whatever the method (Gemma's 15 of 18): they are left out, so the share says what the method
        did (on a model without them, every layer counts)."""
        layers = [layer.layer_idx for layer in self.method_layers()]
        if not self.step or not layers:
            return 0.0
        per_layer = self.stats.per_layer()
        return sum(per_layer[i] for i in layers) / (len(layers) * self.step)

    def attended_bytes_mean(self) -> float:
        return self.stats.attended_bytes() / self.step if self.step else 0.0
