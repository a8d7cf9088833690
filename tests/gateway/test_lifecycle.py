"""A request's life in the gateway, in process: replicas are httpx.MockTransport handlers, so attempts,
retries, fallbacks, streams, cancellation and usage records are checked in milliseconds."""
import asyncio
import gc
import json
import types
from collections import Counter
from collections.abc import Awaitable, Callable

import httpx
import pytest
from starlette.testclient import TestClient

from inferd.gateway.admission import AdmissionQueue, QueueConfig
from inferd.gateway.app import Gateway, build_gateway_app
from inferd.gateway.config import GatewayConfig, ModelPrice
from inferd.gateway.deployments import Deployment, Deployments, TextModel, Upstream
from inferd.gateway.limits import MemoryLimiter
from inferd.gateway.store import Store
from inferd.protocol import headers
from inferd.protocol.http import whole_body

CHAT = {"messages": [{"role": "user", "content": "one two three"}], "max_tokens": 4}


class WordTokenizer:
    vocab_size = 1000
    bos_token = eos_token = chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join("x" * i for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        return b"x" * token_id

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return " ".join(m["content"] for m in messages)


def usage(prompt: int, completion: int, cached: int = 0) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion_body(text: str = "hi there") -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": usage(3, 2)}


def sse(*events: bytes) -> bytes:
    return b"".join(e + b"\n\n" for e in events)


class Replicas:
    """The mock transport's handler: each base URL answers as its function says; every request is kept."""

    def __init__(self, **behaviour):
        self.behaviour = behaviour
        self.requests: list[httpx.Request] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/ready", "/v1/models", "/metrics"):
            return httpx.Response(200, json={"status": "ready"})
        self.requests.append(request)
        return await self.behaviour[request.url.host](request)


def make_gateway(tmp_path, replicas: Replicas, deployments: list[Deployment], **config) -> tuple[Gateway, str]:
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    store.migrate()
    store.create_tenant("t")
    _, new = store.create_key("t")
    config = GatewayConfig(db_url=store.url, usage_journal=tmp_path / "usage.journal", **config)
    ds = Deployments()
    for d in deployments:
        ds.add(d)
    return Gateway(config, store, MemoryLimiter(), ds, transport=httpx.MockTransport(replicas)), new.key


def deployment(name: str, *hosts: str, fallbacks=(), ours: bool = True, inflight: int = 8) -> Deployment:
    return Deployment(name, TextModel(WordTokenizer(), 64), [Upstream(f"http://{h}:9", name=h) for h in hosts],
                      AdmissionQueue(QueueConfig(max_inflight=inflight)), internal_headers=ours,
                      fallbacks=list(fallbacks))


def run(gateway: Gateway, key: str, body: dict = CHAT, **kw) -> tuple[httpx.Response, list]:
    records = []
    gateway.observers.append(records.append)
    with TestClient(build_gateway_app(gateway)) as client:
        r = client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"} | kw)
    return r, records


async def ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json=completion_body())


async def refused(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


async def broken(request: httpx.Request) -> httpx.Response:
    return httpx.Response(500, json={"error": {"message": "boom", "type": "server_error", "code": "oops"}})


def test_a_request_is_planned_sent_with_internal_headers_and_recorded(tmp_path):
    replicas = Replicas(a=ok)
    gw, key = make_gateway(tmp_path, replicas, [deployment("m", "a")], prices={"m": ModelPrice(1e6, 0, 2e6)})
    r, records = run(gw, key)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hi there"
    sent = replicas.requests[0]
    assert json.loads(sent.content)["model"] == "m"
    assert sent.headers[headers.CACHE_NAMESPACE] == records[0].tenant_id
    assert sent.headers[headers.PRIORITY] == "interactive" and headers.DEADLINE_MS not in sent.headers
    [rec] = records
    assert (rec.status, rec.attempt, rec.prompt_tokens, rec.completion_tokens) == ("completed", 1, 3, 2)
    assert rec.cost_usd == pytest.approx(3 * 1 + 2 * 2) and rec.replica == "a" and rec.ttft_s is not None
    assert gw.deployments.get("m").queue.inflight == 0 and gw.deployments.get("m").upstreams[0].inflight == 0


def test_an_unreachable_replica_is_followed_by_another_with_a_record_each(tmp_path):
    gw, key = make_gateway(tmp_path, Replicas(a=refused, b=ok), [deployment("m", "a", "b")])
    gw.deployments.get("m").router.config.policy = "round_robin"
    r, records = run(gw, key)
    assert r.status_code == 200
    assert [(x.attempt, x.status, x.replica, x.completion_tokens) for x in records] == [
        (1, "failed", "a", 0), (2, "completed", "b", 2)]
    assert records[0].error_code == "upstream_unavailable"
    assert not gw.deployments.get("m").upstreams[0].healthy
    assert all(u.inflight == 0 for u in gw.deployments.get("m").upstreams)


async def reset(request: httpx.Request) -> httpx.Response:
    raise httpx.RemoteProtocolError("the server closed the connection before the response ended", request=request)


def test_a_replica_whose_connection_breaks_before_the_head_is_followed_by_another(tmp_path):
    gw, key = make_gateway(tmp_path, Replicas(a=reset, b=ok), [deployment("m", "a", "b")])
    gw.deployments.get("m").router.config.policy = "round_robin"
    r, records = run(gw, key)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hi there"
    assert [(x.attempt, x.status, x.replica, x.error_code) for x in records] == [
        (1, "failed", "a", "upstream_unavailable"), (2, "completed", "b", None)]
    assert gw.deployments.get("m").upstreams[0].healthy  # it may be alive (a stale connection): the probe says
    assert all(u.inflight == 0 for u in gw.deployments.get("m").upstreams) and gw.deployments.get("m").queue.inflight == 0


def test_a_read_timeout_is_not_sent_to_another_replica(tmp_path):
    async def slow(request):
        raise httpx.ReadTimeout("the upstream did not answer within the read timeout", request=request)

    gw, key = make_gateway(tmp_path, Replicas(a=slow, b=ok), [deployment("m", "a", "b")])
    gw.deployments.get("m").router.config.policy = "round_robin"
    r, records = run(gw, key)
    assert r.status_code == 503 and [(x.replica, x.status) for x in records] == [("a", "failed")]


def test_no_replica_reachable_is_a_503_and_nothing_is_billed(tmp_path):
    gw, key = make_gateway(tmp_path, Replicas(a=refused), [deployment("m", "a")])
    r, records = run(gw, key)
    assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable"
    assert [(x.status, x.http_status, x.cost_usd) for x in records] == [("failed", 503, 0.0)]


def test_a_failing_deployment_falls_back_once_and_says_so(tmp_path):
    gw, key = make_gateway(tmp_path, Replicas(a=broken, b=ok), [deployment("m", "a", fallbacks=["small"]),
                                                               deployment("small", "b")])
    r, records = run(gw, key)
    assert r.status_code == 200 and r.headers[headers.FALLBACK] == "m->small"
    assert [(x.attempt, x.model, x.status, x.http_status) for x in records] == [
        (1, "m", "failed", 500), (2, "small", "completed", 200)]
    assert all(d.queue.inflight == 0 for d in gw.deployments.every())


def test_a_5xx_without_fallbacks_reaches_the_client_as_is(tmp_path):
    gw, key = make_gateway(tmp_path, Replicas(a=broken), [deployment("m", "a")])
    r, records = run(gw, key)
    assert r.status_code == 500 and r.json()["error"]["code"] == "oops"
    assert [(x.status, x.error_code) for x in records] == [("failed", "oops")]


def test_a_stream_from_our_replica_passes_through_and_bills_its_usage_comments(tmp_path):
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}'
    body = sse(chunk, headers.USAGE_PREFIX + json.dumps(usage(3, 1)).encode(), chunk,
               headers.USAGE_PREFIX + json.dumps(usage(3, 2)).encode(), b"data: [DONE]")

    async def stream(request):
        assert request.headers[headers.USAGE_EVENTS] == "1"
        return httpx.Response(200, stream=httpx.ByteStream(body), headers={"content-type": "text/event-stream"})

    gw, key = make_gateway(tmp_path, Replicas(a=stream), [deployment("m", "a")])
    r, records = run(gw, key, CHAT | {"stream": True})
    assert r.status_code == 200 and r.content == sse(chunk, chunk, b"data: [DONE]")
    assert [(x.status, x.prompt_tokens, x.completion_tokens) for x in records] == [("completed", 3, 2)]


def test_an_external_stream_is_asked_for_usage_which_the_client_did_not_ask_for(tmp_path):
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}'
    last = b'data: {"choices":[],"usage":' + json.dumps(usage(3, 1)).encode() + b"}"

    async def stream(request):
        assert json.loads(request.content)["stream_options"] == {"include_usage": True}
        assert headers.CACHE_NAMESPACE not in request.headers
        return httpx.Response(200, stream=httpx.ByteStream(sse(chunk, last, b"data: [DONE]")))

    gw, key = make_gateway(tmp_path, Replicas(a=stream), [deployment("m", "a", ours=False)])
    r, records = run(gw, key, CHAT | {"stream": True})
    assert r.content == sse(chunk, b"data: [DONE]")
    assert [(x.status, x.completion_tokens, x.ttft_s is not None) for x in records] == [("completed", 1, True)]


def test_an_external_stream_that_says_no_usage_is_billed_a_token_per_chunk_of_text(tmp_path):
    head = b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    role, text = head + b'"delta":{"role":"assistant"}}]}', head + b'"delta":{"content":"hi"}}]}'
    end = head + b'"delta":{},"finish_reason":"length"}]}'

    async def stream(request):  # as llama.cpp's server streams: no usage, whatever was asked
        return httpx.Response(200, stream=httpx.ByteStream(sse(role, text, text, text, end, b"data: [DONE]")))

    gw, key = make_gateway(tmp_path, Replicas(a=stream), [deployment("m", "a", ours=False)])
    r, records = run(gw, key, CHAT | {"stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(e[6:]) for e in r.content.decode().split("\n\n") if e.startswith("data: {")]
    [record] = records
    assert (record.status, record.completion_tokens) == ("completed", 3) and record.prompt_tokens > 0
    assert events[-1] == {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                          "usage": {"prompt_tokens": record.prompt_tokens, "completion_tokens": 3,
                                    "total_tokens": record.prompt_tokens + 3}}
    (tmp_path / "again").mkdir()
    gw, key = make_gateway(tmp_path / "again", Replicas(a=stream), [deployment("m", "a", ours=False)])
    r, records = run(gw, key, CHAT | {"stream": True})  # not asked for: counted all the same, not sent
    assert b'"usage"' not in r.content and [x.completion_tokens for x in records] == [3]


def test_a_stream_the_replica_breaks_ends_with_an_error_event(tmp_path):
    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield sse(b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}',
                      headers.USAGE_PREFIX + json.dumps(usage(3, 1)).encode())
            raise httpx.ReadError("reset")

    async def stream(request):
        return httpx.Response(200, stream=Broken())

    gw, key = make_gateway(tmp_path, Replicas(a=stream), [deployment("m", "a")])
    r, records = run(gw, key, CHAT | {"stream": True})
    assert b'"code":"upstream_unavailable"' in r.content and r.content.endswith(b"data: [DONE]\n\n")
    assert [(x.status, x.error_code, x.completion_tokens) for x in records] == [("failed", "upstream_unavailable", 0)]


def test_refusals_are_recorded_before_any_work(tmp_path):
    replicas = Replicas(a=ok)
    gw, key = make_gateway(tmp_path, replicas, [deployment("m", "a")])
    r, records = run(gw, key, CHAT, **{headers.DEADLINE_MS: "soon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == headers.DEADLINE_MS
    assert [(x.model, x.status, x.http_status) for x in records] == [("m", "rejected", 400)]  # the one it gets
    assert not replicas.requests


def test_a_request_waiting_past_its_deadline_expires_without_reaching_a_replica(tmp_path):
    async def slow(request):
        await asyncio.sleep(1.0)
        return httpx.Response(200, json=completion_body())

    replicas = Replicas(a=slow)
    gw, key = make_gateway(tmp_path, replicas, [deployment("m", "a", inflight=1)])
    records = []
    gw.observers.append(records.append)
    auth = {"authorization": f"Bearer {key}"}
    with TestClient(build_gateway_app(gw)) as client:
        async def both():
            first = asyncio.ensure_future(asyncio.to_thread(client.post, "/v1/chat/completions", json=CHAT,
                                                            headers=auth))
            while not replicas.requests:  # the first holds the only slot (a fixed sleep lost that race when busy)
                await asyncio.sleep(0.01)
            second = asyncio.to_thread(client.post, "/v1/chat/completions", json=CHAT,
                                       headers=auth | {headers.DEADLINE_MS: "200"})
            return await asyncio.gather(first, second)
        r1, r2 = asyncio.run(both())
    assert (r1.status_code, r2.status_code) == (200, 504) and r2.json()["error"]["code"] == "deadline_exceeded"
    assert sorted(x.status for x in records) == ["completed", "expired"] and len(replicas.requests) == 1


class CountingTokenizer(WordTokenizer):
    def __init__(self):
        self.templated = 0

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        self.templated += 1
        return super().apply_chat_template(messages, add_generation_prompt)


async def test_a_full_queue_refuses_before_the_prompt_is_tokenized(tmp_path):
    release = asyncio.Event()

    async def slow(request: httpx.Request) -> httpx.Response:
        await release.wait()
        return httpx.Response(200, json=completion_body())

    tokenizer = CountingTokenizer()
    d = Deployment("m", TextModel(tokenizer, 64), [Upstream("http://a:9", name="a")],
                   AdmissionQueue(QueueConfig(max_inflight=1, max_queue_len=1)), internal_headers=True)
    gw, key = make_gateway(tmp_path, Replicas(a=slow), [d])
    records = []
    gw.observers.append(records.append)
    await gw.start()
    app = build_gateway_app(gw)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        def post():
            return asyncio.create_task(client.post("/v1/chat/completions", json=CHAT,
                                                   headers={"authorization": f"Bearer {key}"}))
        running = post()
        while d.queue.inflight < 1:
            await asyncio.sleep(0.001)
        waiting = post()
        while d.queue.length < 1:
            await asyncio.sleep(0.001)
        refused = await post()
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full"
        assert refused.headers["retry-after"] == "1" and tokenizer.templated == 2  # the third was never planned
        assert (records[0].model, records[0].status, records[0].http_status) == ("m", "rejected", 503)
        auth = {"authorization": f"Bearer {key}"}  # a body is validated only once it may wait, unless its
        invalid = await client.post("/v1/chat/completions", json={"model": "m", "messages": "?"}, headers=auth)
        unnamed = await client.post("/v1/chat/completions", json={"model": 7, "messages": "?"}, headers=auth)
        assert invalid.status_code == 503 and unnamed.status_code == 400  # model is not a string
        release.set()
        assert (await running).status_code == 200 and (await waiting).status_code == 200
    await gw.close()
    assert d.queue.inflight == 0 and d.queue.length == 0 and len(records) == 5


def asgi_post(app, path: str, key: str, body: bytes) -> tuple[Callable[[], Awaitable[None]], Counter]:
    """A raw ASGI POST of body to path with key, as a call to make again and again (no socket, no HTTP parser), and
    the response statuses it has seen."""
    head = [(b"host", b"x"), (b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode())]
    statuses: Counter = Counter()

    async def one() -> None:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": head, "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                statuses[message["status"]] += 1
        await app(scope, whole_body(body), send)
    return one, statuses


async def _stream(request: httpx.Request) -> httpx.Response:
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}'
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=httpx.ByteStream(
        sse(chunk, headers.USAGE_PREFIX + json.dumps(usage(3, 1)).encode(), b"data: [DONE]")))


@pytest.mark.parametrize("case", ["refused", "answered", "streamed", "invalid"])
async def test_a_request_leaves_no_reference_cycles(tmp_path, case):
    """A request's objects go when it ends, by reference counting. A refusal used to leave a cycle (its error's
    traceback holds the frames that held the error), and a burst's cycles made the collector stop the event
    loop for milliseconds in the middle of the burst."""
    d = deployment("m", "a")
    if case == "refused":
        d.queue.config.max_queue_len = 0  # every request: 503 queue_full
    gw, key = make_gateway(tmp_path, Replicas(a=_stream if case == "streamed" else ok), [d])
    app = build_gateway_app(gw)
    body = json.dumps({"model": "m", "messages": "not a list"} if case == "invalid" else
                      CHAT | {"model": "m", "stream": case == "streamed"}).encode()
    one, statuses = asgi_post(app, "/v1/chat/completions", key, body)

    await gw.start()
    try:
        for _ in range(5):
            await one()  # warm: first-use caches
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(20):
                await one()
            gc.collect()
            ours = [o for o in gc.garbage if isinstance(o, types.FrameType) and "/inferd/" in o.f_code.co_filename]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    finally:
        await gw.close()
    assert set(statuses) == {{"refused": 503, "invalid": 400}.get(case, 200)}
    assert [f.f_code.co_name for f in ours] == []


def test_the_serving_routes_answer_other_methods_405_in_the_error_shape(tmp_path):
    gw, key = make_gateway(tmp_path, Replicas(a=ok), [deployment("m", "a")])
    with TestClient(build_gateway_app(gw)) as client:
        r = client.get("/v1/chat/completions", headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
        assert client.post("/v1/chat/completions/extra", json=CHAT).status_code == 404
