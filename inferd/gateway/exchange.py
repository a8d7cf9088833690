"""One request's state as its lifecycle (lifecycle.py) keeps it: the exchange, its attempts and their admissions,
the response head; and what is read from a request before it is planned: the model it names, its class and
deadline, the deployment it may use."""
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry import trace
from starlette.requests import Request

from inferd.gateway import relay
from inferd.gateway.charges import Plan
from inferd.gateway.deployments import Deployment, Upstream
from inferd.gateway.kinds import Operation
from inferd.gateway.limits import Reservation
from inferd.gateway.policy import KeyPolicy
from inferd.protocol import headers
from inferd.protocol.errors import InvalidRequest, ModelNotFound, PermissionDenied

UNKNOWN_MODEL = "unknown"  # requests refused before their model was known (Exchange.model)


# the request and its attempts

@dataclass(slots=True, eq=False)
class Admission:
    """A reservation against the key's limits and a slot in one deployment's queue; the attempts on that
    deployment's replicas share it."""
    deployment: Deployment
    reservation: Reservation | None = None
    queue_s: float | None = None
    dispatched_s: float | None = None  # time.monotonic() when it got its slot (held until the request ends)


@dataclass(slots=True, eq=False)
class Attempt:
    number: int
    plan: Plan
    admission: Admission
    outcome: relay.Outcome = field(default_factory=relay.Outcome)
    upstream: Upstream | None = None
    span: trace.Span | None = None  # the replica call
    started_unix_s: float = field(default_factory=time.time)

    @property
    def deployment(self) -> Deployment:
        return self.admission.deployment

    def leave_upstream(self) -> None:
        if self.upstream is not None and self.span is not None:
            self.upstream.leave(self.plan.reserved_tokens)
            self.span.end()
            self.span = None


@dataclass(slots=True, eq=False)
class Exchange:
    request_id: str
    operation: str
    arrival_s: float  # time.monotonic()
    span: trace.Span
    started_unix_s: float = field(default_factory=time.time)
    key: KeyPolicy | None = None
    priority_class: str = "interactive"
    deadline_s: float | None = None  # time.monotonic() by which it must have started
    attempts: list[Attempt] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)  # said on every response (degraded, fallback)
    refusal: BaseException | None = None  # what ended it before any attempt
    model: str = UNKNOWN_MODEL  # the deployment it names, once known: a refusal before any attempt is recorded there
    version: str | None = None  # and that deployment's version (the console counts the refusal on its card)
    content: bytes = b""  # the client's body, as it came (a plan without a body of its own forwards it)
    batch_id: str | None = None  # a batch line's batch: priced at config.batch_price_multiplier
    finished: bool = False  # _finish ran (at a stream's end, before its [DONE], or in the finally)
    unhold: Callable[[], None] = lambda: None  # its place held in the queue while it is planned (_refuse_early)

    def begin(self, plan: Plan, admission: Admission) -> Attempt:
        attempt = Attempt(len(self.attempts) + 1, plan, admission)
        self.attempts.append(attempt)
        return attempt

    def remaining_deadline_ms(self) -> int | None:
        if self.deadline_s is None:
            return None
        return max(int((self.deadline_s - time.monotonic()) * 1000), 1)


@dataclass(slots=True)
class Head:
    status: int
    headers: dict[str, str]
    content: bytes | None = None  # None: the stream follows


# request headers

def priority_class(key: KeyPolicy, request: Request) -> str:
    """The key's (or tenant's) class; a request header may only lower it."""
    asked = headers.priority_class(request.headers.get(headers.PRIORITY))
    configured = key.effective_class
    return configured if asked is None else max(configured, asked, key=headers.PRIORITY_CLASSES.index)


def deadline_s(key: KeyPolicy, request: Request, arrival_s: float) -> float | None:
    ms = headers.deadline_ms(request.headers.get(headers.DEADLINE_MS))
    ms = ms if ms is not None else key.tenant.default_deadline_ms
    return None if ms is None else arrival_s + ms / 1000


def usable(deployment: Deployment | None, key: KeyPolicy, kind: str, path: str, model: str | None,
           version: str | None = None) -> Deployment:
    """The deployment that answers for `model` (resolved by the caller), if it exists, is of the kind the route
    needs and the key may use it; else the error that says which."""
    if deployment is None:
        raise ModelNotFound(f"The model '{model}' does not exist" + (f" in version '{version}'." if version
                            else "."), param="model")
    if deployment.model.kind != kind:
        raise InvalidRequest(f"The model '{deployment.name}' is a {deployment.model.kind} model; "
                             f"{path} needs a {kind} model.", param="model", code="wrong_model_kind")
    if not key.may_use(deployment.name):
        raise PermissionDenied(f"Your key may not use the model '{deployment.name}'.", param="model",
                               code="model_not_allowed")
    return deployment


def model_named(request: Request, op: Operation, raw) -> tuple[str, str | None] | None:
    """The model (and version) the request names in its path (op.model_param) or as a string in its body, read
    before the body is validated, so that a request refused early is never validated; None: not named so."""
    if op.model_param is not None:
        return request.path_params[op.model_param], request.path_params.get("version")
    model = raw.get("model") if isinstance(raw, dict) else None
    return (model, None) if isinstance(model, str) else None
