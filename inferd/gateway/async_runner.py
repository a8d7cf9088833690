"""Runs async jobs and delivers their webhooks, from the store, under leases (leases.py).

    run      → a queued job (or one whose gateway's lease lapsed) leased to this gateway while the batch
               runner has a slot for its model (batch lines and jobs together hold at most the model's queue
               capacity: BatchRunner.take_slot); in_progress, through the request path as a batch line is
               (batch_runner.serve_in_process): the job's key, the batch class, a deadline at its expiry,
               priced at the batch multiplier, its usage record naming the job. Refused for want of room (429,
               503): tried again (after 1 s, doubling to 30 s) until it expires. Any other answer is its result,
               written once (AsyncJobStore.finish). A job cancelled meanwhile has its request aborted.
    deliver  → an ended job whose webhook is due: its object POSTed, signed (webhooks.py), each attempt
               recorded; a failure (no answer, not 2xx, or the URL refused) is tried again after
               webhook_backoff_s, doubling, until webhook_max_attempts.

The leases are renewed every lease_s / 3 while the work runs; a gateway that closes frees its own; one that
dies leaves them to lapse, and then another gateway (or this one, restarted) takes the job over: a job that was
running is run again from the start, a job that had ended is never run again.
"""
import asyncio
import json
import logging
import time
from datetime import datetime, timezone

import httpx

from inferd.gateway import leases, webhooks
from inferd.gateway.batch_runner import ROOM, RETRY_S, serve_in_process
from inferd.gateway.store import UNAVAILABLE
from inferd.gateway.tables import async_jobs
from inferd.protocol.errors import APIError, AuthenticationFailed, DeadlineExceeded, error_body, to_api_error

log = logging.getLogger(__name__)

POLL_S = 1.0
MAX_RETRY_S = 30.0  # the longest wait before a job refused for want of room (429, 503) is tried again
MAX_DELIVERIES_AT_ONCE = 16


class AsyncRunner:
    def __init__(self, gateway):
        self.gw = gateway
        self.owner = gateway.config.gateway_id
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._runs: dict[str, asyncio.Task] = {}  # job id -> its run
        self._deliveries: dict[str, asyncio.Task] = {}  # job id -> its webhook's delivery
        self._renewed_s = 0.0
        self._client: httpx.AsyncClient | None = None

    def wake(self) -> None:
        self._wake.set()

    async def start(self) -> None:
        c = self.gw.config
        self._client = httpx.AsyncClient(timeout=c.webhook_timeout_s, follow_redirects=False)
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        """Stops at once; the jobs it held are freed for the next gateway (their requests cancelled)."""
        tasks = [t for t in (self._task, *self._runs.values(), *self._deliveries.values()) if t is not None]
        held = [*self._runs, *self._deliveries]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if held:
            await asyncio.to_thread(leases.free, self.gw.store.engine, async_jobs, self.owner,
                                    async_jobs.c.id.in_(held))
        if self._client is not None:
            await self._client.aclose()

    async def _loop(self) -> None:
        while True:
            try:
                await self._step()
            except UNAVAILABLE as exc:  # the store is down: one line per poll, no traceback
                log.warning("async runner: the store cannot be read (%s); retrying", type(exc).__name__)
            except Exception:
                log.exception("async runner: a step failed")
            try:
                async with asyncio.timeout(POLL_S):  # not wait_for, which in 3.11 may swallow close()'s cancel
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()

    async def _step(self) -> None:
        store, c = self.gw.async_jobs, self.gw.config
        if self._runs:
            statuses = await asyncio.to_thread(store.statuses, list(self._runs))
            for job_id, task in self._runs.items():
                if statuses.get(job_id) == "cancelled" and not task.done():
                    task.cancel()  # its request is aborted; the job stays cancelled
        held = [*self._runs, *self._deliveries]
        if held and time.monotonic() - self._renewed_s > c.lease_s / 3:
            await asyncio.to_thread(leases.renew, self.gw.store.engine, async_jobs, self.owner, c.lease_s,
                                    async_jobs.c.id.in_(held))
            self._renewed_s = time.monotonic()
        if (room := c.async_max_running - len(self._runs)) > 0:
            jobs = await asyncio.to_thread(store.claim, self.owner, c.lease_s, room, held)
            for i, job in enumerate(jobs):
                model, kind = json.loads(job["body"]).get("model"), self._operation(job).kind
                if not self.gw.batch_runner.take_slot(model, kind):  # no room: the rest go back
                    await asyncio.to_thread(leases.free, self.gw.store.engine, async_jobs, self.owner,
                                            async_jobs.c.id.in_([j["id"] for j in jobs[i:]]))
                    break
                self._runs[job["id"]] = asyncio.create_task(self._run(job, model))
        if (room := MAX_DELIVERIES_AT_ONCE - len(self._deliveries)) > 0 and self.gw.webhook_secrets.enabled:
            for job in await asyncio.to_thread(store.claim, self.owner, c.lease_s, room, held, True):
                self._deliveries[job["id"]] = asyncio.create_task(self._deliver(job))

    # running

    def _operation(self, job: dict):
        return self.gw.batch_runner.operation(job["endpoint"])

    async def _run(self, job: dict, model: str | None) -> None:
        store = self.gw.async_jobs
        try:
            await asyncio.to_thread(store.start, job["id"])
            if (await asyncio.to_thread(store.statuses, [job["id"]])).get(job["id"]) != "in_progress":
                return  # cancelled meanwhile
            status, content = await self._answer(job)
            if await asyncio.to_thread(store.finish, job["id"], "completed" if status == 200 else "failed", status,
                                       content):
                self.wake()  # its webhook is due
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("async job %s: the runner failed; it is tried again", job["id"])
            await asyncio.to_thread(leases.free, self.gw.store.engine, async_jobs, self.owner,
                                    async_jobs.c.id == job["id"])
        finally:
            self._runs.pop(job["id"], None)
            self.gw.batch_runner.give_slot(model)

    async def _answer(self, job: dict) -> tuple[int, bytes]:
        """The job's answer (status, body): the request path's, or why it was not run."""
        op, wait_s = self._operation(job), RETRY_S
        while True:
            if time.time() >= job["expires_at"]:
                return _error(DeadlineExceeded("The job was not run before it expired.", code="job_expired"))
            found = await asyncio.to_thread(self.gw.store.find_key, job["key_id"].removeprefix("key_"))
            if found is None:
                return _error(AuthenticationFailed("The job's key was revoked."))
            status, content = await serve_in_process(self.gw, op, found[0], job["body"].encode(), job["id"],
                                                     job["expires_at"], job["id"])
            if status not in ROOM:
                return status, content
            await asyncio.sleep(wait_s)  # each refusal is a usage record: wait longer each time
            wait_s = min(wait_s * 2, MAX_RETRY_S)

    # delivering

    async def _deliver(self, job: dict) -> None:
        store, c = self.gw.async_jobs, self.gw.config
        try:
            attempt = await asyncio.to_thread(store.attempts, job["id"]) + 1
            obj = await asyncio.to_thread(store.get, None, job["id"])
            obj["webhook"] = {"url": job["webhook_url"]}
            body = json.dumps({"type": f"async.job.{obj['status']}", "timestamp": _iso(time.time()), "data": obj},
                              separators=(",", ":")).encode()
            secrets = await asyncio.to_thread(self.gw.webhook_secrets.signing, job["tenant_id"],
                                              c.webhook_rotation_grace_s)
            at, code, error = time.time(), None, None
            try:
                await asyncio.to_thread(webhooks.check_url, job["webhook_url"], c.webhook_allow_networks)
                r = await self._client.post(job["webhook_url"], content=body,
                                            headers=webhooks.signed_headers(secrets, job["id"], body))
                code, error = r.status_code, None if r.is_success else f"answered HTTP {r.status_code}"
            except APIError as exc:
                error = exc.message
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}"[:256]
            next_at = time.time() + webhooks.backoff_s(attempt, c.webhook_backoff_s, c.webhook_backoff_max_s)
            state = await asyncio.to_thread(store.delivered, job["id"], self.owner, attempt, at, code, error,
                                            next_at, c.webhook_max_attempts)
            log.info("async job %s: webhook attempt %d %s (%s)", job["id"], attempt, state, error or code)
            if state == "pending":
                asyncio.get_running_loop().call_later(max(next_at - time.time(), 0), self.wake)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("async job %s: delivering its webhook failed; it is tried again", job["id"])
        finally:
            self._deliveries.pop(job["id"], None)


def _error(err: APIError) -> tuple[int, bytes]:
    err = to_api_error(err)
    return err.status, json.dumps(error_body(err)).encode()


def _iso(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, timezone.utc).isoformat().replace("+00:00", "Z")
