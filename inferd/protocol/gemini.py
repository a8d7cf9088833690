"""Google's Gemini API out (generateContent, streamGenerateContent with alt=sse): a chat completion as its request,
its answer and its stream back as a chat completion and chunks, its errors in OpenAI's shape. The gateway's
transport for it is gateway/providers.py's GeminiTransport."""
import json
import time
from typing import Any

import orjson

from inferd.protocol import completions
from inferd.protocol.completions import conversation, text_of
from inferd.protocol.sse import EventSplitter, data_of, sse_event

FINISH_REASONS = {"STOP": "stop", "MAX_TOKENS": "length", "SAFETY": "content_filter", "RECITATION": "content_filter",
                  "BLOCKLIST": "content_filter", "PROHIBITED_CONTENT": "content_filter", "SPII": "content_filter"}
CONFIG = {"max_completion_tokens": "maxOutputTokens", "max_tokens": "maxOutputTokens", "temperature": "temperature",
          "top_p": "topP", "top_k": "topK", "n": "candidateCount", "seed": "seed",
          "presence_penalty": "presencePenalty", "frequency_penalty": "frequencyPenalty"}


def request_body(chat: dict) -> dict:
    """A chat completion body (as the gateway plans it) as a generateContent request."""
    names = {c["id"]: c["function"]["name"] for m in chat["messages"] for c in m.get("tool_calls") or []}
    system, contents = conversation(chat, lambda m: _turn(m, names), "parts")
    out: dict[str, Any] = {"contents": contents}
    if system:
        out["systemInstruction"] = {"parts": [{"text": "\n\n".join(system)}]}
    config = {theirs: chat[ours] for ours, theirs in CONFIG.items() if chat.get(ours) is not None}
    if chat.get("stop"):
        config["stopSequences"] = [chat["stop"]] if isinstance(chat["stop"], str) else chat["stop"]
    if config:
        out["generationConfig"] = config
    if chat.get("tools"):
        out["tools"] = [{"functionDeclarations": [
            {"name": t["function"]["name"], "parametersJsonSchema": t["function"].get("parameters")
             or {"type": "object", "properties": {}}}
            | ({"description": t["function"]["description"]} if t["function"].get("description") else {})
            for t in chat["tools"]]}]
        choice = chat.get("tool_choice") or "auto"
        mode = {"auto": "AUTO", "required": "ANY", "none": "NONE"}.get(choice) if isinstance(choice, str) else "ANY"
        calling = {"mode": mode} | ({"allowedFunctionNames": [choice["function"]["name"]]}
                                    if isinstance(choice, dict) else {})
        out["toolConfig"] = {"functionCallingConfig": calling}
    return out


def _turn(m: dict, names: dict[str, str]) -> tuple[str, list[dict]]:
    if m["role"] == "tool":
        name = names.get(m.get("tool_call_id") or "", "")
        return "user", [{"functionResponse": {"name": name, "response": {"content": text_of(m.get("content"))}}}]
    parts = [{"text": text}] if (text := text_of(m.get("content"))) else []
    for call in m.get("tool_calls") or []:
        parts.append({"functionCall": {"name": call["function"]["name"],
                                       "args": json.loads(call["function"]["arguments"] or "{}")}})
    return ("model" if m["role"] == "assistant" else "user"), parts


def chat_completion(answer: dict) -> dict:
    """A whole generateContent answer as a chat completion (a choice per candidate)."""
    choices = []
    for i, candidate in enumerate(answer.get("candidates") or []):
        parts = (candidate.get("content") or {}).get("parts") or []
        text = "".join(p.get("text", "") for p in parts if not p.get("thought"))
        calls = _calls(parts, candidate.get("index", i), 0)
        choices.append({"index": candidate.get("index", i), "message": completions.message(text, calls),
                        "finish_reason": _finish(candidate.get("finishReason"), bool(calls))})
    return completions.completion(str(answer.get("responseId", "")), answer.get("modelVersion"), choices,
                                  chat_usage(answer.get("usageMetadata") or {}))


def _calls(parts: list[dict], choice: int, first: int) -> list[dict]:
    calls = [p["functionCall"] for p in parts if "functionCall" in p]
    return [{"id": c.get("id") or f"call_{choice}_{first + k}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c.get("args") or {})}}
            for k, c in enumerate(calls)]


def _finish(reason: str | None, called: bool) -> str:
    finish = FINISH_REASONS.get(reason or "STOP", "stop")
    return "tool_calls" if called and finish == "stop" else finish


def chat_usage(meta: dict) -> dict:
    """Its usage as a chat completion's: thinking tokens are output tokens (they are billed as such)."""
    return completions.usage(meta.get("promptTokenCount") or 0, meta.get("cachedContentTokenCount") or 0,
                             (meta.get("candidatesTokenCount") or 0) + (meta.get("thoughtsTokenCount") or 0))


class ChunkStream:
    """streamGenerateContent's events (whole SSE events) in, chat completion chunks out; end() adds the usage and
    `data: [DONE]` once the provider's stream has ended (it sends no end event of its own)."""

    def __init__(self):
        self.head: dict | None = None
        self.usage: dict = {}
        self.calls: dict[int, int] = {}  # calls so far, per choice
        self.failed = False
        self.split = EventSplitter()

    def feed(self, data: bytes) -> bytes:
        return self._events(self.split.whole(data))

    def end(self) -> bytes:
        out = self._events(self.split.rest())
        if self.failed or self.head is None:
            return out
        return out + sse_event(self.head | {"choices": [], "usage": chat_usage(self.usage)}) + b"data: [DONE]\n\n"

    def _events(self, events: list[bytes]) -> bytes:
        out: list[bytes] = []
        for event in events:
            if (data := data_of(event)) is not None:
                out += self._answer(orjson.loads(data))
        return b"".join(out)

    def _answer(self, answer: dict) -> list[bytes]:
        if "error" in answer:
            self.failed = True
            return [sse_event({"error": {"message": str(answer["error"].get("message", "The provider failed.")),
                                    "type": "server_error", "param": None, "code": "upstream_error"}})]
        out = []
        if self.head is None:
            self.head = {"id": "chatcmpl-" + str(answer.get("responseId", "")), "object": "chat.completion.chunk",
                         "created": int(time.time()), "model": answer.get("modelVersion")}
        self.usage = answer.get("usageMetadata") or self.usage
        for i, candidate in enumerate(answer.get("candidates") or []):
            index = candidate.get("index", i)
            if index not in self.calls:
                self.calls[index] = 0
                out.append(self._chunk(index, {"role": "assistant", "content": ""}))
            parts = (candidate.get("content") or {}).get("parts") or []
            if text := "".join(p.get("text", "") for p in parts if not p.get("thought")):
                out.append(self._chunk(index, {"content": text}))
            for call in _calls(parts, index, self.calls[index]):
                out.append(self._chunk(index, {"tool_calls": [{"index": self.calls[index]} | call]}))
                self.calls[index] += 1
            if candidate.get("finishReason"):
                out.append(self._chunk(index, {}, _finish(candidate["finishReason"], self.calls[index] > 0)))
        return out

    def _chunk(self, index: int, delta: dict, finish: str | None = None) -> bytes:
        return sse_event(self.head | {"choices": [{"index": index, "delta": delta, "logprobs": None,
                                              "finish_reason": finish}]})



def chat_error(status: int, content: bytes) -> tuple[int, bytes]:
    """Its error answer ({"error": {"code", "message", "status"}}) in OpenAI's shape, with its status."""
    try:
        error = orjson.loads(content)
        error = error[0]["error"] if isinstance(error, list) else error["error"]  # a stream's errors come in a list
        message, kind = str(error["message"]), str(error.get("status") or "error").lower()
    except (ValueError, KeyError, TypeError, IndexError):
        message, kind = "The provider failed.", "api_error"
    return status, orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": kind}})
