"""Hosted providers in their own protocols, behind the gateway's chat completions.

Each transport here sits between the gateway and one external deployment's provider (Upstream.transport);
control/launch.py picks it by the deployment's `api`.

An external deployment whose `api` is `anthropic`, `gemini` or `bedrock` gets, through its transport, the chat
completion the gateway planned in that provider's protocol, and its answer back as a chat completion: whole, or as
chunks translated event by event (protocol/anthropic.py, gemini.py, bedrock.py); `azure` is OpenAI's protocol at
Azure's URLs. The request path, the relay and the usage records see only OpenAI's shape, so limits, fallbacks and billing
work as for any upstream; the provider's usage is the record's, and an overloaded provider's answer (Anthropic's
529) a 503 that a fallback deployment may take.
"""
import json
import os
import re
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from urllib.parse import quote

import httpx
import orjson

from inferd.protocol import anthropic, bedrock, gemini

ANTHROPIC_VERSION = "2023-06-01"
BEDROCK_HOST = re.compile(r"bedrock-runtime(?:-fips)?\.([a-z0-9-]+)\.amazonaws\.com")
CHAT_PATH = "/v1/chat/completions"  # where the gateway sends a chat completion, after the deployment's base URL


class TranslatingTransport(httpx.AsyncBaseTransport, ABC):
    """A chat completion out in a provider's own protocol, and its answer back as one: whole, or its stream's
    events translated one by one as they come. Each provider says its URL, headers and translations."""

    def __init__(self, inner: httpx.AsyncBaseTransport | None = None):
        self.inner = inner or httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not request.url.path.endswith(CHAT_PATH):
            return _error(404, f"{request.url.path} has no counterpart in this provider's API")
        try:
            chat = json.loads(await request.aread())
            body = self.request_body(chat)
        except (ValueError, KeyError, TypeError) as exc:
            return _error(400, str(exc))
        key = request.headers.get("authorization", "").removeprefix("Bearer ")
        url = request.url.copy_with(path=request.url.path.removesuffix(CHAT_PATH) + self.path(chat),
                                    params=self.params(chat))
        response = await self.inner.handle_async_request(self.prepared(httpx.Request(
            "POST", url, headers={"content-type": "application/json"} | self.key_headers(key),
            content=orjson.dumps(body), extensions=request.extensions)))
        if response.status_code != 200 or not chat.get("stream"):
            content = await response.aread()
            await response.aclose()
            if response.status_code != 200:
                status, content = self.error(response.status_code, content)
                return httpx.Response(status, content=content, headers={"content-type": "application/json"})
            try:
                answer = self.answer(orjson.loads(content))
            except (ValueError, KeyError, TypeError, AttributeError):
                return _error(502, "The provider's answer could not be read.", "upstream_error")
            return httpx.Response(200, content=orjson.dumps(answer), headers={"content-type": "application/json"})
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=_Chunks(response, self.chunks()))

    async def aclose(self) -> None:
        await self.inner.aclose()

    # what each provider says

    @abstractmethod
    def path(self, chat: dict) -> str:
        """Where the chat completion goes, after the deployment's base URL (a /v1 at its end taken off)."""

    def params(self, chat: dict) -> dict[str, str]:
        return {}

    def prepared(self, request: httpx.Request) -> httpx.Request:
        """The request as it is sent (signed, for a provider that wants that)."""
        return request

    @abstractmethod
    def key_headers(self, key: str) -> dict[str, str]:
        """The headers that carry the deployment's key (and the protocol's version)."""

    @abstractmethod
    def request_body(self, chat: dict) -> dict:
        """The chat completion body in the provider's protocol; ValueError for what it cannot take."""

    @abstractmethod
    def answer(self, content: dict) -> dict:
        """A whole answer as a chat completion."""

    @abstractmethod
    def chunks(self):
        """A stream's translator: feed(the stream's next piece) -> chunks, end() -> what follows the last."""

    @abstractmethod
    def error(self, status: int, content: bytes) -> tuple[int, bytes]:
        """An error answer in OpenAI's shape, and its status."""


class AnthropicTransport(TranslatingTransport):
    """Messages at {base_url}/messages; bearer: the key as a Bearer token (a server that checks only that, as
    vLLM's), else as x-api-key."""

    def __init__(self, inner: httpx.AsyncBaseTransport | None = None, bearer: bool = False):
        super().__init__(inner)
        self.bearer = bearer

    def path(self, chat: dict) -> str:
        return "/v1/messages"

    def key_headers(self, key: str) -> dict[str, str]:
        out = {"anthropic-version": ANTHROPIC_VERSION}
        if key:
            out |= {"authorization": f"Bearer {key}"} if self.bearer else {"x-api-key": key}
        return out

    request_body = staticmethod(anthropic.messages_body)
    answer = staticmethod(anthropic.chat_completion)
    chunks = staticmethod(anthropic.ChunkStream)
    error = staticmethod(anthropic.chat_error)


class GeminiTransport(TranslatingTransport):
    """generateContent (streamGenerateContent with alt=sse) at {base_url}/models/{model}, the key as
    x-goog-api-key."""

    def path(self, chat: dict) -> str:
        return f"/models/{chat['model']}:{'streamGenerateContent' if chat.get('stream') else 'generateContent'}"

    def params(self, chat: dict) -> dict[str, str]:
        return {"alt": "sse"} if chat.get("stream") else {}

    def key_headers(self, key: str) -> dict[str, str]:
        return {"x-goog-api-key": key} if key else {}

    request_body = staticmethod(gemini.request_body)
    answer = staticmethod(gemini.chat_completion)
    chunks = staticmethod(gemini.ChunkStream)
    error = staticmethod(gemini.chat_error)


class BedrockTransport(TranslatingTransport):
    """Converse at {base_url}/model/{model}/converse (converse-stream), signed with SigV4 by botocore's signer with
    the credentials of botocore's chain (the environment, ~/.aws, an instance role); or, with the deployment's
    key, that key as a Bedrock API key (a Bearer token). The region is the base URL's
    (bedrock-runtime.REGION.amazonaws.com), else $AWS_REGION (control/spec.py checks there is one)."""

    def __init__(self, inner: httpx.AsyncBaseTransport | None = None):
        import botocore.session  # botocore: only where a deployment talks to Bedrock
        super().__init__(inner)
        self.credentials = botocore.session.get_session().get_credentials()

    def path(self, chat: dict) -> str:
        return f"/model/{quote(chat['model'], safe='')}/{'converse-stream' if chat.get('stream') else 'converse'}"

    def key_headers(self, key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {key}"} if key else {}

    def prepared(self, request: httpx.Request) -> httpx.Request:
        if "authorization" in request.headers:
            return request
        if self.credentials is None:  # the spec's check said so at start (control/spec.py); they went since
            raise httpx.ConnectError("no AWS credentials to sign the request with")
        from botocore.auth import SigV4Auth
        from botocore.awsrequest import AWSRequest
        host = BEDROCK_HOST.fullmatch(request.url.host)
        region = host[1] if host else os.environ.get("AWS_REGION", os.environ.get("AWS_DEFAULT_REGION"))
        aws = AWSRequest("POST", str(request.url), headers={"content-type": "application/json"},
                         data=request.content)
        SigV4Auth(self.credentials.get_frozen_credentials(), "bedrock", region).add_auth(aws)
        return httpx.Request("POST", request.url, headers=dict(aws.headers.items()), content=request.content,
                             extensions=request.extensions)

    request_body = staticmethod(bedrock.request_body)
    answer = staticmethod(bedrock.chat_completion)
    chunks = staticmethod(bedrock.ChunkStream)
    error = staticmethod(bedrock.chat_error)


class _Chunks(httpx.AsyncByteStream):
    """A provider's event stream as chat completion chunks, each event translated once it is whole."""


    def __init__(self, response: httpx.Response, chunks):
        self.response = response
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for data in self.response.aiter_raw():
            if out := self.chunks.feed(data):
                yield out
        if out := self.chunks.end():
            yield out

    async def aclose(self) -> None:
        await self.response.aclose()


class AzureTransport(httpx.AsyncBaseTransport):
    """Azure OpenAI: OpenAI's bodies and answers, at {endpoint}/openai/deployments/{deployment}/{operation} with
    its api-version, the key as `api-key`."""

    def __init__(self, deployment: str, api_version: str, inner: httpx.AsyncBaseTransport | None = None):
        self.deployment, self.api_version = deployment, api_version
        self.inner = inner or httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        root, _, operation = request.url.path.rpartition("/v1/")
        url = request.url.copy_with(path=f"{root}/openai/deployments/{self.deployment}/{operation}",
                                    params={"api-version": self.api_version})
        out = {k: v for k, v in request.headers.items() if k in ("content-type", "accept")}
        if key := request.headers.get("authorization", "").removeprefix("Bearer "):
            out["api-key"] = key
        return await self.inner.handle_async_request(httpx.Request(
            "POST", url, headers=out, content=await request.aread(), extensions=request.extensions))

    async def aclose(self) -> None:
        await self.inner.aclose()


def _error(status: int, message: str, code: str | None = None) -> httpx.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return httpx.Response(status, json={"error": {"message": message, "type": kind, "param": None, "code": code}})
