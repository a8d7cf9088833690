"""The OpenAI Batches API: a batch, its lines and their results in the store; validation before any work.

    POST /v1/batches   GET /v1/batches (paginated)   GET /v1/batches/{id}   POST /v1/batches/{id}/cancel

A batch's status moves   validating → in_progress → finalizing → completed | expired | cancelled
                         validating → failed (its errors name the input's lines)
                         in_progress → cancelling → finalizing → cancelled
and only through BatchStore.move, which stamps the status's time. Its lines (tables.batch_lines) are written
once each: a result replaces state 'pending' and nothing else (BatchStore.finish_line). Request counts are
counted from the lines, never kept apart. The runner (batch_runner.py) does the work.
"""
import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass

from sqlalchemy import Engine, func, insert, select, update
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inferd.gateway import leases
from inferd.gateway.auth import authorization, client_address
from inferd.gateway.files import list_page, page_limit
from inferd.gateway.kinds import Operation
from inferd.gateway.oidc import stored_key_required
from inferd.gateway.tables import batch_lines, batches
from inferd.protocol.errors import InvalidRequest, NotFound, to_api_error
from inferd.protocol.http import decode_json

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
ENDED = ("failed", "completed", "expired", "cancelled")
WINDOW = re.compile(r"^(\d+)([smh])$")  # OpenAI takes "24h"; shorter windows too (tests, short jobs)
MAX_WINDOW_S = 24 * 3600
MAX_LISTED_ERRORS = 100


@dataclass(slots=True)
class Line:
    line: int
    custom_id: str
    body: str  # JSON
    reserved_tokens: int


class BatchStore:
    def __init__(self, engine: Engine):
        self.engine = engine

    def create(self, tenant_id: str, key_id: str, endpoint: str, input_file_id: str, window: str,
               metadata: dict | None) -> dict:
        now = int(time.time())
        row = {"id": f"batch_{uuid.uuid4().hex}", "tenant_id": tenant_id, "key_id": key_id, "endpoint": endpoint,
               "input_file_id": input_file_id, "completion_window": window, "status": "validating",
               "metadata": metadata, "created_at": now, "expires_at": now + window_s(window)}
        with self.engine.begin() as conn:
            conn.execute(insert(batches).values(**row))
        return self.get(tenant_id, row["id"])

    def get(self, tenant_id: str | None, batch_id: str) -> dict:
        """The batch object (tenant_id None: whoever's, for the runner)."""
        query = select(batches).where(batches.c.id == batch_id)
        if tenant_id is not None:
            query = query.where(batches.c.tenant_id == tenant_id)
        with self.engine.connect() as conn:
            row = conn.execute(query).mappings().first()
        if row is None:
            raise NotFound(f"No such batch: '{batch_id}'.", param="batch_id", code="batch_not_found")
        return batch_object(dict(row), self.counts([batch_id])[batch_id])

    def row(self, batch_id: str) -> dict:
        with self.engine.connect() as conn:
            return dict(conn.execute(select(batches).where(batches.c.id == batch_id)).mappings().one())

    def page(self, tenant_id: str, limit: int, after: str | None) -> dict:
        out = list_page(self.engine, select(batches).where(batches.c.tenant_id == tenant_id), batches, tenant_id,
                        limit, after, dict)
        counts = self.counts([r["id"] for r in out["data"]])
        out["data"] = [batch_object(r, counts[r["id"]]) for r in out["data"]]
        return out

    def counts(self, batch_ids: list[str]) -> dict[str, dict]:
        """request_counts from the lines: completed (answered 200), failed (any other end), total."""
        out = {b: {"total": 0, "completed": 0, "failed": 0} for b in batch_ids}
        ok = func.sum(func.coalesce(func.cast(batch_lines.c.status_code == 200, batch_lines.c.line.type), 0))
        ended = func.sum(func.coalesce(func.cast(batch_lines.c.state != "pending", batch_lines.c.line.type), 0))
        query = (select(batch_lines.c.batch_id, func.count(), ok, ended)
                 .where(batch_lines.c.batch_id.in_(batch_ids)).group_by(batch_lines.c.batch_id))
        with self.engine.connect() as conn:
            for batch_id, total, completed, done in conn.execute(query):
                out[batch_id] = {"total": total, "completed": int(completed or 0),
                                 "failed": int(done or 0) - int(completed or 0)}
        return out

    def move(self, batch_id: str, status: str, frm: tuple[str, ...], **values) -> bool:
        """Change the batch's status (and stamp its time) if it is now one of frm; False if it was not."""
        values |= {"status": status, f"{status}_at": int(time.time())}
        with self.engine.begin() as conn:
            done = conn.execute(update(batches).where(batches.c.id == batch_id, batches.c.status.in_(frm))
                                .values(**values))
        return done.rowcount == 1

    def start(self, batch_id: str, lines: list[Line]) -> bool:
        """The validated lines stored and the batch in_progress, in one transaction."""
        with self.engine.begin() as conn:
            done = conn.execute(update(batches).where(batches.c.id == batch_id, batches.c.status == "validating")
                                .values(status="in_progress", in_progress_at=int(time.time())))
            if done.rowcount != 1:
                return False
            for i in range(0, len(lines), 1000):
                conn.execute(insert(batch_lines), [
                    {"batch_id": batch_id, "line": ln.line, "custom_id": ln.custom_id, "body": ln.body,
                     "reserved_tokens": ln.reserved_tokens, "state": "pending"} for ln in lines[i:i + 1000]])
        return True

    def active(self) -> list[dict]:
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(select(batches).where(batches.c.status.in_(ACTIVE))
                                                  .order_by(batches.c.seq)).mappings()]

    def pending(self, batch_id: str, after_line: int, limit: int) -> list[dict]:
        """Pending lines no gateway holds (leases.py), after after_line."""
        query = (select(batch_lines.c.line, batch_lines.c.custom_id, batch_lines.c.body)
                 .where(batch_lines.c.batch_id == batch_id, batch_lines.c.state == "pending",
                        batch_lines.c.line > after_line, leases.free_or_lapsed(batch_lines, time.time()))
                 .order_by(batch_lines.c.line).limit(limit))
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(query).mappings()]

    def claim_line(self, batch_id: str, line: int, owner: str, lease_s: float) -> bool:
        return leases.claim(self.engine, batch_lines, owner, lease_s, batch_lines.c.batch_id == batch_id,
                            batch_lines.c.line == line, batch_lines.c.state == "pending")

    def pending_left(self, batch_id: str, besides_owner: str | None = None) -> int:
        """Lines still pending (besides_owner: only those another gateway holds a live lease on)."""
        c = batch_lines.c
        query = select(func.count()).where(c.batch_id == batch_id, c.state == "pending")
        if besides_owner is not None:
            query = query.where(c.lease_until >= time.time(), c.lease_owner != besides_owner)
        with self.engine.connect() as conn:
            return conn.execute(query).scalar_one()

    def finish_line(self, batch_id: str, line: int, request_id: str, status_code: int, response: bytes) -> bool:
        """The line's result, once: False if it already had one."""
        with self.engine.begin() as conn:
            done = conn.execute(update(batch_lines).where(batch_lines.c.batch_id == batch_id,
                                                          batch_lines.c.line == line, batch_lines.c.state == "pending")
                                .values(state="done", request_id=request_id, status_code=status_code,
                                        response=response.decode(errors="replace"), ended_at=int(time.time()),
                                        lease_owner=None, lease_until=None))
        return done.rowcount == 1

    def end_pending(self, batch_id: str, state: str) -> int:
        """Every line still pending ends as `state` (expired, cancelled)."""
        with self.engine.begin() as conn:
            return conn.execute(update(batch_lines).where(batch_lines.c.batch_id == batch_id,
                                                          batch_lines.c.state == "pending")
                                .values(state=state, ended_at=int(time.time()))).rowcount

    def lines(self, batch_id: str) -> list[dict]:
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(select(batch_lines).where(batch_lines.c.batch_id == batch_id)
                                                  .order_by(batch_lines.c.line)).mappings()]

    def queued_tokens(self, tenant_id: str) -> int:
        """Reserved tokens of the tenant's lines not yet run, in its active batches."""
        query = (select(func.coalesce(func.sum(batch_lines.c.reserved_tokens), 0))
                 .select_from(batch_lines.join(batches, batches.c.id == batch_lines.c.batch_id))
                 .where(batches.c.tenant_id == tenant_id, batches.c.status.in_(ACTIVE),
                        batch_lines.c.state == "pending"))
        with self.engine.connect() as conn:
            return int(conn.execute(query).scalar_one())


def window_s(window: str) -> int:
    m = WINDOW.match(window or "")
    seconds = int(m[1]) * {"s": 1, "m": 60, "h": 3600}[m[2]] if m else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise InvalidRequest("completion_window must be '24h' (or a shorter window such as '30m')",
                             param="completion_window")
    return seconds


def batch_object(row: dict, counts: dict) -> dict:
    errors = row.get("errors")
    return {"id": row["id"], "object": "batch", "endpoint": row["endpoint"],
            "errors": {"object": "list", "data": errors} if errors else None, "input_file_id": row["input_file_id"],
            "completion_window": row["completion_window"], "status": row["status"],
            "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
            **{f"{t}_at": row[f"{t}_at"] for t in ("created", "in_progress", "expires", "finalizing", "completed",
                                                   "failed", "expired", "cancelling", "cancelled")},
            "request_counts": counts, "metadata": row["metadata"]}


# validation

def validate(content: bytes, op: Operation, planned, max_body_bytes: int, max_lines: int
             ) -> tuple[list[Line], list[dict]]:
    """The input file's lines, each checked as the request path would refuse it (planned: RequestPath.planned
    with the batch's key); and the errors, each naming its line. Runs in a thread (it tokenizes)."""
    lines, errors, seen = [], [], set()

    def error(number: int, code: str, message: str, param: str | None = None) -> None:
        errors.append({"code": code, "message": message, "param": param, "line": number})

    raw_lines = [ln for ln in content.split(b"\n")]
    if raw_lines and not raw_lines[-1].strip():
        raw_lines.pop()
    if not raw_lines:
        error(None, "empty_file", "The input file has no lines.")
    if len(raw_lines) > max_lines:
        error(None, "too_many_lines", f"The input file has {len(raw_lines)} lines; at most {max_lines} are taken.")
        raw_lines = []
    for number, raw in enumerate(raw_lines, 1):
        try:
            item = decode_json(raw)
        except ValueError:
            error(number, "invalid_json_line", "This line is not valid JSON.")
            continue
        if not isinstance(item, dict) or not isinstance(item.get("custom_id"), str) or not isinstance(
                item.get("body"), dict):
            error(number, "invalid_request", "A line needs custom_id (a string), method, url and body (an object).")
            continue
        custom_id, body = item["custom_id"], item["body"]
        if custom_id in seen:
            error(number, "duplicate_custom_id", f"The custom_id '{custom_id}' is used by an earlier line.",
                  "custom_id")
            continue
        seen.add(custom_id)
        if item.get("method", "POST") != "POST":
            error(number, "invalid_method", "A line's method must be POST.", "method")
        elif item.get("url") != op.path:
            error(number, "mismatched_url", f"The line's url is {item.get('url')!r}; this batch's endpoint is "
                  f"{op.path}.", "url")
        elif body.get("stream"):
            error(number, "streaming_unsupported", "A batch line cannot stream.", "body.stream")
        elif len(encoded := json.dumps(body, separators=(",", ":"))) > max_body_bytes:
            error(number, "body_too_large", f"The line's body is larger than {max_body_bytes} bytes.", "body")
        else:
            try:
                plan = planned(op, body)
            except Exception as exc:  # what the request path would refuse the line with
                err = to_api_error(exc)
                error(number, err.code or "invalid_request", err.message, err.param)
                continue
            lines.append(Line(number, custom_id, encoded, plan.reserved_tokens))
    return lines, errors[:MAX_LISTED_ERRORS]


# routes

class BatchRoutes:
    def __init__(self, gateway):
        self.gw = gateway

    def routes(self) -> list[Route]:
        return [Route("/v1/batches", self.create, methods=["POST"]),
                Route("/v1/batches", self.listing, methods=["GET"]),
                Route("/v1/batches/{batch_id}", self.get, methods=["GET"]),
                Route("/v1/batches/{batch_id}/cancel", self.cancel, methods=["POST"])]

    async def _key(self, request: Request):
        return await self.gw.keys.authenticate(authorization(request), client_address(request))

    async def create(self, request: Request) -> Response:
        key = await self._key(request)
        stored_key_required(key, "Batches")
        try:
            body = decode_json(await request.body())
        except ValueError:
            raise InvalidRequest("The request body is not valid JSON.", code="invalid_json") from None
        if not isinstance(body, dict):
            raise InvalidRequest("The request body must be a JSON object.")
        endpoint, file_id = body.get("endpoint"), body.get("input_file_id")
        if self.gw.batch_runner.operation(endpoint) is None:
            raise InvalidRequest(f"endpoint must be one of {', '.join(self.gw.batch_runner.endpoints())}",
                                 param="endpoint")
        window = body.get("completion_window", "24h")
        window_s(window)
        metadata = body.get("metadata")
        if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16):
            raise InvalidRequest("metadata must be an object of at most 16 pairs", param="metadata")
        if not isinstance(file_id, str):
            raise InvalidRequest("input_file_id is required", param="input_file_id")
        file = await asyncio.to_thread(self.gw.files.get, key.tenant.id, file_id)
        if file["purpose"] != "batch":
            raise InvalidRequest(f"The file '{file_id}' is not a batch input file.", param="input_file_id")
        batch = await asyncio.to_thread(self.gw.batches.create, key.tenant.id, key.id, endpoint, file_id, window,
                                        metadata)
        self.gw.batch_runner.wake()
        return JSONResponse(batch)

    async def listing(self, request: Request) -> Response:
        key, q = await self._key(request), request.query_params
        return JSONResponse(await asyncio.to_thread(self.gw.batches.page, key.tenant.id, page_limit(q, 20),
                                                    q.get("after")))

    async def get(self, request: Request) -> Response:
        key = await self._key(request)
        return JSONResponse(await asyncio.to_thread(self.gw.batches.get, key.tenant.id,
                                                    request.path_params["batch_id"]))

    async def cancel(self, request: Request) -> Response:
        """Stops new lines; running ones finish; the batch ends cancelled with what was done."""
        key, batch_id = await self._key(request), request.path_params["batch_id"]
        batch = await asyncio.to_thread(self.gw.batches.get, key.tenant.id, batch_id)
        if batch["status"] in ("validating", "in_progress"):
            await asyncio.to_thread(self.gw.batches.move, batch_id, "cancelling", ("validating", "in_progress"))
            self.gw.batch_runner.wake()
        elif batch["status"] not in ("cancelling", "cancelled"):
            raise InvalidRequest(f"A batch that is {batch['status']} cannot be cancelled.", code="batch_not_cancellable")
        return JSONResponse(await asyncio.to_thread(self.gw.batches.get, key.tenant.id, batch_id))
