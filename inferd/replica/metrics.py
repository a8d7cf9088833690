"""A replica's Prometheus metrics: the engine's state at scrape time, and per-sequence latencies."""
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from inferd.engine.request import RequestOutput
from inferd.telemetry import LATENCY_BUCKETS_S


class EngineStatsLike(Protocol):
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_evictions: int
    num_nested_prefills: int
    threads: int
    others_cores: float
    num_thread_changes: int


StatsSource = Callable[[], EngineStatsLike]


# scrape-time engine gauges

class EngineCollector:
    """Reads the engine's counters when Prometheus scrapes."""

    def __init__(self, stats: StatsSource):
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily("inferd_num_requests_running", "Sequences in the running batch.", s.num_running)
        yield GaugeMetricFamily("inferd_num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield GaugeMetricFamily("inferd_kv_cache_blocks_used", "KV cache blocks in use.", s.kv_blocks_used)
        yield GaugeMetricFamily("inferd_kv_cache_blocks_capacity", "KV cache blocks in the pool.", s.kv_blocks_total)
        yield CounterMetricFamily("inferd_preemptions", "Sequences preempted since start.", s.num_preemptions)
        yield CounterMetricFamily("inferd_prefix_cache_query_tokens", "Tokens of sequences looked up in the "
                                  "prefix cache when scheduled.", s.prefix_cache_query_tokens)
        yield CounterMetricFamily("inferd_prefix_cache_hit_tokens", "Tokens found in the prefix cache (not "
                                  "computed).", s.prefix_cache_hit_tokens)
        yield CounterMetricFamily("inferd_prefix_cache_evictions", "Cached KV blocks evicted for reuse.",
                                  s.prefix_cache_evictions)
        yield CounterMetricFamily("inferd_nested_prefills", "Prompts that arrived while a step ran and were "
                                  "prefilled between its layers.", s.num_nested_prefills)
        yield GaugeMetricFamily("inferd_engine_threads", "Threads a step runs on now: fewer while other processes "
                                "use this replica's cores.", s.threads)
        yield GaugeMetricFamily("inferd_cpu_others_cores", "Cores of this replica's set that other processes used "
                                "in the last measured window.", s.others_cores)
        yield CounterMetricFamily("inferd_engine_thread_changes", "Times the step's thread count changed with the "
                                  "cores other processes use.", s.num_thread_changes)
        spec = getattr(s, "spec", None)
        if spec is not None:
            yield from _spec_metrics(spec)


def _spec_metrics(spec) -> Iterator[Metric]:
    yield CounterMetricFamily("inferd_spec_decode_draft_tokens", "Speculative tokens proposed.", spec.draft_tokens)
    yield CounterMetricFamily("inferd_spec_decode_accepted_tokens", "Speculative tokens accepted.",
                              spec.accepted_tokens)
    by_position = CounterMetricFamily("inferd_spec_decode_accepted_by_position", "Drafts accepted at each "
                                      "position (1 = first draft).", labels=["position"])
    for i, n in enumerate(spec.accepted_by_position):
        by_position.add_metric([str(i + 1)], n)
    yield by_position
    drafted = CounterMetricFamily("inferd_spec_decode_drafted_by_position", "Drafts proposed at each position "
                                  "(acceptance at position i = accepted / drafted).", labels=["position"])
    for i, n in enumerate(spec.drafted_by_position):
        drafted.add_metric([str(i + 1)], n)
    yield drafted


# request metrics

class ServerMetrics:
    """All metrics of one server, on its own registry."""

    def __init__(self, stats: StatsSource | None = None):
        self.registry = CollectorRegistry()
        self.ttft_s = self._histogram("inferd_time_to_first_token_seconds", "Arrival to first output token.")
        self.itl_s = self._histogram("inferd_inter_token_latency_seconds", "Time between output tokens.")
        self.e2e_s = self._histogram("inferd_e2e_request_latency_seconds", "Arrival to last output token.")
        self.queue_s = self._histogram("inferd_queue_time_seconds", "Arrival to first scheduled.")
        self.prompt_tokens = Counter("inferd_prompt_tokens_total", "Prompt tokens of ended sequences.",
                                     registry=self.registry)
        self.generation_tokens = Counter("inferd_generation_tokens_total", "Output tokens of ended sequences.",
                                         registry=self.registry)
        self.requests = Counter("inferd_requests_total", "Ended sequences by finish reason.", ["finish_reason"],
                                registry=self.registry)
        if stats is not None:
            self.registry.register(EngineCollector(stats))

    def _histogram(self, name: str, doc: str) -> Histogram:
        return Histogram(name, doc, buckets=LATENCY_BUCKETS_S, registry=self.registry)

    def start_sequence(self, arrival_s: float | None = None) -> "SequenceTrace":
        """arrival_s: time.monotonic() when the request arrived (default: now)."""
        return SequenceTrace(self, time.monotonic() if arrival_s is None else arrival_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(slots=True)
class SequenceTrace:
    """Latency bookkeeping for one engine sequence, fed with its outputs."""
    metrics: ServerMetrics
    arrival_s: float
    last_token_s: float | None = None
    queue_seen: bool = False
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    ended: bool = False

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        self.num_prompt_tokens, self.num_output_tokens = out.num_prompt_tokens, out.num_output_tokens
        if out.queue_time_s is not None and not self.queue_seen:
            self.queue_seen = True
            self.metrics.queue_s.observe(out.queue_time_s)
        if out.token_ids:
            self._tokens(out, now)
        if out.finished:
            self._end(out.finish_reason or "stop", now)

    def abort(self) -> None:
        self._end("abort", time.monotonic())

    def _tokens(self, out: RequestOutput, now: float) -> None:
        m = self.metrics
        if self.last_token_s is None:
            m.ttft_s.observe((out.first_token_time or now) - self.arrival_s)
        else:
            gap_s = (now - self.last_token_s) / len(out.token_ids)
            for _ in out.token_ids:
                m.itl_s.observe(gap_s)
        self.last_token_s = now

    def _end(self, finish_reason: str, now: float) -> None:
        if self.ended:
            return
        self.ended = True
        m = self.metrics
        m.requests.labels(finish_reason=finish_reason).inc()
        m.prompt_tokens.inc(self.num_prompt_tokens)
        m.generation_tokens.inc(self.num_output_tokens)
        if self.last_token_s is not None:
            m.e2e_s.observe(now - self.arrival_s)


# endpoint

def metrics_route(metrics: ServerMetrics, path: str = "/metrics") -> Route:
    async def endpoint(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
    return Route(path, endpoint, methods=["GET"])
