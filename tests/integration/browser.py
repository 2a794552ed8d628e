"""A real headless Chromium for page tests: Debian's `chromium` driven by playwright (no browser download:
`playwright install` is never run; `make test` installs the package when missing: its target test-tools)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium_path() -> str:
    path = os.environ.get("MIRROR_SD_TEST_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(path):
        pytest.fail("chromium is not installed: `make test-tools` installs it (Debian's package; `make test` runs it)")
    return path


@contextmanager
def chromium_page(viewport: dict | None = None) -> Iterator[tuple[object, list[str]]]:
    """One page in a fresh profile; the browser and its profile are gone on the way out."""
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="mirror-sd-chromium-")
    try:
        with sync_playwright() as playwright:
            context = playwright.chromium.launch_persistent_context(
                profile, executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS,
                viewport=viewport or {"width": 1400, "height": 900})
            try:
                page = context.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda error: errors.append(str(error)))
                yield page, errors  # errors: what the page's scripts threw (a test asserts none)
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
