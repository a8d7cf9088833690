"""Robot-policy sessions over WebSocket (openpi's protocol): one coroutine owns each session's life.

    handshake: the key (`Authorization: Api-Key <key>` as openpi-client sends it, or Bearer), the policy the
      path names, the key's access to it, the session caps of its tenant, key and deployment; a refusal
      accepts and closes at once with a 44xx code and a reason (protocol/policy.py's CLOSE_CODES)
    → the policy's metadata (binary msgpack), then observation → action chunk, strictly in order
    → the end (the client closed, idle timeout, a protocol error): caps released, one usage record.

Per observation: the frame's size, then the spec (keys, dtypes, shapes) before any work; its deadline
(its own timestamp + deadline keys, else the session's x-inferd-deadline-ms after its arrival) checked
before it is sent on, and again by the replica's batcher while it waits; a newer observation replaces
an older one still waiting here (that one is answered `superseded`, so replies stay one per observation,
in order); a chunk that comes back after its deadline is sent flagged `late: true`. Each chunk says
until when it is to be played (`valid_until`, unix seconds: its observation's time + horizon / control
rate). Timestamps are the robot's clock (time.time()); a robot on another host must keep it in sync.

Session caps count this gateway's sessions (a session is long-lived; a shared limiter's leases are not).
"""
import asyncio
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import httpx
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from inferd.gateway.deployments import Deployment, PolicyModel, Upstream
from inferd.gateway.policy import KeyPolicy
from inferd.gateway.usage import UsageRecord
from inferd.protocol import headers
from inferd.gateway.auth import client_address
from inferd.protocol.errors import APIError, AuthenticationFailed, RateLimitExceeded, ServiceUnavailable
from inferd.protocol.policy import (CLOSE_CODES, WEBSOCKET_PATH, PolicyError, check_observation, packb, unpackb,
                                    valid_until)
from inferd.telemetry.gateway_metrics import gauge

log = logging.getLogger(__name__)

KIND = "policy"
RETRY_SESSION_S = 5.0  # what a refused session is told to wait (openpi-client's own retry interval)
READ_TIMEOUT_S = 60.0  # an observation without a deadline waits this long for its replica at most
ROUND_TRIPS = 64  # recent replica round trips kept per deployment: the fastest bounds what a deadline needs
ROUND_TRIPS_WINDOW_S = 5.0  # and only those of the last seconds count (see RoundTrips)


class RoundTrips:
    """A deployment's recent round trips to its replicas. An observation whose deadline is nearer than the fastest
    of them is refused without running; only the last ROUND_TRIPS_WINDOW_S seconds' count, so that after a slow
    spell (every trip longer than the robots' deadlines, so every observation refused and no trip measured) the
    next observation runs and measures again, rather than the refusals going on for good."""

    def __init__(self):
        self._trips: deque[tuple[float, float]] = deque(maxlen=ROUND_TRIPS)  # (when it ended, its seconds)

    def add(self, seconds: float, now: float) -> None:
        self._trips.append((now, seconds))

    def fastest(self, now: float) -> float:
        """The shortest round trip of the window, 0 with none."""
        recent = [s for t, s in self._trips if now - t < ROUND_TRIPS_WINDOW_S]
        return min(recent) if recent else 0.0


@dataclass(slots=True, eq=False)
class Entry:
    frame: bytes
    arrival_s: float  # time.monotonic()
    arrival_unix_s: float
    superseded: bool = False


@dataclass(slots=True, eq=False)
class Session:
    id: str
    key: KeyPolicy
    deployment: Deployment
    scopes: list[str]  # the caps it holds
    deadline_ms: float | None  # the session's default, after each observation's time
    arrival_s: float = field(default_factory=time.monotonic)
    started_unix_s: float = field(default_factory=time.time)
    observations: int = 0
    chunks: int = 0
    expired: int = 0  # answered deadline_exceeded, not run
    late: int = 0  # run, but answered after the deadline
    superseded: int = 0
    invalid: int = 0
    failed: int = 0
    prev_total_ms: float | None = None
    status: str = "completed"
    error_code: str | None = None

    @property
    def model(self) -> PolicyModel:
        return self.deployment.model

    def units(self, seconds: float) -> dict[str, float]:
        return {"observations": self.observations, "chunks": self.chunks,
                "actions": self.chunks * self.model.horizon, "missed_deadlines": self.expired + self.late,
                "expired": self.expired, "late": self.late, "superseded": self.superseded,
                "invalid": self.invalid, "failed": self.failed, "session_s": round(seconds, 3)}


class PolicySessions:
    def __init__(self, gateway):
        self.gw = gateway
        self.open: dict[str, int] = {}  # cap scope -> sessions holding it
        self._round_trips: dict[str, RoundTrips] = {}

    def routes(self) -> list[WebSocketRoute]:
        return [WebSocketRoute(WEBSOCKET_PATH, self.session)]

    async def session(self, ws: WebSocket) -> None:
        key = None
        try:
            key = await self._key(ws)
            s = self._open(ws, key)
        except PolicyError as exc:
            await ws.accept()
            await ws.close(exc.close or CLOSE_CODES["protocol_error"], exc.reason())
            if key is not None:
                self._refused(ws, key, exc)
            self.gw.metrics.rejected(exc.code)
            return
        try:
            await ws.accept()
            await ws.send_bytes(packb(s.model.metadata))
            await self._converse(ws, s)
        except (WebSocketDisconnect, OSError, RuntimeError):  # gone while we spoke: nothing to tell it
            pass
        finally:
            self._close(s)

    # the handshake

    async def _key(self, ws: WebSocket) -> KeyPolicy:
        scheme, _, secret = (ws.headers.get("authorization") or "").partition(" ")
        try:
            return await self.gw.keys.authenticate(f"Bearer {secret.strip()}" if scheme.lower() == "api-key"
                                                   else ws.headers.get("authorization"), client_address(ws))
        except AuthenticationFailed as exc:
            raise PolicyError("unauthorized", exc.message.replace("'Authorization: Bearer <key>'",
                              "'Authorization: Api-Key <key>' or Bearer"), close=CLOSE_CODES["unauthorized"])
        except RateLimitExceeded as exc:  # this address failed too often: refused without a store read
            raise PolicyError(exc.code, exc.message, close=CLOSE_CODES[exc.code])
        except ServiceUnavailable as exc:  # the store is down and this key is not cached here
            raise PolicyError("unavailable", exc.message, retry_after_s=1.0, close=CLOSE_CODES["unavailable"])

    def _open(self, ws: WebSocket, key: KeyPolicy) -> Session:
        name = ws.path_params["name"]
        d = self.gw.deployments.route(name, KIND)
        if d is None or d.model.kind != KIND:
            raise PolicyError("model_not_found", f"No policy named '{name}' is served here.",
                              close=CLOSE_CODES["model_not_found"])
        if not key.may_use(d.name):
            raise PolicyError("forbidden", f"Your key may not use the policy '{d.name}'.",
                              close=CLOSE_CODES["forbidden"])
        try:
            deadline_ms = headers.deadline_ms(ws.headers.get(headers.DEADLINE_MS))
        except APIError as exc:
            raise PolicyError("protocol_error", exc.message, close=CLOSE_CODES["protocol_error"]) from None
        scopes = self._take_caps(key, d)
        return Session(f"ses_{uuid.uuid4().hex}", key, d, scopes, deadline_ms)

    def _take_caps(self, key: KeyPolicy, d: Deployment) -> list[str]:
        """All of the session's caps or none: its tenant's, key's and the tenant's model limit, and the
        deployment's (sessions per replica times its replicas)."""
        t = key.tenant
        caps = [(f"tenant:{t.id}", t.limits.max_sessions, "your tenant's"),
                (f"key:{key.id}", key.limits.max_sessions, "your key's"),
                (f"model:{t.id}:{d.name}", t.model_limits[d.name].max_sessions if d.name in t.model_limits
                 else None, f"your tenant's for '{d.name}'"),
                (f"deployment:{d.name}", d.model.max_sessions * max(1, len(d.upstreams)), f"the policy '{d.name}''s")]
        for scope, cap, whose in caps:
            if cap is not None and self.open.get(scope, 0) >= cap:
                raise PolicyError("session_limit", f"All {cap} of {whose} sessions are open; retry in "
                                  f"{RETRY_SESSION_S:g} s.", retry_after_s=RETRY_SESSION_S,
                                  close=CLOSE_CODES["session_limit"])
        for scope, _, _ in caps:
            self.open[scope] = self.open.get(scope, 0) + 1
        return [scope for scope, _, _ in caps]

    # the conversation

    async def _converse(self, ws: WebSocket, s: Session) -> None:
        """A reader takes frames as they come; the worker answers them in order. The reader ends the
        session (the client left, idle timeout, a text frame), which cancels an answer in flight."""
        pending: deque[Entry] = deque()
        wake = asyncio.Event()
        reader = asyncio.create_task(self._read(ws, s, pending, wake))
        worker = asyncio.create_task(self._work(ws, s, pending, wake))
        try:
            await asyncio.wait((reader, worker), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reader, worker):
                task.cancel()
            await asyncio.gather(reader, worker, return_exceptions=True)
        if not reader.cancelled() and reader.exception() is None and (end := reader.result()) is not None:
            s.status, s.error_code = ("completed" if end.code == "idle_timeout" else "failed"), end.code
            await ws.close(end.close, end.reason())
        elif not worker.cancelled() and (exc := worker.exception()) is not None:
            if isinstance(exc, (WebSocketDisconnect, OSError, RuntimeError)):
                return
            log.error("policy session %s failed", s.id, exc_info=exc)
            s.status, s.error_code = "failed", "internal_error"
            await ws.close(1011, "internal_error")

    async def _read(self, ws: WebSocket, s: Session, pending: deque[Entry], wake: asyncio.Event) -> PolicyError | None:
        """Frames into pending until the client leaves (None) or the session must end (the error)."""
        idle_s = s.model.idle_timeout_s
        while True:
            try:
                async with asyncio.timeout(idle_s):
                    message = await ws.receive()
            except TimeoutError:
                return PolicyError("idle_timeout", f"No observation for {idle_s:g} s.", close=CLOSE_CODES["idle_timeout"])
            if message["type"] == "websocket.disconnect":
                return None
            frame = message.get("bytes")
            if frame is None:
                return PolicyError("protocol_error", "Observations are binary msgpack frames; this one was text.",
                                   close=CLOSE_CODES["protocol_error"])
            for older in pending:  # waiting, not started: the newer observation replaces it
                older.superseded = True
            pending.append(Entry(frame, time.monotonic(), time.time()))
            wake.set()

    async def _work(self, ws: WebSocket, s: Session, pending: deque[Entry], wake: asyncio.Event) -> None:
        while True:
            while not pending:
                wake.clear()
                await wake.wait()
            entry = pending.popleft()
            s.observations += 1
            if entry.superseded:
                s.superseded += 1
                self.gw.metrics.observed(s.deployment.name, "superseded")
                await ws.send_text(PolicyError("superseded", "A newer observation from this session replaced this "
                                               "one before it ran.").frame())
                continue
            reply = await self._answer(s, entry)
            await (ws.send_bytes(reply) if isinstance(reply, bytes) else ws.send_text(reply))
            s.prev_total_ms = (time.monotonic() - entry.arrival_s) * 1000

    async def _answer(self, s: Session, e: Entry) -> bytes | str:
        """The observation's chunk (msgpack) or its error frame (text)."""
        m, name = s.model, s.deployment.name
        try:
            if len(e.frame) > m.max_frame_bytes:
                raise PolicyError("frame_too_large", f"The frame has {len(e.frame)} bytes; this policy takes at most "
                                  f"{m.max_frame_bytes}.")
            obs = check_observation(m.spec, unpackb(e.frame))
            taken = obs.timestamp_unix_s if obs.timestamp_unix_s is not None else e.arrival_unix_s
            ms = obs.deadline_ms if obs.deadline_ms is not None else s.deadline_ms
            deadline = None if ms is None else taken + ms / 1000
            reply = await self._infer(s, e, deadline)
        except PolicyError as exc:
            if exc.code in ("invalid_observation", "frame_too_large"):
                s.invalid += 1
            elif exc.code == "deadline_exceeded":
                s.expired += 1
            else:
                s.failed += 1
            self.gw.metrics.observed(name, exc.code)
            return exc.frame()
        done = time.time()
        late = deadline is not None and done > deadline
        s.chunks += 1
        s.late += late
        timing = reply.setdefault("server_timing", {})
        timing["total_ms"] = (time.monotonic() - e.arrival_s) * 1000
        if s.prev_total_ms is not None:
            timing["prev_total_ms"] = s.prev_total_ms
        reply["valid_until"] = valid_until(taken, m.horizon, m.control_hz)
        reply["late"] = late
        self.gw.metrics.observed(name, "late" if late else "answered", time.monotonic() - e.arrival_s)
        return packb(reply)

    async def _infer(self, s: Session, e: Entry, deadline_unix_s: float | None) -> dict:
        d = s.deployment
        left_s = None if deadline_unix_s is None else deadline_unix_s - time.time()
        trips = self._round_trips.setdefault(d.name, RoundTrips())
        if left_s is not None and left_s <= trips.fastest(time.monotonic()):
            raise PolicyError("deadline_exceeded", f"The observation's deadline {'passed' if left_s <= 0 else 'is nearer than this policy answers'} "
                              f"({left_s * 1000:.0f} ms left); it was not run.")
        upstream = self._pick(s)
        out = {"content-type": "application/msgpack", headers.REQUEST_ID: f"{s.id}-{s.observations}",
               headers.PRIORITY: s.key.effective_class, headers.TENANT: s.key.tenant.id}
        if upstream.api_key:
            out["authorization"] = f"Bearer {upstream.api_key}"
        if left_s is not None:
            out[headers.DEADLINE_MS] = str(max(1, int(left_s * 1000)))
        sent = time.monotonic()
        upstream.enter(1)
        request = httpx.Request("POST", f"{upstream.base_url}/v1/policy/infer", headers=out, content=e.frame,
                                extensions={"timeout": {"connect": 5.0, "pool": None, "write": None,
                                                        "read": READ_TIMEOUT_S if left_s is None else left_s + 1.0}})
        try:
            r = await self.gw.transport.handle_async_request(request)
            try:
                await r.aread()
            finally:
                await r.aclose()
        except httpx.HTTPError as exc:
            if isinstance(exc, httpx.ConnectError):
                upstream.healthy = False  # out of routing until its /ready answers again
            raise PolicyError("unavailable", f"The policy's replica did not answer ({type(exc).__name__}); "
                              "retry.", retry_after_s=1.0) from None
        finally:
            upstream.leave(1)
        if r.status_code != 200:
            raise _replica_error(r)
        now = time.monotonic()
        trips.add(now - sent, now)
        return unpackb(r.content)

    def _pick(self, s: Session) -> Upstream:
        ready = [u for u in s.deployment.upstreams if u.healthy and not u.draining]
        if not ready:
            raise PolicyError("unavailable", "No replica of this policy is ready; retry shortly.", retry_after_s=1.0)
        return min(ready, key=lambda u: u.inflight)

    # the end

    def _close(self, s: Session) -> None:
        for scope in s.scopes:
            self.open[scope] -= 1
            if not self.open[scope]:
                del self.open[scope]
        seconds = time.monotonic() - s.arrival_s
        d, key = s.deployment, s.key
        cost = self.gw.config.price(d.name).cost_usd(s.observations, 0, 0, seconds)
        self.gw.record(UsageRecord(
            request_id=s.id, model=d.name, status=s.status, http_status=101, started_unix_s=s.started_unix_s,
            e2e_s=seconds, gateway_id=self.gw.config.gateway_id, tenant_id=key.tenant.id, key_id=key.id,
            deployment_version=d.version, priority_class=key.effective_class, error_code=s.error_code,
            prompt_tokens=s.observations, completion_tokens=s.chunks * s.model.horizon, cost_usd=cost,
            units=s.units(seconds)))
        log.info("policy session ended", extra={"request_id": s.id, "tenant_id": key.tenant.id, "model": d.name,
                                                "status": s.status, "error_code": s.error_code} | s.units(seconds))

    def _refused(self, ws: WebSocket, key: KeyPolicy, exc: PolicyError) -> None:
        self.gw.record(UsageRecord(
            request_id=f"ses_{uuid.uuid4().hex}", status="rejected",
            model="unknown" if exc.code == "model_not_found" else ws.path_params["name"],
            http_status=exc.close or 4400, started_unix_s=time.time(), e2e_s=0.0,
            gateway_id=self.gw.config.gateway_id, tenant_id=key.tenant.id, key_id=key.id, error_code=exc.code))

    def count(self, deployment: str) -> int:
        """Sessions open on a deployment (the autoscaler's in-flight work for a policy)."""
        return self.open.get(f"deployment:{deployment}", 0)

    def collect(self):
        """The open sessions per deployment, for the gateway's /metrics."""
        g = gauge("inferd_gateway_policy_sessions", "Robot policy sessions open.", ["model"])
        for name, d in self.gw.deployments.by_name.items():
            if d.model.kind == KIND:
                g.add_metric([name], self.count(name))
        yield g


def _replica_error(r: httpx.Response) -> PolicyError:
    try:
        error = r.json()["error"]
        code, message = error.get("code") or "internal_error", error.get("message") or ""
    except (ValueError, KeyError, TypeError, AttributeError):
        code, message = "internal_error", f"The policy's replica answered {r.status_code}."
    if r.status_code == 504:
        return PolicyError("deadline_exceeded", message)
    if r.status_code == 503:
        retry = r.headers.get("retry-after")
        return PolicyError("overloaded", message, retry_after_s=float(retry) if retry and retry.isdigit() else 1.0)
    if r.status_code in (400, 413):
        return PolicyError(code if code in ("invalid_observation", "frame_too_large") else "invalid_observation",
                           message)
    return PolicyError("internal_error", "The policy failed on this observation.")
