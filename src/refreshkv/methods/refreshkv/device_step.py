"""`refreshkv` / `recycled` decode steps with every per-step number on the device (core/device_steps.py), for static
decoding's CUDA graphs (runtime/static_decode.py).

One graph per kind of step, chosen on the host from the step number alone: a partial step; `recycled`'s full step;
`refreshkv`'s query-check step, in which each layer decides per row on the device: the rows that drifted attend over
C_f and refresh C_p, the others attend over C_p (on a GPU only each row's own path reads its cache; with
`conditional` the refresh is a conditional graph node, skipped on the device where no row drifted). The refresh is
partial_cache.py's rule, the same as eager steps run.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from ...core.device_steps import DeviceLayer, attend, only_if, write_token
from ...core.kvstore import FullStore, LayerState
from ...core.selection import APPENDED
from .partial_cache import RefreshLayer, RefreshState, SelectionRule, hold_answer_on_device


class RefreshKV(Protocol):
    """What a device step reads of the policy (policy.py's `RefreshKV`): its schedule and its selection."""

    stride: int | None
    carry: float
    keep_decoded: bool

    def scheduled(self, step: int) -> bool: ...
    def drifted(self, layer: RefreshLayer, query: Tensor) -> Tensor: ...
    def compared_query(self, layer: RefreshLayer, query: Tensor, width: int = 1) -> Tensor: ...
    def selection_rule(self, layer: RefreshLayer) -> SelectionRule: ...


def step_kind(policy: RefreshKV, step: int) -> str:
    """A partial step, or at a scheduled step a full one (fixed schedule) or a query check (dynamic)."""
    if not policy.scheduled(step):
        return "partial"
    return "full" if policy.stride is not None else "check"


def runs_on_device(states: list[LayerState]) -> bool:
    """A dense C_f and a partial cache in every layer (a budget below the cache)."""
    return all(isinstance(s, RefreshState) and type(s.full) is FullStore and s.partial is not None for s in states)


def step(
    policy: RefreshKV, layer: DeviceLayer[RefreshState], query: Tensor, key: Tensor, value: Tensor, scaling: float
) -> Tensor:
    """The new token into C_f; then C_p (a partial step), C_f and a refreshed C_p (a full step), or each row its
    own of the two (a query check), as the method decides eagerly."""
    state, counters, kind = layer.state, layer.counters, layer.kind
    partial, full = state.partial, state.full
    assert partial is not None and isinstance(full, FullStore)  # `runs_on_device`
    position = counters.seen - 1
    write_token(full, key, value, position)
    if kind == "full":  # every row refreshes (recycled's stride)
        layer.record_full_share(1.0)
        return full_attention(policy, layer, query, scaling)
    rows = policy.drifted(layer, query) if kind == "check" else None
    # a refreshed row carries C_p as it was before this step's token took a slot, as it would eagerly
    held = (partial.store.positions.clone(), partial.scores.clone()) if rows is not None and policy.carry else None
    partial.put(partial.scores, key, value, position, (APPENDED + counters.step).float())
    store = partial.store
    output, _ = attend(query, store.keys, store.values, scaling, positions=store.positions, rows=rows, expect=False)
    if rows is None:
        layer.record_full_share(0.0)
        return output
    layer.record_full_share(rows.float().mean())

    def refresh() -> None:  # the rows that drifted: attention over C_f into `output`, C_p refreshed
        drifted = full_attention(policy, layer, query, scaling, rows, held)
        output.copy_(torch.where(rows.view(-1, 1, 1, 1), drifted, output))

    only_if(rows.any(), refresh, layer.conditional)
    return output


def full_attention(
    policy: RefreshKV,
    layer: DeviceLayer[RefreshState],
    query: Tensor,
    scaling: float,
    rows: Tensor | None = None,
    held: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Attention over C_f (for `rows` only, where the kernel can) and C_p rebuilt from it, the anchor moved."""
    state, seen = layer.state, layer.counters.seen
    full = state.full
    assert isinstance(full, FullStore)  # `runs_on_device`
    output, probs = attend(query, full.keys, full.values, scaling, length=seen, rows=rows, keep_probs=True)
    assert probs is not None  # asked for
    batch, n = query.shape[0], full.keys.shape[2]
    valid = (torch.arange(n, device=query.device) < seen).expand(batch, n).reshape(batch, 1, 1, n)
    before = state.answer_start if policy.keep_decoded else None
    kv = (full.keys, full.values)
    kept = policy.selection_rule(layer).refresh(layer, probs.unsqueeze(3), valid, kv, rows, held=held, before=before)
    if policy.keep_decoded:
        hold_answer_on_device(state, kept, seen, rows)
    if policy.stride is None:
        assert state.anchor is not None  # the dynamic schedule's anchor, set at the prompt
        current = policy.compared_query(layer, query)
        # in place, as every state a step changes: a graph replays into the memory it was captured with
        state.anchor.copy_(current if rows is None else torch.where(rows[:, None], current, state.anchor))
    return output
