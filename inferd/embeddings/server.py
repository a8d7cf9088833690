"""An embedding replica: POST /v1/embeddings (OpenAI's contract), /v1/models, /health, /ready, /metrics."""
import asyncio
import base64
import json
import logging
import math
import time
from pathlib import Path

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inferd.embeddings.config import EmbeddingConfig
from inferd.embeddings.metrics import EmbeddingMetrics
from inferd.embeddings.runtime import EmbeddingRuntime
from inferd.protocol import headers
from inferd.protocol.errors import ModelNotFound
from inferd.protocol.http import build_app, read_json, unless_disconnected
from inferd.protocol.openai import EmbeddingRequest
from inferd.replica.loading import in_passing_thread
from inferd.replica.state import Readiness, batched_lifespan, deadline_s, outcome, status_routes

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 2**20
READINESS_INPUT = "Hello"


class EmbeddingRoutes:
    def __init__(self, runtime: EmbeddingRuntime, metrics: EmbeddingMetrics, readiness: Readiness,
                 max_body_bytes: int = MAX_BODY_BYTES):
        self.runtime, self.metrics, self.readiness, self.max_body_bytes = runtime, metrics, readiness, max_body_bytes

    def routes(self) -> list[Route]:
        return [Route("/v1/embeddings", self.embeddings, methods=["POST"]),
                Route("/v1/models", self.list_models, methods=["GET"]),
                *status_routes(self.readiness, lambda: {"queue_inputs": self.runtime.batcher.queued_items},
                               self.metrics.render)]

    async def embeddings(self, request: Request) -> Response:
        try:
            response, num_inputs, num_tokens = await self._embed(request)
        except BaseException as exc:
            self.metrics.observe_request(outcome(exc))
            raise
        self.metrics.observe_request("completed", num_inputs, num_tokens, time.monotonic() - request.state.arrival_s)
        return response

    async def _embed(self, request: Request) -> tuple[Response, int, int]:
        body = EmbeddingRequest.model_validate(await read_json(request, self.max_body_bytes))
        info = self.runtime.info
        if body.model is not None and body.model != info.name:
            raise ModelNotFound(f"The model '{body.model}' does not exist; this server serves '{info.name}'.",
                                param="model")
        dimensions = self.runtime.check_dimensions(body.dimensions)
        priority = headers.priority_class(request.headers.get(headers.PRIORITY)) or "interactive"
        deadline = deadline_s(request)
        token_ids = await asyncio.to_thread(self.runtime.tokenize, body.inputs(), body.truncate)
        vectors = await unless_disconnected(request, self.runtime.embed(token_ids, priority, deadline, dimensions))
        num_tokens = sum(len(t) for t in token_ids)
        response = await asyncio.to_thread(embedding_response, vectors, body.encoding_format, info.name, num_tokens)
        return response, len(token_ids), num_tokens

    async def list_models(self, request: Request) -> Response:
        i = self.runtime.info
        card = {"id": i.name, "object": "model", "created": int(self.readiness.loaded_unix_s or time.time()),
                "owned_by": "inferd", "kind": "embedding", "dimensions": i.dimensions,
                "max_input_tokens": i.max_input_tokens, "matryoshka": i.matryoshka, "dtype": i.dtype,
                "num_special_tokens": self.runtime.shape.num_special_tokens,
                "truncate": self.runtime.config.truncate, "source_path": i.source_path, "digests": i.digests}
        return JSONResponse({"object": "list", "data": [card]})


def embedding_response(vectors: torch.Tensor, encoding_format: str, model: str, num_tokens: int) -> JSONResponse:
    """OpenAI's response (rendered in a thread: 2048 vectors take a while); base64 is each vector's
    little-endian float32 bytes, as the openai SDK decodes it."""
    if encoding_format == "base64":
        rows = vectors.numpy().astype("<f4")
        encoded = [base64.b64encode(row.tobytes()).decode("ascii") for row in rows]
    else:
        encoded = vectors.tolist()
    usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    return JSONResponse({"object": "list", "model": model,
                         "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)],
                         "usage": usage}, headers={headers.USAGE: json.dumps(usage, separators=(",", ":"))})


# the app and its life

def build_embedding_app(runtime: EmbeddingRuntime, metrics: EmbeddingMetrics, *, api_key: str | None = None,
                        loaded_unix_s: float | None = None) -> Starlette:
    """runtime's batcher should report to metrics.observe_batch (EmbeddingRuntime's on_batch)."""
    readiness = Readiness(loaded_unix_s=loaded_unix_s or time.time())
    metrics.watch_queue(runtime.batcher)
    routes = EmbeddingRoutes(runtime, metrics, readiness).routes()
    return build_app(routes, batched_lifespan(runtime, readiness, lambda: _warm_up(runtime)), api_key)


async def _warm_up(runtime: EmbeddingRuntime) -> str:
    vectors = await runtime.embed(runtime.tokenize([READINESS_INPUT]))
    if vectors.shape != (1, runtime.info.dimensions) or not math.isfinite(float(vectors.abs().sum())):
        raise RuntimeError(f"the readiness embedding came out as {tuple(vectors.shape)}, or not finite")
    return f"model={runtime.info.name} dimensions={runtime.info.dimensions} dtype={runtime.info.dtype}"


def serve_embeddings(model_source: str | Path | None = None, host: str = "127.0.0.1", port: int = 8000,
                     api_key: str | None = None, served_model_name: str | None = None,
                     config: EmbeddingConfig | None = None, log_level: str = "info") -> None:
    """Load the model (None: the packaged all-MiniLM-L6-v2), then serve it until interrupted."""
    metrics = EmbeddingMetrics()
    runtime = in_passing_thread(lambda: EmbeddingRuntime.load(model_source, config, served_model_name,
                                                              on_batch=metrics.observe_batch))
    app = build_embedding_app(runtime, metrics, api_key=api_key, loaded_unix_s=time.time())
    log.info("serving embeddings of %s on http://%s:%d", runtime.info.name, host, port)
    uvicorn.run(app, host=host, port=port, log_level=log_level, log_config=None,
                access_log=log_level == "debug", timeout_graceful_shutdown=5)
