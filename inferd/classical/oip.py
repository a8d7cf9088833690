"""The Open Inference Protocol (KServe v2) on a classical replica: server and model health, model metadata,
and infer with typed tensors (protocol/oip.py checks them into the same rows /v1/predict runs). The
model's one version is its file's sha256, first 12 hex digits; the unversioned paths serve it too."""
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inferd.classical.answers import json_ready, json_response
from inferd.classical.runtime import Answer, ClassicalRuntime
from inferd.protocol import headers
from inferd.protocol.classical import decode_body
from inferd.protocol.errors import NotFound
from inferd.protocol.http import read_body
from inferd.protocol.oip import (MAX_BODY_BYTES, InferRequest, infer_matrix, infer_response, model_metadata,
                                 requested_outputs)
from inferd.replica.state import Readiness

SERVER_NAME = "inferd"


class PredictRoutes(Protocol):
    """What the v2 routes share with /v1/predict's (server.py's ClassicalRoutes): the model, readiness, the
    request's bookkeeping and the batched prediction."""
    runtime: ClassicalRuntime
    readiness: Readiness

    async def observed(self, api: str, request: Request, work: Awaitable[Response]) -> Response: ...
    async def run(self, request: Request, rows: np.ndarray) -> Answer: ...
    async def off_loop(self, rows: int, fn: Callable[..., Any], *args) -> Any: ...


class OIPRoutes:
    def __init__(self, v1: PredictRoutes):
        self.v1, self.runtime = v1, v1.runtime

    def routes(self) -> list[Route]:
        model, version = "/v2/models/{name}", "/v2/models/{name}/versions/{version}"
        return [Route("/v2", self.server_metadata, methods=["GET"]),
                Route("/v2/health/live", self.live, methods=["GET"]),
                Route("/v2/health/ready", self.server_ready, methods=["GET"]),
                Route(model, self.metadata, methods=["GET"]), Route(version, self.metadata, methods=["GET"]),
                Route(f"{model}/ready", self.model_ready, methods=["GET"]),
                Route(f"{version}/ready", self.model_ready, methods=["GET"]),
                Route(f"{model}/infer", self.infer, methods=["POST"]),
                Route(f"{version}/infer", self.infer, methods=["POST"])]

    async def server_metadata(self, request: Request) -> Response:
        return JSONResponse({"name": SERVER_NAME, "version": "2", "extensions": []})

    async def live(self, request: Request) -> Response:
        return JSONResponse({"live": True})

    async def server_ready(self, request: Request) -> Response:
        ready = self.v1.readiness.ready
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    async def metadata(self, request: Request) -> Response:
        self._check_model(request)
        i = self.runtime.info
        return JSONResponse(model_metadata(i.name, [i.version], i.platform, self.runtime.schema))

    async def model_ready(self, request: Request) -> Response:
        self._check_model(request)
        ready = self.v1.readiness.ready
        return JSONResponse({"name": self.runtime.info.name, "ready": ready}, status_code=200 if ready else 503)

    async def infer(self, request: Request) -> Response:
        return await self.v1.observed("v2", request, self._infer(request))

    async def _infer(self, request: Request) -> tuple[Response, int]:
        self._check_model(request)
        body = InferRequest.model_validate(decode_body(await read_body(request, MAX_BODY_BYTES)))
        schema = self.runtime.schema
        outputs = requested_outputs(schema, body)
        rows = await self.v1.off_loop(body.num_rows, infer_matrix, schema, body)
        predictions, probabilities = await self.v1.run(request, rows)
        i = self.runtime.info
        answer = infer_response(i.name, i.version, body.id, outputs, schema, json_ready(predictions),
                                None if probabilities is None else json_ready(probabilities))
        return json_response(answer, extra_headers=headers.usage_headers(len(rows))), len(rows)

    def _check_model(self, request: Request) -> None:
        name, version = request.path_params["name"], request.path_params.get("version")
        i = self.runtime.info
        if name != i.name:
            raise NotFound(f"Model '{name}' is not served here; this server serves '{i.name}'.",
                           code="model_not_found")
        if version is not None and version != i.version:
            raise NotFound(f"Model '{name}' has no version '{version}'; it has '{i.version}'.",
                           code="model_version_not_found")
