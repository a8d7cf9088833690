"""The demo robot policy through a real `inferd serve` (the shared server), called as robots call OpenPI's
server: openpi-client's WebsocketClientPolicy and ActionChunkBroker, unmodified. Metadata, chunks, the
broker asking again after a horizon, keys, malformed observations beside a healthy session, a deadline in
the past, a client that leaves mid-session, and the session's usage record."""
import json
import threading
import time

import httpx
import numpy as np
import pytest
from openpi_client.action_chunk_broker import ActionChunkBroker
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from sqlalchemy import create_engine, text
from websockets.exceptions import ConnectionClosedError

from inferd.policy.demo import DEMO_NAME
from inferd.policy.sim import ReacherTask
from tests.conftest import SMOLLM2_KEY
from tests.server import db_url


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


@pytest.fixture(scope="module")
def ws_url(server):
    cards = httpx.get(f"{server[0]}/v1/models", headers={"authorization": f"Bearer {SMOLLM2_KEY}"}).json()["data"]
    card = {c["id"]: c for c in cards}[DEMO_NAME]
    assert card["kind"] == "policy" and card["action_horizon"] >= 1
    return server[0].replace("http://", "ws://") + card["websocket_path"]


def client(ws_url: str, key: str = SMOLLM2_KEY) -> WebsocketClientPolicy:
    return WebsocketClientPolicy(ws_url, api_key=key)


def metric(url: str, name: str, **labels) -> float:
    text_ = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text_.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_metadata_chunks_and_the_broker(ws_url, server):
    policy = client(ws_url)
    meta = policy.get_server_metadata()
    horizon, dim = meta["action_horizon"], meta["action_dim"]
    assert meta["control_hz"] > 0 and set(meta["observation_spec"]) == {"observation/image", "observation/state",
                                                                         "prompt"}
    task = ReacherTask(0)
    reply = policy.infer(task.observation())
    assert reply["actions"].shape == (horizon, dim) and reply["actions"].dtype == np.float32
    assert {"infer_ms", "queue_ms"} <= set(reply["server_timing"]) and reply["late"] is False

    calls = []

    class Counting:
        def infer(self, obs):
            calls.append(1)
            return policy.infer(obs)

        def reset(self):
            pass

    broker = ActionChunkBroker(Counting(), action_horizon=horizon)
    for step in range(horizon + 1):
        action = broker.infer(task.observation())
        assert action["actions"].shape == (dim,)
        task.step(action["actions"])
        assert len(calls) == (1 if step < horizon else 2)  # a new chunk once the horizon is played
    assert httpx.get(f"{server[0]}/healthz").text == "OK\n"


def test_a_wrong_key_is_refused_at_the_handshake(ws_url):
    with pytest.raises(ConnectionClosedError) as closed:
        client(ws_url, key="sk-not-a-key")
    assert closed.value.rcvd.code == 4401 and "unauthorized" in closed.value.rcvd.reason


def test_malformed_observations_get_error_frames_while_others_are_served(ws_url):
    healthy, answers, stop = client(ws_url), [], threading.Event()

    def robot():
        task = ReacherTask(1)
        while not stop.is_set():
            answers.append(healthy.infer(task.observation())["actions"].shape)

    thread = threading.Thread(target=robot)
    thread.start()
    try:
        bad = client(ws_url)
        good = ReacherTask(2).observation()
        missing = {k: v for k, v in good.items() if k != "prompt"}
        cases = [(missing, "no 'prompt'"), (good | {"observation/state": good["observation/state"][:4]},
                                            r"has shape \[4\]"),
                 (good | {"observation/image": good["observation/image"].astype(np.float32)}, "needs uint8"),
                 (good | {"observation/image": np.zeros(50 * 2**20, np.uint8)}, "frame_too_large")]
        for obs, says in cases:
            before = len(answers)
            with pytest.raises(RuntimeError, match=says):
                bad.infer(obs)
            for _ in range(100):
                if len(answers) > before:
                    break
                time.sleep(0.02)
            assert len(answers) > before  # the other robot kept being answered meanwhile
        assert bad.infer(good)["actions"].ndim == 2  # and the bad session is still usable
    finally:
        stop.set()
        thread.join(10)


def test_a_deadline_in_the_past_is_not_run(ws_url, server):
    policy = client(ws_url)
    ran = metric(server[0], "inferd_policy_batch_observations_count")
    obs = ReacherTask(3).observation() | {"inferd.timestamp": time.time() - 1.0, "inferd.deadline_ms": 20}
    with pytest.raises(RuntimeError, match="deadline_exceeded"):
        policy.infer(obs)
    assert metric(server[0], "inferd_policy_batch_observations_count") == ran
    assert policy.infer(ReacherTask(3).observation())["actions"].ndim == 2


def test_a_client_that_leaves_mid_session_leaves_a_record_and_nothing_else(ws_url, server):
    began = time.time()
    others = metric(server[0], "inferd_gateway_policy_sessions", model=DEMO_NAME)  # earlier tests' clients
    policy = client(ws_url)
    for seed in (4, 5, 6):
        policy.infer(ReacherTask(seed).observation())
    policy._ws.send(policy._packer.pack(ReacherTask(7).observation()))  # then leave without reading the answer
    policy._ws.close()
    for _ in range(100):
        if metric(server[0], "inferd_gateway_policy_sessions", model=DEMO_NAME) == others:
            break
        time.sleep(0.1)
    assert metric(server[0], "inferd_gateway_policy_sessions", model=DEMO_NAME) == others
    engine = create_engine(db_url(server[1]))
    for _ in range(50):  # usage records are written in batches, within a second
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT status, prompt_tokens, units FROM usage_records WHERE model = :m "
                                     "AND http_status = 101 AND started_unix_s >= :t"),
                                {"m": DEMO_NAME, "t": began}).all()
        if rows:
            break
        time.sleep(0.1)
    [(status, observations, units)] = rows
    units = json.loads(units) if isinstance(units, str) else units
    assert status == "completed" and observations in (3, 4) and units["chunks"] >= 3 and units["session_s"] > 0
