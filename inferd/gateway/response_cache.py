"""The exact-match response cache: a deployment's whole answers kept by the hash of everything they depend on.

A request is cached only if its answer is a function of it: an embedding, or a text request at temperature 0
or with a seed, with no tools unless the deployment says its tools are pure (`tools: true`). Its key hashes
the tenant, the deployment's name, version and digests (weights, tokenizer, template), the operation and the
request as it goes to the replica (after the gateway's own changes, such as a degraded max_tokens), less what
only shapes its delivery (`stream`, `stream_options`, `user`, `cache`). So nothing is ever shared across
tenants, and a new version or new weights start empty. A request may bypass it with `"cache": false`.

What is kept is the replica's unary answer as it came (the stream of a streamed request is not kept); a hit
is answered from it, unary or replayed as a stream, with a new id. The lifecycle still checks the key, the
access list and the rate limits of a hit; its usage record says `cache_hit` and costs nothing.

One store a deployment: in the gateway's memory (least recently used out past `max_bytes`, none older than
`ttl_s`), or in Redis where the gateways share their limits there (each answer expires after `ttl_s`; one
larger than `max_bytes` is not kept; the whole is bounded by Redis's own maxmemory and eviction policy).
A Redis that does not answer is a miss, never an error."""
import hashlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from inferd.protocol.ids import new_id

DELIVERY_FIELDS = ("stream", "stream_options", "user", "cache")  # they shape how an answer is sent, not what it is
HIT, MISS, BYPASS, UNCACHEABLE = "hit", "miss", "bypass", "uncacheable"  # the x-inferd-cache header
REDIS_PREFIX = "inferd:response:"
REDIS_TIMEOUT_S = 0.05  # a cache that is slow to answer is worth less than the model

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ResponseCacheConfig:
    ttl_s: float = 300.0
    max_bytes: int = 64 * 1024 * 1024
    tools: bool = False  # requests with tools may be cached: calling them has no side effect the answer hides


class ResponseCache:
    def __init__(self, config: ResponseCacheConfig, clock=time.monotonic, redis_url: str | None = None):
        self.config = config
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # key -> (expires, answer)
        self.redis = Redis.from_url(redis_url, socket_timeout=REDIS_TIMEOUT_S,
                                    socket_connect_timeout=REDIS_TIMEOUT_S) if redis_url else None
        self.bytes = 0  # in this gateway's memory
        self.failures = 0  # Redis calls that failed (the first is logged)

    def verdict(self, op: str, raw: dict) -> str:
        """MISS if the request may be answered from the cache (and fill it), else BYPASS or UNCACHEABLE."""
        if raw.get("cache") is False:
            return BYPASS
        if op == "embeddings":
            return MISS
        if raw.get("tools") and not self.config.tools:
            return UNCACHEABLE
        return MISS if raw.get("temperature") == 0 or raw.get("seed") is not None else UNCACHEABLE

    async def get(self, key: str) -> bytes | None:
        if self.redis is not None:
            try:
                found = await self.redis.get(REDIS_PREFIX + key)
            except (RedisError, OSError) as exc:
                self._failed(exc)
                found = None
            return found
        entry = self._entries.get(key)
        if entry is not None and entry[0] <= self._clock():
            self._drop(key)
            entry = None
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[1]

    async def put(self, key: str, answer: bytes) -> None:
        if len(answer) > self.config.max_bytes:
            return
        if self.redis is not None:
            try:
                await self.redis.set(REDIS_PREFIX + key, answer, px=max(int(self.config.ttl_s * 1000), 1))
            except (RedisError, OSError) as exc:
                self._failed(exc)
            return
        if key in self._entries:
            self._drop(key)
        self._entries[key] = (self._clock() + self.config.ttl_s, answer)
        self.bytes += len(answer)
        while self.bytes > self.config.max_bytes:
            self._drop(next(iter(self._entries)))

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()

    def __len__(self) -> int:
        return len(self._entries)

    def _failed(self, exc: BaseException) -> None:
        if not self.failures:
            log.warning("the response cache's Redis did not answer (%s); requests go to the model", exc)
        self.failures += 1

    def _drop(self, key: str) -> None:
        self.bytes -= len(self._entries.pop(key)[1])


def cache_key(tenant_id: str, deployment: str, version: str, digests: dict | None, op: str, request: dict) -> str:
    """The hash of what the answer depends on (the module's docstring)."""
    sent = {k: v for k, v in request.items() if k not in DELIVERY_FIELDS}
    whole = orjson.dumps([tenant_id, deployment, version, digests or {}, op, sent],
                         option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    return hashlib.sha256(whole).hexdigest()


def renewed(answer: bytes) -> dict:
    """A cached answer, parsed, as a new one: its own id (the same prefix) and creation time."""
    whole = orjson.loads(answer)
    if isinstance(whole.get("id"), str):
        prefix = whole["id"].rpartition("-")[0] or "cmpl"
        whole |= {"id": f"{prefix}-{new_id()}", "created": int(time.time())}
    return whole
