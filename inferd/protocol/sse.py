import json
from collections.abc import AsyncGenerator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_DONE = b"data: [DONE]\n\n"
# Characters JSON may hold unescaped that str.splitlines, and clients that split a stream with it (httpx's
# aiter_lines among them), take for line ends: an event holding one reached such a client cut in two, its JSON
# broken (a generated token's text can be U+2028). SSE ends lines only at CR and LF; these go as JSON escapes.
LINE_SEPARATORS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def sse_event(payload: dict, event: str | None = None) -> bytes:
    """One event: its JSON data, and its type for APIs that name their events (Anthropic's)."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    for raw, escaped in LINE_SEPARATORS:
        if raw in data:
            data = data.replace(raw, escaped)
    return (b"event: " + event.encode() + b"\n" if event else b"") + b"data: " + data + b"\n\n"


class EventSplitter:
    """Whole events out of a stream's pieces (an event may come cut across two pieces)."""

    def __init__(self):
        self.buffer = b""

    def whole(self, data: bytes) -> list[bytes]:
        events = (self.buffer + data).replace(b"\r\n", b"\n").split(b"\n\n")
        self.buffer = events.pop()
        return events

    def rest(self) -> list[bytes]:
        rest, self.buffer = self.buffer, b""
        return [rest] if rest.strip() else []


def data_of(event: bytes) -> bytes | None:
    """An event's data line (after `data:`), or None."""
    return next((line[5:] for line in event.split(b"\n") if line.startswith(b"data:")), None)


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
