"""Anthropic's protocol out, alone: a chat completion as a messages request, a message and an event stream back as
a chat completion and its chunks, a provider's errors in OpenAI's shape (the gateway's fallbacks read 5xx)."""
import json

import pytest

from inferd.protocol.anthropic import ChunkStream, chat_completion, chat_error, messages_body

CHAT = {"model": "claude-x", "max_tokens": 50, "temperature": 1.5, "stop": "END", "user": "u",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Rome"}'}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                     {"role": "user", "content": [{"type": "text", "text": "and tomorrow?"}]}],
        "tools": [{"type": "function", "function": {"name": "w", "description": "weather"}}],
        "tool_choice": "required", "parallel_tool_calls": False, "stream": True,
        "stream_options": {"include_usage": True}}


def test_a_chat_completion_as_a_messages_request():
    body = messages_body(CHAT)
    assert body["system"] == "be brief" and body["max_tokens"] == 50 and body["temperature"] == 1.0
    assert body["stop_sequences"] == ["END"] and body["metadata"] == {"user_id": "u"} and body["stream"] is True
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "w", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny"},
                                     {"type": "text", "text": "and tomorrow?"}]}]
    assert body["tools"] == [{"name": "w", "input_schema": {"type": "object", "properties": {}},
                              "description": "weather"}]
    assert body["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}
    assert messages_body({"model": "m", "messages": [{"role": "user", "content": "x"}]})["max_tokens"] == 4096
    with pytest.raises(ValueError, match="'n'"):
        messages_body({"model": "m", "messages": [], "n": 2})


def test_a_message_as_a_chat_completion():
    chat = chat_completion({"id": "msg_1", "model": "claude-x", "stop_reason": "tool_use", "content": [
        {"type": "text", "text": "Let me look."}, {"type": "tool_use", "id": "t1", "name": "w", "input": {"a": 1}}],
        "usage": {"input_tokens": 10, "cache_read_input_tokens": 4, "cache_creation_input_tokens": 2,
                  "output_tokens": 7}})
    choice = chat["choices"][0]
    assert chat["id"] == "chatcmpl-msg_1" and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    assert choice["message"]["tool_calls"] == [{"id": "t1", "type": "function",
                                                "function": {"name": "w", "arguments": '{"a": 1}'}}]
    assert chat["usage"] == {"prompt_tokens": 16, "completion_tokens": 7, "total_tokens": 23,
                             "prompt_tokens_details": {"cached_tokens": 4}}


def event(kind: str, **data) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind} | data)}\n\n".encode()


def test_an_event_stream_as_chunks_then_done():
    stream = ChunkStream()
    out = stream.feed(b"".join([
        event("message_start", message={"id": "msg_2", "model": "claude-x", "usage": {"input_tokens": 9,
                                                                                      "output_tokens": 1}}),
        event("ping"),
        event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
        event("content_block_delta", index=0, delta={"type": "text_delta", "text": "Hi"}),
        event("content_block_stop", index=0),
        event("content_block_start", index=1, content_block={"type": "tool_use", "id": "t9", "name": "w", "input": {}}),
        event("content_block_delta", index=1, delta={"type": "input_json_delta", "partial_json": '{"a":'}),
        event("content_block_delta", index=1, delta={"type": "input_json_delta", "partial_json": " 2}"}),
        event("message_delta", delta={"stop_reason": "tool_use"}, usage={"output_tokens": 12}),
        event("message_stop")]))
    lines = [line for line in out.split(b"\n\n") if line]
    assert lines[-1] == b"data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": "Hi"}
    assert deltas[2]["tool_calls"][0] == {"index": 0, "id": "t9", "type": "function",
                                          "function": {"name": "w", "arguments": ""}}
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[3:5]) == '{"a": 2}'
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["usage"]["prompt_tokens"] == 9 and chunks[-1]["usage"]["completion_tokens"] == 12
    assert {c["id"] for c in chunks} == {"chatcmpl-msg_2"}
    failed = ChunkStream().feed(event("error", error={"type": "overloaded_error", "message": "busy"}))
    assert json.loads(failed[6:])["error"]["message"] == "busy"


def test_a_providers_errors_in_openais_shape():
    status, body = chat_error(529, b'{"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}')
    assert status == 503 and json.loads(body)["error"]["message"] == "busy"
    status, body = chat_error(401, b'{"type": "error", "error": {"type": "authentication_error", "message": "key"}}')
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    assert chat_error(502, b"<html>")[0] == 502
