"""The gateway's Prometheus metrics: admissions, rejections, queues, tokens and cost (bounded labels)."""
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from inferd.telemetry import LATENCY_BUCKETS_S, merged

OTHER = "other"


class LabelBudget:
    """At most `limit` distinct values of a label; later ones are reported as 'other'."""

    def __init__(self, limit: int):
        self.limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        if len(self._seen) < self.limit:
            self._seen.add(value)
            return value
        return OTHER


class GatewayMetrics:
    def __init__(self, tenant_label_limit: int = 100):
        r = self.registry = CollectorRegistry()
        self.tenant_label = LabelBudget(tenant_label_limit)
        self.requests = Counter("inferd_gateway_requests_total", "Requests ended, by status.",
                                ["model", "status"], registry=r)
        self.rejections = Counter("inferd_gateway_rejections_total", "Requests refused, by reason.",
                                  ["reason"], registry=r)
        self.admissions = Counter("inferd_gateway_admissions_total", "Requests admitted to a replica.",
                                  ["model", "priority_class"], registry=r)
        self.queue_s = Histogram("inferd_gateway_queue_time_seconds", "Time waiting for admission.",
                                 ["priority_class"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.ttft_s = Histogram("inferd_gateway_time_to_first_token_seconds", "Arrival to first token, as "
                                "clients see it.", ["model"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.tokens = Counter("inferd_gateway_tokens_total", "Billed tokens.", ["tenant", "model", "kind"],
                              registry=r)
        self.cost = Counter("inferd_gateway_cost_usd_total", "Billed cost in USD.", ["tenant", "model"], registry=r)
        self.degradations = Counter("inferd_gateway_degraded_total", "Requests degraded under overload, by "
                                    "the deployment asked for and the action.", ["model", "action"], registry=r)
        self.fallbacks = Counter("inferd_gateway_fallbacks_total", "Requests a deployment failed and handed to "
                                 "a fallback deployment.", ["model", "fallback", "reason"], registry=r)
        self.response_caches = Counter("inferd_gateway_response_cache_total", "Requests to a deployment with a "
                                       "response cache, by result: hit, miss, bypass, uncacheable.",
                                       ["model", "result"], registry=r)
        self.observations = Counter("inferd_gateway_policy_observations_total", "Robot policy observations by "
                                    "outcome (answered, late, deadline_exceeded, superseded, invalid_observation, "
                                    "...).", ["model", "outcome"], registry=r)
        self.observation_s = Histogram("inferd_gateway_policy_observation_seconds", "Observation frame in to its "
                                       "action chunk out, as the gateway sees it.", ["model"],
                                       buckets=LATENCY_BUCKETS_S, registry=r)
        self._children: dict[tuple, object] = {}  # (metric, label values) -> its child: .labels() costs µs
        self._watched: list[Callable[[], Iterator[Metric]]] = []
        r.register(_Watched(self._watched))

    def _child(self, metric, *values: str):
        child = self._children.get((metric, values))
        if child is None:
            child = self._children[(metric, values)] = metric.labels(*values)
        return child

    def admitted(self, model: str, priority_class: str, queue_s: float) -> None:
        self._child(self.admissions, model, priority_class).inc()
        self._child(self.queue_s, priority_class).observe(queue_s)

    def rejected(self, reason: str) -> None:
        self._child(self.rejections, reason).inc()

    def response_cache(self, model: str, result: str) -> None:
        self._child(self.response_caches, model, result).inc()

    def degraded(self, model: str, actions: list[str]) -> None:
        for action in actions:
            self.degradations.labels(model, action).inc()

    def fallback(self, model: str, fallback: str, reason: str) -> None:
        self.fallbacks.labels(model, fallback, reason).inc()

    def ended(self, tenant_id: str, model: str, status: str, prompt: int, cached: int, completion: int,
              cost_usd: float, ttft_s: float | None) -> None:
        tenant = self.tenant_label(tenant_id)
        self._child(self.requests, model, status).inc()
        for kind, n in (("prompt", prompt - cached), ("cached_prompt", cached), ("completion", completion)):
            if n:
                self._child(self.tokens, tenant, model, kind).inc(n)
        if cost_usd:
            self._child(self.cost, tenant, model).inc(cost_usd)
        if ttft_s is not None:
            self._child(self.ttft_s, model).observe(ttft_s)

    def observed(self, model: str, outcome: str, latency_s: float | None = None) -> None:
        self._child(self.observations, model, outcome).inc()
        if latency_s is not None:
            self._child(self.observation_s, model).observe(latency_s)

    def watch(self, collect: Callable[[], Iterator[Metric]]) -> None:
        """collect's families join the gateway's; those several sources name alike (each pool's replicas by
        state) are one family, with one HELP and one TYPE line, as the text format wants."""
        self._watched.append(collect)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Watched:
    def __init__(self, sources: list[Callable[[], Iterator[Metric]]]):
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        return iter(merged(family for source in self.sources for family in source()))

    def describe(self) -> list[Metric]:
        return []


def gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
