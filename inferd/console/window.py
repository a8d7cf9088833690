"""The console's own small time series: what the gateway did per deployment version, in time buckets.

It sees every usage record (a Gateway observer) and samples the gauges (queue length, in-flight, ready
replicas, the replicas' mean KV-cache use) every SAMPLE_S. Two rings per deployment version, so memory is
bounded whatever the traffic:
    FINE: 1-minute buckets for the last hour (TTFT over 5 and 60 minutes, the request rate now)
    COARSE: 10-minute buckets for the last 24 hours (the History charts); the console saves them in the store
            each minute and restores them at start, so History outlives a restart
The prefix-cache hit rate is the records' cached prompt tokens over their prompt tokens. A latency (TTFT, E2E,
and the record's TPOT: streamed or unary, see relay.Outcome.tpot_s) is counted in the gateway's histogram buckets
(telemetry.LATENCY_BUCKETS_S); percentiles are interpolated inside a bucket, as Prometheus' histogram_quantile
does. Prometheus stays the system of record.
"""
import bisect
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from inferd.telemetry import LATENCY_BUCKETS_S

FINE_S, FINE_COUNT = 60.0, 60
COARSE_S, COARSE_COUNT = 600.0, 144
SAMPLE_S = 5.0
EDGES = (0.0, *LATENCY_BUCKETS_S)


@dataclass(slots=True)
class Bucket:
    start_unix_s: float
    requests: int = 0
    failures: Counter = field(default_factory=Counter)  # error code (or status) of records not completed
    ttft: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    e2e: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    tpot: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    prompt_tokens: int = 0
    cached_tokens: int = 0
    queue_length_max: int = 0
    inflight_max: int = 0
    ready_replicas: int = 0
    kv_usage: float | None = None  # the last sample's mean over ready replicas that report it

    def add(self, record) -> None:
        self.requests += 1
        if record.status != "completed":
            self.failures[record.error_code or record.status] += 1
        if record.ttft_s is not None:
            self.ttft[bisect.bisect_left(LATENCY_BUCKETS_S, record.ttft_s)] += 1
        self.e2e[bisect.bisect_left(LATENCY_BUCKETS_S, record.e2e_s)] += 1
        self.prompt_tokens += record.prompt_tokens
        self.cached_tokens += record.cached_tokens
        if record.tpot_s is not None:
            self.tpot[bisect.bisect_left(LATENCY_BUCKETS_S, record.tpot_s)] += 1

    def to_dict(self) -> dict:
        return {"requests": self.requests, "failures": dict(self.failures), "ttft": self.ttft, "e2e": self.e2e,
                "tpot": self.tpot, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "queue_length_max": self.queue_length_max, "inflight_max": self.inflight_max,
                "ready_replicas": self.ready_replicas, "kv_usage": self.kv_usage}

    def merge(self, saved: dict) -> None:
        """Another gateway's (or an earlier process's) bucket of the same time, as to_dict wrote it."""
        self.requests += saved["requests"]
        self.failures.update(saved["failures"])
        for name in ("ttft", "e2e", "tpot"):
            setattr(self, name, [a + b for a, b in zip(getattr(self, name), saved[name])])
        self.prompt_tokens += saved["prompt_tokens"]
        self.cached_tokens += saved["cached_tokens"]
        self.queue_length_max = max(self.queue_length_max, saved["queue_length_max"])
        self.inflight_max = max(self.inflight_max, saved["inflight_max"])
        self.ready_replicas = max(self.ready_replicas, saved["ready_replicas"])
        if saved["kv_usage"] is not None:
            self.kv_usage = max(self.kv_usage or 0.0, saved["kv_usage"])

    def sample(self, queue_length: int, inflight: int, ready: int, kv_usage: float | None = None) -> None:
        self.queue_length_max = max(self.queue_length_max, queue_length)
        self.inflight_max = max(self.inflight_max, inflight)
        self.ready_replicas = ready
        if kv_usage is not None:
            self.kv_usage = kv_usage


class Ring:
    """The last `count` buckets of `width_s` seconds, aligned to multiples of width_s."""

    def __init__(self, width_s: float, count: int):
        self.width_s, self.buckets = width_s, deque(maxlen=count)

    def current(self, now_unix_s: float) -> Bucket:
        start = now_unix_s // self.width_s * self.width_s
        if not self.buckets or self.buckets[-1].start_unix_s < start:
            self.buckets.append(Bucket(start))
        return self.buckets[-1]

    def since(self, since_unix_s: float) -> list[Bucket]:
        return [b for b in self.buckets if b.start_unix_s + self.width_s > since_unix_s]


@dataclass(slots=True)
class Series:
    fine: Ring = field(default_factory=lambda: Ring(FINE_S, FINE_COUNT))
    coarse: Ring = field(default_factory=lambda: Ring(COARSE_S, COARSE_COUNT))


class Window:
    """Per (deployment, version): only versions the gateway serves get a series (a record for an unknown
    model name is not kept), so the number of series is bounded by the deployments."""

    def __init__(self, known, clock=time.time):
        self.known, self.clock = known, clock  # known(name, version) -> bool
        self.series: dict[tuple[str, str], Series] = {}

    def observe(self, record) -> None:
        s = self._series(record.model, record.deployment_version or "")
        if s is not None:
            now = self.clock()
            s.fine.current(now).add(record)
            s.coarse.current(now).add(record)

    def sample(self, name: str, version: str, queue_length: int, inflight: int, ready: int,
               kv_usage: float | None = None) -> None:
        s = self._series(name, version)
        if s is not None:
            now = self.clock()
            s.fine.current(now).sample(queue_length, inflight, ready, kv_usage)
            s.coarse.current(now).sample(queue_length, inflight, ready, kv_usage)

    def recent(self, name: str, version: str) -> dict:
        """The Now page's figures from the last 5 and 60 minutes."""
        s, now = self.series.get((name, version)), self.clock()
        out = {}
        for minutes in (5, 60):
            buckets = s.fine.since(now - minutes * 60) if s else []
            requests = sum(b.requests for b in buckets)
            prompt = sum(b.prompt_tokens for b in buckets)
            out[f"last_{minutes}m"] = {
                "requests": requests, "failures": dict(sum((b.failures for b in buckets), Counter())),
                "prefix_cache_hit_rate": sum(b.cached_tokens for b in buckets) / prompt if prompt else None,
                **{f"{m}_p{round(q * 100)}_s": quantile(q, merged(buckets, m))
                   for m in ("ttft", "tpot", "e2e") for q in (0.5, 0.95)}}
        last = s.fine.since(now - FINE_S) if s else []  # this minute and the one before
        out["kv_cache_usage"] = next((b.kv_usage for b in reversed(last) if b.kv_usage is not None), None)
        out["requests_per_s"] = sum(b.requests for b in last) / max(now - last[0].start_unix_s, 1.0) if last else 0.0
        return out

    def history(self, name: str, version: str, fine: bool = False) -> list[dict]:
        """One point per bucket, oldest first: the History charts."""
        s = self.series.get((name, version))
        if s is None:
            return []
        ring = s.fine if fine else s.coarse
        return [{"start_unix_s": b.start_unix_s, "requests_per_s": b.requests / ring.width_s,
                 "failures": sum(b.failures.values()), "ttft_p95_s": quantile(0.95, b.ttft),
                 "e2e_p95_s": quantile(0.95, b.e2e), "tpot_p95_s": quantile(0.95, b.tpot),
                 "prefix_cache_hit_rate": b.cached_tokens / b.prompt_tokens if b.prompt_tokens else None,
                 "kv_cache_usage": b.kv_usage, "queue_length_max": b.queue_length_max,
                 "inflight_max": b.inflight_max, "ready_replicas": b.ready_replicas} for b in ring.buckets]

    def reasons(self, since_unix_s: float) -> list[dict]:
        """What did not complete since then, per deployment, version and reason (an error code, such as a client
        error's, or the status: cancelled when the client left): the Usage tab's table, most first."""
        out = []
        for (name, version), s in self.series.items():
            counts = sum((b.failures for b in s.coarse.since(since_unix_s)), Counter())
            out += [{"model": name, "version": version, "reason": r, "count": n} for r, n in counts.items()]
        return sorted(out, key=lambda r: (-r["count"], r["model"], r["reason"]))

    def coarse_buckets(self, since_unix_s: float) -> list[tuple[str, str, float, dict]]:
        """(deployment, version, start, bucket) of the History buckets that end after since_unix_s: what the
        console saves each minute (console/routes.py)."""
        return [(name, version, b.start_unix_s, b.to_dict()) for (name, version), s in self.series.items()
                for b in s.coarse.since(since_unix_s)]

    def restore(self, saved: list[dict]) -> None:
        """History buckets saved before this process started (every gateway's of the store, oldest first), for
        the versions served now. The bucket in progress is left out: this process counts it from here on."""
        current = self.clock() // COARSE_S * COARSE_S
        for row in saved:
            s = self._series(row["deployment"], row["version"])
            if s is None or row["start_unix_s"] >= current:
                continue
            ring = s.coarse.buckets
            if not ring or ring[-1].start_unix_s < row["start_unix_s"]:
                ring.append(Bucket(row["start_unix_s"]))
            if ring[-1].start_unix_s == row["start_unix_s"]:
                ring[-1].merge(row["bucket"])

    def _series(self, name: str, version: str) -> Series | None:
        s = self.series.get((name, version))
        if s is None and self.known(name, version):
            s = self.series[(name, version)] = Series()
        return s


def merged(buckets: list[Bucket], name: str) -> list[int]:
    out = [0] * (len(LATENCY_BUCKETS_S) + 1)
    for b in buckets:
        for i, n in enumerate(getattr(b, name)):
            out[i] += n
    return out


def quantile(q: float, counts: list[int]) -> float | None:
    """The q-quantile of a bucketed distribution (linear inside its bucket); None with no samples. A value past
    the last edge is reported as the last edge."""
    total = sum(counts)
    if total == 0:
        return None
    rank, seen = q * total, 0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            if i >= len(LATENCY_BUCKETS_S):
                return LATENCY_BUCKETS_S[-1]
            low, high = EDGES[i], EDGES[i + 1]
            return low + (high - low) * (rank - seen) / n
        seen += n
    return LATENCY_BUCKETS_S[-1]
