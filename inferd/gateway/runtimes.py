"""What the gateway says to, and reads from, a replica by the runtime it runs (Deployment.runtime).

inferd's replicas take the x-inferd-* headers and report on /ready. A vLLM replica (started by the control
plane) is told the same things in its own request fields: the tenant as `cache_salt` (prefix-cache entries
are shared only within a tenant), the priority class as `priority` (lower runs first, under vLLM's priority
scheduling), and for streams usage in every chunk (`continuous_usage_stats`: a cancelled stream is billed
for what it got). Its load comes from its Prometheus metrics (vllm:*), mapped onto /ready's keys.
A llama.cpp replica takes none of these (one request at a time, no metrics, no usage in its streams: the
relay counts their chunks).
"""
import httpx

from inferd.gateway.deployments import Deployment, Upstream
from inferd.protocol.headers import PRIORITY_CLASSES

REPORT_TIMEOUT_S = 2.0
VLLM_GAUGES = {"vllm:kv_cache_usage_perc": "kv_cache_usage", "vllm:num_requests_running": "running",
               "vllm:num_requests_waiting": "waiting"}


def stream_options(d: Deployment) -> dict | None:
    """The stream_options an external runtime's stream needs so that the gateway learns its usage."""
    if d.internal_headers:
        return None
    return {"include_usage": True, "continuous_usage_stats": True} if d.runtime == "vllm" else {"include_usage": True}


def has_metrics(d: Deployment) -> bool:
    """Whether the deployment's replicas are the gateway's and serve Prometheus metrics (federated on /metrics)."""
    return d.runtime in ("inferd", "vllm")


def takes_request_id(d: Deployment) -> bool:
    """Whether the replica takes the gateway's request id header (llama.cpp's server answers 400 to an
    x-request-id that is not a UUID)."""
    return d.runtime != "llama.cpp"


def request_fields(d: Deployment, tenant_id: str, priority_class: str) -> dict | None:
    """Body fields that carry the tenant and the class to the runtime (None: it takes them as headers, or not)."""
    if d.runtime != "vllm":
        return None
    return {"cache_salt": tenant_id, "priority": PRIORITY_CLASSES.index(priority_class)}


async def replica_report(client: httpx.AsyncClient, d: Deployment, upstream: Upstream) -> dict | None:
    """What a replica says of itself (inferd: /ready's JSON: kv_cache_usage, cold-start times, ...; vLLM: its
    metrics under the same keys); None if it does not answer."""
    try:
        if d.runtime == "vllm":
            r = await client.get(f"{upstream.base_url}/metrics", timeout=REPORT_TIMEOUT_S)
            return vllm_gauges(r.text) if r.status_code == 200 else None
        if d.internal_headers:
            body = (await client.get(f"{upstream.base_url}/ready", timeout=REPORT_TIMEOUT_S)).json()
            return body if isinstance(body, dict) else None
    except (httpx.HTTPError, ValueError):
        return None
    return None


def vllm_gauges(text: str) -> dict:
    """The gauges of VLLM_GAUGES from a Prometheus text exposition, summed over their label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        key = VLLM_GAUGES.get(name)
        if key is not None:
            try:
                out[key] = out.get(key, 0.0) + float(rest.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return out
