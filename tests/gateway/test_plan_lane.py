"""The plan lane (gateway/plan_lane.py): plans in arrival order, at most a budget a loop turn, so that what
arrives meanwhile runs first."""
import asyncio
import time

import pytest

from inferd.gateway.plan_lane import PlanLane


async def test_plans_run_in_order_and_yield_between_budgets():
    lane = PlanLane(budget_s=0.002)
    ran, turns = [], []

    def plan(i: int):
        def work():
            time.sleep(0.001)  # a chat template and a tokenizer's millisecond
            ran.append(i)
            return i
        return work

    async def ticker():  # what arrives meanwhile: it runs between the lane's turns
        while len(ran) < 20:
            turns.append(len(ran))
            await asyncio.sleep(0)
    tick = asyncio.create_task(ticker())
    results = await asyncio.gather(*(lane.run(plan(i)) for i in range(20)))
    await tick
    assert results == list(range(20)) and ran == list(range(20))
    steps = [b - a for a, b in zip(turns, turns[1:])]
    assert max(steps) <= 3  # a turn ran at most ~budget / 1 ms plans (2, and one that started under it)
    assert len(set(turns)) >= 7


async def test_a_plan_raises_to_its_caller_only():
    lane = PlanLane()

    def bad():
        raise ValueError("no")
    good = asyncio.create_task(lane.run(lambda: "ok"))
    with pytest.raises(ValueError):
        await lane.run(bad)
    assert await good == "ok"


async def test_a_cancelled_request_is_not_planned():
    lane = PlanLane()
    ran = []
    first = asyncio.create_task(lane.run(lambda: ran.append(1)))
    second = asyncio.create_task(lane.run(lambda: ran.append(2)))
    await asyncio.sleep(0)
    second.cancel()
    await first
    await asyncio.sleep(0)
    assert ran == [1]
