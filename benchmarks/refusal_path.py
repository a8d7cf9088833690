"""What one refusal costs the gateway's event loop, in process: no sockets, no client on the same cores.

A gateway (tests/gateway/test_lifecycle.py's: SQLite store, in-process limiter, a word tokenizer) whose one
deployment has one slot, held by a request its replica never answers, and no queue: every further chat request is
refused 503 queue_full after auth, the body, the early checks and its usage record. --requests of them are sent as
raw ASGI calls at once (--sequential: one after another); prints microseconds per refusal, and with --profile
cProfile's top functions. --uvloop: on uvloop's loop, as `inferd serve` runs.

    PYTHONPATH=. .venv/bin/python benchmarks/refusal_path.py --requests 2000 [--profile] [--sequential] [--uvloop]
"""
import argparse
import asyncio
import cProfile
import gc
import json
import pstats
import tempfile
import time
from pathlib import Path

import httpx

from inferd.gateway.app import build_gateway_app
from tests.gateway.test_lifecycle import CHAT, Replicas, asgi_post, deployment, make_gateway


async def run(n: int, profile: bool, sequential: bool = False) -> None:
    hold = asyncio.Event()

    async def never(request: httpx.Request) -> httpx.Response:
        await hold.wait()
        return httpx.Response(200, json={})
    gw, key = make_gateway(Path(tempfile.mkdtemp(prefix="refusal-path-")), Replicas(a=never),
                           [deployment("m", "a", inflight=1)])
    gw.deployments.get("m").queue.config.max_queue_len = 0
    app = build_gateway_app(gw)
    await gw.start()
    gc.collect()
    gc.freeze()  # as run_gateway does after start-up
    one, statuses = asgi_post(app, "/v1/chat/completions", key, json.dumps(CHAT | {"model": "m"}).encode())
    holder = asyncio.create_task(one())  # takes the one slot
    await asyncio.sleep(0.1)
    for _ in range(50):  # warm-up
        await one()
    statuses.clear()
    profiler = cProfile.Profile() if profile else None
    started = time.perf_counter()
    if profiler:
        profiler.enable()
    if sequential:
        for _ in range(n):
            await one()
    else:
        await asyncio.gather(*(one() for _ in range(n)))
    if profiler:
        profiler.disable()
    elapsed = time.perf_counter() - started
    print(f"{n} requests, statuses {sorted(statuses)}: {elapsed / n * 1e6:.0f} µs a refusal")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    hold.set()
    holder.cancel()
    await gw.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--sequential", action="store_true", help="each request after the last, not all at once")
    p.add_argument("--uvloop", action="store_true")
    args = p.parse_args()
    if args.uvloop:
        import uvloop
        uvloop.install()
    asyncio.run(run(args.requests, args.profile, args.sequential))


if __name__ == "__main__":
    main()
