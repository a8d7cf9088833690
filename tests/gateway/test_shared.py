"""Two gateway processes sharing one PostgreSQL store and one Redis, in front of one replica; and traces."""
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import create_engine, text
from starlette.testclient import TestClient

from tests.gateway.services import postgres_url, redis_server
from tests.server import ROOT, free_port, inferd, wait_ready


@contextmanager
def process(log_path: Path, *args: str) -> Iterator[str]:
    port = free_port()
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "inferd.cli", *args, "--port", str(port)], stdout=log,
                                stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log_path)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shared")
    db = postgres_url()
    with redis_server() as redis_url, \
            process(folder / "replica.log", "replica", "--dtype", "float32", "--max-model-len", "512",
                    "--kv-cache-gib", "0.1") as replica:
        flags = ["gateway", "--upstream", replica, "--db", db, "--redis-url", redis_url, "--log-format", "json"]
        with process(folder / "gw1.log", *flags, "--usage-journal", str(folder / "gw1.journal")) as gw1, \
                process(folder / "gw2.log", *flags, "--usage-journal", str(folder / "gw2.journal")) as gw2:
            yield {"db": db, "replica": replica, "gateways": [gw1, gw2]}


def tenant_key(db: str, *flags: str) -> tuple[str, str]:
    name = f"shared-{time.monotonic_ns()}"
    inferd("tenants", "create", name, "--db", db, *flags)
    return name, json.loads(inferd("keys", "create", "--tenant", name, "--db", db, "--format", "json"))["key"]


def chat(url: str, key: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=120,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1} | body)


def test_two_gateways_share_a_tenants_request_limit(setup):
    _, key = tenant_key(setup["db"], "--rpm", "6")
    start = time.monotonic()
    codes = [chat(setup["gateways"][i % 2], key).status_code for i in range(12)]
    refilled = int((time.monotonic() - start) / 10)  # the bucket refills continuously, a request per 10 s
    assert codes[:6] == [200] * 6 and set(codes) <= {200, 429}
    assert 6 <= codes.count(200) <= 6 + refilled  # not 6 per gateway


def test_two_gateways_share_a_concurrency_limit(setup):
    _, key = tenant_key(setup["db"], "--max-concurrency", "2")
    with ThreadPoolExecutor(6) as pool:
        rs = list(pool.map(lambda i: chat(setup["gateways"][i % 2], key, max_tokens=24, ignore_eos=True), range(6)))
    codes = [r.status_code for r in rs]
    assert codes.count(200) == 2, codes
    assert {r.json()["error"]["code"] for r in rs if r.status_code == 429} == {"max_concurrency"}


def test_revocation_reaches_every_gateway_within_a_second(setup):
    name, key = tenant_key(setup["db"])
    assert all(chat(g, key).status_code == 200 for g in setup["gateways"])
    key_id = json.loads(inferd("keys", "list", "--tenant", name, "--db", setup["db"], "--format", "json"))[0]["id"]
    inferd("keys", "revoke", key_id, "--db", setup["db"])
    revoked_at = time.monotonic()
    pending = set(setup["gateways"])
    while pending:
        pending = {g for g in pending if chat(g, key).status_code == 200}
        assert time.monotonic() - revoked_at < 1.0, f"still accepted by {pending} after 1 s"


def test_both_gateways_write_usage_to_the_shared_store(setup):
    name, key = tenant_key(setup["db"])
    for g in setup["gateways"]:
        assert chat(g, key).status_code == 200
    time.sleep(1.0)
    engine = create_engine(setup["db"])
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT u.gateway_id, u.status FROM usage_records u JOIN tenants t "
                                 "ON t.id = u.tenant_id WHERE t.name = :n"), {"n": name}).all()
    engine.dispose()
    assert len(rows) == 2 and len({r.gateway_id for r in rows}) == 2


def test_a_client_gone_mid_stream_frees_its_shared_lease_and_keeps_its_record(setup):
    """The client closes a stream while it decodes: the gateway's settle in Redis (a network call, run as the
    stream is cancelled) still runs, so the tenant's one concurrency slot is free at once and the request has its
    record."""
    name, key = tenant_key(setup["db"], "--max-concurrency", "1")
    gw = setup["gateways"][0]
    for _ in range(3):
        with httpx.stream("POST", f"{gw}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                          timeout=120, json={"messages": [{"role": "user", "content": "Count to a thousand"}],
                                             "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            rid = r.headers["x-request-id"]
            next(r.iter_lines())  # decoding; then the client goes away
        deadline = time.monotonic() + 5
        while (again := chat(gw, key)).status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert again.status_code == 200, again.text  # the slot was given back, not left for the lease's expiry
        engine = create_engine(setup["db"])
        while True:
            with engine.connect() as conn:
                status = conn.execute(text("SELECT status FROM usage_records WHERE request_id = :r"),
                                      {"r": rid}).scalar()
            if status is not None or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        engine.dispose()
        assert status is not None, f"no usage record for {rid}"


def test_traces_follow_the_request_path(setup, tmp_path):
    from inferd.gateway.app import Gateway, build_gateway_app
    from inferd.gateway.config import GatewayConfig
    from inferd.gateway.deployments import Deployments, Upstream
    from inferd.control.gateway_setup import deployment_for
    from inferd.gateway.limits import MemoryLimiter
    from inferd.gateway.store import Store
    from inferd.telemetry.tracing import make_tracer

    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    store.migrate()
    store.create_tenant("traced")
    _, new = store.create_key("traced")
    config = GatewayConfig(db_url=store.url, usage_journal=tmp_path / "usage.journal")
    deployments = Deployments()
    deployments.add(deployment_for([Upstream(setup["replica"])], config))
    exporter = InMemorySpanExporter()
    tracer, provider = make_tracer("inferd-gateway", exporter=exporter)
    with TestClient(build_gateway_app(Gateway(config, store, MemoryLimiter(), deployments, tracer, provider))) as c:
        r = c.post("/v1/chat/completions", headers={"authorization": f"Bearer {new.key}"},
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans["chat SmolLM2-135M-Instruct"]
    assert {"auth", "admission", "queue", "replica call"} <= set(spans)
    assert all(spans[n].parent.span_id == root.context.span_id for n in ("auth", "admission", "queue", "replica call"))
    assert root.attributes["gen_ai.operation.name"] == "chat" and root.attributes["gen_ai.usage.output_tokens"] == 2
    assert root.attributes["gen_ai.request.model"] == "SmolLM2-135M-Instruct"
    assert [e.name for e in root.events] == ["first_token"]
