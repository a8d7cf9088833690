"""The Now page's figures, read from their owners each time (nothing here keeps a copy): the deployments and
their queues and replicas (gateway/deployments.py), the robot sessions (gateway/sessions.py), the control
plane's pools (the gateway's services that have a `deployment` and `members`: replica states, cold start,
the autoscaler's last decision) and the rollouts; recent rates and latencies from the console's Window."""
import asyncio
import time

import httpx

from inferd.console.window import Window
from inferd.gateway.runtimes import replica_report



def snapshot(gw, window: Window) -> dict:
    return {"at_unix_s": time.time(), "gateway_id": gw.config.gateway_id,
            "uptime_s": time.time() - gw.started_unix_s, "usage_records_pending": gw.usage.pending,
            "deployments": [deployment(gw, d, window) for d in gw.deployments.every()]}


def deployment(gw, d, window: Window) -> dict:
    pool = pool_of(gw, d)
    queues = {cls: {"length": s.length, "oldest_age_s": s.oldest_age_s, "queued_tokens": s.queued_tokens}
              for cls, s in d.queue.stats().items()}
    out = {"name": d.name, "version": d.version, "kind": d.model.kind,
           "canary": gw.deployments.canaries.get(d.name) is d, "servable": gw.deployments.servable(d),
           "replicas": replicas(d, pool), "queues": queues, "inflight": d.queue.inflight,
           "degradation_level": d.degrader.level if d.degrader else None,
           "sessions_open": gw.sessions.count(d.name) if d.model.kind == "policy" else None}
    if pool is not None:
        decision = getattr(pool, "decision", None)
        out["cold_start_s"] = pool.cold_start.estimate_s if pool.cold_start.measured else None
        out["target_replicas"] = pool.target
        out["autoscaler"] = {"desired": decision.desired, "reason": decision.reason} if decision else None
    return out | window.recent(d.name, d.version)


def replicas(d, pool) -> list[dict]:
    """Each replica with its state: the pool's (starting, ready, draining) where a pool runs it, else from the
    gateway's probe (ready, or failed when unhealthy)."""
    states = {id(m.upstream): (m.state, m.started_unix_s) for m in pool.members} if pool else {}
    out = [{"name": m.upstream.name, "state": m.state, "started_unix_s": m.started_unix_s,
            "inflight": m.upstream.inflight} for m in (pool.members if pool else []) if m.upstream not in d.upstreams]
    for u in d.upstreams:
        state, started = states.get(id(u), ("ready", None))
        if state == "ready" and not u.healthy:
            state = "failed"
        elif u.draining:
            state = "draining"
        out.append({"name": u.name, "state": state, "started_unix_s": started, "inflight": u.inflight})
    return out


def pool_of(gw, d):
    return next((s for s in gw.services if getattr(s, "deployment", None) is d and hasattr(s, "members")), None)


async def kv_cache_usage(client: httpx.AsyncClient, d) -> float | None:
    """The mean KV-cache use (0..1) the deployment's healthy replicas report (gateway.runtimes.replica_report;
    None: none reports it, e.g. an external OpenAI-compatible replica)."""
    async def one(u) -> float | None:
        value = (await replica_report(client, d, u) or {}).get("kv_cache_usage")
        try:
            return None if value is None else float(value)
        except (TypeError, ValueError):
            return None
    values = [v for v in await asyncio.gather(*(one(u) for u in d.upstreams if u.healthy)) if v is not None]
    return sum(values) / len(values) if values else None
