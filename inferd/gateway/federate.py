"""The replicas' own metrics, served from the gateway's /metrics with a `replica` label (one scrape target)."""
import asyncio
from collections.abc import Iterator

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from inferd.gateway.deployments import Upstream
from inferd.telemetry import merged


async def replica_metrics(client: httpx.AsyncClient, upstreams: list[Upstream]) -> bytes:
    texts = await asyncio.gather(*(_fetch(client, u) for u in upstreams))
    labelled = []
    for upstream, text in zip(upstreams, texts):
        for family in _parsed(text or ""):  # parsed here: ours to relabel
            family.samples = [s._replace(labels=s.labels | {"replica": upstream.name}) for s in family.samples]
            labelled.append(family)
    registry = CollectorRegistry()
    registry.register(_Families(merged(labelled)))
    return generate_latest(registry)


def _parsed(text: str) -> list[Metric]:
    """A replica's families, or none when its answer is not the Prometheus text format: one replica's
    garbage leaves the others' metrics and the gateway's own."""
    try:
        return list(text_string_to_metric_families(text))
    except ValueError:
        return []


async def _fetch(client: httpx.AsyncClient, upstream: Upstream) -> str | None:
    try:
        r = await client.get(f"{upstream.base_url}/metrics", timeout=5.0)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


class _Families:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)

    def describe(self) -> list[Metric]:
        return []
