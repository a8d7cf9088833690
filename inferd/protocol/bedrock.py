"""AWS Bedrock's Converse API out (converse, converse-stream): a chat completion as its request, its answer and
its event stream (AWS's binary event-stream framing, read with botocore) back as a chat completion and chunks.
The gateway's transport for it, which signs each request (SigV4, botocore's signer), is gateway/providers.py's
BedrockTransport."""
import json
import time
from typing import Any

import orjson

from inferd.protocol import completions
from inferd.protocol.completions import conversation, text_of
from inferd.protocol.sse import sse_event

FINISH_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
                  "guardrail_intervened": "content_filter", "content_filtered": "content_filter"}


def request_body(chat: dict) -> dict:
    """A chat completion body (as the gateway plans it) as a Converse request (the model is in its URL).
    Raises ValueError for what the API cannot take (n above 1)."""
    if (chat.get("n") or 1) > 1:
        raise ValueError("'n' above 1 is not supported by this provider")
    system, turns = conversation(chat, _turn, "content")
    out: dict[str, Any] = {"messages": turns}
    if system:
        out["system"] = [{"text": s} for s in system]
    config = {"maxTokens": chat.get("max_completion_tokens") or chat.get("max_tokens"),
              "temperature": None if chat.get("temperature") is None else min(chat["temperature"], 1.0),
              "topP": chat.get("top_p"),
              "stopSequences": [chat["stop"]] if isinstance(chat.get("stop"), str) else chat.get("stop")}
    if config := {k: v for k, v in config.items() if v is not None}:
        out["inferenceConfig"] = config
    choice = chat.get("tool_choice") or "auto"
    if chat.get("tools") and choice != "none":  # Converse has no "none": the tools are left out
        picked = {"auto": {"auto": {}}, "required": {"any": {}}}.get(choice) if isinstance(choice, str) else \
            {"tool": {"name": choice["function"]["name"]}}
        out["toolConfig"] = {"tools": [{"toolSpec": _spec(t["function"])} for t in chat["tools"]],
                             "toolChoice": picked}
    return out


def _spec(function: dict) -> dict:
    spec = {"name": function["name"], "inputSchema": {"json": function.get("parameters")
                                                      or {"type": "object", "properties": {}}}}
    return spec | ({"description": function["description"]} if function.get("description") else {})


def _turn(m: dict) -> tuple[str, list[dict]]:
    if m["role"] == "tool":
        return "user", [{"toolResult": {"toolUseId": m.get("tool_call_id") or "",
                                        "content": [{"text": text_of(m.get("content"))}]}}]
    blocks = [{"text": text}] if (text := text_of(m.get("content"))) else []
    for call in m.get("tool_calls") or []:
        blocks.append({"toolUse": {"toolUseId": call["id"], "name": call["function"]["name"],
                                   "input": json.loads(call["function"]["arguments"] or "{}")}})
    return m["role"], blocks


def chat_completion(answer: dict) -> dict:
    """A whole Converse answer as a chat completion."""
    blocks = ((answer.get("output") or {}).get("message") or {}).get("content") or []
    text = "".join(b["text"] for b in blocks if "text" in b)
    calls = [{"id": b["toolUse"]["toolUseId"], "type": "function",
              "function": {"name": b["toolUse"]["name"], "arguments": json.dumps(b["toolUse"].get("input") or {})}}
             for b in blocks if "toolUse" in b]
    choice = {"index": 0, "message": completions.message(text, calls),
              "finish_reason": FINISH_REASONS.get(answer.get("stopReason"), "stop")}
    return completions.completion("bedrock", None, [choice], chat_usage(answer.get("usage") or {}))


def chat_usage(usage: dict) -> dict:
    cached, written = usage.get("cacheReadInputTokens") or 0, usage.get("cacheWriteInputTokens") or 0
    return completions.usage((usage.get("inputTokens") or 0) + cached + written, cached, usage.get("outputTokens") or 0)


class ChunkStream:
    """converse-stream's body (AWS event-stream frames, in pieces as they come) in, chat completion chunks out."""

    def __init__(self):
        from botocore.eventstream import EventStreamBuffer  # botocore: only where a deployment talks to Bedrock
        self.frames = EventStreamBuffer()
        self.head = {"id": "chatcmpl-bedrock", "object": "chat.completion.chunk", "created": int(time.time()),
                     "model": None}
        self.calls = 0
        self.finish: str | None = None
        self.usage: dict | None = None
        self.failed = False

    def feed(self, data: bytes) -> bytes:
        self.frames.add_data(data)
        out: list[bytes] = []
        for frame in self.frames:
            kind = frame.headers.get(":message-type")
            payload = orjson.loads(frame.payload) if frame.payload else {}
            if kind == "exception" or kind == "error":
                self.failed = True
                message = payload.get("message") or frame.headers.get(":exception-type") or "The provider failed."
                out.append(sse_event({"error": {"message": message, "type": "server_error", "param": None,
                                           "code": "upstream_error"}}))
            else:
                out += self._event(frame.headers.get(":event-type"), payload)
        return b"".join(out)

    def end(self) -> bytes:
        if self.failed:
            return b""
        out = [self._chunk({}, self.finish or "stop")]
        if self.usage is not None:
            out.append(sse_event(self.head | {"choices": [], "usage": chat_usage(self.usage)}))
        return b"".join(out) + b"data: [DONE]\n\n"

    def _event(self, kind: str | None, e: dict) -> list[bytes]:
        if kind == "messageStart":
            return [self._chunk({"role": "assistant", "content": ""})]
        if kind == "contentBlockStart" and "toolUse" in (e.get("start") or {}):
            use = e["start"]["toolUse"]
            self.calls += 1
            return [self._chunk({"tool_calls": [{"index": self.calls - 1, "id": use["toolUseId"], "type": "function",
                                                 "function": {"name": use["name"], "arguments": ""}}]})]
        if kind == "contentBlockDelta":
            delta = e.get("delta") or {}
            if delta.get("text"):
                return [self._chunk({"content": delta["text"]})]
            if (delta.get("toolUse") or {}).get("input"):
                return [self._chunk({"tool_calls": [{"index": self.calls - 1,
                                                     "function": {"arguments": delta["toolUse"]["input"]}}]})]
        if kind == "messageStop":
            self.finish = FINISH_REASONS.get(e.get("stopReason"), "stop")
        if kind == "metadata":
            self.usage = e.get("usage") or {}
        return []

    def _chunk(self, delta: dict, finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return sse_event(self.head | {"choices": [choice]})



def chat_error(status: int, content: bytes) -> tuple[int, bytes]:
    """Its error answer ({"message": ...}, the kind in x-amzn-errortype) in OpenAI's shape, with its status."""
    try:
        message = str(orjson.loads(content)["message"])
    except (ValueError, KeyError, TypeError):
        message = "The provider failed."
    kind = "rate_limit_error" if status == 429 else "invalid_request_error" if status < 500 else "server_error"
    return status, orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}})
