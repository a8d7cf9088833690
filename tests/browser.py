"""Debian's headless Chromium through chromedriver (Selenium), for the tests that drive a real browser."""
import shutil

import pytest


def chromium():
    """A new headless Chromium (the caller quits it); fails in CI, skips elsewhere, without chromedriver."""
    from tests.gateway.services import missing
    chromedriver = shutil.which("chromedriver")
    if chromedriver is None:
        missing("chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium") or ""
    return webdriver.Chrome(service=Service(chromedriver), options=options)


def wait_for(browser, css: str, text: str = "", timeout_s: float = 30.0):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait
    from selenium.common.exceptions import TimeoutException, WebDriverException
    found = (ec.text_to_be_present_in_element((By.CSS_SELECTOR, css), text) if text
             else ec.visibility_of_element_located((By.CSS_SELECTOR, css)))

    def condition(driver):  # a look while the page navigates (sign-out reloads it) is "not yet", not an error
        try:
            return found(driver)
        except WebDriverException as e:
            if "navigat" not in str(e):
                raise
            return False
    try:
        WebDriverWait(browser, timeout_s).until(condition)
    except TimeoutException:
        pytest.fail(f"no {css!r} with {text!r} in {timeout_s} s; the page says:\n"
                    f"{browser.find_element(By.TAG_NAME, 'body').text[:2000]}")
    return browser.find_element(By.CSS_SELECTOR, css)
