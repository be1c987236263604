"""What a method actually kept of the prompt: counted from the stores' positions, for any method.

`budget_report(cache)` (call it after `generate`; it reads `output.cache`) counts, per layer, row and KV head, the
valid prompt positions still in the cache: position >= the row's left-pad count and < the (padded) prompt length.
A `FullStore` anywhere in a layer's state (full, refreshkv/recycled's C_f, ...) means the whole prompt is kept.
Otherwise the layer's `SlotStore` (the state's `store`, or the first SlotStore attribute) is counted. Methods that
evict prompt tokens while decoding report what remains at the time of the call.

- `budget_ratio`: kept prompt tokens / prompt tokens, summed over layers, rows and KV heads;
- `budget_per_layer`: mean kept tokens per layer (mean over rows and heads);
- `budget_per_head`: per layer, the mean kept tokens of each KV head (mean over rows);
- `ratio_per_layer`: per layer, kept / prompt tokens; `prompt_tokens`: real prompt tokens per row.
"""

from __future__ import annotations

import torch

from .core.kvstore import FullStore, SlotStore


def _stores(state):
    if isinstance(state, (FullStore, SlotStore)):
        return [state]
    fields = vars(state) if hasattr(state, "__dict__") else {}
    ordered = ([fields["store"]] if "store" in fields else []) + list(fields.values())
    return [value for value in ordered if isinstance(value, (FullStore, SlotStore))]


def _kept(state, length: int, pads: torch.Tensor | None, batch: int) -> torch.Tensor:
    """(B, Hkv) kept prompt tokens of one layer."""
    stores = _stores(state)
    if not stores:
        raise ValueError(
            f"cannot read a KV store from layer state of type {type(state).__name__}"
        )
    pad = torch.zeros(batch, dtype=torch.long) if pads is None else pads.long().cpu()
    full = next((s for s in stores if isinstance(s, FullStore)), None)
    if full is not None:
        return (length - pad).view(-1, 1).expand(batch, full.keys.shape[1]).clone()
    positions = stores[0].positions.cpu()
    valid = (positions >= pad.view(-1, 1, 1)) & (positions < length)
    return valid.sum(-1)


def budget_report(cache) -> dict:
    """Kept prompt tokens per layer and KV head after prefill (see the module docstring)."""
    states = [layer.state for layer in cache.layers]
    if any(state is None for state in states):
        raise ValueError("the cache has not been prefilled")
    pads = cache.pads
    length = cache.prompt_length + (
        int(pads.min()) if pads is not None else 0
    )  # padded prompt length
    first = _stores(states[0])
    batch = first[0].keys.shape[0] if first else 1
    prompt = (
        length
        - (
            pads.long().cpu()
            if pads is not None
            else torch.zeros(batch, dtype=torch.long)
        )
    ).tolist()
    kept = [_kept(state, length, pads, batch) for state in states]  # each (B, Hkv)
    total_prompt = sum(prompt)
    kept_all = sum(int(k.sum()) for k in kept)
    prompt_slots = sum(total_prompt * k.shape[1] for k in kept)
    return {
        "budget_ratio": kept_all / prompt_slots if prompt_slots else 0.0,
        "budget_per_layer": [float(k.float().mean()) for k in kept],
        "budget_per_head": [k.float().mean(0).tolist() for k in kept],
        "ratio_per_layer": [int(k.sum()) / (total_prompt * k.shape[1]) for k in kept],
        "prompt_tokens": prompt,
    }


def budget_table(report: dict, title: str = "Kept prompt tokens"):
    """A rich Table of a `budget_report`: one row per layer (mean kept, ratio, per-head means)."""
    from rich.table import Table

    table = Table(title=f"{title} (overall ratio {report['budget_ratio']:.3f})")
    table.add_column("layer", justify="right")
    table.add_column("kept (mean)", justify="right")
    table.add_column("ratio", justify="right")
    table.add_column("per KV head")
    for i, (mean, ratio, heads) in enumerate(
        zip(
            report["budget_per_layer"],
            report["ratio_per_layer"],
            report["budget_per_head"],
        )
    ):
        table.add_row(
            str(i), f"{mean:.1f}", f"{ratio:.3f}", " ".join(f"{h:.0f}" for h in heads)
        )
    return table
