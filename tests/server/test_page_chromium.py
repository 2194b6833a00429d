"""The page at ``/``, driven in headless Chromium, shows the block buffer while a prompt is being answered.

Uses the system Chromium (Debian package ``chromium``) through Playwright; never downloads a browser. Set
``DIFFULEX_UPDATE_SCREENSHOTS=1`` to refresh the screenshot in docs/images/.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from diffulex import BUILTIN_MODEL

from .conftest import RunningServer, start_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync"]
PROMPT = "Write a short story about the old lighthouse keeper."
QUESTION = "There are 6 bags with 8 marbles in each bag. How many marbles are there in all?"
DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "images" / "serving-page.png"


@pytest.fixture(scope="module")
def page_server(peaky_sdar_dir: Path):
    """Bigger blocks, three in the buffer, and a checkpoint that accepts several tokens per step: a richer view."""
    running = start_server(peaky_sdar_dir, block_size=8, page_size=8, buffer_size=3, accept_threshold=0.7)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS, headless=True)
        yield b
        b.close()


def test_page_streams_the_denoising_buffer(page_server: RunningServer, browser, tmp_path: Path) -> None:
    server = page_server
    page = browser.new_page(viewport={"width": 1200, "height": 640})
    page.set_default_timeout(20_000)
    page.goto(server.base_url + "/")
    page.wait_for_function("document.getElementById('meta').textContent.includes('block size')")
    page.fill("#max_tokens", "96")
    page.fill("#delay", "120")  # slow the page's rendering so intermediate steps can be observed
    page.fill("#prompt", PROMPT)
    page.click("#send")

    # While generating: blocks of cells with masked, newly accepted and committed tokens.
    page.wait_for_selector(".msg.assistant .block .cell.new")
    page.wait_for_selector(".msg.assistant .block .cell.mask")
    page.wait_for_selector(".msg.assistant .block .cell.committed")
    page.wait_for_function("Number(document.querySelector('.msg.assistant').dataset.steps || 0) >= 5")
    mid = tmp_path / "page-mid.png"
    page.screenshot(path=str(mid))
    block_size = server.loop.block_size
    cells_per_block = page.eval_on_selector_all(".msg.assistant .block", "bs => bs.map(b => b.querySelectorAll"
                                                "('.cell').length)")
    assert cells_per_block and all(1 <= n <= block_size for n in cells_per_block)

    page.wait_for_selector(".msg.assistant[data-done='1']")
    shown = page.inner_text(".msg.assistant .final")
    stats = page.inner_text(".msg.assistant .stats")
    assert "NFE" in stats and "TPF" in stats
    assert page.inner_text("#status") == "done"

    expected = httpx.post(server.base_url + "/generate",
                          json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 96, "temperature": 0},
                          timeout=30).json()
    assert shown.strip() == expected["text"].strip()
    page.close()


@pytest.fixture(scope="module")
def builtin_server():
    running = start_server(Path(BUILTIN_MODEL), block_size=8, buffer_size=1)
    yield running
    running.stop()


def test_the_built_in_model_answers_on_the_page_while_its_blocks_denoise(
    builtin_server: RunningServer, browser, tmp_path: Path
) -> None:
    """What docs/images/serving-page.png shows: the built-in model answering a question, caught between steps (it
    decodes most blocks of this answer in one forward, so the page shows each block arriving whole)."""
    page = browser.new_page(viewport={"width": 1200, "height": 640})
    page.set_default_timeout(20_000)
    page.goto(builtin_server.base_url + "/")
    page.wait_for_function("document.getElementById('meta').textContent.includes('block size')")
    page.fill("#max_tokens", "64")
    page.fill("#temperature", "0")
    page.fill("#delay", "400")  # slow the page's rendering so a step between masks and answer can be caught
    page.fill("#prompt", QUESTION)
    page.click("#send")
    page.wait_for_function("Number(document.querySelector('.msg.assistant').dataset.steps || 0) >= 3")
    page.wait_for_selector(".msg.assistant .block .cell.new")
    mid = tmp_path / "builtin-mid.png"
    page.screenshot(path=str(mid))
    page.wait_for_selector(".msg.assistant[data-done='1']")
    assert "#### 48" in page.inner_text(".msg.assistant .final")
    if os.environ.get("DIFFULEX_UPDATE_SCREENSHOTS") == "1":
        DOCS_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(mid, DOCS_SCREENSHOT)
    page.close()


def test_page_reports_errors_and_keeps_working(server: RunningServer, browser) -> None:
    page = browser.new_page()
    page.set_default_timeout(20_000)
    page.goto(server.base_url + "/")
    page.fill("#temperature", "-1")  # out of range: the server answers 400
    page.fill("#prompt", "hello")
    page.click("#send")
    page.wait_for_selector(".msg.assistant .stats .error")
    assert "400" in page.inner_text(".msg.assistant .stats")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "8")
    page.fill("#prompt", "hello again")
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-done='1']")
    page.close()
