"""A classical replica's Prometheus metrics: requests by outcome, rows, batches, queue and compute time."""
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from inferd.replica.batcher import Batcher, BatchReport
from inferd.replica.batcher_gauges import BatcherGauges
from inferd.telemetry import LATENCY_BUCKETS_S

BATCH_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)

QUEUE_GAUGES = [  # the batcher's queue at scrape time
    ("inferd_classical_queue_requests", "Requests (or pieces) waiting for a batch.", lambda b: b.queued_items),
    ("inferd_classical_queue_rows", "Rows waiting for a batch.", lambda b: b.queued_cost),
    ("inferd_classical_running_rows", "Rows in the running batch.", lambda b: sum(i.cost for i in b.running)),
]


class ClassicalMetrics:
    """All metrics of one classical server, on its own registry; observe_batch is the batcher's on_batch."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("inferd_classical_requests_total", "Ended requests by API and outcome.",
                                ["api", "outcome"], registry=r)
        self.rows = Counter("inferd_classical_rows_total", "Rows predicted.", registry=r)
        self.batch_rows = Histogram("inferd_classical_batch_rows", "Rows per model call.", buckets=BATCH_ROW_BUCKETS,
                                    registry=r)
        self.batch_requests = Histogram("inferd_classical_batch_requests", "Requests (or pieces) per model call.",
                                        buckets=BATCH_ROW_BUCKETS, registry=r)
        self.queue_s = Histogram("inferd_classical_queue_time_seconds", "Per request (or piece): queued to its "
                                 "batch's start.", buckets=LATENCY_BUCKETS_S, registry=r)
        self.compute_s = Histogram("inferd_classical_batch_compute_seconds", "Per batch: the model's time.",
                                   buckets=LATENCY_BUCKETS_S, registry=r)
        self.request_s = Histogram("inferd_classical_request_latency_seconds", "Arrival to response, per "
                                   "completed request.", buckets=LATENCY_BUCKETS_S, registry=r)

    def watch_queue(self, batcher: Batcher) -> None:
        self.registry.register(BatcherGauges(batcher, QUEUE_GAUGES))

    def observe_batch(self, report: BatchReport) -> None:
        self.batch_rows.observe(report.cost)
        self.batch_requests.observe(report.num_items)
        self.compute_s.observe(report.compute_s)
        for wait_s in report.queue_s:
            self.queue_s.observe(wait_s)

    def observe_request(self, api: str, outcome: str, rows: int = 0, latency_s: float | None = None) -> None:
        self.requests.labels(api=api, outcome=outcome).inc()
        self.rows.inc(rows)
        if latency_s is not None:
            self.request_s.observe(latency_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
