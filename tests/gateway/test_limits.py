import asyncio
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from inferd.gateway.limits import Charge, MemoryLimiter, RateLimited, ratelimit_headers
from inferd.gateway import redis_limiter
from inferd.gateway.redis_limiter import PREFIX, RedisLimiter
from tests.gateway.services import redis_server


@pytest.fixture(scope="module")
def redis_url():
    with redis_server() as url:
        yield url


@pytest.fixture(params=["memory", "redis"])
def make_limiter(request):
    made = []

    def make():
        limiter = MemoryLimiter() if request.param == "memory" else RedisLimiter(request.getfixturevalue("redis_url"))
        made.append(limiter)
        return limiter
    yield make


def charges(ns: str, tokens: int, cost: float = 0.0, tpm: int = 100, rpm: int = 1000, conc: int = 1000,
            budget: float | None = None) -> list[Charge]:
    out = [Charge(f"{ns}:rpm", "rate", "requests_per_minute", "tenant", rpm, 1),
           Charge(f"{ns}:tpm", "rate", "tokens_per_minute", "tenant", tpm, tokens),
           Charge(f"{ns}:conc", "concurrency", "max_concurrency", "key", conc, 1)]
    if budget is not None:
        out.append(Charge(f"{ns}:budget", "budget", "budget", "tenant", budget, cost, time.time() + 3600, 0.0))
    return out


def ns() -> str:
    return f"t{time.monotonic_ns()}"


async def test_tokens_reserve_then_settle_refunds(make_limiter):
    lim, n = make_limiter(), ns()
    r1 = await lim.reserve(charges(n, 60))
    assert ratelimit_headers(r1.states)["x-ratelimit-remaining-tokens"] == "40"
    with pytest.raises(RateLimited) as e:
        await lim.reserve(charges(n, 60))
    assert e.value.charge.name == "tokens_per_minute" and 10 < e.value.retry_after_s <= 12.1
    await lim.settle(r1, {f"{n}:tpm": 10})  # used 10 of the 60 reserved
    await lim.reserve(charges(n, 60))
    await lim.close()


async def test_a_request_that_can_never_fit_says_so(make_limiter):
    lim = make_limiter()
    with pytest.raises(RateLimited) as e:
        await lim.reserve(charges(ns(), 101))
    assert e.value.retry_after_s is None
    await lim.close()


async def test_all_or_nothing(make_limiter):
    lim, n = make_limiter(), ns()
    await lim.reserve(charges(n, 1, conc=1))
    with pytest.raises(RateLimited) as e:
        await lim.reserve(charges(n, 1, conc=1))
    assert e.value.charge.name == "max_concurrency"
    r = await lim.reserve(charges(n + "x", 0))  # other buckets untouched
    assert ratelimit_headers(r.states)["x-ratelimit-remaining-requests"] == "999"
    await lim.close()


async def test_check_refuses_as_reserve_would_and_takes_nothing(make_limiter):
    lim, n = make_limiter(), ns()
    for _ in range(3):
        await lim.check(charges(n, 0, rpm=2, conc=1))  # three checks leave both limits untouched
    r = await lim.reserve(charges(n, 0, rpm=2, conc=1))
    with pytest.raises(RateLimited) as e:
        await lim.check(charges(n, 0, rpm=2, conc=1))
    assert e.value.charge.name == "max_concurrency" and e.value.retry_after_s == 1.0
    await lim.settle(r, {})
    await lim.check(charges(n, 0, rpm=2, conc=1))
    await lim.reserve(charges(n, 0, rpm=2, conc=1))
    with pytest.raises(RateLimited) as e:
        await lim.check(charges(n, 0, rpm=2, conc=5))
    assert e.value.charge.name == "requests_per_minute"
    await lim.close()


async def test_concurrency_is_released_on_settle(make_limiter):
    lim, n = make_limiter(), ns()
    r = await lim.reserve(charges(n, 1, conc=1))
    await lim.settle(r, {})
    await lim.reserve(charges(n, 1, conc=1))
    await lim.close()


async def test_budget_concurrent_reservations_never_overspend(make_limiter):
    lim, n = make_limiter(), ns()
    results = await asyncio.gather(*(lim.reserve(charges(n, 1, cost=0.3, tpm=10**6, budget=1.0))
                                     for _ in range(20)), return_exceptions=True)
    granted = [r for r in results if not isinstance(r, Exception)]
    assert len(granted) == 3  # 0.9 reserved; a 4th would pass 1.0
    for r in granted:
        await lim.settle(r, {f"{n}:budget": 0.1})  # each really cost 0.1
    more = await asyncio.gather(*(lim.reserve(charges(n, 1, cost=0.3, tpm=10**6, budget=1.0))
                                  for _ in range(20)), return_exceptions=True)
    assert sum(not isinstance(r, Exception) for r in more) == 2  # 0.3 spent, 0.7 left
    await lim.close()


async def test_two_limiters_share_redis(redis_url):
    a, b, n = RedisLimiter(redis_url), RedisLimiter(redis_url), ns()
    await a.reserve(charges(n, 50))
    await b.reserve(charges(n, 50))
    with pytest.raises(RateLimited):
        await a.reserve(charges(n, 50))
    await a.close()
    await b.close()


async def test_a_lease_whose_reserve_answer_was_lost_is_released_when_redis_answers(redis_url):
    """The reserve script ran in Redis but its answer never came back (Redis went away mid-call): the gateway
    counts that request locally, and the lease it may have taken in Redis is removed once Redis answers, not left
    for CONCURRENCY_LEASE_S."""
    lim, n = RedisLimiter(redis_url), ns()
    script = lim._reserve

    async def answer_lost(*args, **kwargs):
        await script(*args, **kwargs)
        raise RedisConnectionError("connection closed before the answer")
    lim._reserve = answer_lost
    local = await lim.reserve(charges(n, 1, conc=1))
    lim._reserve = script
    key = next(c.key for c in local.charges if c.kind == "concurrency")
    assert await lim.redis.zcard(PREFIX + key) == 1  # taken in Redis, unknown to the gateway
    await lim.settle(local, {})
    for _ in range(100):  # Redis is tried again LOCAL_RETRY_S after the failure
        if await lim.redis.zcard(PREFIX + key) == 0:
            break
        await asyncio.sleep(0.05)
    assert await lim.redis.zcard(PREFIX + key) == 0
    r = await lim.reserve(charges(n, 1, conc=1))  # the one slot is free, in Redis
    assert r.id in lim._leasing
    await lim.close()


async def test_a_settle_waiting_for_redis_is_retried_after_a_concurrent_try_of_it_failed(redis_url, monkeypatch):
    """A call takes the waiting settle out of the queue to run it first and fails (Redis still away) while the
    limiter's own retry looks at an empty queue: the settle goes back and is still retried, with no request coming
    to do it, until Redis answers."""
    monkeypatch.setattr(redis_limiter, "LOCAL_RETRY_S", 0.2)
    lim, n = RedisLimiter(redis_url), ns()
    script, away = lim._settle, asyncio.Event()
    away.set()

    async def settle(*args, **kwargs):
        if away.is_set():
            await asyncio.sleep(0.4)  # a call that waits for its timeout
            raise RedisConnectionError("Redis is away")
        return await script(*args, **kwargs)
    lim._settle = settle
    r = await lim.reserve(charges(n, 1, conc=1))
    key = PREFIX + next(c.key for c in r.charges if c.kind == "concurrency")
    await lim.settle(r, {})  # fails: waits for Redis; the limiter retries it every LOCAL_RETRY_S
    lim._down_until = 0.0
    await lim.check(charges(ns(), 1))  # takes the waiting settle first; the limiter's retry runs meanwhile
    away.clear()  # Redis answers again; no call comes
    for _ in range(40):
        if not lim._leasing and await lim.redis.zcard(key) == 0:
            break
        await asyncio.sleep(0.05)
    assert (lim._leasing, await lim.redis.zcard(key)) == (set(), 0)
    await lim.close()
