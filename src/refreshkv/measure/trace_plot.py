"""A trace's PNG: one heatmap per measure (decode steps across, traced layers up), full steps marked."""

from __future__ import annotations

from pathlib import Path

from ..runtime.output_files import save_figure

PANELS = (
    ("mass", "exact attention mass on what the step attended to"),
    ("overlap", "share of the exact top-K attended to"),
    ("needle", "share of the needle's tokens in the selection"),
    ("needle_attention", "exact attention on the needle (largest over heads)"),
)
MOST_LABELS = 64  # token labels on the step axis beyond this are thinned


def plot_trace(trace: dict, tokens: list[str], path: Path) -> None:
    """`tokens`: the text of each written token (step s writes token s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    steps, layers = trace["steps"], trace["layers"]
    panels = [panel for panel in PANELS if panel[0] != "needle" or trace["needle_positions"]]
    width = min(4 + 0.18 * len(steps), 40)
    panel_height = max(1.2, 0.12 * len(layers))  # a model with few traced layers (Gemma: 3) still gets readable rows
    figure, axes = plt.subplots(len(panels), 1, figsize=(width, 1.5 + panel_height * len(panels)))
    axes = np.atleast_1d(axes)
    full = np.array([step["full"] for step in steps], dtype=bool).T  # (layers, steps)
    for axis, (name, title) in zip(axes, panels):
        grid = np.array([step[name] for step in steps], dtype=float).T
        image = axis.imshow(
            grid, aspect="auto", origin="lower", vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest"
        )
        rows, columns = np.nonzero(full)
        axis.scatter(columns, rows, s=6, c="red", marker="s", label="full step")
        axis.set_title(title, fontsize=9)
        axis.set_ylabel("layer")
        axis.set_yticks(range(len(layers)), [str(layer) for layer in layers], fontsize=6)
        figure.colorbar(image, ax=axis, fraction=0.02, pad=0.01)
    every = max(1, -(-len(steps) // MOST_LABELS))
    labels = [repr(token)[1:-1][:10] for token in tokens[1 : len(steps) + 1]]
    axes[-1].set_xticks(range(0, len(steps), every), labels[::every], rotation=90, fontsize=6)
    axes[-1].set_xlabel("decode step (the token it writes)")
    axes[0].legend(loc="upper right", fontsize=6)
    figure.suptitle(
        f"{trace['method']}: {trace['prompt_tokens']} prompt tokens, K = {trace['budget']}; {trace['shows']}",
        fontsize=8,
    )
    figure.tight_layout()
    try:
        save_figure(figure, path, "trace plot", dpi=120)
    finally:
        plt.close(figure)
