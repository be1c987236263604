"""What a method actually kept of the prompt: counted from each layer state's `kept()` positions, for any method.

`budget_report(cache)` (call it after `generate`; it reads `output.cache`) counts, per layer, row and KV head, the
valid prompt positions the layer holds: position >= the row's left-pad count and < the (padded) prompt length.
Methods that keep the full cache (full, refreshkv/recycled's C_f, ...) report the whole prompt; methods that evict
prompt tokens while decoding report what remains at the time of the call.

- `budget_ratio`: kept prompt tokens / prompt tokens, summed over layers, rows and KV heads;
- `budget_per_layer`: mean kept tokens per layer (mean over rows and heads);
- `budget_per_head`: per layer, the mean kept tokens of each KV head (mean over rows);
- `ratio_per_layer`: per layer, kept / prompt tokens; `prompt_tokens`: real prompt tokens per row.
"""

from __future__ import annotations

import torch


def budget_report(cache) -> dict:
    """Kept prompt tokens per layer and KV head (see the module docstring)."""
    states = [layer.state for layer in cache.layers]
    if any(state is None for state in states):
        raise ValueError("the cache has not been prefilled")
    kept_positions = [state.kept(cache.pads).cpu() for state in states]  # each (B, Hkv, n), -1 = nothing
    batch = kept_positions[0].shape[0]
    pads = torch.zeros(batch, dtype=torch.long) if cache.pads is None else cache.pads.long().cpu()
    length = cache.prompt_length + int(pads.min())  # padded prompt length
    prompt = (length - pads).tolist()
    kept = [((p >= 0) & (p < length)).sum(-1) for p in kept_positions]  # each (B, Hkv)
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
        table.add_row(str(i), f"{mean:.1f}", f"{ratio:.3f}", " ".join(f"{h:.0f}" for h in heads))
    return table
