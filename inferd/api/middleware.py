"""Request id, API key and the error shape, around every route."""
import hmac
import re
import time
import uuid

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferd.api.errors import AuthenticationFailed, ClientClosedRequest, error_response

REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


# request id, authentication and the error shape for every response

class RequestContextMiddleware:
    """Request id in and out, API key check on /v1/*, and the error shape for whatever escapes a route."""

    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        rid = _request_id(headers.get(b"x-request-id", b""))
        scope.setdefault("state", {}).update(request_id=rid, arrival_s=time.monotonic())
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = message | {"headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            self._authenticate(scope["path"], headers.get(b"authorization", b""))
            await self.app(scope, receive, send_with_id)
        except (ClientClosedRequest, ClientDisconnect):
            return
        except Exception as exc:
            if started:
                raise
            await error_response(exc)(scope, receive, send_with_id)

    def _authenticate(self, path: str, authorization: bytes) -> None:
        if self.api_key is None or not path.startswith("/v1/"):
            return
        scheme, _, key = authorization.partition(b" ")
        if scheme.lower() != b"bearer" or not key:
            raise AuthenticationFailed("Missing API key: send it as 'Authorization: Bearer <key>'.")
        if not hmac.compare_digest(key.strip(), self.api_key):
            raise AuthenticationFailed("Incorrect API key provided.")


def _request_id(raw: bytes) -> str:
    text = raw.decode("latin-1")
    return text if REQUEST_ID.fullmatch(text) else f"req_{uuid.uuid4().hex}"


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    return error_response(exc)
