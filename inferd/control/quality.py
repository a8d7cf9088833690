"""Quality as a release rule: a version's eval set (spec `quality:`), run against its own replicas over the
OpenAI API like any user would call it.

The release gate runs before the gateway takes traffic: a stable version below its floor stops `inferd serve`
(nothing starts); a canary below its floor is refused: its replicas are stopped and its rollout, in state
`refused`, says why (`/admin/rollouts`). The canary controller (rollout.py) compares canary and stable on
the canary's set with `quality_regressions`.
"""
import asyncio
import logging
from dataclasses import dataclass, field

import httpx

from inferd.control.spec import QualitySpec, set_path
from inferd.eval.evaluate import evaluate
from inferd.eval.intervals import difference
from inferd.gateway.deployments import Deployment, Deployments

log = logging.getLogger(__name__)


def same_run(a: QualitySpec, b: QualitySpec) -> bool:
    """Whether a report made under a also answers b (same set, split and items)."""
    return (set_path(a), a.split, a.limit) == (set_path(b), b.split, b.limit)


async def score(d: Deployment, q: QualitySpec, client: httpx.AsyncClient | None = None) -> dict:
    """The eval report of q's set against the deployment's first replica (greedy; direct, not through the
    gateway's limits)."""
    u = d.upstreams[0]
    return await evaluate(u.base_url, u.api_key, d.upstream_model or d.name, set_path(q), q.split,
                          q.floor.as_dict(), q.concurrency, q.limit, client)


def describe(rep: dict) -> str:
    return ", ".join(f"{k} {m['accuracy']:.0%} [{m['low']:.0%}, {m['high']:.0%}]"
                     for k, m in rep["summary"]["metrics"].items())


def quality_regressions(canary: dict, stable: dict) -> tuple[list[str], list[str]]:
    """(worse, not worse): per metric of two reports' summaries, the canary minus the stable with Newcombe's
    95 % interval; worse when the whole interval is below 0."""
    worse, fine = [], []
    for name, c in canary["metrics"].items():
        s = stable["metrics"].get(name)
        if s is None:
            continue
        delta, low, high = difference(c["passed"], c["n"], s["passed"], s["n"])
        (worse if high < 0 else fine).append(f"quality {name} {c['accuracy']:.0%} vs {s['accuracy']:.0%}: "
                                             f"{delta:+.0%} [{low:+.0%}, {high:+.0%}]")
    return worse, fine


@dataclass(slots=True)
class GateResults:
    reports: dict[tuple[str, str], dict] = field(default_factory=dict)  # (name, version) -> its eval report
    refused: dict[str, tuple[Deployment, list[str]]] = field(default_factory=dict)  # canary name -> it, why


def release_gate(plans: list, deployments: Deployments) -> GateResults:
    """Blocking, before the gateway starts: every deployment with a quality spec runs its set. A stable
    version below its floor raises RuntimeError (the caller stops everything); a canary below it is taken
    out of the deployments and its replicas are stopped."""
    results = GateResults()
    for plan in (p for p in plans if p.spec is not None and p.spec.quality is not None):
        s = plan.spec
        d = deployments.canaries.get(s.name) if s.role == "canary" else deployments.by_name.get(s.name)
        if d is None or not d.upstreams:
            raise RuntimeError(f"release gate: {s.name} {s.version} has no replica to run its quality set on")
        rep = asyncio.run(score(d, s.quality))
        results.reports[(s.name, s.version)] = rep
        log.info("release gate: %s %s on %s %s (%d items, %.0f s): %s", s.name, s.version, rep["set"],
                 rep["split"], len(rep["items"]), rep["duration_s"], describe(rep))
        if not rep["below_floor"]:
            continue
        reasons = [f"release gate: {line}" for line in rep["below_floor"]]
        if s.role == "stable":
            raise RuntimeError(f"release gate: {s.name} {s.version} does not start: {'; '.join(rep['below_floor'])}")
        log.error("release gate: canary %s %s refused: %s", s.name, s.version, "; ".join(rep["below_floor"]))
        results.refused[s.name] = (deployments.drop_canary(s.name), reasons)
        if plan.pool is not None:
            plan.pool.close_now()
    return results
