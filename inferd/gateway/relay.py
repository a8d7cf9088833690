"""One attempt on one replica: send the planned body, relay the answer, and say how it went (an Outcome).

The relay never finishes a request: it fills in the attempt's Outcome (status, usage so far, time to
the first token, whether another replica or deployment may still take it) and the lifecycle decides.
Streams from our replicas are passed on as bytes: usage arrives as SSE comments (headers.USAGE_PREFIX),
read here and dropped, so no chunk the client gets is parsed or re-serialized. A stream's last event,
`data: [DONE]`, is held back (Outcome.stream_done): the lifecycle sends it once the usage is journaled. An external server's
chunks are parsed for its usage and counted: a server that streams no usage (llama.cpp's) is billed for the
prompt as the gateway counted it and one token per chunk of text.
"""
import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import httpx

from inferd.protocol import headers
from inferd.protocol.errors import APIError, DeadlineExceeded, UpstreamFailed, error_body
from inferd.protocol.headers import UsageStatus
from inferd.protocol.sse import sse_event

PASSED_HEADERS = ("content-type",)
TIMEOUTS = {"connect": 5.0, "read": None, "write": None, "pool": None}  # an answer may take as long as it takes
DONE = b"data: [DONE]"
ERROR_EVENT = b'data: {"error"'


@dataclass(slots=True)
class Outcome:
    """How an attempt ended; until it says otherwise, the client went away (cancelled)."""
    status: UsageStatus = "cancelled"
    http_status: int = 499
    error_code: str | None = "client_closed_request"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    first_token_unix_ns: int | None = None  # for the span's first_token event
    streamed: bool = False  # the answer came as a stream: its first token was seen here
    decode_s: float | None = None  # a unary answer's first output token to its end, as our replica says
    usage_seen: bool = False  # the upstream said its usage
    planned_prompt_tokens: int = 0  # the prompt as the gateway counted it
    text_chunks: int = 0  # choices with text in an external stream's chunks
    stream_head: dict | None = None  # an external stream's id, object, created and model
    retry_reason: str | None = None  # nothing reached the client: a fallback deployment may take it
    unreachable: bool = False  # no connection: another replica of the same deployment may take it
    no_answer: bool = False  # failed before the answer's head (no connection, a reset, a read error): ditto
    cache_hit: bool = False  # answered from the response cache: no replica, nothing to pay
    stream_done: bool = False  # the stream ended with [DONE] (or an error event): the lifecycle sends [DONE]
    error: APIError | None = None  # what the client is told if no other attempt follows

    def end(self, status: UsageStatus, http_status: int, error_code: str | None = None) -> None:
        self.status, self.http_status, self.error_code = status, http_status, error_code

    def fail(self, error: APIError, status: UsageStatus = "failed", retry_reason: str | None = None) -> None:
        self.end(status, error.status, error.code)
        self.error, self.retry_reason = error, retry_reason

    def observe_usage(self, usage: dict | None) -> None:
        if usage:
            self.usage_seen = True
            self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.completion_tokens = int(usage.get("completion_tokens") or 0)
            self.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    def counted_usage(self) -> None:
        """A stream that said no usage: the prompt as the gateway counted it, a token per chunk of text (a
        server that sends some tokens' text in one chunk is billed for fewer)."""
        if not self.usage_seen and self.text_chunks:
            self.prompt_tokens, self.completion_tokens = self.planned_prompt_tokens, self.text_chunks

    def first_token(self, arrival_s: float) -> None:
        if self.ttft_s is None:
            self.ttft_s = time.monotonic() - arrival_s
            self.first_token_unix_ns = time.time_ns()

    def tpot_s(self, e2e_s: float) -> float | None:
        """Time per output token after the first, of a completed answer of 2 tokens or more: over the stream
        as seen here, or the replica's decode time for a unary answer (None from a server that does not say)."""
        if self.status != "completed" or self.completion_tokens < 2:
            return None
        if self.streamed and self.ttft_s is not None:
            return max(e2e_s - self.ttft_s, 0.0) / (self.completion_tokens - 1)
        return self.decode_s / (self.completion_tokens - 1) if self.decode_s is not None else None

    @property
    def billed(self) -> bool:
        return self.status == "completed" or (self.status == "cancelled" and self.ttft_s is not None)


async def send(transport: httpx.AsyncBaseTransport, url: httpx.URL, request_headers: dict[str, str], body: bytes,
               outcome: Outcome) -> httpx.Response | None:
    """The upstream's response head, or None with the outcome failed. Nothing of the answer came back when the
    connection failed (unreachable) or broke before the head (a replica that died between requests, its pooled
    connection reset): another replica may take the request (no_answer). A read timeout is not retried: the
    replica may still be working on it."""
    try:
        return await transport.handle_async_request(
            httpx.Request("POST", url, headers=request_headers, content=body, extensions={"timeout": TIMEOUTS}))
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        outcome.fail(UpstreamFailed(f"No replica could be reached ({type(exc).__name__}); retry the request."),
                     retry_reason=UpstreamFailed.code)
        outcome.unreachable = outcome.no_answer = True
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        outcome.fail(UpstreamFailed(f"The replica failed ({type(exc).__name__}); retry the request."),
                     retry_reason=UpstreamFailed.code)
        outcome.no_answer = True
    except httpx.HTTPError as exc:
        outcome.fail(UpstreamFailed(f"The replica failed ({type(exc).__name__}); retry the request."),
                     retry_reason=UpstreamFailed.code)
    return None


async def read_whole(response: httpx.Response, outcome: Outcome, arrival_s: float, ours: bool
                     ) -> tuple[bytes, dict] | None:
    """A unary answer (or any non-200): its body and passed headers; None with the outcome failed. Our
    replicas say the usage in a header (headers.USAGE); an external server's body is parsed for it."""
    try:
        content = await response.aread()
    except httpx.HTTPError as exc:
        outcome.fail(UpstreamFailed(f"The replica failed before it answered ({type(exc).__name__})."),
                     retry_reason=UpstreamFailed.code)
        return None
    finally:
        await response.aclose()
    passed = {k: v for k, v in response.headers.items() if k in PASSED_HEADERS}
    if response.status_code == 200:
        usage = response.headers.get(headers.USAGE) if ours else None
        outcome.observe_usage(json.loads(usage) if usage else json.loads(content).get("usage"))
        outcome.decode_s = _seconds(response.headers.get(headers.DECODE_S)) if ours else None
        outcome.first_token(arrival_s)
        outcome.end("completed", 200)
    else:
        outcome.end("failed", response.status_code, _error_code(content))
        if response.status_code >= 500 or response.status_code == 429:  # a fallback may take it (a provider's limit)
            outcome.retry_reason = f"http_{response.status_code}"
    return content, passed


async def relay_stream(response: httpx.Response, outcome: Outcome, arrival_s: float, ours: bool,
                       usage_mode: str, first_token_by: float | None = None) -> AsyncGenerator[bytes, None]:
    """The SSE events of a 200 stream, as the client asked for them; the outcome follows along. With
    first_token_by (time.monotonic()), a stream whose first token has not come by then is ended as expired
    (closing the connection makes the runtime abort the request)."""
    buffer, usage_comment = b"", None
    outcome.streamed = True
    try:
        chunks = response.aiter_raw()
        async for data in chunks if first_token_by is None else _until_first_token(chunks, outcome, first_token_by):
            events = (buffer + data).replace(b"\r\n", b"\n").split(b"\n\n")
            buffer = events.pop()
            out = []
            for event in events:
                if ours and event.startswith(headers.USAGE_PREFIX):
                    usage_comment = event
                    outcome.first_token(arrival_s)
                    continue
                if event == DONE:
                    if not ours and usage_mode != "none" and not outcome.usage_seen:
                        out.append(_counted_usage_event(outcome))  # what the client asked for, from the count
                    outcome.end("completed", 200)
                    outcome.stream_done = True
                    continue
                if event.startswith(ERROR_EVENT):
                    outcome.end("failed", 200, _error_code(event[6:]))
                elif not ours and not _external_event(event, outcome, arrival_s, usage_mode):
                    continue
                out.append(event + b"\n\n")
            if out:
                yield b"".join(out)
    except httpx.HTTPError as exc:
        outcome.end("failed", 200, UpstreamFailed.code)
        outcome.stream_done = True
        yield sse_event(error_body(UpstreamFailed(f"The replica failed mid-stream ({type(exc).__name__}).")))
    except TimeoutError:
        outcome.end("expired", 200, DeadlineExceeded.code)
        outcome.stream_done = True
        yield sse_event(error_body(DeadlineExceeded("The request did not start before its deadline.")))
    finally:
        await response.aclose()
        if usage_comment is not None:
            outcome.observe_usage(json.loads(usage_comment[len(headers.USAGE_PREFIX):]))
        if not ours:
            outcome.counted_usage()


async def _until_first_token(chunks: AsyncIterator[bytes], outcome: Outcome, first_token_by: float | None
                             ) -> AsyncGenerator[bytes, None]:
    """chunks; TimeoutError if first_token_by passes before the outcome has its first token."""
    chunks = aiter(chunks)
    while True:
        try:
            if outcome.ttft_s is not None:
                data = await anext(chunks)
            else:
                async with asyncio.timeout(max(first_token_by - time.monotonic(), 0.0)):
                    data = await anext(chunks)
        except StopAsyncIteration:
            return
        yield data


def _external_event(event: bytes, outcome: Outcome, arrival_s: float, usage_mode: str) -> bool:
    """Reads what an external server's event says of tokens and usage; False: not for the client."""
    if not event.startswith(b"data: "):
        return True
    try:
        chunk = json.loads(event[6:])
    except ValueError:
        return True  # not ours to judge: passed on as it came
    if not isinstance(chunk, dict):
        return True
    outcome.observe_usage(chunk.get("usage"))
    if outcome.stream_head is None:
        outcome.stream_head = {k: chunk[k] for k in ("id", "object", "created", "model") if k in chunk}
    if choices := chunk.get("choices"):
        outcome.text_chunks += sum(1 for c in choices if (c.get("delta") or {}).get("content") or c.get("text"))
        outcome.first_token(arrival_s)
        return True
    return usage_mode != "none"


def _counted_usage_event(outcome: Outcome) -> bytes:
    """The usage chunk a stream that said none would have ended with (Outcome.counted_usage)."""
    outcome.counted_usage()
    usage = {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
             "total_tokens": outcome.prompt_tokens + outcome.completion_tokens}
    return sse_event((outcome.stream_head or {}) | {"choices": [], "usage": usage})


def _seconds(raw: str | None) -> float | None:
    try:
        value = float(raw) if raw is not None else None
    except ValueError:
        return None
    return value if value is not None and 0.0 <= value < 86400.0 else None


def _error_code(content: bytes) -> str | None:
    try:
        return (json.loads(content).get("error") or {}).get("code")
    except (ValueError, AttributeError):
        return None
