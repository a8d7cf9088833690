"""The gateway's HTTP app: authenticate, plan, reserve, queue, forward, record."""
import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import httpx
from opentelemetry import trace
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inferd.api.app import read_json, unless_disconnected
from inferd.api.errors import (ClientClosedRequest, InvalidRequest, ModelNotFound, Overloaded, PermissionDenied,
                               ServiceUnavailable, to_api_error)
from inferd.api.middleware import RequestContextMiddleware, http_exception_handler
from inferd.api.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from inferd.gateway import admin, relay
from inferd.gateway.auth import KeyCache
from inferd.gateway.call import Call, Plan, budget_period, charges_for, check_request_limits
from inferd.gateway.config import GatewayConfig
from inferd.gateway.degrade import Degradation, degrade
from inferd.gateway.deployments import Deployment, Deployments
from inferd.gateway.federate import replica_metrics
from inferd.gateway.limits import Charge, Limiter, retry_after_header
from inferd.gateway.policy import PRIORITY_CLASSES, KeyPolicy
from inferd.gateway.store import Store
from inferd.gateway.usage import UsageRecord, UsageWriter
from inferd.telemetry.gateway_metrics import GatewayMetrics, counter, gauge
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)
access_log = logging.getLogger("inferd.gateway.access")

PROBE_INTERVAL_S = 2.0
FALLBACK_HEADER = "x-inferd-fallback"
UNKNOWN_MODEL = "unknown"  # requests refused before their model was resolved


class DeadlineUnmeetable(ServiceUnavailable):
    code = "deadline_unmeetable"


class Gateway:
    """Everything one gateway process holds; routes and calls reach their state through it."""

    def __init__(self, config: GatewayConfig, store: Store, limiter: Limiter, deployments: Deployments,
                 tracer: trace.Tracer | None = None, tracer_provider=None):
        self.config = config
        self.store = store
        self.limiter = limiter
        self.deployments = deployments
        self.tracer = tracer or trace.NoOpTracer()
        self.tracer_provider = tracer_provider
        self.keys = KeyCache(store, config.key_cache_ttl_s)
        self.usage = UsageWriter(store, config.spill_path)
        self.metrics = GatewayMetrics(config.tenant_label_limit)
        self.metrics.watch(self._collect)
        self.client: httpx.AsyncClient | None = None
        self.started_unix_s = time.time()
        self.rollouts = None  # the canary rollout controller (inferd.control.rollout), when there are canaries
        self.observers: list = []  # called with every usage record (e.g. the rollout controller)
        self.services: list = []  # run with the app: await s.start(gateway), await s.close() (replica pools)
        self._spent: dict[tuple[str, float], float] = {}

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=limits)
        self.usage.start()
        for service in self.services:
            await service.start(self)

    async def close(self) -> None:
        for service in self.services:
            await service.close()
        await self.usage.close()
        await self.client.aclose()
        await self.limiter.close()
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()

    async def charges(self, key: KeyPolicy, model: str, plan: Plan) -> list[Charge]:
        out = charges_for(key, model, plan)
        tenant = key.tenant
        if tenant.budget_usd is not None:
            start, end = budget_period(tenant.budget_period, time.time())
            spent = self._spent.get((tenant.id, start))
            if spent is None:  # what the store already holds for this period, read once per period
                spent = await asyncio.to_thread(self.store.spent_usd, tenant.id, start)
                self._spent[(tenant.id, start)] = spent
            out.append(Charge(f"{tenant.id}:budget:{int(start)}", "budget", "budget", "tenant", tenant.budget_usd,
                              plan.cost_usd, end, spent))
        return out

    def record(self, record: UsageRecord) -> None:
        self.usage.write(record)
        for observe in self.observers:
            observe(record)
        self.metrics.ended(record.tenant_id or "", record.model, record.status, record.prompt_tokens,
                           record.cached_tokens, record.completion_tokens, record.cost_usd, record.ttft_s)
        access_log.info("request", extra={
            "request_id": record.request_id, "tenant_id": record.tenant_id, "key_id": record.key_id,
            "model": record.model, "status": record.status, "http_status": record.http_status,
            "error_code": record.error_code, "prompt_tokens": record.prompt_tokens,
            "cached_tokens": record.cached_tokens, "completion_tokens": record.completion_tokens,
            "queue_s": record.queue_s, "ttft_s": record.ttft_s, "e2e_s": round(record.e2e_s, 6),
            "cost_usd": record.cost_usd, "replica": record.replica})

    def _collect(self) -> Iterator:
        labels = ["model", "priority_class"]
        length = gauge("inferd_gateway_queue_length", "Requests waiting for admission.", labels)
        age = gauge("inferd_gateway_queue_oldest_age_seconds", "Age of the oldest waiting request.", labels)
        tokens = gauge("inferd_gateway_queued_tokens", "Reserved tokens of waiting requests.", labels)
        inflight = gauge("inferd_gateway_inflight_requests", "Requests running on replicas.", ["model"])
        for name, d in self.deployments.by_name.items():
            for cls, s in d.queue.stats().items():
                length.add_metric([name, cls], s.length)
                age.add_metric([name, cls], s.oldest_age_s)
                tokens.add_metric([name, cls], s.queued_tokens)
            inflight.add_metric([name], d.queue.inflight)
        yield from (length, age, tokens, inflight)
        pending = gauge("inferd_gateway_usage_records_pending", "Usage records not yet written.", [])
        pending.add_metric([], self.usage.pending)
        yield pending
        yield counter("inferd_gateway_usage_records_spilled", "Usage records written to the spill file.",
                      self.usage.counters.spilled)


class GatewayRoutes:
    def __init__(self, gateway: Gateway):
        self.gw = gateway

    def routes(self) -> list[Route]:
        return [Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/ready", self.ready, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"])] + admin.routes(self.gw)

    async def metrics(self, request: Request) -> Response:
        """The gateway's metrics, then those of its own replicas (labelled replica=...)."""
        ours = [u for d in self.gw.deployments.every() if d.internal_headers for u in d.upstreams]
        text = self.gw.metrics.render() + await replica_metrics(self.gw.client, ours)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        ok = all(self.gw.deployments.servable(d) for d in self.gw.deployments.by_name.values())
        return JSONResponse({"status": "ready" if ok else "not ready"}, status_code=200 if ok else 503)

    async def models(self, request: Request) -> Response:
        key = await self.gw.keys.authenticate(request.headers.get("authorization"))
        cards = [d.card for d in self.gw.deployments.by_name.values() if key.may_use(d.name)]
        return JSONResponse({"object": "list", "data": cards})

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest, "/v1/chat/completions", "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest, "/v1/completions", "text_completion")

    async def _generate(self, request: Request, body_type: type[SamplingRequest], path: str,
                        operation: str) -> Response:
        gw, state = self.gw, request.state
        span = gw.tracer.start_span(operation, kind=trace.SpanKind.SERVER, attributes={
            "gen_ai.operation.name": operation, "gen_ai.provider.name": "inferd",
            "inferd.request_id": state.request_id})
        key = None
        try:
            with gw.tracer.start_as_current_span("auth", context=trace.set_span_in_context(span)):
                key = await gw.keys.authenticate(request.headers.get("authorization"))
            raw = await read_json(request, gw.config.max_body_bytes)
            body = body_type.model_validate(raw)
            asked = self._deployment(key, body.model)
            cls, deadline = priority_class(key, request), deadline_s(key, request, state.arrival_s)
            deployment, plan, upstream_body, degraded = self._plan(asked, key, body, raw, cls, deadline)
            span.update_name(f"{operation} {deployment.name}")
            span.set_attributes({"gen_ai.request.model": deployment.name, "inferd.tenant_id": key.tenant.id})
            call = Call(gw, state.request_id, operation, key, deployment, cls, deadline, state.arrival_s, span,
                        headers=degraded.header)
        except BaseException as exc:
            self._refused(state, key, exc, span)
            raise
        if degraded.actions:
            gw.metrics.degraded(asked.name, degraded.actions)
        try:  # a client that leaves while its request waits or runs cancels it, streaming or not
            if degraded.reject:
                await call.reject(DeadlineUnmeetable(
                    "The model is overloaded and cannot start this request before its deadline; retry later.",
                    headers={"retry-after": retry_after_header(deployment.queue.expected_wait_s())}))
            run = self._run(call, plan, path, upstream_body, usage_mode(body), body, raw)
            return await unless_disconnected(request, run)
        except ClientClosedRequest:
            await call.last.finish("cancelled", 499, ClientClosedRequest.code)
            raise

    def _plan(self, deployment: Deployment, key: KeyPolicy, body: SamplingRequest, raw: dict, cls: str,
              deadline: float | None) -> tuple[Deployment, Plan, dict, Degradation]:
        """Plan the request on its deployment, after the deployment's degradation ladder (if overloaded)."""
        price = self.gw.config.price
        plan, upstream_body = plan_request(deployment, key, body, raw, price(deployment.name))
        if deployment.degrader is None:
            return deployment, plan, upstream_body, Degradation()
        oldest = max((s.oldest_age_s for s in deployment.queue.stats().values()), default=0.0)
        steps = deployment.degrader.update(oldest)
        left = None if deadline is None else deadline - time.monotonic()
        degraded = degrade(steps, cls, left, deployment.queue.expected_wait_s(), plan.max_output_tokens, key.may_use)
        if degraded.route_to:
            deployment = self.gw.deployments.get(degraded.route_to)
            plan, upstream_body = plan_request(deployment, key, body, raw, price(deployment.name))
        if degraded.max_tokens is not None and degraded.max_tokens < plan.max_output_tokens:
            plan, upstream_body = cap_output(plan, upstream_body, degraded.max_tokens, price(deployment.name))
        return deployment, plan, upstream_body, degraded

    async def _run(self, call: Call, plan: Plan, path: str, upstream_body: dict, mode: str,
                   body: SamplingRequest, raw: dict) -> Response:
        """Admit and forward; if the deployment fails the request before it started (no replica reachable,
        queue full, a 5xx answer), each of its fallback deployments gets one try."""
        fallbacks = [self.gw.deployments.get(n) for n in call.deployment.fallbacks if call.key.may_use(n)]
        primary = call.deployment.name
        while True:
            call.keep_span = bool(fallbacks)
            try:
                await call.admit(plan)
                response = await relay.forward(call, self.gw.client, path, upstream_body, mode)
                if response.status_code < 500 or not fallbacks:
                    call.release_span()
                    return response
                reason = f"http_{response.status_code}"
            except (relay.UpstreamFailed, Overloaded) as exc:
                if not fallbacks:
                    raise
                reason = exc.code
            except BaseException:
                call.release_span()
                raise
            nxt = fallbacks.pop(0)
            log.warning("request %s: %s failed (%s); falling back to %s", call.request_id, call.deployment.name,
                        reason, nxt.name)
            self.gw.metrics.fallback(call.deployment.name, nxt.name, reason)
            plan, upstream_body = plan_request(nxt, call.key, body, raw, self.gw.config.price(nxt.name))
            call = call.fallback(nxt, {FALLBACK_HEADER: f"{primary}->{nxt.name}"})

    def _deployment(self, key: KeyPolicy, model: str | None) -> Deployment:
        deployment = self.gw.deployments.route(model)  # a name with a canary: its share goes there
        if deployment is None:
            raise ModelNotFound(f"The model '{model}' does not exist.", param="model")
        if not key.may_use(deployment.name):
            raise PermissionDenied(f"Your key may not use the model '{deployment.name}'.", param="model",
                                   code="model_not_allowed")
        return deployment

    def _refused(self, state, key: KeyPolicy | None, exc: BaseException, span: trace.Span) -> None:
        """A request refused before admission: still one usage record once we know whose it is."""
        err = to_api_error(exc) if isinstance(exc, Exception) else None
        code = err.code if err else "client_closed_request"
        span.set_attribute("error.type", code or "error")
        span.set_status(trace.StatusCode.ERROR)
        span.end()
        self.gw.metrics.rejected(code or "error")
        if key is not None:
            self.gw.record(UsageRecord(
                request_id=state.request_id, model=UNKNOWN_MODEL, status="rejected",
                http_status=err.status if err else 499,
                started_unix_s=time.time(), e2e_s=time.monotonic() - state.arrival_s,
                gateway_id=self.gw.config.gateway_id, tenant_id=key.tenant.id, key_id=key.id, error_code=code))


# request planning

def plan_request(d: Deployment, key: KeyPolicy, body: SamplingRequest, raw: dict, price) -> tuple[Plan, dict]:
    """Count the prompt in the model's tokens, apply per-request limits, and bound what it may cost."""
    if isinstance(body, ChatCompletionRequest):
        text = d.tokenizer.apply_chat_template(body.template_messages(), add_generation_prompt=True)
        ids, param = [d.tokenizer.encode(text, add_special_tokens=False)], "messages"
    else:
        ids = [d.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else p for p in body.prompts()]
        param = "prompt"
    lens = [len(i) for i in ids]
    if min(lens) == 0:
        raise InvalidRequest("the prompt is empty", param="prompt")
    requested = body.requested_max_tokens()
    cap = check_request_limits(key, d.name, max(lens), requested, param)
    per_output = body.checked_max_tokens(max(lens), d.max_model_len)
    upstream = dict(raw, model=d.upstream_model or d.name)
    if requested is None:
        per_output = max(d.max_model_len - min(lens), 1)
        if cap is not None:
            per_output = upstream["max_tokens"] = min(cap, per_output)
    if body.stream:
        upstream["stream_options"] = {"include_usage": True, "continuous_usage_stats": d.internal_headers}
    outputs = len(lens) * body.num_choices
    plan = Plan(sum(lens), per_output, outputs, price.cost_usd(sum(lens), 0, per_output * outputs), ids[0])
    return plan, upstream


def cap_output(plan: Plan, upstream: dict, cap: int, price) -> tuple[Plan, dict]:
    """The plan and body with at most `cap` output tokens per choice (the degradation ladder's cap)."""
    upstream = dict(upstream, max_tokens=cap)
    upstream.pop("max_completion_tokens", None)
    cost = price.cost_usd(plan.prompt_tokens, 0, cap * plan.num_outputs)
    return Plan(plan.prompt_tokens, cap, plan.num_outputs, cost, plan.prompt_ids), upstream


def priority_class(key: KeyPolicy, request: Request) -> str:
    """The key's (or tenant's) class; a request header may only lower it."""
    configured = key.effective_class
    asked = request.headers.get("x-inferd-priority")
    if asked is None:
        return configured
    if asked not in PRIORITY_CLASSES:
        raise InvalidRequest(f"x-inferd-priority must be one of {', '.join(PRIORITY_CLASSES)}",
                             param="x-inferd-priority")
    return max(configured, asked, key=PRIORITY_CLASSES.index)


def deadline_s(key: KeyPolicy, request: Request, arrival_s: float) -> float | None:
    raw = request.headers.get("x-inferd-deadline-ms")
    if raw is not None and (not raw.isdigit() or int(raw) < 1):
        raise InvalidRequest("x-inferd-deadline-ms must be a positive integer (milliseconds)",
                             param="x-inferd-deadline-ms")
    ms = int(raw) if raw is not None else key.tenant.default_deadline_ms
    return None if ms is None else arrival_s + ms / 1000


def usage_mode(body: SamplingRequest) -> str:
    return "continuous" if body.continuous_usage else "final" if body.include_usage else "none"


# app

async def probe_upstreams(gateway: Gateway) -> None:
    """Mark replicas healthy or not from their /ready, every PROBE_INTERVAL_S."""
    while True:
        for d in gateway.deployments.every():
            for u in d.upstreams:
                u.healthy = await _probe(gateway.client, u, d.internal_headers)
        await asyncio.sleep(PROBE_INTERVAL_S)


async def _probe(client: httpx.AsyncClient, upstream, ours: bool) -> bool:
    path = "/ready" if ours else "/v1/models"
    headers = {"authorization": f"Bearer {upstream.api_key}"} if upstream.api_key else {}
    try:
        return (await client.get(f"{upstream.base_url}{path}", headers=headers, timeout=2.0)).status_code == 200
    except httpx.HTTPError:
        return False


def build_gateway_app(gateway: Gateway) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        probe = asyncio.create_task(probe_upstreams(gateway))
        try:
            yield
        finally:
            probe.cancel()
            await gateway.close()

    return Starlette(routes=GatewayRoutes(gateway).routes(),
                     middleware=[Middleware(RequestContextMiddleware, api_key=None)],
                     exception_handlers={HTTPException: http_exception_handler},
                     lifespan=lifespan)

