"""Usage records: one per request, written through a bounded, durable path.

Records queue in memory (bounded) and are inserted in batches. When the store fails, or the queue is
full, they are appended to a local spill file (JSON lines, fsynced) and replayed into the store once it
answers again; records carry a unique record_id, so a replay never double-counts. Nothing is dropped
and memory never grows past the queue bound.
"""
import asyncio
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from inferd.gateway.store import Store
from inferd.protocol.headers import UsageStatus

log = logging.getLogger(__name__)


@dataclass(slots=True)
class UsageRecord:
    request_id: str
    model: str
    status: UsageStatus
    http_status: int
    started_unix_s: float
    e2e_s: float
    gateway_id: str
    attempt: int = 1
    tenant_id: str | None = None
    key_id: str | None = None
    deployment_version: str | None = None
    replica: str | None = None
    priority_class: str | None = None
    error_code: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    queue_s: float | None = None
    ttft_s: float | None = None
    cost_usd: float = 0.0
    units: dict[str, float] | None = None  # beyond tokens: a robot session's observations, actions, seconds, ...
    ended_unix_s: float = field(default_factory=time.time)
    record_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass(slots=True)
class UsageCounters:
    """What this gateway has handed to the writer, for reconciliation against the store."""
    records: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    spilled: int = 0
    replayed: int = 0


class UsageWriter:
    def __init__(self, store: Store, spill_path: Path, max_pending: int = 10_000, batch_size: int = 500,
                 flush_interval_s: float = 0.5):
        self.store = store
        self.spill_path = spill_path
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.counters = UsageCounters()
        self._queue: asyncio.Queue[UsageRecord | None] = asyncio.Queue(max_pending)
        self._task: asyncio.Task | None = None
        self._closing = False
        self._spill_lock = threading.Lock()  # a spill append never races the replay's rename

    @property
    def _replaying_path(self) -> Path:
        return self.spill_path.with_suffix(".replaying")

    def start(self) -> None:
        self.spill_path.parent.mkdir(parents=True, exist_ok=True)
        self._task = asyncio.create_task(self._run())

    def write(self, record: UsageRecord) -> None:
        c = self.counters
        c.records += 1
        c.prompt_tokens += record.prompt_tokens
        c.cached_tokens += record.cached_tokens
        c.completion_tokens += record.completion_tokens
        c.cost_usd += record.cost_usd
        try:
            self._queue.put_nowait(record)
        except asyncio.QueueFull:
            self._spill([asdict(record)])

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    async def close(self) -> None:
        """Flush everything queued: into the store, or into the spill file if the store is down."""
        self._closing = True
        if self._task is not None:
            try:
                self._queue.put_nowait(None)  # wakes the writer; a full queue means it is busy and will look
            except asyncio.QueueFull:
                pass
            await self._task
        await self._flush([r for r in self._drain(self._queue.qsize() + 1) if r is not None])

    # the writer task

    async def _run(self) -> None:
        while not self._closing:
            try:
                first = await asyncio.wait_for(self._queue.get(), timeout=5.0)
            except asyncio.TimeoutError:
                first = None
            if first is not None:
                await asyncio.sleep(self.flush_interval_s)
                await self._flush([first] + [r for r in self._drain(self.batch_size - 1) if r is not None])
            if not self._closing and self._queue.empty() and (self.spill_path.exists()
                                                               or self._replaying_path.exists()):
                await asyncio.to_thread(self._replay)

    def _drain(self, limit: int) -> list[UsageRecord]:
        batch = []
        while len(batch) < limit and not self._queue.empty():
            batch.append(self._queue.get_nowait())
        return batch

    async def _flush(self, batch: list[UsageRecord]) -> None:
        if not batch:
            return
        rows = await asyncio.to_thread(_insert, self.store, batch)  # rows are made off the event loop too
        if rows is not None:
            self._spill(rows)

    # the spill file

    def _spill(self, rows: list[dict]) -> None:
        with self._spill_lock, self.spill_path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
            f.flush()
            os.fsync(f.fileno())
        self.counters.spilled += len(rows)

    def _replay(self) -> None:
        """Move spilled records into the store; the file goes only once all of them are in."""
        replaying = self._replaying_path
        with self._spill_lock:
            if not replaying.exists():
                if not self.spill_path.exists():
                    return
                os.replace(self.spill_path, replaying)
            rows = [json.loads(line) for line in replaying.read_text().splitlines() if line.strip()]
        try:
            for i in range(0, len(rows), self.batch_size):
                self.store.insert_usage(rows[i:i + self.batch_size])
        except Exception as exc:
            log.warning("usage replay failed (%s); will retry", type(exc).__name__)
            return
        replaying.unlink()
        self.counters.replayed += len(rows)
        log.info("replayed %d spilled usage records", len(rows))


def _insert(store: Store, batch: list[UsageRecord]) -> list[dict] | None:
    """Insert the records; the rows back (to spill) if the store failed."""
    rows = [asdict(r) for r in batch]
    try:
        store.insert_usage(rows)
    except Exception as exc:
        log.error("usage store unavailable (%s); spilling %d records", type(exc).__name__, len(rows))
        return rows
    return None
