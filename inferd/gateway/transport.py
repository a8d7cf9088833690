"""The gateway's HTTP/1.1 client transport to its upstreams: keep-alive connections and a C parser.

An httpx transport (httpx.AsyncBaseTransport), so the gateway's data path, its probes and its tests
(httpx.MockTransport) speak one interface. httpx's own pool costs the gateway more CPU per request than
the rest of its work (it checks every pooled connection on each request); here an idle connection that
the server closes leaves the pool when its end-of-file arrives, so picking one is a list pop. https://
upstreams go through httpx's own transport. A replica placed inside the gateway's process (control/in_process.py)
is an ASGI app mounted under its URL's host: a request to it is a call on the same event loop, its response
streamed as the app sends it; the data path does not know the difference.
"""
import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

import httptools
import httpx

log = logging.getLogger(__name__)

ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]

MAX_IDLE_PER_HOST = 256
# An idle connection is reused only this long: uvicorn (our replicas, vLLM's and llama.cpp's servers) closes one
# idle for 5 s, and a request sent while that close is on its way fails with nothing read (CI saw a 503 on the
# first request 5.4 s after the gateway's last probe; with one replica there was no other to try).
MAX_IDLE_S = 4.0
MAX_BUFFERED_CHUNKS = 64  # past this many unread body chunks the connection stops reading (backpressure)


class _Connection(asyncio.Protocol):
    """One TCP connection; one request at a time. httptools calls the on_* methods while parsing."""

    def __init__(self):
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.busy = False
        self._parser: httptools.HttpResponseParser | None = None
        self._head: asyncio.Future | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._chunks: deque[bytes] = deque()
        self._readable = asyncio.Event()
        self._complete = False
        self._keep_alive = False
        self._error: Exception | None = None
        self._paused = False
        self.idle_since = 0.0  # time.monotonic() when it went back to the pool

    # asyncio.Protocol

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._parser is None:  # bytes while idle: the server is confused; drop the connection
            self.transport.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"invalid HTTP response: {exc}"))
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._parser is not None and not self._complete:
            self._fail(httpx.RemoteProtocolError("the server closed the connection before the response ended"))

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        if not self._head.done():
            self._head.set_result(self._parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._readable.set()
        if len(self._chunks) >= MAX_BUFFERED_CHUNKS and not self._paused:
            self._paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self._complete = True
        self._keep_alive = self._parser.should_keep_alive()  # read now: the parser resets after this call
        self._readable.set()

    # used by the transport

    async def request(self, data: bytes, timeout_s: float | None) -> tuple[int, list[tuple[bytes, bytes]]]:
        self.busy = True
        self._parser = httptools.HttpResponseParser(self)
        self._head = asyncio.get_running_loop().create_future()
        self._headers, self._complete, self._keep_alive, self._error = [], False, False, None
        self.transport.write(data)
        async with asyncio.timeout(timeout_s):
            status = await self._head
        return status, self._headers

    async def chunks(self, timeout_s: float | None):
        while True:
            while self._chunks:
                chunk = self._chunks.popleft()
                if self._paused and len(self._chunks) < MAX_BUFFERED_CHUNKS // 2:
                    self._paused = False
                    self.transport.resume_reading()
                yield chunk
            if self._error is not None:
                raise self._error
            if self._complete:
                return
            self._readable.clear()
            async with asyncio.timeout(timeout_s):
                await self._readable.wait()

    def reusable(self) -> bool:
        return self._complete and self._keep_alive and not self.closed

    def release(self) -> None:
        self.busy, self._parser = False, None
        self._chunks.clear()

    def _fail(self, exc: Exception) -> None:
        self._error = exc
        if self._head is not None and not self._head.done():
            self._head.set_exception(exc)
        self._readable.set()


class _Body(httpx.AsyncByteStream):
    def __init__(self, pool: "UpstreamTransport", key: tuple[str, int], conn: _Connection, timeout_s: float | None):
        self._pool, self._key, self._conn, self._timeout_s = pool, key, conn, timeout_s

    async def __aiter__(self):
        try:
            async for chunk in self._conn.chunks(self._timeout_s):
                yield chunk
        except asyncio.TimeoutError:
            raise httpx.ReadTimeout("the upstream sent nothing within the read timeout") from None

    async def aclose(self) -> None:
        self._pool._put_back(self._key, self._conn)


class UpstreamTransport(httpx.AsyncBaseTransport):
    def __init__(self, connect_timeout_s: float = 5.0):
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._apps: dict[str, ASGIApp] = {}  # in-process replicas by their URL's host
        self._tls = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=4096, max_keepalive_connections=512))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if (app := self._apps.get(url.host)) is not None:
            return await _app_response(app, request)
        if url.scheme != "http":
            return await self._tls.handle_async_request(request)
        timeouts = request.extensions.get("timeout") or {}
        key = (url.host, url.port or 80)
        conn = await self._connection(key, timeouts.get("connect") or self.connect_timeout_s)
        read_timeout_s = timeouts.get("read")
        try:
            status, headers = await conn.request(await _request_bytes(request), read_timeout_s)
        except asyncio.TimeoutError:
            conn.transport.close()
            raise httpx.ReadTimeout("the upstream did not answer within the read timeout") from None
        except BaseException:
            conn.transport.close()
            raise
        return httpx.Response(status, headers=headers, stream=_Body(self, key, conn, read_timeout_s),
                              extensions={"http_version": b"HTTP/1.1"}, request=request)

    def mount(self, host: str, app: ASGIApp) -> None:
        """Requests to http://HOST go to app, in this process (its lifespan is its owner's to run)."""
        self._apps[host] = app

    def unmount(self, host: str) -> None:
        self._apps.pop(host, None)

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.transport.close()
        self._idle.clear()
        await self._tls.aclose()

    async def _connection(self, key: tuple[str, int], timeout_s: float) -> _Connection:
        idle, now = self._idle.get(key), time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < MAX_IDLE_S:
                return conn
            conn.transport.close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await loop.create_connection(_Connection, *key)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection to {key[0]}:{key[1]} within {timeout_s} s") from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {key[0]}:{key[1]}: {exc}") from None
        return conn

    def _put_back(self, key: tuple[str, int], conn: _Connection) -> None:
        if not conn.busy:
            return
        reusable = conn.reusable()
        conn.release()
        idle = self._idle.setdefault(key, [])
        if reusable and len(idle) < MAX_IDLE_PER_HOST:
            conn.idle_since = time.monotonic()
            idle.append(conn)
        else:
            conn.transport.close()


async def _request_bytes(request: httpx.Request) -> bytes:
    body = request.content if isinstance(request.stream, httpx.ByteStream) else await request.aread()
    target = request.url.raw_path
    lines = [request.method.encode() + b" " + target + b" HTTP/1.1"]
    lines += [name + b": " + value for name, value in request.headers.raw]
    if body and b"content-length" not in (n.lower() for n, _ in request.headers.raw):
        lines.append(b"content-length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body



# in-process apps

class _AppCall:
    """One request to an in-process ASGI app: the app runs as a task of its own (as uvicorn runs it), its
    response head and body chunks come back as it sends them; closing the body early tells the app the
    client left (http.disconnect)."""

    running: set[asyncio.Task] = set()  # the calls' tasks, kept until they end

    def __init__(self, app: ASGIApp, scope: dict, body: bytes):
        self._body: bytes | None = body
        self._head: asyncio.Future = asyncio.get_running_loop().create_future()
        self._chunks: asyncio.Queue = asyncio.Queue()
        self._gone = asyncio.Event()
        task = asyncio.create_task(self._run(app, scope))
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def _run(self, app: ASGIApp, scope: dict) -> None:
        try:
            await app(scope, self._receive, self._send)
        except Exception as exc:  # as uvicorn does: logged; a client still waiting for a head gets an error
            log.exception("in-process replica failed on %s %s", scope["method"], scope["path"])
            if not self._head.done():
                self._head.set_exception(httpx.RemoteProtocolError(f"the in-process replica failed: {exc!r}"))
        finally:
            if not self._head.done():
                self._head.set_exception(httpx.RemoteProtocolError("the in-process replica sent no response"))
            self._chunks.put_nowait(None)

    async def _receive(self) -> dict:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict) -> None:
        if self._gone.is_set():  # the gateway closed the response: what follows goes nowhere (as uvicorn's send)
            return
        if message["type"] == "http.response.start":
            self._head.set_result((message["status"], message.get("headers", [])))
        elif message["type"] == "http.response.body":
            if chunk := message.get("body", b""):
                self._chunks.put_nowait(chunk)
            if not message.get("more_body", False):
                self._chunks.put_nowait(None)

    async def head(self, timeout_s: float | None) -> tuple[int, list[tuple[bytes, bytes]]]:
        try:
            async with asyncio.timeout(timeout_s):
                return await self._head
        except BaseException:
            self.close()
            raise

    async def chunks(self, timeout_s: float | None):
        while True:
            async with asyncio.timeout(timeout_s):
                chunk = await self._chunks.get()
            if chunk is None:
                return
            yield chunk

    def close(self) -> None:
        self._gone.set()


class _AppBody(httpx.AsyncByteStream):
    def __init__(self, call: _AppCall, timeout_s: float | None):
        self._call, self._timeout_s = call, timeout_s

    async def __aiter__(self):
        try:
            async for chunk in self._call.chunks(self._timeout_s):
                yield chunk
        except asyncio.TimeoutError:
            raise httpx.ReadTimeout("the in-process replica sent nothing within the read timeout") from None

    async def aclose(self) -> None:
        self._call.close()


async def _app_response(app: ASGIApp, request: httpx.Request) -> httpx.Response:
    url = request.url
    body = request.content if isinstance(request.stream, httpx.ByteStream) else await request.aread()
    path, _, query = url.raw_path.partition(b"?")
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
             "scheme": "http", "path": url.path, "raw_path": path, "query_string": query, "root_path": "",
             "headers": [(n.lower(), v) for n, v in request.headers.raw], "server": (url.host, url.port or 80),
             "client": ("127.0.0.1", 0)}
    read_timeout_s = (request.extensions.get("timeout") or {}).get("read")
    call = _AppCall(app, scope, body)
    try:
        status, headers = await call.head(read_timeout_s)
    except asyncio.TimeoutError:
        raise httpx.ReadTimeout("the in-process replica did not answer within the read timeout") from None
    return httpx.Response(status, headers=headers, stream=_AppBody(call, read_timeout_s),
                          extensions={"http_version": b"HTTP/1.1"}, request=request)
