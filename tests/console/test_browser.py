"""The console in a real browser (Debian's chromium through chromedriver, driven by Selenium) against a real
`inferd serve`: a wrong key and a missing CSRF token refused, sign in, the deployment ready on the live Now
page, a key created and revoked (401 within a second), usage from the rollups, sign out.

INFERD_CONSOLE_SCREENSHOTS=DIR saves a screenshot of each page there (docs/console/ holds the committed ones)."""
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tests.server import running_server

ADMIN_KEY = "console-admin-key-for-tests"
VIEWER_KEY = "console-viewer-key-for-tests"
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = pytest.mark.skipif(CHROMEDRIVER is None and os.environ.get("INFERD_REQUIRE_SERVICES") != "1",
                                reason="chromium-driver not installed")


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("console") / "serve.log"
    with running_server(log_path, "--admin-key", ADMIN_KEY, "--console-viewer-key", VIEWER_KEY,
                        "--max-model-len", "512") as base:
        yield base


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium") or ""
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def wait_for(browser, css: str, text: str = "", timeout_s: float = 30.0):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait
    condition = (ec.text_to_be_present_in_element((By.CSS_SELECTOR, css), text) if text
                 else ec.visibility_of_element_located((By.CSS_SELECTOR, css)))
    from selenium.common.exceptions import TimeoutException
    try:
        WebDriverWait(browser, timeout_s).until(condition)
    except TimeoutException:
        pytest.fail(f"no {css!r} with {text!r} in {timeout_s} s; the page says:\n"
                    f"{browser.find_element(By.TAG_NAME, 'body').text[:2000]}")
    return browser.find_element(By.CSS_SELECTOR, css)


def screenshot(browser, name: str) -> None:
    folder = os.environ.get("INFERD_CONSOLE_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(Path(folder) / f"{name}.png"))


def sign_in(browser, url: str, key: str) -> None:
    browser.get(f"{url}/console")
    wait_for(browser, "#key").send_keys(key)
    browser.find_element("css selector", "#signin-button").click()


def post_without_csrf(browser, path: str) -> int:
    """A same-origin fetch from the signed-in page, with its cookie but without the CSRF token."""
    return browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch(arguments[0], {method: 'POST', headers: {'content-type': 'application/json'}, body: '{}'})"
        ".then(r => done(r.status));", path)


def test_a_wrong_key_is_refused_and_sets_no_session(browser, url):
    sign_in(browser, url, "not-the-key")
    assert "not the admin or viewer key" in wait_for(browser, "#signin-error", "not the").text
    assert browser.get_cookie("inferd_console") is None
    assert httpx.get(f"{url}/console/api/now").status_code == 401


def test_the_console_end_to_end(browser, url):
    sign_in(browser, url, ADMIN_KEY)
    cookie = browser.get_cookie("inferd_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    wait_for(browser, "#now .card", "1 ready")  # pushed over SSE: no reload
    assert post_without_csrf(browser, "/console/api/keys") == 403

    browser.get(f"{url}/console#tenants")
    wait_for(browser, "#create-key").click()
    key = wait_for(browser, "#new-key-value").text
    assert key.startswith("sk-")
    for _ in range(3):
        r = httpx.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=60,
                       json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
    browser.get(f"{url}/console#now")
    wait_for(browser, "#now .card", "5m 3 ")  # the 3 requests counted in the last 5 minutes, pushed live
    screenshot(browser, "now")

    browser.get(f"{url}/console#tenants")
    button = wait_for(browser, "#key-table button.revoke")
    key_id = button.get_attribute("data-key")
    screenshot(browser, "tenants")
    button.click()
    revoked_at = time.monotonic()
    wait_for(browser, "#revoked", key_id)
    status = 200
    while status != 401 and time.monotonic() - revoked_at < 1.0:
        status = httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {key}"}).status_code
    assert status == 401, "the revoked key still worked a second after revoking it"
    assert "key.revoke" in wait_for(browser, "#tenants", "key.revoke").text

    browser.get(f"{url}/console#usage")
    deadline = time.monotonic() + 15
    while "SmolLM2" not in wait_for(browser, "#usage").text and time.monotonic() < deadline:
        time.sleep(1)  # the usage writer stores records in batches, about a second apart
        browser.refresh()
    assert "SmolLM2" in wait_for(browser, "#usage-table").text
    screenshot(browser, "usage")
    for tab in ("history", "rollouts"):
        browser.get(f"{url}/console#{tab}")
        wait_for(browser, f"#{tab} h2")
        screenshot(browser, tab)

    browser.find_element("css selector", "#sign-out").click()
    wait_for(browser, "#signin")
    httpx_cookie = {"inferd_console": cookie["value"]}
    assert httpx.get(f"{url}/console/api/now", cookies=httpx_cookie).status_code == 401


def test_a_viewer_reads_but_changes_nothing(browser, url):
    browser.delete_all_cookies()
    sign_in(browser, url, VIEWER_KEY)
    wait_for(browser, "#now .card", "ready")
    browser.get(f"{url}/console#tenants")
    assert "Read-only" in wait_for(browser, "#tenants", "Read-only").text
    csrf = browser.find_element("css selector", 'meta[name="csrf-token"]').get_attribute("content")
    status = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch('/console/api/keys', {method: 'POST', headers: {'content-type': 'application/json', "
        "'x-csrf-token': arguments[0]}, body: JSON.stringify({tenant: 'default'})}).then(r => done(r.status));", csrf)
    assert status == 403
