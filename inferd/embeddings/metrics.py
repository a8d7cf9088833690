"""An embedding replica's Prometheus metrics: requests, inputs, tokens, batches, queue and compute time."""
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from inferd.replica.batcher import Batcher, BatchReport
from inferd.replica.batcher_gauges import BatcherGauges
from inferd.telemetry import LATENCY_BUCKETS_S

BATCH_INPUT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BATCH_TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)

QUEUE_GAUGES = [  # the batcher's queue at scrape time
    ("inferd_embedding_queue_inputs", "Inputs waiting for a batch.", lambda b: b.queued_items),
    ("inferd_embedding_queue_tokens", "Tokens of the inputs waiting.", lambda b: b.queued_cost),
    ("inferd_embedding_running_inputs", "Inputs in the running batch.", lambda b: len(b.running)),
]


class EmbeddingMetrics:
    """All metrics of one embedding server, on its own registry; observe_batch is the batcher's on_batch."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("inferd_embedding_requests_total", "Ended requests by outcome.", ["outcome"],
                                registry=r)
        self.inputs = Counter("inferd_embedding_inputs_total", "Inputs embedded.", registry=r)
        self.tokens = Counter("inferd_embedding_tokens_total", "Tokens embedded, special tokens included.",
                              registry=r)
        self.padding_tokens = Counter("inferd_embedding_padding_tokens_total", "Padding computed in batches "
                                      "(each padded to its longest input).", registry=r)
        self.batch_inputs = Histogram("inferd_embedding_batch_inputs", "Inputs per model batch.",
                                      buckets=BATCH_INPUT_BUCKETS, registry=r)
        self.batch_tokens = Histogram("inferd_embedding_batch_tokens", "Tokens per model batch, unpadded.",
                                      buckets=BATCH_TOKEN_BUCKETS, registry=r)
        self.queue_s = Histogram("inferd_embedding_queue_time_seconds", "Per input: queued to its batch's "
                                 "start.", buckets=LATENCY_BUCKETS_S, registry=r)
        self.compute_s = Histogram("inferd_embedding_batch_compute_seconds", "Per batch: the model's time.",
                                   buckets=LATENCY_BUCKETS_S, registry=r)
        self.request_s = Histogram("inferd_embedding_request_latency_seconds", "Arrival to response, per "
                                   "completed request.", buckets=LATENCY_BUCKETS_S, registry=r)

    def watch_queue(self, batcher: Batcher) -> None:
        self.registry.register(BatcherGauges(batcher, QUEUE_GAUGES))

    def observe_batch(self, report: BatchReport) -> None:
        self.batch_inputs.observe(report.num_items)
        self.batch_tokens.observe(report.cost)
        self.padding_tokens.inc(report.num_items * report.max_item_cost - report.cost)
        self.compute_s.observe(report.compute_s)
        for wait_s in report.queue_s:
            self.queue_s.observe(wait_s)

    def observe_request(self, outcome: str, num_inputs: int = 0, num_tokens: int = 0,
                        latency_s: float | None = None) -> None:
        self.requests.labels(outcome=outcome).inc()
        self.inputs.inc(num_inputs)
        self.tokens.inc(num_tokens)
        if latency_s is not None:
            self.request_s.observe(latency_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
