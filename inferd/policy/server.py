"""A policy replica: POST /v1/policy/infer (one observation as an openpi msgpack frame in, its action chunk
as msgpack out), /v1/models (the policy's metadata), /health, /ready (after a real forward pass) and
/metrics. Sessions, keys and deadlines-from-the-robot's-clock are the gateway's (gateway/sessions.py);
the replica checks each observation again and drops one whose deadline passes while it waits."""
import logging
import time
from pathlib import Path

import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inferd.policy.config import PolicyConfig
from inferd.policy.metrics import PolicyMetrics
from inferd.policy.runtime import PolicyRuntime
from inferd.protocol import headers
from inferd.protocol.errors import APIError, InvalidRequest, PayloadTooLarge, to_api_error
from inferd.protocol.http import build_app, read_body, unless_disconnected
from inferd.protocol.policy import PolicyError, check_observation, packb, unpackb
from inferd.replica.loading import in_passing_thread
from inferd.replica.state import Readiness, batched_lifespan, deadline_s, outcome, status_routes

log = logging.getLogger(__name__)

MSGPACK = "application/msgpack"


def policy_error(exc: BaseException) -> APIError:
    if isinstance(exc, PolicyError):
        return InvalidRequest(exc.message, code=exc.code)
    return to_api_error(exc)


class PolicyRoutes:
    def __init__(self, runtime: PolicyRuntime, metrics: PolicyMetrics, readiness: Readiness):
        self.runtime, self.metrics, self.readiness = runtime, metrics, readiness

    def routes(self) -> list[Route]:
        return [Route("/v1/policy/infer", self.infer, methods=["POST"]),
                Route("/v1/models", self.list_models, methods=["GET"]),
                *status_routes(self.readiness, lambda: {"queue_observations": self.runtime.batcher.queued_items},
                               self.metrics.render)]

    async def infer(self, request: Request) -> Response:
        try:
            frame = await read_body(request, self.runtime.config.max_frame_bytes)
            observation = check_observation(self.runtime.spec, unpackb(frame))
            priority = headers.priority_class(request.headers.get(headers.PRIORITY)) or "interactive"
            chunk = await unless_disconnected(request, self.runtime.infer(
                observation.values, priority, deadline_s(request)))
        except BaseException as exc:
            if isinstance(exc, PayloadTooLarge):
                exc.code = "frame_too_large"
            self.metrics.observe(outcome(policy_error(exc) if isinstance(exc, PolicyError) else exc))
            raise
        self.metrics.observe("completed", time.monotonic() - request.state.arrival_s)
        infer_ms, queue_ms = chunk.infer_s * 1000, chunk.queue_s * 1000
        body = {"actions": chunk.actions, "policy_timing": {"infer_ms": infer_ms, "batch_size": chunk.batch_size},
                "server_timing": {"infer_ms": infer_ms, "queue_ms": queue_ms}}
        return Response(packb(body), media_type=MSGPACK)

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.card()]})

    def card(self) -> dict:
        files, c = self.runtime.files, self.runtime.config
        return {"id": self.runtime.name, "object": "model", "created": int(self.readiness.loaded_unix_s or time.time()),
                "owned_by": "inferd", "kind": "policy", "metadata": self.runtime.metadata(),
                "max_frame_bytes": c.max_frame_bytes, "max_sessions": c.max_sessions,
                "idle_timeout_s": c.idle_timeout_s, "max_batch_size": c.max_batch_size,
                "source_path": str(files.path), "digests": dict(files.digests)}


def build_policy_app(runtime: PolicyRuntime, metrics: PolicyMetrics, *, api_key: str | None = None,
                     loaded_unix_s: float | None = None) -> Starlette:
    """runtime's batcher should report to metrics.observe_batch (PolicyRuntime's on_batch)."""
    readiness = Readiness(loaded_unix_s=loaded_unix_s or time.time())
    metrics.watch_queue(runtime.batcher)
    routes = PolicyRoutes(runtime, metrics, readiness)
    app = build_app(routes.routes(), batched_lifespan(runtime, readiness, lambda: _warm_up(runtime)), api_key,
                    policy_error)
    app.state.card = routes.card  # its /v1/models card without a request (an in-process replica's)
    return app


def load_policy_app(model_source: str | Path | None = None, api_key: str | None = None,
                    served_model_name: str | None = None, config: PolicyConfig | None = None) -> Starlette:
    """The policy loaded (None: the packaged demo) and its app, not yet started."""
    metrics = PolicyMetrics()
    runtime = in_passing_thread(lambda: PolicyRuntime.load(model_source, config, served_model_name,
                                                           on_batch=metrics.observe_batch))
    return build_policy_app(runtime, metrics, api_key=api_key, loaded_unix_s=time.time())


async def _warm_up(runtime: PolicyRuntime) -> str:
    chunk = await runtime.infer(runtime.readiness_observation())
    m = runtime.metadata()
    want = (m["action_horizon"], m["action_dim"])
    if chunk.actions.shape != want or not np.isfinite(chunk.actions).all():
        raise RuntimeError(f"the readiness forward pass gave actions of shape {chunk.actions.shape}, not {want}")
    return f"policy={runtime.name} horizon={want[0]} dim={want[1]} control_hz={m['control_hz']}"


def serve_policy(model_source: str | Path | None = None, host: str = "127.0.0.1", port: int = 8000,
                 api_key: str | None = None, served_model_name: str | None = None,
                 config: PolicyConfig | None = None, log_level: str = "info") -> None:
    """Load the policy (None: the packaged demo), then serve it until interrupted."""
    app = load_policy_app(model_source, api_key, served_model_name, config)
    card = app.state.card()
    log.info("serving policy %s (sha256 %s) on http://%s:%d", card["id"], card["digests"].get("model"), host, port)
    uvicorn.run(app, host=host, port=port, log_level=log_level, log_config=None,
                access_log=log_level == "debug", timeout_graceful_shutdown=5)
