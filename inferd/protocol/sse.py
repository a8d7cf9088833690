import json
from collections.abc import AsyncGenerator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_DONE = b"data: [DONE]\n\n"
# Characters JSON may hold unescaped that str.splitlines, and clients that split a stream with it (httpx's
# aiter_lines among them), take for line ends: an event holding one reached such a client cut in two, its JSON
# broken (a generated token's text can be U+2028). SSE ends lines only at CR and LF; these go as JSON escapes.
LINE_SEPARATORS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def sse_event(payload: dict) -> bytes:
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    for raw, escaped in LINE_SEPARATORS:
        if raw in data:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


class SSEResponse(StreamingResponse):
    """A server-sent-events stream whose source is closed however the response ends.

    Starlette cancels the stream when the client disconnects; closing the
    generator here as well makes the source's cleanup (aborting engine work)
    run at once, whatever ASGI server is underneath.
    """
    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], headers: dict[str, str] | None = None):
        base = {"cache-control": "no-cache", "x-accel-buffering": "no"}
        super().__init__(events, headers=base | (headers or {}))
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
