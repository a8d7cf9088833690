"""The client's own event-loop lag is measured, and a run with too much of it is refused."""
import asyncio
import time

import pytest

from inferd.bench.errors import ClientLagExceeded
from inferd.bench.lag import LagMonitor, check_lag


def measure(block_s: float) -> dict:
    async def go() -> dict:
        monitor = LagMonitor()
        task = asyncio.create_task(monitor.run())
        await asyncio.sleep(0.05)
        time.sleep(block_s)  # the client starving its own loop
        await asyncio.sleep(0.05)
        task.cancel()
        return monitor.summary()
    return asyncio.run(go())


def test_blocked_loop_is_refused():
    summary = measure(0.15)
    assert summary["max_ms"] >= 140 and summary["probes"] >= 3
    with pytest.raises(ClientLagExceeded, match="over the bound of 50 ms"):
        check_lag(summary, 50.0)


def test_idle_loop_passes():
    summary = measure(0.0)
    check_lag(summary, 50.0)
    assert summary["p99_ms"] < 50
