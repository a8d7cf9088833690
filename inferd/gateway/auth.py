"""API key authentication with a short-lived cache, so revocation reaches every gateway within a second."""
import asyncio
import time

from inferd.protocol.errors import AuthenticationFailed
from inferd.gateway.keys import key_matches, lookup_id_of
from inferd.gateway.policy import KeyPolicy
from inferd.gateway.store import Store

MAX_CACHED_KEYS = 10_000


class KeyCache:
    def __init__(self, store: Store, ttl_s: float):
        self.store = store
        self.ttl_s = ttl_s
        self._cache: dict[str, tuple[float, tuple[KeyPolicy, str] | None]] = {}
        self._loading: dict[str, asyncio.Future] = {}

    async def authenticate(self, authorization: str | None) -> KeyPolicy:
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise AuthenticationFailed("Missing API key: send it as 'Authorization: Bearer <key>'.")
        found = await self._find(lookup_id_of(key))
        if found is None or not key_matches(key, found[1]):
            raise AuthenticationFailed("Incorrect API key provided.")
        return found[0]

    async def _find(self, lookup: str) -> tuple[KeyPolicy, str] | None:
        now = time.monotonic()
        cached = self._cache.get(lookup)
        if cached is not None and cached[0] > now:
            return cached[1]
        if lookup not in self._loading:  # one store read per key however many requests wait for it
            self._loading[lookup] = asyncio.ensure_future(self._load(lookup))
        return await asyncio.shield(self._loading[lookup])

    async def _load(self, lookup: str) -> tuple[KeyPolicy, str] | None:
        try:
            found = await asyncio.to_thread(self.store.find_key, lookup)
            if len(self._cache) >= MAX_CACHED_KEYS:
                self._evict_expired()
            self._cache[lookup] = (time.monotonic() + self.ttl_s, found)
            return found
        finally:
            del self._loading[lookup]

    def _evict_expired(self) -> None:
        now = time.monotonic()
        for k in [k for k, (exp, _) in self._cache.items() if exp <= now] or list(self._cache)[:1000]:
            del self._cache[k]
