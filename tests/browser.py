"""Headless Chromium from the OS packages, driven by Selenium through the OS's
chromedriver (no browser download): for the web explorer's tests and for
``docs/explorer_pictures.py``. ``.ci/run`` installs both packages."""

from __future__ import annotations

import shutil

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.remote.webdriver import WebDriver

MISSING = (
    "the browser tests need Chromium and chromedriver from the OS packages "
    "(Debian: apt-get install -y chromium chromium-driver; .ci/run installs them)"
)


def chromium(width: int = 1400, height: int = 1000) -> WebDriver:
    """A new headless Chromium session; ``RuntimeError`` (saying what to install) when
    the browser or its driver is missing."""
    names = ("chromium", "chromium-browser", "google-chrome")
    binary = next((p for p in map(shutil.which, names) if p), None)
    driver_path = shutil.which("chromedriver")
    if binary is None or driver_path is None:
        raise RuntimeError(MISSING)
    options = Options()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument(f"--window-size={width},{height}")
    return webdriver.Chrome(service=Service(driver_path), options=options)
