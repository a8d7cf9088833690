"""Usage records: one per attempt, journaled before the client has its answer, then stored in batches.

    write(record) → one JSON line appended to the journal with os.write, on the event loop, before the
    response leaves (it is in the kernel's page cache at once: a killed gateway loses nothing)
    → the commit task fsyncs the journal every `fsync_interval_s` while it grows (group commit: a power
    loss loses at most that window) and seals it into a numbered segment every `flush_interval_s` or
    `batch_size` records, while the store keeps up
    → the store task inserts a segment's records, then deletes the segment.

At start, whatever a previous process left (segments and its journal) is inserted before the gateway serves;
records carry a unique record_id and the store skips one it already has, so a segment inserted but not yet
deleted when the process died counts once. While the store is down the journal just grows on disk and the
store task retries; memory holds at most `max_pending` records (the rest are read back from their segment).
One gateway process owns a journal (an exclusive lock beside it).
"""
import asyncio
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import orjson

from inferd.gateway.store import Store
from inferd.protocol.headers import UsageStatus
from inferd.protocol.ids import new_id

log = logging.getLogger(__name__)

RETRY_S = 1.0  # between inserts of a segment while the store fails


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
    tpot_s: float | None = None  # time per output token after the first (Outcome.tpot_s); not billed
    cost_usd: float = 0.0
    units: dict[str, float] | None = None  # beyond tokens: a robot session's observations, actions, seconds, ...
    batch_id: str | None = None  # a batch line's batch
    cache_hit: bool = False  # answered from the response cache (its tokens are the cached answer's; no cost)
    ended_unix_s: float = field(default_factory=time.time)
    record_id: str = field(default_factory=new_id)


RECORD_FIELDS = tuple(f.name for f in fields(UsageRecord))


@dataclass(slots=True)
class UsageCounters:
    """What this gateway has handed to the writer, for reconciliation against the store."""
    records: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    spilled: int = 0  # records whose first insert failed: they wait in their segment for the store
    replayed: int = 0  # records inserted from a segment's file (left by a previous process, or spilled)
    fsyncs: int = 0


@dataclass(slots=True, eq=False)
class Segment:
    """A sealed piece of the journal: its file, and its records while memory holds them (None: read the file)."""
    path: Path
    count: int
    rows: list[UsageRecord] | None
    failed: bool = False


class UsageWriter:
    def __init__(self, store: Store, journal_path: Path, max_pending: int = 10_000, batch_size: int = 500,
                 flush_interval_s: float = 0.5, fsync_interval_s: float = 0.005):
        self.store = store
        self.journal_path = journal_path
        self.max_pending = max_pending
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.fsync_interval_s = fsync_interval_s
        self.counters = UsageCounters()
        self._fd: int | None = None
        self._lock_fd: int | None = None
        self._rows: list[UsageRecord] | None = []  # the open journal's (None: past max_pending, in the file only)
        self._journaled = 0  # records in the open journal
        self._opened_s = 0.0
        self._dirty = False  # written since the last fsync
        self._in_memory = 0  # rows held, open journal and sealed segments together
        self._unstored = 0
        self._next_segment = 0
        self._sealed: asyncio.Queue[Segment | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._closing = False

    @property
    def pending(self) -> int:
        """Records journaled and not yet in the store."""
        return self._unstored

    async def start(self) -> None:
        """Take the journal, insert what a previous process left in it, then begin committing and storing."""
        self.journal_path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.journal_path.with_name(self.journal_path.name + ".lock"),
                                os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise RuntimeError(f"the usage journal {self.journal_path} is held by another gateway process; "
                               "give each gateway its own (--usage-journal)") from None
        left = self._left_over()
        self._open()
        for i, segment in enumerate(left):
            if not await self._store(segment):
                for waiting in left[i:]:
                    self._sealed.put_nowait(waiting)  # the store is down: the store task retries
                break
        self._tasks = [asyncio.create_task(self._commit()), asyncio.create_task(self._store_segments())]

    def write(self, record: UsageRecord) -> None:
        """Journal the record (it survives this process from the moment this returns); stored later."""
        c = self.counters
        c.records += 1
        c.prompt_tokens += record.prompt_tokens
        c.cached_tokens += record.cached_tokens
        c.completion_tokens += record.completion_tokens
        c.cost_usd += record.cost_usd
        if record.units is not None:  # what is journaled is what is stored, whatever the caller does next
            record = replace(record, units=dict(record.units))
        os.write(self._fd, orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))  # a dataclass, in its field order
        self._dirty = True
        self._journaled += 1
        self._unstored += 1
        if self._rows is not None and self._in_memory < self.max_pending:
            self._rows.append(record)  # a row for the store only in the store task
            self._in_memory += 1
        elif self._rows is not None:
            self._in_memory -= len(self._rows)
            self._rows = None

    async def close(self) -> None:
        """Seal and store everything journaled; what the store refuses stays on disk for the next start."""
        self._closing = True
        if not self._tasks:
            return
        commit, storing = self._tasks
        await commit
        if self._journaled:
            await self._seal()
        self._sealed.put_nowait(None)
        await storing
        os.close(self._fd)
        os.close(self._lock_fd)

    # the commit task: group-committed fsync, segments sealed while the store keeps up

    async def _commit(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.fsync_interval_s)
            if self._dirty:
                self._dirty = False
                await asyncio.to_thread(os.fsync, self._fd)
                self.counters.fsyncs += 1
            due = self._journaled >= self.batch_size or time.monotonic() - self._opened_s >= self.flush_interval_s
            if self._journaled and due and self._sealed.empty():
                await self._seal()

    async def _seal(self) -> None:
        old_fd = self._fd
        segment = Segment(self._segment_path(self._next_segment), self._journaled, self._rows)
        self._next_segment += 1
        os.rename(self.journal_path, segment.path)
        self._open()
        await asyncio.to_thread(_sync_and_close, old_fd)
        self._sealed.put_nowait(segment)

    def _open(self) -> None:
        self._fd = os.open(self.journal_path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
        self._rows, self._journaled, self._opened_s = [], 0, time.monotonic()

    # the store task

    async def _store_segments(self) -> None:
        while (segment := await self._sealed.get()) is not None:
            while not await self._store(segment):
                if self._closing:
                    return  # on disk: the next start inserts it
                await asyncio.sleep(RETRY_S)

    async def _store(self, segment: Segment) -> bool:
        """Insert the segment's records and delete it; False (kept on disk, memory freed) if the store failed."""
        stored = await asyncio.to_thread(self._insert, segment)
        if not stored and not segment.failed:
            segment.failed = True
            self.counters.spilled += segment.count
        if stored:
            self._unstored -= segment.count
            if segment.rows is None:
                self.counters.replayed += segment.count
        if segment.rows is not None:
            self._in_memory -= len(segment.rows)
            segment.rows = None
        return stored

    def _insert(self, segment: Segment) -> bool:
        """In a thread: the records into the store, then the segment's file deleted."""
        try:
            for batch in self._batches(segment):
                self.store.insert_usage(batch)
        except Exception as exc:
            log.error("usage store unavailable (%s); %d records wait in %s", type(exc).__name__, segment.count,
                      segment.path)
            return False
        segment.path.unlink()
        return True

    def _batches(self, segment: Segment) -> Iterator[list[dict]]:
        rows = map(_row, segment.rows) if segment.rows is not None else _read(segment.path)
        batch = []
        for row in rows:
            batch.append(row)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch:
            yield batch

    # what a previous process left

    def _segment_path(self, number: int) -> Path:
        return self.journal_path.with_name(f"{self.journal_path.name}.{number:08d}")

    def _left_over(self) -> list[Segment]:
        """Segments a previous process left, oldest first, with its journal sealed as the last one."""
        prefix = self.journal_path.name + "."
        numbered = sorted(int(p.name[len(prefix):]) for p in self.journal_path.parent.glob(prefix + "*")
                          if p.name[len(prefix):].isdigit())
        self._next_segment = numbered[-1] + 1 if numbered else 0
        paths = [self._segment_path(n) for n in numbered]
        if self.journal_path.exists():
            paths.append(self._segment_path(self._next_segment))
            self._next_segment += 1
            os.rename(self.journal_path, paths[-1])
        segments = [Segment(p, sum(1 for _ in _read(p)), None) for p in paths]
        self._unstored += sum(s.count for s in segments)
        return segments


def _row(record: UsageRecord) -> dict:
    return {name: getattr(record, name) for name in RECORD_FIELDS}  # not dataclasses.asdict: it deep-copies


def _read(path: Path) -> Iterator[dict]:
    """A segment's records; a torn last line (a power loss mid-write) is skipped."""
    with path.open() as f:
        for line in f:
            try:
                yield json.loads(line)
            except ValueError:
                log.warning("skipped a torn line in %s", path)


def _sync_and_close(fd: int) -> None:
    os.fsync(fd)
    os.close(fd)
