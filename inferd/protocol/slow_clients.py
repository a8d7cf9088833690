"""uvicorn's HTTP protocol (httptools) with what it lacks against slow or hostile clients: a deadline for
reading each request and a cap on its head.

uvicorn's timeout_keep_alive (5 s) only runs while a connection is idle between requests, and any byte
cancels it; a client that trickles its headers or its body a byte at a time holds its connection (and, for
a body, a request in the app) forever, and httptools itself caps no header size. Here a request's head must
arrive within HEADERS_TIMEOUT_S of the connection or of the previous answer, and its body within
BODY_TIMEOUT_S of its head; past either the connection is closed (the app sees a disconnect). A head above
MAX_HEAD_BYTES is answered 400, like a request httptools cannot parse, in the error shape (uvicorn's own
answer is plain text). A WebSocket, once upgraded, is not this protocol's any more.

A deadline is a number on the connection; one timer a server, every SWEEP_S while it has connections, closes
those past theirs (not a timer armed and cancelled for each request's head and body)."""
import json
import time

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from inferd.protocol.errors import InvalidRequest, error_body

HEADERS_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0  # a 200 MiB file upload needs 3.4 MiB/s
MAX_HEAD_BYTES = 64 * 1024
SWEEP_S = 0.5  # a deadline holds to within this


class ReadDeadlineProtocol(HttpToolsProtocol):
    """Pass as uvicorn.run(http=ReadDeadlineProtocol)."""
    _deadline_s: float | None = None  # time.monotonic() by which the request (head or body) must have come
    _head_bytes = 0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(HEADERS_TIMEOUT_S)
        if getattr(self.server_state, "deadline_sweep", None) is None:
            self.server_state.deadline_sweep = self.loop.call_later(SWEEP_S, _sweep, self.loop, self.server_state)

    def on_message_begin(self) -> None:
        self._head_bytes = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(name + value)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm(BODY_TIMEOUT_S)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm(HEADERS_TIMEOUT_S)

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(error_body(InvalidRequest(msg, code="invalid_http_request"))).encode()
        defaults = [name + b": " + value for name, value in self.server_state.default_headers]
        head = [b"HTTP/1.1 400 Bad Request", *defaults,
                b"content-type: application/json", b"content-length: %d" % len(body), b"connection: close"]
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        self.transport.close()

    def handle_websocket_upgrade(self) -> None:
        self._disarm()
        super().handle_websocket_upgrade()

    def _count(self, part: bytes) -> None:
        self._head_bytes += len(part)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise ValueError("head too large")  # httptools stops parsing; data_received answers 400

    def _arm(self, seconds: float) -> None:
        self._deadline_s = time.monotonic() + seconds

    def _disarm(self) -> None:
        self._deadline_s = None

    def _expired(self) -> None:
        self._deadline_s = None
        if not self.transport.is_closing():
            self.transport.close()


def _sweep(loop, state) -> None:
    """Closes the server's connections past their deadline; again in SWEEP_S while any is open (uvicorn's
    ServerState keeps them: a connection leaves it when it closes)."""
    now = time.monotonic()
    for connection in list(state.connections):
        if (deadline_s := getattr(connection, "_deadline_s", None)) is not None and deadline_s <= now:
            connection._expired()
    state.deadline_sweep = loop.call_later(SWEEP_S, _sweep, loop, state) if state.connections else None
