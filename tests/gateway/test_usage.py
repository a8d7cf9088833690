import json
import time

import pytest
from sqlalchemy import func, select

from inferd.gateway.store import Store
from inferd.gateway.tables import usage_records
from inferd.gateway.usage import UsageRecord, UsageWriter
from tests.server import free_port


def record(i: int) -> UsageRecord:
    return UsageRecord(request_id=f"req-{i}", model="m", status="completed", http_status=200,
                       started_unix_s=time.time(), e2e_s=0.1, gateway_id="gw", prompt_tokens=3,
                       completion_tokens=2, cost_usd=0.001)


def count(store: Store) -> int:
    with store.engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(usage_records)).scalar_one()


def sqlite(tmp_path) -> Store:
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    store.migrate()
    return store


def journal_files(journal) -> list:
    return sorted(p.name for p in journal.parent.glob(journal.name + "*") if not p.name.endswith(".lock"))


async def until(condition, timeout_s: float = 5.0) -> None:
    import asyncio
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_record_is_in_the_journal_when_write_returns_then_in_the_store(tmp_path):
    store, journal = sqlite(tmp_path), tmp_path / "usage.journal"
    writer = UsageWriter(store, journal, flush_interval_s=0.05)
    await writer.start()
    writer.write(record(0))
    assert json.loads(journal.read_text())["request_id"] == "req-0"  # before any await: no task has run
    for i in range(1, 1200):
        writer.write(record(i))
    await until(lambda: count(store) == 1200 and writer.pending == 0, 30)  # pending drops once the insert returns
    assert writer.counters.fsyncs >= 1
    writer.write(record(9999))
    await writer.close()  # stores what is journaled
    assert count(store) == 1201 and writer.counters.records == 1201 and journal_files(journal) == ["usage.journal"]
    assert journal.read_text() == ""


async def test_a_killed_writers_journal_is_stored_at_the_next_start_once(tmp_path):
    store, journal = sqlite(tmp_path), tmp_path / "usage.journal"
    lines = [json.dumps(_row(record(i))) for i in range(30)]
    journal.write_text("\n".join(lines[:20]) + "\n")  # what a killed process left: its open journal,
    (tmp_path / "usage.journal.00000004").write_text("\n".join(lines[10:30]) + "\n")  # a segment half stored
    store.insert_usage([json.loads(line) for line in lines[10:20]])
    writer = UsageWriter(store, journal)
    await writer.start()
    assert count(store) == 30 and writer.pending == 0 and writer.counters.replayed == 40
    assert journal_files(journal) == ["usage.journal"]
    await writer.close()


async def test_store_down_keeps_records_on_disk_until_it_answers(tmp_path):
    journal = tmp_path / "usage.journal"
    down = Store(f"postgresql+psycopg://nobody:x@127.0.0.1:{free_port()}/none?connect_timeout=1")
    writer = UsageWriter(down, journal, flush_interval_s=0.01, max_pending=10)
    await writer.start()
    for i in range(50):
        writer.write(record(i))
    await until(lambda: writer.counters.spilled > 0)
    await writer.close()
    assert writer.pending == 50 and writer._in_memory == 0  # past max_pending the rows live on disk only
    on_disk = [json.loads(line) for p in journal.parent.glob("usage.journal.*") if not p.name.endswith(".lock")
               for line in p.read_text().splitlines()]
    assert sorted(r["request_id"] for r in on_disk) == sorted(f"req-{i}" for i in range(50))
    assert "prompt" not in on_disk[0]

    up = sqlite(tmp_path)
    writer = UsageWriter(up, journal)
    await writer.start()
    await writer.close()
    assert count(up) == 50 and journal_files(journal) == ["usage.journal"]


async def test_one_journal_one_gateway(tmp_path):
    store, journal = sqlite(tmp_path), tmp_path / "usage.journal"
    first = UsageWriter(store, journal)
    await first.start()
    with pytest.raises(RuntimeError, match="held by another gateway"):
        await UsageWriter(store, journal).start()
    await first.close()


def _row(r: UsageRecord) -> dict:
    from dataclasses import asdict
    return asdict(r)
