"""The shared batcher's queue as Prometheus gauges, read at scrape time (each kind names its own gauges)."""
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from inferd.replica.batcher import Batcher

Gauge = tuple[str, str, Callable[[Batcher], float]]  # name, help, what it reads of the batcher


class BatcherGauges:
    def __init__(self, batcher: Batcher, gauges: list[Gauge]):
        self._batcher, self._gauges = batcher, gauges

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        for name, doc, read in self._gauges:
            yield GaugeMetricFamily(name, doc, read(self._batcher))
