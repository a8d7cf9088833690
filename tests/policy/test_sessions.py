"""Robot-policy sessions through the gateway, in process: the gateway's WebSocket route in front of a real
policy replica app (the tiny policy) reached through httpx's ASGI transport. The handshake (keys, access,
caps), the strict alternation, checks before work, deadlines, superseding, and one usage record a session."""
import time
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from inferd.gateway.admission import AdmissionQueue, QueueConfig
from inferd.gateway.app import build_gateway_app
from inferd.gateway.config import ModelPrice
from inferd.gateway.deployments import Deployment, Upstream
from inferd.gateway.policy import Limits
from inferd.policy.config import PolicyConfig
from inferd.policy.metrics import PolicyMetrics
from inferd.policy.runtime import PolicyRuntime
from inferd.policy.server import build_policy_app
from inferd.control.kinds import policy_model
from inferd.protocol.policy import packb, unpackb
from tests.gateway.test_lifecycle import Replicas, make_gateway
from tests.policy.tiny import TinyPolicy, expected, observation

PATH = "/v1/policies/tiny/ws"


class InProcessReplica:
    """The policy replica app as the gateway's upstream; its batcher runs on the gateway's loop (a Service)."""

    def __init__(self, policy: TinyPolicy):
        self.runtime = PolicyRuntime(policy, PolicyConfig())
        self.asgi = httpx.ASGITransport(app=build_policy_app(self.runtime, PolicyMetrics()))

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        return await self.asgi.handle_async_request(request)

    async def start(self, gateway) -> None:
        self.runtime.start()

    async def close(self) -> None:
        await self.runtime.stop()


def make(tmp_path, policy: TinyPolicy, *, max_frame_bytes=2**20, max_sessions=4, idle_timeout_s=30.0):
    replica = InProcessReplica(policy)
    replicas = Replicas(p=replica)
    model = policy_model(replica.runtime.metadata(), max_frame_bytes, max_sessions, idle_timeout_s)
    d = Deployment("tiny", model, [Upstream("http://p:9", name="p")], AdmissionQueue(QueueConfig(max_inflight=8)))
    gw, key = make_gateway(tmp_path, replicas, [d], prices={"tiny": ModelPrice(1e6, 0, 0, 3600.0)})
    gw.services.append(replica)
    records = []
    gw.observers.append(records.append)
    return gw, key, replicas, records


@contextmanager
def session(client: TestClient, gw, headers: dict):
    """A session the test itself leaves: closed, then waited for until the gateway has ended it (TestClient
    cancels the app as its websocket context exits, which would race the session's own end)."""
    with client.websocket_connect(PATH, headers=headers) as ws:
        yield ws
        opened = gw.sessions.count("tiny")
        ws.close()
        for _ in range(300):
            if gw.sessions.count("tiny") < opened:
                break
            time.sleep(0.01)


def auth(key: str, scheme: str = "Api-Key") -> dict:
    return {"authorization": f"{scheme} {key}"}


def test_metadata_first_then_a_chunk_per_observation_and_one_record(tmp_path):
    gw, key, replicas, records = make(tmp_path, TinyPolicy())
    with TestClient(build_gateway_app(gw)) as client:
        with session(client, gw, auth(key)) as ws:
            meta = unpackb(ws.receive_bytes())
            assert meta["action_horizon"] == 4 and meta["observation_spec"]["prompt"]["dtype"] == "str"
            now = time.time()
            ws.send_bytes(packb(observation((1, 1, 1), **{"inferd.timestamp": now})))
            first = unpackb(ws.receive_bytes())
            np.testing.assert_array_equal(first["actions"], expected([1, 1, 1]))
            assert first["valid_until"] == pytest.approx(now + 4 / 50) and first["late"] is False
            assert {"infer_ms", "queue_ms", "total_ms"} <= set(first["server_timing"])
            ws.send_bytes(packb(observation((2, 0, 0))))
            second = unpackb(ws.receive_bytes())
            assert "prev_total_ms" in second["server_timing"]
        assert client.get("/v1/models", headers=auth(key, "Bearer")).json()["data"][0]["websocket_path"] == PATH
    [rec] = records
    assert (rec.status, rec.http_status, rec.prompt_tokens, rec.completion_tokens) == ("completed", 101, 2, 8)
    assert rec.units["observations"] == 2 and rec.units["chunks"] == 2 and rec.units["missed_deadlines"] == 0
    assert rec.cost_usd == pytest.approx(2.0 + rec.units["session_s"], rel=0.05)  # $1 an observation, $1 a second
    assert gw.sessions.open == {} and all(u.inflight == 0 for u in gw.deployments.get("tiny").upstreams)


@pytest.mark.parametrize("headers, path, code", [
    ({}, PATH, 4401),
    ({"authorization": "Api-Key sk-wrong"}, PATH, 4401),
    (None, "/v1/policies/nope/ws", 4404),
])
def test_refused_handshakes_close_with_a_code_and_reason(tmp_path, headers, path, code):
    gw, key, replicas, _ = make(tmp_path, TinyPolicy())
    with TestClient(build_gateway_app(gw)) as client:
        with client.websocket_connect(path, headers=auth(key) if headers is None else headers) as ws:
            with pytest.raises(WebSocketDisconnect) as closed:
                ws.receive_bytes()
    assert closed.value.code == code and closed.value.reason
    assert replicas.requests == []


def test_model_access_and_the_tenants_session_cap(tmp_path):
    gw, key, _, records = make(tmp_path, TinyPolicy())
    tenant = gw.store.tenants()[0]
    gw.store.update_tenant(tenant.name, limits=Limits(max_sessions=1).to_dict())
    _, other = gw.store.create_key(tenant.name, allowed_models=["something-else"])
    with TestClient(build_gateway_app(gw)) as client:
        with client.websocket_connect(PATH, headers=auth(other.key)) as ws:
            with pytest.raises(WebSocketDisconnect) as closed:
                ws.receive_bytes()
        assert closed.value.code == 4403
        with session(client, gw, auth(key)) as first:
            first.receive_bytes()
            with client.websocket_connect(PATH, headers=auth(key)) as second:
                with pytest.raises(WebSocketDisconnect) as closed:
                    second.receive_bytes()
            assert closed.value.code == 4429 and "retry in 5 s" in closed.value.reason
        with session(client, gw, auth(key)) as again:  # the first one's slot is free again
            again.receive_bytes()
    assert sorted(r.status for r in records) == ["completed", "completed", "rejected", "rejected"]


def test_bad_observations_are_error_frames_and_the_session_goes_on(tmp_path):
    gw, key, replicas, records = make(tmp_path, TinyPolicy(), max_frame_bytes=10_000)
    with TestClient(build_gateway_app(gw)) as client:
        with client.websocket_connect(PATH, headers=auth(key)) as ws:
            ws.receive_bytes()
            bad = observation()
            del bad["prompt"]
            for frame, code in ((packb(bad), "invalid_observation"), (b"\xc1", "invalid_observation"),
                                (packb(observation(big=np.zeros(20_000, np.uint8))), "frame_too_large"),
                                (packb(observation(**{"inferd.timestamp": time.time() - 5,
                                                      "inferd.deadline_ms": 100})), "deadline_exceeded")):
                ws.send_bytes(frame)
                assert ws.receive_json()["error"]["code"] == code
            assert replicas.requests == []  # none of them reached the replica
            ws.send_bytes(packb(observation()))
            assert unpackb(ws.receive_bytes())["actions"].shape == (4, 2)
            ws.send_text("hello")
            with pytest.raises(WebSocketDisconnect) as closed:
                ws.receive_bytes()
            assert closed.value.code == 4400
    [rec] = records
    assert rec.units["invalid"] == 3 and rec.units["expired"] == 1 and rec.error_code == "protocol_error"


def test_a_newer_observation_replaces_a_waiting_one_and_a_late_chunk_is_flagged(tmp_path):
    gw, key, _, records = make(tmp_path, TinyPolicy(delay_s=0.2))
    with TestClient(build_gateway_app(gw)) as client:
        with session(client, gw, auth(key)) as ws:
            ws.receive_bytes()
            for i in range(3):  # a client that does not wait: the second waits behind the first, the third replaces it
                ws.send_bytes(packb(observation((i, 0, 0), **{"inferd.deadline_ms": 100})))
            first = unpackb(ws.receive_bytes())
            np.testing.assert_array_equal(first["actions"], expected([0, 0, 0]))
            assert first["late"] is True  # 200 ms of forward pass for a 100 ms deadline
            assert ws.receive_json()["error"]["code"] == "superseded"
            third = ws.receive()
            assert "bytes" in third or "deadline_exceeded" in third["text"]  # it waited 200 ms: past its deadline
    [rec] = records
    assert rec.units["superseded"] == 1 and rec.units["late"] == 1


def test_a_client_that_leaves_mid_inference_leaves_nothing_behind(tmp_path):
    policy = TinyPolicy(delay_s=0.3)
    gw, key, _, records = make(tmp_path, policy)
    with TestClient(build_gateway_app(gw)) as client:
        with session(client, gw, auth(key)) as ws:  # it leaves 50 ms into a 300 ms forward pass
            ws.receive_bytes()
            ws.send_bytes(packb(observation()))
            time.sleep(0.05)
        for _ in range(100):
            if records:
                break
            time.sleep(0.02)
        d = gw.deployments.get("tiny")
        assert gw.sessions.open == {} and d.upstreams[0].inflight == 0
    [rec] = records
    assert rec.status == "completed" and rec.units["chunks"] == 0


def test_an_address_that_keeps_sending_wrong_keys_is_refused_without_a_store_read(tmp_path):
    gw, key, _, _ = make(tmp_path, TinyPolicy())
    reads = []
    find = gw.store.find_key
    gw.store.find_key = lambda lookup: reads.append(lookup) or find(lookup)
    codes = []
    with TestClient(build_gateway_app(gw)) as client:
        for i in range(40):
            with client.websocket_connect(PATH, headers=auth(f"sk-inferd-wrong{i:04d}")) as ws:
                with pytest.raises(WebSocketDisconnect) as closed:
                    ws.receive_bytes()
            codes.append(closed.value.code)
    assert codes[0] == 4401 and codes[-1] == 4429 and len(reads) < 40


def test_the_deadline_bound_forgets_a_slow_spell():
    """Observations nearer their deadline than the fastest recent round trip are refused unrun; once a slow spell's
    trips are older than the window, the next one runs and measures again (no refusals for good)."""
    from inferd.gateway.sessions import ROUND_TRIPS_WINDOW_S, RoundTrips
    trips = RoundTrips()
    assert trips.fastest(0.0) == 0.0  # nothing measured: nothing refused
    for i in range(100):  # an overloaded spell: every trip slower than a 20 ms deadline
        trips.add(0.030 + i * 0.001, now=10.0 + i * 0.01)
    assert trips.fastest(11.0) == pytest.approx(0.066)  # the window keeps the last 64 trips: the fastest of those
    assert trips.fastest(11.0 + ROUND_TRIPS_WINDOW_S) == 0.0  # every trip is older than the window
    trips.add(0.004, now=20.0)
    assert trips.fastest(20.1) == 0.004
