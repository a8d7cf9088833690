"""A classical replica: POST /v1/predict, the Open Inference Protocol's /v2 routes (oip.py), /v1/models,
/health, /ready (after a real prediction) and /metrics. Errors: OpenAI's shape on /v1, the OIP's on /v2
(protocol/http.py picks it by path)."""
import asyncio
import logging
import time
from pathlib import Path

import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inferd.classical.answers import predict_response
from inferd.classical.config import ClassicalConfig
from inferd.classical.metrics import ClassicalMetrics
from inferd.classical.oip import OIPRoutes
from inferd.classical.runtime import Answer, ClassicalRuntime
from inferd.protocol import headers
from inferd.protocol.classical import MAX_PREDICT_BODY_BYTES, PredictRequest, decode_body, feature_matrix
from inferd.protocol.errors import ModelNotFound
from inferd.protocol.http import build_app, read_body, unless_disconnected
from inferd.replica.loading import in_passing_thread
from inferd.replica.state import Readiness, batched_lifespan, deadline_s, outcome, status_routes

log = logging.getLogger(__name__)

INLINE_ROWS = 256  # a request with more rows is checked in a thread, off the event loop


class ClassicalRoutes:
    def __init__(self, runtime: ClassicalRuntime, metrics: ClassicalMetrics, readiness: Readiness,
                 max_body_bytes: int = MAX_PREDICT_BODY_BYTES):
        self.runtime, self.metrics, self.readiness, self.max_body_bytes = runtime, metrics, readiness, max_body_bytes

    def routes(self) -> list[Route]:
        return [Route("/v1/predict", self.predict, methods=["POST"]),
                Route("/v1/models", self.list_models, methods=["GET"]),
                *status_routes(self.readiness, lambda: {"queue_rows": self.runtime.batcher.queued_cost},
                               self.metrics.render), *OIPRoutes(self).routes()]

    async def predict(self, request: Request) -> Response:
        return await self.observed("v1", request, self._predict(request))

    async def observed(self, api: str, request: Request, work) -> Response:
        """Runs work (-> response, rows), counting its outcome."""
        try:
            response, rows = await work
        except BaseException as exc:
            self.metrics.observe_request(api, outcome(exc))
            raise
        self.metrics.observe_request(api, "completed", rows, time.monotonic() - request.state.arrival_s)
        return response

    async def _predict(self, request: Request) -> tuple[Response, int]:
        body = PredictRequest.model_validate(decode_body(await read_body(request, self.max_body_bytes)))
        name = self.runtime.info.name
        if body.model is not None and body.model != name:
            raise ModelNotFound(f"The model '{body.model}' does not exist; this server serves '{name}'.",
                                param="model")
        rows = await self.off_loop(body.num_rows, feature_matrix, self.runtime.schema, body)
        answer = await self.run(request, rows)
        return predict_response(name, answer), len(rows)

    async def run(self, request: Request, rows: np.ndarray) -> Answer:
        priority = headers.priority_class(request.headers.get(headers.PRIORITY)) or "interactive"
        return await unless_disconnected(request, self.runtime.predict(rows, priority, deadline_s(request)))

    @staticmethod
    async def off_loop(rows: int, fn, *args):
        return fn(*args) if rows <= INLINE_ROWS else await asyncio.to_thread(fn, *args)

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.card()]})

    def card(self) -> dict:
        i = self.runtime.info
        return {"id": i.name, "object": "model", "created": int(self.readiness.loaded_unix_s or time.time()),
                "owned_by": "inferd", "kind": "classical", "task": self.runtime.task, "format": i.format,
                "platform": i.platform, "library": i.library, "version": i.version,
                "schema": self.runtime.schema.as_dict(), "max_batch_rows": self.runtime.config.max_batch_rows,
                "source_path": i.source_path, "digests": i.digests}


# the app and its life

def build_classical_app(runtime: ClassicalRuntime, metrics: ClassicalMetrics, *, api_key: str | None = None,
                        loaded_unix_s: float | None = None) -> Starlette:
    """runtime's batcher should report to metrics.observe_batch (ClassicalRuntime's on_batch)."""
    readiness = Readiness(loaded_unix_s=loaded_unix_s or time.time())
    metrics.watch_queue(runtime.batcher)
    routes = ClassicalRoutes(runtime, metrics, readiness)
    app = build_app(routes.routes(), batched_lifespan(runtime, readiness, lambda: _warm_up(runtime)), api_key)
    app.state.card = routes.card  # its /v1/models card without a request (an in-process replica's)
    return app


def load_classical_app(model_source: str | Path | None = None, api_key: str | None = None,
                       served_model_name: str | None = None, config: ClassicalConfig | None = None) -> Starlette:
    """The model loaded (None: the demo iris classifier, trained on first use) and its app, not yet started."""
    metrics = ClassicalMetrics()
    runtime = in_passing_thread(lambda: ClassicalRuntime.load(model_source, config, served_model_name,
                                                              on_batch=metrics.observe_batch))
    return build_classical_app(runtime, metrics, api_key=api_key, loaded_unix_s=time.time())


async def _warm_up(runtime: ClassicalRuntime) -> str:
    predictions, probabilities = await runtime.predict(runtime.readiness_rows())
    if len(predictions) != 1 or probabilities is not None and probabilities.shape[0] != 1:
        raise RuntimeError(f"the readiness prediction came out as {predictions!r}")
    i = runtime.info
    return f"model={i.name} format={i.format} task={runtime.task} features={len(runtime.schema.features)}"


def serve_classical(model_source: str | Path | None = None, host: str = "127.0.0.1", port: int = 8000,
                    api_key: str | None = None, served_model_name: str | None = None,
                    config: ClassicalConfig | None = None, log_level: str = "info") -> None:
    """Load the model (None: the demo iris classifier, trained on first use), then serve it until interrupted."""
    app = load_classical_app(model_source, api_key, served_model_name, config)
    card = app.state.card()
    log.info("serving %s (%s, sha256 %s) on http://%s:%d", card["id"], card["format"], card["digests"]["model"],
             host, port)
    uvicorn.run(app, host=host, port=port, log_level=log_level, log_config=None,
                access_log=log_level == "debug", timeout_graceful_shutdown=5)
