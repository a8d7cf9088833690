"""The same reservations as limits.MemoryLimiter, shared by every gateway through one Redis.

Each reserve and settle is one Lua script, so it is atomic across gateways; time is Redis' clock.
"""
import time

from redis.asyncio import Redis

from inferd.gateway.limits import (CONCURRENCY_LEASE_S, BucketState, Charge, RateLimited, Reservation,
                                   after_reserve, new_reservation_id, retry_after_s)

PREFIX = "inferd:limit:"

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
        self.redis = Redis.from_url(url)
        self._reserve = self.redis.register_script(RESERVE)
        self._settle = self.redis.register_script(SETTLE)

    async def check(self, charges: list[Charge]) -> None:
        await self._run_reserve(charges, dry=True)

    async def reserve(self, charges: list[Charge]) -> Reservation:
        return await self._run_reserve(charges, dry=False)

    async def _run_reserve(self, charges: list[Charge], dry: bool) -> Reservation:
        """The reserve script; dry: only whether it would fit (raises as reserve would), nothing taken."""
        rid = new_reservation_id()
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

    async def settle(self, reservation: Reservation, actual: dict[str, float]) -> None:
        args: list = [reservation.id]
        for c in reservation.charges:
            used = actual.get(c.key, c.amount)
            delta = c.amount - used if c.kind == "rate" else used - c.amount
            args += [c.kind, repr(float(c.limit)), repr(float(delta))]
        await self._settle(keys=[PREFIX + c.key for c in reservation.charges], args=args)

    async def close(self) -> None:
        await self.redis.aclose()
