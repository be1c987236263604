"""`pyramidkv` (Cai et al., 2024, PyramidKV): SnapKV selection with budgets decreasing from the bottom layer up.

Attention funnels from broad (lower layers) to focused (upper layers), so lower layers get more tokens
(dynamickv.txt §1, §5.1: "layers select important tokens in a monotonically decreasing manner"). The selection in each
layer is SnapKV's (observation window, max-pooled scores, GQA aggregation, window kept in every layer and counted in
the budget); only the per-layer budget of selected tokens differs, with the same total as SnapKV: num_layers x
(K - window), as PyramidKV's released code builds its pyramid on the budget less the window.

Defaults: snapkv's selection (window 32, kernel 7, span pooling, max over the group; chosen on the selection dev
set), since PyramidKV changes only the budgets; `preset="paper"` pools with the papers' centred kernel instead
(window 32, kernel 7, beta 20, as SnapKV's released setting). PyramidKV's released class defaults differ again
(window 64, kernel 5, average pooling); this package max-pools, as SnapKV's and RefreshKV's selections do.

Schedule (`pyramid_budgets`), PyramidKV's arithmetic sequence: with m layers and a mean budget K = total / m, the top
layer gets K / `beta` and the bottom layer 2K - K / `beta`, layers in between on the straight line (the mean is K, so
the sum is the total). `beta` = 20 by default (PyramidKV's setting); `beta` = 1 gives SnapKV's uniform budgets.
Integer budgets: the real values are floored and the remaining tokens given one each to the lowest layers, so the
budgets sum exactly to the total and never increase going up.
Budgets never exceed what exists: each layer keeps at most the L - window prompt tokens outside the window. When the
pyramid asks for more in some layers, their excess is spread evenly over the other layers (a uniform upward shift of
the line, capped), so the total is kept while it fits; a budget >= the prompt length keeps everything everywhere.
"""

from __future__ import annotations

import dataclasses
import math

from ..core.policy import PolicyError, register
from ..core.selection import SelectionLayer
from .snapkv import SnapKV

DEFAULT_BETA = 20.0


def check_beta(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 1:
        raise PolicyError(f"beta must be a number >= 1 (top layer budget = K / beta), got {value!r}")


def pyramid_budgets(total: int, num_layers: int, beta: float = DEFAULT_BETA, cap: int | None = None) -> list[int]:
    """Integer per-layer budgets, bottom layer first: non-increasing, summing to `total` (or to num_layers * cap
    when the total does not fit under `cap`, the most any layer can keep)."""
    if num_layers < 1 or total < 0:
        raise ValueError(f"need num_layers >= 1 and total >= 0, got {num_layers}, {total}")
    check_beta(beta)
    if cap is not None and total >= num_layers * cap:
        return [max(cap, 0)] * num_layers
    mean = total / num_layers
    top = mean / beta
    bottom = 2 * mean - top
    if num_layers == 1:
        line = [float(total)]
    else:
        line = [bottom - (bottom - top) * i / (num_layers - 1) for i in range(num_layers)]
    if cap is not None and max(line) > cap:
        # Shift the line up by the c that makes sum(min(cap, x + c)) == total (monotone in c; c in [0, cap]).
        low, high = 0.0, float(cap)
        for _ in range(100):
            shift = (low + high) / 2
            if sum(min(cap, x + shift) for x in line) < total:
                low = shift
            else:
                high = shift
        line = [min(cap, x + high) for x in line]
    limit = math.inf if cap is None else cap
    budgets = [int(min(math.floor(x + 1e-9), limit)) for x in line]
    remainder = total - sum(budgets)
    for i in range(num_layers):  # lowest layers first: keeps the sequence non-increasing
        if remainder <= 0:
            break
        if budgets[i] < limit:
            budgets[i] += 1
            remainder -= 1
    for i in reversed(range(num_layers)):  # float rounding only: take back from the top
        if remainder >= 0:
            break
        if budgets[i] > 0:
            budgets[i] -= 1
            remainder += 1
    return budgets


@register
@dataclasses.dataclass
class PyramidKV(SnapKV):
    """PyramidKV: SnapKV with per-layer budgets decreasing linearly from the bottom layer, same total.

    Parameters: `budget`: K tokens per KV head (or `budget_ratio`: K as a share of the longest prompt, 1/8 by
    default), the mean per layer, window included; `window` (32), `kernel` (7), `pooling` (span), `aggregation`
    (max) as in snapkv (its defaults); `beta` (20) the top layer's budget is the mean / beta; `compress_every`
    (None) as in snapkv, each layer back to its pyramid budget. `preset="paper"`: PyramidKV's own selection
    (centred max-pooling, kernel 7, window 32, beta 20).
    """

    name = "pyramidkv"
    summary = "SnapKV with per-layer budgets decreasing linearly from the bottom layer (same total budget)"
    # The defaults are snapkv's selection (span pooling: the centred kernel cuts a number the tokenizer spells digit
    # by digit); "paper" keeps the pyramid on the papers' centred kernel, as this method ran before.
    presets = {"paper": {"window": 32, "kernel": 7, "pooling": "centered", "aggregation": "max", "beta": DEFAULT_BETA}}

    beta: float = DEFAULT_BETA

    def __post_init__(self) -> None:
        super().__post_init__()
        check_beta(self.beta)

    def layer_budget(self, layer: SelectionLayer) -> int:
        outside_window = max(layer.seen - self.window, 0)  # prompt tokens SnapKV selects from (window kept anyway)
        layers = layer.method_layers()  # the pyramid spans the layers that run the method (not sliding windows)
        total = self.selected_budget(layer) * len(layers)
        budgets = pyramid_budgets(total, len(layers), self.beta, cap=outside_window)
        return budgets[layers.index(layer)]
