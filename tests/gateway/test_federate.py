"""The gateway's /metrics with its replicas' own (gateway/federate.py)."""
from starlette.testclient import TestClient

from inferd.gateway.app import build_gateway_app
from tests.gateway.test_lifecycle import Replicas, deployment, make_gateway, ok


def test_metrics_answer_when_a_replica_answers_its_metrics_with_something_else(tmp_path):
    """Found by the fuzzer (tests/gateway/test_hostile.py): GET /metrics was a 500 when one replica's
    /metrics was not the Prometheus text format (here the mock replica's JSON)."""
    gw, _ = make_gateway(tmp_path, Replicas(a=ok), [deployment("m", "a")])
    with TestClient(build_gateway_app(gw)) as client:
        r = client.get("/metrics")
    assert r.status_code == 200 and "inferd_gateway_queue_length" in r.text
