"""uvicorn's HTTP protocol (httptools) with what it lacks against slow or hostile clients: a deadline for
reading each request and a cap on its head.

uvicorn's timeout_keep_alive (5 s) only runs while a connection is idle between requests, and any byte
cancels it; a client that trickles its headers or its body a byte at a time holds its connection (and, for
a body, a request in the app) forever, and httptools itself caps no header size. Here a request's head must
arrive within HEADERS_TIMEOUT_S of the connection or of the previous answer, and its body within
BODY_TIMEOUT_S of its head; past either the connection is closed (the app sees a disconnect). A head above
MAX_HEAD_BYTES is answered 400, like a request httptools cannot parse, in the error shape (uvicorn's own
answer is plain text). A WebSocket, once upgraded, is not this protocol's any more."""
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from inferd.protocol.errors import InvalidRequest, error_body

HEADERS_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0  # a 200 MiB file upload needs 3.4 MiB/s
MAX_HEAD_BYTES = 64 * 1024


class ReadDeadlineProtocol(HttpToolsProtocol):
    """Pass as uvicorn.run(http=ReadDeadlineProtocol)."""
    _deadline = None
    _head_bytes = 0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(HEADERS_TIMEOUT_S)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

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
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()
