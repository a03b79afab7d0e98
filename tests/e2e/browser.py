"""Headless Debian Chromium driven by Playwright, for the tests that use pages as a
person does (the admin, the customer portal). The browser is Debian's ``chromium``
package (``make test`` installs it); Playwright's own browser download is never used."""

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.conftest import drain, in_thread

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",  # the suite runs as root, where Chromium's sandbox cannot start
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TEST_OUTPUT = Path(__file__).resolve().parents[2] / "test-output"
TIMEOUT_MS = 10_000


@contextmanager
def chromium() -> Iterator[Browser]:
    """Headless Debian Chromium, for a test that opens several pages (or one page at
    several sizes) in one browser. Playwright's sync API runs an event loop in this
    thread while it is open, so Django refuses ORM calls here until it closes: set up the
    data first and touch the database from another thread meanwhile."""
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: this test drives Debian's chromium package "
            "(apt-get install -y chromium); `make test` installs it."
        )
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def chromium_page(screenshots: Path) -> Iterator[Page]:
    """A page in headless Debian Chromium (``chromium``), its screenshots' folder made."""
    screenshots.mkdir(parents=True, exist_ok=True)
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1700, "height": 1000})
        page.set_default_timeout(TIMEOUT_MS)
        yield page


def screenshots(folder: str):
    """``shot(page, name)``: a full-page PNG under test-output/<folder>/."""
    directory = TEST_OUTPUT / folder
    directory.mkdir(parents=True, exist_ok=True)

    def shot(page: Page, name: str) -> Path:
        path = directory / f"{name}.png"
        page.screenshot(path=path, full_page=True)
        return path

    return shot


def log_in(page: Page, base_url: str, username: str, password: str) -> None:
    """Through the admin's login form; waits for the page it leads to."""
    admin = base_url + "/admin/"
    page.goto(admin + "login/?next=/admin/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("input[type=submit]")
    page.wait_for_url(re.compile("^" + re.escape(admin) + r"(\?.*)?$"))


def in_a_thread(fn=drain) -> None:
    """``fn()`` (the pipeline's ``drain`` by default) while the browser is open: the ORM
    and ``asyncio.run`` both refuse to run beside the Playwright sync API's event loop in
    this thread."""
    errors: list[BaseException] = []  # re-raised in the test's thread
    thread = in_thread(fn, errors)
    thread.join(30)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} did not finish within 30 s"
    if errors:
        raise errors[0]
