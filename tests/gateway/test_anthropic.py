"""Anthropic's Messages API at the gateway, in process, with the official anthropic client over the gateway's app
and mock replicas (tests/gateway/test_lifecycle.py's): what the replica is sent, the answer and the stream
translated back, errors in Anthropic's shape and statuses (a full queue is its 529), and one usage record of the
same tokens and price as the same conversation sent as a chat completion. The real server: test_anthropic_e2e.py."""
import asyncio
import json
import threading
import time

import anthropic
import httpx
import pytest
from starlette.testclient import TestClient

from inferd.gateway.app import build_gateway_app
from inferd.protocol import headers
from inferd.protocol.anthropic import MessagesAnswer, MessagesRequest
from tests.gateway.test_lifecycle import Replicas, deployment, make_gateway, sse, usage

ASK = [{"role": "user", "content": "one two three"}]
CALL = {"id": "call_7", "type": "function", "function": {"name": "clock", "arguments": '{"zone": 2}'}}
CLOCK = {"name": "clock", "description": "The time", "input_schema": {
    "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}}


def chat_answer(message: dict, finish: str = "stop") -> dict:
    return {"id": "chatcmpl-req_1", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant"} | message, "finish_reason": finish}],
            "usage": usage(5, 3, cached=2)}


def chunk(delta: dict, finish: str | None = None) -> bytes:
    return b"data: " + json.dumps({"id": "chatcmpl-req_2", "object": "chat.completion.chunk", "model": "m",
                                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}).encode()


def serving(tmp_path, answer, **queue):
    replicas = Replicas(a=answer)
    gw, key = make_gateway(tmp_path, replicas, [deployment("m", "a", **queue)])
    records = []
    gw.observers.append(records.append)
    return gw, key, replicas, records


def client_of(http: TestClient, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url="http://testserver", api_key=key, http_client=http, max_retries=0)


def test_a_message_is_sent_as_its_chat_completion_and_answered_as_a_message(tmp_path):
    async def answer(request):
        return httpx.Response(200, json=chat_answer({"content": "hi", "tool_calls": [CALL]}, "tool_calls"))
    gw, key, replicas, records = serving(tmp_path, answer)
    with TestClient(build_gateway_app(gw)) as http:
        m = client_of(http, key).messages.create(
            model="m", max_tokens=9, system="be brief", stop_sequences=["END"],
            extra_body={"temperature": 0.5, "top_k": 4},
            tools=[CLOCK], tool_choice={"type": "tool", "name": "clock", "disable_parallel_tool_use": True},
            metadata={"user_id": "u1"}, messages=ASK + [
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "t1", "name": "clock", "input": {"zone": 1}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "12:00"},
                                             {"type": "text", "text": "and now?"}]}])
    sent = json.loads(replicas.requests[0].content)
    assert replicas.requests[0].url.path == "/v1/chat/completions"
    assert sent["messages"] == [
        {"role": "system", "content": "be brief"}, *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "clock", "arguments": '{"zone": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "12:00"}, {"role": "user", "content": "and now?"}]
    assert (sent["max_tokens"], sent["temperature"], sent["stop"], sent["top_k"], sent["user"]) == (
        9, 0.5, ["END"], 4, "u1")
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "clock"}}
    assert sent["parallel_tool_calls"] is False and sent["tools"][0]["function"]["parameters"] == CLOCK["input_schema"]
    assert m.id == "msg_req_1" and m.stop_reason == "tool_use" and m.role == "assistant"
    assert [b.type for b in m.content] == ["text", "tool_use"] and m.content[0].text == "hi"
    assert (m.content[1].id, m.content[1].name, m.content[1].input) == ("call_7", "clock", {"zone": 2})
    assert (m.usage.input_tokens, m.usage.cache_read_input_tokens, m.usage.output_tokens) == (3, 2, 3)
    assert [(r.status, r.prompt_tokens, r.completion_tokens) for r in records] == [("completed", 5, 3)]


def test_the_stream_is_anthropics_event_sequence(tmp_path):
    async def answer(request):
        body = sse(chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}), chunk({"content": "lo"}),
                   chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                          "function": {"name": "clock", "arguments": ""}}]}),
                   chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"zone"'}}]}),
                   chunk({"tool_calls": [{"index": 0, "function": {"arguments": ': 3}'}}]}),
                   chunk({}, "tool_calls"), headers.USAGE_PREFIX + json.dumps(usage(5, 6)).encode(),
                   b'data: {"id":"chatcmpl-req_2","choices":[],"usage":' + json.dumps(usage(5, 6)).encode() + b"}",
                   b"data: [DONE]")
        return httpx.Response(200, stream=httpx.ByteStream(body), headers={"content-type": "text/event-stream"})
    gw, key, _, records = serving(tmp_path, answer)
    with TestClient(build_gateway_app(gw)) as http:
        with client_of(http, key).messages.stream(model="m", max_tokens=8, messages=ASK, tools=[CLOCK]) as stream:
            kinds = [event.type for event in stream if event.type not in ("text", "input_json")]
            final = stream.current_message_snapshot
    assert kinds == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == "Hello" and final.content[1].input == {"zone": 3}
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == 6 and final.usage.input_tokens > 0
    assert [(r.status, r.completion_tokens) for r in records] == [("completed", 6)]


def test_a_full_queue_is_529_and_errors_take_anthropics_shape(tmp_path):
    release, held = threading.Event(), []

    async def answer(request):
        await asyncio.to_thread(release.wait, 30)
        return httpx.Response(200, json=chat_answer({"content": "x"}))
    gw, key, _, _ = serving(tmp_path, answer, inflight=1)
    queue = gw.deployments.get("m").queue
    with TestClient(build_gateway_app(gw)) as http:
        client = client_of(http, key)
        busy = threading.Thread(target=lambda: held.append(client.messages.create(model="m", max_tokens=2,
                                                                                  messages=ASK)))
        busy.start()
        deadline = time.monotonic() + 30
        while queue.inflight < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        room, queue.config.max_queue_len = queue.config.max_queue_len, 0  # its one slot held, no room to wait
        with pytest.raises(anthropic.OverloadedError) as e:
            client.messages.create(model="m", max_tokens=2, messages=ASK)
        release.set()
        busy.join()
        assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"
        assert int(e.value.response.headers["retry-after"]) >= 1
        with pytest.raises(anthropic.AuthenticationError) as e:
            client_of(http, "sk-wrong").messages.create(model="m", max_tokens=2, messages=ASK)
        assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                           "message": "Incorrect API key provided."}}
        with pytest.raises(anthropic.NotFoundError):
            client.messages.create(model="nope", max_tokens=2, messages=ASK)
        queue.config.max_queue_len = room  # (a request refused for capacity is refused before its body is checked)
        r = http.post("/v1/messages", json={"model": "m", "messages": ASK}, headers={"x-api-key": key})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in r.json()["error"]["message"]
        r = http.post("/v1/messages", json={"model": "m", "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {}}]}]}, headers={"x-api-key": key})
        assert r.status_code == 400 and r.json()["type"] == "error"
        r = http.get("/v1/messages", headers={"x-api-key": key})
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert len(held) == 1 and held[0].content[0].text == "x"


def test_a_replicas_error_answer_is_in_anthropics_shape(tmp_path):
    async def answer(request):
        return httpx.Response(400, json={"error": {"message": "bad stop", "type": "invalid_request_error",
                                                   "param": "stop", "code": None}})
    gw, key, _, records = serving(tmp_path, answer)
    with TestClient(build_gateway_app(gw)) as http:
        with pytest.raises(anthropic.BadRequestError) as e:
            client_of(http, key).messages.create(model="m", max_tokens=2, messages=ASK)
    assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": "bad stop"}}
    assert [r.http_status for r in records] == [400]


def test_the_same_conversation_costs_the_same_by_either_api(tmp_path):
    async def answer(request):
        return httpx.Response(200, json=chat_answer({"content": "hi"}))
    gw, key, _, records = serving(tmp_path, answer)
    with TestClient(build_gateway_app(gw)) as http:
        client_of(http, key).messages.create(model="m", max_tokens=4, messages=ASK)
        http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 4, "messages": ASK},
                  headers={"authorization": f"Bearer {key}"})
    fields = [(r.model, r.status, r.prompt_tokens, r.cached_tokens, r.completion_tokens, r.cost_usd, r.tenant_id)
              for r in records]
    assert len(fields) == 2 and fields[0] == fields[1]


def test_count_tokens_is_the_prompt_the_model_reads(tmp_path):
    gw, key, _, _ = serving(tmp_path, None)
    with TestClient(build_gateway_app(gw)) as http:
        client = client_of(http, key)
        counted = client.messages.count_tokens(model="m", messages=ASK, system="be brief")
        assert counted.input_tokens == 5  # the word tokenizer: "be brief one two three"
        with pytest.raises(anthropic.NotFoundError):
            client.messages.count_tokens(model="nope", messages=ASK)


def test_the_request_translation_alone():
    body = MessagesRequest.model_validate({"model": "m", "max_tokens": 3, "stream": True, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": [
            {"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]}]}],
        "tool_choice": {"type": "any"}})
    chat = body.chat()
    assert chat["messages"] == [{"role": "tool", "tool_call_id": "a", "content": "r1\nr2"}]
    assert chat["tool_choice"] == "required" and chat["stream_options"] == {"include_usage": True}
    failed = MessagesAnswer(4)
    assert b"event: error" in failed.events(b'data: {"error": {"message": "boom"}}\n\n') and failed.end() == b""
