import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

import httpx

from inferd.bench.tokenizer import ApiKind
from inferd.bench.workloads import BenchRequest

Outcome = Literal["pending", "completed", "rejected", "failed", "cancelled", "timed_out"]
REJECT_STATUSES = (429, 503)


@dataclass(slots=True)
class Endpoint:
    """Where and how requests go: base_url is the server root or its /v1."""
    base_url: str
    model: str
    api: ApiKind = "chat"
    api_key: str | None = None
    timeout_s: float = 300.0
    extra_body: dict = field(default_factory=dict)

    @property
    def v1_url(self) -> str:
        root = self.base_url.rstrip("/")
        return root if root.endswith("/v1") else f"{root}/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, request: BenchRequest) -> dict:
        base = {"model": self.model, "max_tokens": request.max_tokens, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        if request.messages is not None:  # a quality item: greedy, its own stop, checked afterwards
            return {k: v for k, v in base.items() if k != "ignore_eos"} | {"messages": request.messages,
                                                                          "temperature": 0, "seed": 0}
        if self.api == "chat":
            return base | {"messages": [{"role": "user", "content": request.text}]} | self.extra_body
        return base | {"prompt": request.text} | self.extra_body


@dataclass(slots=True)
class RequestRecord:
    """What one request saw; times in seconds, sent_s from the run's start, chunk_s from sent_s."""
    index: int
    scheduled_s: float
    input_tokens: int
    sent_s: float = 0.0
    outcome: Outcome = "pending"
    chunk_s: list[float] = field(default_factory=list)
    done_s: float | None = None
    output_tokens: int = 0
    usage_seen: bool = False
    finish_reason: str | None = None
    status: int | None = None
    error_type: str | None = None
    retry_after: str | None = None  # the Retry-After header of a rejection, as sent
    reply: list[str] = field(default_factory=list)  # the streamed text, in pieces
    passed_check: bool | None = None  # quality set: its reply passed the item's check (None: no check)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] if self.chunk_s else None

    @property
    def e2e_s(self) -> float | None:
        return self.done_s

    @property
    def tpot_s(self) -> float | None:
        if self.outcome != "completed" or self.output_tokens < 2 or self.done_s is None or not self.chunk_s:
            return None
        return (self.done_s - self.chunk_s[0]) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]


# one streamed request

async def send(client: httpx.AsyncClient, endpoint: Endpoint, request: BenchRequest, record: RequestRecord,
               run_start_s: float) -> RequestRecord:
    """Streams one request; every outcome lands in record, never raises for the server's or network's faults."""
    start = time.perf_counter()
    record.sent_s = start - run_start_s
    try:
        async with asyncio.timeout(endpoint.timeout_s):
            await _exchange(client, endpoint, request, record, start)
    except (httpx.TimeoutException, TimeoutError):
        record.outcome, record.error_type = "timed_out", "timeout"
    except httpx.HTTPError as exc:
        record.outcome, record.error_type = "failed", type(exc).__name__
    return record


async def _exchange(client: httpx.AsyncClient, endpoint: Endpoint, request: BenchRequest, record: RequestRecord,
                    start: float) -> None:
    url = f"{endpoint.v1_url}/{'chat/completions' if endpoint.api == 'chat' else 'completions'}"
    async with client.stream("POST", url, json=endpoint.body(request), headers=endpoint.headers,
                             timeout=endpoint.timeout_s) as response:
        record.status = response.status_code
        if response.status_code != 200:
            await _refused(response, record)
            return
        await _read_stream(response, record, request.cancel_after_chunks, start)


async def _refused(response: httpx.Response, record: RequestRecord) -> None:
    await response.aread()
    if response.status_code in REJECT_STATUSES:
        record.outcome = "rejected"
        record.retry_after = response.headers.get("retry-after")
        return
    record.outcome, record.error_type = "failed", _error_type(response)


async def _read_stream(response: httpx.Response, record: RequestRecord, cancel_after: int | None,
                       start: float) -> None:
    async for line in sse_lines(response.aiter_bytes()):
        now = time.perf_counter()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            record.done_s, record.outcome = now - start, "completed"
            return
        if not _on_event(_decode(data), record, now - start):
            return
        if cancel_after is not None and len(record.chunk_s) >= cancel_after:
            record.done_s, record.outcome = now - start, "cancelled"
            return
    record.outcome, record.error_type = "failed", "incomplete_stream"


LINE_END = re.compile(rb"\r\n|\n|\r")


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """A stream's lines as SSE ends them: at CR LF, LF or CR only. httpx's aiter_lines (str.splitlines) also ends
    one at U+2028, U+2029 or U+0085, which a server's JSON may hold unescaped, and so cut an event in two."""
    buffer = b""
    async for data in chunks:
        buffer += data
        held = len(buffer) - buffer.endswith(b"\r")  # a CR at the end may be half of a CR LF
        *lines, rest = LINE_END.split(buffer[:held])
        buffer = rest + buffer[held:]
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    if buffer.rstrip(b"\r"):
        yield buffer.rstrip(b"\r").decode("utf-8", errors="replace")


def _on_event(event: dict, record: RequestRecord, at_s: float) -> bool:
    """Takes one SSE event; False when it carries an error."""
    if "error" in event:
        record.outcome, record.error_type = "failed", _error_name(event["error"])
        return False
    if usage := event.get("usage"):
        record.output_tokens, record.input_tokens, record.usage_seen = (
            usage.get("completion_tokens", 0), usage.get("prompt_tokens", record.input_tokens), True)
    for choice in event.get("choices") or []:
        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
        if text:
            record.reply.append(text)
            record.chunk_s.append(at_s)
            if not record.usage_seen:
                record.output_tokens = len(record.chunk_s)
        record.finish_reason = choice.get("finish_reason") or record.finish_reason
    return True


def _decode(data: str) -> dict:
    try:
        event = json.loads(data)
    except ValueError:
        return {"error": {"code": "malformed_event"}}
    return event if isinstance(event, dict) else {"error": {"code": "malformed_event"}}


# error details

def _error_type(response: httpx.Response) -> str:
    try:
        return _error_name(response.json().get("error") or {})
    except (ValueError, AttributeError):
        return f"http_{response.status_code}"


def _error_name(error: dict | str) -> str:
    if not isinstance(error, dict):
        return "stream_error"
    return str(error.get("code") or error.get("type") or "stream_error")

