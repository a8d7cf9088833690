"""Unknown keys cost at most one store read per key id and TTL, and a flood of them from one address is
refused without any store read."""
import secrets

import pytest

from inferd.gateway.auth import AUTH_FAILURE_BURST, FailedAuthentications, KeyCache
from inferd.gateway.store import Store
from inferd.protocol.errors import AuthenticationFailed, RateLimitExceeded


@pytest.fixture
def store_and_key(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    store.migrate()
    store.create_tenant("t")
    _, new = store.create_key("t")
    return store, new.key


def random_key() -> str:
    return "sk-inferd-" + secrets.token_hex(6) + secrets.token_urlsafe(32)


async def test_an_unknown_key_is_read_once_per_ttl(store_and_key):
    store, _ = store_and_key
    keys, unknown = KeyCache(store, ttl_s=60), random_key()
    for _ in range(50):
        with pytest.raises(AuthenticationFailed):
            await keys.authenticate(f"Bearer {unknown}")  # no address: no allowance to spend
    assert keys.store_reads == 1


async def test_a_flood_of_random_keys_from_one_address_stops_reading_the_store(store_and_key):
    store, good = store_and_key
    keys = KeyCache(store, ttl_s=60)
    assert (await keys.authenticate(f"Bearer {good}", "10.0.0.1")).tenant.name == "t"
    refused = []
    for _ in range(1000):
        try:
            await keys.authenticate(f"Bearer {random_key()}", "10.0.0.1")
        except AuthenticationFailed:
            refused.append(401)
        except RateLimitExceeded as exc:
            refused.append((429, exc.code, exc.headers["retry-after"]))
    assert refused[:AUTH_FAILURE_BURST] == [401] * AUTH_FAILURE_BURST
    assert set(refused[AUTH_FAILURE_BURST:]) == {(429, "too_many_failed_authentications", "1")}
    assert keys.store_reads == 1 + AUTH_FAILURE_BURST
    assert (await keys.authenticate(f"Bearer {good}", "10.0.0.1")).tenant.name == "t"  # cached: still served
    with pytest.raises(AuthenticationFailed):
        await keys.authenticate(f"Bearer {random_key()}", "10.0.0.2")  # another address has its own allowance


def test_the_failure_buckets_refill_and_are_bounded():
    now = [0.0]
    failures = FailedAuthentications(burst=2, per_s=1.0, max_addresses=100, clock=lambda: now[0])
    failures.failed("a")
    failures.failed("a")
    assert failures.retry_after_s("a") == 1.0
    now[0] = 0.5
    assert failures.retry_after_s("a") == 0.5
    now[0] = 1.0
    assert failures.retry_after_s("a") == 0.0
    for i in range(1000):
        failures.failed(f"10.0.{i // 256}.{i % 256}")
    assert failures.tracked == 100


async def test_ten_thousand_random_keys_read_the_store_once_per_unknown_id_within_each_address_allowance(
        store_and_key):
    """10,000 random keys from 10 addresses, every third one a key already tried: a known-absent key id is
    answered without a store read, and each address reads the store at most its allowance of times."""
    import random
    import time
    from inferd.gateway.auth import AUTH_FAILURES_PER_S
    store, good = store_and_key
    keys, tried, rng = KeyCache(store, ttl_s=60), [], random.Random(17)
    assert (await keys.authenticate(f"Bearer {good}", "10.0.0.1")).tenant.name == "t"
    started = time.monotonic()
    for i in range(10_000):
        again = i % 3 == 2 and tried
        key, address = rng.choice(tried) if again else random_key(), f"10.0.0.{i % 10}"
        reads = keys.store_reads
        with pytest.raises((AuthenticationFailed, RateLimitExceeded)):
            await keys.authenticate(f"Bearer {key}", address)
        assert not (again and keys.store_reads > reads), "a key id known absent was read again"
        tried.append(key)
    allowance = AUTH_FAILURE_BURST + (time.monotonic() - started) * AUTH_FAILURES_PER_S + 1
    assert keys.store_reads <= 1 + 10 * allowance
    assert (await keys.authenticate(f"Bearer {good}", "10.0.0.1")).tenant.name == "t"  # cached: still served


async def test_a_key_in_use_stays_fresh_without_a_read_at_request_time_and_its_revocation_still_lands(
        store_and_key):
    """The background refresh keeps a used key's entry fresh past many TTLs (no request waits for a read), reads
    all such keys in one query a half TTL, and a revocation refuses the key within about a TTL."""
    import asyncio
    from inferd.gateway.keys import lookup_id_of
    store, good = store_and_key
    _, other = store.create_key("t")
    keys = KeyCache(store, ttl_s=0.2)
    keys.start()
    try:
        for key in (good, other.key):
            assert (await keys.authenticate(f"Bearer {key}")).tenant.name == "t"
        reads = keys.store_reads
        await asyncio.sleep(1.0)  # five TTLs
        assert keys._cached(lookup_id_of(good)) is not None and keys._cached(lookup_id_of(other.key)) is not None
        assert 5 <= keys.store_reads - reads <= 11  # one query per half TTL (0.1 s) for both keys
        assert store.revoke_key(lookup_id_of(good))
        await asyncio.sleep(0.3)  # a TTL and a half
        with pytest.raises(AuthenticationFailed):
            await keys.authenticate(f"Bearer {good}")
        assert (await keys.authenticate(f"Bearer {other.key}")).tenant.name == "t"
    finally:
        await keys.close()
