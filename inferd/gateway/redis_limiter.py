"""The same reservations as limits.MemoryLimiter, shared by every gateway through one Redis.

Each reserve and settle is one Lua script, so it is atomic across gateways; time is Redis' clock.

While Redis cannot be reached (a call fails or takes over REDIS_TIMEOUT_S), the gateway keeps serving: it
checks and reserves against its own in-process limiter (the same limits, counted by this gateway alone, so
N gateways may let a tenant have up to N times its rates and concurrency for the outage) and tries Redis
again after LOCAL_RETRY_S. A Redis reservation whose settle failed waits in memory and is settled in Redis
before anything else once it answers (tried again every LOCAL_RETRY_S, also when no request comes to do it),
so no concurrency lease stays taken for CONCURRENCY_LEASE_S. So is the lease of a reserve whose call failed: the
script may have run before the answer was lost (Redis stopping mid-call), and removing a lease that was never taken
does nothing.
"""
import asyncio
import logging
import time
from collections import deque
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from inferd.gateway.limits import (CONCURRENCY_LEASE_S, BucketState, Charge, MemoryLimiter, RateLimited,
                                   Reservation, after_reserve, new_reservation_id, retry_after_s)

log = logging.getLogger(__name__)

PREFIX = "inferd:limit:"
REDIS_TIMEOUT_S = 2.0  # a Redis call slower than this counts as Redis being down
LOCAL_RETRY_S = 1.0  # after a failed call, limits are counted in process this long before Redis is tried again
MAX_UNSETTLED = 100_000  # Redis reservations waiting to be settled; beyond, the oldest are left to their leases
DOWN = (RedisConnectionError, RedisTimeoutError)

RESERVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rid, lease, dry = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1'
local out, levels, fail = {}, {}, 0
for i = 1, #KEYS do
  local a = 3 + (i - 1) * 5
  local kind, limit, amount = ARGV[a + 1], tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local remaining, reset
  if kind == 'rate' then
    local b = redis.call('HMGET', KEYS[i], 'level', 't')
    local level = tonumber(b[1]) or limit
    local ts = tonumber(b[2]) or now
    level = math.min(limit, level + math.max(now - ts, 0) * limit / 60)
    levels[i] = level
    remaining, reset = level, (limit - level) * 60 / limit
  elseif kind == 'budget' then
    local period_end = tonumber(ARGV[a + 4])
    redis.call('SET', KEYS[i], ARGV[a + 5], 'NX', 'EXAT', math.ceil(period_end) + 86400)
    remaining, reset = limit - tonumber(redis.call('GET', KEYS[i])), math.max(period_end - now, 0)
  else
    redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
    remaining, reset = limit - redis.call('ZCARD', KEYS[i]), 0
  end
  out[#out + 1] = tostring(remaining)
  out[#out + 1] = tostring(reset)
  if fail == 0 and amount > remaining + 1e-9 then fail = i end
end
if fail == 0 and not dry then
  for i = 1, #KEYS do
    local a = 3 + (i - 1) * 5
    local kind, amount = ARGV[a + 1], tonumber(ARGV[a + 3])
    if kind == 'rate' then
      redis.call('HSET', KEYS[i], 'level', tostring(levels[i] - amount), 't', tostring(now))
      redis.call('EXPIRE', KEYS[i], 3600)
    elseif kind == 'budget' then
      redis.call('INCRBYFLOAT', KEYS[i], ARGV[a + 3])
    else
      redis.call('ZADD', KEYS[i], now + lease, rid)
      redis.call('EXPIRE', KEYS[i], math.ceil(lease))
    end
  end
end
table.insert(out, 1, tostring(fail))
return out
"""

SETTLE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rid = ARGV[1]
for i = 1, #KEYS do
  local a = 1 + (i - 1) * 3
  local kind, limit, delta = ARGV[a + 1], tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  if kind == 'rate' then
    local b = redis.call('HMGET', KEYS[i], 'level', 't')
    local level = tonumber(b[1]) or limit
    local ts = tonumber(b[2]) or now
    level = math.min(limit, level + math.max(now - ts, 0) * limit / 60 + delta)
    redis.call('HSET', KEYS[i], 'level', tostring(level), 't', tostring(now))
  elseif kind == 'budget' then
    if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('INCRBYFLOAT', KEYS[i], tostring(delta)) end
  else
    redis.call('ZREM', KEYS[i], rid)
  end
end
return 1
"""


class RedisLimiter:
    def __init__(self, url: str):
        # a pooled connection that Redis closed while it was away fails once: tried again on a new one
        self.redis = Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S,
                                    retry=Retry(NoBackoff(), 1, (RedisConnectionError,)))
        self._reserve = self.redis.register_script(RESERVE)
        self._settle = self.redis.register_script(SETTLE)
        self.local = MemoryLimiter()  # while Redis is down
        self._local_ids: set[str] = set()  # reservations the local limiter holds
        self._unsettled: deque[tuple[Reservation, dict[str, float]]] = deque()
        self._down_until = 0.0  # time.monotonic() before which Redis is not tried
        self._outage = False
        self.failures = 0  # calls that found Redis down
        self._leasing: set[str] = set()  # Redis reservations with a concurrency charge, not yet settled there
        self._retrying: asyncio.Task | None = None  # settles what waits once Redis may be tried again

    @property
    def leases_held(self) -> int:
        return len(self._leasing) + self.local.leases_held

    @property
    def shared(self) -> bool:
        """Whether limits are counted in Redis (False: by this gateway alone, during an outage)."""
        return not self._outage

    async def check(self, charges: list[Charge]) -> None:
        ok, _ = await self._shared(self._run_reserve, charges, True, new_reservation_id())
        if not ok:
            await self.local.check(charges)

    async def reserve(self, charges: list[Charge]) -> Reservation:
        rid, tried = new_reservation_id(), time.monotonic() >= self._down_until
        ok, reservation = await self._shared(self._run_reserve, charges, False, rid)
        if not ok:
            leases = [c for c in charges if c.kind == "concurrency"]
            if tried and leases:  # the script may have run and its answer been lost: its lease, if taken, is
                self._wait_for_redis(Reservation(rid, leases), {})  # released when Redis answers (rates untouched)
            reservation = await self.local.reserve(charges)
            self._local_ids.add(reservation.id)
        elif any(c.kind == "concurrency" for c in charges):
            self._leasing.add(reservation.id)
        return reservation

    async def settle(self, reservation: Reservation, actual: dict[str, float]) -> None:
        if reservation.id in self._local_ids:
            self._local_ids.discard(reservation.id)
            await self.local.settle(reservation, actual)
            return
        ok, _ = await self._shared(self._run_settle, reservation, actual)
        if not ok:
            self._wait_for_redis(reservation, actual)

    def _wait_for_redis(self, reservation: Reservation, actual: dict[str, float], first: bool = False) -> None:
        """A settle to run in Redis before anything else once it answers (first: before the others waiting)."""
        if len(self._unsettled) == MAX_UNSETTLED:  # the oldest is left to its lease's expiry
            self._leasing.discard(self._unsettled.popleft()[0].id)
        if first:
            self._unsettled.appendleft((reservation, actual))
        else:
            self._unsettled.append((reservation, actual))
        if self._retrying is None or self._retrying.done():
            self._retrying = asyncio.get_running_loop().create_task(self._retry_unsettled())

    async def _retry_unsettled(self) -> None:
        """Until nothing waits and Redis answers: whenever Redis may be tried again, a call that settles what waited
        and pings. (A settle that another call took out and failed comes back through _wait_for_redis, which
        restarts this.) Not only until nothing waits: the settles could pass and the ping after them fail, on a
        pooled connection from before the outage, and no call then told the outage over until the next request
        (seen once in CI: the outage test's `shared` still False, no lease held)."""
        while self._unsettled or self._outage:
            await asyncio.sleep(max(self._down_until - time.monotonic(), 0.0) + 0.05)
            await self._shared(self.redis.ping)

    async def _shared(self, call, *args) -> tuple[bool, Any]:
        """(True, call's result) from Redis; (False, None) if Redis is down (RateLimited passes through)."""
        if time.monotonic() < self._down_until:
            return False, None
        try:
            await self._settle_waiting()
            result = await call(*args)
        except DOWN as exc:
            self.failures += 1
            self._down_until = time.monotonic() + LOCAL_RETRY_S
            if not self._outage:
                self._outage = True
                log.error("Redis unavailable (%s): rate limits and concurrency are counted by this gateway alone "
                          "until it answers", type(exc).__name__)
            return False, None
        except RateLimited:
            self._answered()
            raise
        self._answered()
        return True, result

    async def _settle_waiting(self) -> None:
        """What waited for Redis goes first (each taken out before its await: concurrent callers share the work)."""
        while self._unsettled:
            waiting = self._unsettled.popleft()
            try:
                await self._run_settle(*waiting)
            except BaseException:  # Redis away, or this call cancelled: it waits again, first
                self._wait_for_redis(*waiting, first=True)
                raise

    def _answered(self) -> None:
        if self._outage:
            self._outage = False
            log.warning("Redis answers again: rate limits and concurrency are shared between gateways again")

    async def _run_reserve(self, charges: list[Charge], dry: bool, rid: str) -> Reservation:
        """The reserve script; dry: only whether it would fit (raises as reserve would), nothing taken."""
        args: list = [rid, CONCURRENCY_LEASE_S, "1" if dry else "0"]
        for c in charges:
            args += [c.kind, repr(float(c.limit)), repr(float(c.amount)), repr(c.period_end_unix_s), repr(c.initial)]
        raw = await self._reserve(keys=[PREFIX + c.key for c in charges], args=args)
        fail = int(raw[0])
        states = [BucketState(c, float(raw[1 + 2 * i]), float(raw[2 + 2 * i])) for i, c in enumerate(charges)]
        if fail:
            c = charges[fail - 1]
            raise RateLimited(c, retry_after_s(c, states[fail - 1], time.time()), states)
        return Reservation(rid, charges, after_reserve(states))

    async def _run_settle(self, reservation: Reservation, actual: dict[str, float]) -> None:
        args: list = [reservation.id]
        for c in reservation.charges:
            used = actual.get(c.key, c.amount)
            delta = c.amount - used if c.kind == "rate" else used - c.amount
            args += [c.kind, repr(float(c.limit)), repr(float(delta))]
        await self._settle(keys=[PREFIX + c.key for c in reservation.charges], args=args)
        self._leasing.discard(reservation.id)

    async def close(self) -> None:
        if self._retrying is not None:
            self._retrying.cancel()
        await self.redis.aclose()

