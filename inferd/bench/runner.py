import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from inferd.bench.arrivals import LoadShape, arrival_offsets_s, arrival_offsets_within_s
from inferd.bench.client import Endpoint, RequestRecord, send
from inferd.bench.errors import EndpointError
from inferd.bench.lag import LagMonitor
from inferd.bench.server import GaugePoller, scrape, server_view, wait_idle
from inferd.bench.target import root_url
from inferd.bench.workloads import BenchRequest

WARMUP_TEXT = "Say hello."
WARMUP_MAX_TOKENS = 8


@dataclass(slots=True)
class RunConfig:
    """One measured load against one endpoint."""
    endpoint: Endpoint
    load: LoadShape
    duration_s: float | None = None  # open loop: arrivals within it; closed loop: stop sending after it
    warmup_requests: int = 1
    max_client_lag_ms: float = 50.0
    metrics_url: str | None = None
    metrics_poll_s: float = 1.0
    progress: bool = True
    seed: int = 0

    @property
    def scrape_url(self) -> str:
        return self.metrics_url or f"{root_url(self.endpoint.base_url)}/metrics"


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]
    duration_s: float
    client_lag: dict
    server: dict | None
    offered_rate_per_s: float | None = None


def http_client() -> httpx.AsyncClient:
    """One pool for the whole run, never the bottleneck: no connection limit."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(60.0, connect=10.0))


# schedule

def offsets_for(config: RunConfig, requests: list[BenchRequest]) -> list[float] | None:
    """Send offsets for open loop (trace offsets win); None for closed loop."""
    if requests and requests[0].arrival_offset_s is not None:
        return [r.arrival_offset_s or 0.0 for r in requests]
    if not config.load.open_loop:
        return None
    if config.duration_s is not None:
        return arrival_offsets_within_s(config.load, config.duration_s, config.seed)[:len(requests)]
    return arrival_offsets_s(config.load, len(requests), config.seed)


# running

async def warm_up(client: httpx.AsyncClient, config: RunConfig) -> None:
    for i in range(config.warmup_requests):
        request = BenchRequest(-1 - i, WARMUP_TEXT, 0, WARMUP_MAX_TOKENS)
        record = await send(client, config.endpoint, request, RequestRecord(request.index, 0.0, 0),
                            time.perf_counter())
        if record.outcome != "completed":
            raise EndpointError(f"the warm-up request ended {record.outcome} (status {record.status}, "
                                f"{record.error_type}); check the endpoint, or pass --warmup-requests 0")


async def run_load(client: httpx.AsyncClient, config: RunConfig, requests: list[BenchRequest]) -> RunResult:
    """Server counters before and after, gauges and client lag during (the caller judges the lag)."""
    await wait_idle(client, config.scrape_url)
    before = await scrape(client, config.scrape_url)
    start = time.perf_counter()
    lag, poller = LagMonitor(), GaugePoller(client, config.scrape_url, start, config.metrics_poll_s)
    background = [asyncio.create_task(lag.run()), asyncio.create_task(poller.run())]
    try:
        records = await _dispatch(client, config, requests, start)
        duration_s = time.perf_counter() - start
    finally:
        for task in background:
            task.cancel()
    await wait_idle(client, config.scrape_url)
    after = await scrape(client, config.scrape_url)
    rate = config.load.rate_per_s if config.load.open_loop else None
    return RunResult(records, duration_s, lag.summary() | {"bound_ms": config.max_client_lag_ms},
                     server_view(before, after, poller.points), rate)


async def _dispatch(client: httpx.AsyncClient, config: RunConfig, requests: list[BenchRequest],
                    start: float) -> list[RequestRecord]:
    offsets = offsets_for(config, requests)
    with _progress(config, len(offsets) if offsets is not None else len(requests)) as bar:
        if offsets is None:
            return await _closed_loop(client, config, requests, start, bar)
        return await _open_loop(client, config, requests[:len(offsets)], offsets, start, bar)


async def _open_loop(client: httpx.AsyncClient, config: RunConfig, requests: list[BenchRequest],
                     offsets: list[float], start: float, bar: tqdm) -> list[RequestRecord]:
    tasks = []
    for request, offset_s in zip(requests, offsets):
        if (delay_s := start + offset_s - time.perf_counter()) > 0:
            await asyncio.sleep(delay_s)
        record = RequestRecord(request.index, offset_s, request.input_tokens)
        task = asyncio.create_task(send(client, config.endpoint, request, record, start))
        task.add_done_callback(lambda _: bar.update())
        tasks.append(task)
    return list(await asyncio.gather(*tasks))


async def _closed_loop(client: httpx.AsyncClient, config: RunConfig, requests: list[BenchRequest], start: float,
                       bar: tqdm) -> list[RequestRecord]:
    queue, records = iter(requests), []
    end_s = start + config.duration_s if config.duration_s is not None else float("inf")

    async def worker() -> None:
        for request in queue:
            if time.perf_counter() >= end_s:
                return
            record = RequestRecord(request.index, time.perf_counter() - start, request.input_tokens)
            records.append(await send(client, config.endpoint, request, record, start))
            bar.update()

    await asyncio.gather(*(worker() for _ in range(config.load.concurrency)))
    return sorted(records, key=lambda r: r.index)


@contextmanager
def _progress(config: RunConfig, total: int) -> Iterator[tqdm]:
    bar = tqdm(total=total, unit="req", disable=not config.progress, mininterval=0.5, leave=False,
               desc=f"{config.load.rate_per_s:g} req/s" if config.load.open_loop else "closed loop")
    try:
        yield bar
    finally:
        bar.close()
