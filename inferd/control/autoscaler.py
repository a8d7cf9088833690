"""How many replicas a deployment wants: a pure decision from its signals, smoothed in time.

Signals (read by the pool every interval_s): the admission queue's oldest age and waiting tokens, the
replicas' KV cache usage, TTFT p95 over a window against the deployment's target, and the measured cold
start. Scale-up needs a signal to breach for upscale_delay_s; a queue that is still growing counts as a
breach early, when its oldest request would be over target by the time a new replica is warm. Scale-down
drains one replica at a time after downscale_delay_s of idleness. Within min/max, under the cost ceiling
(replica-hours spent over the last hour), and from zero a replica starts as soon as a request waits.
"""
import math
from collections import deque
from dataclasses import dataclass, field

from inferd.control.spec import AutoscalingSpec

HOUR_S = 3600.0
IDLE_UTILIZATION = 0.5  # scale down only if the others would run the load at most half full


@dataclass(slots=True)
class Signals:
    replicas: int  # ready + starting, not draining
    starting: int  # of those, not ready yet
    queue_length: int = 0
    queue_age_s: float = 0.0  # oldest waiting request
    waiting_tokens: int = 0  # reserved tokens of waiting requests
    inflight: int = 0  # requests running on the replicas
    kv_usage: float = 0.0  # mean over ready replicas, 0..1
    ttft_p95_s: float | None = None  # over the window; None: no request finished in it
    cold_start_s: float = 0.0  # the moving estimate: start -> ready


@dataclass(slots=True)
class Decision:
    desired: int
    reason: str  # why (the signals that breached), or "steady"


@dataclass(slots=True)
class Autoscaler:
    spec: AutoscalingSpec
    max_num_seqs: int  # per replica: what idleness is measured against
    breach_since: float | None = None
    idle_since: float | None = None
    last_queue_length: int = 0
    usage: deque = field(default_factory=deque)  # (t, replicas) samples: replica-seconds spent

    def decide(self, now: float, s: Signals) -> Decision:
        a, n = self.spec, s.replicas
        self._account(now, n)
        growing = s.queue_length > 0 and s.queue_length >= self.last_queue_length
        self.last_queue_length = s.queue_length
        if n < a.min_replicas:
            return self._step(n + 1, f"below min_replicas {a.min_replicas}")
        if n > a.max_replicas:
            return self._step(n - 1, f"above max_replicas {a.max_replicas}")
        if n == 0 and s.queue_length:
            return self._step(1, "a request waits and no replica runs")
        over_budget = self.over_budget(now)
        floor = max(a.min_replicas, 1 if s.queue_length or s.inflight else 0)
        if over_budget and n > max(floor, math.floor(a.max_replica_hours_per_hour)):
            return self._step(n - 1, f"cost ceiling {a.max_replica_hours_per_hour:g} replica-hours per hour")
        breaches = self.breaches(s, growing)
        if breaches:
            self.idle_since = None
            self.breach_since = self.breach_since if self.breach_since is not None else now
            held = now - self.breach_since >= a.upscale_delay_s
            if held and n < a.max_replicas and not s.starting and not over_budget:
                return self._step(n + 1, ", ".join(breaches))
            return Decision(n, "breach held back: " + ", ".join(breaches))
        self.breach_since = None
        if n > a.min_replicas and not s.starting and self._idle(s, n):
            self.idle_since = self.idle_since if self.idle_since is not None else now
            if now - self.idle_since >= a.downscale_delay_s:
                return self._step(n - 1, f"idle for {a.downscale_delay_s:g} s")
        else:
            self.idle_since = None
        return Decision(n, "steady")

    def breaches(self, s: Signals, growing: bool) -> list[str]:
        a, ready = self.spec, max(s.replicas - s.starting, 1)
        out = []
        if s.queue_age_s * 1000 > a.target_queue_age_ms:
            out.append(f"queue age {s.queue_age_s * 1000:.0f} ms > {a.target_queue_age_ms:g} ms")
        elif growing and (s.queue_age_s + s.cold_start_s) * 1000 > self.queue_target_ms():
            out.append(f"queue growing: {s.queue_age_s * 1000:.0f} ms + cold start {s.cold_start_s:.1f} s "
                       f"> {self.queue_target_ms():g} ms")
        if s.waiting_tokens > a.max_waiting_tokens_per_replica * ready:
            out.append(f"waiting tokens {s.waiting_tokens} > {a.max_waiting_tokens_per_replica} per replica")
        if s.kv_usage > a.max_kv_usage:
            out.append(f"KV usage {s.kv_usage:.2f} > {a.max_kv_usage:g}")
        busy = s.queue_length > 0 or s.inflight > ready * self.max_num_seqs * IDLE_UTILIZATION
        if a.target_ttft_ms is not None and s.ttft_p95_s is not None and s.ttft_p95_s * 1000 > a.target_ttft_ms \
                and busy:  # slow first tokens on idle replicas: more replicas would not help
            out.append(f"TTFT p95 {s.ttft_p95_s * 1000:.0f} ms > {a.target_ttft_ms:g} ms")
        return out

    def queue_target_ms(self) -> float:
        """What a waiting request may wait at most: the queue age target, or the TTFT target if lower."""
        a = self.spec
        return min(a.target_queue_age_ms, a.target_ttft_ms) if a.target_ttft_ms is not None else a.target_queue_age_ms

    def spent_replica_hours(self, now: float) -> float:
        """Replica-hours over the last hour (time before the first sample counts as none)."""
        total, samples = 0.0, list(self.usage)
        for (t0, n), (t1, _) in zip(samples, samples[1:] + [(now, 0)]):
            total += n * max(min(t1, now) - max(t0, now - HOUR_S), 0.0)
        return total / HOUR_S

    def over_budget(self, now: float) -> bool:
        ceiling = self.spec.max_replica_hours_per_hour
        return ceiling is not None and self.spent_replica_hours(now) >= ceiling

    def _idle(self, s: Signals, n: int) -> bool:
        a = self.spec
        calm = s.queue_length == 0 and s.kv_usage <= a.max_kv_usage / 2
        return calm and s.inflight <= (n - 1) * self.max_num_seqs * IDLE_UTILIZATION

    def _account(self, now: float, n: int) -> None:
        if not self.usage or self.usage[-1][1] != n:
            self.usage.append((now, n))
        while len(self.usage) > 1 and self.usage[1][0] <= now - HOUR_S:
            self.usage.popleft()

    def _step(self, desired: int, reason: str) -> Decision:
        self.breach_since = self.idle_since = None
        return Decision(desired, reason)


class TtftWindow:
    """First-token times the gateway saw for one deployment, over the last window_s."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.samples: deque[tuple[float, float]] = deque()

    def add(self, now: float, ttft_s: float) -> None:
        self.samples.append((now, ttft_s))
        self._trim(now)

    def p95(self, now: float) -> float | None:
        self._trim(now)
        if not self.samples:
            return None
        values = sorted(v for _, v in self.samples)
        return values[min(math.ceil(0.95 * len(values)) - 1, len(values) - 1)]

    def _trim(self, now: float) -> None:
        while self.samples and self.samples[0][0] < now - self.window_s:
            self.samples.popleft()


class ColdStart:
    """A moving estimate of a replica's cold start (start -> ready), from the measured ones."""

    def __init__(self, initial_s: float = 20.0, alpha: float = 0.5):
        self.estimate_s = initial_s
        self.alpha = alpha
        self.measured = 0
        self.last: dict[str, float] = {}  # phase -> seconds since start: loaded, warm, ready

    def observe(self, phases: dict[str, float]) -> None:
        self.last = phases
        total = phases["ready"]
        self.estimate_s = total if not self.measured else self.alpha * total + (1 - self.alpha) * self.estimate_s
        self.measured += 1
