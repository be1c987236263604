"""Greedy decode steps with every per-step number on the device, so that a step is captured once as a CUDA graph and
replayed (issue 48: a GPU step that is not host-bound).

A step replayed from a graph reruns the kernels captured, with the arguments they had then: a cache length, a
position or a step count written as a Python number would stay what it was at capture. Here those live in device
tensors (`Counters`) that the step itself advances, every store keeps its fixed size, and attention reads which
entries count from the device (core/triton_decode.py on a GPU, PyTorch's attention over the whole buffer with a
mask elsewhere). The next token is chosen inside the step (greedy), so a replay needs nothing from the host.

`StaticCache` is a `PolicyCache` whose prompt goes through the method as always (the same prefill and selection);
`StaticDecoder` then decodes from it. Per method one graph per kind of step, chosen on the host from the step
number alone: `full` and the eviction methods one; `recycled` a partial and a full step; `refreshkv` a partial step
and a query-check step, in which each layer decides per row on the device: the rows that drifted attend over C_f and
refresh C_p, the others attend over C_p (on a GPU only each row's own path reads its cache; with `conditional` the
refresh is a conditional graph node, skipped on the device where no row drifted). What it runs: `full`,
`refreshkv` and `recycled` with a dense C_f, and the eviction methods that evict by their stored scores (snapkv,
pyramidkv, dynamickv, refreekv, keydiff); rows without padding, no sliding-window layer, at most the announced new
tokens. The stores are the prefill's own: after `run` the cache holds the generation, its host counters advanced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from ..core import triton_decode
from ..core.attention_math import attend_with_probs, decode_attention
from ..core.kvstore import FullStore
from ..core.policy import PolicyError
from ..core.selection import APPENDED, SelectionPolicy, SelectionState
from ..engine.cache import PolicyCache, PolicyLayer, hand_over
from ..engine.cache_argument import with_cache
from ..methods.full import Full
from ..methods.refreshkv import RefreshKV, RefreshState, answer_scores, copy_rows
from .compiled import compiled_forward
from .generate import StepTimer

UNSUPPORTED = (
    "static decoding runs full, refreshkv and recycled with a dense C_f (budget below the cache) and the eviction "
    "methods that evict by their stored scores"
)


@dataclasses.dataclass
class Counters:
    """What a step reads and advances on the device: tokens held, counting the current one, and the step number."""

    seen: Tensor  # (1,) int64
    step: Tensor  # (1,) int64


def attend(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    scaling: float,
    *,
    length: Tensor | None = None,
    positions: Tensor | None = None,
    rows: Tensor | None = None,
    expect: bool = True,
    keep_probs: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """One query token over a whole fixed-size store, of which the first `length` entries count or the slots whose
    `positions` are >= 0. Where the Triton kernel runs only the rows whose `rows` flag is `expect` are computed;
    elsewhere every row is (the caller keeps the ones it wants). Returns the output (B, 1, Hq, D) and, with
    `keep_probs`, the float32 probabilities (B, Hkv, G, n)."""
    if triton_decode.available(query, keys):
        return triton_decode.one_query_attention(
            query, keys, values, scaling, length, positions, rows, expect, keep_probs
        )
    n = keys.shape[2]
    valid = (torch.arange(n, device=keys.device) < length).view(1, 1, n) if length is not None else positions >= 0
    if keep_probs:
        return attend_with_probs(query, keys, values, scaling, valid)
    return decode_attention(query, keys, values, scaling, valid), None


class StaticLayer(PolicyLayer):
    """A `PolicyLayer` whose decode steps run on fixed-size stores and device counters once `static` is set."""

    static = False

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.static:
            return super().update(key_states, value_states, *args, **kwargs)
        hand_over(self, key_states)
        return key_states, value_states

    def positions(self, device) -> Tensor:
        if not self.static:
            return super().positions(device)
        return self.cache.counters.seen - 1

    def attend(self, module, query, key, value, mask, scaling: float, sliding_window: int | None = None):
        if not self.static:
            return super().attend(module, query, key, value, mask, scaling, sliding_window)
        counters, policy = self.cache.counters, self.cache.policy
        position = counters.seen - 1
        state = self.state
        if isinstance(state, FullStore):
            self._record(1.0)
            _write(state, key, value, position)
            return attend(query, state.keys, state.values, scaling, length=counters.seen)[0]
        if isinstance(state, SelectionState):
            self._record(0.0)
            # the eviction methods static decoding runs evict by their stored scores (`check_static`)
            state.put(state.scores, key, value, position, (APPENDED + counters.step).float())
            return attend(query, state.store.keys, state.store.values, scaling, positions=state.store.positions)[0]
        return self._refresh_step(policy, state, query, key, value, scaling)

    def _refresh_step(self, policy: RefreshKV, state: RefreshState, query, key, value, scaling: float) -> Tensor:
        """refreshkv / recycled: the new token into C_f; then C_p (a partial step), C_f and a refreshed C_p (a full
        step), or each row its own of the two (a query check), as the method decides eagerly."""
        counters, kind, partial = self.cache.counters, self.cache.kind, state.partial
        position = counters.seen - 1
        _write(state.full, key, value, position)
        if kind == "full":  # every row refreshes (recycled's stride)
            self._record(1.0)
            return self._full_attention(policy, state, query, scaling)
        rows = policy.drifted(self, query) if kind == "check" else None
        # a refreshed row carries C_p as it was before this step's token took a slot, as it would eagerly
        held = (partial.store.positions.clone(), partial.scores.clone()) if rows is not None and policy.carry else None
        partial.put(partial.scores, key, value, position, (APPENDED + counters.step).float())
        store = partial.store
        output, _ = attend(query, store.keys, store.values, scaling, positions=store.positions, rows=rows, expect=False)
        if rows is None:
            self._record(0.0)
            return output
        self._record(rows.float().mean())

        def refresh() -> None:  # the rows that drifted: attention over C_f into `output`, C_p refreshed
            drifted = self._full_attention(policy, state, query, scaling, rows, held)
            output.copy_(torch.where(rows.view(-1, 1, 1, 1), drifted, output))

        only_if(rows.any(), refresh, self.cache.conditional)
        return output

    def _full_attention(self, policy: RefreshKV, state: RefreshState, query, scaling: float, rows=None, held=None):
        """Attention over C_f (for `rows` only, where the kernel can) and C_p rebuilt from it, the anchor moved."""
        full, seen = state.full, self.cache.counters.seen
        output, probs = attend(query, full.keys, full.values, scaling, length=seen, rows=rows, keep_probs=True)
        batch, n = query.shape[0], full.keys.shape[2]
        valid = (torch.arange(n, device=query.device) < seen).expand(batch, n).reshape(batch, 1, 1, n)
        before = state.answer_start if policy.keep_decoded else None
        kv = (full.keys, full.values)
        kept = policy._refresh(self, probs.unsqueeze(3), valid, kv, rows, held=held, before=before)
        if policy.keep_decoded:
            hold_answer(state, kept, seen, rows)
        if policy.stride is None:
            current = policy.compared_query(self, query)
            # in place, as every state a step changes: a graph replays into the memory it was captured with
            state.anchor.copy_(current if rows is None else torch.where(rows[:, None], current, state.anchor))
        return output

    def _record(self, share: float | Tensor) -> None:
        """The share of rows that attended fully at this step, in the cache's per-layer device record."""
        record, index = self.cache.full_shares[self.layer_idx], self.cache.counters.step - 1
        if isinstance(share, Tensor):
            record.index_copy_(0, index, share.view(1))
        else:
            record.index_fill_(0, index, share)


def hold_answer(state: RefreshState, kept: int, seen: Tensor, rows: Tensor | None) -> None:
    """`keep_decoded` on the device: after a refresh that selected `kept` tokens before the answer, the answer so far
    goes into the slots after them, as `RefreshKV._hold_answer` puts it eagerly. The host does not know how far the
    answer has come, so the whole span it may take is copied from C_f and the positions not yet decoded (>= `seen`)
    are left empty (zeros: C_f holds whatever its allocation held there, which a masked slot must not carry in)."""
    partial, full, start = state.partial, state.full, state.answer_start
    assert partial is not None  # a refresh has C_p
    room = min(partial.store.slots - kept, full.keys.shape[2] - start)
    store, taken = partial.store, slice(kept, kept + room)
    positions = torch.arange(start, start + room, device=seen.device)
    decoded = positions < seen
    shape = (*full.keys.shape[:2], room)
    scores = torch.where(decoded, answer_scores(positions, start), float("-inf"))
    answer = decoded.view(1, 1, room, 1)
    for target, source in (
        (store.keys[:, :, taken], torch.where(answer, full.keys[:, :, start : start + room], 0)),
        (store.values[:, :, taken], torch.where(answer, full.values[:, :, start : start + room], 0)),
        (store.positions[:, :, taken], torch.where(decoded, positions, -1).expand(shape)),
        (partial.scores[:, :, taken], scores.expand(shape)),
    ):
        copy_rows(target, source, rows)


def only_if(flag: Tensor, body: Callable[[], None], conditional: bool) -> None:
    """Run `body` where `flag` (a one-element bool tensor) holds. Eagerly the flag is read on the host; in a CUDA
    graph being captured, with `conditional`, the body becomes a conditional node that the graph skips on the device
    (torch.cuda.CUDAGraph.begin_capture_to_if_node), else it always runs, as it does under torch.compile. Skipping
    changes nothing: the body only writes the rows whose flags are set."""
    capturing = flag.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing and conditional:
        graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
        graph.begin_capture_to_if_node(flag)
        try:
            body()
        finally:
            graph.end_capture_to_conditional_node()
    elif capturing or torch.compiler.is_compiling() or bool(flag):
        body()


def _write(full: FullStore, key: Tensor, value: Tensor, position: Tensor) -> None:
    """The decoded token's key and value into C_f at `position` (a device index)."""
    full.keys.index_copy_(2, position, key)
    full.values.index_copy_(2, position, value)


class StaticCache(PolicyCache):
    """A `PolicyCache` that `StaticDecoder` can decode from after its prompt (the prompt runs as in any PolicyCache)."""

    layer_type = StaticLayer
    kind = "partial"  # the kind of step being run or captured (host side, fixed per graph)
    conditional = False  # a query check's refresh as a conditional graph node (`only_if`)
    counters: Counters
    full_shares: list[Tensor]  # per layer, (steps,) share of rows that attended fully


def step_kind(policy, step: int) -> str:
    """The step's kind, from its number alone: "plain" (every step alike), "partial", "full" or "check"."""
    if not isinstance(policy, RefreshKV):
        return "plain"
    if not policy._scheduled(step):
        return "partial"
    return "full" if policy.stride is not None else "check"


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
        for layer in cache.layers:  # attention over the whole buffer weighs unwritten entries by 0: 0 x NaN is NaN
            full = layer.state.full if isinstance(layer.state, RefreshState) else layer.state
            if isinstance(full, FullStore):
                with torch.inference_mode():  # the prefill's stores are inference tensors when it ran in that mode
                    full.keys[:, :, full.length :].zero_()
                    full.values[:, :, full.length :].zero_()
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
                kind = step_kind(policy, step)
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
            state = layer.state
            if isinstance(state, RefreshState):
                state.full.length += steps
                state = state.partial
            elif isinstance(state, FullStore):
                state.length += steps
                continue
            state.filled = 0  # mask until the slots are known full again
            state.empty = int((state.store.positions < 0).sum(-1).min())


def check_static(cache: PolicyCache, new_tokens: int) -> None:
    """Refuse, in one line, a cache that static decoding cannot run (see the module doc)."""
    if not isinstance(cache, StaticCache):
        raise PolicyError("static decoding takes a StaticCache (refreshkv.runtime.static_decode), prefilled")
    policy = cache.policy
    states = [layer.state for layer in cache.layers]
    if any(state is None for state in states):
        raise PolicyError("static decoding starts after the prompt: prefill the StaticCache first")
    if any(cache.windowed):
        raise PolicyError("static decoding does not run sliding-window layers")
    if cache.pads is not None:
        raise PolicyError("static decoding takes rows of one length, without padding")
    if new_tokens > cache.expected_new_tokens():
        raise PolicyError(
            f"static decoding holds the {cache.expected_new_tokens()} new tokens announced to the cache; "
            f"{new_tokens} asked for"
        )
    if isinstance(policy, Full) or (
        isinstance(policy, RefreshKV)
        and all(isinstance(s, RefreshState) and type(s.full) is FullStore and s.partial is not None for s in states)
    ):
        return
    eviction = isinstance(policy, SelectionPolicy) and all(
        getattr(type(policy), name) is getattr(SelectionPolicy, name)
        for name in ("decode", "append", "observe", "eviction_scores", "appended_score")
    )
    if not eviction or not all(isinstance(s, SelectionState) for s in states):
        raise PolicyError(f"{UNSUPPORTED}; got '{policy.name}'")
