"""Header names and the values they carry between client, gateway and replica, parsed in one place."""
import json
from typing import Literal, get_args

from inferd.protocol.errors import InvalidRequest

REQUEST_ID = "x-request-id"  # the client's (or a generated) id, passed on to the replica and its engine
DEADLINE_MS = "x-inferd-deadline-ms"  # the client's deadline; from the gateway: the milliseconds left
PRIORITY = "x-inferd-priority"  # the scheduling class; a client may only lower its key's
CACHE_NAMESPACE = "x-inferd-cache-namespace"  # gateway -> replica: the tenant whose prefix cache to use
TENANT = "x-inferd-tenant"  # gateway -> replica
USAGE_EVENTS = "x-inferd-usage-events"  # gateway -> replica: "1" asks for usage as SSE comments (USAGE_PREFIX)
USAGE = "x-inferd-usage"  # replica -> gateway: a unary answer's usage object (JSON), so its body is not parsed
DECODE_S = "x-inferd-decode-s"  # replica -> gateway: a unary answer's seconds from its first output token to its end
RESPONSE_CACHE = "x-inferd-cache"  # gateway -> client: hit, miss, bypass or uncacheable (a deployment with a cache)
FALLBACK = "x-inferd-fallback"  # gateway -> client: "a->b" when a fallback deployment answered
DEGRADED = "x-inferd-degraded"  # gateway -> client: the degradation steps applied
ASYNC = "x-inferd-async"  # client -> gateway: "1" answers 202 with a job, as `Prefer: respond-async` does
WEBHOOK_URL = "x-inferd-webhook-url"  # client -> gateway: where an async job's result is POSTed, signed

USAGE_PREFIX = b": usage "  # an SSE comment holding the usage so far; clients ignore comments

PriorityClass = Literal["interactive", "batch"]
PRIORITY_CLASSES: tuple[PriorityClass, ...] = get_args(PriorityClass)  # dispatch order: interactive first

UsageStatus = Literal["completed", "failed", "cancelled", "rejected", "expired"]
USAGE_STATUSES: tuple[UsageStatus, ...] = get_args(UsageStatus)


def deadline_ms(raw: str | None) -> int | None:
    """The value of DEADLINE_MS; raises InvalidRequest unless a positive integer."""
    if raw is None:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise InvalidRequest(f"{DEADLINE_MS} must be a positive integer (milliseconds)", param=DEADLINE_MS)
    return int(raw)


def priority_class(raw: str | None) -> PriorityClass | None:
    """The value of PRIORITY; raises InvalidRequest unless one of PRIORITY_CLASSES."""
    if raw is None:
        return None
    if raw not in PRIORITY_CLASSES:
        raise InvalidRequest(f"{PRIORITY} must be one of {', '.join(PRIORITY_CLASSES)}", param=PRIORITY)
    return raw


def usage_headers(prompt_tokens: int, completion_tokens: int = 0) -> dict[str, str]:
    """A unary answer's USAGE header (the usage object the gateway counts); a classical answer's rows count
    as its prompt tokens."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    return {USAGE: json.dumps(usage, separators=(",", ":"))}
