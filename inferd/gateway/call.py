"""One request through the gateway: reservation, queue slot, timings, and exactly one usage record."""
import calendar
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from opentelemetry import trace

from inferd.api.errors import (APIError, DeadlineExceeded, InvalidRequest, Overloaded, RateLimitExceeded)
from inferd.gateway import admission
from inferd.gateway.deployments import Deployment, Upstream
from inferd.gateway.limits import Charge, RateLimited, Reservation, ratelimit_headers, retry_after_header
from inferd.gateway.policy import KeyPolicy, Limits
from inferd.gateway.usage import UsageRecord

LIMIT_MESSAGES = {
    "requests_per_minute": "requests per minute", "tokens_per_minute": "tokens per minute",
    "max_concurrency": "concurrent requests", "budget": "budget (USD)",
}


@dataclass(slots=True)
class Plan:
    """What the request may cost at most, known before it runs."""
    prompt_tokens: int
    max_output_tokens: int  # per choice
    num_outputs: int  # prompts × n
    cost_usd: float = 0.0
    prompt_ids: list[int] = field(default_factory=list)  # the (first) prompt's tokens, for the router

    @property
    def reserved_tokens(self) -> int:
        return self.prompt_tokens + self.max_output_tokens * self.num_outputs


@dataclass(slots=True)
class Call:
    gateway: "Gateway"  # noqa: F821 (inferd.gateway.app.Gateway)
    request_id: str
    operation: str  # chat | text_completion
    key: KeyPolicy
    deployment: Deployment
    priority_class: str
    deadline_s: float | None  # time.monotonic() by which it must have started
    arrival_s: float
    span: trace.Span
    started_unix_s: float = field(default_factory=time.time)
    attempt: int = 1
    plan: Plan | None = None
    reservation: Reservation | None = None
    admitted: bool = False
    upstream: Upstream | None = None
    dispatched_s: float | None = None
    queue_s: float | None = None
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finished: bool = False
    headers: dict[str, str] = field(default_factory=dict)  # said on the response (degraded, fallback)
    next: "Call | None" = None  # the attempt on a fallback deployment, once this one failed
    keep_span: bool = False  # a fallback may follow: finishing does not end the request's span

    # before the work

    async def admit(self, plan: Plan) -> None:
        """Reserve the worst case, then wait for a slot; raises the API error (and records it) if not."""
        self.plan = plan
        gw, tracer = self.gateway, self.gateway.tracer
        with tracer.start_as_current_span("admission", context=trace.set_span_in_context(self.span)):
            charges = await gw.charges(self.key, self.deployment.name, plan)
            try:
                self.reservation = await gw.limiter.reserve(charges)
            except RateLimited as exc:
                await self._reject(_rate_limited(exc), "rejected")
        ticket = admission.Ticket(self.key.tenant.id, self.priority_class, plan.reserved_tokens,
                                  self.key.tenant.weight, self.key.tenant.queue_share, self.deadline_s,
                                  enqueued_s=self.arrival_s)
        with tracer.start_as_current_span("queue", context=trace.set_span_in_context(self.span)) as span:
            try:
                self.queue_s = await self.deployment.queue.admit(ticket)
            except admission.QueueRejected as exc:
                await self._reject(_queue_rejected(exc), "rejected")
            except admission.DeadlineExceeded as exc:
                await self._reject(DeadlineExceeded(
                    f"The request's deadline passed after {exc.waited_s:.3f} s in the queue; it was not started."),
                    "expired")
            span.set_attribute("inferd.queue_s", self.queue_s)
        self.admitted = True
        self.dispatched_s = time.monotonic()
        gw.metrics.admitted(self.deployment.name, self.priority_class, self.queue_s)

    def remaining_deadline_ms(self) -> int | None:
        if self.deadline_s is None:
            return None
        return max(int((self.deadline_s - time.monotonic()) * 1000), 1)

    def ratelimit_headers(self) -> dict[str, str]:
        return ratelimit_headers(self.reservation.states) if self.reservation else {}

    def response_headers(self) -> dict[str, str]:
        return self.ratelimit_headers() | self.headers

    # while it runs

    def observe_usage(self, usage: dict | None) -> None:
        if not usage:
            return
        self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        self.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        self.cached_tokens = int(details.get("cached_tokens") or 0)

    def first_token(self) -> None:
        if self.ttft_s is None:
            self.ttft_s = time.monotonic() - self.arrival_s
            self.span.add_event("first_token")

    def retry(self, error_code: str) -> None:
        """This attempt never reached a replica: record it (not billed) and go on as the next attempt."""
        self.gateway.record(self._record("failed", 503, error_code, 0.0))
        self.attempt += 1
        self.upstream = None

    def fallback(self, deployment: Deployment, headers: dict[str, str]) -> "Call":
        """This attempt failed before it ran (and is recorded); the next one goes to another deployment."""
        self.next = Call(self.gateway, self.request_id, self.operation, self.key, deployment, self.priority_class,
                         self.deadline_s, self.arrival_s, self.span, attempt=self.attempt + 1,
                         headers=self.headers | headers)
        return self.next

    @property
    def last(self) -> "Call":
        call = self
        while call.next is not None:
            call = call.next
        return call

    # after it

    async def finish(self, status: str, http_status: int, error_code: str | None = None) -> None:
        """Settle the reservation, free the slot and write the usage record; runs once, however it ends."""
        if self.finished:
            return
        self.finished = True
        billed = status == "completed" or (status == "cancelled" and self.ttft_s is not None)
        if not billed:
            self.cached_tokens = self.completion_tokens = self.prompt_tokens = 0
        cost = self.gateway.config.price(self.deployment.name).cost_usd(
            self.prompt_tokens, self.cached_tokens, self.completion_tokens)
        if self.reservation is not None:
            await self.gateway.limiter.settle(self.reservation, self._actual(cost))
        if self.admitted:
            self.deployment.queue.release(time.monotonic() - (self.dispatched_s or self.arrival_s))
        record = self._record(status, http_status, error_code, cost)
        self.gateway.record(record)
        self._end_span(record)

    def _actual(self, cost_usd: float) -> dict[str, float]:
        tokens = self.prompt_tokens + self.completion_tokens
        return {c.key: tokens if c.name == "tokens_per_minute" else cost_usd
                for c in self.reservation.charges if c.name in ("tokens_per_minute", "budget")}

    def _record(self, status: str, http_status: int, error_code: str | None, cost_usd: float) -> UsageRecord:
        return UsageRecord(
            request_id=self.request_id, attempt=self.attempt, model=self.deployment.name, status=status,
            http_status=http_status, started_unix_s=self.started_unix_s, e2e_s=time.monotonic() - self.arrival_s,
            gateway_id=self.gateway.config.gateway_id, tenant_id=self.key.tenant.id, key_id=self.key.id,
            deployment_version=self.deployment.version, replica=self.upstream.name if self.upstream else None,
            priority_class=self.priority_class, error_code=error_code, prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens, completion_tokens=self.completion_tokens, queue_s=self.queue_s,
            ttft_s=self.ttft_s, cost_usd=cost_usd)

    def _end_span(self, record: UsageRecord) -> None:
        self.span.set_attributes({"gen_ai.usage.input_tokens": record.prompt_tokens,
                                  "gen_ai.usage.output_tokens": record.completion_tokens,
                                  "inferd.status": record.status, "http.response.status_code": record.http_status})
        if record.error_code:
            self.span.set_attribute("error.type", record.error_code)
            self.span.set_status(trace.StatusCode.ERROR)
        if not self.keep_span:
            self.span.end()

    def release_span(self) -> None:
        """No fallback follows this attempt: its finish ends the span (or did, now)."""
        if self.keep_span:
            self.keep_span = False
            if self.finished:
                self.span.end()

    async def reject(self, err: APIError, status: str = "rejected") -> None:
        """Refuse the request here (before it ran): record it and raise err."""
        err.headers = (err.headers or {}) | self.headers
        await self._reject(err, status)

    async def _reject(self, err: APIError, status: str) -> None:
        self.gateway.metrics.rejected(err.code or status)
        await self.finish(status, err.status, err.code)
        raise err


# limits → charges

def charges_for(key: KeyPolicy, model: str, plan: Plan) -> list[Charge]:
    tenant = key.tenant
    scopes = [("tenant", tenant.id, tenant.limits), ("key", key.id, key.limits)]
    if model in tenant.model_limits:
        scopes.append(("model", f"{tenant.id}:model:{model}", tenant.model_limits[model]))
    out = []
    for scope, sid, lim in scopes:
        if lim.rpm:
            out.append(Charge(f"{sid}:rpm", "rate", "requests_per_minute", scope, lim.rpm, 1))
        if lim.tpm:
            out.append(Charge(f"{sid}:tpm", "rate", "tokens_per_minute", scope, lim.tpm, plan.reserved_tokens))
        if lim.max_concurrency:
            out.append(Charge(f"{sid}:concurrency", "concurrency", "max_concurrency", scope, lim.max_concurrency, 1))
    return out


def budget_period(period: str, now_unix_s: float) -> tuple[float, float]:
    """[start, end) of the budget period holding now, in UTC."""
    now = datetime.fromtimestamp(now_unix_s, timezone.utc)
    if period == "day":
        start = now.replace(hour=0, minute=0, second=0, microsecond=0)
        return start.timestamp(), start.timestamp() + 86400
    start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    days = calendar.monthrange(start.year, start.month)[1]
    return start.timestamp(), start.timestamp() + days * 86400


def request_limits(key: KeyPolicy, model: str) -> tuple[int | None, int | None]:
    """The tightest per-request (max_input_tokens, max_output_tokens) over tenant, key and model."""
    scopes: list[Limits] = [key.tenant.limits, key.limits, key.tenant.model_limits.get(model, Limits())]
    ins = [s.max_input_tokens for s in scopes if s.max_input_tokens]
    outs = [s.max_output_tokens for s in scopes if s.max_output_tokens]
    return min(ins, default=None), min(outs, default=None)


def check_request_limits(key: KeyPolicy, model: str, prompt_tokens: int, requested_output: int | None,
                         param: str) -> int | None:
    """Raises if the request is bigger than allowed; returns the output cap to apply (None: no cap)."""
    max_in, max_out = request_limits(key, model)
    if max_in is not None and prompt_tokens > max_in:
        raise InvalidRequest(f"The prompt has {prompt_tokens} tokens; your limit is {max_in} input tokens "
                             "per request.", param=param, code="max_input_tokens")
    if max_out is not None and requested_output is not None and requested_output > max_out:
        raise InvalidRequest(f"max_tokens is {requested_output}; your limit is {max_out} output tokens per "
                             "request.", param="max_tokens", code="max_output_tokens")
    return max_out


# errors

def _rate_limited(exc: RateLimited) -> RateLimitExceeded:
    c = exc.charge
    what = LIMIT_MESSAGES.get(c.name, c.name)
    headers = ratelimit_headers(exc.states)
    if exc.retry_after_s is None:
        return RateLimitExceeded(f"This request needs {c.amount:g} against a {c.scope} limit of {c.limit:g} "
                                 f"{what}; it can never fit. Lower max_tokens or the prompt.",
                                 code=f"{c.name}_request_too_large", headers=headers)
    headers["retry-after"] = retry_after_header(exc.retry_after_s)
    return RateLimitExceeded(f"Rate limit reached for {what} ({c.scope} limit {c.limit:g}). "
                             f"Retry after {exc.retry_after_s:.1f} s.", code=c.name, headers=headers)


def _queue_rejected(exc: admission.QueueRejected) -> APIError:
    headers = {"retry-after": retry_after_header(exc.retry_after_s)}
    if exc.reason == "tenant_queue_share":
        return RateLimitExceeded("Your share of this model's queue is full; retry later.",
                                 code="tenant_queue_share", headers=headers)
    return Overloaded("The model's queue is full; retry later.", code=exc.reason, headers=headers)

