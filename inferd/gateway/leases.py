"""Leases: which gateway runs a piece of durable work (a batch line, a batch's validation or finalizing, an
async job), so that several gateways on one store never run it twice at once.

    claim  → a row whose lease is free (none, or lapsed) becomes this gateway's until now + lease_s
    renew  → the holder pushes its lease on while it works (every lease_s / 3)
    free   → the holder lets go (the work ended, or was handed back)

A gateway that dies stops renewing; another claims the row once the lease has lapsed. Each is one conditional
UPDATE, so two gateways racing for a row cannot both win (PostgreSQL re-reads the row it waited for; SQLite
writes one at a time). A result is still written once whoever holds the lease (the row's own state guards it).
Lease times are each gateway's own clock (unix s): gateways on several machines need clocks that agree to well
within lease_s (NTP does).
"""
import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy import Connection, Engine, Table, or_, update


def free_or_lapsed(table: Table, now: float):
    return or_(table.c.lease_until.is_(None), table.c.lease_until < now)


def claim(engine: Engine | Connection, table: Table, owner: str, lease_s: float, *where) -> bool:
    """The row(s) matching where (and free or lapsed) leased to owner; True if any was."""
    now = time.time()
    statement = (update(table).where(*where, or_(free_or_lapsed(table, now), table.c.lease_owner == owner))
                 .values(lease_owner=owner, lease_until=now + lease_s))
    if isinstance(engine, Connection):
        return engine.execute(statement).rowcount > 0
    with engine.begin() as conn:
        return conn.execute(statement).rowcount > 0


def renew(engine: Engine, table: Table, owner: str, lease_s: float, *where) -> int:
    """Push on owner's leases of the rows matching where; how many it still held."""
    with engine.begin() as conn:
        return conn.execute(update(table).where(*where, table.c.lease_owner == owner)
                            .values(lease_until=time.time() + lease_s)).rowcount


def free(engine: Engine, table: Table, owner: str, *where) -> None:
    with engine.begin() as conn:
        conn.execute(update(table).where(*where, table.c.lease_owner == owner)
                     .values(lease_owner=None, lease_until=None))


@asynccontextmanager
async def holding(engine: Engine, table: Table, owner: str, lease_s: float, rows, *only_if) -> AsyncIterator[bool]:
    """Claims the rows (a where clause) if also only_if, for the block (yields False, and holds nothing, if another
    gateway has them); renews the lease every lease_s / 3 while the block runs, frees it at the end."""
    if not await asyncio.to_thread(claim, engine, table, owner, lease_s, rows, *only_if):
        yield False
        return

    async def renewing() -> None:
        while True:
            await asyncio.sleep(lease_s / 3)
            await asyncio.to_thread(renew, engine, table, owner, lease_s, rows)

    task = asyncio.create_task(renewing())
    try:
        yield True
    finally:
        task.cancel()
        await asyncio.to_thread(free, engine, table, owner, rows)
