"""A replica of our engine: the OpenAI app over it, /health, /ready (a real inference) and /metrics."""
import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, aclosing
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inferd.engine.async_engine import AsyncEngine
from inferd.engine.request import RequestOutput, SamplingParams
from inferd.models.config import LoadedModel
from inferd.replica.openai_app import APIConfig, ModelInfo, create_app
from inferd.replica.state import Readiness
from inferd.replica.metrics import ServerMetrics, metrics_route

log = logging.getLogger(__name__)

READINESS_PROMPT = "Hello"
# a prefill and a decode step: what a decode step builds on first use (the C++ decode loop: ~30 s on a machine's first
# start) is built before the replica says it is ready, not in its first user's time to first token
READINESS_TOKENS = 2


@dataclass(slots=True)
class ReplicaConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    log_level: str = "info"
    loaded_unix_s: float | None = None  # when the weights were loaded and the engine built (cold start)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class EngineBackend:
    """The engine as the OpenAI app sees it (openai_app.TextBackend)."""

    def __init__(self, engine: AsyncEngine, model: LoadedModel, served_model_name: str | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.info = ModelInfo(name=served_model_name or engine.model_name, max_model_len=engine.max_model_len,
                              vocab_size=model.tokenizer.vocab_size, source_path=str(model.path),
                              digests=dict(model.digests))

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 cache_namespace: str = "default", priority: int = 0) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(request_id, prompt_token_ids, params, cache_namespace, priority)


# app

def build_replica_app(engine: AsyncEngine, model: LoadedModel, config: ReplicaConfig) -> Starlette:
    backend = EngineBackend(engine, model, config.served_model_name)
    metrics = ServerMetrics(engine.stats)
    readiness = Readiness(loaded_unix_s=config.loaded_unix_s)
    routes = [Route("/health", _health, methods=["GET"]),
              Route("/ready", _ready_endpoint(engine, readiness), methods=["GET"]),
              metrics_route(metrics)]
    api_config = APIConfig(api_key=config.api_key)
    return create_app(backend, api_config, metrics=metrics, extra_routes=routes,
                      lifespan=_lifespan(engine, backend, readiness, config.url))


def serve(app: Starlette, config: ReplicaConfig) -> None:
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level, log_config=None,
                access_log=config.log_level == "debug", timeout_graceful_shutdown=5)


# health and readiness

async def _health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def _ready_endpoint(engine: AsyncEngine, readiness: Readiness):
    async def ready(request: Request) -> Response:
        """Also what the control plane reads: cold-start times and KV cache usage (0..1)."""
        stats = engine.stats()
        body = {"loaded_unix_s": readiness.loaded_unix_s, "warm_unix_s": readiness.warm_unix_s,
                "kv_cache_usage": stats.kv_blocks_used / max(stats.kv_blocks_total, 1)}
        if readiness.ready and engine.healthy:
            return JSONResponse({"status": "ready"} | body)
        return JSONResponse({"status": "not ready"} | body, status_code=503)
    return ready


def _lifespan(engine: AsyncEngine, backend: EngineBackend, readiness: Readiness, url: str):
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        probe = asyncio.create_task(_readiness_probe(engine, backend, readiness, url))
        try:
            yield
        finally:
            probe.cancel()
            readiness.ready = False
            await engine.stop()
    return lifespan


async def _readiness_probe(engine: AsyncEngine, backend: EngineBackend, readiness: Readiness, url: str) -> None:
    prompt = backend.tokenizer.encode(READINESS_PROMPT)
    params = SamplingParams(max_tokens=READINESS_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        async with aclosing(engine.generate("readiness-probe", prompt, params)) as outputs:
            async for out in outputs:
                if out.finished and out.num_output_tokens != READINESS_TOKENS:
                    raise RuntimeError(f"probe ended with {out.num_output_tokens} tokens ({out.finish_reason})")
    except Exception as exc:
        log.error("readiness inference failed: %s: %s", type(exc).__name__, exc)
        return
    readiness.warm_unix_s = time.time()
    readiness.ready = True
    log.info("replica ready: model=%s url=%s", backend.info.name, url)
