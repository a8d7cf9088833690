"""Anthropic's Messages API in (POST /v1/messages, /v1/messages/count_tokens): its request as the chat completion
the replicas serve, their answers (whole, or as a stream of chat chunks) as its message and its events, and its
error shape. The gateway runs a messages request through the same lifecycle as a chat completion
(gateway/text.py), so keys, limits, admission, usage records and prices are the same whichever API it came by.
"""
import json
import time
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from inferd.protocol import completions
from inferd.protocol.completions import conversation, text_of
from inferd.protocol.errors import APIError, Overloaded, ServiceUnavailable, to_api_error
from inferd.protocol.sse import EventSplitter, data_of, sse_event

PATHS = ("/v1/messages", "/v1/messages/count_tokens")
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}
OVERLOADED = 529  # Anthropic's status for "no capacity now, retry" (its SDK's OverloadedError)


# the request

class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Body):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Body):
    user_id: str | None = None


class CountTokensRequest(_Body):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    def chat(self) -> dict:
        """The chat completion body of the same conversation (its tools and tool choice included)."""
        messages = [{"role": "system", "content": _text(self.system)}] if self.system else []
        for m in self.messages:
            messages += _chat_messages(m)
        out: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.tools:
            out["tools"] = [{"type": "function", "function": {
                "name": t.name, "parameters": t.input_schema} | ({"description": t.description} if t.description
                                                                  else {})} for t in self.tools]
        if self.tool_choice is not None:
            c = self.tool_choice
            out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(c.type) or {
                "type": "function", "function": {"name": c.name or ""}}
            if c.disable_parallel_tool_use:
                out["parallel_tool_calls"] = False
        return out


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    stream: bool = False

    def chat(self) -> dict:
        out = super().chat() | {"max_tokens": self.max_tokens, "stream": self.stream}
        fields = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                  "stop": self.stop_sequences or None, "user": self.metadata.user_id if self.metadata else None}
        out |= {k: v for k, v in fields.items() if v is not None}
        if self.stream:
            out["stream_options"] = {"include_usage": True}  # the output tokens of message_delta
        return out


def _chat_messages(m: Message) -> list[dict]:
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    text = "\n".join(b.text for b in m.content if isinstance(b, TextBlock))
    if m.role == "user":  # its tool results (which come first in the turn), then its text
        out = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)}
               for b in m.content if isinstance(b, ToolResultBlock)]
        return out + ([{"role": "user", "content": text}] if text or not out else [])
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in m.content if isinstance(b, ToolUseBlock)]
    return [{"role": "assistant", "content": text or None} | ({"tool_calls": calls} if calls else {})]


def _text(content: str | list[TextBlock] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(b.text for b in content)


# the answer

def message(chat: dict) -> dict:
    """A whole chat completion (one choice) as a message."""
    choice, usage = chat["choices"][0], chat.get("usage") or {}
    content = []
    if choice["message"].get("content"):
        content.append({"type": "text", "text": choice["message"]["content"]})
    for call in choice["message"].get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"])})
    return {"id": _message_id(chat["id"]), "type": "message", "role": "assistant", "model": chat["model"],
            "content": content, "stop_reason": STOP_REASONS.get(choice["finish_reason"], "end_turn"),
            "stop_sequence": None, "usage": _usage(usage)}


class MessagesAnswer:
    """A chat completion's answer as a message: whole(), or its chunks (whole SSE events, as the gateway relays
    them) through events(), then end() to close the message. input_tokens: the prompt's count, which
    message_start carries before any usage has come."""

    def __init__(self, input_tokens: int):
        self.input_tokens = input_tokens
        self.started = self.failed = False
        self.block: tuple[int, str] | None = None  # the open content block: its index and type
        self.blocks = 0
        self.stop_reason = "end_turn"
        self.usage: dict = {}

    def whole(self, status: int, content: bytes) -> tuple[int, bytes]:
        if status != 200:
            return whole_error(status, content)
        return status, orjson.dumps(message(orjson.loads(content)))

    def events(self, data: bytes) -> bytes:
        out: list[bytes] = []
        for event in data.split(b"\n\n"):
            if event.startswith(b"data: "):
                self._chunk(orjson.loads(event[6:]), out)
        return b"".join(out)

    def end(self) -> bytes:
        if self.failed:
            return b""
        out: list[bytes] = []
        self._start(out, {})
        self._close(out)
        out.append(_event("message_delta", {"delta": {"stop_reason": self.stop_reason, "stop_sequence": None},
                                            "usage": {"output_tokens": self.usage.get("completion_tokens", 0)}}))
        out.append(_event("message_stop", {}))
        return b"".join(out)

    def _chunk(self, chunk: dict, out: list[bytes]) -> None:
        if "error" in chunk:  # the replica failed mid-stream
            self.failed = True
            out.append(_event("error", {"error": {"type": "api_error", "message": chunk["error"]["message"]}}))
            return
        self._start(out, chunk)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.block is None or self.block[1] != "text":
                    self._open(out, "text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                if call.get("id"):  # a call's head; its arguments follow in pieces
                    self._open(out, "tool_use", {"type": "tool_use", "id": call["id"],
                                                 "name": call["function"]["name"], "input": {}})
                if call.get("function", {}).get("arguments"):
                    out.append(self._delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]}))
            if choice.get("finish_reason"):
                self.stop_reason = STOP_REASONS.get(choice["finish_reason"], "end_turn")

    def _start(self, out: list[bytes], chunk: dict) -> None:
        if self.started:
            return
        self.started = True
        out.append(_event("message_start", {"message": {
            "id": _message_id(chunk.get("id", "")), "type": "message", "role": "assistant",
            "model": chunk.get("model", ""), "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}}))
        out.append(_event("ping", {}))

    def _open(self, out: list[bytes], kind: str, block: dict) -> None:
        self._close(out)
        self.block = (self.blocks, kind)
        self.blocks += 1
        out.append(_event("content_block_start", {"index": self.block[0], "content_block": block}))

    def _close(self, out: list[bytes]) -> None:
        if self.block is not None:
            out.append(_event("content_block_stop", {"index": self.block[0]}))
            self.block = None

    def _delta(self, delta: dict) -> bytes:
        return _event("content_block_delta", {"index": self.block[0], "delta": delta})


def _event(kind: str, data: dict) -> bytes:
    return sse_event({"type": kind} | data, kind)


def _message_id(chat_id: str) -> str:
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def _usage(usage: dict) -> dict:
    """Anthropic counts the prompt's tokens read from a cache apart from its input tokens."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": usage.get("prompt_tokens", 0) - cached, "output_tokens": usage.get("completion_tokens", 0),
            "cache_read_input_tokens": cached}


# errors

def status_of(err: APIError) -> int:
    """Its status on these paths: a refusal for capacity is Anthropic's 529, the rest as the error tree says."""
    return OVERLOADED if isinstance(err, Overloaded) else err.status


def error_body(err: APIError) -> dict:
    status = status_of(err)
    kind = ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else
                                       "overloaded_error" if isinstance(err, ServiceUnavailable) else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def error_response(exc: BaseException, map_error=to_api_error) -> Response:
    err = map_error(exc)
    return Response(orjson.dumps(error_body(err)), status_code=status_of(err), headers=err.headers or None,
                    media_type="application/json")


def whole_error(status: int, content: bytes) -> tuple[int, bytes]:
    """A replica's error answer (OpenAI's shape) in Anthropic's."""
    try:
        error = orjson.loads(content)["error"]
        message, code = str(error["message"]), error.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, code = "The model's server failed.", None
    err = Overloaded(message) if code == Overloaded.code else APIError(message)
    if code != Overloaded.code:
        err.status = status
    return status_of(err), orjson.dumps(error_body(err))


# out: a provider that speaks this API, behind the gateway's chat completions (gateway/providers.py)

FINISH_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
                  "pause_turn": "stop", "refusal": "content_filter"}
DEFAULT_MAX_TOKENS = 4096  # Anthropic requires max_tokens; a chat completion without one gets this


def messages_body(chat: dict) -> dict:
    """A chat completion body (as the gateway plans it) as a messages request. Raises ValueError for what the
    API cannot take (n above 1)."""
    if (chat.get("n") or 1) > 1:
        raise ValueError("'n' above 1 is not supported by this provider")
    system, turns = conversation(chat, _turn, "content")
    out: dict[str, Any] = {"model": chat["model"], "messages": turns,
                           "max_tokens": chat.get("max_completion_tokens") or chat.get("max_tokens")
                           or DEFAULT_MAX_TOKENS}
    if system:
        out["system"] = "\n\n".join(system)
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                         ("stream", "stream")):
        if chat.get(ours) is not None:
            out[theirs] = min(chat[ours], 1.0) if ours == "temperature" else chat[ours]
    if chat.get("stop"):
        out["stop_sequences"] = [chat["stop"]] if isinstance(chat["stop"], str) else chat["stop"]
    if chat.get("user"):
        out["metadata"] = {"user_id": chat["user"]}
    if chat.get("tools"):
        out["tools"] = [{"name": t["function"]["name"], "input_schema": t["function"].get("parameters")
                         or {"type": "object", "properties": {}}}
                        | ({"description": t["function"]["description"]} if t["function"].get("description") else {})
                        for t in chat["tools"]]
        choice = chat.get("tool_choice") or "auto"
        out["tool_choice"] = {"type": {"auto": "auto", "required": "any", "none": "none"}[choice]} \
            if isinstance(choice, str) else {"type": "tool", "name": choice["function"]["name"]}
        if chat.get("parallel_tool_calls") is False and out["tool_choice"]["type"] != "none":
            out["tool_choice"]["disable_parallel_tool_use"] = True
    return out


def _turn(m: dict) -> tuple[str, list[dict]]:
    if m["role"] == "tool":
        return "user", [{"type": "tool_result", "tool_use_id": m.get("tool_call_id") or "",
                         "content": text_of(m.get("content"))}]
    blocks = [{"type": "text", "text": text}] if (text := text_of(m.get("content"))) else []
    for call in m.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"] or "{}")})
    return m["role"], blocks


def chat_completion(msg: dict) -> dict:
    """A whole message as a chat completion."""
    text = "".join(b["text"] for b in msg.get("content", []) if b.get("type") == "text")
    calls = [{"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": json.dumps(b["input"])}}
             for b in msg.get("content", []) if b.get("type") == "tool_use"]
    choice = {"index": 0, "message": completions.message(text, calls),
              "finish_reason": FINISH_REASONS.get(msg.get("stop_reason"), "stop")}
    return completions.completion(str(msg.get("id", "")), msg.get("model"), [choice],
                                  chat_usage(msg.get("usage") or {}))


def chat_usage(usage: dict) -> dict:
    """Anthropic's usage as a chat completion's: every prompt token, those read from its cache among them."""
    cached, written = usage.get("cache_read_input_tokens") or 0, usage.get("cache_creation_input_tokens") or 0
    prompt = (usage.get("input_tokens") or 0) + cached + written
    return completions.usage(prompt, cached, usage.get("output_tokens") or 0)


class ChunkStream:
    """A messages stream (its pieces, as they come) in, chat completion chunks out, then `data: [DONE]`."""

    def __init__(self):
        self.head: dict = {}
        self.usage: dict = {}
        self.calls = 0  # tool_use blocks so far: the index of the next call
        self.split = EventSplitter()

    def feed(self, data: bytes) -> bytes:
        return self._events(self.split.whole(data))

    def end(self) -> bytes:
        return self._events(self.split.rest())  # its message_stop ended the chunks

    def _events(self, events: list[bytes]) -> bytes:
        out: list[bytes] = []
        for event in events:
            if (data := data_of(event)) is not None:
                out += self._event(orjson.loads(data))
        return b"".join(out)

    def _event(self, e: dict) -> list[bytes]:
        kind = e.get("type")
        if kind == "message_start":
            message = e["message"]
            self.head = {"id": "chatcmpl-" + str(message.get("id", "")), "object": "chat.completion.chunk",
                         "created": int(time.time()), "model": message.get("model")}
            self.usage = message.get("usage") or {}
            return [self._chunk({"role": "assistant", "content": ""})]
        if kind == "content_block_start" and e["content_block"].get("type") == "tool_use":
            block = e["content_block"]
            self.calls += 1
            return [self._chunk({"tool_calls": [{"index": self.calls - 1, "id": block["id"], "type": "function",
                                                 "function": {"name": block["name"], "arguments": ""}}]})]
        if kind == "content_block_delta":
            delta = e["delta"]
            if delta.get("type") == "text_delta":
                return [self._chunk({"content": delta["text"]})]
            if delta.get("type") == "input_json_delta" and delta.get("partial_json"):
                return [self._chunk({"tool_calls": [{"index": self.calls - 1,
                                                     "function": {"arguments": delta["partial_json"]}}]})]
        if kind == "message_delta":
            self.usage = self.usage | {k: v for k, v in (e.get("usage") or {}).items() if v is not None}
            finish = FINISH_REASONS.get((e.get("delta") or {}).get("stop_reason"), "stop")
            return [self._chunk({}, finish)]
        if kind == "message_stop":
            usage = sse_event(self.head | {"choices": [], "usage": chat_usage(self.usage)})
            return [usage, b"data: [DONE]\n\n"]
        if kind == "error":
            return [sse_event({"error": {"message": (e.get("error") or {}).get("message", "The provider failed."),
                                    "type": "server_error", "param": None, "code": "upstream_error"}})]
        return []

    def _chunk(self, delta: dict, finish: str | None = None) -> bytes:
        return sse_event(self.head | {"choices": [{"index": 0, "delta": delta, "logprobs": None,
                                              "finish_reason": finish}]})



def chat_error(status: int, content: bytes) -> tuple[int, bytes]:
    """A provider's error answer in OpenAI's shape; its 529 (overloaded) is a 503, which a fallback may take."""
    try:
        error = orjson.loads(content)["error"]
        message, kind = str(error["message"]), str(error.get("type"))
    except (ValueError, KeyError, TypeError, AttributeError):
        message, kind = "The provider failed.", "api_error"
    if status == OVERLOADED:
        status, kind = 503, "upstream_overloaded"
    return status, orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": kind}})
