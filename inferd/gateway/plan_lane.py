"""Planning, taken in turn on the event loop: templating and tokenizing never run ahead of a later request's
cheap refusal.

A request's checks up to its early refusal (auth, body, limits, queue room) take tens of microseconds; its plan
(a chat template and the model's tokenizer) takes hundreds. Run inline, a burst's plans ran one after another
before the later arrivals were even read, and their refusals waited for all of them. Here plans wait in one
FIFO that runs at most `budget_s` of them a loop turn, then yields, so what arrived meanwhile is read and refused
first. On the loop, not in a thread: the plans hold the GIL (the template is Python), and a thread would make
the loop wait for it anyway, in 5 ms switches.
"""
import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any

BUDGET_S = 0.002  # planning a loop turn may take before it yields


class PlanLane:
    def __init__(self, budget_s: float = BUDGET_S):
        self.budget_s = budget_s
        self._work: deque[tuple[Callable[[], Any], asyncio.Future]] = deque()
        self._runner: asyncio.Task | None = None

    async def run(self, plan: Callable[[], Any]) -> Any:
        """plan() once the work queued before it has run; its result or its exception."""
        done = asyncio.get_running_loop().create_future()
        self._work.append((plan, done))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.get_running_loop().create_task(self._drain())
        try:
            return await done
        except BaseException:
            plan = done = None  # the error's traceback holds this frame: no cycle through the future
            raise

    async def _drain(self) -> None:
        while self._work:
            await asyncio.sleep(0)  # what arrived is read (and maybe refused) before the next plans
            until = time.perf_counter() + self.budget_s
            while self._work and time.perf_counter() < until:
                plan, done = self._work.popleft()
                if done.done():  # its request was cancelled while it waited
                    continue
                try:
                    done.set_result(plan())
                except Exception as exc:
                    done.set_exception(exc)
                plan = done = None  # nor through this frame, which an error's traceback holds too
