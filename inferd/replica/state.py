"""What every replica server (text, embedding, classical) reads and keeps the same way."""
import asyncio
from dataclasses import dataclass

from starlette.requests import Request

from inferd.protocol import headers
from inferd.protocol.errors import APIError, ClientClosedRequest, DeadlineExceeded


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
