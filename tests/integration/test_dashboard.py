"""The live dashboard in a real browser: headless Chromium (Debian's ``chromium``, driven by
Playwright) watches ``isthmus demo`` lose a peer and gain one, without reloading the page; a
browser without the token sees none of the run.

Skipped, with the reason, where chromium or Playwright is missing: ``make test-browser``
installs chromium (apt) and runs this file. ``ISTHMUS_DASHBOARD_SCREENSHOT=PATH`` keeps a
screenshot of the page taken after the join (docs/dashboard.png is one).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip(
        "Debian's chromium is not installed: `make test-browser` installs it (apt) and runs this",
        allow_module_level=True,
    )
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')"
)

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]

# Records every value the members card shows, from inside the page: the list lives only as long
# as the page does, so finding the whole history at the end also proves there was no reload.
WATCH = """() => {
  const el = document.getElementById("member-count");
  window.__seen = [el.textContent];
  new MutationObserver(() => {
    const v = el.textContent;
    if (window.__seen[window.__seen.length - 1] !== v) window.__seen.push(v);
  }).observe(el, {childList: true, characterData: true, subtree: true});
}"""
SEEN_3_2_3 = """() => {
  const s = window.__seen || [];
  const a = s.indexOf("3"), b = s.indexOf("2", a + 1), c = s.indexOf("3", b + 1);
  return a >= 0 && b > a && c > b;
}"""


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A 3-peer demo whose peer 1 is SIGKILLed inside a collective at step 20 (the round aborts)
    and a fourth peer joins at step 40; yields the dashboard URL it printed (with the token in
    the fragment) and the process. The demo is stopped with Ctrl-C when the test is done."""
    err = tmp_path / "demo.err"
    argv = [
        sys.executable, "-m", "isthmus.cli", "demo", "--peers", "3", "--model", "tiny",
        "--strategy", "ddp", "--steps", "400", "--fault", "1:kill@collective:step=20",
        "--join", "40", "--step-delay", "0.08", "--corpus-bytes", "200000", "--batch-size", "4",
        "--no-progress", "--run-dir", str(tmp_path / "run"),
    ]  # fmt: skip
    with err.open("wb") as f:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=f)
    try:
        deadline = time.monotonic() + 60
        url = None
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            m = re.search(r"dashboard: (http://\S+)", err.read_text(errors="replace"))
            url = m.group(1) if m else None
            time.sleep(0.1)
        assert url, f"the demo printed no dashboard URL:\n{err.read_text(errors='replace')}"
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # the launcher stops its peers on Ctrl-C
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_the_dashboard_follows_a_kill_and_a_join_live_and_shows_nothing_without_the_token(
    demo: tuple[str, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    url, proc = demo
    base = url.split("#", 1)[0]
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
            page.goto(url)
            page.wait_for_selector("body[data-state=live]", timeout=60_000)
            assert "token" not in page.evaluate("location.href")  # taken out of the address bar
            page.evaluate(WATCH)
            page.wait_for_function(SEEN_3_2_3, timeout=120_000, polling=100)
            seen = page.evaluate("window.__seen")
            page.wait_for_selector("#peers tbody tr:nth-child(4)")  # peer1 (dead) and peer3
            shot = os.environ.get("ISTHMUS_DASHBOARD_SCREENSHOT") or str(tmp_path / "dash.png")
            time.sleep(1.0)  # a second of the new epoch on the charts
            page.screenshot(path=shot, full_page=True)
            names = page.inner_text("#peers")
            assert all(n in names for n in ("peer0", "peer1", "peer2", "peer3")), names
            # the round it died in, with a reason (whoever noticed first: the coordinator or a
            # survivor whose all-reduce broke)
            assert page.inner_text("#aborts tbody").strip() not in ("", "none")

            # another browser, no token: the login form and nothing of the run
            stranger = browser.new_context().new_page()
            stranger.goto(base)
            stranger.wait_for_selector("body[data-state=login]", timeout=30_000)
            assert stranger.is_hidden("#dash")
            assert "peer0" not in stranger.content()
            assert stranger.inner_text("#member-count") == "-"
            code = stranger.evaluate(
                "fetch('v1/dashboard/snapshot', {credentials: 'same-origin'}).then(r => r.status)"
            )
            assert code == 401
            stranger.fill("#token", "not-the-token")
            stranger.click("#login-form button")
            # a function, not an expression: the page's CSP forbids evaluating strings
            stranger.wait_for_function(
                "() => document.getElementById('login-error').textContent.includes('invalid')"
            )
            assert stranger.is_hidden("#dash") and "peer0" not in stranger.content()
        finally:
            browser.close()
    assert seen[0] in ("-", "0", "3"), seen  # watched from before the kill
    assert proc.poll() is None, "the demo ended before the browser had seen it all"
