"""Forwarding an admitted request to its replica and relaying the answer, counting what it used."""
import json
from collections.abc import AsyncGenerator

import httpx
from opentelemetry import trace
from opentelemetry.propagate import inject
from starlette.responses import Response

from inferd.api.errors import ClientClosedRequest, ServiceUnavailable, error_body
from inferd.api.sse import SSE_DONE, SSEResponse, sse_event
from inferd.gateway.call import Call
from inferd.gateway.deployments import Upstream

PASSED_HEADERS = ("content-type",)
MAX_ATTEMPTS = 2  # a request no replica received is tried on at most this many


class UpstreamFailed(ServiceUnavailable):
    code = "upstream_unavailable"


def upstream_headers(call: Call) -> dict[str, str]:
    d, headers = call.deployment, {"content-type": "application/json", "x-request-id": call.request_id}
    if call.upstream.api_key:
        headers["authorization"] = f"Bearer {call.upstream.api_key}"
    if d.internal_headers:
        headers["x-inferd-cache-namespace"] = call.key.tenant.id
        headers["x-inferd-priority"] = call.priority_class
        headers["x-inferd-tenant"] = call.key.tenant.id
        if (ms := call.remaining_deadline_ms()) is not None:
            headers["x-inferd-deadline-ms"] = str(ms)
    inject(headers)
    return headers


async def forward(call: Call, client: httpx.AsyncClient, path: str, body: dict,
                  usage_mode: str) -> Response:
    """Send to the router's replica; finishes the call (and its usage record) however it ends.

    A request that never reached its replica (connection refused or timed out) is retried once on
    another one: the failed attempt gets its own record, linked by the request id.
    """
    tried: list[Upstream] = []
    while (sent := await _send(call, client, path, body, tried)) is None:
        pass
    response, span = sent
    if response.status_code != 200 or not body.get("stream"):
        return await _whole(call, response, span)
    return SSEResponse(_relay_stream(call, response, span, usage_mode), headers=call.response_headers())


async def _send(call: Call, client: httpx.AsyncClient, path: str, body: dict,
                tried: list[Upstream]) -> tuple[httpx.Response, trace.Span] | None:
    call.upstream = upstream = call.deployment.pick(call.plan.prompt_ids, call.key.tenant.id, exclude=tried)
    upstream.inflight += 1
    upstream.inflight_tokens += call.plan.reserved_tokens
    span = call.gateway.tracer.start_span("replica call", context=trace.set_span_in_context(call.span),
                                          kind=trace.SpanKind.CLIENT, attributes={"server.address": upstream.name})
    try:
        with trace.use_span(span, end_on_exit=False):
            req = client.build_request("POST", f"{upstream.base_url}{path}", json=body, headers=upstream_headers(call))
        return await client.send(req, stream=True), span
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        _leave(call, span)
        upstream.healthy = False  # out of routing until its /ready answers again
        tried.append(upstream)
        if len(tried) < MAX_ATTEMPTS and any(u.healthy and u not in tried for u in call.deployment.upstreams):
            call.retry(UpstreamFailed.code)
            return None
        await call.finish("failed", 503, UpstreamFailed.code)
        raise UpstreamFailed(f"No replica could be reached ({type(exc).__name__}); retry the request.") from None
    except httpx.HTTPError as exc:
        _leave(call, span)
        await call.finish("failed", 503, UpstreamFailed.code)
        raise UpstreamFailed(f"The replica failed ({type(exc).__name__}); retry the request.") from None
    except BaseException:
        _leave(call, span)
        await call.finish("cancelled", 499, "client_closed_request")
        raise


async def _whole(call: Call, response: httpx.Response, span: trace.Span) -> Response:
    try:
        content = await response.aread()
    except httpx.HTTPError as exc:
        await call.finish("failed", 503, UpstreamFailed.code)
        raise UpstreamFailed(f"The replica failed before it answered ({type(exc).__name__}).") from None
    except BaseException:
        await call.finish("cancelled", 499, ClientClosedRequest.code)
        raise
    finally:
        await response.aclose()
        _leave(call, span)
    ok = response.status_code == 200
    if ok:
        call.observe_usage(json.loads(content).get("usage"))
        call.first_token()
    await call.finish("completed" if ok else "failed", response.status_code, None if ok else _error_code(content))
    headers = {k: v for k, v in response.headers.items() if k in PASSED_HEADERS} | call.response_headers()
    return Response(content, status_code=response.status_code, headers=headers)


async def _relay_stream(call: Call, response: httpx.Response, span: trace.Span,
                        usage_mode: str) -> AsyncGenerator[bytes, None]:
    status, http_status, code = "cancelled", 499, ClientClosedRequest.code
    try:
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                status, http_status, code = "completed", 200, None
                yield SSE_DONE
                break
            event = json.loads(line[6:])
            if "error" in event:
                status, http_status, code = "failed", 200, (event["error"] or {}).get("code")
                yield line.encode() + b"\n\n"
                continue
            out = _client_chunk(call, event, usage_mode)
            if out is not None:
                yield out
    except httpx.HTTPError as exc:
        status, http_status, code = "failed", 200, UpstreamFailed.code
        yield sse_event(error_body(UpstreamFailed(f"The replica failed mid-stream ({type(exc).__name__}).")))
        yield SSE_DONE
    finally:
        await response.aclose()
        _leave(call, span)
        await call.finish(status, http_status, code)


def _client_chunk(call: Call, event: dict, usage_mode: str) -> bytes | None:
    """usage_mode is what the client asked for: none, final (include_usage) or continuous."""
    call.observe_usage(event.get("usage"))
    if not event.get("choices"):
        return sse_event(event) if usage_mode != "none" else None
    call.first_token()
    if usage_mode == "none":
        event.pop("usage", None)
    elif usage_mode == "final":
        event["usage"] = None
    return sse_event(event)


def _leave(call: Call, span: trace.Span) -> None:
    call.upstream.inflight -= 1
    call.upstream.inflight_tokens -= call.plan.reserved_tokens
    span.end()


def _error_code(content: bytes) -> str | None:
    try:
        return (json.loads(content).get("error") or {}).get("code")
    except (ValueError, AttributeError):
        return None

