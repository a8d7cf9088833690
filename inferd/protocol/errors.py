"""The error tree every route answers with, and the one mapping from exceptions to it.

    APIError                 OpenAI's error object: status, type, code, param, message
    ├── InvalidRequest (400) ── ContextLengthExceeded
    ├── AuthenticationFailed (401)
    ├── PermissionDenied (403)
    ├── NotFound (404) ── ModelNotFound
    ├── MethodNotAllowed (405), PayloadTooLarge (413), ClientClosedRequest (499)
    ├── RateLimitExceeded (429)
    ├── InternalError (500)
    ├── ServiceUnavailable (503) ── Overloaded, UpstreamFailed, DeadlineUnmeetable
    └── DeadlineExceeded (504)

A replica maps its runtime's own errors before these (replica/errors.py) and passes that mapping to
the middleware; everything else that escapes a route is an InternalError, logged with its traceback.
"""
import json
import logging

import orjson
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

log = logging.getLogger(__name__)

_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


# typed errors

class APIError(Exception):
    """An error the client can act on; rendered as OpenAI's error object."""
    status: int = 400
    type: str = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}
        if code is not None:
            self.code = code


class InvalidRequest(APIError):
    pass


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class AuthenticationFailed(APIError):
    status = 401
    code = "invalid_api_key"


class NotFound(APIError):
    status = 404
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class PermissionDenied(APIError):
    status = 403
    type = "permission_error"
    code = "permission_denied"


class RateLimitExceeded(APIError):
    """A tenant's limit; code names it (requests_per_minute, tokens_per_minute, max_concurrency, budget)."""
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class ServiceUnavailable(APIError):
    status = 503
    type = "server_error"
    code = "service_unavailable"


class Overloaded(ServiceUnavailable):
    """The deployment's queue is full; retry after the Retry-After header."""
    status = 503
    type = "server_error"
    code = "queue_full"


class UpstreamFailed(ServiceUnavailable):
    code = "upstream_unavailable"


class DeadlineUnmeetable(ServiceUnavailable):
    code = "deadline_unmeetable"


class DeadlineExceeded(APIError):
    status = 504
    type = "timeout_error"
    code = "deadline_exceeded"


class MethodNotAllowed(APIError):
    status = 405
    code = "method_not_allowed"


class PayloadTooLarge(APIError):
    status = 413
    code = "payload_too_large"


class ClientClosedRequest(APIError):
    status = 499
    code = "client_closed_request"


class InternalError(APIError):
    status = 500
    type = "server_error"
    code = "internal_error"


# mapping: every exception becomes one APIError, in this one place

def to_api_error(exc: BaseException) -> APIError:
    match exc:
        case APIError():
            return exc
        case ValidationError():
            return _from_validation(exc)
        case json.JSONDecodeError() | UnicodeDecodeError():
            return InvalidRequest("The request body is not valid JSON.", code="invalid_json")
        case HTTPException():
            return _from_http(exc)
    log.error("internal error", exc_info=(type(exc), exc, exc.__traceback__))
    return InternalError("The server had an error while processing your request.")


def error_body(err: APIError) -> dict:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def error_response(exc: BaseException, map_error=to_api_error) -> Response:
    err = map_error(exc)
    return Response(orjson.dumps(error_body(err)), status_code=err.status, headers=err.headers or None,
                    media_type="application/json")


# helpers

def _from_validation(exc: ValidationError) -> InvalidRequest:
    first = min(exc.errors(include_url=False, include_input=False), key=_specificity)
    parts = [str(p) for p in first["loc"] if not _is_union_tag(p)]
    param = ".".join(parts) or None
    msg = str(first["msg"]).removeprefix("Value error, ")
    if param is None:
        return InvalidRequest(f"Invalid request body: {msg}")
    if first["type"] == "missing":
        return InvalidRequest(f"'{param}' is a required property", param=param)
    return InvalidRequest(f"Invalid '{param}': {msg}", param=param)


def _specificity(error: dict) -> tuple[bool, int]:
    """Among a union's failed branches, the one that got furthest says most."""
    return str(error["type"]).endswith("_type"), -len(error["loc"])


def _is_union_tag(part: str | int) -> bool:
    return isinstance(part, str) and (part in _UNION_TAGS or "[" in part or "-" in part)


def _from_http(exc: HTTPException) -> APIError:
    match exc.status_code:
        case 404:
            return NotFound("Not found.")
        case 405:
            return MethodNotAllowed("Method not allowed.")
        case 413:
            return PayloadTooLarge("The request body is too large.")
    err = APIError(str(exc.detail))
    err.status = exc.status_code
    return err
