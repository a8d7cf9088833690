"""Hostile requests for any route of the gateway, as Hypothesis strategies, and the properties every answer
keeps: never a 5xx, and an error in the shape of the API it answers (OpenAI's `{"error": {...}}`, the Open
Inference Protocol's `{"error": "..."}` under /v2). The routes come from the app itself, so a route added
later is fuzzed without a change here."""
import json
import re
from dataclasses import dataclass
from urllib.parse import quote

import httpx
from hypothesis import strategies as st
from starlette.routing import Route

KEY_CHARS = st.characters(min_codepoint=0x21, max_codepoint=0x2ff, exclude_characters=[chr(c) for c in range(0x7f, 0xa0)])
PARAM = re.compile(r"\{([a-z_]+)(:[a-z]+)?\}")
TIMEOUT_S = 30.0  # a request not answered (or closed) within this is a hang


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str  # Starlette's template, with {params}


def endpoints(app) -> list[Endpoint]:
    """Every (method, path) the app routes: HTTP routes by their methods, a WebSocket route as a GET."""
    found = []
    for route in app.routes:
        methods = sorted((route.methods or {"GET"}) - {"HEAD"}) if isinstance(route, Route) else ["GET"]
        found += [Endpoint(m, route.path) for m in methods]
    return found


# bodies

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def deeply_nested(depth: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


def near_valid(models: list[str]) -> st.SearchStrategy[dict]:
    """A body one step from a good one: each route's fields are in some of these, then one is given a random
    value, one dropped or a random key added. max_tokens stays 1 so a real server answers fast."""
    bases = st.sampled_from([
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        {"prompt": "hi", "max_tokens": 1},
        {"input": "hi"},
        {"inputs": [{"name": "input-0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]},
        {"instances": [[1.0, 2.0, 3.0, 4.0]]},
        {"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        {"tenant": "t", "name": "k"},
        {"name": "t2", "rpm": 10},
        {"text": "hi"}, {"tokens": [1, 2, 3]},
    ])

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


def requests(eps: list[Endpoint], models: list[str], good_key: str) -> st.SearchStrategy[Hostile]:
    @st.composite
    def build(draw) -> Hostile:
        ep = draw(st.sampled_from(eps))
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


def check_answer(req: Hostile, r: httpx.Response) -> None:
    """The properties: no 5xx; an error body in the shape of its API (the console's pages have their own)."""
    what = f"{req.endpoint.method} {req.url} -> {r.status_code} {r.text[:300]!r}"
    assert r.status_code < 500, what
    if r.status_code < 400 or req.url.startswith("/console") or r.request.url.path.startswith("/console"):
        return
    body = r.json()
    if r.request.url.path == "/v2" or r.request.url.path.startswith("/v2/"):
        assert isinstance(body, dict) and isinstance(body.get("error"), str), what
    else:
        assert isinstance(body, dict) and isinstance(body.get("error"), dict), what
        assert isinstance(body["error"].get("message"), str) and "type" in body["error"], what
