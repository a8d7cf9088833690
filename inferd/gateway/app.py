"""The gateway process: its state, its routes and its app. A request's life is gateway/lifecycle.py."""
import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Protocol

import httpx
from opentelemetry import trace
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from inferd.gateway import admin, classical, embeddings, runtimes, text
from inferd.gateway.async_jobs import AsyncJobStore, AsyncRoutes, wants_async
from inferd.gateway.async_runner import AsyncRunner
from inferd.gateway.auth import KeyCache, authorization, client_address
from inferd.gateway.oidc import Issuer, TokenKeys
from inferd.gateway.batch_runner import BatchRunner
from inferd.gateway.batches import BatchRoutes, BatchStore
from inferd.gateway.charges import BudgetWatch, Charges
from inferd.gateway.config import GatewayConfig
from inferd.gateway.deployments import Deployments, Upstream
from inferd.gateway.federate import replica_metrics
from inferd.gateway.files import FileRoutes, Files, LocalFileStorage
from inferd.gateway.kinds import Operation
from inferd.gateway.lifecycle import RequestPath
from inferd.gateway.sessions import PolicySessions
from inferd.gateway.limits import Limiter
from inferd.gateway.store import UNAVAILABLE, Store
from inferd.gateway.tokenize import TokenizerRoutes
from inferd.gateway.transport import UpstreamTransport
from inferd.gateway.usage import UsageRecord, UsageWriter
from inferd.gateway.webhooks import WebhookSecrets
from inferd.protocol.errors import APIError, ServiceUnavailable, to_api_error
from inferd.protocol.http import build_app
from inferd.telemetry.gateway_metrics import GatewayMetrics, counter, gauge

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 2.0


class Service(Protocol):
    """Runs with the app (the control plane's replica pools, the rollout controller)."""
    async def start(self, gateway: "Gateway") -> None: ...
    async def close(self) -> None: ...


Observer = Callable[[UsageRecord], None]  # sees every usage record (e.g. the rollout controller)


class Gateway:
    """Everything one gateway process holds. The transport carries all its upstream traffic (requests,
    probes, metrics); tests pass httpx.MockTransport."""

    def __init__(self, config: GatewayConfig, store: Store, limiter: Limiter, deployments: Deployments,
                 tracer: trace.Tracer | None = None, tracer_provider=None,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.config = config
        self.store = store
        self.limiter = limiter
        self.deployments = deployments
        self.transport = transport or UpstreamTransport()
        self.client = httpx.AsyncClient(transport=self.transport, timeout=httpx.Timeout(None, connect=5.0))
        self.tracer = tracer or trace.NoOpTracer()
        self.tracer_provider = tracer_provider
        self.keys = KeyCache(store, config.key_cache_ttl_s)
        self.issuer = Issuer(config.oidc.issuer, config.oidc.leeway_s) if config.oidc else None  # oidc.py
        if config.oidc and config.oidc.audience:
            self.keys.tokens = TokenKeys(self.issuer, config.oidc, store)
        self.usage = UsageWriter(store, config.usage_journal)
        self.metrics = GatewayMetrics(config.tenant_label_limit)
        self.metrics.watch(self._collect)
        self.budgets = BudgetWatch(store, self.metrics.tenant_label)  # budgets and spend for /metrics
        self.metrics.watch(self.budgets.collect)
        self.started_unix_s = time.time()
        self.rollouts = None  # the canary rollout controller (inferd.control.rollout), when there are canaries
        self.observers: list[Observer] = []
        self.services: list[Service] = []
        self.requests = RequestPath(config, self.keys, Charges(store), limiter, deployments, self.transport,
                                    self.record, self.metrics, self.tracer)
        self.sessions = PolicySessions(self)  # robot policies over WebSocket
        self.metrics.watch(self.sessions.collect)
        self.files = Files(store.engine, LocalFileStorage(config.files_dir), config.max_file_bytes,
                           config.tenant_files_max_bytes)
        self.batches = BatchStore(store.engine)
        self.batch_runner = BatchRunner(self)
        self.async_jobs = AsyncJobStore(store.engine)
        self.webhook_secrets = WebhookSecrets(store.engine, config.webhook_master_secret)
        self.async_runner = AsyncRunner(self)

    async def start(self) -> None:
        await self.usage.start()  # inserts what a killed predecessor journaled before anything is served
        self.keys.start()
        await self.budgets.start(self)
        if self.issuer is not None:
            await self.issuer.start()
        for service in self.services:
            await service.start(self)
        await self.batch_runner.start()  # resumes the store's unfinished batches
        await self.async_runner.start()  # and its async jobs

    async def close(self) -> None:
        await self.async_runner.close()
        await self.batch_runner.close()
        await self.keys.close()
        await self.budgets.close()
        if self.issuer is not None:
            await self.issuer.close()
        for service in self.services:
            await service.close()
        await self.usage.close()
        for d in self.deployments.every():
            if d.response_cache is not None:
                await d.response_cache.close()
        await self.client.aclose()
        await self.limiter.close()
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()

    def record(self, record: UsageRecord) -> None:
        self.usage.write(record)
        for observe in self.observers:
            observe(record)
        self.metrics.ended(record.tenant_id or "", record.model, record.status, record.prompt_tokens,
                           record.cached_tokens, record.completion_tokens, record.cost_usd, record.ttft_s)

    def _collect(self) -> Iterator:
        labels = ["model", "priority_class"]
        length = gauge("inferd_gateway_queue_length", "Requests waiting for admission.", labels)
        age = gauge("inferd_gateway_queue_oldest_age_seconds", "Age of the oldest waiting request.", labels)
        tokens = gauge("inferd_gateway_queued_tokens", "Reserved tokens of waiting requests.", labels)
        inflight = gauge("inferd_gateway_inflight_requests", "Requests running on replicas.", ["model"])
        on_replica = gauge("inferd_gateway_replica_inflight_requests", "Requests this gateway has on each replica.",
                           ["model", "replica"])
        cached = gauge("inferd_gateway_response_cache_bytes", "Bytes of answers in a deployment's response cache.",
                       ["model"])
        for name, d in self.deployments.by_name.items():
            if d.response_cache is not None:
                cached.add_metric([name], d.response_cache.bytes)
            for cls, s in d.queue.stats().items():
                length.add_metric([name, cls], s.length)
                age.add_metric([name, cls], s.oldest_age_s)
                tokens.add_metric([name, cls], s.queued_tokens)
            inflight.add_metric([name], d.queue.inflight)
            for u in d.upstreams:
                on_replica.add_metric([name, u.name], u.inflight)
        yield from (length, age, tokens, inflight, on_replica, cached)
        leases = gauge("inferd_gateway_concurrency_leases", "Concurrency leases this gateway holds (reserved against "
                       "max_concurrency limits, not yet released).", [])
        leases.add_metric([], self.limiter.leases_held)
        yield leases
        pending = gauge("inferd_gateway_usage_records_pending", "Usage records journaled, not yet in the store.", [])
        pending.add_metric([], self.usage.pending)
        yield pending
        yield counter("inferd_gateway_usage_records_spilled", "Usage records the store refused; kept in the journal.",
                      self.usage.counters.spilled)


# routes

class GatewayRoutes:
    def __init__(self, gateway: Gateway):
        self.gw = gateway
        self.async_routes = AsyncRoutes(gateway)

    def routes(self) -> list[Route]:
        serving = [Route(op.path, self._serve(op), methods=["POST"])
                   for op in (*text.OPERATIONS, *embeddings.OPERATIONS, *classical.OPERATIONS)]
        return [Route("/v1/models", self.models, methods=["GET"]), *serving, *classical.OIPRoutes(self.gw).routes(),
                *TokenizerRoutes(self.gw).routes(), Route("/health", self.health, methods=["GET"]),
                Route("/healthz", self.healthz, methods=["GET"]),
                Route("/ready", self.ready, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]), *self.gw.sessions.routes(),
                *FileRoutes(self.gw).routes(), *BatchRoutes(self.gw).routes(),
                *self.async_routes.routes()] + admin.routes(self.gw)

    def _serve(self, op: Operation):
        can_wait = self.gw.batch_runner.operation(op.path) is not None  # what batches take, async jobs take

        async def endpoint(request: Request) -> Response:
            if can_wait and wants_async(request):
                return await self.async_routes.submit(request, op)
            return await self.gw.requests.serve(request, op)
        return endpoint

    async def metrics(self, request: Request) -> Response:
        """The gateway's metrics, then those of the replicas it started, any runtime (labelled replica=...)."""
        ours = [u for d in self.gw.deployments.every() if runtimes.has_metrics(d) for u in d.upstreams]
        text_ = self.gw.metrics.render() + await replica_metrics(self.gw.client, ours)
        return Response(text_, media_type=CONTENT_TYPE_LATEST)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def healthz(self, request: Request) -> Response:
        """What OpenPI's policy server answers there, for robot-side health checks."""
        return PlainTextResponse("OK\n")

    async def ready(self, request: Request) -> Response:
        ok = all(self.gw.deployments.servable(d) for d in self.gw.deployments.by_name.values())
        return JSONResponse({"status": "ready" if ok else "not ready"}, status_code=200 if ok else 503)

    async def models(self, request: Request) -> Response:
        key = await self.gw.keys.authenticate(authorization(request), client_address(request))
        cards = [d.tenant_card() for d in self.gw.deployments.by_name.values() if key.may_use(d.name)]
        return JSONResponse({"object": "list", "data": cards})


# app

async def probe_upstreams(gateway: Gateway) -> None:
    """Mark replicas healthy or not from their /ready, every PROBE_INTERVAL_S."""
    while True:
        for d in gateway.deployments.every():
            for u in d.upstreams:
                u.healthy = await _probe(gateway.client, u, d.internal_headers)
        await asyncio.sleep(PROBE_INTERVAL_S)


async def _probe(client: httpx.AsyncClient, upstream: Upstream, ours: bool) -> bool:
    path = "/ready" if ours else "/v1/models"
    headers = {"authorization": f"Bearer {upstream.api_key}"} if upstream.api_key else {}
    try:
        return (await client.get(f"{upstream.base_url}{path}", headers=headers, timeout=2.0)).status_code == 200
    except httpx.HTTPError:
        return False


def gateway_error(exc: BaseException) -> APIError:
    """The gateway's errors: a store that cannot be reached is 503 store_unavailable on any route (admin, files,
    batches, console), never a 500; the rest as every route maps them."""
    if isinstance(exc, UNAVAILABLE):
        log.warning("store unavailable (%s)", type(exc).__name__)
        return ServiceUnavailable("The store is unavailable; retry shortly.", code="store_unavailable",
                                  headers={"retry-after": "1"})
    return to_api_error(exc)


def build_gateway_app(gateway: Gateway, extra_routes: list[Route] = ()) -> Starlette:
    """extra_routes: served beside the gateway's own (the console's, from the control plane)."""
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        probe = asyncio.create_task(probe_upstreams(gateway))
        try:
            yield
        finally:
            probe.cancel()
            await gateway.close()

    return build_app(GatewayRoutes(gateway).routes() + list(extra_routes), lifespan, None, gateway_error)
