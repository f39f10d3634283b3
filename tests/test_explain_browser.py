"""The HTML report in a real browser: headless Chromium opens the file from disk with the network off, every image
decodes (naturalWidth > 0), and a screenshot of the page is not blank. The test looks at the page from outside,
through Chromium's DevTools protocol: the page users get carries no test code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from itertools import count
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest

import conftest_explain as helpers
from bertembed.atomic import write_atomic
from bertembed.explain.report import report_html, run_analyses

tiny = helpers.tiny  # shared fixture

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or (
    "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>"]  # any network request would fail
# the images that decoded, and all of them, once the page has loaded (the load event waits for every image)
COUNT_IMAGES = "[[...document.images].filter(i => i.complete && i.naturalWidth > 0).length, document.images.length]"

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                                "(apt-get install chromium; .ci/run installs it)")


def evaluate(page: Path, expression: str, tmp_path: Path):
    """The value of a JavaScript `expression` in `page` once it has loaded, asked through the DevTools protocol on a
    pipe (Chromium reads commands on fd 3 and answers on fd 4, each message JSON ended by a NUL byte)."""
    commands, answers = os.pipe(), os.pipe()

    def as_fds_3_and_4():
        os.dup2(commands[0], 3)
        os.dup2(answers[1], 4)

    browser = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                                "--remote-debugging-pipe", "about:blank"], pass_fds=(3, 4),
                               preexec_fn=as_fds_3_and_4, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(commands[0])
    os.close(answers[1])
    received, sent, pending, ids = os.fdopen(answers[0], "rb"), os.fdopen(commands[1], "wb"), bytearray(), count(1)

    def message() -> dict:
        while b"\0" not in pending:
            chunk = received.read1(1 << 16)
            assert chunk, "chromium closed the DevTools pipe"
            pending.extend(chunk)
        end = pending.index(b"\0")
        text = bytes(pending[:end])
        del pending[:end + 1]
        return json.loads(text)

    def call(method: str, session: str | None = None, until: str | None = None, **params) -> dict:
        """Send a command; return its result, or with `until` the parameters of that event, which follows."""
        sent.write(json.dumps({"id": (number := next(ids)), "method": method, "params": params,
                               **({"sessionId": session} if session else {})}).encode() + b"\0")
        sent.flush()
        while True:
            reply = message()
            if until is None and reply.get("id") == number:
                assert "error" not in reply, reply
                return reply["result"]
            if until is not None and reply.get("method") == until:
                return reply["params"]

    try:
        target = call("Target.createTarget", url="about:blank")["targetId"]
        session = call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        call("Page.enable", session)
        call("Page.navigate", session, until="Page.loadEventFired", url=page.as_uri())
        return call("Runtime.evaluate", session, expression=expression, returnByValue=True)["result"]["value"]
    finally:
        browser.kill()
        browser.wait(timeout=30)
        received.close()
        sent.close()


@pytest.fixture(scope="module")
def report_file(tiny, tmp_path_factory) -> Path:
    results = run_analyses("the cat sat on the mat", "a dog", tiny, finetune=True, steps=2)
    return write_atomic(tmp_path_factory.mktemp("report") / "report.html", report_html(results).encode())


def test_every_image_loads(report_file, tmp_path):
    loaded, total = evaluate(report_file, COUNT_IMAGES, tmp_path)
    assert total == report_file.read_text().count("<img") == 13
    assert loaded == total, f"{total - loaded} broken image(s)"


def test_a_broken_image_is_counted(report_file, tmp_path):
    broken = tmp_path / "broken.html"
    broken.write_text(report_file.read_text().replace("base64,iVBOR", "base64,AAAAiVBOR", 1))
    assert evaluate(broken, COUNT_IMAGES, tmp_path) == [12, 13]


def test_screenshot_is_not_blank(report_file, tmp_path):
    shot = tmp_path / "shot.png"
    done = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,2400",
                           "--hide-scrollbars", f"--screenshot={shot}", report_file.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
    pixels = mpimg.imread(shot)[..., :3]
    assert pixels.shape[:2] == (2400, 1200)
    not_white = (pixels < 0.95).any(-1).mean()
    colourful = (pixels.max(-1) - pixels.min(-1) > 0.2).mean()  # the plots' bars and heatmaps
    assert not_white > 0.05 and colourful > 0.01, (not_white, colourful)
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50
