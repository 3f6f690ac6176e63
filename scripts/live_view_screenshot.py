"""Serve the bundled model under a real load and take a screenshot of the live view (docs/live-view.png).

    python scripts/live_view_screenshot.py [--model PATH] [--warmup 40] [--out docs/live-view.png]

Starts `conveyor serve` on a free port, runs scripts/live_view_load.py's clients against it, opens
/dashboard in headless Chromium (Debian's `chromium`, driven by playwright; nothing is downloaded),
waits --warmup seconds for the timeline and the latency figures to fill, and saves the page.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_view_load import run_load  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.serving.client import wait_healthy  # noqa: E402
from bench.serving.servers import free_port  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model to serve (default: the bundled one)")
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--warmup", type=float, default=40.0, help="seconds of load before the screenshot")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "live-view.png")
    args = parser.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("chromium is not on PATH (Debian: apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "conveyor", "serve", "--port", str(port),
                               "--disable-log-stats", *(["--model", args.model] if args.model else [])])
    try:
        wait_healthy(base_url, 300, is_alive=lambda: server.poll() is None)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium)
            page = browser.new_page(viewport={"width": 1480, "height": 1000}, device_scale_factor=1)
            page.goto(f"{base_url}/dashboard")
            threads = run_load(base_url, args.clients, args.warmup + 30)
            time.sleep(args.warmup)
            page.wait_for_function("document.querySelectorAll('tr.row').length >= 4", timeout=60_000)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.out), full_page=True)
            print(f"wrote {args.out}")
            browser.close()
        del threads   # daemon threads: they end with the server
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
