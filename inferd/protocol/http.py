"""What every route of gateway and replica shares: request id, API key, body reading, disconnects, errors.

Errors take the shape of the API they answer: the Open Inference Protocol's (`{"error": "..."}`) on its
paths (oip.PATHS), Anthropic's on its messages paths (anthropic.PATHS), OpenAI's everywhere else, an unknown
route under /v2/ included. Every app answers the router's own 404 and 405 (HTTPException) through
http_exception_handler, in the same shape."""
import asyncio
import hmac
import inspect
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import orjson

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferd.protocol.anthropic import PATHS as ANTHROPIC_PATHS, error_response as anthropic_error_response
from inferd.protocol.errors import (APIError, AuthenticationFailed, ClientClosedRequest, PayloadTooLarge,
                                    error_response, to_api_error)
from inferd.protocol.headers import REQUEST_ID as REQUEST_ID_HEADER
from inferd.protocol.ids import new_id
from inferd.protocol.oip import PATHS as OIP_PATHS, oip_error_response

T = TypeVar("T")

REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


# request id, authentication and the error shape for every response

class RequestContextMiddleware:
    """Request id in and out, API key check on /v1/* and /v2/*, and the error shape for whatever escapes a
    route."""

    def __init__(self, app: ASGIApp, api_key: str | None,
                 map_error: Callable[[BaseException], APIError] = to_api_error):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.map_error = map_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        rid = _request_id(headers.get(REQUEST_ID_HEADER.encode(), b""))
        scope.setdefault("state", {}).update(request_id=rid, arrival_s=time.monotonic())
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = message | {"headers": [*message.get("headers", []), (REQUEST_ID_HEADER.encode(), rid.encode())]}
            await send(message)

        try:
            self._authenticate(scope["path"], headers.get(b"authorization", b""))
            await self.app(scope, receive, send_with_id)
        except (ClientClosedRequest, ClientDisconnect):
            return
        except Exception as exc:
            if started:
                raise
            await error_response_for(scope["path"], exc, self.map_error)(scope, receive, send_with_id)

    def _authenticate(self, path: str, authorization: bytes) -> None:
        if self.api_key is None or not path.startswith(("/v1/", "/v2/")) and path != "/v2":
            return
        scheme, _, key = authorization.partition(b" ")
        if scheme.lower() != b"bearer" or not key:
            raise AuthenticationFailed("Missing API key: send it as 'Authorization: Bearer <key>'.")
        if not hmac.compare_digest(key.strip(), self.api_key):
            raise AuthenticationFailed("Incorrect API key provided.")


def build_app(routes: list[BaseRoute], lifespan, api_key: str | None, map_error=to_api_error) -> Starlette:
    """Every app's (the gateway's and each replica's): request id, key and error shape for all routes, the POST
    routes of fixed paths answered directly, the router's own 404 and 405 in the error shape."""
    return Starlette(routes=routes, lifespan=lifespan,
                     middleware=[Middleware(RequestContextMiddleware, api_key=api_key, map_error=map_error),
                                 Middleware(DirectRoutes, routes=routes)],
                     exception_handlers={HTTPException: http_exception_handler})


class DirectRoutes:
    """POST routes of fixed paths answered from a dict, ahead of the router: the hot routes skip matching every
    route's pattern and Starlette's per-route exception wrapper (benchmarks/refusal_path.py measures it).
    It sits after RequestContextMiddleware, which gives their errors their shape; anything else (another
    method, a path with parameters) goes on to the router, which keeps its 404 and 405 answers. A route is
    taken only where the router would pick it for its path (no earlier route matches it)."""

    def __init__(self, app: ASGIApp, routes: list[BaseRoute]):
        self.app = app
        self.endpoints: dict[str, Callable[[Request], Awaitable[Response]]] = {}
        for route in routes:
            if not (isinstance(route, Route) and "POST" in (route.methods or ()) and not route.param_convertors
                    and inspect.iscoroutinefunction(route.endpoint)):
                continue
            scope = {"type": "http", "path": route.path, "root_path": "", "method": "POST"}
            if next(r for r in routes if r.matches(scope)[0] is Match.FULL) is route:
                self.endpoints[route.path] = route.endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.endpoints.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" \
            else None
        if endpoint is None:
            return await self.app(scope, receive, send)
        response = await endpoint(Request(scope, receive, send))
        await response(scope, receive, send)


def _request_id(raw: bytes) -> str:
    text = raw.decode("latin-1")
    return text if REQUEST_ID.fullmatch(text) else f"req_{new_id()}"


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Every app's handler of HTTPException (the router's 404 and 405, which Starlette answers in plain text)."""
    return error_response_for(request.url.path, exc)


def error_response_for(path: str, exc: BaseException, map_error=to_api_error) -> Response:
    if OIP_PATHS.fullmatch(path):
        return oip_error_response(exc, map_error)
    if path in ANTHROPIC_PATHS:
        return anthropic_error_response(exc, map_error)
    return error_response(exc, map_error)


# request bodies and disconnects

def decode_json(content: bytes | str) -> Any:
    """The body's JSON (orjson: strict UTF-8, no NaN or Infinity, at most 1,024 levels deep); anything else is
    json.JSONDecodeError, an invalid body (never a RecursionError, which would be a 500)."""
    return orjson.loads(content)


async def read_json(request: Request, max_body_bytes: int) -> Any:
    return decode_json(await read_body(request, max_body_bytes))


async def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The whole body; ClientClosedRequest if the client goes away before it has sent it."""
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise PayloadTooLarge(f"The request body is larger than {max_body_bytes} bytes.")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientClosedRequest("The client closed the connection.") from None
    return b"".join(chunks)


def whole_body(body: bytes) -> Receive:
    """The ASGI receive of a request made in process with all its body: the body, then nothing until the call is
    cancelled (no client goes away)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
    return receive


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@asynccontextmanager
async def cancelled_on_disconnect(request: Request) -> AsyncIterator[None]:
    """The body runs in the current task; if the client goes away first, it is cancelled and
    ClientClosedRequest raised. Enter it only once the request body has been read."""
    task, gone = asyncio.current_task(), False

    async def watch() -> None:
        nonlocal gone
        await _wait_for_disconnect(request)
        gone = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()
        raise ClientClosedRequest("The client closed the connection.") from None
    finally:
        watcher.cancel()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits work, unless the client goes away first (then ClientClosedRequest)."""
    async with cancelled_on_disconnect(request):
        return await work
