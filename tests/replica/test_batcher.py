"""The dynamic batcher over a fake model: a function that records its batches and can be held busy."""
import asyncio
import functools
import threading
import time

import pytest

from inferd.protocol.errors import DeadlineExceeded, InvalidRequest, Overloaded, ServiceUnavailable
from inferd.replica.batch_window import pick
from inferd.replica.batcher import Batcher, BatcherConfig, Item, Submission


class FakeModel:
    """Doubles each payload; while `hold` is set, a batch blocks until `release()`."""

    def __init__(self, hold: bool = False):
        self.batches: list[list[int]] = []
        self.started: list[float] = []
        self.gate = threading.Event()
        if not hold:
            self.gate.set()
        self.running = threading.Event()

    def __call__(self, payloads: list[int]) -> list[int]:
        self.batches.append(list(payloads))
        self.started.append(time.monotonic())
        self.running.set()
        self.gate.wait(10)
        self.running.clear()
        return [2 * p for p in payloads]

    def release(self) -> None:
        self.gate.set()

    async def until_running(self) -> None:
        while not self.running.is_set():
            await asyncio.sleep(0.001)


def batcher_test(fn):
    @functools.wraps(fn)
    def run():
        asyncio.run(fn())
    return run


async def started(model: FakeModel, **settings) -> Batcher:
    config = BatcherConfig(**({"max_batch_cost": 1000, "max_batch_items": 8} | settings))
    batcher = Batcher(model, config)
    batcher.start()
    return batcher


async def busy(model: FakeModel, batcher: Batcher) -> asyncio.Future:
    """Hold the model busy with one batch; its future."""
    [future] = batcher.submit([0], [1])
    await model.until_running()
    return future


@batcher_test
async def test_an_idle_model_gets_the_first_item_at_once():
    model = FakeModel()
    batcher = await started(model, max_queue_delay_ms=10_000)
    begun = time.monotonic()
    assert await batcher.run([21], [1]) == [42]
    assert time.monotonic() - begun < 1.0  # not the 10 s fill delay
    await batcher.stop()


@batcher_test
async def test_after_a_busy_batch_the_next_one_fills_for_at_most_the_delay():
    model = FakeModel(hold=True)
    batcher = await started(model, max_queue_delay_ms=300, max_batch_items=3)
    first = await busy(model, batcher)
    arrived = time.monotonic()
    second = batcher.submit([1], [1])
    model.release()
    await first
    await asyncio.sleep(0.05)
    third = batcher.submit([2], [1])  # arrives while the second waits to fill: joins its batch
    assert await asyncio.gather(*second, *third) == [2, 4]
    assert model.batches == [[0], [1, 2]]
    assert 0.25 <= model.started[1] - arrived < 2.0
    await batcher.stop()


@batcher_test
async def test_items_that_waited_out_the_busy_time_go_at_once():
    model = FakeModel(hold=True)
    batcher = await started(model, max_queue_delay_ms=100)
    first = await busy(model, batcher)
    second = batcher.submit([1], [1])
    await asyncio.sleep(0.3)
    released = time.monotonic()
    model.release()
    await asyncio.gather(first, *second)
    assert model.started[1] - released < 0.09
    await batcher.stop()


@batcher_test
async def test_a_full_batch_goes_without_waiting_for_the_delay():
    model = FakeModel(hold=True)
    batcher = await started(model, max_queue_delay_ms=10_000, max_batch_items=2)
    first = await busy(model, batcher)
    rest = batcher.submit([1, 2], [1, 1])
    model.release()
    begun = time.monotonic()
    await asyncio.gather(first, *rest)
    assert time.monotonic() - begun < 1.0 and model.batches == [[0], [1, 2]]
    await batcher.stop()


@batcher_test
async def test_batches_keep_to_the_cost_cap_and_a_costlier_item_goes_alone():
    model = FakeModel(hold=True)
    batcher = await started(model, max_batch_cost=10, max_queue_delay_ms=0)
    first = await busy(model, batcher)
    rest = batcher.submit([1, 2, 3, 4], [4, 4, 25, 4])
    model.release()
    assert await asyncio.gather(first, *rest) == [0, 2, 4, 6, 8]
    assert model.batches == [[0], [1, 2], [3], [4]]
    await batcher.stop()


@batcher_test
async def test_interactive_items_go_before_batch_items_that_came_first():
    model = FakeModel(hold=True)
    batcher = await started(model, max_batch_items=1, max_queue_delay_ms=0)
    first = await busy(model, batcher)
    later = batcher.submit([1], [1], priority="batch")
    sooner = batcher.submit([2], [1], priority="interactive")
    model.release()
    await asyncio.gather(first, *later, *sooner)
    assert model.batches == [[0], [2], [1]]
    await batcher.stop()


@batcher_test
async def test_a_waiting_items_deadline_fails_it_while_the_model_is_still_busy():
    model = FakeModel(hold=True)
    batcher = await started(model)
    first = await busy(model, batcher)
    [late] = batcher.submit([1], [1], deadline_s=time.monotonic() + 0.05)
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(late, 2.0)
    assert model.running.is_set() and batcher.queued_items == 0
    model.release()
    await first
    assert model.batches == [[0]]
    with pytest.raises(DeadlineExceeded):
        batcher.submit([2], [1], deadline_s=time.monotonic() - 0.001)
    await batcher.stop()


@batcher_test
async def test_a_full_queue_refuses_with_a_retry_after():
    model = FakeModel(hold=True)
    batcher = await started(model, max_queue_items=2, max_queue_cost=10)
    first = await busy(model, batcher)
    waiting = batcher.submit([1, 2], [1, 1])
    with pytest.raises(Overloaded) as refused:
        batcher.submit([3], [1])
    assert int(refused.value.headers["retry-after"]) >= 1
    with pytest.raises(InvalidRequest):
        batcher.submit([4, 5, 6], [1, 1, 1])  # larger than the whole queue: it could never fit
    model.release()
    await asyncio.gather(first, *waiting)
    model.gate.clear()
    first = await busy(model, batcher)
    waiting = batcher.submit([7], [8])
    with pytest.raises(Overloaded):
        batcher.submit([8], [3])  # the cost bound
    model.release()
    await asyncio.gather(first, *waiting)
    await batcher.stop()


@batcher_test
async def test_many_inputs_split_over_batches_come_back_in_order():
    model = FakeModel()
    batcher = await started(model, max_batch_items=3, max_batch_cost=40, sort_by_cost=True)
    costs = [5, 30, 2, 17, 9, 1, 30, 4, 12, 8, 3, 25]
    results = await batcher.run(list(range(12)), costs)
    assert results == [2 * i for i in range(12)]
    assert len(model.batches) >= 4 and sorted(p for b in model.batches for p in b) == list(range(12))
    assert all(len(b) <= 3 and sum(costs[p] for p in b) <= 40 for b in model.batches)
    await batcher.stop()


@batcher_test
async def test_a_cancelled_request_leaves_the_queue():
    model = FakeModel(hold=True)
    batcher = await started(model)
    first = await busy(model, batcher)
    request = asyncio.create_task(batcher.run([1, 2, 3], [1, 1, 1]))
    await asyncio.sleep(0.01)
    assert batcher.queued_items == 3
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)
    assert batcher.queued_items == 0 and batcher.queued_cost == 0
    model.release()
    await first
    await asyncio.sleep(0.01)
    assert model.batches == [[0]]
    await batcher.stop()


@batcher_test
async def test_a_failing_model_fails_its_whole_batch():
    def broken(payloads):
        raise RuntimeError("no")
    batcher = Batcher(broken, BatcherConfig(max_batch_cost=10, max_batch_items=4))
    batcher.start()
    outcomes = await asyncio.gather(*batcher.submit([1, 2], [1, 1]), return_exceptions=True)
    assert [type(o) for o in outcomes] == [RuntimeError, RuntimeError]
    await batcher.stop()


@batcher_test
async def test_stop_fails_the_running_and_the_waiting():
    model = FakeModel(hold=True)
    batcher = await started(model)
    first = await busy(model, batcher)
    waiting = batcher.submit([1], [1])
    model.release()
    await batcher.stop()
    outcomes = await asyncio.gather(first, *waiting, return_exceptions=True)
    assert [type(o) for o in outcomes] == [ServiceUnavailable, ServiceUnavailable]
    batcher.start()  # again, as after a restart
    assert await batcher.run([4], [1]) == [8]
    await batcher.stop()


def item(cost: int, seq: int) -> Item:
    return Item(seq, cost, 0, seq, 0.0, None, Submission())


def test_sorting_by_cost_grows_the_batch_around_the_oldest_item_with_the_least_padding():
    window = [item(c, i) for i, c in enumerate([50, 3, 48, 2, 49, 4, 51])]
    assert [i.cost for i in pick(window, 3, 1000, by_cost=True)] == [48, 49, 50]
    assert [i.cost for i in pick(window, 3, 1000, by_cost=False)] == [50, 3, 48]
    assert [i.cost for i in pick(window, 4, 100, by_cost=True)] == [49, 50]  # the cost cap
    short_head = [item(c, i) for i, c in enumerate([3, 50, 2, 4, 49])]
    assert [i.cost for i in pick(short_head, 3, 1000, by_cost=True)] == [2, 3, 4]
