import asyncio
import time

import pytest

from inferd.gateway.admission import AdmissionQueue, QueueConfig, QueueRejected, Ticket
from inferd.protocol.errors import DeadlineExceeded


def ticket(tenant: str, tokens: int = 10, cls: str = "interactive", weight: float = 1.0, share: float = 1.0,
           deadline_s: float | None = None) -> Ticket:
    return Ticket(tenant, cls, tokens, weight, share, deadline_s)


async def admit_all(q: AdmissionQueue, tickets: list[Ticket]) -> list[asyncio.Task]:
    tasks = [asyncio.create_task(q.admit(t)) for t in tickets]
    await asyncio.sleep(0)
    return tasks


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def order_of(q: AdmissionQueue, tasks: list[asyncio.Task], names: list[str]) -> list[str]:
    """The order the tasks were admitted in, releasing each at once (a name starting "batch" is of that class)."""
    order = []
    while len(order) < len(tasks):
        await asyncio.sleep(0)
        done = [n for t, n in zip(tasks, names) if t.done() and n not in order]
        order += done
        for n in done:
            q.release(0.01, "batch" if n.startswith("batch") else "interactive")
    return order


async def test_a_flooding_tenant_waits_behind_its_own_requests():
    q = AdmissionQueue(QueueConfig(max_inflight=1))
    running = await admit_all(q, [ticket("x")])
    names = [f"a{i}" for i in range(6)] + ["b0", "b1"]
    tasks = await admit_all(q, [ticket(n[0]) for n in names])
    q.release(0.01)
    order = await order_of(q, tasks, names)
    assert running[0].done()
    assert order.index("b0") <= 1 and order.index("b1") <= 3  # b interleaves with a's burst


async def test_weights_share_dispatch():
    q = AdmissionQueue(QueueConfig(max_inflight=1))
    await admit_all(q, [ticket("x")])
    names = [f"a{i}" for i in range(6)] + [f"b{i}" for i in range(6)]
    tasks = await admit_all(q, [ticket(n[0], weight=2.0 if n[0] == "a" else 1.0) for n in names])
    q.release(0.01)
    first_six = (await order_of(q, tasks, names))[:6]
    assert sum(n.startswith("a") for n in first_six) == 4


async def test_interactive_before_batch():
    q = AdmissionQueue(QueueConfig(max_inflight=1))
    await admit_all(q, [ticket("x")])
    names = ["batch1", "batch2", "inter1"]
    tasks = await admit_all(q, [ticket("a", cls="batch"), ticket("a", cls="batch"), ticket("b")])
    q.release(0.01)
    assert (await order_of(q, tasks, names))[0] == "inter1"


async def test_batch_only_into_capacity_interactive_leaves_free():
    """Batch work fills idle slots, but never makes an interactive request wait for one."""
    q = AdmissionQueue(QueueConfig(max_inflight=2))
    batch = await admit_all(q, [ticket("a", cls="batch") for _ in range(3)])
    assert [t.done() for t in batch] == [True, True, False]  # idle capacity: two batch requests run
    inter = await admit_all(q, [ticket("b"), ticket("b"), ticket("b")])
    assert [t.done() for t in inter] == [True, True, False]  # batch holds no slot against interactive
    q.release(0.01, "batch")
    await settle()
    assert not batch[2].done()  # an interactive request waits: no new batch request starts
    q.release(0.01, "interactive")
    await settle()
    assert inter[2].done() and not batch[2].done()
    for cls in ("interactive", "interactive", "batch"):
        q.release(0.01, cls)
    await settle()
    assert batch[2].done() and q.inflight_by_class == {"interactive": 0, "batch": 1}


async def test_bounds_reject_at_once():
    q = AdmissionQueue(QueueConfig(max_inflight=1, max_queue_len=4, max_queued_tokens=100))
    await admit_all(q, [ticket("x")])
    await admit_all(q, [ticket("a", share=0.5), ticket("a", share=0.5)])
    with pytest.raises(QueueRejected) as e:
        await q.admit(ticket("a", share=0.5))
    assert e.value.reason == "tenant_queue_share" and e.value.retry_after_s >= 1
    await admit_all(q, [ticket("b", tokens=70)])
    with pytest.raises(QueueRejected, match="queued_tokens"):
        await q.admit(ticket("c", tokens=20))
    await admit_all(q, [ticket("c")])
    with pytest.raises(QueueRejected, match="queue_full"):
        await q.admit(ticket("d"))


async def test_deadline_drops_waiting_work_and_frees_its_place():
    q = AdmissionQueue(QueueConfig(max_inflight=1))
    await admit_all(q, [ticket("x")])
    with pytest.raises(DeadlineExceeded):
        await q.admit(ticket("a", deadline_s=time.monotonic() + 0.05))
    assert q.stats()["interactive"].length == 0 and q.inflight == 1


async def test_cancelled_waiter_leaves_no_trace_and_admitted_one_releases():
    q = AdmissionQueue(QueueConfig(max_inflight=1))
    [first] = await admit_all(q, [ticket("x")])
    [waiting] = await admit_all(q, [ticket("a")])
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert q.stats()["interactive"].length == 0
    q.release(0.01)
    assert q.inflight == 0 and first.done()


async def test_requests_being_planned_hold_their_place():
    """A burst: each request that passed the check before planning holds a place; once the free slots and the
    tenant's share of the queue are held, the next is refused before any of them is admitted."""
    q = AdmissionQueue(QueueConfig(max_inflight=2, max_queue_len=4))
    releases = []
    for _ in range(2 + 2):  # two would start at once, two may wait (a share of 0.5 of 4)
        t = ticket("a", share=0.5)
        q.check_room(t)
        releases.append(q.hold(t))
    with pytest.raises(QueueRejected) as refused:
        q.check_room(ticket("a", share=0.5))
    assert refused.value.reason == "tenant_queue_share"
    q.check_room(ticket("b", share=0.5))  # another tenant still has room
    releases[0]()
    releases[0]()  # a second release does nothing
    q.check_room(ticket("a", share=0.5))
    for release in releases[1:]:
        release()
    assert not q._held
