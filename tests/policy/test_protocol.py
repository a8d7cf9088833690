"""The policy kind's wire contract: openpi-client's msgpack numpy frames, observation checks, error frames."""
import json

import msgpack
import numpy as np
import pytest
from openpi_client import msgpack_numpy

from inferd.protocol.policy import (CLOSE_CODES, ObservationSpec, PolicyError, check_observation, packb, unpackb,
                                    valid_until)

SPEC = ObservationSpec.from_dict({"observation/image": {"shape": [8, 8, 3], "dtype": "uint8"},
                                  "observation/state": {"shape": [6], "dtype": "float32"},
                                  "prompt": {"shape": [], "dtype": "str"}})


def observation(**changes):
    obs = {"observation/image": np.zeros((8, 8, 3), np.uint8), "observation/state": np.arange(6, dtype=np.float64),
           "prompt": "reach the red target"}
    return obs | changes


def test_frames_from_openpi_client_decode_to_the_same_arrays():
    obs = observation(extra=np.float32(2.5))
    got = unpackb(msgpack_numpy.packb(obs))
    np.testing.assert_array_equal(got["observation/image"], obs["observation/image"])
    assert got["observation/state"].dtype == np.float64 and got["prompt"] == obs["prompt"]
    assert got["extra"] == np.float32(2.5) and isinstance(got["extra"], np.float32)


def test_our_frames_decode_in_openpi_client():
    actions = np.random.default_rng(0).standard_normal((10, 2)).astype(np.float32)
    got = msgpack_numpy.unpackb(packb({"actions": actions, "server_timing": {"infer_ms": 1.5}}))
    np.testing.assert_array_equal(got["actions"], actions)
    assert got["server_timing"] == {"infer_ms": 1.5}


@pytest.mark.parametrize("array", [
    {b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": "|O", b"shape": [1]},  # objects: never
    {b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": "V8", b"shape": [1]},
    {b"__ndarray__": True, b"data": b"\0" * 7, b"dtype": "<f4", b"shape": [2]},  # bytes do not match the shape
    {b"__ndarray__": True, b"data": b"\0" * 4, b"dtype": "<f4", b"shape": [-1]},
    {b"__ndarray__": True, b"data": b"\0" * 4, b"dtype": "not a dtype", b"shape": [1]},
])
def test_malformed_arrays_are_invalid_observations(array):
    with pytest.raises(PolicyError) as err:
        unpackb(msgpack.packb({"x": array}))
    assert err.value.code == "invalid_observation"


def test_garbage_is_an_invalid_observation():
    with pytest.raises(PolicyError, match="not valid msgpack"):
        unpackb(b"\xc1\xc1\xc1")


def test_a_good_observation_passes_with_floats_cast():
    got = check_observation(SPEC, unpackb(msgpack_numpy.packb(observation(**{"inferd.timestamp": 10.0}))))
    assert set(got.values) == {"observation/image", "observation/state", "prompt"}
    assert got.values["observation/state"].dtype == np.float32 and got.timestamp_unix_s == 10.0


@pytest.mark.parametrize("changes, says", [
    ({"observation/image": None}, "must be an array"),
    ({"observation/image": np.zeros((8, 8, 3), np.float32)}, "needs uint8"),
    ({"observation/image": np.zeros((8, 8), np.uint8)}, "has shape [8, 8]"),
    ({"observation/state": np.full(6, np.nan)}, "NaN"),
    ({"observation/state": ["a"] * 6}, "needs numbers"),
    ({"prompt": 3}, "must be a string"),
    ({"inferd.deadline_ms": -5}, "positive number"),
    ({"inferd.timestamp": "now"}, "must be a number"),
])
def test_bad_observations_are_named(changes, says):
    with pytest.raises(PolicyError, match=says.replace("[", r"\[").replace("]", r"\]")) as err:
        check_observation(SPEC, observation(**changes))
    assert err.value.code == "invalid_observation"


def test_a_missing_key_is_named_with_what_the_policy_reads():
    obs = observation()
    del obs["observation/state"]
    with pytest.raises(PolicyError, match="no 'observation/state'.*reads: observation/image"):
        check_observation(SPEC, obs)


def test_error_frames_and_close_reasons():
    err = PolicyError("session_limit", "x" * 300, retry_after_s=5.0, close=CLOSE_CODES["session_limit"])
    assert json.loads(err.frame()) == {"error": {"code": "session_limit", "message": "x" * 300, "retry_after_s": 5.0}}
    assert len(err.reason().encode()) <= 123 and err.reason().startswith("session_limit: ")


def test_spec_round_trip_and_refusals():
    assert ObservationSpec.from_dict(SPEC.as_dict()) == SPEC
    with pytest.raises(ValueError, match="dtype"):
        ObservationSpec.from_dict({"x": {"shape": [1], "dtype": "float64"}})
    assert valid_until(100.0, 10, 50.0) == pytest.approx(100.2)
