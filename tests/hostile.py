"""Hostile requests for any route of the gateway or a replica, as Hypothesis strategies, and the properties
every answer keeps: never a 5xx, and an error in the shape of the API it answers (the Open Inference
Protocol's `{"error": "..."}` on the app's /v2 routes, OpenAI's `{"error": {message, type, param, code}}`
everywhere else, unknown routes included). The routes come from the app itself, so a route added later is
fuzzed without a change here; unknown routes are drawn beside them.

Clients that hang up (`hangups`, `hang_up`): at every stage of a request on a raw socket (mid-head, mid-body,
after the body, mid-answer; on the WebSocket mid-head, mid-handshake, mid-frame, after a frame); what they
leave in the server's log must tell of no internal error (`internal_errors`)."""
import json
import re
import socket
from dataclasses import dataclass
from urllib.parse import quote

import httpx
import numpy as np
from hypothesis import strategies as st
from starlette.routing import Route, compile_path

from inferd.protocol.anthropic import PATHS as ANTHROPIC_PATHS
from inferd.protocol.policy import packb, unpackb

KEY_CHARS = st.characters(min_codepoint=0x21, max_codepoint=0x2ff, exclude_characters=[chr(c) for c in range(0x7f, 0xa0)])
PARAM = re.compile(r"\{([a-z_]+)(:[a-z]+)?\}")
TIMEOUT_S = 30.0  # a request not answered (or closed) within this is a hang


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str  # Starlette's template, with {params}
    websocket: bool = False


def endpoints(app) -> list[Endpoint]:
    """Every (method, path) the app routes: HTTP routes by their methods, a WebSocket route as a GET."""
    found = []
    for route in app.routes:
        if isinstance(route, Route):
            found += [Endpoint(m, route.path) for m in sorted((route.methods or {"GET"}) - {"HEAD"})]
        else:
            found.append(Endpoint("GET", route.path, websocket=True))
    return found


# bodies

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def deeply_nested(depth: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


BASES = [  # each route's fields are in one of these
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    {"prompt": "hi", "max_tokens": 1},
    {"input": "hi"},
    {"inputs": [{"name": "input-0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]},
    {"instances": [[1.0, 2.0, 3.0, 4.0]]},
    {"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    {"tenant": "t", "name": "k"},
    {"name": "t2", "rpm": 10},
    {"text": "hi"}, {"tokens": [1, 2, 3]},
]


def near_valid(models: list[str]) -> st.SearchStrategy[dict]:
    """A body one step from a good one: each route's fields are in some of these, then one is given a random
    value, one dropped or a random key added. max_tokens stays 1 so a real server answers fast."""
    bases = st.sampled_from(BASES)

    @st.composite
    def build(draw) -> dict:
        body = dict(draw(bases))
        body["model"] = draw(st.sampled_from(models) | st.text(max_size=10) | json_values)
        how = draw(st.sampled_from(["value", "drop", "add", "keep"]))
        key = draw(st.sampled_from(sorted(body)))
        if how == "value" and key != "max_tokens":
            body[key] = draw(json_values)
        elif how == "drop":
            body.pop(key)
        elif how == "add":
            body[draw(st.text(max_size=12))] = draw(json_values)
        return body
    return build()


def bodies(models: list[str]) -> st.SearchStrategy[bytes | None]:
    encoded = lambda s: s.map(lambda v: json.dumps(v).encode())  # noqa: E731
    return st.one_of(
        st.none(),
        encoded(near_valid(models)), encoded(near_valid(models)), encoded(json_values),
        st.binary(max_size=64),  # not JSON, often not UTF-8
        encoded(near_valid(models)).map(lambda b: b.replace(b'"hi"', b'"\xff\xfe"')),  # invalid UTF-8 in a string
        encoded(near_valid(models)).map(lambda b: b[:max(1, len(b) // 2)]),  # cut short
        st.builds(deeply_nested, st.sampled_from([500, 990, 100_000]), st.sampled_from(["list", "object"])),
        st.sampled_from([b"", b"null", b"[]", b"{}", b"1e999999", b'"x"', b"-0", b"NaN", b'{"a":1,"a":2}']),
        st.sampled_from([2 << 20, 17 << 20]).map(lambda n: b'{"model": "' + b"x" * n + b'"}'),  # huge
    )


# requests

@dataclass(frozen=True)
class Hostile:
    endpoint: Endpoint
    url: str
    headers: dict
    body: bytes | None


ASYNC_VALUES = ["respond-async", "respond-async, wait=5", "http://127.0.0.1:9/h", "http://[::1]:9/h",
                "https://10.1.2.3/h", "ftp://1.1.1.1/x", "http://u:p@1.1.1.1/"]  # async jobs, webhook URLs


unknown_endpoints = st.builds(  # paths no app routes (but by chance), some under known prefixes
    lambda method, prefix, rest: Endpoint(method, prefix + rest), st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
    st.sampled_from(["/", "/v1/", "/v2/", "/v2/models/{name}/", "/v2/health/", "/admin/", "/console/"]),
    st.from_regex(r"[a-z0-9._~/-]{0,12}", fullmatch=True))


def requests(eps: list[Endpoint], models: list[str], good_key: str) -> st.SearchStrategy[Hostile]:
    @st.composite
    def build(draw) -> Hostile:
        known = st.sampled_from(eps)
        ep = draw(st.one_of(known, known, known, unknown_endpoints))  # one in four unknown
        url = PARAM.sub(lambda m: quote(draw(st.sampled_from(models) | st.text(min_size=1, max_size=12)), safe=""),
                        ep.path)
        if draw(st.booleans()):
            url += "?" + "&".join(f"{quote(k)}={quote(v)}" for k, v in draw(
                st.dictionaries(st.sampled_from(["limit", "after", "since", "days", "model", "x"]) | st.text(
                    max_size=5), st.text(max_size=8) | st.integers().map(str), max_size=3)).items())
        key = draw(st.sampled_from([good_key] * 6 + [None, "", "sk-" + "0" * 40]) | st.text(KEY_CHARS, max_size=60))
        headers = {"authorization": f"Bearer {key}".strip().encode()} if key is not None else {}  # UTF-8 too
        headers["content-type"] = draw(st.sampled_from([
            "application/json", "text/plain", "multipart/form-data", "multipart/form-data; boundary=x",
            "application/x-www-form-urlencoded", "application/msgpack"]))
        for name, value in draw(st.dictionaries(st.sampled_from(["x-request-id", "x-inferd-priority",
                                                                 "x-inferd-deadline-ms", "x-stainless-x", "prefer",
                                                                 "x-inferd-webhook-url"]),
                                                st.sampled_from(ASYNC_VALUES) | st.text(st.characters(
                                                    min_codepoint=32, max_codepoint=126), max_size=20),
                                                max_size=2)).items():
            if value.strip():
                headers[name] = value.strip()  # what a client may send: no space at either end
        return Hostile(ep, url, headers, draw(bodies(models)))
    return build()


def send(client: httpx.Client, req: Hostile) -> httpx.Response:
    """client: made with timeout=TIMEOUT_S where it is a real connection."""
    return client.request(req.endpoint.method, req.url, headers=req.headers, content=req.body)


def check_answer(req: Hostile, r: httpx.Response, eps: list[Endpoint], server_errors: tuple[int, ...] = ()) -> None:
    """The properties: no 5xx (but server_errors); an error body in the shape of its API, by the app's routes eps
    (the console's pages have their own)."""
    what = f"{req.endpoint.method} {req.url} -> {r.status_code} {r.text[:300]!r}"
    assert r.status_code < 500 or r.status_code in server_errors, what
    path = r.request.url.path  # as the server sees it: decoded
    if r.status_code < 400 or path.startswith("/console"):
        return
    body = r.json()
    if path in ANTHROPIC_PATHS:  # Anthropic's shape
        assert isinstance(body, dict) and list(body) == ["type", "error"] and body["type"] == "error", what
        assert list(body["error"]) == ["type", "message"] and isinstance(body["error"]["message"], str), what
        return
    assert isinstance(body, dict) and list(body) == ["error"], what
    if any(compile_path(e.path)[0].match(path) for e in eps if e.path.startswith("/v2")):  # the OIP's routes
        assert isinstance(body["error"], str), what
    else:
        assert isinstance(body["error"], dict) and list(body["error"]) == ["message", "type", "param", "code"], what
        assert isinstance(body["error"]["message"], str) and isinstance(body["error"]["type"], str), what


# clients that hang up

HANGUPS = ("mid-head", "mid-body", "after-body", "mid-answer")
WS_HANGUPS = ("mid-head", "mid-handshake", "mid-frame", "after-frame")
STREAMING = [(Endpoint("POST", "/v1/chat/completions"), {"messages": [{"role": "user", "content": "Count to 50."}]}),
             (Endpoint("POST", "/v1/completions"), {"prompt": "1, 2, 3,"})]


@dataclass(frozen=True)
class Hangup:
    request: Hostile
    stage: str  # one of HANGUPS (WS_HANGUPS on a WebSocket route)
    cut: float  # the share of its head, body or frame sent before it leaves


def good_requests(eps: list[Endpoint], models: list[str], good_key: str) -> st.SearchStrategy[Hostile]:
    """Requests that would be served: streams (a client leaves mid-stream) and robot sessions on any model."""
    auth = {"authorization": f"Bearer {good_key}".encode(), "content-type": "application/json"}

    def stream(route: tuple[Endpoint, dict], model: str) -> Hostile:
        body = route[1] | {"model": model, "max_tokens": 64, "stream": True}
        return Hostile(route[0], route[0].path, auth, json.dumps(body).encode())

    def session(ep: Endpoint, model: str) -> Hostile:
        return Hostile(ep, PARAM.sub(quote(model, safe=""), ep.path), auth, None)

    found = st.builds(stream, st.sampled_from(STREAMING), st.sampled_from(models))
    if websockets := [e for e in eps if e.websocket]:
        found |= st.builds(session, st.sampled_from(websockets), st.sampled_from(models))
    return found


def hangups(eps: list[Endpoint], models: list[str], good_key: str) -> st.SearchStrategy[Hangup]:
    reqs = requests(eps, models, good_key) | good_requests(eps, models, good_key)
    return reqs.flatmap(lambda req: st.builds(Hangup, st.just(req), st.sampled_from(
        WS_HANGUPS if req.endpoint.websocket else HANGUPS), st.floats(0, 1)))


def sweep(eps: list[Endpoint], models: list[str], good_key: str) -> list[Hangup]:
    """Every route at every stage, with the key and a body of every route's fields (a route with a parameter once
    per model in it): what hangups leaves to chance."""
    auth = {"authorization": f"Bearer {good_key}", "content-type": "application/json"}
    found = []
    for ep in eps:
        for model in models if PARAM.search(ep.path) else models[:1]:
            body = None if ep.method == "GET" else json.dumps(
                {k: v for base in BASES for k, v in base.items()} | {"model": model}).encode()
            req = Hostile(ep, PARAM.sub(quote(model, safe=""), ep.path), auth, body)
            found += [Hangup(req, stage, 0.5) for stage in (WS_HANGUPS if ep.websocket else HANGUPS)]
    return found


def hang_up(address: tuple[str, int], h: Hangup, source: str = "127.0.0.1") -> None:
    """Sends h's request on a new connection (from the address source) up to its stage, then closes it."""
    req = h.request
    body = req.body or b""
    if req.endpoint.websocket:
        head = _head(req, {"upgrade": "websocket", "connection": "Upgrade", "sec-websocket-version": "13",
                           "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ=="})
    else:
        head = _head(req, {"content-length": str(len(body) + (h.stage == "mid-body")), "connection": "close"})
    with socket.create_connection(address, timeout=TIMEOUT_S, source_address=(source, 0)) as s:
        try:
            _send_until(s, h, head, body)
        except ConnectionError:  # the server closed it first (a refusal before the body, a frame too large)
            pass


def _send_until(s: socket.socket, h: Hangup, head: bytes, body: bytes) -> None:
    if h.stage == "mid-head":
        return s.sendall(head[:int(h.cut * (len(head) - 1))])
    s.sendall(head)
    if h.stage == "mid-body":
        return s.sendall(body[:int(h.cut * len(body))])
    if h.stage == "mid-handshake":
        return
    answer = s.makefile("rb")
    if not h.request.endpoint.websocket:
        s.sendall(body)
        if h.stage == "mid-answer" and b"text/event-stream" in _read_head(answer):
            answer.read(1)  # the stream's first byte
        return
    if _read_head(answer).startswith(b"HTTP/1.1 101"):
        frame = _masked(_observation(_read_frame(answer)))
        s.sendall(frame[:int(h.cut * (len(frame) - 1))] if h.stage == "mid-frame" else frame)


def _head(req: Hostile, extra: dict) -> bytes:
    lines = [f"{req.endpoint.method} {req.url} HTTP/1.1".encode(), b"host: inferd"]
    for name, value in (req.headers | extra).items():
        lines.append(name.encode() + b": " + (value if isinstance(value, bytes) else value.encode()))
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _read_head(answer) -> bytes:
    head = b""
    while (line := answer.readline()) not in (b"\r\n", b""):
        head += line
    return head


def _read_frame(answer) -> tuple[int, bytes]:
    """The server's next frame (unmasked): its opcode and payload; (8, b"") if the connection ends first."""
    head = answer.read(2)
    if len(head) < 2:
        return 8, b""
    size = head[1] & 0x7f
    if size >= 126:
        size = int.from_bytes(answer.read(2 if size == 126 else 8), "big")
    return head[0] & 0x0f, answer.read(size)


def _observation(frame: tuple[int, bytes]) -> bytes:
    """An observation of zeros (a str key empty) after the policy's metadata frame; other bytes after a refusal."""
    opcode, payload = frame
    if opcode != 2:
        return b"\x80"
    spec = unpackb(payload)["observation_spec"]
    return packb({k: "" if v["dtype"] == "str" else np.zeros(v["shape"], v["dtype"]) for k, v in spec.items()})


def _masked(payload: bytes) -> bytes:
    """One binary frame as a client sends it (masked, here with a zero mask)."""
    n = len(payload)
    size = bytes([0x80 | n]) if n < 126 else bytes([0xfe]) + n.to_bytes(2, "big") if n < 1 << 16 \
        else bytes([0xff]) + n.to_bytes(8, "big")
    return b"\x82" + size + b"\0\0\0\0" + payload


def internal_errors(log: str) -> list[str]:
    """The lines of a server's JSON log that tell of an internal error: one at error level or above, an access
    record of internal_error, a line that is not JSON and holds a traceback."""
    found = []
    for line in log.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            record = {"level": "error"} if "Traceback" in line or "ERROR" in line else {}
        if not isinstance(record, dict):
            continue
        if record.get("level") in ("error", "critical") or record.get("error_code") == "internal_error":
            found.append(line[:2000])
    return found
