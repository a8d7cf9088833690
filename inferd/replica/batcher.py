"""A dynamic batcher for models that take batches of independent items (embeddings, tabular rows, ...).

Callers submit items, each with a cost (tokens, rows), a priority class and maybe a deadline, and get one
future per item. One dispatch task runs batches, one at a time, through the model function in a worker
thread; the event loop never runs the model. When batches go:
    idle     nothing runs: whatever waits is dispatched at once, no delay
    busy     a batch runs: new items wait for it
    filling  a batch just ended and less than a full batch waits: dispatch once the batch is full or its
             oldest item has waited max_queue_delay_ms since it arrived (items that waited out the busy
             time go at once)

What a batch holds: up to max_batch_items items and max_batch_cost cost (an item costlier than that goes
alone), interactive before batch. With sort_by_cost, a window of the queue's head (window_batches
batches' worth) is sorted by cost and the batch grown from the oldest item towards the neighbours that
add the least padding; the oldest item is always in the next batch, so nothing starves.

Failures: an item still waiting when its deadline passes fails then with DeadlineExceeded (a timer, not
the next dispatch); a cancelled future leaves the queue; a full queue refuses a submission with
Overloaded and a Retry-After estimated from the cost the model got through per second so far.
"""
import asyncio
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import count, islice
from typing import Any, Generic, TypeVar

from inferd.protocol.errors import DeadlineExceeded, InvalidRequest, Overloaded, ServiceUnavailable
from inferd.protocol.headers import PRIORITY_CLASSES, PriorityClass
from inferd.replica.batch_window import pick

T = TypeVar("T")
R = TypeVar("R")


@dataclass(slots=True)
class BatcherConfig:
    max_batch_cost: int
    max_batch_items: int
    max_queue_delay_ms: float = 2.0
    max_queue_items: int = 4096
    max_queue_cost: int = 1 << 20
    sort_by_cost: bool = False
    window_batches: int = 4  # with sort_by_cost: how many batches' worth of the queue's head is sorted

    def __post_init__(self):
        assert min(self.max_batch_cost, self.max_batch_items, self.max_queue_items, self.max_queue_cost) >= 1
        assert self.max_queue_delay_ms >= 0 and self.window_batches >= 1


@dataclass(slots=True)
class Submission:
    """The items of one submit call: they share a deadline and its timer."""
    items: list["Item"] = field(default_factory=list)
    waiting: int = 0
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True, eq=False)
class Item:
    payload: Any
    cost: int
    priority: int  # index in PRIORITY_CLASSES: 0 goes first
    seq: int
    enqueued_s: float
    future: asyncio.Future
    submission: Submission


@dataclass(slots=True)
class BatchReport:
    """What the on_batch observer hears of each batch run."""
    num_items: int
    cost: int
    max_item_cost: int  # the batch padded to its longest item costs num_items * max_item_cost
    queue_s: list[float]  # per item: enqueued to dispatched
    compute_s: float
    failed: bool


class Batcher(Generic[T, R]):
    """run_batch(payloads) -> one result per payload, in order; called in the worker thread."""

    def __init__(self, run_batch: Callable[[list[T]], list[R]], config: BatcherConfig, *,
                 on_batch: Callable[[BatchReport], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.config, self._run_batch, self._on_batch, self._clock = config, run_batch, on_batch, clock
        self._queues: list[dict[int, Item]] = [{} for _ in PRIORITY_CLASSES]
        self._seq = count()
        self.queued_items, self.queued_cost = 0, 0
        self.running: list[Item] = []
        self._cost_per_s: float | None = None
        self._changed: asyncio.Event | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task | None = None

    # life

    def start(self) -> None:
        assert self._task is None, "started twice"
        self._changed = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batcher")
        self._task = asyncio.get_running_loop().create_task(self._dispatch_loop())

    async def stop(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        gone = ServiceUnavailable("The server is shutting down; retry the request.")
        for item in [*self.running, *(i for q in self._queues for i in q.values())]:
            self._leave(item)
            _fail(item, gone)
        await asyncio.to_thread(self._executor.shutdown, True)
        self._task = None

    # submitting

    def submit(self, payloads: Sequence[T], costs: Sequence[int], priority: PriorityClass = "interactive",
               deadline_s: float | None = None) -> list[asyncio.Future]:
        """One future per payload, resolved with its result; deadline_s on the clock (time.monotonic())."""
        assert self._task is not None, "start() the batcher first"
        assert len(payloads) == len(costs) and payloads
        self._admit(len(payloads), sum(costs), deadline_s)
        loop, now, sub, rank = asyncio.get_running_loop(), self._clock(), Submission(), PRIORITY_CLASSES.index(priority)
        for payload, cost in zip(payloads, costs):
            item = Item(payload, cost, rank, next(self._seq), now, loop.create_future(), sub)
            self._queues[item.priority][item.seq] = item
            item.future.add_done_callback(lambda f, item=item: f.cancelled() and self._leave(item))
            sub.items.append(item)
        sub.waiting = len(sub.items)
        self.queued_items += len(sub.items)
        self.queued_cost += sum(costs)
        if deadline_s is not None:
            sub.timer = loop.call_later(deadline_s - now, self._expire, sub)
        self._changed.set()
        return [item.future for item in sub.items]

    async def run(self, payloads: Sequence[T], costs: Sequence[int], priority: PriorityClass = "interactive",
                  deadline_s: float | None = None) -> list[R]:
        """submit, then the results in order; on any failure (or cancellation) the rest are cancelled."""
        futures = self.submit(payloads, costs, priority, deadline_s)
        try:
            return list(await asyncio.gather(*futures))
        finally:
            for f in futures:
                f.cancel()

    def _admit(self, num_items: int, cost: int, deadline_s: float | None) -> None:
        c = self.config
        if num_items > c.max_queue_items or cost > c.max_queue_cost:
            raise InvalidRequest(f"This request ({num_items} items, cost {cost}) is larger than the whole queue "
                                 f"({c.max_queue_items} items, cost {c.max_queue_cost}); split it.")
        if self.queued_items + num_items > c.max_queue_items or self.queued_cost + cost > c.max_queue_cost:
            retry_s = max(1, math.ceil((self.queued_cost + cost) / self._cost_per_s)) if self._cost_per_s else 1
            raise Overloaded(f"The queue is full ({self.queued_items} items waiting); retry in {retry_s} s.",
                             headers={"retry-after": str(retry_s)})
        if deadline_s is not None and deadline_s <= self._clock():
            raise DeadlineExceeded("The request's deadline passed before it was queued.")

    # leaving the queue

    def _leave(self, item: Item) -> bool:
        """Take item off the queue (or the running list); False if it was on neither."""
        if self._queues[item.priority].pop(item.seq, None) is None:
            if item in self.running:
                self.running.remove(item)
            return False
        self.queued_items, self.queued_cost = self.queued_items - 1, self.queued_cost - item.cost
        sub = item.submission
        sub.waiting -= 1
        if sub.waiting == 0 and sub.timer is not None:
            sub.timer.cancel()
        return True

    def _expire(self, sub: Submission) -> None:
        for item in filter(self._leave, sub.items):
            _fail(item, DeadlineExceeded("The request's deadline passed while it waited in the queue."))

    # dispatching

    async def _dispatch_loop(self) -> None:
        just_ran = False
        while True:
            await (self._until_filled() if just_ran else self._until_any())
            batch = self._take()
            if batch:
                await self._run(batch)
            just_ran = bool(batch)

    async def _until_any(self) -> None:
        while not self.queued_items:
            self._changed.clear()
            await self._changed.wait()

    async def _until_filled(self) -> None:
        c = self.config
        while self.queued_items and self.queued_items < c.max_batch_items and self.queued_cost < c.max_batch_cost:
            oldest_s = min(next(iter(q.values())).enqueued_s for q in self._queues if q)
            left_s = oldest_s + c.max_queue_delay_ms / 1000 - self._clock()
            if left_s <= 0:
                return
            self._changed.clear()
            try:
                async with asyncio.timeout(left_s):
                    await self._changed.wait()
            except TimeoutError:
                return

    def _take(self) -> list[Item]:
        c, batch, cost = self.config, [], 0
        head = next((next(iter(q.values())) for q in self._queues if q), None)
        if head is None or head.cost >= c.max_batch_cost:  # a head costlier than a whole batch goes alone
            return [head] if head else []
        for queue in self._queues:
            window = list(islice(queue.values(), c.max_batch_items * (c.window_batches if c.sort_by_cost else 1)))
            picked = pick(window, c.max_batch_items - len(batch), c.max_batch_cost - cost, c.sort_by_cost)
            batch, cost = batch + picked, cost + sum(i.cost for i in picked)
        return batch

    async def _run(self, batch: list[Item]) -> None:
        now = self._clock()
        for item in batch:
            self._leave(item)
        self.running = list(batch)
        try:
            results = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._run_batch, [i.payload for i in batch])
            assert len(results) == len(batch), f"run_batch returned {len(results)} results for {len(batch)} items"
        except Exception as exc:
            results, failure = None, exc
        for i, item in enumerate(batch):
            if results is None:
                _fail(item, failure)
            elif not item.future.done():
                item.future.set_result(results[i])
        self.running = []
        self._report(batch, now, self._clock() - now, results is None)

    def _report(self, batch: list[Item], dispatched_s: float, compute_s: float, failed: bool) -> None:
        cost = sum(i.cost for i in batch)
        if compute_s > 0 and not failed:
            rate = cost / compute_s
            self._cost_per_s = rate if self._cost_per_s is None else 0.8 * self._cost_per_s + 0.2 * rate
        if self._on_batch is not None:
            self._on_batch(BatchReport(len(batch), cost, max(i.cost for i in batch),
                                       [dispatched_s - i.enqueued_s for i in batch], compute_s, failed))


def _fail(item: Item, exc: BaseException) -> None:
    if not item.future.done():
        item.future.set_exception(exc)
