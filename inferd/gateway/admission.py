"""Bounded, deadline-aware admission for one deployment.

At most `max_inflight` interactive requests run on the deployment's replicas; the rest wait in bounded
queues, one per priority class (interactive before batch). A batch request starts only into capacity that
interactive traffic leaves free (fewer than `max_inflight` running of all classes, none interactive waiting),
and never holds a slot against an interactive one: interactive requests count only themselves against
`max_inflight`, so a replica full of batch work still takes them at once and its engine preempts the batch
sequences first. Inside a class, tenants share dispatch by weighted fair
queueing over reserved tokens (start-time fair queueing), so one tenant's burst waits behind its own
requests, not in front of everyone else's. A full queue answers at once; a request whose deadline passes
while it waits is dropped before it starts. A request that passed the check before planning holds its place
(hold) until it asks for admission, so that a burst's later requests are refused before the earlier ones'
prompts are tokenized.
"""
import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from inferd.protocol.errors import DeadlineExceeded
from inferd.protocol.headers import PRIORITY_CLASSES


@dataclass(slots=True)
class QueueConfig:
    max_inflight: int = 64  # requests running on the deployment's replicas at once
    max_queue_len: int = 256  # waiting requests, all classes together
    max_queued_tokens: int = 1_000_000  # reserved tokens (prompt + max output) of waiting requests

    def __post_init__(self):
        for name in ("max_inflight", "max_queue_len", "max_queued_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


class QueueRejected(Exception):
    """No room: reason is queue_full, queued_tokens (503) or tenant_queue_share (429)."""

    def __init__(self, reason: str, retry_after_s: float):
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(slots=True, eq=False)
class Ticket:
    tenant_id: str
    priority_class: str
    tokens: int
    weight: float = 1.0
    queue_share: float = 1.0
    deadline_s: float | None = None  # time.monotonic() by which it must have started
    enqueued_s: float = field(default_factory=time.monotonic)
    virtual_start: float = 0.0
    admitted: asyncio.Future | None = None


@dataclass(slots=True)
class ClassStats:
    length: int
    queued_tokens: int
    oldest_age_s: float


class AdmissionQueue:
    def __init__(self, config: QueueConfig):
        self.config = config
        self.max_inflight = config.max_inflight  # the capacity now: the control plane sets it (set_capacity)
        self.inflight = 0  # all classes together
        self.inflight_by_class = {c: 0 for c in PRIORITY_CLASSES}
        self._queues: dict[str, dict[str, deque[Ticket]]] = {c: {} for c in PRIORITY_CLASSES}
        self._last_finish: dict[tuple[str, str], float] = {}
        self._virtual_time = {c: 0.0 for c in PRIORITY_CLASSES}
        self._length = 0
        self._queued_tokens = 0
        self._service_s = 1.0  # moving average of a request's time in flight, for Retry-After
        self._starved = asyncio.Event()  # a request waits and nothing may run (capacity 0)
        self._held: dict[tuple[str, str], int] = {}  # (class, tenant) -> requests being planned (hold)

    async def admit(self, ticket: Ticket) -> float:
        """Wait for a slot; returns the seconds waited. Raises QueueRejected or DeadlineExceeded."""
        self.check_room(ticket)
        self._enqueue(ticket)
        self._dispatch()
        try:
            timeout = None if ticket.deadline_s is None else max(ticket.deadline_s - time.monotonic(), 0.0)
            async with asyncio.timeout(timeout):
                await asyncio.shield(ticket.admitted)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if ticket.admitted.done():
                self.release(0.0, ticket.priority_class)
            else:
                self._remove(ticket)
            if isinstance(exc, TimeoutError):
                waited_s = time.monotonic() - ticket.enqueued_s
                raise DeadlineExceeded(f"The request's deadline passed after {waited_s:.3f} s in the queue; "
                                       "it was not started.") from None
            raise
        return time.monotonic() - ticket.enqueued_s

    def release(self, service_s: float, priority_class: str = PRIORITY_CLASSES[0]) -> None:
        """A dispatched request of that class ended (however it ended)."""
        assert self.inflight_by_class[priority_class] > 0
        self.inflight -= 1
        self.inflight_by_class[priority_class] -= 1
        if service_s > 0:
            self._service_s = 0.9 * self._service_s + 0.1 * service_s
        self._dispatch()

    def set_capacity(self, max_inflight: int) -> None:
        """Requests that may run at once (ready replicas × max_num_seqs); 0: all wait, e.g. scaled to zero.

        Lowering it stops nothing already running; raising it admits waiting requests at once."""
        self.max_inflight = max(max_inflight, 0)
        self._dispatch()

    @property
    def length(self) -> int:
        return self._length

    async def wait_starved(self, timeout_s: float) -> None:
        """Until a request is queued while the capacity is 0 (the control plane starts a replica), or timeout_s."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._starved.wait()
        except TimeoutError:
            pass
        self._starved.clear()

    def stats(self) -> dict[str, ClassStats]:
        now = time.monotonic()
        out = {}
        for cls, tenants in self._queues.items():
            tickets = [t for q in tenants.values() for t in q]
            out[cls] = ClassStats(len(tickets), sum(t.tokens for t in tickets),
                                  max((now - t.enqueued_s for t in tickets), default=0.0))
        return out

    # queueing

    def check_room(self, ticket: Ticket) -> None:
        """Raises QueueRejected if the ticket cannot wait now; admit asks this first, and the lifecycle asks it
        before planning (with tokens=0) so that a full queue refuses before the prompt is tokenized. Requests
        being planned (hold) count as waiting, less those that the free slots would start at once."""
        cfg, cls = self.config, ticket.priority_class
        running = self.inflight_by_class[cls] if cls == PRIORITY_CLASSES[0] else self.inflight
        free = max(self.max_inflight - running, 0)
        held = max(sum(n for (c, _), n in self._held.items() if c == cls) - free, 0)
        if self._length + held >= cfg.max_queue_len:
            raise QueueRejected("queue_full", self._retry_after_s())
        if self._queued_tokens + ticket.tokens > cfg.max_queued_tokens and self._length:
            raise QueueRejected("queued_tokens", self._retry_after_s())
        mine = len(self._queues[cls].get(ticket.tenant_id, ()))
        mine += max(self._held.get((cls, ticket.tenant_id), 0) - free, 0)
        if mine >= max(1, math.floor(cfg.max_queue_len * ticket.queue_share)):
            raise QueueRejected("tenant_queue_share", self._retry_after_s())

    def hold(self, ticket: Ticket) -> Callable[[], None]:
        """Counts the ticket's request as waiting while it is planned; returns the release (called once it
        asks admit, or ends before; a second call does nothing)."""
        key = (ticket.priority_class, ticket.tenant_id)
        self._held[key] = self._held.get(key, 0) + 1
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                if (n := self._held[key] - 1) > 0:
                    self._held[key] = n
                else:
                    del self._held[key]
        return release

    def _enqueue(self, ticket: Ticket) -> None:
        cls, key = ticket.priority_class, (ticket.priority_class, ticket.tenant_id)
        ticket.admitted = asyncio.get_running_loop().create_future()
        ticket.virtual_start = max(self._virtual_time[cls], self._last_finish.get(key, 0.0))
        self._last_finish[key] = ticket.virtual_start + max(ticket.tokens, 1) / ticket.weight
        self._queues[cls].setdefault(ticket.tenant_id, deque()).append(ticket)
        self._length += 1
        self._queued_tokens += ticket.tokens
        if self.max_inflight == 0:
            self._starved.set()

    def _remove(self, ticket: Ticket) -> None:
        queue = self._queues[ticket.priority_class].get(ticket.tenant_id)
        if queue is not None and ticket in queue:
            queue.remove(ticket)
            self._forget(ticket, queue)

    def _forget(self, ticket: Ticket, queue: deque[Ticket]) -> None:
        self._length -= 1
        self._queued_tokens -= ticket.tokens
        if not queue:
            del self._queues[ticket.priority_class][ticket.tenant_id]

    def _dispatch(self) -> None:
        while (ticket := self._next()) is not None:
            self.inflight += 1
            self.inflight_by_class[ticket.priority_class] += 1
            ticket.admitted.set_result(None)

    def _next(self) -> Ticket | None:
        """The next ticket that may start: interactive while fewer than max_inflight of its own run; a lower
        class only while nothing of a higher class waits and fewer than max_inflight of all classes run."""
        for cls in PRIORITY_CLASSES:
            tenants = self._queues[cls]
            running = self.inflight_by_class[cls] if cls == PRIORITY_CLASSES[0] else self.inflight
            if tenants and running >= self.max_inflight:
                return None
            if tenants:
                queue = min(tenants.values(), key=lambda q: q[0].virtual_start)
                ticket = queue.popleft()
                self._virtual_time[cls] = ticket.virtual_start
                self._forget(ticket, queue)
                if len(self._last_finish) > 4 * (self.config.max_queue_len + 64):
                    self._prune_finish_times(cls)
                return ticket
        return None

    def _prune_finish_times(self, cls: str) -> None:
        """Tenants with nothing queued and a finish time in the past need no memory."""
        v = self._virtual_time[cls]
        idle = [k for k, f in self._last_finish.items() if k[0] == cls and f <= v and k[1] not in self._queues[cls]]
        for key in idle:
            del self._last_finish[key]

    def expected_wait_s(self) -> float:
        """About how long a request arriving now would wait for a slot (queue length x mean service time)."""
        return self._length / max(self.max_inflight, 1) * self._service_s

    def _retry_after_s(self) -> float:
        return max(1.0, self.expected_wait_s())
