"""One request's life in the gateway, owned by one coroutine from its first byte to its usage records.

    authenticate → read the body → resolve the deployment it names (canary share, access list)
    → refuse early what needs no plan (request-rate and concurrency limits, a full queue or queue share)
    → validate the body (first, if it names no model as a string), then plan on it (the kind counts and
      bounds the work; the degradation ladder may cap or re-route it)
    → attempts: admission on a deployment (reserve against limits and budget, wait for a queue slot),
      then its replicas (an unreachable one is followed by one other), then each fallback deployment once
    → deliver (unary body or SSE stream) → finish, in one `finally`: one usage record per attempt,
      reservations settled, queue slots and replicas released, one access log line, the span ended.

The route handler (`serve`) drives this as an async generator: its first item is the response head, the
rest is the stream; whatever the client or the upstream does, the generator's `finally` runs once.
A batch line (batch_runner.py) comes through `serve` too, as an in-process request with its key already
known and its batch id: the same limits, admission, routing and records, priced at the batch multiplier.
"""
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import nullcontext
from typing import Protocol

import anyio
import httpx
import orjson
from opentelemetry import trace
from opentelemetry.propagate import inject
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from inferd.gateway import relay, runtimes
from inferd.gateway.admission import QueueRejected, Ticket
from inferd.gateway.auth import KeyCache, authorization, client_address
from inferd.gateway.charges import (Charges, Plan, actual_amounts, queue_rejected, rate_limited,
                                    request_charges)
from inferd.gateway.config import GatewayConfig, ModelPrice
from inferd.gateway.degrade import degrade
from inferd.gateway.deployments import Deployment, Deployments, Upstream
from inferd.gateway.exchange import (UNKNOWN_MODEL, Admission, Attempt, Exchange, Head, deadline_s, model_named,
                                     priority_class, usable)
from inferd.gateway.kinds import Operation
from inferd.gateway.limits import Limiter, RateLimited, ratelimit_headers, retry_after_header
from inferd.gateway.plan_lane import PlanLane
from inferd.gateway.policy import KeyPolicy
from inferd.gateway.response_cache import HIT, MISS, cache_key, renewed
from inferd.gateway.usage import UsageRecord
from inferd.protocol import headers
from inferd.protocol.errors import (APIError, ClientClosedRequest, DeadlineExceeded, DeadlineUnmeetable, Overloaded,
                                    ServiceUnavailable, to_api_error)
from inferd.protocol.completions import as_chunks
from inferd.protocol.http import cancelled_on_disconnect, read_body
from inferd.protocol.sse import SSE_DONE, SSEResponse, sse_event
from inferd.telemetry.gateway_metrics import GatewayMetrics

log = logging.getLogger(__name__)
access_log = logging.getLogger("inferd.gateway.access")

MAX_REPLICAS_PER_ATTEMPT = 2  # a replica that gave no answer is followed by at most one other of the deployment
UNPLANNED = Plan(0, 0, 0, 0.0, None, False)  # the plan of an attempt refused before planning (_refuse_early)


class Recorder(Protocol):
    def __call__(self, record: UsageRecord) -> None: ...


# the lifecycle

class RequestPath:
    def __init__(self, config: GatewayConfig, keys: KeyCache, charges: Charges, limiter: Limiter,
                 deployments: Deployments, transport: httpx.AsyncBaseTransport, record: Recorder,
                 metrics: GatewayMetrics, tracer: trace.Tracer):
        self.config = config
        self.keys = keys
        self.charges = charges
        self.limiter = limiter
        self.deployments = deployments
        self.transport = transport
        self.record = record
        self.metrics = metrics
        self.tracer = tracer
        self.traced = not isinstance(tracer, trace.NoOpTracer)  # without an exporter, no span work at all
        self._urls: dict[tuple[str, str], httpx.URL] = {}
        self.lane = PlanLane()  # plans wait there, so that a later request's refusal never waits for them

    async def serve(self, request: Request, op: Operation, key: KeyPolicy | None = None,
                    batch_id: str | None = None) -> Response:
        """The answer to request; key: already known (a batch line's), else the request's own is checked."""
        life = self._life(request, op, key, batch_id)
        head = await anext(life)
        if head.content is None:
            return SSEResponse(life, headers=head.headers)
        await life.aclose()
        return Response(head.content, status_code=head.status, headers=head.headers)

    async def _life(self, request: Request, op: Operation, key: KeyPolicy | None, batch_id: str | None
                    ) -> AsyncGenerator[Head | bytes, None]:
        state = request.state
        x = Exchange(state.request_id, op.name, state.arrival_s, self.tracer.start_span(
            op.name, kind=trace.SpanKind.SERVER, attributes={
                "gen_ai.operation.name": op.name, "gen_ai.provider.name": "inferd",
                "inferd.request_id": state.request_id}) if self.traced else trace.INVALID_SPAN, batch_id=batch_id)
        try:
            with self._child("auth", x):
                x.key = key or await self.keys.authenticate(authorization(request), client_address(request))
            if op.model_param is not None:  # named in the path: known before the body (a 413) is read
                x.model = self._known(request.path_params[op.model_param])
            x.content = await read_body(request, min(op.max_body_bytes or self.config.max_body_bytes,
                                                     self.config.max_body_bytes))
            raw = op.decode(x.content)
            named = model_named(request, op, raw)  # else validated first, to say what is wrong with it
            body = None if named is not None else op.body_type.model_validate(raw)
            asked = self._deployment(x.key, op, *(named or (body.model, None)))
            x.model, x.version = asked.name, asked.version
            x.priority_class = priority_class(x.key, request)
            x.deadline_s = deadline_s(x.key, request, x.arrival_s)
            await self._refuse_early(x, asked)
            deployment, plan, body = await self.lane.run(lambda: self._plan(x, op, asked, body, raw))
            if self.traced:
                x.span.update_name(f"{op.name} {deployment.name}")
                x.span.set_attributes({"gen_ai.request.model": deployment.name, "inferd.tenant_id": x.key.tenant.id})
            key, stored = await self._cached(x, op, deployment, plan, raw)
            if stored is not None:  # parsed once: its usage, then the body or the stream's chunks
                stored = renewed(stored)
                attempt, response = await self._hit(x, deployment, plan, stored.get("usage")), None
                whole = None if plan.stream else (orjson.dumps(stored), {"content-type": "application/json"})
            else:
                async with cancelled_on_disconnect(request):
                    attempt, response, whole = await self._attempts(x, op, deployment, plan, body, raw)
                if key and whole is not None and response.status_code == 200 and attempt.deployment is deployment:
                    await deployment.response_cache.put(key, whole[0])
            said, answer = self._response_headers(x, attempt), op.answer(plan) if op.answer else None
            if whole is not None:
                status, content = response.status_code if response else 200, whole[0]
                if answer:
                    status, content = answer.whole(status, content)
                yield Head(status, whole[1] | said, content)
                return
            yield Head(200, said)
            if stored is not None:  # a hit, replayed as a stream
                usage = answer is not None or bool((raw.get("stream_options") or {}).get("include_usage"))
                events = b"".join(map(sse_event, as_chunks(stored, usage)))
                yield answer.events(events) if answer else events
                attempt.outcome.stream_done = True
            else:
                ours = attempt.deployment.internal_headers  # else the gateway keeps the deadline: first token by it
                attempt.outcome.planned_prompt_tokens = plan.prompt_tokens
                async for chunk in relay.relay_stream(response, attempt.outcome, x.arrival_s, ours, plan.usage_mode,
                                                      None if ours else x.deadline_s):
                    yield answer.events(chunk) if answer else chunk
            if attempt.outcome.stream_done:
                await self._finish(x)  # the records are journaled before the client has the stream's end
                yield answer.end() if answer else SSE_DONE
        except BaseException as exc:  # an API error, or the client went away (cancelled)
            if not x.attempts:
                x.refusal = exc
            if isinstance(exc, APIError):
                exc.headers = (exc.headers or {}) | x.headers
            raise
        finally:
            await self._finish(x)

    # planning

    def price(self, model: str, batch: bool) -> ModelPrice:
        """The model's price; a batch line's is config.batch_price_multiplier of it."""
        price = self.config.price(model)
        return price.scaled(self.config.batch_price_multiplier) if batch else price

    def planned(self, key: KeyPolicy, op: Operation, raw: dict) -> Plan:
        """What serving this body as key would plan, without running it: a batch line's validation. Raises
        what the request would be refused with (its body, its model, the key's access, the per-request limits)."""
        body = op.body_type.model_validate(raw)
        d = self._deployment(key, op, body.model, None)
        return op.plan(d, key, body, raw, self.price(d.name, batch=True))

    def _deployment(self, key: KeyPolicy, op: Operation, model: str | None, version: str | None) -> Deployment:
        deployment = self.deployments.route(model, op.kind, version)  # a canary's share goes there
        return usable(deployment, key, op.kind, op.path, model, version)

    def _known(self, name: str) -> str:
        """A name the client gave, as a usage record keeps it: a deployment's, else unknown (never a made-up one)."""
        return name if self.deployments.get(name) is not None else UNKNOWN_MODEL

    async def _refuse_early(self, x: Exchange, d: Deployment) -> None:
        """What refuses most and needs no plan, before the prompt is tokenized: the key's request-rate and
        concurrency limits, then room in d's queue and the tenant's share of it (unless a fallback or the
        degradation ladder could still take the request elsewhere). Nothing is taken here; admission asks the
        same again with the plan's real amounts."""
        err = None
        if charges := request_charges(x.key, d.name):
            try:
                await self.limiter.check(charges)
            except RateLimited as exc:
                err = rate_limited(exc)
        if err is None and not d.fallbacks and d.degrader is None:
            try:
                d.queue.check_room(ticket := self._ticket(x, 0))
                x.unhold = d.queue.hold(ticket)
            except QueueRejected as exc:
                err = queue_rejected(exc)
        if err is not None:
            self._refuse(x.begin(UNPLANNED, Admission(d)), err, "rejected")
            try:
                raise err
            finally:
                err = None  # this frame is in err's traceback: holding err too would make a cycle of them

    def _plan(self, x: Exchange, op: Operation, d: Deployment, body: BaseModel | None, raw: dict
              ) -> tuple[Deployment, Plan, BaseModel]:
        """The body validated (unless it was), then its plan on its deployment, after the deployment's degradation
        ladder (if it is overloaded)."""
        def price(model: str) -> ModelPrice:
            return self.price(model, x.batch_id is not None)
        body = body or op.body_type.model_validate(raw)
        plan = op.plan(d, x.key, body, raw, price(d.name))
        if d.degrader is None:
            return d, plan, body
        oldest = max((s.oldest_age_s for s in d.queue.stats().values()), default=0.0)
        left = None if x.deadline_s is None else x.deadline_s - time.monotonic()
        degraded = degrade(d.degrader.update(oldest), x.priority_class, left, d.queue.expected_wait_s(),
                           plan.max_output_tokens, x.key.may_use)
        if not degraded.actions:
            return d, plan, body
        self.metrics.degraded(d.name, degraded.actions)
        x.headers |= degraded.header
        if degraded.reject:
            attempt = x.begin(plan, Admission(d))
            err = DeadlineUnmeetable(
                "The model is overloaded and cannot start this request before its deadline; retry later.",
                headers={"retry-after": retry_after_header(d.queue.expected_wait_s())})
            attempt.outcome.fail(err, "rejected")
            self.metrics.rejected(err.code)
            raise err
        if degraded.route_to:
            d = self.deployments.get(degraded.route_to)
            plan = op.plan(d, x.key, body, raw, price(d.name))
        if op.cap_output and degraded.max_tokens is not None and degraded.max_tokens < plan.max_output_tokens:
            plan = op.cap_output(plan, degraded.max_tokens, price(d.name))
        return d, plan, body

    # the response cache

    async def _cached(self, x: Exchange, op: Operation, d: Deployment, plan: Plan, raw) -> tuple[str | None, bytes | None]:
        """The request's key in d's response cache (None: it may not be answered from there) and the answer kept
        under it, if any; the verdict goes in a response header and the metrics."""
        cache = d.response_cache
        if cache is None or not isinstance(raw, dict):
            return None, None
        verdict, key, stored = cache.verdict(op.name, raw), None, None
        if verdict == MISS:
            key = cache_key(x.key.tenant.id, d.name, d.version, d.card.get("digests"), op.name,
                            raw if plan.body is None else plan.body)
            stored = await cache.get(key)
            verdict = MISS if stored is None else HIT
        x.headers[headers.RESPONSE_CACHE] = verdict
        self.metrics.response_cache(d.name, verdict)
        return key, stored

    async def _hit(self, x: Exchange, d: Deployment, plan: Plan, usage: dict | None) -> Attempt:
        """The attempt a cached answer answers: the key's rate limits and budget still apply (a reservation,
        settled to nothing), no queue and no replica."""
        attempt = x.begin(plan, Admission(d))
        with self._child("admission", x):
            try:
                attempt.admission.reservation = await self.limiter.reserve(await self.charges.of(x.key, d.name, plan))
            except RateLimited as exc:
                self._refuse(attempt, rate_limited(exc), "rejected")
                raise attempt.outcome.error from None
            except ServiceUnavailable as exc:  # a budget's spend could not be read
                self._refuse(attempt, exc, "rejected")
                raise
        x.unhold()
        o = attempt.outcome
        o.observe_usage(usage)
        o.end("completed", 200)
        o.cache_hit, o.ttft_s = True, time.monotonic() - x.arrival_s
        return attempt

    # attempts

    async def _attempts(self, x: Exchange, op: Operation, d: Deployment, plan: Plan, body, raw: dict
                        ) -> tuple[Attempt, httpx.Response, tuple[bytes, dict] | None]:
        """The attempt that answers: its response head and, unless a 200 stream follows, its whole body.
        A deployment that fails the request before any output hands it to its next fallback, once each."""
        fallbacks = [f for f in map(self.deployments.get, d.fallbacks) if f is not None and x.key.may_use(f.name)]
        primary = d.name
        while True:
            attempt, response = await self._on_deployment(x, op, d, plan)
            whole, streams = None, response is not None and plan.stream and response.status_code == 200
            if response is not None and not streams:
                whole = await relay.read_whole(response, attempt.outcome, x.arrival_s, d.internal_headers)
            outcome = attempt.outcome
            if (streams or whole is not None) and (outcome.retry_reason is None or not fallbacks):
                return attempt, response, whole
            if outcome.retry_reason is None or not fallbacks:
                raise outcome.error
            nxt = fallbacks.pop(0)
            log.warning("request %s: %s failed (%s); falling back to %s", x.request_id, d.name,
                        outcome.retry_reason, nxt.name)
            self.metrics.fallback(d.name, nxt.name, outcome.retry_reason)
            x.headers[headers.FALLBACK] = f"{primary}->{nxt.name}"
            d, plan = nxt, op.plan(nxt, x.key, body, raw, self.price(nxt.name, x.batch_id is not None))

    async def _on_deployment(self, x: Exchange, op: Operation, d: Deployment, plan: Plan
                             ) -> tuple[Attempt, httpx.Response | None]:
        """Admission on d, then its replicas: one that gave no answer (unreachable, or its connection broke
        before the response head) is followed by one other, if healthy; each attempt has its own record."""
        shared = Admission(d)
        attempt = x.begin(plan, shared)
        if not await self._admit(x, attempt):
            return attempt, None
        tried: list[Upstream] = []
        while True:
            response = await self._send(x, op, attempt, tried)
            if response is not None or not attempt.outcome.no_answer:
                return attempt, response
            if len(tried) >= MAX_REPLICAS_PER_ATTEMPT or not any(u.healthy and u not in tried for u in d.upstreams):
                return attempt, None
            attempt = x.begin(plan, shared)

    async def _admit(self, x: Exchange, attempt: Attempt) -> bool:
        """Reserve the worst case, then wait for a slot; False (the outcome says why) if refused."""
        a, d, plan = attempt.admission, attempt.deployment, attempt.plan
        with self._child("admission", x):
            try:
                a.reservation = await self.limiter.reserve(await self.charges.of(x.key, d.name, plan))
            except RateLimited as exc:
                return self._refuse(attempt, rate_limited(exc), "rejected")
            except ServiceUnavailable as exc:  # a budget's spend could not be read
                return self._refuse(attempt, exc, "rejected")
        x.unhold()
        with self._child("queue", x) as span:
            try:
                a.queue_s = await d.queue.admit(self._ticket(x, plan.reserved_tokens))
            except QueueRejected as exc:
                err = queue_rejected(exc)
                return self._refuse(attempt, err, "rejected", err.code if isinstance(err, Overloaded) else None)
            except DeadlineExceeded as exc:
                return self._refuse(attempt, exc, "expired")
            span.set_attribute("inferd.queue_s", a.queue_s)
        a.dispatched_s = time.monotonic()
        self.metrics.admitted(d.name, x.priority_class, a.queue_s)
        return True

    def _ticket(self, x: Exchange, tokens: int) -> Ticket:
        tenant = x.key.tenant
        return Ticket(tenant.id, x.priority_class, tokens, tenant.weight, tenant.queue_share, x.deadline_s,
                      enqueued_s=x.arrival_s)

    def _refuse(self, attempt: Attempt, err: APIError, status: str, retry_reason: str | None = None) -> bool:
        attempt.outcome.fail(err, status, retry_reason)
        self.metrics.rejected(err.code or status)
        return False

    async def _send(self, x: Exchange, op: Operation, attempt: Attempt,
                    tried: list[Upstream]) -> httpx.Response | None:
        d, plan = attempt.deployment, attempt.plan
        attempt.upstream = upstream = d.pick(plan.prompt_ids, x.key.tenant.id, exclude=tried)
        tried.append(upstream)
        upstream.enter(plan.reserved_tokens)
        attempt.span = self.tracer.start_span("replica call", context=trace.set_span_in_context(x.span),
                                              kind=trace.SpanKind.CLIENT,
                                              attributes={"server.address": upstream.name}) if self.traced \
            else trace.INVALID_SPAN
        fields = runtimes.request_fields(d, x.key.tenant.id, x.priority_class)
        body = x.content if plan.body is None else _json_bytes(plan.body | fields if fields else plan.body)
        response = await relay.send(upstream.transport or self.transport, self._url(upstream, plan.path or op.path),
                                    self._upstream_headers(x, attempt), body, attempt.outcome)
        if response is None:
            if attempt.outcome.unreachable:
                upstream.healthy = False  # out of routing until its /ready answers again
            attempt.leave_upstream()
        return response

    def _upstream_headers(self, x: Exchange, attempt: Attempt) -> dict[str, str]:
        d, upstream = attempt.deployment, attempt.upstream
        out = {"content-type": "application/json"}
        if runtimes.takes_request_id(d):
            out[headers.REQUEST_ID] = x.request_id
        if upstream.api_key:
            out["authorization"] = f"Bearer {upstream.api_key}"
        if d.internal_headers:
            out[headers.CACHE_NAMESPACE] = out[headers.TENANT] = x.key.tenant.id
            out[headers.PRIORITY] = x.priority_class
            if (ms := x.remaining_deadline_ms()) is not None:
                out[headers.DEADLINE_MS] = str(ms)
            if attempt.plan.stream:
                out[headers.USAGE_EVENTS] = "1"
        if self.traced:
            inject(out, context=trace.set_span_in_context(attempt.span))
        return out

    def _url(self, upstream: Upstream, path: str) -> httpx.URL:
        key = (upstream.base_url, path)
        url = self._urls.get(key)
        if url is None:
            if len(self._urls) > 4096:
                self._urls.clear()
            url = self._urls[key] = httpx.URL(upstream.base_url + path)
        return url

    def _response_headers(self, x: Exchange, attempt: Attempt) -> dict[str, str]:
        reservation = attempt.admission.reservation
        return (ratelimit_headers(reservation.states) if reservation else {}) | x.headers

    # the end

    async def _finish(self, x: Exchange) -> None:
        """Settle, release and record every attempt; then the access line and the span. Once."""
        if x.finished:
            return
        x.finished = True
        x.unhold()
        records = []
        # a stream cancelled as its client left still settles (Redis: a call); a shield costs, so only then
        settles = any(a.admission.reservation is not None for a in x.attempts)
        with anyio.CancelScope(shield=True) if settles else nullcontext():
            for attempt, nxt in zip(x.attempts, [*x.attempts[1:], None]):
                attempt.leave_upstream()
                records.append(await self._settle(x, attempt, nxt is None or nxt.admission is not attempt.admission))
        refusal = None if x.attempts else _refusal(x.refusal)
        if not records and x.key is not None:
            records.append(self._refusal_record(x, refusal))
        for record in records:
            self.record(record)
        if refusal is not None:
            self.metrics.rejected(refusal.code or "error")
            x.span.set_attribute("error.type", refusal.code or "error")
            x.span.set_status(trace.StatusCode.ERROR)
        elif records:
            _span_outcome(x.span, records[-1])
            if (first_ns := x.attempts[-1].outcome.first_token_unix_ns) is not None:
                x.span.add_event("first_token", timestamp=first_ns)
        if records and access_log.isEnabledFor(logging.INFO):
            _access_line(records[-1], len(x.attempts))
        x.span.end()
        x.refusal = None  # an error's traceback holds the frames that hold x: no cycle left for the collector
        for attempt in x.attempts:
            attempt.outcome.error = None

    async def _settle(self, x: Exchange, attempt: Attempt, ends_admission: bool) -> UsageRecord:
        """The attempt's usage record; the last attempt on an admission also settles and frees it."""
        o, d, a = attempt.outcome, attempt.deployment, attempt.admission
        if not o.billed:
            o.prompt_tokens = o.cached_tokens = o.completion_tokens = 0
        cost = 0.0 if o.cache_hit else self.price(d.name, x.batch_id is not None).cost_usd(
            o.prompt_tokens, o.cached_tokens, o.completion_tokens)
        if ends_admission:
            if a.reservation is not None:
                await self.limiter.settle(a.reservation, actual_amounts(
                    a.reservation.charges, 0 if o.cache_hit else o.prompt_tokens + o.completion_tokens, cost))
            if a.dispatched_s is not None:
                d.queue.release(time.monotonic() - a.dispatched_s, x.priority_class)
        e2e_s = time.monotonic() - x.arrival_s
        return UsageRecord(
            request_id=x.request_id, attempt=attempt.number, model=d.name, status=o.status,
            http_status=o.http_status, started_unix_s=attempt.started_unix_s, e2e_s=e2e_s,
            gateway_id=self.config.gateway_id, tenant_id=x.key.tenant.id, key_id=x.key.id,
            deployment_version=d.version, replica=attempt.upstream.name if attempt.upstream else None,
            priority_class=x.priority_class, error_code=o.error_code, prompt_tokens=o.prompt_tokens,
            cached_tokens=o.cached_tokens, completion_tokens=o.completion_tokens, queue_s=a.queue_s,
            ttft_s=o.ttft_s, tpot_s=o.tpot_s(e2e_s), cost_usd=cost, batch_id=x.batch_id, cache_hit=o.cache_hit)

    def _refusal_record(self, x: Exchange, err: APIError) -> UsageRecord:
        return UsageRecord(
            request_id=x.request_id, model=x.model, deployment_version=x.version, status="rejected",
            http_status=err.status, started_unix_s=x.started_unix_s, e2e_s=time.monotonic() - x.arrival_s,
            gateway_id=self.config.gateway_id, tenant_id=x.key.tenant.id, key_id=x.key.id, error_code=err.code,
            batch_id=x.batch_id)

    def _child(self, name: str, x: Exchange):
        if not self.traced:
            return nullcontext(trace.INVALID_SPAN)
        return self.tracer.start_as_current_span(name, context=trace.set_span_in_context(x.span))


# helpers

def _refusal(exc: BaseException | None) -> APIError:
    """Why a request ended before any attempt: the error it is answered with, else its client left (cancelled)."""
    return to_api_error(exc) if isinstance(exc, Exception) else ClientClosedRequest("The client closed the connection.")


def _json_bytes(body: dict) -> bytes:
    return orjson.dumps(body)


def _span_outcome(span: trace.Span, record: UsageRecord) -> None:
    span.set_attributes({"gen_ai.usage.input_tokens": record.prompt_tokens,
                         "gen_ai.usage.output_tokens": record.completion_tokens,
                         "inferd.status": record.status, "http.response.status_code": record.http_status})
    if record.error_code:
        span.set_attribute("error.type", record.error_code)
        span.set_status(trace.StatusCode.ERROR)


def _access_line(record: UsageRecord, attempts: int) -> None:
    access_log.info("request", extra={
        "request_id": record.request_id, "tenant_id": record.tenant_id, "key_id": record.key_id,
        "model": record.model, "status": record.status, "http_status": record.http_status,
        "error_code": record.error_code, "attempts": attempts, "prompt_tokens": record.prompt_tokens,
        "cached_tokens": record.cached_tokens, "completion_tokens": record.completion_tokens,
        "queue_s": record.queue_s, "ttft_s": record.ttft_s, "e2e_s": round(record.e2e_s, 6),
        "cost_usd": record.cost_usd, "replica": record.replica})
