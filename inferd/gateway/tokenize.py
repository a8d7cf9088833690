"""/tokenize, /detokenize and /tokenizer_info (vLLM's routes, which lm-eval's remote tokenizer calls) for text
models, answered here from the deployment's tokenizer, the one the gateway counts prompts with: the key is
authenticated and its access to the model checked as on every route; no replica, limit or usage record."""
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inferd.gateway.auth import client_address
from inferd.gateway.deployments import Deployment
from inferd.gateway.lifecycle import usable
from inferd.protocol.http import read_json
from inferd.protocol.openai import (DetokenizeRequest, TokenizeRequest, detokenize_answer, tokenize_answer,
                                    tokenizer_info)

KIND = "text"


class TokenizerRoutes:
    def __init__(self, gateway):
        self.gw = gateway

    def routes(self) -> list[Route]:
        return [Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/tokenizer_info", self.tokenizer_info, methods=["GET"])]

    async def tokenize(self, request: Request) -> Response:
        key = await self._key(request)
        body = TokenizeRequest.model_validate(await read_json(request, self.gw.config.max_body_bytes))
        d = self._deployment(request, key, body.model)
        return JSONResponse(tokenize_answer(d.model.tokenizer, body, d.model.max_model_len))

    async def detokenize(self, request: Request) -> Response:
        key = await self._key(request)
        body = DetokenizeRequest.model_validate(await read_json(request, self.gw.config.max_body_bytes))
        d = self._deployment(request, key, body.model)
        return JSONResponse(detokenize_answer(d.model.tokenizer, body, d.model.tokenizer.vocab_size))

    async def tokenizer_info(self, request: Request) -> Response:
        """The model in the query (?model=...), else the first text deployment."""
        d = self._deployment(request, await self._key(request), request.query_params.get("model"))
        return JSONResponse(tokenizer_info(d.model.tokenizer, d.model.max_model_len))

    async def _key(self, request: Request):
        return await self.gw.keys.authenticate(request.headers.get("authorization"), client_address(request))

    def _deployment(self, request: Request, key, model: str | None) -> Deployment:
        return usable(self.gw.deployments.stable(model, KIND), key, KIND, request.url.path, model)
