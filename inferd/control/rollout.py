"""Canary rollouts: a second version of a name takes a share of its traffic, is compared with the stable version
over a window (errors, TTFT and TPOT p95, cost per request, a probe set) and on the canary's quality set (spec
`quality:`, scored by inferd.control.quality), and is promoted or rolled back. A canary the release gate
refused never starts: its rollout is `refused`.

It is a gateway service (Gateway.services) on the gateway's event loop, beside the data path: the gateway
hands it every usage record (observe) and routes by the weight it sets on Deployments; a retired version's
replicas are drained and stopped by its replica pool (inferd.control.pool).
"""
import asyncio
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import httpx
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from inferd.control.pool import ReplicaPool
from inferd.control.probes import Probe, read_probes
from inferd.control.quality import GateResults, describe, quality_regressions, same_run, score
from inferd.control.spec import QualitySpec, RolloutSpec
from inferd.gateway.deployments import Deployment, Deployments

log = logging.getLogger(__name__)

STATES = ("pending", "running", "promoted", "rolled_back", "refused")
JUDGED = ("completed", "failed", "expired")  # what the error rate counts; cancellations and rejections do not
PROBE_TIMEOUT_S = 60.0


class RolloutError(ValueError):
    """An operation the rollout's state does not allow (e.g. starting one already decided)."""


# probes

async def run_probes(client: httpx.AsyncClient, d: Deployment, probes: list[Probe]) -> float:
    """The share of probes whose greedy answer from the deployment's replicas matches its regex."""
    passed = 0
    for p in probes:
        u = d.pick([], "probe")
        body = {"model": d.upstream_model or d.name, "messages": p.messages, "max_tokens": p.max_tokens,
                "temperature": 0}
        headers = {"authorization": f"Bearer {u.api_key}"} if u.api_key else {}
        try:
            r = await client.post(f"{u.base_url}/v1/chat/completions", json=body, headers=headers,
                                  timeout=PROBE_TIMEOUT_S)
            r.raise_for_status()
            passed += bool(p.expect.search(r.json()["choices"][0]["message"]["content"] or ""))
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            log.warning("probe against %s %s failed: %s", d.name, d.version, type(exc).__name__)
    return passed / len(probes)


# windowed stats and the rules

@dataclass(slots=True)
class Sample:
    at_s: float  # monotonic
    status: str
    ttft_s: float | None
    tpot_s: float | None
    cost_usd: float


def sample_of(record, now_s: float) -> Sample:
    return Sample(now_s, record.status, record.ttft_s, record.tpot_s, record.cost_usd)


@dataclass(slots=True)
class VersionStats:
    requests: int = 0  # completed, failed and expired in the window
    errors: int = 0
    error_rate: float = 0.0
    ttft_p95_s: float | None = None
    tpot_p95_s: float | None = None
    cost_per_request_usd: float | None = None
    probe_score: float | None = None
    quality: dict | None = None  # the eval report's summary on the canary's quality set


def p95(values: list[float]) -> float | None:
    """Nearest rank: the smallest value at least 95 % of the values do not exceed."""
    if not values:
        return None
    values = sorted(values)
    return values[max(math.ceil(0.95 * len(values)) - 1, 0)]


def stats_of(samples: list[Sample], probe_score: float | None = None, quality: dict | None = None) -> VersionStats:
    judged = [s for s in samples if s.status in JUDGED]
    done = [s for s in judged if s.status == "completed"]
    errors = len(judged) - len(done)
    return VersionStats(len(judged), errors, errors / len(judged) if judged else 0.0,
                        p95([s.ttft_s for s in done if s.ttft_s is not None]),
                        p95([s.tpot_s for s in done if s.tpot_s is not None]),
                        sum(s.cost_usd for s in done) / len(done) if done else None, probe_score, quality)


@dataclass(slots=True)
class Verdict:
    action: str  # wait | promote | rollback
    reasons: list[str]


def judge(policy: RolloutSpec, canary: VersionStats, stable: VersionStats, quality: bool = False) -> Verdict:
    """Roll back if any rule fails, promote if all pass, wait until the window holds enough canary requests.
    With quality, a canary worse than the stable on the quality set beyond the interval is rolled back at once
    (it needs no traffic); until both are scored nothing is promoted."""
    if quality and (canary.quality is None or stable.quality is None):
        return Verdict("wait", ["the quality set is still running"])
    worse, fine = quality_regressions(canary.quality, stable.quality) if quality else ([], [])
    if worse:
        return Verdict("rollback", worse)
    if canary.requests < policy.min_requests:
        return Verdict("wait", [f"{canary.requests} of {policy.min_requests} canary requests in the window"])
    if policy.probes is not None and canary.probe_score is None:
        return Verdict("wait", ["the probe set is still running"])
    failed, passed = [], []
    increase = canary.error_rate - stable.error_rate
    (failed if increase > policy.max_error_rate_increase else passed).append(
        f"error rate {canary.error_rate:.1%} vs {stable.error_rate:.1%} (max +{policy.max_error_rate_increase:.1%})")
    for what, c, s, limit in (("TTFT p95", canary.ttft_p95_s, stable.ttft_p95_s, policy.max_ttft_p95_ratio),
                              ("TPOT p95", canary.tpot_p95_s, stable.tpot_p95_s, policy.max_tpot_p95_ratio),
                              ("cost per request", canary.cost_per_request_usd, stable.cost_per_request_usd,
                               policy.max_cost_ratio)):
        if c is None or not s:
            passed.append(f"{what}: no {'stable baseline' if c is not None else 'canary value'}")
        else:
            (failed if c / s > limit else passed).append(f"{what} {c / s:.2f}x stable (max {limit}x)")
    if canary.probe_score is not None:
        (failed if canary.probe_score < policy.min_probe_score else passed).append(
            f"probe score {canary.probe_score:.0%} (min {policy.min_probe_score:.0%}, stable "
            f"{'-' if stable.probe_score is None else format(stable.probe_score, '.0%')})")
    return Verdict("rollback", failed) if failed else Verdict("promote", passed + fine)


# one canary

@dataclass(slots=True, eq=False)
class Rollout:
    name: str
    stable: Deployment
    canary: Deployment
    policy: RolloutSpec
    stable_pool: ReplicaPool | None = None  # drained once the canary is promoted
    canary_pool: ReplicaPool | None = None  # drained when it is rolled back
    quality: QualitySpec | None = None  # the canary's quality set: canary and stable are compared on it
    state: str = "pending"
    weight: float = 0.0
    verdict: Verdict = field(default_factory=lambda: Verdict("wait", ["not started"]))
    decided_by: str | None = None  # auto | operator
    started_unix_s: float | None = None
    decided_unix_s: float | None = None
    probe_scores: dict[str, float] = field(default_factory=dict)  # version -> share of probes passed
    quality_reports: dict[str, dict] = field(default_factory=dict)  # version -> its eval report
    windows: dict[str, deque[Sample]] = field(default_factory=dict)  # version -> samples, oldest first

    def stats(self, version: str, now_s: float) -> VersionStats:
        window = self.windows.setdefault(version, deque())
        while window and window[0].at_s < now_s - self.policy.window_s:
            window.popleft()
        report = self.quality_reports.get(version)
        return stats_of(list(window), self.probe_scores.get(version), report["summary"] if report else None)

    def status(self, now_s: float) -> dict:
        versions = {d.version: asdict(self.stats(d.version, now_s)) | {"role": role, "replicas_alive": _alive(pool)}
                    for role, d, pool in (("stable", self.stable, self.stable_pool),
                                          ("canary", self.canary, self.canary_pool))}
        return {"name": self.name, "state": self.state, "stable_version": self.stable.version,
                "canary_version": self.canary.version, "weight": self.weight, "auto": self.policy.auto,
                "window_s": self.policy.window_s, "min_requests": self.policy.min_requests, "versions": versions,
                "decision": {"action": self.verdict.action, "reasons": self.verdict.reasons,
                             "by": self.decided_by, "at_unix_s": self.decided_unix_s},
                "started_unix_s": self.started_unix_s}


def _alive(pool: ReplicaPool | None) -> int:
    return sum(m.handle.alive() for m in pool.members) if pool is not None else 0


# the controller

class RolloutController:
    """A gateway service: start(gateway) and close() run with the app; the operations run on its event loop."""

    def __init__(self, deployments: Deployments, rollouts: list[Rollout], interval_s: float = 2.0,
                 drain_timeout_s: float = 30.0):
        self.deployments = deployments
        self.rollouts = {r.name: r for r in rollouts}
        self.interval_s = interval_s
        self.drain_timeout_s = drain_timeout_s
        self.requests: Counter[tuple[str, str, str]] = Counter()  # (model, version, status) -> records
        self.client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self, gateway) -> None:
        gateway.rollouts = self
        gateway.observers.append(self.observe)
        gateway.metrics.watch(self.collect)
        self.client = gateway.client
        self._spawn(self._run())

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    # what the gateway and the admin API call

    def observe(self, record) -> None:
        version = record.deployment_version or ""
        self.requests[(record.model, version, record.status)] += 1
        rollout = self.rollouts.get(record.model)
        if rollout is not None and rollout.state == "running" and version:  # a refusal before any attempt has none
            rollout.windows.setdefault(version, deque()).append(sample_of(record, time.monotonic()))

    def status(self, name: str | None = None) -> list[dict]:
        now = time.monotonic()
        return [r.status(now) for r in self.rollouts.values() if name is None or r.name == name]

    def start_rollout(self, name: str, weight: float | None = None) -> dict:
        rollout = self._get(name)
        if weight is not None and not 0 < weight < 1:
            raise RolloutError("weight must be between 0 and 1 (exclusive)")
        if rollout.state not in ("pending", "running"):
            raise RolloutError(f"the rollout of {name} is {rollout.state}; it cannot start again")
        if rollout.state == "pending":
            rollout.state, rollout.started_unix_s, rollout.windows = "running", time.time(), {}
            rollout.verdict = Verdict("wait", ["started"])
            if rollout.policy.probes is not None:
                self._spawn(self._probe(rollout))
            if rollout.quality is not None:
                self._spawn(self._score_quality(rollout))
        rollout.weight = rollout.policy.weight if weight is None else weight
        self.deployments.weights[name] = rollout.weight
        log.info("rollout of %s %s started at weight %.2f", name, rollout.canary.version, rollout.weight)
        return rollout.status(time.monotonic())

    def promote(self, name: str, by: str = "operator", reasons: list[str] | None = None) -> dict:
        rollout = self._get(name)
        self._decide(rollout, "promoted", by, reasons or ["promoted by the operator"])
        self.deployments.promote(name)
        self._spawn(self._retire(rollout.stable, rollout.stable_pool))
        return rollout.status(time.monotonic())

    def rollback(self, name: str, by: str = "operator", reasons: list[str] | None = None) -> dict:
        rollout = self._get(name)
        self._decide(rollout, "rolled_back", by, reasons or ["rolled back by the operator"])
        self.deployments.drop_canary(name)
        self._spawn(self._retire(rollout.canary, rollout.canary_pool))
        return rollout.status(time.monotonic())

    def evaluate(self, rollout: Rollout) -> Verdict:
        """Judge the window now; with auto, act on a decision."""
        if rollout.state != "running":
            return rollout.verdict
        now = time.monotonic()
        verdict = judge(rollout.policy, rollout.stats(rollout.canary.version, now),
                        rollout.stats(rollout.stable.version, now), rollout.quality is not None)
        rollout.verdict = verdict
        if rollout.policy.auto and verdict.action == "promote":
            self.promote(rollout.name, "auto", verdict.reasons)
        elif rollout.policy.auto and verdict.action == "rollback":
            self.rollback(rollout.name, "auto", verdict.reasons)
        return verdict

    # metrics

    def collect(self) -> Iterator:
        state = GaugeMetricFamily("inferd_gateway_rollout_state", "1 for the rollout's current state.",
                                  labels=["model", "canary_version", "state"])
        weight = GaugeMetricFamily("inferd_gateway_canary_weight", "Share of the name's requests routed to the "
                                   "canary.", labels=["model", "canary_version"])
        for r in self.rollouts.values():
            for s in STATES:
                state.add_metric([r.name, r.canary.version, s], float(r.state == s))
            weight.add_metric([r.name, r.canary.version], r.weight)
        requests = CounterMetricFamily("inferd_gateway_version_requests", "Requests ended, by deployment version "
                                       "and status.", labels=["model", "version", "status"])
        for (model, version, status), n in list(self.requests.items()):
            requests.add_metric([model, version, status], n)
        yield from (state, weight, requests)

    # background work

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            for rollout in list(self.rollouts.values()):
                try:
                    self.evaluate(rollout)
                except Exception:  # one bad evaluation must not end the controller
                    log.exception("rollout of %s: evaluation failed", rollout.name)

    async def _probe(self, rollout: Rollout) -> None:
        probes = read_probes(rollout.policy.probes)
        for d in (rollout.canary, rollout.stable):
            rollout.probe_scores[d.version] = await run_probes(self.client, d, probes)
            log.info("probe score of %s %s: %.0f%%", d.name, d.version, 100 * rollout.probe_scores[d.version])

    async def _score_quality(self, rollout: Rollout) -> None:
        """The versions the release gate did not score on this set, scored now (canary first)."""
        for d in (rollout.canary, rollout.stable):
            if d.version not in rollout.quality_reports:
                rollout.quality_reports[d.version] = await score(d, rollout.quality, self.client)
                log.info("quality of %s %s: %s", d.name, d.version, describe(rollout.quality_reports[d.version]))

    async def _retire(self, deployment: Deployment, pool: ReplicaPool | None) -> None:
        """Out of routing already: requests it queued before the switch start first, then its pool drains
        (running requests get the pool's drain timeout) and stops every replica."""
        deadline = time.monotonic() + self.drain_timeout_s
        while deployment.queue.length and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if pool is not None:
            await pool.drain_all()
            log.info("stopped the replicas of %s %s", deployment.name, deployment.version)

    def _decide(self, rollout: Rollout, state: str, by: str, reasons: list[str]) -> None:
        if rollout.state in ("promoted", "rolled_back", "refused"):
            raise RolloutError(f"the rollout of {rollout.name} is already {rollout.state}")
        rollout.state, rollout.decided_by, rollout.decided_unix_s = state, by, time.time()
        rollout.weight = 1.0 if state == "promoted" else 0.0
        rollout.verdict = Verdict("promote" if state == "promoted" else "rollback", reasons)
        log.warning("rollout of %s %s: %s (%s): %s", rollout.name, rollout.canary.version, state, by,
                    "; ".join(reasons))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _get(self, name: str) -> Rollout:
        rollout = self.rollouts.get(name)
        if rollout is None:
            raise KeyError(f"no canary for '{name}' (canaries: {', '.join(self.rollouts) or 'none'})")
        return rollout


def controller_for(plans: list, deployments: Deployments, gate: GateResults | None = None) -> RolloutController | None:
    """The controller over the canaries of `inferd serve --config` (None without canaries); run it with the
    gateway as one of its services. gate: the release gate's reports (reused when the canary's set is the
    same) and the canaries it refused (their rollouts start `refused`)."""
    gate = gate or GateResults()
    by_version = {(p.spec.name, p.spec.version): p for p in plans if p.spec is not None}
    canaries = {name: (d, None) for name, d in deployments.canaries.items()} | gate.refused
    rollouts = []
    for name, (canary, refused) in canaries.items():
        stable = deployments.by_name[name]
        stable_plan, canary_plan = by_version[(name, stable.version)], by_version[(name, canary.version)]
        q = canary_plan.spec.quality
        rollout = Rollout(name, stable, canary, canary_plan.spec.rollout or RolloutSpec(), stable_plan.pool,
                          canary_plan.pool, q)
        for spec in (stable_plan.spec, canary_plan.spec):
            if q is not None and spec.quality is not None and same_run(q, spec.quality) and \
                    (name, spec.version) in gate.reports:
                rollout.quality_reports[spec.version] = gate.reports[(name, spec.version)]
        if refused is not None:
            rollout.state, rollout.decided_by, rollout.decided_unix_s = "refused", "release gate", time.time()
            rollout.verdict = Verdict("rollback", refused)
        rollouts.append(rollout)
    return RolloutController(deployments, rollouts) if rollouts else None
