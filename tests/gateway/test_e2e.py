"""`inferd serve` (gateway + one replica process) driven over HTTP: keys, limits, queues, deadlines, usage."""
import json
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import create_engine, text

from tests.server import ROOT, db_url, inferd, new_tenant_key, running_server, wait_stored

API_KEY = "sk-gateway-e2e-key"
ADMIN_KEY = "admin-e2e-secret"
PRICES = """
prices:
  SmolLM2-135M-Instruct: {input_usd_per_mtok: 1000.0, cached_input_usd_per_mtok: 100.0, output_usd_per_mtok: 2000.0}
"""
MAX_INFLIGHT, MAX_QUEUE_LEN = 4, 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gateway")
    (folder / "gateway.yaml").write_text(PRICES)
    log_path = folder / "serve.log"
    with running_server(log_path, "--api-key", API_KEY, "--admin-key", ADMIN_KEY, "--max-model-len", "1024",
                        "--kv-cache-gib", "0.25", "--gateway-config", str(folder / "gateway.yaml"),
                        "--max-inflight", str(MAX_INFLIGHT), "--max-queue-len", str(MAX_QUEUE_LEN)) as url:
        yield url, log_path


@pytest.fixture(scope="module")
def url(server) -> str:
    return server[0]


def chat(url: str, key: str, content: str = "Say hi", max_tokens: int = 4, headers: dict | None = None,
         timeout: float = 120, **body) -> httpx.Response:
    payload = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens} | body
    return httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=timeout,
                      headers={"authorization": f"Bearer {key}"} | (headers or {}))


def records(server, tenant_name: str) -> list[dict]:
    wait_stored(server[0])
    engine = create_engine(db_url(server[1]))
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT u.* FROM usage_records u JOIN tenants t ON t.id = u.tenant_id "
                                 "WHERE t.name = :n ORDER BY u.id"), {"n": tenant_name}).mappings().all()
    engine.dispose()
    return [dict(r) for r in rows]


def unique(name: str) -> str:
    return f"{name}-{time.monotonic_ns()}"


# keys

def test_keys_from_the_cli_and_revocation_within_a_second(server, url):
    name = unique("rev")
    key = new_tenant_key(server[1], name)
    assert chat(url, key).status_code == 200
    listed = inferd("keys", "list", "--tenant", name, "--db", db_url(server[1]), "--format", "json")
    key_id = json.loads(listed)[0]["id"]
    assert key not in inferd("keys", "list", "--db", db_url(server[1]))  # listed, never shown again
    inferd("keys", "revoke", key_id, "--db", db_url(server[1]))
    revoked_at = time.monotonic()
    while chat(url, key, max_tokens=1).status_code == 200:
        assert time.monotonic() - revoked_at < 1.0, "a revoked key still worked after 1 s"
    r = chat(url, key)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_model_access_list_and_bad_headers(server, url):
    name = unique("acl")
    inferd("tenants", "create", name, "--db", db_url(server[1]), "--models", "some-other-model")
    key = json.loads(inferd("keys", "create", "--tenant", name, "--db", db_url(server[1]), "--format", "json"))["key"]
    r = chat(url, key)
    assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"
    assert httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {key}"}).json()["data"] == []
    for header, value in (("x-inferd-deadline-ms", "soon"), ("x-inferd-priority", "urgent")):
        r = chat(url, API_KEY, headers={header: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == header


# limits

def test_requests_per_minute_answers_429_with_headers(server, url):
    key = new_tenant_key(server[1], unique("rpm"), "--rpm", "2")
    assert [chat(url, key, max_tokens=1).status_code for _ in range(2)] == [200, 200]
    r = chat(url, key, max_tokens=1)
    err = r.json()["error"]
    assert r.status_code == 429 and err["code"] == "requests_per_minute" and err["type"] == "rate_limit_error"
    assert 1 <= int(r.headers["retry-after"]) <= 30
    assert r.headers["x-ratelimit-limit-requests"] == "2" and r.headers["x-ratelimit-remaining-requests"] == "0"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "x"}])


def test_per_request_maxima(server, url):
    key = new_tenant_key(server[1], unique("max"), "--max-input-tokens", "60", "--max-output-tokens", "3")
    r = chat(url, key, content="word " * 100)
    assert r.status_code == 400 and r.json()["error"]["code"] == "max_input_tokens"
    r = chat(url, key, content="hi", max_tokens=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "max_output_tokens"
    r = httpx.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3  # no max_tokens: capped


def fire(url: str, key: str, n: int, **kw) -> list[httpx.Response]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: chat(url, key, **kw), range(n)))


def test_100_concurrent_requests_cannot_overspend_tokens_per_minute(server, url):
    name, tpm = unique("tpm"), 400
    key = new_tenant_key(server[1], name, "--tpm", str(tpm))
    started = time.monotonic()
    responses = fire(url, key, 100, max_tokens=4)
    elapsed_s = time.monotonic() - started
    ok = [r for r in responses if r.status_code == 200]
    refused = {r.json()["error"]["code"] for r in responses if r.status_code != 200}
    # the limit refuses; on a slow machine the bounded queue may refuse some first, which is no overspend
    assert ok and "tokens_per_minute" in refused and refused <= {"tokens_per_minute", "queue_full", "queued_tokens",
                                                                 "tenant_queue_share"}, (len(ok), refused)
    used = sum(r.json()["usage"]["total_tokens"] for r in ok)
    one_reservation = ok[0].json()["usage"]["prompt_tokens"] + 4
    refill = tpm * elapsed_s / 60
    assert used <= tpm + refill + one_reservation, (used, tpm, refill)


def test_100_concurrent_requests_cannot_overspend_the_budget(server, url):
    name, budget = unique("budget"), 0.25
    key = new_tenant_key(server[1], name, "--budget-usd", str(budget), "--budget-period", "day")
    responses = fire(url, key, 100, max_tokens=4)
    refused = [r.json()["error"]["code"] for r in responses if r.status_code != 200]
    # the budget refuses; the tenant's share of the bounded queue may refuse a burst's excess first, before its
    # prompts are planned (requests being planned hold their places), which is no overspend
    assert "budget" in refused and set(refused) <= {"budget", "queue_full", "queued_tokens", "tenant_queue_share"}
    rows = records(server, name)
    spent = sum(r["cost_usd"] for r in rows)
    worst_case = max(r["prompt_tokens"] for r in rows if r["status"] == "completed") * 1000e-6 + 4 * 2000e-6
    assert 0 < spent <= budget + worst_case
    assert sum(r["status"] == "rejected" for r in rows) == len(refused)


# queues, deadlines, fairness

def test_full_queue_503_tenant_share_429_and_deadlines(server, url):
    flood_key = new_tenant_key(server[1], unique("flood"), "--queue-share", "1.0")
    shared_key = new_tenant_key(server[1], unique("share"), "--queue-share", "0.25")
    results: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: results.append(chat(url, flood_key, max_tokens=24,
                                                                    ignore_eos=True))) for _ in range(30)]
    for t in threads:
        t.start()
    # the flood's refusals come back at once: then its queue is full, and no flood request has finished
    # (each makes 24 tokens); a fixed sleep here raced a fast engine that had freed a place within it
    t0 = time.monotonic()
    while sum(r.status_code == 503 for r in results) < 30 - MAX_INFLIGHT - MAX_QUEUE_LEN:
        assert time.monotonic() - t0 < 30, "the flood was not refused"
        time.sleep(0.01)
    expired = chat(url, API_KEY, headers={"x-inferd-deadline-ms": "300"})
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    assert codes.count(200) == MAX_INFLIGHT + MAX_QUEUE_LEN and codes.count(503) == 30 - MAX_INFLIGHT - MAX_QUEUE_LEN
    full = next(r for r in results if r.status_code == 503)
    assert full.json()["error"]["code"] == "queue_full" and int(full.headers["retry-after"]) >= 1
    assert expired.status_code in (503, 504)
    if expired.status_code == 504:
        assert expired.json()["error"]["code"] == "deadline_exceeded"
    shares = fire(url, shared_key, 12, max_tokens=24, ignore_eos=True)
    share_codes = [r.status_code for r in shares]
    assert 429 in share_codes and share_codes.count(200) <= MAX_INFLIGHT + MAX_QUEUE_LEN // 4
    assert {r.json()["error"]["code"] for r in shares if r.status_code == 429} == {"tenant_queue_share"}


def test_a_deadline_that_passes_in_the_queue_expires_the_request(server, url):
    name = unique("late")
    key = new_tenant_key(server[1], name, "--deadline-ms", "400")
    flood_key = new_tenant_key(server[1], unique("busy"), "--queue-share", "1.0")
    with ThreadPoolExecutor(MAX_INFLIGHT + 2) as pool:
        # every slot held by 128-token requests, so none frees within the deadline however fast the engine; a
        # long client timeout, since cores shared with other tests' servers slow the flood many times over
        busy = [pool.submit(chat, url, flood_key, max_tokens=128, ignore_eos=True, timeout=600)
                for _ in range(MAX_INFLIGHT + 2)]
        wait_for_gauge(url, "inferd_gateway_inflight_requests", MAX_INFLIGHT)
        r = chat(url, key)  # its tenant's default deadline
        assert all(f.result().status_code == 200 for f in busy)
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    assert [row["status"] for row in records(server, name)] == ["expired"]


def wait_for_gauge(url: str, name: str, value: float, timeout_s: float = 120) -> None:
    """Until the gateway's /metrics shows gauge `name` (any labels) at `value`."""
    pattern = re.compile(rf"^{name}(\{{[^}}]*\}})? (\S+)$", re.M)
    give_up = time.monotonic() + timeout_s
    while not any(float(v) == value for _, v in pattern.findall(httpx.get(f"{url}/metrics", timeout=30).text)):
        assert time.monotonic() < give_up, f"{name} never reached {value}"
        time.sleep(0.05)


def test_one_tenants_burst_does_not_take_anothers_turn(server, url):
    a, b = unique("burst-a"), unique("calm-b")
    key_a, key_b = new_tenant_key(server[1], a, "--queue-share", "1.0"), new_tenant_key(server[1], b)
    with ThreadPoolExecutor(20) as pool:
        burst = [pool.submit(chat, url, key_a, max_tokens=24, ignore_eos=True) for _ in range(14)]
        time.sleep(0.8)
        # b's three wait in the queue beside a's at once (sent one after another, the second arrived after a's queued
        # ones had taken the slots the first freed, and waited a whole wave of a's: a timing, not a turn)
        calm = [pool.submit(chat, url, key_b, max_tokens=24, ignore_eos=True) for _ in range(3)]
        assert all(f.result().status_code == 200 for f in burst + calm)
    queue_a = sorted(r["queue_s"] for r in records(server, a))
    queue_b = [r["queue_s"] for r in records(server, b)]
    assert max(queue_b) < queue_a[len(queue_a) // 2], (queue_b, queue_a)  # b waits less than a's median


# usage records and the CLI

def test_usage_records_statuses_cli_and_reconciliation(server, url):
    name = unique("bill")
    key = new_tenant_key(server[1], name)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
    done = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=6)
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=200, stream=True,
                                            messages=[{"role": "user", "content": "Tell a story"}],
                                            extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 4:
            break
    stream.close()
    bad = chat(url, key, model="no-such-model")
    assert bad.status_code == 404
    rows = records(server, name)
    by_status = {r["status"]: r for r in rows}
    assert sorted(by_status) == ["cancelled", "completed", "rejected"]
    assert by_status["completed"]["completion_tokens"] == done.usage.completion_tokens
    assert by_status["completed"]["cost_usd"] == pytest.approx(
        (done.usage.prompt_tokens * 1000 + done.usage.completion_tokens * 2000) / 1e6)
    cancelled = by_status["cancelled"]
    assert 3 <= cancelled["completion_tokens"] < 200 and cancelled["cost_usd"] > 0  # billed for what was produced
    assert by_status["rejected"]["cost_usd"] == 0 and by_status["rejected"]["http_status"] == 404
    assert all(r["request_id"] and r["key_id"] for r in rows)
    table = json.loads(inferd("usage", "--db", db_url(server[1]), "--tenant", name, "--format", "json"))
    assert sum(row["requests"] for row in table) == 3 and sum(row["cancelled"] for row in table) == 1
    assert inferd("usage", "--db", db_url(server[1]), "--format", "csv").startswith("tenant,model,spend,requests")
    check = subprocess.run([sys.executable, "-m", "inferd.cli", "usage", "--db", db_url(server[1]), "--reconcile",
                            url, "--admin-key", ADMIN_KEY, "--format", "json"], capture_output=True, text=True,
                           cwd=ROOT)
    assert check.returncode == 0, check.stdout + check.stderr
    assert all(row["match"] for row in json.loads(check.stdout))


def test_a_refusal_that_names_a_model_is_recorded_under_it(server, url):
    name = unique("refused")
    key = new_tenant_key(server[1], name)
    long = chat(url, key, content="word " * 1200, model="SmolLM2-135M-Instruct")
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    assert chat(url, key, model="no-such-model").status_code == 404
    assert [(r["model"], r["status"], r["http_status"]) for r in records(server, name)] == [
        ("SmolLM2-135M-Instruct", "rejected", 400), ("unknown", "rejected", 404)]  # never a name a client made up


def test_records_hold_the_tpot_of_unary_and_streamed_answers(server, url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    ids = [unique("tpot-unary"), unique("tpot-stream")]
    unary = client.chat.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
        extra_body={"ignore_eos": True}, extra_headers={"x-request-id": ids[0]})
    assert "x-inferd-decode-s" not in unary.headers  # between replica and gateway only
    for _ in client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=6, stream=True, extra_body={"ignore_eos": True},
                                            extra_headers={"x-request-id": ids[1]}):
        pass
    wait_stored(url)
    engine = create_engine(db_url(server[1]))
    with engine.connect() as conn:
        rows = [dict(r) for r in conn.execute(text("SELECT * FROM usage_records WHERE request_id IN (:a, :b) "
                                                   "ORDER BY id"), {"a": ids[0], "b": ids[1]}).mappings()]
    engine.dispose()
    assert [(r["request_id"], r["completion_tokens"]) for r in rows] == [(ids[0], 6), (ids[1], 6)]
    for r in rows:  # per output token after the first: more than nothing, less than the whole answer over 5
        assert 0 < r["tpot_s"] < r["e2e_s"] / 5, r


def test_admin_api(server, url):
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    name = unique("adm")
    r = httpx.post(f"{url}/admin/tenants", headers=admin, json={"name": name, "limits": {"rpm": 100}})
    assert r.status_code == 201 and r.json()["limits"] == {"rpm": 100}
    r = httpx.post(f"{url}/admin/keys", headers=admin, json={"tenant": name, "name": "svc"})
    key, key_id = r.json()["key"], r.json()["id"]
    assert chat(url, key, max_tokens=1).status_code == 200
    listed = httpx.get(f"{url}/admin/keys", headers=admin, params={"tenant": name}).json()["data"]
    assert key not in json.dumps(listed) and "key_hash" not in listed[0]
    assert httpx.patch(f"{url}/admin/tenants/{name}", headers=admin, json={"limits": {"tpm": 5}}).json()["limits"] \
        == {"rpm": 100, "tpm": 5}
    assert httpx.delete(f"{url}/admin/keys/{key_id}", headers=admin).status_code == 200
    r = httpx.get(f"{url}/admin/tenants", headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_key"
    r = httpx.post(f"{url}/admin/tenants", headers=admin, json={"name": name + "x", "limits": {"rpd": 1}})
    assert r.status_code == 400 and "unknown limit 'rpd'" in r.json()["error"]["message"]


# observability

def test_metrics_and_json_logs_hold_no_secrets(server, url):
    chat(url, API_KEY, content="the secret plan is purple elephants")
    m = httpx.get(f"{url}/metrics").text
    for name in ("inferd_gateway_rejections_total", "inferd_gateway_queue_length", "inferd_gateway_tokens_total",
                 "inferd_gateway_cost_usd_total", 'replica="replica-0"', "inferd_kv_cache_blocks_capacity"):
        assert name in m
    log = Path(server[1]).read_text()
    assert API_KEY not in log and ADMIN_KEY not in log and "purple elephants" not in log
    access = [json.loads(line) for line in log.splitlines() if line.startswith("{") and '"request"' in line]
    assert access and {"request_id", "tenant_id", "status", "prompt_tokens", "queue_s"} <= set(access[-1])
