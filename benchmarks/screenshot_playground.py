"""The documentation's screenshots of the web playground (docs/playground.md): a real server on
the embedded model, a real streamed answer, then the metrics page after it.

    python benchmarks/screenshot_playground.py   # writes docs/images/playground.png, playground_metrics.png

Needs Debian's chromium and chromium-driver and selenium (the test extras), like
tests/e2e/test_playground.py, whose browser helper it uses.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' server and browser helpers

from tests.e2e.browser import chromium, missing, set_value  # noqa: E402
from tests.e2e.conftest import ServerProcess  # noqa: E402

QUESTION = "Write a haiku about the sea."
SYSTEM = "You are a helpful assistant."
LOAD_S = 20.0  # traffic drawn on the metrics page


def load(url: str, stop: threading.Event) -> None:
    """Requests one after another (four at a time) until `stop`: something for the charts to draw."""

    def client(i: int) -> None:
        while not stop.is_set():
            body = {"messages": [{"role": "user", "content": f"Tell me a story about the number {i}."}],
                    "max_tokens": 96, "temperature": 0.8}  # fmt: skip
            httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
            i += 4

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    args = parser.parse_args()
    if (why := missing()) is not None:
        sys.exit(why)
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    log_dir = Path(tempfile.mkdtemp(prefix="llmserve-screenshot-"))
    server = ServerProcess(["smollm2-135m-instruct"], log_dir=log_dir, served_name=None).start()
    try:
        # one request first: the answer on the page should not carry start-up's one-time costs
        body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).raise_for_status()
        with chromium(width=1280, height=900) as driver:
            driver.get(f"{server.url}/")
            WebDriverWait(driver, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"))
            set_value(driver, "system", SYSTEM)
            set_value(driver, "temperature", "0")
            set_value(driver, "max_tokens", "64")
            driver.find_element(By.ID, "prompt").send_keys(QUESTION, Keys.ENTER)
            WebDriverWait(driver, 120).until(
                lambda d: "finish" in d.find_element(By.CSS_SELECTOR, ".message.assistant .stats").text
            )
            args.out.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(args.out / "playground.png"))
            stop = threading.Event()
            traffic = threading.Thread(target=load, args=(server.url, stop))
            traffic.start()
            driver.set_window_size(1280, 600)  # the charts without the empty page below them
            driver.get(f"{server.url}/playground/metrics")
            time.sleep(LOAD_S)
            driver.save_screenshot(str(args.out / "playground_metrics.png"))
            stop.set()
            traffic.join()
    finally:
        server.stop()
        shutil.rmtree(log_dir, ignore_errors=True)  # a failed start raised with the log's text
    print(f"wrote {args.out / 'playground.png'} and {args.out / 'playground_metrics.png'}")


if __name__ == "__main__":
    main()
