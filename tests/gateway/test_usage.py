import asyncio
import json
import time

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


async def test_records_are_batched_into_the_store(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    store.migrate()
    writer = UsageWriter(store, tmp_path / "spill.jsonl", flush_interval_s=0.05)
    writer.start()
    for i in range(1200):
        writer.write(record(i))
    await asyncio.sleep(0.5)
    assert count(store) == 1200 and writer.pending == 0
    writer.write(record(9999))
    await writer.close()  # flushes what is queued
    assert count(store) == 1201 and writer.counters.records == 1201 and not (tmp_path / "spill.jsonl").exists()


async def test_store_down_spills_to_disk_then_replays(tmp_path):
    down = Store(f"postgresql+psycopg://nobody:x@127.0.0.1:{free_port()}/none?connect_timeout=1")
    spill = tmp_path / "spill.jsonl"
    writer = UsageWriter(down, spill, flush_interval_s=0.01)
    writer.start()
    for i in range(50):
        writer.write(record(i))
    await writer.close()
    lines = spill.read_text().splitlines()
    assert len(lines) == 50 and writer.counters.spilled == 50
    assert "prompt" not in json.loads(lines[0]) and json.loads(lines[0])["request_id"] == "req-0"

    up = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    up.migrate()
    writer = UsageWriter(up, spill, flush_interval_s=0.01)
    writer._replay()  # what the writer task does once the store answers
    writer._replay()  # nothing left, nothing doubled
    assert count(up) == 50 and not spill.exists()


async def test_a_full_queue_spills_instead_of_growing(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    store.migrate()
    writer = UsageWriter(store, tmp_path / "spill.jsonl", max_pending=10)
    for i in range(25):  # writer task not started: the queue cannot drain
        writer.write(record(i))
    assert writer.pending == 10 and writer.counters.spilled == 15
    await writer.close()
    writer._replay()
    assert count(store) == 25
