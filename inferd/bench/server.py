import asyncio
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

# metric names: inferd first, vLLM after; the first present wins
QUEUE_TIME = ("inferd_queue_time_seconds", "vllm:request_queue_time_seconds")
RUNNING = ("inferd_num_requests_running", "vllm:num_requests_running")
WAITING = ("inferd_num_requests_waiting", "vllm:num_requests_waiting")
KV_USED, KV_TOTAL = "inferd_kv_cache_blocks_used", "inferd_kv_cache_blocks_capacity"
KV_RATIO = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREFIX_HITS = ("inferd_prefix_cache_hit_tokens_total", "vllm:prefix_cache_hits_total")
PREFIX_QUERIES = ("inferd_prefix_cache_query_tokens_total", "vllm:prefix_cache_queries_total")
PROMPT_TOKENS = ("inferd_prompt_tokens_total", "vllm:prompt_tokens_total")
GENERATION_TOKENS = ("inferd_generation_tokens_total", "vllm:generation_tokens_total")
REQUESTS = ("inferd_requests_total", "vllm:request_success_total")
PREEMPTIONS = ("inferd_preemptions_total", "vllm:num_preemptions_total")

Samples = dict[str, float]


# scraping

def parse_metrics(text: str) -> Samples:
    """Prometheus text as {'name{k="v"}': value}, labels sorted; model_name and replica labels summed over."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items())
                              if k not in ("model_name", "replica"))
            key = f"{s.name}{{{labels}}}" if labels else s.name
            samples[key] = samples.get(key, 0.0) + s.value
    return samples


async def scrape(client: httpx.AsyncClient, url: str) -> Samples | None:
    """The server's metrics now, or None when it has no Prometheus endpoint."""
    try:
        response = await client.get(url, timeout=10)
    except httpx.HTTPError:
        return None
    return parse_metrics(response.text) if response.status_code == 200 else None


def first(samples: Samples, names: tuple[str, ...]) -> float | None:
    return next((samples[n] for n in names if n in samples), None)


# gauges during the run

@dataclass(slots=True)
class GaugePoint:
    t_s: float
    running: float | None
    waiting: float | None
    kv_usage_ratio: float | None


def gauge_point(samples: Samples, t_s: float) -> GaugePoint:
    ratio = first(samples, KV_RATIO)
    used, total = samples.get(KV_USED), samples.get(KV_TOTAL)
    if ratio is None and used is not None and total:
        ratio = used / total
    return GaugePoint(t_s, first(samples, RUNNING), first(samples, WAITING), ratio)


@dataclass(slots=True)
class GaugePoller:
    """Polls queue depth and KV usage every interval_s while the run lasts."""
    client: httpx.AsyncClient
    url: str
    start_s: float
    interval_s: float = 1.0
    points: list[GaugePoint] = field(default_factory=list)

    async def run(self) -> None:
        while True:
            samples = await scrape(self.client, self.url)
            if samples is not None:
                self.points.append(gauge_point(samples, time.perf_counter() - self.start_s))
            await asyncio.sleep(self.interval_s)


async def wait_idle(client: httpx.AsyncClient, url: str, timeout_s: float = 30.0) -> None:
    """Waits until the server reports nothing running or waiting (cancelled streams end asynchronously)."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        samples = await scrape(client, url)
        if samples is None or not (first(samples, RUNNING) or first(samples, WAITING)):
            return
        await asyncio.sleep(0.2)


# the server's view of the run

def delta(before: Samples, after: Samples, names: tuple[str, ...]) -> float | None:
    name = next((n for n in names if n in after), None)
    return None if name is None else after[name] - before.get(name, 0.0)


def labelled_deltas(before: Samples, after: Samples, names: tuple[str, ...], label: str) -> dict[str, float]:
    out = {}
    for key, value in after.items():
        if key.split("{")[0] in names and f'{label}="' in key:
            name = key.split(f'{label}="')[1].split('"')[0]
            out[name] = out.get(name, 0.0) + value - before.get(key, 0.0)
    return {k: v for k, v in out.items() if v}


def histogram_quantile(q: float, before: Samples, after: Samples, name: str) -> float | None:
    """Prometheus' histogram_quantile over the run's bucket deltas (linear within a bucket)."""
    buckets = sorted((float(k.split('le="')[1].rstrip('"}')), v - before.get(k, 0.0))
                     for k, v in after.items() if k.startswith(f"{name}_bucket{{"))
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, lower, below = q * buckets[-1][1], 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(cumulative - below, 1e-12)
        lower, below = upper, cumulative
    return lower


def queue_time(before: Samples, after: Samples) -> dict | None:
    name = next((n for n in QUEUE_TIME if f"{n}_count" in after), None)
    if name is None:
        return None
    count = after[f"{name}_count"] - before.get(f"{name}_count", 0.0)
    total = after[f"{name}_sum"] - before.get(f"{name}_sum", 0.0)
    p95 = histogram_quantile(0.95, before, after, name)
    return {"count": int(count), "mean_ms": total / count * 1e3 if count else None,
            "p95_ms_from_buckets": None if p95 is None else p95 * 1e3}


def server_view(before: Samples | None, after: Samples | None, points: list[GaugePoint]) -> dict | None:
    if before is None or after is None:
        return None
    hits, queries = delta(before, after, PREFIX_HITS), delta(before, after, PREFIX_QUERIES)
    kv = [p.kv_usage_ratio for p in points if p.kv_usage_ratio is not None]
    waiting = [p.waiting for p in points if p.waiting is not None]
    reasons = (labelled_deltas(before, after, REQUESTS, "finish_reason")
               or labelled_deltas(before, after, REQUESTS, "finished_reason"))
    return {"requests_by_finish_reason": reasons,
            "prompt_tokens": delta(before, after, PROMPT_TOKENS),
            "generation_tokens": delta(before, after, GENERATION_TOKENS),
            "preemptions": delta(before, after, PREEMPTIONS),
            "queue_time": queue_time(before, after),
            "kv_cache_usage_peak_ratio": max(kv) if kv else None,
            "waiting_peak": max(waiting) if waiting else None,
            "prefix_cache_hit_ratio": hits / queries if hits is not None and queries else None,
            "gauges": [[p.t_s, p.running, p.waiting, p.kv_usage_ratio] for p in points]}
