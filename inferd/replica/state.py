"""What every replica server (text, embedding, classical) reads and keeps the same way."""
import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inferd.protocol import headers
from inferd.protocol.errors import APIError, ClientClosedRequest, DeadlineExceeded

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Readiness:
    ready: bool = False
    loaded_unix_s: float | None = None  # when the model was loaded (cold start)
    warm_unix_s: float | None = None  # when the readiness inference finished


def deadline_s(request: Request) -> float | None:
    """DEADLINE_MS (from the gateway: the milliseconds left) on the monotonic clock; work not started by
    then is dropped."""
    ms = headers.deadline_ms(request.headers.get(headers.DEADLINE_MS))
    return None if ms is None else request.state.arrival_s + ms / 1000


def outcome(exc: BaseException) -> str:
    """How a request that raised ended, as the replicas' request metrics label it."""
    match exc:
        case DeadlineExceeded():
            return "expired"
        case ClientClosedRequest() | asyncio.CancelledError():
            return "cancelled"
        case APIError() if exc.status < 500 or exc.status == 503:
            return "rejected"
    return "failed"


def status_routes(readiness: Readiness, queue: Callable[[], dict], render_metrics: Callable[[], bytes]) -> list[Route]:
    """/health, /ready (503 until warm; the load and warm times and what queue() says waits) and /metrics, alike
    for the kinds over the batcher."""
    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        body = {"loaded_unix_s": readiness.loaded_unix_s, "warm_unix_s": readiness.warm_unix_s} | queue()
        if readiness.ready:
            return JSONResponse({"status": "ready"} | body)
        return JSONResponse({"status": "not ready"} | body, status_code=503)

    async def metrics(request: Request) -> Response:
        return Response(render_metrics(), media_type=CONTENT_TYPE_LATEST)

    return [Route("/health", health, methods=["GET"]), Route("/ready", ready, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"])]


def batched_lifespan(runtime, readiness: Readiness, warm_up: Callable[[], Awaitable[str]]):
    """The app's life for a runtime over the batcher: started with the app, ready once warm_up (a real inference
    that raises if its answer is wrong; it returns what the ready log line says) has run, stopped at the end."""
    @asynccontextmanager
    async def lifespan(app) -> AsyncIterator[None]:
        runtime.start()
        probe = asyncio.create_task(_warm(warm_up, readiness))
        try:
            yield
        finally:
            probe.cancel()
            readiness.ready = False
            await runtime.stop()
    return lifespan


async def _warm(warm_up: Callable[[], Awaitable[str]], readiness: Readiness) -> None:
    try:
        said = await warm_up()
    except Exception as exc:
        log.error("readiness inference failed: %s: %s", type(exc).__name__, exc)
        return
    gc.collect()
    gc.freeze()  # what start-up made (libraries, the model) is never walked by a full collection again
    readiness.warm_unix_s = time.time()
    readiness.ready = True
    log.info("replica ready: %s", said)
