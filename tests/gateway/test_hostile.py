"""Hostile input against every route of the gateway (tests/hostile.py): in process, with the admin API on
and a text deployment over mock replicas, and against the shared real server with every model kind; clients
that hang up at every stage of a request, against the real server."""
import json
import re
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from starlette.testclient import TestClient

from inferd.console.routes import Console
from inferd.gateway.app import build_gateway_app
from tests.conftest import SMOLLM2_KEY
from tests.gateway.test_lifecycle import Replicas, deployment, make_gateway, ok
from tests.hostile import (TIMEOUT_S, check_answer, endpoints, hang_up, hangups, internal_errors, requests, send,
                           sweep)
from tests.server import wait_stored

ADMIN_KEY = "admin-fuzz"
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def in_process(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    gw, key = make_gateway(tmp, Replicas(a=ok), [deployment("m", "a")], admin_key=ADMIN_KEY, files_dir=tmp / "files")
    app = build_gateway_app(gw, Console(gw).routes())
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, endpoints(app), key


def test_every_route_is_fuzzed(in_process):
    _, eps, _ = in_process
    paths = {e.path for e in eps}
    assert {"/v1/chat/completions", "/v1/files", "/v1/batches", "/tokenize", "/admin/tenants"} <= paths
    assert any(p.startswith("/v2/") for p in paths) and any(p.startswith("/console") for p in paths)


def test_hostile_requests_in_process_get_no_5xx_and_the_api_error_shape(in_process):
    client, eps, key = in_process

    @FUZZ
    @given(requests(eps, ["m"], key) | requests(eps, ["m"], ADMIN_KEY))
    def one(req):
        check_answer(req, send(client, req), eps)
    one()


def test_hostile_requests_to_the_real_server_get_no_5xx_and_the_api_error_shape(smollm2_server, in_process):
    url, _ = smollm2_server
    _, eps, _ = in_process
    # From an address of its own: its failed authentications must not rate-limit other tests' new keys
    # (gateway/auth.py limits them per client address).
    transport = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(base_url=url, timeout=TIMEOUT_S, transport=transport) as client:
        models = [m["id"] for m in client.get("/v1/models", headers={"authorization": f"Bearer {SMOLLM2_KEY}"}).json()[
            "data"]]

        @FUZZ
        @given(requests(eps, models, SMOLLM2_KEY))
        def one(req):
            check_answer(req, send(client, req), eps)
        one()
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        r = client.get("/v1/models", headers={"authorization": f"Bearer {SMOLLM2_KEY}"})
        assert r.status_code == 200, r.text



@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
def test_an_unknown_route_answers_openais_error_shape_and_an_oip_route_the_oips(smollm2_server, method):
    """Issue #53: /v2/nope answered {"error": "Not found."}; only the protocol's own routes answer its shape."""
    url, _ = smollm2_server
    for path in ["/nope", "/v1/nope", "/v2/nope", "/v2/models/x/nope", "/v2/health", "/console/nope"]:
        r = httpx.request(method, f"{url}{path}")
        assert r.status_code == 404 and r.json() == {"error": {"message": "Not found.", "param": None,
                                                               "type": "invalid_request_error", "code": "not_found"}}, \
            (path, r.text)
    r = httpx.request(method, f"{url}/v2/health/live")  # without a key: 401 (or 405)
    assert r.status_code in (401, 405) and isinstance(r.json()["error"], str), r.text


# clients that hang up

AWAY = "127.0.0.2"  # hang-ups come from here: failed authentications must not rate-limit other tests' keys


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname, parts.port


def internal_error_rejections(url: str) -> float:
    found = re.search(r'^inferd_gateway_rejections_total\{reason="internal_error"\} (\S+)$',
                      httpx.get(f"{url}/metrics", timeout=10).text, re.M)
    return float(found.group(1)) if found else 0.0


def settled(url: str, timeout_s: float = 30.0) -> None:
    """Until the requests and sessions the hang-ups left have ended and their records are stored."""
    deadline = time.monotonic() + timeout_s
    busy = re.compile(r"^inferd_gateway_(inflight_requests|policy_sessions)\{.*\} [1-9]", re.M)
    while busy.search(httpx.get(f"{url}/metrics", timeout=10).text):
        assert time.monotonic() < deadline, "requests still in flight after the clients left"
        time.sleep(0.2)
    wait_stored(url)
    time.sleep(0.5)  # a replica's log of an abort it saw last


def test_a_client_that_hangs_up_mid_body_is_a_client_closed_request(smollm2_server):
    """Issue #53: Content-Length 100000, 48 bytes, then gone: a 499 client_closed_request at info, once."""
    url, log_path = smollm2_server
    mark, before = log_path.stat().st_size, internal_error_rejections(url)
    with socket.create_connection(_address(url), source_address=(AWAY, 0)) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  f"authorization: Bearer {SMOLLM2_KEY}\r\ncontent-length: 100000\r\n\r\n".encode()
                  + b'{"model": "x", "messages": [{"role": "user", "c')
    settled(url)
    log = log_path.read_text()[mark:]
    assert internal_errors(log) == [] and internal_error_rejections(url) == before
    [line] = [json.loads(line) for line in log.splitlines() if '"inferd.gateway.access"' in line]
    assert line["level"] == "info"
    assert (line["http_status"], line["error_code"]) == (499, "client_closed_request"), line


def test_clients_that_hang_up_at_any_stage_leave_no_internal_error(smollm2_server, in_process):
    """Every route at every stage (mid-head, mid-body, after the body, mid-answer; a robot session mid-head,
    mid-handshake, mid-frame, after a frame), then hostile requests left at random stages."""
    url, log_path = smollm2_server
    _, eps, _ = in_process
    address = _address(url)
    models = [m["id"] for m in httpx.get(f"{url}/v1/models", headers={
        "authorization": f"Bearer {SMOLLM2_KEY}"}).json()["data"]]
    mark, before = log_path.stat().st_size, internal_error_rejections(url)
    for h in sweep(eps, models, SMOLLM2_KEY):
        hang_up(address, h, AWAY)

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                      HealthCheck.data_too_large])
    @given(hangups(eps, models, SMOLLM2_KEY))
    def one(h):
        hang_up(address, h, AWAY)
    one()
    settled(url)
    assert internal_errors(log_path.read_text()[mark:]) == []
    assert internal_error_rejections(url) == before
    r = httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {SMOLLM2_KEY}"})
    assert r.status_code == 200, r.text
