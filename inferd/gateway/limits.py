"""Reservations against rate limits, concurrency and budgets: all-or-nothing, taken before work, settled after.

Rate limits are token buckets (capacity = the per-minute limit, refilled continuously), so a burst can use
the whole minute's allowance but never more. Admission reserves the worst case (prompt + max output
tokens, and its cost); settling refunds what was not used, so concurrent requests can never overspend
by counting after the fact.
"""
import math
import time
from dataclasses import dataclass, field
from typing import Protocol

from inferd.protocol.ids import new_id

CONCURRENCY_LEASE_S = 900.0  # a concurrency slot a crashed gateway never released expires after this


@dataclass(slots=True, frozen=True)
class Charge:
    key: str  # bucket id, e.g. "ten_x:tpm"
    kind: str  # "rate" | "concurrency" | "budget"
    name: str  # the limit, as clients see it in error codes: requests_per_minute, tokens_per_minute, ...
    scope: str  # tenant | key | model
    limit: float  # per minute (rate), slots (concurrency), USD per period (budget)
    amount: float
    period_end_unix_s: float = 0.0  # budget: when the period's counter stops counting
    initial: float = 0.0  # budget: spend already on record when the counter is first created


@dataclass(slots=True)
class BucketState:
    charge: Charge
    remaining: float
    reset_s: float  # until the bucket is full again (rate) or the period ends (budget)


@dataclass(slots=True)
class Reservation:
    id: str
    charges: list[Charge]
    states: list[BucketState] = field(default_factory=list)


class RateLimited(Exception):
    """A limit would be exceeded; nothing was reserved."""

    def __init__(self, charge: Charge, retry_after_s: float | None, states: list[BucketState]):
        super().__init__(charge.name)
        self.charge = charge
        self.retry_after_s = retry_after_s  # None: this request can never fit this limit
        self.states = states


class Limiter(Protocol):
    leases_held: int  # concurrency leases this gateway holds (reserved, not yet settled): 0 once load stops

    async def check(self, charges: list[Charge]) -> None: ...  # raises RateLimited as reserve would; takes nothing
    async def reserve(self, charges: list[Charge]) -> Reservation: ...
    async def settle(self, reservation: Reservation, actual: dict[str, float]) -> None: ...
    async def close(self) -> None: ...


def new_reservation_id() -> str:
    return new_id()


# in-process limiter (one gateway)

@dataclass(slots=True)
class _Bucket:
    level: float
    t: float


class MemoryLimiter:
    """Exact and atomic within one process (the asyncio loop never interleaves a reserve)."""

    def __init__(self, clock=time.monotonic, wall_clock=time.time):
        self._clock, self._wall = clock, wall_clock
        self._buckets: dict[str, _Bucket] = {}
        self._leases: dict[str, set[str]] = {}
        self._spent: dict[str, float] = {}

    @property
    def leases_held(self) -> int:
        return sum(len(held) for held in self._leases.values())

    async def check(self, charges: list[Charge]) -> None:
        self._fits(charges)

    async def reserve(self, charges: list[Charge]) -> Reservation:
        rid = new_reservation_id()
        states = self._fits(charges)
        for c in charges:
            self._apply(c, rid)
        return Reservation(rid, charges, after_reserve(states))

    def _fits(self, charges: list[Charge]) -> list[BucketState]:
        states = [self._state(c) for c in charges]
        for c, s in zip(charges, states):
            retry = retry_after_s(c, s, self._wall())
            if retry != 0.0:
                raise RateLimited(c, retry, states)
        return states

    async def settle(self, reservation: Reservation, actual: dict[str, float]) -> None:
        for c in reservation.charges:
            used = actual.get(c.key, c.amount)
            if c.kind == "rate":
                b = self._bucket(c)
                b.level = min(b.level + c.amount - used, c.limit)
            elif c.kind == "budget":
                self._spent[c.key] = self._spent.get(c.key, c.initial) + used - c.amount
            else:
                self._leases.get(c.key, set()).discard(reservation.id)

    async def close(self) -> None:
        pass

    def _bucket(self, c: Charge) -> _Bucket:
        now = self._clock()
        b = self._buckets.setdefault(c.key, _Bucket(c.limit, now))
        b.level = min(c.limit, b.level + (now - b.t) * c.limit / 60.0)
        b.t = now
        return b

    def _state(self, c: Charge) -> BucketState:
        if c.kind == "rate":
            level = self._bucket(c).level
            return BucketState(c, level, (c.limit - level) * 60.0 / c.limit)
        if c.kind == "budget":
            spent = self._spent.setdefault(c.key, c.initial)
            return BucketState(c, c.limit - spent, max(c.period_end_unix_s - self._wall(), 0.0))
        return BucketState(c, c.limit - len(self._leases.get(c.key, ())), 0.0)

    def _apply(self, c: Charge, rid: str) -> None:
        if c.kind == "rate":
            self._buckets[c.key].level -= c.amount
        elif c.kind == "budget":
            self._spent[c.key] += c.amount
        else:
            self._leases.setdefault(c.key, set()).add(rid)


def retry_after_s(c: Charge, s: BucketState, now_unix_s: float) -> float | None:
    """0.0 when the charge fits now; else seconds until it could, None if it never can."""
    if c.amount <= s.remaining + 1e-9:
        return 0.0
    if c.amount > c.limit:
        return None
    if c.kind == "rate":
        return (c.amount - s.remaining) * 60.0 / c.limit
    if c.kind == "budget":
        return max(c.period_end_unix_s - now_unix_s, 1.0)
    return 1.0


def after_reserve(states: list[BucketState]) -> list[BucketState]:
    for s in states:
        s.remaining = max(s.remaining - s.charge.amount, 0.0)
        if s.charge.kind == "rate":
            s.reset_s = (s.charge.limit - s.remaining) * 60.0 / s.charge.limit
    return states


# response headers (OpenAI's names)

def ratelimit_headers(states: list[BucketState]) -> dict[str, str]:
    """x-ratelimit-* for the tightest requests-per-minute and tokens-per-minute buckets."""
    headers = {}
    for name, suffix in (("requests_per_minute", "requests"), ("tokens_per_minute", "tokens")):
        tight = [s for s in states if s.charge.name == name]
        if tight:
            s = min(tight, key=lambda s: s.remaining)
            headers[f"x-ratelimit-limit-{suffix}"] = str(int(s.charge.limit))
            headers[f"x-ratelimit-remaining-{suffix}"] = str(max(int(s.remaining), 0))
            headers[f"x-ratelimit-reset-{suffix}"] = f"{s.reset_s:.3f}s"
    return headers


def retry_after_header(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))
