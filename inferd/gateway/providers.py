"""Hosted providers in their own protocols, behind the gateway's chat completions.

An external deployment whose `api` is `anthropic` gets, through this transport, the chat completion the gateway
planned as a messages request (its key as `x-api-key`, or a Bearer token with `auth: bearer`, and
`anthropic-version`), and its answer back as a chat
completion: whole, or as chunks translated event by event (protocol/anthropic.py). The request path, the relay
and the usage records see only OpenAI's shape, so limits, fallbacks and billing work as for any upstream; the
provider's usage is the record's, and its 529 (overloaded) a 503 that a fallback deployment may take.
"""
import json
from collections.abc import AsyncIterator

import httpx
import orjson

from inferd.protocol.anthropic import ChunkStream, chat_completion, chat_error, messages_body

ANTHROPIC_VERSION = "2023-06-01"
CHAT_PATH, MESSAGES_PATH = "/chat/completions", "/messages"


class AnthropicTransport(httpx.AsyncBaseTransport):
    """bearer: the key as a Bearer token (a server that checks only that, as vLLM's), else as x-api-key."""

    def __init__(self, inner: httpx.AsyncBaseTransport | None = None, bearer: bool = False):
        self.inner = inner or httpx.AsyncHTTPTransport()
        self.bearer = bearer

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not request.url.path.endswith(CHAT_PATH):
            return _error(404, f"{request.url.path} has no counterpart in this provider's API")
        try:
            body = messages_body(json.loads(await request.aread()))
        except (ValueError, KeyError, TypeError) as exc:
            return _error(400, str(exc))
        out = {"content-type": "application/json", "anthropic-version": ANTHROPIC_VERSION}
        if key := request.headers.get("authorization", "").removeprefix("Bearer "):
            out |= {"authorization": f"Bearer {key}"} if self.bearer else {"x-api-key": key}
        url = request.url.copy_with(path=request.url.path.removesuffix(CHAT_PATH) + MESSAGES_PATH)
        response = await self.inner.handle_async_request(httpx.Request(
            "POST", url, headers=out, content=orjson.dumps(body), extensions=request.extensions))
        if response.status_code != 200 or not body.get("stream"):
            content = await response.aread()
            await response.aclose()
            if response.status_code != 200:
                status, content = chat_error(response.status_code, content)
                return httpx.Response(status, content=content, headers={"content-type": "application/json"})
            return httpx.Response(200, content=orjson.dumps(chat_completion(orjson.loads(content))),
                                  headers={"content-type": "application/json"})
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Chunks(response))

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Chunks(httpx.AsyncByteStream):
    """The provider's event stream as chat completion chunks, each event translated once it is whole."""

    def __init__(self, response: httpx.Response):
        self.response = response
        self.chunks = ChunkStream()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        buffer = b""
        async for data in self.response.aiter_raw():
            events = (buffer + data).replace(b"\r\n", b"\n").split(b"\n\n")
            buffer = events.pop()
            if out := self.chunks.events(b"\n\n".join(events)):
                yield out

    async def aclose(self) -> None:
        await self.response.aclose()


def _error(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": "invalid_request_error",
                                                  "param": None, "code": None}})
