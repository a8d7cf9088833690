"""Building and running a gateway: from flags to a served app (used by `inferd serve` and `inferd gateway`)."""
import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from pathlib import Path

import httpx
import uvicorn
from uvicorn.main import STARTUP_FAILURE

from inferd.console.routes import Console
from inferd.gateway.admission import AdmissionQueue, QueueConfig
from inferd.gateway.app import Gateway, build_gateway_app
from inferd.gateway.config import GatewayConfig, load_settings_file
from inferd.control.kinds import gateway_model
from inferd.control.pool import ReplicaPool
from inferd.control.tls import CertificateReloader, check_pair, expiry_metric
from inferd.gateway.deployments import Deployment, Deployments, Upstream
from inferd.gateway.keys import NewKey
from inferd.gateway.limits import MemoryLimiter
from inferd.gateway.response_cache import ResponseCacheConfig
from inferd.gateway.store import Store
from inferd.gateway.transport import UpstreamTransport
from inferd.gateway.webhooks import check_networks
from inferd.protocol.policy import MAX_WS_FRAME_BYTES
from inferd.protocol.slow_clients import ReadDeadlineProtocol
from inferd.router.router import Router, RouterConfig
from inferd.telemetry.tracing import make_tracer

log = logging.getLogger("inferd")

DEFAULT_TENANT = "default"


def gateway_config(args: argparse.Namespace, default_inflight: int) -> GatewayConfig:
    settings = load_settings_file(args.gateway_config) if args.gateway_config else {}
    queue = settings.get("queue") or QueueConfig(max_inflight=default_inflight)
    overrides = {k: getattr(args, k) for k in ("max_inflight", "max_queue_len", "max_queued_tokens")
                 if getattr(args, k) is not None}
    queue = QueueConfig(**({"max_inflight": queue.max_inflight, "max_queue_len": queue.max_queue_len,
                            "max_queued_tokens": queue.max_queued_tokens} | overrides))
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be 1-65535, not {args.port}")
    if args.lease_s <= 0:
        raise ValueError(f"--lease-s must be above 0, not {args.lease_s:g}")
    config = GatewayConfig(host=args.host, port=args.port, db_url=args.db, redis_url=args.redis_url,
                           admin_key=args.admin_key, console_viewer_key=getattr(args, "console_viewer_key", None),
                           prices=settings.get("prices", {}), queue=queue,
                           otlp_endpoint=args.otlp_endpoint, batch_price_multiplier=args.batch_price_multiplier,
                           router=RouterConfig(args.router, args.router_affinity_weight, args.router_load_weight))
    if args.usage_journal:
        config.usage_journal = Path(args.usage_journal)
    if args.files_dir:
        config.files_dir = Path(args.files_dir)
    config.lease_s = args.lease_s
    config.oidc = settings.get("oidc")
    tls = settings.get("tls") or {}
    certfile, keyfile = args.ssl_certfile or tls.get("certfile"), args.ssl_keyfile or tls.get("keyfile")
    if keyfile and not certfile:
        raise ValueError("--ssl-keyfile needs --ssl-certfile")
    if certfile:
        config.ssl_certfile, config.ssl_keyfile = Path(certfile), Path(keyfile) if keyfile else None
        check_pair(config.ssl_certfile, config.ssl_keyfile)
    if args.response_cache_ttl_s < 0 or args.response_cache_mib <= 0:
        raise ValueError("--response-cache-ttl-s must be at least 0 and --response-cache-mib above 0")
    if args.response_cache_ttl_s > 0:
        config.response_cache = ResponseCacheConfig(args.response_cache_ttl_s, int(args.response_cache_mib * 2**20))
    config.tenant_batch_queued_tokens = args.tenant_batch_queued_tokens
    config.webhook_master_secret = webhook_master_secret(args.webhook_secret_file)
    config.webhook_allow_networks = check_networks(tuple(args.webhook_allow_network))
    return config


def webhook_master_secret(path: str | None) -> bytes | None:
    """The file's bytes (stripped), else $INFERD_WEBHOOK_SECRET's; None: no webhooks."""
    raw = Path(path).read_bytes().strip() if path else os.environ.get("INFERD_WEBHOOK_SECRET", "").encode()
    if raw and len(raw) < 16:
        raise ValueError("the webhook master secret must be at least 16 bytes")
    return raw or None


def open_store(config: GatewayConfig, api_key: NewKey | None) -> Store:
    """Migrate the store; register --api-key (hashed) or, on a first start, make and show one key; on a start
    where tenant 'default' has no live key, say how to make one."""
    store = Store(config.db_url)
    store.migrate()
    if api_key:
        if store.find_key(api_key.lookup_id) is None:
            _default_tenant(store)
            store.create_key(DEFAULT_TENANT, "--api-key", new_key=api_key, actor="inferd-serve")
    elif not store.tenants():
        _default_tenant(store)
        _, new = store.create_key(DEFAULT_TENANT, "first key", actor="inferd-serve")
        print(f"\nCreated tenant '{DEFAULT_TENANT}' and its first API key (shown once, store it now):\n\n"
              f"    {new.key}\n\nMore keys: inferd keys create --tenant {DEFAULT_TENANT}\n", flush=True)
    elif any(t.name == DEFAULT_TENANT for t in store.tenants()) and \
            not any(k["revoked_unix_s"] is None for k in store.keys(DEFAULT_TENANT)):
        log.warning("tenant '%s' has no API key that works; make one with: inferd keys create --tenant %s",
                    DEFAULT_TENANT, DEFAULT_TENANT)
    return store


def _default_tenant(store: Store) -> None:
    if not any(t.name == DEFAULT_TENANT for t in store.tenants()):
        store.create_tenant(DEFAULT_TENANT, actor="inferd-serve")


def deployment_for(upstreams: list[Upstream], config: GatewayConfig, model_name: str | None = None,
                   tokenizer_source: str | None = None, max_model_len: int | None = None,
                   queue: QueueConfig | None = None, router: RouterConfig | None = None,
                   version: str = "v1", runtime: str | None = None, card: dict | None = None) -> Deployment:
    """A deployment over replicas that serve the same model; its card comes from the first one (given: an
    in-process replica's, read without a request)."""
    try:
        card = card or describe_upstream(upstreams[0].base_url, upstreams[0].api_key)
    except httpx.HTTPError as exc:
        if model_name is None:
            raise RuntimeError(f"cannot read {upstreams[0].base_url}/v1/models: {exc}") from None
        log.warning("cannot read %s/v1/models (%s); serving it as %s", upstreams[0].base_url, exc, model_name)
        card = {"id": model_name}
    ours = "source_path" in card
    runtime = runtime or ("inferd" if ours else "openai")
    source = tokenizer_source or card.get("source_path")
    if source is None:
        log.warning("no tokenizer for %s given (--tokenizer); counting tokens with the default model's", card["id"])
    return Deployment(name=model_name or card["id"], model=gateway_model(card, source, max_model_len),
                      upstreams=upstreams,
                      queue=AdmissionQueue(queue or config.queue), upstream_model=card["id"], internal_headers=ours,
                      router=Router(router or config.router), version=version, runtime=runtime,
                      card={k: v for k, v in card.items() if k in ("source_path", "digests")})


def describe_upstream(base_url: str, api_key: str | None, timeout_s: float = 10.0) -> dict:
    """The upstream's first /v1/models card (id, max_model_len, source_path when it is an inferd replica)."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{base_url.rstrip('/').removesuffix('/v1')}/v1/models", headers=headers, timeout=timeout_s)
    r.raise_for_status()
    return r.json()["data"][0]


def run_gateway(config: GatewayConfig, store: Store, deployments: Deployments, log_level: str,
                services=(), transport: UpstreamTransport | None = None) -> None:
    """services: control-plane parts started and closed with the app (Gateway.services), e.g. replica pools;
    transport: the one in-process replicas are mounted on (None: a new one)."""
    if config.redis_url:
        from inferd.gateway.redis_limiter import RedisLimiter
        limiter = RedisLimiter(config.redis_url)
    else:
        limiter = MemoryLimiter()
    tracer, provider = make_tracer("inferd-gateway", config.otlp_endpoint)
    gateway = Gateway(config, store, limiter, deployments, tracer, provider, transport)
    gateway.services.extend(services)
    if config.ssl_certfile:
        gateway.metrics.watch(lambda: expiry_metric(config.ssl_certfile))
    console = Console(gateway, config.console_viewer_key)
    gateway.services.append(console)
    names = ", ".join(deployments.by_name)
    log.info("inferd ready: model=%s url=%s://%s:%d (gateway %s, store %s, limits %s)", names,
             "https" if config.ssl_certfile else "http", config.host, config.port, config.gateway_id, store.engine.url.render_as_string(hide_password=True),
             "redis" if config.redis_url else "in-process")
    app = build_gateway_app(gateway, console.routes())
    # while a worker thread (the usage writer, the journal) runs Python, the event loop waits this long at most for
    # the GIL, not the default 5 ms: the overload run's rejection p99 at 10x fell from 9.4-9.7 to 8.2-8.6 ms
    # (benchmarks/results/overload-gil-switch.md)
    sys.setswitchinterval(0.0005)
    gc.collect()
    gc.freeze()  # a full collection walked start-up's ~110,000 objects: 80 ms of a stopped event loop
    server = GatewayServer(uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                                          ws_max_size=MAX_WS_FRAME_BYTES, http=ReadDeadlineProtocol,
                                          log_config=None, access_log=False, timeout_graceful_shutdown=5,
                                          ssl_certfile=config.ssl_certfile, ssl_keyfile=config.ssl_keyfile),
                           pools=[s for s in services if isinstance(s, ReplicaPool)])
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the SIGINT it caught again once it has shut down
        pass
    if not server.started:  # it could not listen (uvicorn.run's exit code)
        sys.exit(STARTUP_FAILURE)


class GatewayServer(uvicorn.Server):
    """uvicorn's server whose shutdown signal (SIGTERM, Ctrl-C) halts the replica pools at once: the shutdown
    stops the pools first, then (the app's shutdown: Gateway.close) their replicas. Without it a pool took the
    replicas that a terminal's Ctrl-C also stopped for crashed ones while the gateway waited for its
    connections, and started others."""

    def __init__(self, config: uvicorn.Config, pools: list[ReplicaPool]):
        super().__init__(config)
        self.pools = pools
        self._watch: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.config.ssl is not None:  # the certificate reloaded on SIGHUP and when its files change
            reloader = CertificateReloader(self.config.ssl, self.config.ssl_certfile, self.config.ssl_keyfile)
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reloader.reload)
            self._watch = asyncio.create_task(reloader.watch())

    async def shutdown(self, sockets=None) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await super().shutdown(sockets)

    def handle_exit(self, sig, frame) -> None:
        for pool in self.pools:
            pool.halt()
        super().handle_exit(sig, frame)
