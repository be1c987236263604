"""Greedy decode steps with every per-step number on the device, so that a step is captured once as a CUDA graph and
replayed (a GPU step that is not host-bound).

Each layer's step is its method's device step (`Policy.device_step`, core/device_steps.py): the per-step numbers live
in device tensors (`Counters`) that the step itself advances, every store keeps its fixed size, and attention reads
which entries count from the device. The next token is chosen inside the step (greedy), so a replay needs nothing
from the host.

`StaticCache` is a `PolicyCache` whose prompt goes through the method as always (the same prefill and selection);
`StaticDecoder` then decodes from it. Per method one graph per kind of step (`Policy.device_step_kind`), chosen on
the host from the step number alone: `full` and the eviction methods one; `recycled` a partial and a full step;
`refreshkv` a partial step and a query-check step (methods/refreshkv/device_step.py). What it runs: `full`,
`refreshkv` and `recycled` with a dense C_f, and the eviction methods that evict by their stored scores (snapkv,
pyramidkv, dynamickv, refreekv, keydiff); rows without padding, no sliding-window layer, at most the announced new
tokens. The stores are the prefill's own: after `run` the cache holds the generation, its host counters advanced.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..core.attention_math import Scaling
from ..core.device_steps import Counters
from ..core.kvstore import LayerState
from ..core.policy import PolicyError
from ..engine.cache import PolicyCache, PolicyLayer
from ..engine.cache_argument import with_cache
from ..engine.handoff import hand_over
from .compiled import compiled_forward
from .generate import StepTimer

UNSUPPORTED = (
    "static decoding runs full, refreshkv and recycled with a dense C_f (budget below the cache) and the eviction "
    "methods that evict by their stored scores"
)


class StaticLayer(PolicyLayer):
    """A `PolicyLayer` whose decode steps run on fixed-size stores and device counters once `static` is set."""

    static = False

    if TYPE_CHECKING:  # StaticCache makes its layers of this type (`layer_type`), so their cache is one

        @property
        def cache(self) -> StaticCache: ...

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if not self.static:
            return super().update(key_states, value_states, *args, **kwargs)
        hand_over(self, key_states)
        return key_states, value_states

    def positions(self, device: torch.device) -> Tensor:
        if not self.static:
            return super().positions(device)
        return self.cache.counters.seen - 1

    def attend(self, module, query, key, value, mask, scaling: Scaling, sliding_window: int | None = None) -> Tensor:
        if not self.static:
            return super().attend(module, query, key, value, mask, scaling, sliding_window)
        # a device step is written for a plain scale; a soft-capped one (Gemma 2) reaches it as the layer got it
        return self.cache.policy.device_step(self, query, key, value, scaling)  # type: ignore[arg-type]

    # -- the `DeviceLayer` members a method's device step reads (core/device_steps.py) --
    @property
    def counters(self) -> Counters:
        return self.cache.counters

    @property
    def kind(self) -> str:
        return self.cache.kind

    @property
    def conditional(self) -> bool:
        return self.cache.conditional

    def record_full_share(self, share: float | Tensor) -> None:
        """The share of rows that attended fully at this step, in the cache's per-layer device record."""
        record, index = self.cache.full_shares[self.layer_idx], self.cache.counters.step - 1
        if isinstance(share, Tensor):
            record.index_copy_(0, index, share.view(1))
        else:
            record.index_fill_(0, index, share)


class StaticCache(PolicyCache):
    """A `PolicyCache` that `StaticDecoder` can decode from after its prompt (the prompt runs as in any PolicyCache)."""

    layer_type = StaticLayer
    kind = "partial"  # the kind of step being run or captured (host side, fixed per graph)
    conditional = False  # a query check's refresh as a conditional graph node (`only_if`)
    layers: list[StaticLayer]  # type: ignore[assignment]  # made by layer_type, as PolicyCache's
    counters: Counters
    full_shares: list[Tensor]  # per layer, (steps,) share of rows that attended fully


@dataclasses.dataclass
class StaticOutput:
    tokens: list[list[int]]  # (B, new tokens): the first from the prompt's logits
    kinds: list[str]  # per decode step
    replayed: list[bool]  # per decode step: replayed from a graph (else eager: a warm-up, or graphs=False)
    step_ms: list[float]  # per decode step, from device events (CUDA) or the host clock
    full_share: float  # share of layer-steps (and rows) that attended fully
    logits: Tensor | None  # (steps + 1, B, V) float32 when asked for
    graphs: int  # graphs captured


class StaticDecoder:
    """Greedy decoding of `new_tokens` tokens from a prefilled `StaticCache` and the prompt's last logits."""

    def __init__(
        self,
        model,
        cache: StaticCache,
        logits: Tensor,
        new_tokens: int,
        keep_logits: bool = False,
        compile: bool = False,
        conditional: bool = False,
    ):
        check_static(cache, new_tokens)
        self.model, self.cache, self.new_tokens = model, cache, new_tokens
        cache.conditional = conditional
        # compiled: each kind of step its own graph (dynamo guards on `cache.kind`), its small operators fused
        self.forward = compiled_forward(model) if compile else model
        device = logits.device
        batch = logits.shape[0]
        first = cache.layers[0]
        cache.counters = Counters(
            torch.full((1,), first.seen, dtype=torch.long, device=device),
            torch.full((1,), cache.step, dtype=torch.long, device=device),
        )
        self.first_step = cache.step
        with torch.inference_mode():  # the prefill's stores are inference tensors when it ran in that mode
            for layer in cache.layers:
                prefilled(layer).clear_unwritten()
        # on the device beforehand: a copy from the host cannot be captured
        cache.rope_inv_freq = [None if f is None else f.to(device) for f in cache.rope_inv_freq]
        cache.full_shares = [torch.zeros(cache.step + new_tokens, device=device) for _ in cache.layers]
        self.token = logits.argmax(-1, keepdim=True)
        self.position = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.history = torch.zeros(batch, cache.step + new_tokens, dtype=torch.long, device=device)
        self.history[:, cache.step] = self.token[:, 0]
        self.kept_logits = None
        if keep_logits:
            self.kept_logits = torch.zeros(cache.step + new_tokens, *logits.shape, device=device)
            self.kept_logits[cache.step] = logits.float()

    def _step(self) -> None:
        """One decode step: advance the counters, run the model on the last token, keep the next one."""
        counters = self.cache.counters
        counters.seen += 1
        counters.step += 1
        self.position.copy_((counters.seen - 1).expand_as(self.position))
        logits = self.forward(
            self.token, position_ids=self.position, use_cache=True, **with_cache(self.model, self.cache)
        ).logits[:, -1]
        self.token.copy_(logits.argmax(-1, keepdim=True))
        self.history.index_copy_(1, counters.step, self.token)
        if self.kept_logits is not None:
            self.kept_logits.index_copy_(0, counters.step, logits.float()[None])

    @torch.inference_mode()
    def run(self, graphs: bool = True) -> StaticOutput:
        """Decode; with `graphs` (CUDA only) each kind of step is run once eagerly (to warm it), captured after, and
        replayed from then on."""
        cache, policy = self.cache, self.cache.policy
        if graphs and self.token.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; run with graphs=False elsewhere")
        cache.counting_on_device = True
        for layer in cache.layers:
            layer.static = True
        captured: dict[str, torch.cuda.CUDAGraph] = {}
        warmed: set[str] = set()
        kinds: list[str] = []
        replayed: list[bool] = []
        timer = StepTimer(self.token.device)
        try:
            for step in range(self.first_step + 1, self.first_step + self.new_tokens):
                kind = policy.device_step_kind(step)
                cache.kind = kind
                kinds.append(kind)
                if graphs and kind in warmed and kind not in captured:
                    captured[kind] = self._capture()
                replayed.append(kind in captured)
                timer.mark()
                if kind in captured:
                    captured[kind].replay()
                elif graphs:
                    self._warm()
                    warmed.add(kind)
                else:
                    self._step()
                timer.mark()
        finally:
            cache.counting_on_device = False
            for layer in cache.layers:
                layer.static = False
        self._advance_host(len(kinds))
        steps = max(len(kinds), 1)
        shares = torch.stack(cache.full_shares)[:, self.first_step : self.first_step + len(kinds)]
        return StaticOutput(
            tokens=self.history[:, self.first_step :].tolist(),
            kinds=kinds,
            replayed=replayed,
            step_ms=[seconds * 1000 for seconds in timer.seconds()],
            full_share=float(shares.sum()) / (len(cache.layers) * steps),
            logits=None if self.kept_logits is None else self.kept_logits[self.first_step :].cpu(),
            graphs=len(captured),
        )

    def _warm(self) -> None:
        """One eager step on a side stream (what capture wants before it: kernels compiled, workspaces made)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step()
        torch.cuda.current_stream().wait_stream(side)

    def _capture(self) -> torch.cuda.CUDAGraph:
        """The current kind of step as a graph (capture records the kernels; it does not run them)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        return graph

    def _advance_host(self, steps: int) -> None:
        """The cache's host counters as eager decoding would have left them, so that it can go on eagerly."""
        cache = self.cache
        cache.step += steps
        for layer in cache.layers:
            layer.seen += steps
            prefilled(layer).advance(steps)


def prefilled(layer: PolicyLayer) -> LayerState:
    """The layer's state: static decoding starts after the prompt."""
    if layer.state is None:
        raise PolicyError("static decoding starts after the prompt: prefill the StaticCache first")
    return layer.state


def check_static(cache: PolicyCache, new_tokens: int) -> None:
    """Refuse, in one line, a cache that static decoding cannot run (see the module doc)."""
    if not isinstance(cache, StaticCache):
        raise PolicyError("static decoding takes a StaticCache (refreshkv.runtime.static_decode), prefilled")
    policy = cache.policy
    states = [prefilled(layer) for layer in cache.layers]
    if any(cache.windowed):
        raise PolicyError("static decoding does not run sliding-window layers")
    if cache.pads is not None:
        raise PolicyError("static decoding takes rows of one length, without padding")
    if new_tokens > cache.expected_new_tokens():
        raise PolicyError(
            f"static decoding holds the {cache.expected_new_tokens()} new tokens announced to the cache; "
            f"{new_tokens} asked for"
        )
    if not policy.runs_on_device(states):
        raise PolicyError(f"{UNSUPPORTED}; got '{policy.name}'")
