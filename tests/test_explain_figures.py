"""Figures and notebook views: every result draws its own figures from real results without show(), and their
captions state the numbers."""

from __future__ import annotations

import matplotlib
import pytest

import conftest_explain as helpers
from bertembed.explain.report import run_analyses

tiny = helpers.tiny  # shared fixture

matplotlib.use("Agg")

# every figure, by the name of its PNG (--plots DIR, docs/figures/), in the order the report shows them
FIGURES = ["decomposition_norms", "variance_shares", "position_similarity", "position_norms", "position_spectrum",
           "position_pca", "segments", "segment_effect", "token_norms", "neighbours", "onehot", "finetune_rows",
           "finetune_positions", "drift"]


@pytest.fixture(scope="module")
def results(tiny):
    from bertembed.explain.drift import drift

    out = run_analyses("the cat sat", "a dog", tiny, finetune=True, steps=2)
    return [*out, drift(tiny, tiny)]


def test_every_figure_draws_with_a_numeric_caption(results, monkeypatch):
    import matplotlib.pyplot as plt

    monkeypatch.setattr(plt, "show", lambda *a, **k: pytest.fail("plots must not call show()"))
    drawn = []
    for result in results:
        for figure in result.figures():
            fig = figure.draw()
            assert isinstance(fig, matplotlib.figure.Figure) and fig.axes
            assert all(ax.get_ylabel() for ax in fig.axes), figure.name  # every axis says what it measures
            assert fig.axes[0].get_title() or fig.get_suptitle(), figure.name
            assert any(ch.isdigit() for ch in figure.caption) and len(figure.caption) > 80
            drawn.append(figure.name)
            plt.close(fig)
    assert drawn == FIGURES


def test_single_panel_plots_draw_into_a_given_ax(results):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    assert results[0].plot_norms(ax=ax) is fig
    assert len(ax.patches) >= 3 * len(results[0].tokens)  # three bars per token
    plt.close(fig)


def test_results_render_in_notebooks(results):
    for result in results:
        page = result._repr_html_()
        assert "<table>" in page and page.count("<img") == len(result.figures())


def test_the_spectrum_figure_shades_the_band_its_numbers_cover():
    """The shaded band is frequencies 1..k, the band whose share the caption and the summary quote."""
    from bertembed.explain import analyze_positions

    report = analyze_positions()
    ax = report.plot_spectrum().axes[0]
    (band,) = [p for p in ax.patches if p.get_label().startswith("frequencies 1-")]
    extent = band.get_extents().transformed(ax.transData.inverted())  # (display back to data coordinates)
    assert (extent.x0, extent.x1) == pytest.approx((0.5, report.k + 0.5))
    assert f"{report.lowfreq_share:.0%}" in band.get_label()
    assert report.lowfreq_share == pytest.approx(float(report.spectrum[1:report.k + 1].sum()))


def test_the_rows_moved_figure_draws_no_bar_for_zero_on_its_log_axis(results):
    from bertembed.explain.finetune import FinetuneReport

    report = next(r for r in results if isinstance(r, FinetuneReport))
    frozen = [t for run in report.runs for t in run.tables if t.moved == 0]
    assert frozen, "the demo has a run with a frozen table (no row moved)"
    ax = report.plot_rows().axes[0]
    heights = [bar.get_height() for bar in ax.patches]
    assert all(h > 0 for h in heights if h == h)  # (NaN: no bar)
    assert sum(h != h for h in heights) == len(frozen)
    assert sum(text.get_text() == "0" for text in ax.texts) == len(frozen)


def test_the_positions_figures_have_interactive_twins_naming_every_position():
    """Each positions figure has a plotly twin with the same data, its hover naming the position; the matplotlib pair
    names its first positions (on the bundled ring: every one, 62° apart) and joins them in order."""
    import matplotlib.pyplot as plt
    import numpy as np

    from bertembed.explain import analyze_positions

    go = pytest.importorskip("plotly.graph_objects", reason="plotly draws the report's interactive figures")

    report = analyze_positions()
    twins = {f.name: f.plotly() for f in report.figures()}
    assert all(isinstance(fig, go.Figure) and fig.data for fig in twins.values())
    for name in ("position_similarity", "position_norms", "position_pca"):
        assert all("position" in t.hovertemplate for t in twins[name].data), name
    points = next(t for t in twins["position_pca"].data if t.name == "positions")
    assert list(points.text) == list(range(512)) and np.allclose(points.x, report.pca_coords[:, 0])
    assert np.allclose(twins["position_norms"].data[0].y, report.norms)
    heat = twins["position_similarity"].data[0]
    assert np.allclose(heat.z, report.similarity, atol=1e-6)
    fig = report.plot_pca()
    ax, right = fig.axes[:2]
    assert [t.get_text() for t in ax.texts] == [str(p) for p in range(24)]  # period 5.8: every position named
    assert np.allclose(ax.lines[0].get_xdata(), report.pca_coords[:24, 0])
    assert len(right.lines) == 4 and right.get_xlabel() == "position"
    plt.close(fig)
