"""The replica's OpenAI API over a text runtime (the engine): prompts to engine jobs, outputs to responses."""
import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Protocol

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Lifespan

from inferd.engine.request import RequestOutput, SamplingParams
from inferd.protocol import headers
from inferd.protocol.errors import DeadlineExceeded, InvalidRequest, ModelNotFound, ServiceUnavailable, error_body
from inferd.protocol.http import build_app, read_json, unless_disconnected
from inferd.protocol.openai import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, SamplingRequest,
                                    TokenizeRequest, detokenize_answer, tokenize_answer, tokenizer_info, usage_body)
from inferd.protocol.sse import SSE_DONE, SSEResponse, sse_event
from inferd.protocol.tokenizer import Tokenizer
from inferd.replica.errors import replica_error
from inferd.replica.state import deadline_s
from inferd.replica.responses import (ChoiceResult, Echo, ResponseMeta, call_parsers, chat_chunk, chat_logprobs,
                                      chat_response, completion_chunk, completion_logprobs, completion_response,
                                      sampling_params, usage_chunk)
from inferd.replica.metrics import ServerMetrics


# what the API needs from a model runtime (the replica wires the engine in)

@dataclass(slots=True)
class ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int
    source_path: str
    digests: dict[str, str]
    created_unix_s: int = field(default_factory=lambda: int(time.time()))

    @property
    def fingerprint(self) -> str | None:
        weights = self.digests.get("weights")
        return f"fp_{weights[:12]}" if weights else None


class TextBackend(Protocol):
    info: ModelInfo
    tokenizer: Tokenizer

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 cache_namespace: str = "default", priority: int = 0) -> AsyncIterator[RequestOutput]: ...


@dataclass(slots=True)
class APIConfig:
    api_key: str | None = None
    max_body_bytes: int = 16 * 2**20
    internal_headers: bool = True  # read the gateway's cache namespace, priority, deadline and usage headers


@dataclass(slots=True)
class Job:
    """One choice: one engine sequence."""
    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float  # time.monotonic() when the HTTP request arrived
    deadline_s: float | None = None  # time.monotonic() by which its first output must exist
    cache_namespace: str = "default"  # the engine reuses cached KV only within one namespace (a tenant)
    priority: int = 0  # the engine's scheduling class: 0 interactive, 1 batch


# routes

class OpenAIRoutes:
    def __init__(self, backend: TextBackend, config: APIConfig, metrics: ServerMetrics | None):
        self.backend = backend
        self.config = config
        self.metrics = metrics

    def routes(self) -> list[BaseRoute]:
        return [Route("/v1/models", self.list_models, methods=["GET"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/tokenizer_info", self.tokenizer_info, methods=["GET"])]

    async def list_models(self, request: Request) -> Response:
        info = self.backend.info
        card = {"id": info.name, "object": "model", "created": info.created_unix_s, "owned_by": "inferd",
                "max_model_len": info.max_model_len, "source_path": info.source_path, "digests": info.digests}
        return JSONResponse({"object": "list", "data": [card]})

    async def chat_completions(self, request: Request) -> Response:
        body = ChatCompletionRequest.model_validate(await read_json(request, self.config.max_body_bytes))
        self._check_model(body.model)
        if body.tools:
            await asyncio.to_thread(body.check_tool_schemas)
        text = body.chat_prompt(self.backend.tokenizer)
        prompt = self.backend.tokenizer.encode(text, add_special_tokens=False)
        jobs = self._jobs(request, body, [prompt])
        meta = self._meta("chatcmpl", request)
        if body.stream:
            events = self._chat_events(meta, body, jobs, [len(prompt)], self._usage_events(request))
            return await self._stream(request, events)
        results = await unless_disconnected(request, self._collect(jobs))
        usage = _usage([len(prompt)], results)
        return _unary(chat_response(meta, results, usage, self._token_bytes, bool(body.logprobs),
                                    call_parsers(body, len(jobs))), usage, results)

    async def completions(self, request: Request) -> Response:
        body = CompletionRequest.model_validate(await read_json(request, self.config.max_body_bytes))
        self._check_model(body.model)
        prompts = body.prompt_token_ids(self.backend.tokenizer, self.backend.info.vocab_size)
        jobs = self._jobs(request, body, prompts)
        meta = self._meta("cmpl", request)
        lens = [len(p) for p in prompts]
        if body.stream:
            return await self._stream(request, self._completion_events(meta, body, jobs, lens,
                                                                       self._usage_events(request)))
        results = await unless_disconnected(request, self._collect(jobs))
        usage = _usage(lens, results)
        echoes = [self._echo(p, ids) for p, ids in zip(body.prompts(), prompts)] if body.echo else None
        return _unary(completion_response(meta, results, usage, self._token_bytes, body.logprobs is not None,
                                          echoes), usage, results)

    async def tokenize(self, request: Request) -> Response:
        body = TokenizeRequest.model_validate(await read_json(request, self.config.max_body_bytes))
        self._check_model(body.model)
        return JSONResponse(tokenize_answer(self.backend.tokenizer, body, self.backend.info.max_model_len))

    async def detokenize(self, request: Request) -> Response:
        body = DetokenizeRequest.model_validate(await read_json(request, self.config.max_body_bytes))
        self._check_model(body.model)
        return JSONResponse(detokenize_answer(self.backend.tokenizer, body, self.backend.info.vocab_size))

    async def tokenizer_info(self, request: Request) -> Response:
        return JSONResponse(tokenizer_info(self.backend.tokenizer, self.backend.info.max_model_len))

    # request preparation

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.backend.info.name:
            raise ModelNotFound(f"The model '{model}' does not exist; this server serves "
                                f"'{self.backend.info.name}'.", param="model")

    def _echo(self, prompt: str | list[int], token_ids: list[int]) -> Echo:
        """A text prompt comes back as sent; token ids as the text they decode to (special tokens kept)."""
        text = prompt if isinstance(prompt, str) else self.backend.tokenizer.decode(prompt, skip_special_tokens=False)
        return Echo(text, token_ids)

    def _jobs(self, request: Request, body: SamplingRequest, prompts: list[list[int]]) -> list[Job]:
        rid, n, max_len = request.state.request_id, body.num_choices, self.backend.info.max_model_len
        if any(not p for p in prompts):
            raise InvalidRequest("the prompt is empty", param="prompt")
        deadline, namespace, priority = deadline_s(request), self._cache_namespace(request), self._priority(request)
        return [Job(i * n + j, f"{rid}-{i * n + j}", p, sampling_params(body, len(p), max_len, j),
                    request.state.arrival_s, deadline, namespace, priority)
                for i, p in enumerate(prompts) for j in range(n)]

    def _cache_namespace(self, request: Request) -> str:
        return (request.headers.get(headers.CACHE_NAMESPACE) if self.config.internal_headers else None) or "default"

    def _priority(self, request: Request) -> int:
        """The engine's scheduling class: the index in PRIORITY_CLASSES (0 interactive, 1 batch)."""
        cls = headers.priority_class(request.headers.get(headers.PRIORITY)) if self.config.internal_headers else None
        return headers.PRIORITY_CLASSES.index(cls or "interactive")

    def _usage_events(self, request: Request) -> bool:
        return self.config.internal_headers and request.headers.get(headers.USAGE_EVENTS) == "1"

    def _meta(self, prefix: str, request: Request) -> ResponseMeta:
        info = self.backend.info
        return ResponseMeta(f"{prefix}-{request.state.request_id}", int(time.time()), info.name, info.fingerprint)

    def _token_bytes(self, token_id: int) -> bytes:
        return self.backend.tokenizer.token_bytes(token_id)

    # running choices

    async def _outputs(self, jobs: list[Job]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """All choices run concurrently; their outputs merged in arrival order."""
        queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(job, queue)) for job in jobs]
        remaining, unstarted = len(tasks), {job.index for job in jobs}
        try:
            while remaining:
                index, item = await _next_output(queue, jobs[0].deadline_s if unstarted else None)
                unstarted.discard(index)
                if isinstance(item, Exception):
                    raise item
                if item is None:
                    remaining -= 1
                elif item.finished and item.finish_reason == "abort":
                    raise ServiceUnavailable("The request was aborted by the server; retry it.")
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()

    async def _pump(self, job: Job, queue: asyncio.Queue) -> None:
        trace = self.metrics.start_sequence(job.arrival_s) if self.metrics else None
        try:
            outs = self.backend.generate(job.request_id, job.prompt_token_ids, job.params, job.cache_namespace,
                                         job.priority)
            async with aclosing(outs):
                async for out in outs:
                    if trace:
                        trace.observe(out)
                    queue.put_nowait((job.index, out))
            queue.put_nowait((job.index, None))
        except asyncio.CancelledError:
            if trace:
                trace.abort()
            raise
        except Exception as exc:
            queue.put_nowait((job.index, exc))

    async def _collect(self, jobs: list[Job]) -> list[ChoiceResult]:
        results = [ChoiceResult(job.index) for job in jobs]
        async with aclosing(self._outputs(jobs)) as outputs:
            async for index, out in outputs:
                results[index].add(out)
        return results

    # streaming

    async def _stream(self, request: Request, events: AsyncGenerator[bytes, None]) -> Response:
        """Wait for the first event, so that a request failing before any output gets a real status code."""
        try:
            first = await unless_disconnected(request, anext(events))
        except BaseException:
            await events.aclose()
            raise
        return SSEResponse(_sse_body(first, events))

    async def _chat_events(self, meta: ResponseMeta, body: ChatCompletionRequest, jobs: list[Job],
                           prompt_lens: list[int], usage_events: bool) -> AsyncGenerator[bytes, None]:
        usage, results, started = body.include_usage, [ChoiceResult(job.index) for job in jobs], [False] * len(jobs)
        parsers = call_parsers(body, len(jobs))
        async with aclosing(self._outputs(jobs)) as outputs:
            async for index, out in outputs:
                if not started[index]:
                    started[index] = True
                    yield sse_event(chat_chunk(meta, index, {"role": "assistant", "content": ""}, None, None,
                                               _so_far(body, prompt_lens, results)))
                results[index].count(out)
                lps = chat_logprobs(out.logprobs, self._token_bytes) if body.logprobs and out.logprobs else None
                if parsers:  # the text, or each call's head and then its arguments in pieces
                    deltas = parsers[index].feed(out.text)
                else:
                    deltas = [{"content": out.text}] if out.text else []
                if not deltas and (lps or out.finished):
                    deltas = [{}]
                finish = _finish(out)
                if finish == "stop" and parsers and parsers[index].complete:
                    finish = "tool_calls"
                for k, delta in enumerate(deltas):
                    last = k == len(deltas) - 1
                    event = sse_event(chat_chunk(meta, index, delta, lps if k == 0 else None, finish if last else None,
                                                 _so_far(body, prompt_lens, results)))
                    yield event + _usage_comment(prompt_lens, results) if usage_events and last else event
        if usage:
            yield sse_event(usage_chunk(meta, "chat.completion.chunk", _usage(prompt_lens, results)))
        yield SSE_DONE

    async def _completion_events(self, meta: ResponseMeta, body: CompletionRequest, jobs: list[Job],
                                 prompt_lens: list[int], usage_events: bool) -> AsyncGenerator[bytes, None]:
        usage, results, offsets = body.include_usage, [ChoiceResult(job.index) for job in jobs], [0] * len(jobs)
        async with aclosing(self._outputs(jobs)) as outputs:
            async for index, out in outputs:
                results[index].count(out)
                lps = None
                if body.logprobs is not None and out.logprobs:
                    lps = completion_logprobs(out.logprobs, self._token_bytes, offsets[index])
                offsets[index] += len(out.text)
                if out.text or lps or out.finished:
                    event = sse_event(completion_chunk(meta, index, out.text, lps, _finish(out),
                                                       _so_far(body, prompt_lens, results)))
                    yield event + _usage_comment(prompt_lens, results) if usage_events else event
        if usage:
            yield sse_event(usage_chunk(meta, "text_completion", _usage(prompt_lens, results)))
        yield SSE_DONE


# helpers

def create_app(backend: TextBackend, config: APIConfig, *, metrics: ServerMetrics | None = None,
               extra_routes: Sequence[BaseRoute] = (), lifespan: Lifespan | None = None) -> Starlette:
    """The OpenAI-compatible app; extra_routes (health, metrics) share its request ids and error shape."""
    routes = OpenAIRoutes(backend, config, metrics).routes() + list(extra_routes)
    return build_app(routes, lifespan, config.api_key, replica_error)


async def _next_output(queue: asyncio.Queue, deadline_s: float | None) -> tuple:
    if deadline_s is None:
        return await queue.get()
    try:
        async with asyncio.timeout(max(deadline_s - time.monotonic(), 0.0)):
            return await queue.get()
    except TimeoutError:
        raise DeadlineExceeded("The request's deadline passed before it started; it was dropped.") from None


async def _sse_body(first: bytes, events: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    try:
        yield first
        async for event in events:
            yield event
    except Exception as exc:
        yield sse_event(error_body(replica_error(exc)))
        yield SSE_DONE
    finally:
        await events.aclose()


def _so_far(body: SamplingRequest, prompt_lens: list[int], results: list[ChoiceResult]) -> bool | dict:
    """The chunk's usage field: the usage so far with continuous_usage_stats, else null or absent."""
    if body.continuous_usage:
        return _usage(prompt_lens, results)
    return body.include_usage


def _unary(body: dict, usage: dict, results: list[ChoiceResult]) -> JSONResponse:
    """A whole answer; its usage also in a header, so that the gateway need not parse the body, and the time
    from its first output token to now (the gateway's TPOT of an answer it did not see stream)."""
    out = {headers.USAGE: json.dumps(usage, separators=(",", ":"))}
    firsts = [r.first_token_time for r in results if r.first_token_time is not None]
    if firsts:
        out[headers.DECODE_S] = f"{max(time.monotonic() - min(firsts), 0.0):.6f}"
    return JSONResponse(body, headers=out)


def _usage_comment(prompt_lens: list[int], results: list[ChoiceResult]) -> bytes:
    """The usage so far as an SSE comment, for the gateway (USAGE_EVENTS); it bills cancelled streams by it."""
    usage = json.dumps(_usage(prompt_lens, results), separators=(",", ":")).encode()
    return headers.USAGE_PREFIX + usage + b"\n\n"


def _finish(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finished else None


def _usage(prompt_lens: list[int], results: list[ChoiceResult]) -> dict:
    """Each prompt counts once, as cached as the least cached of its n choices (results in job order)."""
    n = len(results) // len(prompt_lens)
    cached = sum(min(r.num_cached_tokens for r in results[i:i + n]) for i in range(0, len(results), n))
    return usage_body(sum(prompt_lens), sum(r.num_output_tokens for r in results), cached)
