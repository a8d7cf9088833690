"""/tokenize, /detokenize and /tokenizer_info (vLLM's routes, which lm-eval's remote tokenizer calls) and
Anthropic's /v1/messages/count_tokens for text models, answered here from the deployment's tokenizer, the one the gateway counts prompts with: the key is
authenticated and its access to the model checked as on every route; no replica, limit or usage record."""
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inferd.gateway.auth import authorization, client_address
from inferd.gateway.deployments import Deployment
from inferd.gateway.exchange import usable
from inferd.protocol.anthropic import CountTokensRequest
from inferd.protocol.errors import InvalidRequest
from inferd.protocol.http import read_json
from inferd.protocol.openai import (ChatCompletionRequest, DetokenizeRequest, TokenizeRequest, detokenize_answer,
                                    tokenize_answer, tokenizer_info)

KIND = "text"


class TokenizerRoutes:
    def __init__(self, gateway):
        self.gw = gateway

    def routes(self) -> list[Route]:
        return [Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
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

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's count of a messages request's input tokens: its prompt as the model reads it."""
        key = await self._key(request)
        body = CountTokensRequest.model_validate(await read_json(request, self.gw.config.max_body_bytes))
        d = self._deployment(request, key, body.model)
        chat = ChatCompletionRequest.model_validate(body.chat())
        try:
            prompt = chat.chat_prompt(d.model.tokenizer)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="messages") from None
        return JSONResponse({"input_tokens": len(d.model.tokenizer.encode(prompt, add_special_tokens=False))})

    async def tokenizer_info(self, request: Request) -> Response:
        """The model in the query (?model=...), else the first text deployment."""
        d = self._deployment(request, await self._key(request), request.query_params.get("model"))
        return JSONResponse(tokenizer_info(d.model.tokenizer, d.model.max_model_len))

    async def _key(self, request: Request):
        return await self.gw.keys.authenticate(authorization(request), client_address(request))

    def _deployment(self, request: Request, key, model: str | None) -> Deployment:
        return usable(self.gw.deployments.stable(model, KIND), key, KIND, request.url.path, model)
