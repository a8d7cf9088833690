"""Fallbacks between deployments and the degradation ladder, through a real `inferd serve --config`."""
import threading
import time

import httpx
import pytest
from sqlalchemy import create_engine, text

from tests.server import db_url, free_port, running_server

KEY = "sk-fallback-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
RUNTIME = "{dtype: float32, max_num_seqs: 4, max_model_len: 512, kv_cache_gib: 0.05, num_threads: 1}"
CONFIG = f"""
deployments:
  - name: smol
    model: {{source: default}}
    runtime: {RUNTIME}
    queue: {{max_inflight: 1}}
    degradation:
      overload_queue_age_ms: 300
      sustain_s: 0
      steps:
        - {{action: cap_max_tokens, max_tokens: 2}}
        - {{action: route, priority_class: batch, to: small}}
        - {{action: reject_late}}
  - name: small
    model: {{source: default}}
    runtime: {RUNTIME}
  - name: broken
    external: {{base_url: "http://127.0.0.1:PORT/v1", model: smol}}
    fallbacks: [smol]
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fallback")
    config = tmp / "deploy.yaml"
    config.write_text(CONFIG.replace("PORT", str(free_port())))  # nothing listens there: every request is refused
    log_path = tmp / "serve.log"
    with running_server(log_path, "--config", str(config), "--api-key", KEY) as url:
        yield url, log_path


def chat(url: str, model: str, max_tokens: int = 16, headers: dict | None = None) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Count to fifty"}], "max_tokens": max_tokens,
            "ignore_eos": True}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH | (headers or {}), timeout=120)


def records(log_path, request_id: str) -> list[tuple]:
    engine = create_engine(db_url(log_path))
    deadline = time.monotonic() + 10
    try:
        while True:  # the usage writer flushes in batches
            with engine.connect() as conn:
                rows = conn.execute(text("SELECT attempt, model, status, error_code, completion_tokens FROM "
                                         "usage_records WHERE request_id = :r ORDER BY attempt"), {"r": request_id})
                rows = [tuple(r) for r in rows]
            if rows and rows[-1][2] == "completed" or time.monotonic() > deadline:
                return rows
            time.sleep(0.2)
    finally:
        engine.dispose()


def test_a_failing_deployment_falls_back_and_says_so(served):
    url, log_path = served
    r = chat(url, "broken", max_tokens=3)
    assert r.status_code == 200, r.text
    assert r.headers["x-inferd-fallback"] == "broken->smol"
    assert r.json()["usage"]["completion_tokens"] == 3
    assert records(log_path, r.headers["x-request-id"]) == [
        (1, "broken", "failed", "upstream_unavailable", 0), (2, "smol", "completed", None, 3)]
    assert 'inferd_gateway_fallbacks_total{fallback="smol",model="broken",reason="upstream_unavailable"} 1.0' \
        in httpx.get(f"{url}/metrics").text


def test_sustained_overload_climbs_the_degradation_ladder(served):
    url, log_path = served
    flood = [threading.Thread(target=chat, args=(url, "smol", 40)) for _ in range(3)]
    for t in flood:  # one runs (max_inflight 1), two wait
        t.start()
    time.sleep(1.0)  # the oldest waiting request is now older than 300 ms: overloaded
    capped: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: capped.append(chat(url, "smol", 16)))
    waiting.start()  # step 1: max_tokens capped to 2 (it queues behind the flood)
    time.sleep(0.5)
    routed = chat(url, "smol", 16, {"x-inferd-priority": "batch"})  # step 2: batch goes to `small`, capped
    late = chat(url, "smol", 16, {"x-inferd-deadline-ms": "500"})  # step 3: cannot start within 0.5 s
    assert routed.status_code == 200, routed.text
    assert routed.headers["x-inferd-degraded"] == "cap_max_tokens,route:small"
    assert routed.json()["model"] == "small" and routed.json()["usage"]["completion_tokens"] == 2
    assert late.status_code == 503 and late.json()["error"]["code"] == "deadline_unmeetable", late.text
    assert "reject_late" in late.headers["x-inferd-degraded"] and int(late.headers["retry-after"]) >= 1
    for t in [*flood, waiting]:
        t.join(timeout=120)
    assert capped[0].status_code == 200 and capped[0].headers["x-inferd-degraded"] == "cap_max_tokens"
    assert capped[0].json()["usage"]["completion_tokens"] == 2
    assert records(log_path, late.headers["x-request-id"])[0][2:4] == ("rejected", "deadline_unmeetable")
    metrics = httpx.get(f"{url}/metrics").text
    for action, n in (("cap_max_tokens", 3), ("route:small", 1), ("reject_late", 1)):
        assert f'inferd_gateway_degraded_total{{action="{action}",model="smol"}} {n}.0' in metrics, action
