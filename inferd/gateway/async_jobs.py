"""Asynchronous single requests: a POST to a serving route with `Prefer: respond-async` (RFC 7240) or
`x-inferd-async: 1` is answered 202 at once with a job; the job runs later, durable in the store.

    POST /v1/chat/completions | /v1/completions | /v1/embeddings   (+ Prefer: respond-async)
         → 202 {job}, Location: /v1/async/{id}, Preference-Applied: respond-async
    GET  /v1/async/{id}          the job; once ended its `response`: the status and body the synchronous call
                                 would have answered
    GET  /v1/async               the tenant's jobs, newest first (limit, after: OpenAI's cursor pagination)
    POST /v1/async/{id}/cancel   queued or in_progress → cancelled (a running request is aborted)

The body is checked before the 202 as the synchronous route checks it (its key, size, JSON, fields, model,
access, per-request limits: RequestPath.planned), so bad input is a 400 at once, never a failed job. A job
cannot stream. An optional `x-inferd-webhook-url` header names where its result is POSTed, signed
(webhooks.py). A job's status moves only through AsyncJobStore's conditional updates:

    queued → in_progress → completed (answered 200) | failed (any other answer, or past its window)
    queued | in_progress → cancelled

The runner (async_runner.py) runs jobs at the batch priority class, priced at the batch multiplier, with a
usage record per attempt that names the job in its batch_id.
"""
import asyncio
import json
import time
import uuid

from sqlalchemy import Engine, func, insert, select, update
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inferd.gateway import leases, webhooks
from inferd.gateway.auth import authorization, client_address
from inferd.gateway.batch_runner import queued_tokens_cap
from inferd.gateway.files import list_page, page_limit
from inferd.gateway.kinds import Operation
from inferd.gateway.oidc import stored_key_required
from inferd.gateway.tables import async_jobs, webhook_deliveries
from inferd.protocol import headers
from inferd.protocol.errors import InvalidRequest, NotFound, RateLimitExceeded
from inferd.protocol.http import read_body

RUNNING = ("queued", "in_progress")
ENDED = ("completed", "failed", "cancelled")
MAX_DELIVERIES_SHOWN = 20
_ASYNC = headers.ASYNC.encode()


def wants_async(request: Request) -> bool:
    """Prefer: respond-async (among other preferences), or x-inferd-async: 1 / true."""
    for name, value in request.scope["headers"]:  # the raw list, once: every serving request asks this
        if name == b"prefer" and any(p.split(b";")[0].strip().lower() == b"respond-async" for p in value.split(b",")):
            return True
        if name == _ASYNC and value.strip().lower() in (b"1", b"true", b"yes"):
            return True
    return False


class AsyncJobStore:
    def __init__(self, engine: Engine):
        self.engine = engine

    def create(self, tenant_id: str, key_id: str, endpoint: str, body: bytes, reserved_tokens: int,
               window_s: int, webhook_url: str | None) -> dict:
        now = int(time.time())
        row = {"id": f"async_{uuid.uuid4().hex}", "tenant_id": tenant_id, "key_id": key_id, "endpoint": endpoint,
               "body": body.decode(), "reserved_tokens": reserved_tokens, "status": "queued",
               "webhook_url": webhook_url, "created_at": now, "expires_at": now + window_s}
        with self.engine.begin() as conn:
            conn.execute(insert(async_jobs).values(**row))
        return self.get(tenant_id, row["id"])

    def row(self, tenant_id: str | None, job_id: str) -> dict:
        query = select(async_jobs).where(async_jobs.c.id == job_id)
        if tenant_id is not None:
            query = query.where(async_jobs.c.tenant_id == tenant_id)
        with self.engine.connect() as conn:
            row = conn.execute(query).mappings().first()
        if row is None:
            raise NotFound(f"No such async job: '{job_id}'.", param="job_id", code="async_job_not_found")
        return dict(row)

    def get(self, tenant_id: str | None, job_id: str) -> dict:
        """The job object (tenant_id None: whoever's, for the runner and its webhook)."""
        return job_object(self.row(tenant_id, job_id), self.deliveries(job_id))

    def page(self, tenant_id: str, limit: int, after: str | None) -> dict:
        """The tenant's jobs, newest first (their webhook deliveries left out)."""
        return list_page(self.engine, select(async_jobs).where(async_jobs.c.tenant_id == tenant_id), async_jobs,
                         tenant_id, limit, after, lambda row: job_object(row, None))

    def deliveries(self, job_id: str) -> list[dict]:
        query = (select(webhook_deliveries).where(webhook_deliveries.c.job_id == job_id)
                 .order_by(webhook_deliveries.c.id.desc()).limit(MAX_DELIVERIES_SHOWN))
        with self.engine.connect() as conn:
            return [{k: r[k] for k in ("attempt", "at_unix_s", "duration_s", "status_code", "error")}
                    for r in reversed(conn.execute(query).mappings().all())]

    def start(self, job_id: str) -> None:
        self._move(job_id, ("queued",), status="in_progress", started_at=int(time.time()))

    def finish(self, job_id: str, status: str, status_code: int | None, response: bytes) -> bool:
        """The job's result, once (False if it had ended); its webhook, if any, is due now."""
        return self._move(job_id, RUNNING, status=status, status_code=status_code,
                          response=response.decode(errors="replace"), ended_at=int(time.time()))

    def cancel(self, tenant_id: str, job_id: str) -> dict:
        job = self.row(tenant_id, job_id)
        if job["status"] not in RUNNING and job["status"] != "cancelled":
            raise InvalidRequest(f"A job that is {job['status']} cannot be cancelled.", code="job_not_cancellable")
        self._move(job_id, RUNNING, status="cancelled", ended_at=int(time.time()))
        return self.get(tenant_id, job_id)

    def _move(self, job_id: str, frm: tuple[str, ...], **values) -> bool:
        if values["status"] in ENDED:
            values |= {"lease_owner": None, "lease_until": None}
        with self.engine.begin() as conn:
            done = conn.execute(update(async_jobs).where(async_jobs.c.id == job_id, async_jobs.c.status.in_(frm))
                                .values(**values))
            if done.rowcount and values["status"] in ENDED:
                conn.execute(update(async_jobs).where(async_jobs.c.id == job_id,
                                                      async_jobs.c.webhook_url.is_not(None))
                             .values(webhook_state="pending", webhook_next_at=time.time()))
        return done.rowcount == 1

    def statuses(self, job_ids: list[str]) -> dict[str, str]:
        with self.engine.connect() as conn:
            return dict(conn.execute(select(async_jobs.c.id, async_jobs.c.status)
                                     .where(async_jobs.c.id.in_(job_ids))).all())

    # leases and deliveries (async_runner.py)

    def claim(self, owner: str, lease_s: float, limit: int, besides: list[str], webhooks: bool = False
              ) -> list[dict]:
        """Up to limit jobs to run (webhooks: whose result is due at their webhook), oldest first, leased to
        owner; besides: ids it already holds."""
        now, c = time.time(), async_jobs.c
        due = (c.webhook_state == "pending", c.webhook_next_at <= now) if webhooks else (c.status.in_(RUNNING),)
        query = (select(c.id).where(*due, leases.free_or_lapsed(async_jobs, now), c.id.not_in(besides))
                 .order_by(c.seq).limit(limit))
        with self.engine.connect() as conn:
            ids = conn.execute(query).scalars().all()
        claimed = [i for i in ids if leases.claim(self.engine, async_jobs, owner, lease_s, c.id == i, *due)]
        return [self.row(None, i) for i in claimed]

    def delivered(self, job_id: str, owner: str, attempt: int, at_unix_s: float, status_code: int | None,
                  error: str | None, next_at: float | None, max_attempts: int) -> str:
        """One delivery attempt recorded; the job's webhook state after it (delivered, pending, failed)."""
        ok = status_code is not None and 200 <= status_code < 300
        state = "delivered" if ok else "failed" if attempt >= max_attempts or next_at is None else "pending"
        with self.engine.begin() as conn:
            conn.execute(insert(webhook_deliveries).values(
                job_id=job_id, attempt=attempt, at_unix_s=at_unix_s, duration_s=time.time() - at_unix_s,
                status_code=status_code, error=error[:256] if error else None))
            conn.execute(update(async_jobs).where(async_jobs.c.id == job_id, async_jobs.c.lease_owner == owner)
                         .values(webhook_state=state, webhook_next_at=next_at if state == "pending" else None,
                                 lease_owner=None, lease_until=None))
        return state

    def attempts(self, job_id: str) -> int:
        with self.engine.connect() as conn:
            return conn.execute(select(func.count()).where(webhook_deliveries.c.job_id == job_id)).scalar_one()

    def queued_tokens(self, tenant_id: str) -> int:
        query = select(func.coalesce(func.sum(async_jobs.c.reserved_tokens), 0)).where(
            async_jobs.c.tenant_id == tenant_id, async_jobs.c.status.in_(RUNNING))
        with self.engine.connect() as conn:
            return int(conn.execute(query).scalar_one())


def job_object(row: dict, deliveries: list[dict] | None) -> dict:
    response = None
    if row["status_code"] is not None:
        try:
            body = json.loads(row["response"])
        except ValueError:
            body = row["response"]
        response = {"status_code": row["status_code"], "body": body}
    link = f"/v1/async/{row['id']}"
    return {"id": row["id"], "object": "async.job", "endpoint": row["endpoint"], "status": row["status"],
            "created_at": row["created_at"], "started_at": row["started_at"], "ended_at": row["ended_at"],
            "expires_at": row["expires_at"], "response": response,
            "links": {"self": link, "cancel": f"{link}/cancel"},
            "webhook": None if row["webhook_url"] is None else {
                "url": row["webhook_url"], "state": row["webhook_state"]} | (
                {} if deliveries is None else {"deliveries": deliveries})}


# routes

class AsyncRoutes:
    def __init__(self, gateway):
        self.gw = gateway

    def routes(self) -> list[Route]:
        return [Route("/v1/async", self.listing, methods=["GET"]),
                Route("/v1/async/{job_id}", self.get, methods=["GET"]),
                Route("/v1/async/{job_id}/cancel", self.cancel, methods=["POST"])]

    async def _key(self, request: Request):
        return await self.gw.keys.authenticate(authorization(request), client_address(request))

    async def submit(self, request: Request, op: Operation) -> Response:
        """The 202 for a request that asked to be answered asynchronously; its checks are the sync route's."""
        gw, config = self.gw, self.gw.config
        key = await self._key(request)
        stored_key_required(key, "Async jobs")
        content = await read_body(request, min(op.max_body_bytes or config.max_body_bytes, config.max_body_bytes))
        raw = op.decode(content)
        body = op.body_type.model_validate(raw)
        if getattr(body, "stream", False):
            raise InvalidRequest("An asynchronous request cannot stream; poll the job or name a webhook.",
                                 param="stream", code="streaming_unsupported")
        headers.priority_class(request.headers.get(headers.PRIORITY))  # checked as the sync route checks them
        headers.deadline_ms(request.headers.get(headers.DEADLINE_MS))
        plan = gw.requests.planned(key, op, raw)
        url = request.headers.get(headers.WEBHOOK_URL)
        if url is not None:
            if not gw.webhook_secrets.enabled:
                raise InvalidRequest("This gateway sends no webhooks (it has no webhook secret); poll the job.",
                                     param="webhook_url", code="webhooks_disabled")
            await asyncio.to_thread(webhooks.check_url, url, config.webhook_allow_networks)
        await asyncio.to_thread(self._within_token_cap, key.tenant, plan.reserved_tokens)
        try:
            content.decode()
        except UnicodeDecodeError:  # JSON in UTF-16 or -32: stored as UTF-8
            content = json.dumps(raw).encode()
        job = await asyncio.to_thread(gw.async_jobs.create, key.tenant.id, key.id, op.path, content,
                                      plan.reserved_tokens, config.async_window_s, url)
        gw.async_runner.wake()
        return JSONResponse(job, status_code=202, headers={
            "location": job["links"]["self"], "preference-applied": "respond-async", "retry-after": "1"})

    def _within_token_cap(self, tenant, tokens: int) -> None:
        """Async jobs and batch lines not yet run share the tenant's cap on queued batch tokens."""
        cap = queued_tokens_cap(self.gw.config, tenant)
        queued = self.gw.async_jobs.queued_tokens(tenant.id) + self.gw.batches.queued_tokens(tenant.id)
        if queued + tokens > cap:
            raise RateLimitExceeded(
                f"The job reserves {tokens} tokens and your unfinished batches and jobs {queued}; the limit of "
                f"queued batch tokens is {cap}. Retry when they have run.", code="token_limit_exceeded")

    async def listing(self, request: Request) -> Response:
        key, q = await self._key(request), request.query_params
        return JSONResponse(await asyncio.to_thread(self.gw.async_jobs.page, key.tenant.id, page_limit(q, 20),
                                                    q.get("after")))

    async def get(self, request: Request) -> Response:
        key = await self._key(request)
        return JSONResponse(await asyncio.to_thread(self.gw.async_jobs.get, key.tenant.id,
                                                    request.path_params["job_id"]))

    async def cancel(self, request: Request) -> Response:
        key = await self._key(request)
        job = await asyncio.to_thread(self.gw.async_jobs.cancel, key.tenant.id, request.path_params["job_id"])
        self.gw.async_runner.wake()
        return JSONResponse(job)
