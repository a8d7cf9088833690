"""The replicas of one local deployment, kept at a target count on the gateway's event loop.

A ReplicaPool starts replicas (make_replica: a local process or a Ray actor), lets one join routing only
once its /ready answered (a real inference), replaces replicas that die, drains replicas it lets go (no
new requests; running ones get drain_timeout_s to finish; then it stops them), and keeps the deployment's
admission capacity at ready replicas × per-replica slots (0 with none: requests wait in the queue).
With an autoscaling spec, an Autoscaler sets the target from the deployment's signals every interval_s.

Public API (call on the gateway's event loop; other control-plane parts, e.g. rollouts, use these):
    pool.scale_to(n, reason)   the target; starts or drains replicas towards it at once
    await pool.drain_all()     drain every replica and wait until all have stopped (target 0)
    pool.halt()                the gateway is shutting down: start, replace, drain nothing more (any thread)
    await pool.close()         stop every replica now (gateway shutdown); close_now() from any thread
    pool.forget(handles)       someone else stops these replicas: no longer kept or replaced (any thread)
    pool.members               the replicas (Member: handle, upstream, state) in start order
"""
import asyncio
import logging
import math
import re
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from inferd.control.in_process import InProcessReplica
from inferd.control.autoscaler import Autoscaler, ColdStart, Decision, Signals, TtftWindow
from inferd.control.replicas import ReplicaHandle
from inferd.control.spec import AutoscalingSpec
from inferd.gateway.deployments import Deployment, Upstream
from inferd.gateway.runtimes import replica_report

log = logging.getLogger(__name__)

STARTING, READY, DRAINING, STOPPED = "starting", "ready", "draining", "stopped"
READY_TIMEOUT_S = 900.0
DEFAULT_DRAIN_TIMEOUT_S = 30.0
CHECK_INTERVAL_S = 0.5  # how often dead replicas are looked for without an autoscaler
DECISION_HISTORY = 50  # the autoscaler's recent decisions kept (for the admin API and the console)


@dataclass(slots=True, eq=False)
class Member:
    handle: ReplicaHandle
    upstream: Upstream
    state: str = STARTING
    started_unix_s: float = 0.0
    replacement: bool = False  # started in place of one that exited
    task: asyncio.Task | None = None  # its start-up or its drain


@dataclass(slots=True, eq=False)
class ReplicaPool:
    deployment: Deployment
    make: Callable[[], ReplicaHandle]  # a new, not yet started replica of this deployment
    per_replica_inflight: int  # admission slots one ready replica adds (its max_num_seqs)
    target: int
    autoscaling: AutoscalingSpec | None = None
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    prefix: str = ""  # replica names are PREFIX-0, PREFIX-1, ... (default: the deployment's name)
    members: list[Member] = field(default_factory=list)
    autoscaler: Autoscaler | None = None
    ttft: TtftWindow | None = None
    cold_start: ColdStart = field(default_factory=ColdStart)
    decision: Decision | None = None
    signals: Signals | None = None
    decisions: deque = field(default_factory=lambda: deque(maxlen=DECISION_HISTORY))  # see _remember
    restarts: int = 0
    failures: int = 0  # replicas that failed to start, in a row: backs off further starts
    next_start_s: float = 0.0
    client: httpx.AsyncClient | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _loop_task: asyncio.Task | None = None
    _closed: bool = False
    _owns_client: bool = False
    _names: int = 0
    _sessions: Callable[[str], int] = lambda name: 0  # the gateway's open robot sessions of a deployment

    def __post_init__(self):
        if self.autoscaling is not None:
            self.autoscaler = Autoscaler(self.autoscaling, self.per_replica_inflight)
            self.ttft = TtftWindow(self.autoscaling.window_s)
            self.drain_timeout_s = self.autoscaling.drain_timeout_s

    @property
    def name(self) -> str:
        return self.deployment.name

    def counts(self) -> dict[str, int]:
        out = {STARTING: 0, READY: 0, DRAINING: 0}
        for m in self.members:
            if m.state in out:
                out[m.state] += 1
        return out

    # adopting the replicas `inferd serve` started before the gateway

    def adopt(self, handle: ReplicaHandle, started_unix_s: float, ready_unix_s: float) -> None:
        """A replica already started and ready (it is in deployment.upstreams if upstream is given)."""
        upstream = next((u for u in self.deployment.upstreams if u.base_url == handle.url.rstrip("/")), None)
        if upstream is None:
            upstream = Upstream(handle.url, handle.api_key, name=self._new_name())
            self.deployment.upstreams.append(upstream)
        self._names += 1
        self.members.append(Member(handle, upstream, READY, started_unix_s))
        ours = self.deployment.internal_headers and not isinstance(handle, InProcessReplica)  # that one is not up yet
        report = (_ready_body_sync(upstream) if ours else None) or {}
        phases = _phases(report | getattr(handle, "cold_start", dict)(), started_unix_s, ready_unix_s)
        if phases:
            self._observe_cold_start(upstream, phases)

    # running with the gateway (Gateway.services)

    async def start(self, gateway=None) -> None:
        """With the gateway (its transport reaches in-process replicas, whose apps start here); alone: own client."""
        self._owns_client = gateway is None
        self.client = gateway.client if gateway is not None else httpx.AsyncClient(timeout=5.0)
        self._loop = asyncio.get_running_loop()
        if gateway is not None:
            gateway.metrics.watch(self.collect)
            gateway.observers.append(self.observe)
            self._sessions = gateway.sessions.count
        for m in self.members:  # adopted: loaded before the loop ran
            if isinstance(m.handle, InProcessReplica):
                await m.handle.serve(READY_TIMEOUT_S)
        self._set_capacity()
        self._loop_task = asyncio.create_task(self._run(), name=f"pool-{self.name}")

    def observe(self, record) -> None:
        """A request's usage record (Gateway.record): its first-token time feeds the TTFT window."""
        if self.ttft is not None and record.ttft_s is not None and record.model == self.name \
                and record.deployment_version == self.deployment.version:
            self.ttft.add(time.monotonic(), record.ttft_s)

    def halt(self) -> None:
        """The gateway's shutdown began (its signal handler calls this, before the app's shutdown): from now on no
        replica starts, and one that exits (a terminal's Ctrl-C reaches the replicas too) is not replaced."""
        self._closed = True

    async def close(self) -> None:
        """Stops every replica now (running requests are cut); no new ones start."""
        self.halt()
        if self._loop_task is not None:
            self._loop_task.cancel()
        members, self.members = self.members, []
        log.info("deployment %s: stopping %d replica(s)", self.name, len(members))
        for m in members:
            m.state = STOPPED
        await asyncio.gather(*(asyncio.to_thread(m.handle.stop) for m in members))  # all at once
        self.members = members  # close_now (idempotent) still finds them
        if self.client is not None and self._owns_client:
            await self.client.aclose()

    def close_now(self) -> None:
        """Blocking: stop every replica this pool started (safe to call more than once, from any thread)."""
        self._closed = True
        for m in self.members:
            m.state = STOPPED
            m.handle.stop()

    # scaling

    def scale_to(self, n: int, reason: str = "") -> None:
        if n != self.target:
            log.info("deployment %s: %d -> %d replicas (%s)", self.name, self.target, n, reason or "asked")
        self.target = max(n, 0)
        self._reconcile()

    def forget(self, handles: list[ReplicaHandle]) -> None:
        """These replicas are stopped by their caller (e.g. a rollback): out of routing, not replaced, and the
        target shrinks by as many. Safe from any thread."""
        def apply() -> None:
            gone = [m for m in self.members if m.handle in handles]
            for m in gone:
                m.state = STOPPED
                self.members.remove(m)
                if m.upstream in self.deployment.upstreams:
                    self.deployment.upstreams.remove(m.upstream)
            self.target = max(self.target - len(gone), 0)
            self._set_capacity()
        loop = self._loop
        if loop is not None and loop.is_running():
            try:
                on_loop = asyncio.get_running_loop() is loop
            except RuntimeError:
                on_loop = False
            if not on_loop:
                loop.call_soon_threadsafe(apply)
                return
        apply()

    async def drain_all(self) -> None:
        self.scale_to(0, "drain all")
        await asyncio.gather(*(m.task for m in self.members if m.task is not None), return_exceptions=True)

    def _reconcile(self) -> None:
        if self._closed:
            return
        live = [m for m in self.members if m.state in (STARTING, READY)]
        for m in live[self.target:][::-1] if len(live) > self.target else []:
            self._drain(m)  # the newest first: a starting replica costs least to give up
        missing = self.target - len(live)
        if missing > 0 and time.monotonic() >= self.next_start_s:
            for _ in range(missing):
                self._start_one()

    def _start_one(self, name: str | None = None) -> Member:
        handle = self.make()
        upstream = Upstream(handle.url, handle.api_key, name=name or self._new_name())
        m = Member(handle, upstream, STARTING, time.time(), replacement=name is not None)
        self.members.append(m)
        m.task = asyncio.create_task(self._bring_up(m), name=f"start-{upstream.name}")
        return m

    async def _bring_up(self, m: Member) -> None:
        ok = False
        try:
            await asyncio.to_thread(m.handle.start)
            m.upstream.base_url = m.handle.url.rstrip("/")  # a Ray replica's URL is known once it is placed
            if m.state == STARTING and not self._closed:
                if isinstance(m.handle, InProcessReplica):
                    await m.handle.serve(READY_TIMEOUT_S)
                else:
                    await asyncio.to_thread(m.handle.wait_ready, READY_TIMEOUT_S)
                ok = m.state == STARTING and not self._closed
        except Exception as exc:
            if m.state == STARTING and not self._closed:
                log.error("deployment %s: replica %s did not start: %s", self.name, m.upstream.name, exc)
                self.failures += 1
                self.next_start_s = time.monotonic() + min(2.0 ** self.failures, 60.0)
        if not ok:  # failed, or given up (drained, closed) meanwhile
            await self._stop(m)
            return
        ready_unix_s = time.time()
        self.failures = 0
        if "source_path" not in self.deployment.card:
            await self._refresh_card(m.upstream)
        if m.state != STARTING or self._closed:
            await self._stop(m)
            return
        m.state = READY
        self.deployment.upstreams.append(m.upstream)
        self._set_capacity()
        log.info("deployment %s: replica %s on %s is %s (cold start %.1f s)", self.name, m.upstream.name,
                 m.handle.url, "back" if m.replacement else "ready", ready_unix_s - m.started_unix_s)
        report = (await self._ready_body(m.upstream) or {}) | getattr(m.handle, "cold_start", dict)()
        phases = _phases(report, m.started_unix_s, ready_unix_s)
        if phases:
            self._observe_cold_start(m.upstream, phases)

    def _drain(self, m: Member) -> None:
        if m.state == STARTING:  # never routed to: stop it at once (its start-up task then removes it)
            m.state = DRAINING
            asyncio.create_task(asyncio.to_thread(m.handle.stop))
            return
        m.state = DRAINING
        m.upstream.draining = True
        self._set_capacity()
        log.info("deployment %s: draining replica %s (%d running)", self.name, m.upstream.name, m.upstream.inflight)
        m.task = asyncio.create_task(self._drain_then_stop(m), name=f"drain-{m.upstream.name}")

    async def _drain_then_stop(self, m: Member) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while m.upstream.inflight > 0 and time.monotonic() < deadline and m.handle.alive():
            await asyncio.sleep(0.1)
        if m.upstream.inflight > 0:
            log.warning("deployment %s: replica %s still runs %d requests after %.0f s; stopping it", self.name,
                        m.upstream.name, m.upstream.inflight, self.drain_timeout_s)
        await self._stop(m)
        log.info("deployment %s: replica %s drained and stopped", self.name, m.upstream.name)

    async def _stop(self, m: Member) -> None:
        m.state = STOPPED
        if m.upstream in self.deployment.upstreams:
            self.deployment.upstreams.remove(m.upstream)
        if m in self.members:
            self.members.remove(m)
        self._set_capacity()
        await asyncio.to_thread(m.handle.stop)

    def _set_capacity(self) -> None:
        self.deployment.queue.set_capacity(self.counts()[READY] * self.per_replica_inflight)

    # the loop: replace the dead, read signals, decide

    async def _run(self) -> None:
        interval = self.autoscaling.interval_s if self.autoscaling else CHECK_INTERVAL_S
        while not self._closed:
            try:
                await self.tick()
            except Exception:
                log.exception("deployment %s: pool check failed", self.name)
            await self.deployment.queue.wait_starved(interval)

    async def tick(self) -> None:
        for m in [m for m in self.members if m.state in (READY, DRAINING)]:
            if not m.handle.alive():
                self._replace(m)
        if self.autoscaler is not None:
            self.signals = await self.read_signals()
            self.decision = self.autoscaler.decide(time.monotonic(), self.signals)
            self._remember(self.decision, self.signals)
            if self.decision.desired != self.signals.replicas:
                self.scale_to(self.decision.desired, self.decision.reason)
        self._reconcile()

    def _remember(self, d: Decision, s: Signals) -> None:
        """Each decision that scales, and one that holds when its reason differs from the last one kept, not
        counting figures ("steady" once, not every interval; a breach held back once until it changes kind)."""
        last = self.decisions[-1] if self.decisions else None
        kind = re.sub(r"[\d.]+", "#", d.reason)
        if d.desired != s.replicas or last is None or last["kind"] != kind or last["replicas"] != s.replicas:
            self.decisions.append({"at_unix_s": time.time(), "replicas": s.replicas, "desired": d.desired,
                                   "reason": d.reason, "kind": kind})

    def _replace(self, m: Member) -> None:
        """A replica died: out of routing now; a new one takes its name (unless it was being drained)."""
        was_draining = m.state == DRAINING
        if self._closed:
            log.info("deployment %s: replica %s exited (shutting down)", self.name, m.upstream.name)
        else:
            log.error("deployment %s: replica %s on %s exited; %s", self.name, m.upstream.name, m.handle.url,
                      "it was draining" if was_draining else "starting a replacement")
        if m.task is not None:
            m.task.cancel()
        m.state = STOPPED
        self.members.remove(m)
        asyncio.create_task(asyncio.to_thread(m.handle.stop))  # what it left running (a vLLM server's engine)
        if m.upstream in self.deployment.upstreams:
            self.deployment.upstreams.remove(m.upstream)
        self._set_capacity()
        if not was_draining and not self._closed:
            self.restarts += 1
            self._start_one(m.upstream.name)

    async def read_signals(self) -> Signals:
        stats = self.deployment.queue.stats().values()
        ready = [m for m in self.members if m.state == READY]
        bodies = await asyncio.gather(*(self._ready_body(m.upstream) for m in ready))
        kv = [b["kv_cache_usage"] for b in bodies if b and b.get("kv_cache_usage") is not None]
        counts = self.counts()
        now = time.monotonic()
        return Signals(replicas=counts[STARTING] + counts[READY], starting=counts[STARTING],
                       queue_length=sum(s.length for s in stats),
                       queue_age_s=max((s.oldest_age_s for s in stats), default=0.0),
                       waiting_tokens=sum(s.queued_tokens for s in stats),
                       inflight=self.deployment.queue.inflight + self._sessions(self.name),  # a robot session holds a slot
                       kv_usage=sum(kv) / len(kv) if kv else 0.0,
                       ttft_p95_s=self.ttft.p95(now) if self.ttft else None, cold_start_s=self.cold_start.estimate_s)

    # replica reports

    async def _ready_body(self, upstream: Upstream) -> dict | None:
        return await replica_report(self.client, self.deployment, upstream)

    async def _refresh_card(self, upstream: Upstream) -> None:
        """Scaled up from zero: the model card (and max_model_len) as the first replica reports them."""
        headers = {"authorization": f"Bearer {upstream.api_key}"} if upstream.api_key else {}
        try:
            r = await self.client.get(f"{upstream.base_url}/v1/models", headers=headers, timeout=5.0)
            card = r.json()["data"][0]
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            return
        self.deployment.describe(card)

    def _observe_cold_start(self, upstream: Upstream, phases: dict[str, float]) -> None:
        self.cold_start.observe(phases)
        log.info("deployment %s: replica %s cold start: %s", self.name, upstream.name,
                 ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()))

    def _new_name(self) -> str:
        name = f"{self.prefix or self.name}-{self._names}"
        self._names += 1
        return name

    # metrics (the gateway's /metrics)

    def collect(self) -> Iterator:
        labels = [self.name, self.deployment.version]
        replicas = GaugeMetricFamily("inferd_deployment_replicas", "Replicas by state.",
                                     labels=["deployment", "version", "state"])
        for state, n in self.counts().items():
            replicas.add_metric(labels + [state], n)
        yield replicas
        target = GaugeMetricFamily("inferd_deployment_desired_replicas", "The replica count the pool works towards "
                                   "(the autoscaler's decision).", labels=["deployment", "version"])
        target.add_metric(labels, self.target)
        yield target
        cold = GaugeMetricFamily("inferd_replica_cold_start_seconds", "The last measured cold start, seconds from "
                                 "process start to weights loaded, warm (readiness inference done) and ready (seen "
                                 "by the gateway); estimate: the moving average of ready the autoscaler uses.",
                                 labels=["deployment", "version", "phase"])
        for phase, s in self.cold_start.last.items():
            cold.add_metric(labels + [phase], s)
        cold.add_metric(labels + ["estimate"], self.cold_start.estimate_s)
        yield cold
        restarts = CounterMetricFamily("inferd_replica_restarts", "Replicas replaced after they exited.",
                                       labels=["deployment", "version"])
        restarts.add_metric(labels, self.restarts)
        yield restarts
        if self.signals is not None:
            s = self.signals
            signal = GaugeMetricFamily("inferd_autoscaler_signal", "What the autoscaler last read.",
                                       labels=["deployment", "version", "signal"])
            for key, value in (("queue_age_seconds", s.queue_age_s), ("waiting_tokens", s.waiting_tokens),
                               ("queue_length", s.queue_length), ("kv_cache_usage", s.kv_usage),
                               ("ttft_p95_seconds", s.ttft_p95_s), ("cold_start_seconds", s.cold_start_s)):
                if value is not None:
                    signal.add_metric(labels + [key], value)
            yield signal


def _phases(body: dict | None, started_unix_s: float, ready_unix_s: float) -> dict[str, float] | None:
    """Seconds from start to each cold-start phase, from the replica's /ready report."""
    if not body or body.get("loaded_unix_s") is None or body.get("warm_unix_s") is None:
        return None
    return {"weights_loaded": max(body["loaded_unix_s"] - started_unix_s, 0.0),
            "warm": max(body["warm_unix_s"] - started_unix_s, 0.0),
            "ready": max(ready_unix_s - started_unix_s, 0.0)}


def _ready_body_sync(upstream: Upstream) -> dict | None:
    try:
        return httpx.get(f"{upstream.base_url}/ready", timeout=2.0).json()
    except (httpx.HTTPError, ValueError):
        return None


def per_replica_slots(max_inflight: int, replicas: int, max_num_seqs: int) -> int:
    """Admission slots per replica: the configured capacity spread over the initial replicas."""
    return max(math.ceil(max_inflight / replicas), 1) if replicas else max_num_seqs
