"""Hostile input against every route of the gateway (tests/hostile.py): in process, with the admin API on
and a text deployment over mock replicas, and against the shared real server with every model kind."""
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from starlette.testclient import TestClient

from inferd.console.routes import Console
from inferd.gateway.app import build_gateway_app
from tests.conftest import SMOLLM2_KEY
from tests.gateway.test_lifecycle import Replicas, deployment, make_gateway, ok
from tests.hostile import TIMEOUT_S, check_answer, endpoints, requests, send

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
        check_answer(req, send(client, req))
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
            check_answer(req, send(client, req))
        one()
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        r = client.get("/v1/models", headers={"authorization": f"Bearer {SMOLLM2_KEY}"})
        assert r.status_code == 200, r.text

