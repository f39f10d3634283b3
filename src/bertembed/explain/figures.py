"""How a result's figure is made and shown: its record (`Figure`), the axes and colours every figure shares, and its
PNG in HTML. Each result's `plot_*` functions take the result (and optionally a matplotlib `ax`) and return the
Figure, never calling `show()`; matplotlib is imported only when one is drawn (Agg backend)."""

from __future__ import annotations

import base64
import dataclasses
import html
import io
from collections.abc import Callable
from typing import Any

PART_COLOURS = {"word": "#4c72b0", "position": "#dd8452", "segment": "#55a868"}


@dataclasses.dataclass(frozen=True)
class Figure:
    """One figure of a result: its name (the PNG's, for --plots DIR), its title, its caption (the measured numbers in
    words) and `draw()`, which returns a new matplotlib Figure."""

    name: str
    title: str
    caption: str
    draw: Callable[[], Any]


def axes(ax=None, size=(7.5, 3.6), panels=1):
    """(figure, ax), or (figure, [ax, ...]) for `panels` > 1, on a new figure unless `ax` is given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, panels, figsize=size, layout="constrained") if ax is None else (ax.figure, ax)


def token_axis(ax, tokens) -> None:
    ax.set_xticks(range(len(tokens)), tokens, rotation=60, ha="right", fontsize=8)
    ax.set_xlim(-0.6, len(tokens) - 0.4)


def figure_png(fig) -> bytes:
    """Render a matplotlib Figure to PNG bytes and close it."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def figure_html(title: str, png: bytes, caption: str) -> str:
    """A figure: its PNG inline (a base64 data URI, so the page needs no other file), then its caption."""
    data = base64.b64encode(png).decode("ascii")
    return (f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,{data}"><figcaption><b>'
            f"{html.escape(title)}.</b> {html.escape(caption)}</figcaption></figure>")
