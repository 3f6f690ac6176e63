"""The live view page in a real browser: headless Chromium (Debian's) driven by Playwright, against a
real server on a loopback port. No browser is downloaded: without Chromium or playwright these skip."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import API_KEY, RunningServer, free_port, slow_steps, start_server, wait_for

try:
    from playwright.sync_api import Browser, Page, sync_playwright
except ImportError:
    sync_playwright = None

CHROMIUM = shutil.which("chromium")
pytestmark = [pytest.mark.browser, pytest.mark.skipif(
    CHROMIUM is None or sync_playwright is None,
    reason="needs Chromium and playwright (apt-get install chromium; pip install playwright): not installed")]

TIMEOUT_MS = 20_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[RunningServer]:
    running = start_server(tiny_checkpoint, max_num_seqs=4)
    yield running
    running.stop()


class Tab:
    """A page on the live view that records what would show in its console as an error."""

    def __init__(self, browser: Browser, base_url: str) -> None:
        self.page: Page = browser.new_page(viewport={"width": 1400, "height": 900})
        self.page.set_default_timeout(TIMEOUT_MS)
        self.errors: list[str] = []
        self.page.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.goto(f"{base_url}/")   # redirected to /dashboard

    def status(self) -> str:
        return self.page.locator("#status").inner_text()

    def block_counts(self) -> str | None:
        return self.page.locator("#blocks").get_attribute("data-counts")

    def close(self) -> None:
        self.page.close()


def send(base_url: str, **body: Any) -> threading.Thread:
    def post() -> None:
        httpx.post(f"{base_url}/v1/completions", json={"prompt": "the batch in a browser", "max_tokens": 40,
                                                       "ignore_eos": True, **body}, timeout=60)

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread


def test_a_request_appears_as_a_row_in_every_tab_and_leaves_when_it_finishes(browser: Browser,
                                                                             server: RunningServer) -> None:
    tabs = [Tab(browser, server.base_url), Tab(browser, server.base_url)]
    try:
        for tab in tabs:
            tab.page.wait_for_function("document.querySelector('#status').textContent === 'idle'")
            assert tab.page.locator("#config").inner_text().count("max num seqs") == 1
        idle_blocks = tabs[0].block_counts()
        row = "tr.row:has-text('browser-tenant')"
        with slow_steps(server.engine, 0.03):
            request = send(server.base_url, user="browser-tenant")
            for tab in tabs:
                tab.page.wait_for_selector(row)
            tabs[0].page.wait_for_selector(f"{row}[data-state='decoding']")
            assert tabs[0].status() == "live"
            busy_blocks = tabs[0].block_counts()
            request.join(60)
        for tab in tabs:
            tab.page.wait_for_selector(row, state="detached")
        assert busy_blocks != idle_blocks          # the block map showed the request's blocks
        assert tabs[0].block_counts() != busy_blocks
        assert tabs[0].page.locator("#c-ttft").inner_text() != "–"
        for tab in tabs:
            assert tab.errors == []
    finally:
        for tab in tabs:
            tab.close()


def test_the_page_asks_for_the_api_key(browser: Browser, tiny_checkpoint: Path) -> None:
    running = start_server(tiny_checkpoint, api_key=API_KEY, max_num_seqs=2)
    tab = Tab(browser, running.base_url)
    try:
        tab.page.wait_for_selector("#key-form", state="visible")
        assert tab.status() == "API key needed"
        tab.page.fill("#key-input", "wrong")
        tab.page.click("#key-form button")
        tab.page.wait_for_function("document.querySelector('#key-error').textContent.includes('refused')")
        tab.page.fill("#key-input", API_KEY)
        tab.page.click("#key-form button")
        tab.page.wait_for_function("document.querySelector('#status').textContent === 'idle'")
        assert tab.page.locator("#key-form").is_hidden()
        # A refused key is a 401 the browser logs as a failed resource; nothing else may be an error.
        assert all("401" in error for error in tab.errors), tab.errors
    finally:
        tab.close()
        running.stop()


def test_the_page_says_engine_down_and_reconnects_after_a_restart(browser: Browser, tiny_checkpoint: Path) -> None:
    port = free_port()
    first = start_server(tiny_checkpoint, max_num_seqs=2, server_options={"port": port})
    tab = Tab(browser, first.base_url)
    try:
        tab.page.wait_for_function("document.querySelector('#status').textContent === 'idle'")
        first.stop()
        tab.page.wait_for_function("document.querySelector('#status').textContent === 'engine down'")
        second = start_server(tiny_checkpoint, max_num_seqs=2, server_options={"port": port})
        try:
            tab.page.wait_for_function("document.querySelector('#status').textContent === 'idle'")
            with slow_steps(second.engine, 0.03):
                request = send(second.base_url, user="after-restart")
                tab.page.wait_for_selector("tr.row:has-text('after-restart')")
                request.join(60)
            tab.page.wait_for_selector("tr.row:has-text('after-restart')", state="detached")
        finally:
            second.stop()
        # While the server was gone the browser logged failed connections; no script error.
        assert not [e for e in tab.errors if "ERR_CONNECTION_REFUSED" not in e and "Failed to fetch" not in e]
    finally:
        tab.close()
