"""The replica pool on a real event loop, with small in-process HTTP replicas (no engine): joining only
when ready, draining before stopping, replacing the dead, admission capacity, scale from zero."""
import asyncio
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from inferd.control.pool import DRAINING, READY, ReplicaPool
from inferd.control.replicas import free_port
from inferd.control.spec import AutoscalingSpec
from inferd.gateway.admission import AdmissionQueue, QueueConfig, Ticket
from inferd.gateway.deployments import Deployment, TextModel
from inferd.router.router import Router, RouterConfig


class HttpReplica:
    """A ReplicaHandle whose process is a uvicorn server thread answering /ready like `inferd replica`."""

    def __init__(self, ready_after_s: float = 0.2):
        self.port = free_port()
        self.url, self.api_key = f"http://127.0.0.1:{self.port}", "k"
        self.ready_after_s = ready_after_s
        self.stopped = False
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        time.sleep(self.ready_after_s)  # its "weights loading"
        loaded = time.time()

        async def ready(request):
            return JSONResponse({"status": "ready", "loaded_unix_s": loaded, "warm_unix_s": loaded + 0.01,
                                 "kv_cache_usage": 0.25})

        async def models(request):
            return JSONResponse({"data": [{"id": "m", "max_model_len": 321, "source_path": "/x"}]})

        app = Starlette(routes=[Route("/ready", ready), Route("/v1/models", models)])
        self.server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="error", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not (self.server and self.server.started):
            if time.monotonic() > deadline or self.stopped:
                raise RuntimeError("not ready")
            time.sleep(0.02)

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def stop(self, timeout_s: float = 15.0) -> None:
        self.stopped = True
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(timeout_s)


async def until(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def pool_of(target: int, made: list, autoscaling: AutoscalingSpec | None = None) -> ReplicaPool:
    deployment = Deployment("m", TextModel(None, 100), [], AdmissionQueue(QueueConfig(1)),
                            router=Router(RouterConfig(policy="least_loaded")))

    def make() -> HttpReplica:
        made.append(HttpReplica())
        return made[-1]
    return ReplicaPool(deployment, make, per_replica_inflight=2, target=target, autoscaling=autoscaling)


def test_join_drain_replace_and_close():
    async def main():
        made: list[HttpReplica] = []
        pool = pool_of(0, made)
        d = pool.deployment
        await pool.start()
        assert d.queue.max_inflight == 0
        pool.scale_to(2)
        assert pool.counts()["starting"] == 2 and d.upstreams == []  # not routed before ready
        await until(lambda: pool.counts()[READY] == 2)
        assert d.queue.max_inflight == 4 and len(d.upstreams) == 2
        assert d.model.max_model_len == d.card["max_model_len"] == 321 and d.card["source_path"] == "/x"
        await until(lambda: pool.cold_start.measured == 2)
        last = pool.cold_start.last
        assert 0.2 < last["weights_loaded"] < last["warm"] < last["ready"] < 5 and pool.cold_start.estimate_s < 5

        newest = pool.members[-1]
        newest.upstream.inflight = 1  # a request runs there
        pool.scale_to(1)
        assert newest.state == DRAINING and newest.upstream.draining and d.queue.max_inflight == 2
        assert all(d.pick([1, 2, 3], "t") is not newest.upstream for _ in range(20))
        await asyncio.sleep(0.5)
        assert newest.handle.alive() and newest.upstream in d.upstreams  # waits for its request
        newest.upstream.inflight = 0
        await until(lambda: not newest.handle.alive() and newest.upstream not in d.upstreams)
        assert pool.counts() == {"starting": 0, "ready": 1, "draining": 0}

        survivor = pool.members[0]
        survivor.handle.stop()  # it dies
        await until(lambda: pool.restarts == 1)
        assert survivor.upstream not in d.upstreams and d.queue.max_inflight == 0
        await until(lambda: pool.counts()[READY] == 1)
        assert d.upstreams[0].name == survivor.upstream.name and d.queue.max_inflight == 2
        await pool.close()
        assert len(made) == 3 and not any(r.alive() for r in made)
    asyncio.run(main())


def test_scale_from_zero_when_a_request_waits():
    async def main():
        made: list[HttpReplica] = []
        spec = AutoscalingSpec(min_replicas=0, max_replicas=1, scale_to_zero=True, downscale_delay_s=0.3,
                               interval_s=5.0)
        pool = pool_of(0, made, spec)
        await pool.start()
        t0 = time.monotonic()
        waited = await pool.deployment.queue.admit(Ticket("t", "interactive", 10, deadline_s=t0 + 10))
        assert pool.counts()[READY] == 1 and waited < 3.0  # woken at once, not after interval_s
        pool.deployment.queue.release(0.1)
        pool.autoscaling.interval_s = 0.1
        await until(lambda: pool.counts() == {"starting": 0, "ready": 0, "draining": 0}, 15)
        assert "idle for 0.3 s" in pool.decision.reason and pool.deployment.queue.max_inflight == 0
        scaled = [(d["replicas"], d["desired"], d["reason"]) for d in pool.decisions if d["desired"] != d["replicas"]]
        assert scaled == [(0, 1, "a request waits and no replica runs"), (1, 0, "idle for 0.3 s")], pool.decisions
        await pool.close()
    asyncio.run(main())


def test_recent_decisions_keep_each_scaling_and_each_change_of_reason_bounded():
    from inferd.control.autoscaler import Decision, Signals
    from inferd.control.pool import DECISION_HISTORY
    pool = pool_of(1, [], AutoscalingSpec(min_replicas=1, max_replicas=3))
    one = Signals(replicas=1, starting=0)
    for _ in range(5):
        pool._remember(Decision(1, "steady"), one)
    for ms in (900, 950, 1000):  # the same reason with other figures: kept once
        pool._remember(Decision(1, f"breach held back: queue age {ms} ms > 500 ms"), one)
    pool._remember(Decision(2, "queue age 1200 ms > 500 ms"), one)
    pool._remember(Decision(2, "queue age 1300 ms > 500 ms"), one)  # scales again: kept
    assert [(d["desired"], d["reason"]) for d in pool.decisions] == [
        (1, "steady"), (1, "breach held back: queue age 900 ms > 500 ms"), (2, "queue age 1200 ms > 500 ms"),
        (2, "queue age 1300 ms > 500 ms")]
    for i in range(DECISION_HISTORY * 2):
        pool._remember(Decision(2, "scale"), Signals(replicas=1, starting=0))
    assert len(pool.decisions) == DECISION_HISTORY
