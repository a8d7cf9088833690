"""Runs batches: validates them, sends their lines through the request path, and writes their output files.

    validating → the input checked line by line (batches.validate) and the tenant's cap on queued batch
                 tokens; the lines stored and the batch in_progress in one transaction, or the batch failed
    in_progress → each pending line through RequestPath.serve as an in-process request: the batch's key,
                 the `batch` priority class, a deadline at the batch's expiry; so limits, admission, routing and
                 usage records are an interactive request's, priced at the batch multiplier. Per deployment at
                 most its queue's max_inflight lines at once; admission starts them only into free capacity.
                 A line refused for want of room (429, 503) stays pending and is tried again; any other
                 answer is its result, written once.
    finalizing → lines never run end as expired (past the window) or cancelled; the output and error files
                 written; the batch completed, expired or cancelled.

Everything is read back from the store, so a gateway killed at any point resumes its batches when it starts
again: completed lines keep their results, a line that was running when it died is run again. Several gateways
on one store share the work under leases (leases.py): a line runs only on the gateway that leased it, a
batch is validated and finalized by one gateway at a time; a dead gateway's leases lapse after lease_s and
another takes its lines over (a restarted gateway is another: it waits out its predecessor's leases too).
"""
import asyncio
import json
import logging
import time
import uuid

from starlette.requests import Request

from inferd.gateway import embeddings, text
from inferd.gateway import leases
from inferd.gateway.batches import Line, validate
from inferd.gateway.store import UNAVAILABLE
from inferd.gateway.tables import batch_lines, batches
from inferd.gateway.kinds import Operation
from inferd.protocol import headers
from inferd.protocol.errors import APIError, error_body, to_api_error
from inferd.protocol.http import whole_body

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often the runner looks for new, cancelled or expired work
RETRY_S = 1.0  # before a line refused for want of room is tried again
UNLIMITED_LINES = 64  # lines at once for a model that has no deployment of its own name (an alias)
ROOM = (429, 503)  # refusals that a later try may not meet
ENDING = ("in_progress", "cancelling", "finalizing")  # the statuses finalizing starts from or resumes


class BatchRunner:
    def __init__(self, gateway):
        self.gw = gateway
        self.operations: dict[str, Operation] = {  # OpenAI's Batch API: its endpoints, answered in its shapes
            op.path: op for op in (*text.OPERATIONS, *embeddings.OPERATIONS) if op.answer is None}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._driving: dict[str, asyncio.Task] = {}
        self._running: dict[str, int] = {}  # lines (and async jobs) in flight per model, all batches together
        self.owner = gateway.config.gateway_id  # whose leases (leases.py)

    def operation(self, endpoint: str | None) -> Operation | None:
        return self.operations.get(endpoint)

    def endpoints(self) -> list[str]:
        return list(self.operations)

    def wake(self) -> None:
        self._wake.set()

    def take_slot(self, model: str | None, kind: str) -> bool:
        """A place for one more batch-class request on the model (batch lines and async jobs together), so that
        they hold at most its queue's capacity and never fill the queue interactive requests wait in."""
        if self._running.get(model, 0) >= lines_at_once(self.gw.deployments, model, kind):
            return False
        self._running[model] = self._running.get(model, 0) + 1
        return True

    def give_slot(self, model: str | None) -> None:
        self._running[model] -= 1

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        """Stops at once: lines in flight are cancelled and stay pending (the next start runs them)."""
        tasks = [t for t in (self._task, *self._driving.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            try:
                for batch in await asyncio.to_thread(self.gw.batches.active):
                    if batch["id"] not in self._driving:
                        self._driving[batch["id"]] = asyncio.create_task(self._drive(batch["id"]))
            except UNAVAILABLE as exc:  # the store is down: one line per poll, no traceback
                log.warning("batch runner: the store cannot be read (%s); retrying", type(exc).__name__)
            except Exception:
                log.exception("batch runner: reading active batches failed")
            try:
                async with asyncio.timeout(POLL_S):  # not wait_for, which in 3.11 may swallow close()'s cancel
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()

    async def _drive(self, batch_id: str) -> None:
        try:
            batch = await asyncio.to_thread(self.gw.batches.row, batch_id)
            if batch["status"] == "validating":
                async with self._holding(batch_id, ("validating",)) as held:
                    if not held:
                        return  # another gateway validates it
                    batch = await self._validate(batch)
            if batch["status"] in ("in_progress", "cancelling"):
                await self._run_lines(batch)
            if (await asyncio.to_thread(self.gw.batches.row, batch_id))["status"] in ENDING:
                async with self._holding(batch_id, ENDING) as held:
                    if held:
                        await asyncio.to_thread(self._finalize, batch_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s: the runner failed; it is tried again", batch_id)
            await asyncio.sleep(POLL_S)
        finally:
            self._driving.pop(batch_id, None)

    def _holding(self, batch_id: str, statuses: tuple[str, ...]):
        """The batch's lease while it is one of statuses (validating, finalizing: one gateway at a time)."""
        return leases.holding(self.gw.store.engine, batches, self.owner, self.gw.config.lease_s,
                              batches.c.id == batch_id, batches.c.status.in_(statuses))

    async def _key(self, batch: dict):
        found = await asyncio.to_thread(self.gw.store.find_key, batch["key_id"].removeprefix("key_"))
        return found[0] if found else None

    # validating

    async def _validate(self, batch: dict) -> dict:
        store, config, op = self.gw.batches, self.gw.config, self.operations[batch["endpoint"]]
        key = await self._key(batch)
        errors: list[dict] = []
        if key is None:
            errors = [{"code": "invalid_api_key", "message": "The batch's key was revoked.", "line": None}]
        else:
            try:
                content = await asyncio.to_thread(self.gw.files.content, batch["tenant_id"], batch["input_file_id"])
            except APIError as exc:
                errors = [{"code": exc.code, "message": exc.message, "param": "input_file_id", "line": None}]
            else:
                lines, errors = await asyncio.to_thread(
                    validate, content, op, lambda o, raw: self.gw.requests.planned(key, o, raw),
                    min(op.max_body_bytes or config.max_body_bytes, config.max_body_bytes), config.batch_max_lines)
                if not errors:
                    errors = await asyncio.to_thread(self._within_token_cap, key.tenant, lines)
        if errors:
            await asyncio.to_thread(store.move, batch["id"], "failed", ("validating",), errors=errors)
        else:
            await asyncio.to_thread(store.start, batch["id"], lines)
        return await asyncio.to_thread(self.gw.batches.row, batch["id"])

    def _within_token_cap(self, tenant, lines: list[Line]) -> list[dict]:
        cap = queued_tokens_cap(self.gw.config, tenant)
        queued = self.gw.batches.queued_tokens(tenant.id) + self.gw.async_jobs.queued_tokens(tenant.id)
        wanted = sum(ln.reserved_tokens for ln in lines)
        if queued + wanted <= cap:
            return []
        return [{"code": "token_limit_exceeded", "line": None, "message":
                 f"The batch reserves {wanted} tokens and your unfinished batches and jobs {queued}; the limit of "
                 f"queued batch tokens is {cap}. Retry when they have run."}]

    # in_progress

    async def _run_lines(self, batch: dict) -> None:
        """Start pending lines while there is room, until none is left, the batch is cancelled or expires. Each
        line is leased to this gateway before it starts and while it runs (another gateway runs the others)."""
        op, running, after = self.operations[batch["endpoint"]], {}, 0  # running: task -> its line
        store, lease_s = self.gw.batches, self.gw.config.lease_s
        key, key_read_s, renewed_s = await self._key(batch), time.monotonic(), time.monotonic()
        try:
            while True:
                status = (await asyncio.to_thread(store.row, batch["id"]))["status"]
                expired = time.time() >= batch["expires_at"]
                if status != "in_progress" or expired or key is None:
                    await self._stop_lines(batch, running, cancel=expired or key is None)
                    if key is None:
                        await asyncio.to_thread(store.move, batch["id"], "cancelling", ("in_progress",))
                    return
                pending = [ln for ln in await asyncio.to_thread(store.pending, batch["id"], after, 64)
                           if ln["line"] not in running.values()]
                if not pending and after:
                    after = 0  # lines refused for want of room are tried again, from the start
                elif not pending and not running:
                    if not await asyncio.to_thread(store.pending_left, batch["id"]):
                        return
                    await asyncio.sleep(RETRY_S)  # the rest are other gateways' (or lapse to us)
                    continue
                for line in pending:
                    model = json.loads(line["body"]).get("model")
                    if not self.take_slot(model, op.kind):
                        break
                    after = line["line"]
                    if await asyncio.to_thread(store.claim_line, batch["id"], line["line"], self.owner, lease_s):
                        running[asyncio.create_task(self._line(batch, key, op, line, model))] = line["line"]
                    else:
                        self.give_slot(model)
                if running:
                    done, _ = await asyncio.wait(running, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        del running[task]
                elif pending or not after:
                    await asyncio.sleep(RETRY_S)
                if running and time.monotonic() - renewed_s > lease_s / 3:
                    await asyncio.to_thread(leases.renew, store.engine, batch_lines, self.owner, lease_s,
                                            batch_lines.c.batch_id == batch["id"],
                                            batch_lines.c.line.in_(list(running.values())))
                    renewed_s = time.monotonic()
                if time.monotonic() - key_read_s > POLL_S * 10:
                    key, key_read_s = await self._key(batch), time.monotonic()
        finally:
            for task in running:
                task.cancel()
            await asyncio.shield(asyncio.to_thread(leases.free, store.engine, batch_lines, self.owner,
                                                   batch_lines.c.batch_id == batch["id"]))

    async def _stop_lines(self, batch: dict, running: dict, cancel: bool) -> None:
        """Ours end (cancelled, or let finish); then those other gateways run, before the batch is finalized."""
        if cancel:
            for task in running:
                task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        running.clear()
        while await asyncio.to_thread(self.gw.batches.pending_left, batch["id"], self.owner):
            await asyncio.sleep(POLL_S)

    async def _line(self, batch: dict, key, op: Operation, line: dict, model: str | None) -> None:
        request_id = f"{batch['id']}-{line['line']}"
        try:
            status, content = await serve_in_process(self.gw, op, key, line["body"].encode(), request_id,
                                                     batch["expires_at"], batch["id"])
            if status in ROOM:  # stays pending: tried again, here or by a gateway with room
                await asyncio.to_thread(leases.free, self.gw.batches.engine, batch_lines, self.owner,
                                        batch_lines.c.batch_id == batch["id"], batch_lines.c.line == line["line"])
                await asyncio.sleep(RETRY_S)
                return
            if not await asyncio.to_thread(self.gw.batches.finish_line, batch["id"], line["line"], request_id,
                                           status, content):
                log.warning("batch %s line %d already had its result", batch["id"], line["line"])
        finally:
            self.give_slot(model)

    # finalizing

    def _finalize(self, batch_id: str) -> None:
        """In a thread: lines never run ended, the output and error files written, the batch ended. Safe to
        repeat (a gateway killed while finalizing does it again at its next start)."""
        store = self.gw.batches
        batch = store.row(batch_id)
        store.move(batch_id, "finalizing", ("in_progress", "cancelling"))
        end = ("cancelled" if batch["cancelling_at"] is not None else
               "expired" if time.time() >= batch["expires_at"] else "completed")
        if end != "completed":
            store.end_pending(batch_id, end)
        output, errors = [], []
        for line in store.lines(batch_id):
            item = _output_line(line)
            (output if line["status_code"] == 200 else errors).append(json.dumps(item, separators=(",", ":")))
        ids = {}
        for name, lines, prefix in (("output", output, "file-o"), ("error", errors, "file-e")):
            if lines:
                ids[f"{name}_file_id"] = self.gw.files.create(
                    batch["tenant_id"], f"{batch_id}_{name}.jsonl", "batch_output",
                    ("\n".join(lines) + "\n").encode(), file_id=prefix + batch_id.removeprefix("batch_"))["id"]
        store.move(batch_id, end, ("finalizing",), **ids)
        log.info("batch %s %s: %d answered, %d errors", batch_id, end, len(output), len(errors))


def queued_tokens_cap(config, tenant) -> int:
    """The most reserved tokens the tenant's batch lines and async jobs not yet run may hold together."""
    return config.tenant_batch_queued_tokens if tenant.batch_queued_tokens is None else tenant.batch_queued_tokens


def lines_at_once(ds, model: str | None, kind: str) -> int:
    """Lines (or jobs) at once for the model: its queue's capacity, so that each waits at most for one to end."""
    d = ds.get(model or ds.defaults.get(kind, ""))
    return max(d.queue.max_inflight, 1) if d is not None else UNLIMITED_LINES


async def serve_in_process(gw, op: Operation, key, body: bytes, request_id: str, expires_at: float,
                           batch_id: str) -> tuple[int, bytes]:
    """body through the request path as an in-process request of the batch class, with a deadline at
    expires_at (unix s); its status and body. batch_id: the batch (or async job) its usage records name."""
    left_ms = max(int((expires_at - time.time()) * 1000), 1)
    scope = {"type": "http", "method": "POST", "path": op.path, "query_string": b"", "path_params": {},
             "client": None, "headers": [(b"content-type", b"application/json"),
                                         (headers.PRIORITY.encode(), b"batch"),
                                         (headers.DEADLINE_MS.encode(), str(left_ms).encode())],
             "state": {"request_id": request_id, "arrival_s": time.monotonic()}}
    try:
        response = await gw.requests.serve(Request(scope, whole_body(body)), op, key=key, batch_id=batch_id)
    except APIError as exc:
        err = to_api_error(exc)
        return err.status, json.dumps(error_body(err)).encode()
    return response.status_code, bytes(response.body)


def _output_line(line: dict) -> dict:
    """A line of the output or error file, in OpenAI's format."""
    out = {"id": f"batch_req_{uuid.uuid5(uuid.NAMESPACE_URL, line['batch_id'] + str(line['line'])).hex}",
           "custom_id": line["custom_id"], "response": None, "error": None}
    if line["state"] == "done":
        try:
            body = json.loads(line["response"])
        except ValueError:
            body = line["response"]
        out["response"] = {"status_code": line["status_code"], "request_id": line["request_id"], "body": body}
    else:
        out["error"] = {"code": f"batch_{line['state']}",
                        "message": f"The line was not run: the batch was {line['state']} first."}
    return out
