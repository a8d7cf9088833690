"""Canary rollouts through a real `inferd serve --config`: one server, two names, each with a canary.

`bad`'s canary is a tiny random-weight model that fails the probe set: it is rolled back automatically while
the stable version answers every request. `good`'s canary is SmolLM2 again (v2): it is promoted, then serves
all traffic and v1's replica is stopped.
"""
import json
import time

import httpx
import pytest
from sqlalchemy import create_engine, text

from tests.models.test_hf import save_tiny_model
from tests.server import db_url, inferd, running_server

KEY = "sk-rollout-test-key"
ADMIN = "rollout-admin-key"
AUTH = {"authorization": f"Bearer {KEY}"}
RUNTIME = "{dtype: float32, max_num_seqs: 4, max_model_len: 512, kv_cache_gib: 0.05, num_threads: 1}"
PROBES = [{"messages": [{"role": "user", "content": "What is the capital of France? Answer with one word."}],
           "expect": "(?i)paris", "max_tokens": 8}]
# latency ratios are generous: 4 replicas share 2 cores here, and the point of `good` is that it passes
ROLLOUT = ("{weight: 0.5, window_s: 300, min_requests: 3, max_ttft_p95_ratio: 5, max_tpot_p95_ratio: 5, "
           "max_cost_ratio: 1.5, probes: PROBES}")
CONFIG = f"""
deployments:
  - name: good
    model: {{source: default}}
    runtime: {RUNTIME}
    price: {{input_usd_per_mtok: 1.0, cached_input_usd_per_mtok: 1.0, output_usd_per_mtok: 2.0}}
  - name: good
    version: v2
    role: canary
    model: {{source: default}}
    runtime: {RUNTIME}
    rollout: {ROLLOUT}
  - name: bad
    model: {{source: default}}
    runtime: {RUNTIME}
  - name: bad
    version: v2
    role: canary
    model: {{source: TINY}}
    runtime: {RUNTIME}
    rollout: {ROLLOUT}
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rollout")
    save_tiny_model(tmp / "tiny", max_position_embeddings=512)
    (tmp / "probes.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROBES))
    config = tmp / "deploy.yaml"
    config.write_text(CONFIG.replace("PROBES", str(tmp / "probes.jsonl")).replace("TINY", str(tmp / "tiny")))
    log_path = tmp / "serve.log"
    with running_server(log_path, "--config", str(config), "--api-key", KEY, "--admin-key", ADMIN) as url:
        yield url, log_path


def chat(url: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6,
            "temperature": 0}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)


def admin(url: str, method: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.request(method, f"{url}/admin/rollouts{path}", json=body, timeout=30,
                         headers={"authorization": f"Bearer {ADMIN}"})


def versions(log_path, request_ids: list[str]) -> list[str]:
    """Which version served each request, from the usage records (the writer flushes in batches)."""
    engine = create_engine(db_url(log_path))
    deadline = time.monotonic() + 10
    try:
        while True:
            with engine.connect() as conn:
                rows = dict(conn.execute(text("SELECT request_id, deployment_version FROM usage_records")).all())
            if all(r in rows for r in request_ids) or time.monotonic() > deadline:
                return [rows.get(r) for r in request_ids]
            time.sleep(0.2)
    finally:
        engine.dispose()


def wait_for(url: str, name: str, done, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        status = admin(url, "GET", f"/{name}").json()
        if done(status) or time.monotonic() > deadline:
            return status
        time.sleep(0.25)


def test_rollout_errors_use_the_api_error_shape(served):
    url, _ = served
    assert admin(url, "POST", "/nope/start").json()["error"]["code"] == "not_found"
    bad_weight = admin(url, "POST", "/good/start", {"weight": 2})
    assert bad_weight.status_code == 400 and bad_weight.json()["error"]["param"] == "weight"
    assert admin(url, "POST", "/good/pause").status_code == 404
    anonymous = httpx.get(f"{url}/admin/rollouts", timeout=10)
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_admin_key"


def test_a_bad_canary_is_rolled_back_and_a_good_one_promoted(served):
    url, log_path = served
    before = [chat(url, "good") for _ in range(2)]  # no rollout started: stable only
    assert versions(log_path, [r.headers["x-request-id"] for r in before]) == ["v1", "v1"]
    assert [s["state"] for s in admin(url, "GET", "").json()["data"]] == ["pending", "pending"]

    for name in ("bad", "good"):
        assert "running, canary v2 at 50% of traffic" in inferd("rollout", "start", name, "--url", url,
                                                                 "--admin-key", ADMIN)
    during = {"bad": [], "good": []}
    for _ in range(8):  # weight 0.5: every second request goes to the canary, until it is decided
        for name in during:
            during[name].append(chat(url, name))
    assert all(r.status_code == 200 for rs in during.values() for r in rs)  # stable answered throughout
    sent = time.monotonic()

    bad = wait_for(url, "bad", lambda s: s["state"] == "rolled_back" and s["versions"]["v2"]["replicas_alive"] == 0)
    good = wait_for(url, "good", lambda s: s["state"] == "promoted" and s["versions"]["v1"]["replicas_alive"] == 0)
    print(f"decided {time.monotonic() - sent:.1f} s after the last request")
    assert bad["state"] == "rolled_back" and bad["decision"]["by"] == "auto", bad
    assert any(r.startswith("probe score 0% (min 100%, stable 100%)") for r in bad["decision"]["reasons"]), bad
    assert bad["versions"]["v2"]["replicas_alive"] == 0 and bad["versions"]["v1"]["replicas_alive"] == 1
    assert good["state"] == "promoted" and good["decision"]["by"] == "auto", good
    assert good["versions"]["v2"]["probe_score"] == 1.0 and good["versions"]["v1"]["replicas_alive"] == 0, good

    after = {name: [chat(url, name) for _ in range(3)] for name in ("bad", "good")}
    assert all(r.status_code == 200 for rs in after.values() for r in rs)
    assert versions(log_path, [r.headers["x-request-id"] for r in after["bad"]]) == ["v1"] * 3
    assert versions(log_path, [r.headers["x-request-id"] for r in after["good"]]) == ["v2"] * 3

    table = inferd("rollout", "status", "good", "--url", url, "--admin-key", ADMIN)
    assert "good: promoted" in table and "decision: promote (auto)" in table
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert 'inferd_gateway_rollout_state{canary_version="v2",model="bad",state="rolled_back"} 1.0' in metrics
    assert 'inferd_gateway_canary_weight{canary_version="v2",model="good"} 1.0' in metrics
    assert 'inferd_gateway_version_requests_total{model="good",status="completed",version="v2"}' in metrics
    rollback_again = admin(url, "POST", "/bad/rollback")
    assert rollback_again.status_code == 400 and rollback_again.json()["error"]["code"] == "invalid_rollout_state"
