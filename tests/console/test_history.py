"""The console's History outlives a gateway restart: the buckets go to the store (a real SQLite file) each minute
and when the gateway closes, and a new gateway process on the same store reads them back at start."""
import httpx
from starlette.testclient import TestClient

from inferd.console.routes import Console
from inferd.console.window import COARSE_S
from inferd.gateway.app import Gateway, build_gateway_app
from inferd.gateway.config import GatewayConfig
from inferd.gateway.deployments import Deployments
from inferd.gateway.limits import MemoryLimiter
from tests.gateway.test_lifecycle import CHAT, Replicas, deployment, make_gateway, ok

T0 = 1_800_000_000.0 // COARSE_S * COARSE_S


def served(gw: Gateway, at_unix_s: float) -> Console:
    console = Console(gw)
    console.window.clock = lambda: at_unix_s
    gw.services.append(console)
    return console


def test_history_outlives_a_gateway_restart(tmp_path):
    gw, key = make_gateway(tmp_path, Replicas(a=ok), [deployment("m", "a")])
    served(gw, T0 + 5)
    with TestClient(build_gateway_app(gw)) as client:
        for body in (CHAT | {"model": "m"}, CHAT | {"model": "m", "max_tokens": 10_000}):  # the second: a 400
            client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})

    again = Gateway(GatewayConfig(db_url=gw.store.url, usage_journal=tmp_path / "usage2.journal"), gw.store,
                    MemoryLimiter(), Deployments(), transport=httpx.MockTransport(Replicas(a=ok)))
    again.deployments.add(deployment("m", "a"))
    console = served(again, T0 + COARSE_S + 5)  # ten minutes on: the bucket is over
    with TestClient(build_gateway_app(again)):
        points = console.window.history("m", "v1")
    assert (points[0]["start_unix_s"], round(points[0]["requests_per_s"] * COARSE_S), points[0]["failures"]) == \
        (T0, 2, 1)
    assert all(p["start_unix_s"] == T0 + COARSE_S for p in points[1:])  # the one this process counts in, if begun
