"""The HTML report in a real browser: headless Chromium opens the file from disk with the network off, every image
decodes (naturalWidth > 0), and a screenshot of the page is not blank."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest

import conftest_explain as helpers
from bertembed.explain.report import build_report, run_analyses, write_report

tiny = helpers.tiny  # shared fixture

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or (
    "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>"]  # any network request would fail

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                                "(apt-get install chromium; .ci/run installs it)")


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "profile"
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def report_file(tiny, tmp_path_factory) -> Path:
    results = run_analyses("the cat sat on the mat", "a dog", tiny, finetune=True, steps=2)
    return write_report(build_report(results), tmp_path_factory.mktemp("report") / "report.html")


def images_loaded(path: Path, tmp_path: Path) -> tuple[int, int]:
    """(decoded, total) images, as counted by the report's own load script in the rendered DOM."""
    done = chromium(tmp_path, "--run-all-compositor-stages-before-draw", "--virtual-time-budget=5000",
                    "--dump-dom", path.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    marker = re.search(r'data-loaded="(\d+)" data-total="(\d+)"', done.stdout)
    assert marker, "the page's load script did not run: " + done.stdout[-500:]
    return int(marker.group(1)), int(marker.group(2))


def test_every_image_loads(report_file, tmp_path):
    loaded, total = images_loaded(report_file, tmp_path)
    assert total == report_file.read_text().count("<img") == 13
    assert loaded == total, f"{total - loaded} broken image(s)"


def test_a_broken_image_is_counted(report_file, tmp_path):
    broken = tmp_path / "broken.html"
    broken.write_text(report_file.read_text().replace("base64,iVBOR", "base64,AAAAiVBOR", 1))
    assert images_loaded(broken, tmp_path) == (12, 13)


def test_screenshot_is_not_blank(report_file, tmp_path):
    shot = tmp_path / "shot.png"
    done = chromium(tmp_path, "--window-size=1200,2400", "--hide-scrollbars", f"--screenshot={shot}",
                    report_file.as_uri())
    assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
    pixels = mpimg.imread(shot)[..., :3]
    assert pixels.shape[:2] == (2400, 1200)
    not_white = (pixels < 0.95).any(-1).mean()
    colourful = (pixels.max(-1) - pixels.min(-1) > 0.2).mean()  # the plots' bars and heatmaps
    assert not_white > 0.05 and colourful > 0.01, (not_white, colourful)
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50
