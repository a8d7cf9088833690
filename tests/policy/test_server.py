"""The policy replica in process: msgpack observation in, its own chunk out; checks before work; deadlines
while waiting; observations of concurrent callers batched together."""
import asyncio
import time

import httpx
import numpy as np
import pytest
from starlette.testclient import TestClient

from inferd.policy.config import PolicyConfig
from inferd.policy.metrics import PolicyMetrics
from inferd.policy.runtime import PolicyRuntime
from inferd.policy.server import build_policy_app
from inferd.protocol import headers
from inferd.protocol.policy import packb, unpackb
from tests.policy.tiny import TinyPolicy, expected, observation

MSGPACK = {"content-type": "application/msgpack"}


def make_app(policy: TinyPolicy, **config):
    metrics = PolicyMetrics()
    runtime = PolicyRuntime(policy, PolicyConfig(**config), on_batch=metrics.observe_batch)
    return build_policy_app(runtime, metrics), runtime


@pytest.fixture
def client():
    app, _ = make_app(TinyPolicy())
    with TestClient(app) as c:
        for _ in range(100):
            if c.get("/ready").status_code == 200:
                break
            time.sleep(0.02)
        yield c


def test_an_observation_gets_its_chunk_and_timings(client):
    r = client.post("/v1/policy/infer", content=packb(observation((1, 2, 3))), headers=MSGPACK)
    assert r.status_code == 200 and r.headers["content-type"] == "application/msgpack"
    reply = unpackb(r.content)
    np.testing.assert_array_equal(reply["actions"], expected([1, 2, 3]))
    assert set(reply["server_timing"]) == {"infer_ms", "queue_ms"} and reply["policy_timing"]["batch_size"] == 1


def test_the_card_says_what_a_session_needs(client):
    [card] = client.get("/v1/models").json()["data"]
    assert card["kind"] == "policy" and card["metadata"]["action_horizon"] == 4
    assert card["metadata"]["observation_spec"]["observation/state"] == {"shape": [3], "dtype": "float32"}
    assert {"max_frame_bytes", "max_sessions", "idle_timeout_s", "digests"} <= set(card)


@pytest.mark.parametrize("body, code", [
    (packb({"observation/state": np.zeros(3, np.float32)}), "invalid_observation"),
    (b"\xc1not msgpack", "invalid_observation"),
    (packb(observation(state=(1.0, 2.0))), "invalid_observation"),
])
def test_bad_observations_are_400_before_any_work(client, body, code):
    r = client.post("/v1/policy/infer", content=body, headers=MSGPACK)
    assert r.status_code == 400 and r.json()["error"]["code"] == code
    assert client.post("/v1/policy/infer", content=packb(observation()), headers=MSGPACK).status_code == 200


def test_a_frame_over_the_cap_is_413():
    app, _ = make_app(TinyPolicy(), max_frame_bytes=1000)
    with TestClient(app) as c:
        r = c.post("/v1/policy/infer", content=b"\0" * 2000, headers=MSGPACK)
        assert r.status_code == 413 and r.json()["error"]["code"] == "frame_too_large"


def test_concurrent_observations_share_a_batch_and_a_waiting_one_expires():
    asyncio.run(_batched_and_expired())


async def _batched_and_expired():
    policy = TinyPolicy(delay_s=0.05)
    app, runtime = make_app(policy, max_batch_size=8)
    runtime.start()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as c:
            async def post(state, deadline_ms=None):
                h = MSGPACK | ({headers.DEADLINE_MS: str(deadline_ms)} if deadline_ms else {})
                return await c.post("/v1/policy/infer", content=packb(observation(state)), headers=h)
            first = asyncio.create_task(post((0, 0, 0)))  # runs alone: the policy was idle
            await asyncio.sleep(0.01)
            rest = [asyncio.create_task(post((i, 0, 0))) for i in range(1, 6)]
            late = asyncio.create_task(post((9, 9, 9), deadline_ms=20))  # waits behind a 50 ms batch
            answers = await asyncio.gather(first, *rest)
            for i, r in enumerate(answers):
                np.testing.assert_array_equal(unpackb(r.content)["actions"], expected([i, 0, 0]))
            r = await late
            assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
        assert policy.batches[:2] == [1, 5], policy.batches  # the second batch took the five waiting ones
    finally:
        await runtime.stop()
