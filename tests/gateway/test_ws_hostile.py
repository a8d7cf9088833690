"""Hostile frames on the robot policy route `/v1/policies/{name}/ws` (gateway/sessions.py), in process over
the tiny policy's real replica app: random and malformed binary frames, wrong msgpack, observations one
step from a good one, frames above the deployment's frame cap, text frames. Every frame is answered in
order, by a chunk or an error frame of the protocol's shape; a text frame closes the session with 4400;
never 1011 or an exception; afterwards a good session is served as before."""
import json

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from inferd.gateway.app import build_gateway_app
from inferd.protocol.policy import packb, unpackb
from tests.hostile import json_values
from tests.policy.test_sessions import PATH, auth, make, session
from tests.policy.tiny import TinyPolicy, expected, observation

MAX_FRAME_BYTES = 4096  # the deployment's cap in this test: a bigger frame is answered frame_too_large
ERROR_CODES = {"invalid_observation", "frame_too_large", "deadline_exceeded", "superseded"}

arrays = st.fixed_dictionaries({
    b"__ndarray__": st.just(True),
    b"data": st.binary(max_size=64),
    b"dtype": st.sampled_from(["<f4", "|u1", "<i8", "|O", "<U3", "V8", "", "f4" * 10]) | st.integers() | st.none(),
    b"shape": st.lists(st.integers(-2, 10**12), max_size=10) | st.integers() | st.text(max_size=3)})
scalars = st.fixed_dictionaries({b"__npgeneric__": st.just(True), b"data": json_values,
                                 b"dtype": st.sampled_from(["<f4", "|O", "x"]) | json_values})


def pack(value) -> bytes:
    """msgpack of anything Hypothesis drew (an int beyond 64 bits cannot be: then msgpack's nil)."""
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return b"\xc0"


FIXED = {  # built here, named in the strategy (Hypothesis would print their bytes)
    "cut short": packb(observation())[:-3],
    "a byte msgpack never uses": msgpack.packb([[[[]]]] * 3) + b"\xc1",
    "an array claiming 4 billion items": b"\xdd\xff\xff\xff\xff",
    "100,000 nested arrays": b"\x91" * 100_000 + b"\xc0",
    "a good observation": packb(observation()),
}


@st.composite
def near_observation(draw) -> bytes:
    """A good observation with one key given another value, dropped, or a control key set to anything."""
    obs = observation()
    key = draw(st.sampled_from(sorted(obs) + ["inferd.timestamp", "inferd.deadline_ms"]))
    how = draw(st.sampled_from(["value", "drop", "array", "scalar"]))
    if how == "drop":
        obs.pop(key, None)
    else:
        raw = {"value": json_values, "array": arrays, "scalar": scalars}[how]
        obs[key] = draw(raw)
    if any(isinstance(v, np.ndarray) for v in obs.values()):
        try:
            return packb(obs)
        except (OverflowError, ValueError, TypeError):
            return packb(observation())
    return pack(obs)


binary_frames = st.one_of(
    st.binary(max_size=256),  # mostly not msgpack
    json_values.map(pack),  # msgpack, but not an observation
    arrays.map(lambda a: pack({"observation/state": a})),
    near_observation(),
    st.sampled_from(sorted(FIXED)).map(FIXED.get),
    st.integers(MAX_FRAME_BYTES + 1, 3 * MAX_FRAME_BYTES).map(lambda n: b"\x00" * n),  # above the frame cap
)
frames = st.lists(st.tuples(st.just("bytes"), binary_frames), min_size=1, max_size=4).flatmap(
    lambda seq: st.one_of(st.just(seq), st.text(max_size=40).map(lambda t: seq + [("text", t)])))


def test_hostile_frames_get_their_error_frame_or_4400_never_1011(tmp_path):
    gw, key, _, records = make(tmp_path, TinyPolicy(), max_frame_bytes=MAX_FRAME_BYTES, max_sessions=64)
    with TestClient(build_gateway_app(gw)) as client:
        @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.data_too_large])
        @given(frames)
        def one(seq):
            ends_in_text = seq[-1][0] == "text"  # the gateway closes it; else the test leaves (and waits)
            with (client.websocket_connect(PATH, headers=auth(key)) if ends_in_text
                  else session(client, gw, auth(key))) as ws:
                ws.receive_bytes()  # the metadata
                for kind, frame in seq:
                    if kind == "text":
                        ws.send_text(frame)
                        closed = ws.receive()
                        assert closed["type"] == "websocket.close" and closed["code"] == 4400, closed
                        return
                    ws.send_bytes(frame)
                    reply = ws.receive()  # one answer per frame: the client waits for each
                    assert reply["type"] == "websocket.send", reply
                    if reply.get("bytes") is not None:
                        assert unpackb(reply["bytes"])["actions"].shape == (4, 2)
                    else:
                        error = json.loads(reply["text"])["error"]
                        assert error["code"] in ERROR_CODES and isinstance(error["message"], str), error
        one()
        with session(client, gw, auth(key)) as ws:  # the gateway serves as before
            ws.receive_bytes()
            ws.send_bytes(packb(observation((1.0, 2.0, 3.0))))
            np.testing.assert_array_equal(unpackb(ws.receive_bytes())["actions"], expected([1, 2, 3]))
    assert not any(r.error_code == "internal_error" for r in records)
