"""The HTML report in a real browser: Debian's chromium, driven by Playwright through its `executable_path` (no browser
is downloaded), opens the file from disk behind a proxy that answers nothing, and records every request. After the
scripts run: the plotly figures exist, every PNG decodes, no request left the file, no column is cut at 1,400 px, and
a search in the projector marks the neighbours numpy finds. The test looks at the page from outside (plotly's own
state, the page's own search box): the page users get carries no test code."""

from __future__ import annotations

import shutil
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest

import conftest_explain as helpers
from bertembed.atomic import write_atomic
from bertembed.explain.report import report_html, run_analyses

tiny = helpers.tiny  # shared fixture
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (the dev extra) drives the browser")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or (
    "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--proxy-server=127.0.0.1:9",
         "--proxy-bypass-list=<-loopback>"]  # any network request would fail, and is recorded
# the images that decoded, and all of them, once the page has loaded (the load event waits for every image)
COUNT_IMAGES = "[[...document.images].filter(i => i.complete && i.naturalWidth > 0).length, document.images.length]"

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                                "(apt-get install chromium; .ci/run installs it)")


@pytest.fixture(scope="module")
def results(tiny, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:  # (the projector's cache, away from the user's)
        patch.setenv("BERTEMBED_CACHE", str(tmp_path_factory.mktemp("cache")))
        return run_analyses("the cat sat on the mat", "a dog", tiny, projector=True, finetune=True, steps=2)


@pytest.fixture(scope="module")
def report_file(results, tmp_path_factory) -> Path:
    return write_atomic(tmp_path_factory.mktemp("report") / "report.html", report_html(results).encode())


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def loaded(browser, report_file):
    return opened(browser, report_file)


def opened(browser, page_file: Path, width: int = 1400):
    """The page loaded at `width` px, its scripts run; with the requests it made and the errors its scripts threw."""
    page, requests, errors = browser.new_page(viewport={"width": width, "height": 900}), [], []
    page.on("request", lambda request: requests.append(request.url))
    page.on("pageerror", lambda error: errors.append(error))
    page.goto(page_file.as_uri(), wait_until="load")
    return page, requests, errors


def test_the_figures_render_offline(loaded, report_file, results):
    page, requests, errors = loaded
    twins = [f.name for r in results for f in r.figures() if f.plotly is not None]
    drawn = page.evaluate("[...document.querySelectorAll('.js-plotly-plot')].filter(d => d.querySelector("
                          "'.main-svg') && d.data.length).map(d => d.id)")
    assert drawn == twins and len(twins) >= 10
    loaded, total = page.evaluate(COUNT_IMAGES)
    assert loaded == total == sum(len(r.figures()) for r in results) - len(twins)
    assert requests == [report_file.as_uri()] and errors == []


def test_a_broken_image_is_counted(browser, report_file, tmp_path):
    """The image count above would see a PNG that fails to decode (every figure is interactive in this report, so one
    broken image is added to it)."""
    broken = tmp_path / "broken.html"
    broken.write_text(report_file.read_text().replace("<body>", '<body><img alt="broken" '
                                                                  'src="data:image/png;base64,AAAA">', 1))
    loaded, total = opened(browser, broken)[0].evaluate(COUNT_IMAGES)
    assert loaded == total - 1


def test_no_column_is_cut_at_1400_px(loaded):
    page = loaded[0]
    widths = page.evaluate("[...document.querySelectorAll('.scroll')].map(d => [d.scrollWidth, d.clientWidth])")
    assert widths and all(inner <= shown for inner, shown in widths), widths
    headers = page.evaluate("[...document.querySelectorAll('th')].map(h => h.textContent)")
    assert "word norm" in headers and not [h for h in headers if "_" in h]


@pytest.mark.parametrize("asked, token", [("king", "king"), ("King", "king"), ("##s", "##s")])
def test_a_search_marks_the_nearest_rows_numpy_finds(loaded, tiny, asked, token):
    words = helpers.load_tables(tiny)["word_embeddings.weight"].numpy()
    row = helpers.VOCAB.index(token)
    cosine = words @ words[row] / np.maximum(np.linalg.norm(words, axis=1) * np.linalg.norm(words[row]), 1e-30)
    cosine[row] = -np.inf
    expected = np.argsort(-cosine, kind="stable")[:10]
    page = loaded[0]
    page.fill("#word_map_search", asked)
    found, near = page.evaluate("[2, 3].map(i => document.getElementById('word_map').data[i])")
    assert found["text"] == [token] and found["customdata"] == [row]
    assert near["customdata"] == expected.tolist()
    assert [t.split()[0] for t in near["text"]] == [helpers.VOCAB[i] for i in expected]
    assert [float(t.split()[1]) for t in near["text"]] == pytest.approx(cosine[expected], abs=1e-3)
    listed = page.inner_text("#word_map_found")
    assert listed.startswith(f"{token} (id {row})") and helpers.VOCAB[expected[0]] in listed
    page.fill("#word_map_search", "zebra")
    assert "not an entry of the vocabulary" in page.inner_text("#word_map_found")


def test_screenshot_is_not_blank(loaded, tmp_path):
    page = loaded[0]
    page.set_viewport_size({"width": 1200, "height": 2400})
    page.evaluate("window.scrollTo(0, 0)")
    shot = tmp_path / "shot.png"
    page.screenshot(path=shot)
    pixels = mpimg.imread(shot)[..., :3]
    assert pixels.shape[:2] == (2400, 1200)
    not_white = (pixels < 0.95).any(-1).mean()
    colourful = (pixels.max(-1) - pixels.min(-1) > 0.2).mean()  # the plots' bars
    assert not_white > 0.05 and colourful > 0.01, (not_white, colourful)
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50
