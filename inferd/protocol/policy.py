"""The robot-policy kind's wire contract: openpi's msgpack frames, the observation spec, control keys, the
error frame and close codes. Gateway and replica both check observations with `check_observation`.

Frames are msgpack with openpi-client's numpy encoding: an array is a map {b"__ndarray__": True, b"data":
bytes, b"dtype": numpy dtype string, b"shape": [...]}, a numpy scalar {b"__npgeneric__": True, b"data",
b"dtype"}. Decoding builds arrays only of plain numeric dtypes whose bytes match their shape (never
objects, never pickle). A session: the server sends the policy's metadata first (binary), then answers
each observation (binary) with an action dict (binary), or with an error as a text frame holding
{"error": {"code", "message"}}: openpi-client raises on a text frame, so the robot's code sees it.
"""
import json
import math
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

DTYPES = ("uint8", "float32", "str")  # what an observation spec may declare
TIMESTAMP_KEY = "inferd.timestamp"  # observation: unix seconds (client clock) when it was taken
DEADLINE_KEY = "inferd.deadline_ms"  # observation: the actions are useless later than this after the timestamp
CONTROL_KEYS = (TIMESTAMP_KEY, DEADLINE_KEY)
MAX_NDIM = 8
MAX_WS_FRAME_BYTES = 64 * 2**20  # the gateway's WebSocket server reads no larger frame (it closes with 1009);
# a deployment's own, smaller max_frame_bytes is answered with a frame_too_large error and the session goes on
WEBSOCKET_PATH = "/v1/policies/{name}/ws"  # the gateway's route of one policy deployment
_NUMERIC_KINDS = "biuf"  # bool, int, uint, float: the only array dtypes a frame may carry


# error frames and close codes

CLOSE_CODES = {  # a session that cannot go on ends with one of these (WebSocket close codes 4000-4999)
    "protocol_error": 4400,  # a text frame, or a frame that is not a msgpack map
    "unauthorized": 4401,  # no key, or a wrong one
    "forbidden": 4403,  # the key may not use this policy
    "model_not_found": 4404,  # no policy of that name
    "idle_timeout": 4408,  # no observation for the deployment's idle timeout
    "session_limit": 4429,  # the tenant's or the deployment's sessions are all taken; the reason says when to retry
    "too_many_failed_authentications": 4429,  # this address sent wrong keys too often; the reason says when to retry
    "unavailable": 4503,  # no replica of the policy can serve
}


class PolicyError(Exception):
    """An error a session's client is told of: a text frame {"error": {...}}; `close` ends the session with
    that code (CLOSE_CODES), else the session goes on."""

    def __init__(self, code: str, message: str, *, retry_after_s: float | None = None, close: int | None = None):
        super().__init__(message)
        self.code, self.message, self.retry_after_s, self.close = code, message, retry_after_s, close

    def frame(self) -> str:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.retry_after_s is not None:
            error["retry_after_s"] = self.retry_after_s
        return json.dumps({"error": error})

    def reason(self) -> str:
        """The close frame's reason (at most 123 bytes)."""
        return f"{self.code}: {self.message}".encode()[:123].decode(errors="ignore")


def invalid(message: str) -> PolicyError:
    return PolicyError("invalid_observation", message)


# the codec

def _encode(obj):
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in _NUMERIC_KINDS:
            raise TypeError(f"cannot send an array of dtype {obj.dtype}")
        return {b"__ndarray__": True, b"data": np.ascontiguousarray(obj).tobytes(), b"dtype": obj.dtype.str,
                b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot send {type(obj).__name__}")


def _decode(obj: dict):
    if b"__ndarray__" in obj:
        dtype, shape, data = _dtype(obj.get(b"dtype")), obj.get(b"shape"), obj.get(b"data")
        if (not isinstance(shape, list | tuple) or len(shape) > MAX_NDIM
                or not all(isinstance(n, int) and n >= 0 for n in shape)):
            raise invalid("An array's shape must be a list of at most 8 non-negative integers.")
        if not isinstance(data, bytes) or len(data) != math.prod(shape) * dtype.itemsize:
            raise invalid(f"An array of shape {list(shape)} and dtype {dtype} needs "
                          f"{math.prod(shape) * dtype.itemsize} bytes of data.")
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    if b"__npgeneric__" in obj:
        value = obj.get(b"data")
        if not isinstance(value, bool | int | float):
            raise invalid("A numpy scalar must hold a number.")
        return _dtype(obj.get(b"dtype")).type(value)
    return obj


def _dtype(raw) -> np.dtype:
    try:
        dtype = np.dtype(raw) if isinstance(raw, str) and len(raw) <= 8 else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in _NUMERIC_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise invalid(f"Arrays must have a plain numeric dtype (bool, int, uint, float); got {raw!r}.")
    return dtype


def packb(obj) -> bytes:
    return msgpack.packb(obj, default=_encode)


def unpackb(frame: bytes):
    """A frame's object; PolicyError(invalid_observation) for anything malformed."""
    try:
        return msgpack.unpackb(frame, object_hook=_decode, strict_map_key=False)
    except PolicyError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise invalid(f"The frame is not valid msgpack: {exc}.") from None


# the observation spec

@dataclass(slots=True, frozen=True)
class ObservationKey:
    name: str
    dtype: str  # one of DTYPES
    shape: tuple[int, ...] = ()  # for arrays

    def as_dict(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype}


@dataclass(slots=True, frozen=True)
class ObservationSpec:
    keys: tuple[ObservationKey, ...]

    @classmethod
    def from_dict(cls, raw: dict) -> "ObservationSpec":
        """{key: {"shape": [...], "dtype": ...}}, as policy metadata has it; ValueError naming what is wrong."""
        if not isinstance(raw, dict) or not raw:
            raise ValueError("observation_spec must map at least one key to {shape, dtype}")
        keys = []
        for name, entry in raw.items():
            dtype, shape = (entry or {}).get("dtype"), (entry or {}).get("shape", [])
            if dtype not in DTYPES:
                raise ValueError(f"observation_spec[{name!r}].dtype must be one of {', '.join(DTYPES)}")
            if not isinstance(shape, list) or not all(isinstance(n, int) and n > 0 for n in shape):
                raise ValueError(f"observation_spec[{name!r}].shape must be a list of positive integers")
            keys.append(ObservationKey(name, dtype, tuple(shape)))
        return cls(tuple(keys))

    def as_dict(self) -> dict:
        return {k.name: k.as_dict() for k in self.keys}


@dataclass(slots=True)
class Observation:
    values: dict[str, Any]  # exactly the spec's keys: arrays of the declared dtype and shape, or str
    timestamp_unix_s: float | None = None
    deadline_ms: float | None = None


def check_observation(spec: ObservationSpec, obs: Any) -> Observation:
    """The observation the policy reads, or PolicyError(invalid_observation) naming the key. Arrays must have
    the declared shape; uint8 keys take uint8 arrays only, float32 keys any finite numbers (cast); keys the
    spec does not name are ignored."""
    if not isinstance(obs, dict):
        raise invalid("An observation must be a map of keys to values.")
    values = {}
    for key in spec.keys:
        if key.name not in obs:
            raise invalid(f"The observation has no '{key.name}' (this policy reads: "
                          f"{', '.join(k.name for k in spec.keys)}).")
        values[key.name] = _value(key, obs[key.name])
    return Observation(values, _number(obs, TIMESTAMP_KEY), _number(obs, DEADLINE_KEY, positive=True))


def _value(key: ObservationKey, value: Any):
    if key.dtype == "str":
        if not isinstance(value, str):
            raise invalid(f"'{key.name}' must be a string.")
        return value
    if isinstance(value, list):
        try:
            value = np.asarray(value)
        except ValueError:
            raise invalid(f"'{key.name}' is a ragged list; send an array of shape {list(key.shape)}.") from None
    if not isinstance(value, np.ndarray):
        raise invalid(f"'{key.name}' must be an array of shape {list(key.shape)} ({key.dtype}).")
    if value.shape != key.shape:
        raise invalid(f"'{key.name}' has shape {list(value.shape)}; this policy needs {list(key.shape)}.")
    if key.dtype == "uint8":
        if value.dtype != np.uint8:
            raise invalid(f"'{key.name}' has dtype {value.dtype}; this policy needs uint8.")
        return value
    if value.dtype.kind not in "iuf":
        raise invalid(f"'{key.name}' has dtype {value.dtype}; this policy needs numbers (float32).")
    out = value.astype(np.float32)
    if not np.isfinite(out).all():
        raise invalid(f"'{key.name}' holds NaN or infinity.")
    return out


def _number(obs: dict, key: str, positive: bool = False) -> float | None:
    value = obs.get(key)
    if value is None:
        return None
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or (positive and value <= 0):
        raise invalid(f"'{key}' must be a {'positive ' if positive else ''}number.")
    return float(value)


def websocket_path(name: str) -> str:
    return WEBSOCKET_PATH.format(name=name)


def valid_until(timestamp_unix_s: float, horizon: int, control_hz: float) -> float:
    """Until when a chunk of `horizon` actions taken from an observation at timestamp is still to be played."""
    return timestamp_unix_s + horizon / control_hz
