"""What the figures share. Each result's figures are drawn by its own module's `plot_*` functions, which take the
result (and optionally a matplotlib `ax`) and return the Figure, never calling `show()`; matplotlib is imported only
when one is drawn (Agg backend)."""

from __future__ import annotations

PART_COLOURS = {"word": "#4c72b0", "position": "#dd8452", "segment": "#55a868"}


def axes(ax=None, size=(7.5, 3.6), panels=1):
    """(figure, ax), or (figure, [ax, ...]) for `panels` > 1, on a new figure unless `ax` is given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if ax is None:
        return plt.subplots(1, panels, figsize=size, layout="constrained")
    return ax.figure, ax


def token_axis(ax, tokens) -> None:
    ax.set_xticks(range(len(tokens)), tokens, rotation=60, ha="right", fontsize=8)
    ax.set_xlim(-0.6, len(tokens) - 0.4)
