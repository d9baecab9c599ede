"""The headless Chromium fixture (and a live server for it) the browser tests share."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.integration.live_server import live_server


CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1280,900")


@pytest.fixture
def live(tiny_llm):
    with live_server(tiny_llm) as s:
        yield s


@pytest.fixture
def browser(tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        chromium = None
    if not chromium or not driver_path:
        if os.environ.get("CI"):
            pytest.fail("chromium / chromedriver / selenium missing in CI: scripts/setup.sh should install them")
        pytest.skip("chromium and chromedriver are not installed (scripts/setup.sh installs them)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=opts)
    driver.set_script_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def fill(driver, field: str, value: str) -> None:
    el = driver.find_element("id", field)
    el.clear()
    el.send_keys(value)
