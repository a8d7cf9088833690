"""The console in a real browser (Debian's chromium through chromedriver, driven by Selenium) against a real
`inferd serve --config` (one server for the module): a wrong key, a wrong password and a missing CSRF token
refused, sign in with a key and as a console user made by the CLI (signed out once removed), the deployment
ready on the live Now page, a key created and revoked (401 within a second), unary answers' TPOT, usage from
the rollups, sign out; a deployment scaled from zero going from starting to ready, the request rate moving
while `inferd bench` runs, a canary started and promoted with the buttons of the Rollouts page (and audited),
the autoscaler's recent decisions with their reasons.

INFERD_CONSOLE_SCREENSHOTS=DIR saves a screenshot of each page there (docs/console/ holds the committed ones)."""
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.browser import chromium, wait_for
from tests.server import ROOT, db_url, running_server

ADMIN_KEY = "console-admin-key-for-tests"
VIEWER_KEY = "console-viewer-key-for-tests"
API_KEY = "sk-console-test-key"
USER, PASSWORD = "oncall", "a-console-user-password"
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = pytest.mark.skipif(CHROMEDRIVER is None and os.environ.get("INFERD_REQUIRE_SERVICES") != "1",
                                reason="chromium-driver not installed")


RUNTIME = "{dtype: float32, max_num_seqs: 4, max_model_len: 512, kv_cache_gib: 0.05, num_threads: 1}"
PRICE = "{input_usd_per_mtok: 1.0, cached_input_usd_per_mtok: 0.5, output_usd_per_mtok: 2.0}"
# chat: a stable and a canary of the packaged model, decided by the operator; lazy: no replica until asked
CONFIG = f"""
deployments:
  - name: chat
    model: {{source: default}}
    runtime: {RUNTIME}
    price: {PRICE}
  - name: chat
    version: v2
    role: canary
    model: {{source: default}}
    runtime: {RUNTIME}
    price: {PRICE}
    rollout: {{weight: 0.5, window_s: 600, min_requests: 2, auto: false}}
  - name: lazy
    model: {{source: default}}
    runtime: {RUNTIME}
    replicas: 0
    autoscaling: {{min_replicas: 0, max_replicas: 1, scale_to_zero: true, upscale_delay_s: 0, interval_s: 0.5}}
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("console")


@pytest.fixture(scope="module")
def url(folder):
    (folder / "deploy.yaml").write_text(CONFIG)
    console_user("add", USER, "--role", "viewer", "--password-stdin", log=folder / "serve.log", stdin=PASSWORD)
    with running_server(folder / "serve.log", "--config", str(folder / "deploy.yaml"), "--api-key", API_KEY,
                        "--admin-key", ADMIN_KEY, "--console-viewer-key", VIEWER_KEY) as base:
        yield base


@pytest.fixture(scope="module")
def browser():
    driver = chromium()
    yield driver
    driver.quit()


def text(browser, css: str) -> str:
    """An element's text read in one step (the Now page replaces its cards every second: a found element can go
    stale before its .text is read)."""
    return browser.execute_script("const e = document.querySelector(arguments[0]); return e ? e.innerText : null;",
                                  css)


def screenshot(browser, name: str) -> None:
    folder = os.environ.get("INFERD_CONSOLE_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(Path(folder) / f"{name}.png"))


def console_user(*args: str, log: Path, stdin: str = "") -> None:
    """`inferd console user ARGS` on the server's store (the password on stdin, as an operator would pipe it)."""
    subprocess.run([sys.executable, "-m", "inferd.cli", "console", "user", *args, "--db", db_url(log)],
                   input=stdin + "\n", text=True, cwd=ROOT, check=True, timeout=120, capture_output=True)


def sign_in(browser, url: str, key: str, user: str = "") -> None:
    browser.get(f"{url}/console")
    if user:
        wait_for(browser, "#user").send_keys(user)
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


def test_a_console_user_signs_in_by_password_and_a_wrong_password_is_refused(browser, url, folder):
    browser.delete_all_cookies()
    sign_in(browser, url, "not-the-password", user=USER)
    assert "Wrong user name or password" in wait_for(browser, "#signin-error", "Wrong").text
    assert browser.get_cookie("inferd_console") is None
    screenshot(browser, "signin")
    sign_in(browser, url, PASSWORD, user=USER)
    wait_for(browser, '#now .card[data-deployment="chat"]', "ready")
    assert wait_for(browser, "header .who").text == f"{USER} · viewer"
    cookie = {"inferd_console": browser.get_cookie("inferd_console")["value"]}
    assert httpx.get(f"{url}/console/api/now", cookies=cookie).status_code == 200
    console_user("remove", USER, log=folder / "serve.log")
    removed_at = time.monotonic()
    while httpx.get(f"{url}/console/api/now", cookies=cookie).status_code == 200:
        assert time.monotonic() - removed_at < 10, "a removed user's session still reads the console"
        time.sleep(0.5)


def test_the_console_end_to_end(browser, url):
    sign_in(browser, url, ADMIN_KEY)
    cookie = browser.get_cookie("inferd_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    wait_for(browser, '#now .card[data-deployment="chat"]', "1 ready")  # pushed over SSE: no reload
    assert post_without_csrf(browser, "/console/api/keys") == 403

    browser.get(f"{url}/console#tenants")
    wait_for(browser, "#create-key").click()
    key = wait_for(browser, "#new-key-value").text
    assert key.startswith("sk-")
    for _ in range(3):
        r = httpx.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=60,
                       json={"model": "chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                             "ignore_eos": True})
        assert r.status_code == 200, r.text
    browser.get(f"{url}/console#now")
    # the 3 requests counted in the last 5 minutes, pushed live
    card = '#now .card[data-deployment="chat"][data-version="v1"]'
    wait_for(browser, card, "5m 3 ")
    tpot = text(browser, f"{card} table:nth-of-type(2) tbody tr td:nth-child(6)")
    assert tpot.endswith(" ms") and float(tpot.split()[0]) > 0, tpot  # unary answers have a TPOT (decode-s)
    too_long = httpx.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=60,
                          json={"model": "chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10**6})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"], too_long.text

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
    while "chat" not in wait_for(browser, "#usage").text and time.monotonic() < deadline:
        time.sleep(1)  # the usage writer stores records in batches, about a second apart
        browser.refresh()
    assert "chat" in wait_for(browser, "#usage-table").text
    screenshot(browser, "usage")
    assert "cancelled" in text(browser, "#usage-table thead")
    reasons = text(browser, "#reasons-table")  # what did not complete in 24 h, by model and reason
    assert f"chat\tv1\t{too_long.json()['error']['code']}\t1" in reasons, reasons
    browser.get(f"{url}/console#history")
    wait_for(browser, "#history figure.chart .uplot")  # uPlot's charts: a time axis, units, the SLO on latency
    charts = browser.execute_script("return [...document.querySelectorAll('#history figure.chart')].map(f => "
                                    "[f.dataset.figure, f.querySelector('.u-legend').innerText])")
    assert "SLO" in dict(charts)["ttft_p95_s"] and "SLO" not in dict(charts)["e2e_p95_s"]
    assert len(charts) == 8 * len(browser.find_elements("css selector", "#history .card"))
    from selenium.webdriver.common.action_chains import ActionChains
    ttft = '#history figure[data-figure="ttft_p95_s"]'
    over = browser.find_element("css selector", f"{ttft} .u-over")
    ActionChains(browser).move_to_element_with_offset(over, 5 - over.size["width"] // 2, 0).perform()  # far left
    legend = text(browser, f"{ttft} .u-legend")  # the nearest point with a value: its time, the p95, the SLO
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d", legend) and re.search(r"TTFT p95\s*[\d.]+ ms", legend), legend
    assert "2000 ms" in legend, legend
    screenshot(browser, "history")

    browser.find_element("css selector", "#sign-out").click()
    wait_for(browser, "#signin")
    httpx_cookie = {"inferd_console": cookie["value"]}
    assert httpx.get(f"{url}/console/api/now", cookies=httpx_cookie).status_code == 401


def test_a_viewer_reads_but_changes_nothing(browser, url):
    browser.delete_all_cookies()
    sign_in(browser, url, VIEWER_KEY)
    wait_for(browser, "#now .card", "ready")
    browser.get(f"{url}/console#rollouts")
    assert "Canary rollouts" in wait_for(browser, "#rollouts h2").text
    assert not browser.find_elements("css selector", "#rollouts button")  # no buttons for a viewer
    browser.get(f"{url}/console#tenants")
    assert "Read-only" in wait_for(browser, "#tenants", "Read-only").text
    csrf = browser.find_element("css selector", 'meta[name="csrf-token"]').get_attribute("content")
    status = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch('/console/api/keys', {method: 'POST', headers: {'content-type': 'application/json', "
        "'x-csrf-token': arguments[0]}, body: JSON.stringify({tenant: 'default'})}).then(r => done(r.status));", csrf)
    assert status == 403


def chat(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {API_KEY}"}, timeout=300,
                      json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})


def sign_in_as_admin(browser, url: str) -> None:
    browser.delete_all_cookies()
    sign_in(browser, url, ADMIN_KEY)
    wait_for(browser, "#now .card", "ready")


def test_a_deployment_scaled_from_zero_goes_from_starting_to_ready(browser, url):
    sign_in_as_admin(browser, url)
    card = '#now .card[data-deployment="lazy"]'
    wait_for(browser, card, "none")  # no replica until a request waits for one (the card is replaced each second)
    answers = []
    asking = threading.Thread(target=lambda: answers.append(chat(url, "lazy")))
    asking.start()
    wait_for(browser, card, "1 starting", timeout_s=60)  # the autoscaler started one: pushed live
    wait_for(browser, card, "1 ready", timeout_s=240)
    asking.join(timeout=60)
    assert answers and answers[0].status_code == 200, answers and answers[0].text


def test_the_request_rate_moves_while_a_bench_runs(browser, url, tmp_path):
    sign_in_as_admin(browser, url)
    cell = '#now .card[data-deployment="chat"][data-version="v1"] tbody td:nth-child(3)'
    wait_for(browser, cell)
    before = float(text(browser, cell))
    bench = subprocess.Popen(  # closed loop, one request at a time, until killed
        [sys.executable, "-m", "inferd.cli", "bench", "run", "--base-url", f"{url}/v1", "--api-key", API_KEY,
         "--model", "chat", "--arrival", "closed", "--concurrency", "1", "--duration-s", "600", "--num-requests",
         "1000", "--input-tokens", "32", "--output-tokens", "4", "--warmup-requests", "0",
         "--max-client-lag-ms", "100000", "--no-progress", "--no-html", "--out", str(tmp_path / "bench")],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=(tmp_path / "bench.err").open("w"))
    try:
        deadline = time.monotonic() + 120  # bench takes a while to start on a busy machine
        while float(text(browser, cell)) <= before + 0.05:
            assert bench.poll() is None, f"inferd bench exited: {(tmp_path / 'bench.err').read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"requests/s stayed at {before} while inferd bench ran"
            time.sleep(0.5)
    finally:
        bench.terminate()
        bench.wait(timeout=30)
    card = '#now .card[data-deployment="chat"][data-version="v1"]'
    kv = text(browser, f"{card} tbody td:nth-child(6)")
    hits = text(browser, f"{card} table:nth-of-type(2) tbody tr td:nth-child(3)")
    assert kv.endswith("%") and hits.endswith("%"), (kv, hits)  # the replica's /ready and the records' tokens
    screenshot(browser, "now")


def test_a_canary_started_and_promoted_from_the_rollouts_page(browser, url):
    sign_in_as_admin(browser, url)
    browser.get(f"{url}/console#rollouts")
    assert "pending" in wait_for(browser, "#rollout-state-chat", "pending").text
    wait_for(browser, '#rollouts button.rollout-start[data-rollout="chat"]').click()
    wait_for(browser, "#rollout-state-chat", "running")
    for _ in range(6):  # weight 0.5: about half of them reach the canary
        assert chat(url, "chat").status_code == 200
    browser.refresh()
    evidence = wait_for(browser, '#rollouts .card[data-rollout="chat"] table').text
    assert "canary" in evidence and "TPOT p95" in evidence, evidence
    # the autoscaler's recent decisions with their reasons (lazy was scaled from zero by an earlier test)
    wait_for(browser, "#decisions-lazy", "a request waits and no replica runs")
    screenshot(browser, "rollouts")
    wait_for(browser, '#rollouts button.rollout-promote[data-rollout="chat"]').click()
    browser.switch_to.alert.accept()  # "Promote the canary of chat?"
    wait_for(browser, "#rollout-state-chat", "promoted")
    assert "operator" in wait_for(browser, '#rollouts .card[data-rollout="chat"] .decision').text
    assert not browser.find_elements("css selector", '#rollouts button[data-rollout="chat"]')  # decided: no buttons
    status = httpx.get(f"{url}/admin/rollouts/chat", headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert status["state"] == "promoted" and status["weight"] == 1.0, status
    browser.get(f"{url}/console#tenants")
    audit = wait_for(browser, "#tenants", "rollout.promote").text
    assert "rollout.start" in audit and "console:admin" in audit, audit
