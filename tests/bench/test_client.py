"""The streaming client against scripted responses: timing, usage, and every kind of failure kept apart."""
import asyncio
import json

import httpx
import pytest

from inferd.bench.client import Endpoint, RequestRecord, send
from inferd.bench.workloads import BenchRequest


def sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def chat_chunk(content: str | None, finish: str | None = None) -> dict:
    delta = {} if content is None else {"content": content}
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}}


def run(handler, api: str = "chat", cancel_after: int | None = None, timeout_s: float = 5.0) -> RequestRecord:
    seen = []

    def recording(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return handler(request)

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(recording)) as client:
            endpoint = Endpoint("http://x/v1", "m", api, api_key="k", timeout_s=timeout_s)
            request = BenchRequest(0, "hi", 10, 4, cancel_after_chunks=cancel_after)
            return await send(client, endpoint, request, RequestRecord(0, 0.0, 10), 0.0)
    record = asyncio.run(go())
    body = json.loads(seen[0].content)
    assert seen[0].headers["authorization"] == "Bearer k" and body["ignore_eos"] and body["stream"]
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 4
    return record


def stream(*events) -> callable:
    return lambda request: httpx.Response(200, content=sse(*events), headers={"content-type": "text/event-stream"})


def test_chat_stream_with_usage():
    r = run(stream(chat_chunk(""), chat_chunk("Hel"), chat_chunk("lo", None), chat_chunk(" you", "length"),
                   USAGE, b"[DONE]"))
    assert r.outcome == "completed" and r.finish_reason == "length" and r.usage_seen
    assert len(r.chunk_s) == 3 and r.output_tokens == 4 and r.input_tokens == 11  # usage wins over chunks
    assert r.done_s >= r.chunk_s[-1] >= r.chunk_s[0] > 0 and r.status == 200


def test_completions_stream_without_usage_counts_chunks():
    chunk = lambda t, f=None: {"choices": [{"index": 0, "text": t, "finish_reason": f}]}  # noqa: E731
    r = run(stream(chunk("a"), chunk("b"), chunk("c", "stop"), b"[DONE]"), api="completions")
    assert r.outcome == "completed" and r.output_tokens == 3 and not r.usage_seen and r.finish_reason == "stop"


def test_a_stream_is_split_into_lines_as_sse_says_not_as_str_splitlines():
    # another server's JSON with U+2028 / U+0085 unescaped (httpx's aiter_lines cut such an event: malformed_event),
    # events ended by CR LF and by CR, and the body arriving in pieces that cut a CR LF and a UTF-8 character
    text = "a\u2028b\x85c é"
    body = (b"data: " + json.dumps(chat_chunk(text), ensure_ascii=False).encode() + b"\r\n\r\n"
            + sse(chat_chunk("d", "stop")).replace(b"\n", b"\r") + sse(USAGE, b"[DONE]"))
    cuts = [body.index(b"\xc3") + 1, body.index(b"\r\n") + 1, len(body)]
    pieces = [body[a:b] for a, b in zip([0, *cuts], cuts)]

    async def content():
        for piece in pieces:
            yield piece
    r = run(lambda request: httpx.Response(200, content=content(), headers={"content-type": "text/event-stream"}))
    assert r.outcome == "completed" and r.reply == [text, "d"] and r.finish_reason == "stop" and r.usage_seen


def test_cancel_after_chunks():
    r = run(stream(*[chat_chunk("x")] * 4, b"[DONE]"), cancel_after=2)
    assert r.outcome == "cancelled" and len(r.chunk_s) == 2


@pytest.mark.parametrize("status,headers,outcome,retry_after", [
    (429, {"retry-after": "2"}, "rejected", "2"), (503, {}, "rejected", None), (500, {}, "failed", None)])
def test_refusals(status, headers, outcome, retry_after):
    body = {"error": {"message": "no", "type": "server_error", "code": "overloaded"}}
    r = run(lambda request: httpx.Response(status, json=body, headers=headers))
    assert (r.outcome, r.status, r.retry_after) == (outcome, status, retry_after)
    assert r.error_type == (None if outcome == "rejected" else "overloaded") and not r.chunk_s


def test_error_in_stream_and_incomplete_stream():
    r = run(stream(chat_chunk("a"), {"error": {"type": "server_error", "code": None}}, b"[DONE]"))
    assert (r.outcome, r.error_type) == ("failed", "server_error")
    r = run(stream(chat_chunk("a")))
    assert (r.outcome, r.error_type) == ("failed", "incomplete_stream")
    r = run(stream(b"{broken"))
    assert (r.outcome, r.error_type) == ("failed", "malformed_event")


def test_transport_error_and_timeout():
    def refuse(request):
        raise httpx.ConnectError("refused")

    def slow(request):
        raise httpx.ReadTimeout("slow")
    assert (run(refuse).outcome, run(refuse).error_type) == ("failed", "ConnectError")
    assert run(slow).outcome == "timed_out"
