"""Sign-in through a real OpenID Connect provider: oidc-provider (the certified Node implementation, from npm:
tests/oidc/) run on loopback, in front of a real `inferd serve` with the iris model in its process.

The API: an app's client-credentials access token (a JWT for the API's audience, with its tenant claim) calls a
model and leaves a usage record under its tenant, with the tenant's limits; an expired token, a token for another
audience, one whose tenant does not exist and a forged one are refused 401; after the provider's signing key is
rotated (the provider restarted with a new key), its new tokens are accepted. Batches need a stored key.
The console: people sign in through the provider's own login form in Chromium; a group mapped to admin sees
everything, a member of team-a sees only its tenant's keys and usage, a person with no mapped group gets no
session."""
import base64
import json
import time

import httpx
import pytest

from tests.browser import chromium, wait_for
from tests.gateway.services import missing
from tests.oidc.idp import API, CONSOLE_SECRET, OTHER_API, IdentityProvider, Unavailable, app_token, signing_key
from tests.server import db_url, free_port, inferd, running_server, wait_stored

ROW = {"model": "iris", "inputs": [{"sepal_length_cm": 6.7, "sepal_width_cm": 3.0, "petal_length_cm": 5.2,
                                    "petal_width_cm": 2.3}]}
SPEC = """
deployments:
  - name: iris
    kind: classical
    model: {source: default}
    placement: {backend: in_process}
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("oidc")
    try:
        provider = IdentityProvider(folder, free_port(), free_port())
    except Unavailable as exc:
        missing(str(exc))
    (folder / "console-secret").write_text(CONSOLE_SECRET)
    (folder / "spec.yaml").write_text(SPEC)
    (folder / "gateway.yaml").write_text(f"""
oidc:
  issuer: {provider.issuer}
  audience: {API}
  client_id: inferd-console
  client_secret_file: {folder / 'console-secret'}
  roles: {{inferd-admins: admin, team-a-people: member}}
  leeway_s: 0
""")
    log = folder / "serve.log"
    inferd("tenants", "create", "team-a", "--db", db_url(log))
    inferd("tenants", "create", "team-b", "--db", db_url(log))
    for tenant in ("team-a", "team-b"):
        inferd("keys", "create", "--tenant", tenant, "--name", f"{tenant}-key", "--db", db_url(log))
    key_b = json.loads(inferd("keys", "create", "--tenant", "team-b", "--db", db_url(log), "--format", "json"))
    provider.start(signing_key("first"))
    try:
        with running_server(log, "--config", str(folder / "spec.yaml"), "--gateway-config",
                            str(folder / "gateway.yaml"), port=provider.gateway_port) as url:
            yield {"url": url, "folder": folder, "provider": provider, "issuer": provider.issuer,
                   "key_b": key_b["key"]}
    finally:
        provider.stop()


def predict(url: str, token: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/predict", json=ROW, headers={"authorization": f"Bearer {token}"}, timeout=30)


def test_an_apps_token_calls_a_model_as_its_tenant_and_leaves_its_usage_record(setup):
    url, token = setup["url"], app_token(setup["issuer"], "app-a")
    for _ in range(3):
        answer = predict(url, token)
        assert answer.status_code == 200, answer.text
        assert answer.json()["predictions"] == ["virginica"]
    wait_stored(url)
    from sqlalchemy import create_engine, text
    with create_engine(db_url(setup["folder"] / "serve.log")).connect() as conn:
        rows = conn.execute(text("SELECT t.name, u.key_id, u.status FROM usage_records u JOIN tenants t "
                                 "ON t.id = u.tenant_id WHERE u.key_id LIKE 'tok_%'")).all()
    assert len(rows) == 3 and {(r[0], r[2]) for r in rows} == {("team-a", "completed")}
    assert len({r[1] for r in rows}) == 1  # one identity for the app, not one per token


def test_tokens_the_api_must_refuse(setup):
    url, issuer = setup["url"], setup["issuer"]
    short = app_token(issuer, "app-short")  # lives 1 s (and this gateway allows no clock skew)
    assert predict(url, short).status_code == 200
    other = predict(url, app_token(issuer, "app-a", OTHER_API))
    assert other.status_code == 401 and "aud" in other.json()["error"]["message"]
    ghost = predict(url, app_token(issuer, "app-ghost"))
    assert ghost.status_code == 401 and "no-such-tenant" in ghost.json()["error"]["message"]
    header, claims, signature = app_token(issuer, "app-a").split(".")
    forged = json.loads(base64.urlsafe_b64decode(claims + "==")) | {"inferd_tenant": "team-b"}
    forged = base64.urlsafe_b64encode(json.dumps(forged).encode()).decode().rstrip("=")
    refused = predict(url, f"{header}.{forged}.{signature}")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_token"
    time.sleep(max(0.0, json.loads(base64.urlsafe_b64decode(short.split(".")[1] + "=="))["exp"] + 1.05 - time.time()))
    expired = predict(url, short)
    assert expired.status_code == 401 and "expired" in expired.json()["error"]["message"]
    batch = httpx.post(f"{url}/v1/batches", json={"input_file_id": "file-x", "endpoint": "/v1/predict",
                                                  "completion_window": "24h"},
                       headers={"authorization": f"Bearer {app_token(issuer, 'app-a')}"}, timeout=30)
    assert batch.status_code == 403 and batch.json()["error"]["code"] == "api_key_required"
    assert predict(url, setup["key_b"]).status_code == 200  # keys work beside tokens


def test_a_rotated_signing_key_is_taken_once_the_provider_publishes_it(setup):
    url, provider = setup["url"], setup["provider"]
    old = app_token(provider.issuer, "app-a")
    assert predict(url, old).status_code == 200
    provider.stop()
    provider.start(signing_key("second"), signing_key("first-again"))  # a new key signs; the old one is gone
    new = app_token(provider.issuer, "app-a")
    assert json.loads(base64.urlsafe_b64decode(new.split(".")[0] + "=="))["kid"] == "second"
    assert predict(url, new).status_code == 200  # an unknown key id read the provider's keys again
    gone = predict(url, old)  # signed by a key the provider no longer publishes
    assert gone.status_code == 401 and "key" in gone.json()["error"]["message"]


@pytest.fixture
def browser():  # one a test: each person signs in to the provider afresh
    driver = chromium()
    yield driver
    driver.quit()


def sign_in_through_the_provider(browser, url: str, login: str) -> None:
    from selenium.webdriver.common.by import By
    browser.get(f"{url}/console")
    wait_for(browser, "#sso-sign-in").click()
    wait_for(browser, "input[name=login]").send_keys(login)
    browser.find_element(By.CSS_SELECTOR, "input[name=password]").send_keys("any password")
    browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    deadline = time.monotonic() + 30
    while not browser.current_url.startswith(url) and time.monotonic() < deadline:  # the provider's consent
        buttons = browser.find_elements(By.CSS_SELECTOR, "button[type=submit]")
        if buttons and "interaction" in browser.current_url:
            try:
                buttons[0].click()
            except Exception:  # the page moved on meanwhile
                pass
        time.sleep(0.2)


def console_get(browser, path: str) -> tuple[int, dict]:
    """A read of the console's API from the signed-in page (its session cookie)."""
    return tuple(browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch(arguments[0], {credentials: 'same-origin'}).then(r => r.json().then(j => done([r.status, j])));",
        path))


def test_a_person_in_the_admin_group_signs_in_to_the_console_as_admin(setup, browser):
    sign_in_through_the_provider(browser, setup["url"], "alice")
    assert wait_for(browser, "#who", "alice").text == "alice · admin"
    status, data = console_get(browser, "/console/api/tenants")
    assert status == 200 and {t["name"] for t in data["tenants"]} >= {"team-a", "team-b"} and "audit" in data
    assert console_get(browser, "/console/api/now")[0] == 200


def test_a_tenant_member_sees_only_its_tenant(setup, browser):
    sign_in_through_the_provider(browser, setup["url"], "bob")
    assert wait_for(browser, "#who", "bob").text == "bob · member of team-a"
    wait_for(browser, "#tenant-table", "team-a")
    status, data = console_get(browser, "/console/api/tenants")
    assert status == 200 and [t["name"] for t in data["tenants"]] == ["team-a"] and "audit" not in data
    assert {k["tenant"] for k in data["keys"]} == {"team-a"}
    status, error = console_get(browser, "/console/api/now")
    assert status == 403 and error["error"]["code"] == "console_tenant_only"
    status, usage = console_get(browser, "/console/api/usage?tenant=team-b")
    assert status == 200 and {r["tenant"] for r in usage["data"]} <= {"team-a"}


def test_a_person_with_no_mapped_group_gets_no_session(setup, browser):
    sign_in_through_the_provider(browser, setup["url"], "carol")
    assert "none of your groups" in wait_for(browser, "#signin-error", "groups").text
    assert console_get(browser, "/console/api/tenants")[0] == 401
