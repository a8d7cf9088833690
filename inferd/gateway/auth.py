"""API key authentication with a short-lived cache, so revocation reaches every gateway within a second.

The keys used in the last WARM_S are read again in the background, all in one query, every half TTL: a key
in use never waits for a store read (a burst after a quiet second waited for one, the read's thread starved of
the GIL by the burst itself: benchmarks/README.md), and its revocation still takes effect within the TTL.

A key id the store does not have is cached as absent for the same TTL, so repeating an unknown key costs one
store read per TTL. Random keys are each new, so failed authentications are also limited per client
address (a token bucket): an address past its allowance is answered 429 at once, without a store read,
unless its key is one the cache already holds as valid (good clients behind the same address keep working).

While the store cannot be read: a key this gateway has seen valid keeps working (fail open, for at most
STALE_KEY_MAX_S; a revocation made meanwhile takes effect when the store answers again); any other key is
refused 503 `store_unavailable` (fail closed), and for STORE_RETRY_S after a failed read the store is not
tried again, so a flood of unknown keys during an outage costs no connection attempts.
"""
import asyncio
import logging
import time
from collections import OrderedDict

from inferd.gateway.keys import hash_matches, identified
from inferd.gateway.limits import retry_after_header
from inferd.gateway.oidc import TokenKeys, looks_like_token
from inferd.gateway.policy import KeyPolicy
from inferd.gateway.store import UNAVAILABLE, Store
from inferd.protocol.errors import AuthenticationFailed, RateLimitExceeded, ServiceUnavailable

log = logging.getLogger(__name__)

MAX_CACHED_KEYS = 10_000
AUTH_FAILURE_BURST = 20  # failed authentications an address may make at once
AUTH_FAILURES_PER_S = 1.0  # and then this many a second
MAX_TRACKED_ADDRESSES = 10_000  # beyond, the least recently failed address is forgotten
STALE_KEY_MAX_S = 3600.0  # a valid key's cached entry serves this long past its TTL while the store is down
STORE_RETRY_S = 1.0  # after a failed store read, keys not cached are refused this long without a read
WARM_S = 600.0  # a valid key used within this long is kept fresh in the background
MAX_WARM_KEYS = 2_000  # at most this many, the most recently used


class FailedAuthentications:
    """Per client address: a bucket of AUTH_FAILURE_BURST failures refilled at AUTH_FAILURES_PER_S."""

    def __init__(self, burst: float = AUTH_FAILURE_BURST, per_s: float = AUTH_FAILURES_PER_S,
                 max_addresses: int = MAX_TRACKED_ADDRESSES, clock=time.monotonic):
        self.burst, self.per_s, self.max_addresses, self._clock = burst, per_s, max_addresses, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # address: (level, at)

    @property
    def tracked(self) -> int:
        return len(self._buckets)

    def retry_after_s(self, address: str) -> float:
        """0.0 if the address may try; else seconds until it may again."""
        level = self._level(address)
        return 0.0 if level >= 1.0 else (1.0 - level) / self.per_s

    def failed(self, address: str) -> None:
        self._buckets[address] = (self._level(address) - 1.0, self._clock())
        self._buckets.move_to_end(address)
        if len(self._buckets) > self.max_addresses:
            self._buckets.popitem(last=False)

    def _level(self, address: str) -> float:
        level, at = self._buckets.get(address, (self.burst, 0.0))
        return min(self.burst, level + (self._clock() - at) * self.per_s)


def authorization(request) -> str | None:
    """The request's credentials as an Authorization header value: that header, else Anthropic's x-api-key."""
    if (value := request.headers.get("authorization")) is not None:
        return value
    key = request.headers.get("x-api-key")
    return None if key is None else f"Bearer {key}"


def client_address(request) -> str | None:
    """The peer's address (behind a proxy every client is the proxy's address: they share one allowance)."""
    return request.client.host if request.client else None


class KeyCache:
    def __init__(self, store: Store, ttl_s: float):
        self.store = store
        self.ttl_s = ttl_s
        self.failures = FailedAuthentications()
        self.store_reads = 0
        self.store_failures = 0  # reads that failed because the store could not be reached
        self._store_down_until = 0.0  # time.monotonic() before which the store is not read
        self._cache: dict[str, tuple[float, tuple[KeyPolicy, str] | None]] = {}
        self._loading: dict[str, asyncio.Future] = {}
        self._used: dict[str, float] = {}  # lookup id of a valid key: when it last authenticated
        self._warmer: asyncio.Task | None = None
        self.tokens: TokenKeys | None = None  # an identity provider's access tokens too (gateway/oidc.py)

    def start(self) -> None:
        self._warmer = asyncio.get_running_loop().create_task(self._keep_warm())

    async def close(self) -> None:
        if self._warmer is not None:
            self._warmer.cancel()
            await asyncio.gather(self._warmer, return_exceptions=True)

    async def authenticate(self, authorization: str | None, client: str | None = None) -> KeyPolicy:
        """The key's policy; client (the peer's address) is charged for a failure and refused past its allowance."""
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip()
        if self.tokens is not None and looks_like_token(key) and scheme.lower() == "bearer":
            return self.tokens.cached(key) or await self._token(key, client)
        lookup, hashed = identified(key) if scheme.lower() == "bearer" and key else (None, "")
        cached = self._cached(lookup) if lookup else None
        if cached is not None and hash_matches(hashed, cached[1]):
            self._used[lookup] = time.monotonic()
            return cached[0]
        self._check_failures(client)
        if lookup is None:
            self._failed(client)
            raise AuthenticationFailed("Missing API key: send it as 'Authorization: Bearer <key>'.")
        found = await self._find(lookup)
        if found is None or not hash_matches(hashed, found[1]):
            self._failed(client)
            raise AuthenticationFailed("Incorrect API key provided.")
        self._used[lookup] = time.monotonic()
        return found[0]

    async def _token(self, token: str, client: str | None) -> KeyPolicy:
        self._check_failures(client)
        try:
            return await self.tokens.authenticate(token)
        except AuthenticationFailed:
            self._failed(client)
            raise

    def _check_failures(self, client: str | None) -> None:
        if client is not None and (wait_s := self.failures.retry_after_s(client)):
            raise RateLimitExceeded(f"Too many failed authentications from {client}; retry after {wait_s:.1f} s.",
                                    code="too_many_failed_authentications",
                                    headers={"retry-after": retry_after_header(wait_s)})

    def _failed(self, client: str | None) -> None:
        if client is not None:
            self.failures.failed(client)

    def _cached(self, lookup: str) -> tuple[KeyPolicy, str] | None:
        cached = self._cache.get(lookup)
        return cached[1] if cached is not None and cached[0] > time.monotonic() else None

    async def _find(self, lookup: str) -> tuple[KeyPolicy, str] | None:
        cached = self._cache.get(lookup)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        if time.monotonic() < self._store_down_until:
            return self._stale(lookup)
        if lookup not in self._loading:  # one store read per key however many requests wait for it
            self._loading[lookup] = asyncio.ensure_future(self._load(lookup))
        return await asyncio.shield(self._loading[lookup])

    async def _read(self, read, arg):
        """read(arg) in a thread, counted; after a failed one the store is not tried for STORE_RETRY_S."""
        self.store_reads += 1
        try:
            return await asyncio.to_thread(read, arg)
        except UNAVAILABLE:
            self.store_failures += 1
            self._store_down_until = time.monotonic() + STORE_RETRY_S
            raise

    async def _load(self, lookup: str) -> tuple[KeyPolicy, str] | None:
        try:
            found = await self._read(self.store.find_key, lookup)
        except UNAVAILABLE:
            return self._stale(lookup)
        finally:
            del self._loading[lookup]
        if len(self._cache) >= MAX_CACHED_KEYS:
            self._evict_expired()
        self._cache[lookup] = (time.monotonic() + self.ttl_s, found)
        return found

    async def _keep_warm(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 2)
            now = time.monotonic()
            for lookup in [k for k, at in self._used.items() if now - at > WARM_S]:
                del self._used[lookup]
            if len(self._used) > MAX_WARM_KEYS:
                self._used = dict(sorted(self._used.items(), key=lambda kv: kv[1])[-MAX_WARM_KEYS:])
            if not self._used or now < self._store_down_until:
                continue
            lookups = list(self._used)
            try:
                found = await self._read(self.store.find_keys, lookups)
            except UNAVAILABLE:
                continue
            except Exception:  # the entries then expire as they would without this task
                log.exception("reading the keys in use again failed")
                continue
            for lookup in lookups:  # valid until a TTL after the read began: what the store said then
                self._cache[lookup] = (now + self.ttl_s, found.get(lookup))
                if lookup not in found:  # revoked: no longer kept
                    self._used.pop(lookup, None)

    def _stale(self, lookup: str) -> tuple[KeyPolicy, str]:
        """While the store is down: the key's last valid entry, else 503 (an unknown key is never let in)."""
        cached = self._cache.get(lookup)
        if cached is not None and cached[1] is not None and time.monotonic() - cached[0] < STALE_KEY_MAX_S:
            return cached[1]
        raise ServiceUnavailable("The key store is unavailable and this gateway has not seen this key yet; "
                                 "retry shortly.", code="store_unavailable", headers={"retry-after": "1"})

    def _evict_expired(self) -> None:
        now = time.monotonic()
        for k in [k for k, (exp, _) in self._cache.items() if exp <= now] or list(self._cache)[:1000]:
            del self._cache[k]
