import json
from collections.abc import AsyncGenerator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


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
