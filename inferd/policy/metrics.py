"""A policy replica's Prometheus metrics: observations by outcome, batches, queue and compute time."""
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from inferd.replica.batcher import Batcher, BatchReport
from inferd.replica.batcher_gauges import BatcherGauges
from inferd.telemetry import LATENCY_BUCKETS_S

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

QUEUE_GAUGES = [  # the batcher's queue at scrape time
    ("inferd_policy_queue_observations", "Observations waiting for a batch.", lambda b: b.queued_items),
]


class PolicyMetrics:
    """All metrics of one policy server, on its own registry; observe_batch is the batcher's on_batch."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.observations = Counter("inferd_policy_observations_total", "Ended observations by outcome.",
                                    ["outcome"], registry=r)
        self.batch_size = Histogram("inferd_policy_batch_observations", "Observations per forward pass.",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.queue_s = Histogram("inferd_policy_queue_time_seconds", "Per observation: queued to its batch's "
                                 "start.", buckets=LATENCY_BUCKETS_S, registry=r)
        self.compute_s = Histogram("inferd_policy_batch_compute_seconds", "Per batch: the forward pass.",
                                   buckets=LATENCY_BUCKETS_S, registry=r)
        self.latency_s = Histogram("inferd_policy_observation_latency_seconds", "Arrival to actions, per "
                                   "answered observation.", buckets=LATENCY_BUCKETS_S, registry=r)

    def watch_queue(self, batcher: Batcher) -> None:
        self.registry.register(BatcherGauges(batcher, QUEUE_GAUGES))

    def observe_batch(self, report: BatchReport) -> None:
        self.batch_size.observe(report.num_items)
        self.compute_s.observe(report.compute_s)
        for wait_s in report.queue_s:
            self.queue_s.observe(wait_s)

    def observe(self, outcome: str, latency_s: float | None = None) -> None:
        self.observations.labels(outcome=outcome).inc()
        if latency_s is not None:
            self.latency_s.observe(latency_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
