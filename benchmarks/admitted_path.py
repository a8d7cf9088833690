"""What one admitted single-row prediction costs, in process: no sockets, no client on the same cores.

A classical model (benchmarks/classical.py's logistic regression, trained here) runs as an in-process replica
(control/in_process.py) on a gateway's transport (SQLite store, in-process limiter, a key); --requests
single-row POST /v1/predict calls go as raw ASGI calls, --concurrency at a time, first to the replica's own app
(its key), then through the gateway's app (the gateway's key: auth, limits, admission, the usage record, the relay),
in turn for --rounds. Prints microseconds per request for each and their difference, the gateway's share; with
--profile, cProfile's time through the gateway summed by source file (where the gateway's share goes).

    PYTHONPATH=. .venv/bin/python benchmarks/admitted_path.py --requests 2000 [--profile] [--out FILE]
"""
import argparse
import asyncio
import cProfile
import gc
import json
import pstats
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import orjson

from benchmarks.classical import train
from benchmarks.refusal_path import asgi_post
from inferd.classical.config import ClassicalConfig
from inferd.control.gateway_setup import deployment_for
from inferd.control.in_process import InProcessReplica
from inferd.gateway.app import Gateway, build_gateway_app
from inferd.gateway.config import GatewayConfig
from inferd.gateway.deployments import Deployments, Upstream
from inferd.gateway.limits import MemoryLimiter
from inferd.gateway.store import Store
from inferd.gateway.transport import UpstreamTransport


async def per_request_us(one, n: int, concurrency: int, profiler: cProfile.Profile | None = None) -> float:
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await one()
    started = time.perf_counter()
    if profiler:
        profiler.enable()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    if profiler:
        profiler.disable()
    return (time.perf_counter() - started) / n * 1e6


def by_file(profiler: cProfile.Profile, top: int = 18) -> dict[str, float]:
    """cProfile's own time summed by source file (inferd's by its path under inferd/, libraries by package), as
    shares of the whole."""
    totals: Counter = Counter()
    for (path, _, func), (_, _, tottime, _, _) in pstats.Stats(profiler).stats.items():
        if "/inferd/" in path:
            key = "inferd/" + path.split("/inferd/")[-1]
        elif "site-packages/" in path:
            key = path.split("site-packages/")[-1].split("/")[0]
        else:  # the standard library by file, built-ins by name (the loop's wait in select's poll among them)
            key = func if path.startswith("~") else Path(path).name
        totals[key] += tottime
    whole = sum(totals.values())
    return {k: round(v / whole, 3) for k, v in totals.most_common(top)}


async def run(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="admitted-path-"))
    X, names = train(work)
    store = Store(f"sqlite:///{work / 'db.sqlite'}")
    store.migrate()
    store.create_tenant("t")
    _, new = store.create_key("t")
    config = GatewayConfig(db_url=store.url, usage_journal=work / "usage.journal")
    transport = UpstreamTransport()
    replica = InProcessReplica("classical", str(work / "logreg.skops"), "logreg", ClassicalConfig(), transport)
    replica.start()
    deployments = Deployments()
    deployments.add(deployment_for([Upstream(replica.url, replica.api_key, name="logreg-0")], config, "logreg",
                                   card=replica.card()))
    gw = Gateway(config, store, MemoryLimiter(), deployments, transport=transport)
    app = build_gateway_app(gw)
    await gw.start()
    await replica.serve(60)
    gc.collect()
    gc.freeze()  # as run_gateway does after start-up
    body = orjson.dumps({"model": "logreg", "inputs": [dict(zip(names, X[0].tolist()))]})
    direct, direct_statuses = asgi_post(replica.app, "/v1/predict", replica.api_key, body)
    through, through_statuses = asgi_post(app, "/v1/predict", new.key, body)
    for one in (direct, through):  # warm-up
        await per_request_us(one, 100, args.concurrency)
    times = {"replica": [], "gateway": []}
    for _ in range(args.rounds):
        times["replica"].append(await per_request_us(direct, args.requests, args.concurrency))
        times["gateway"].append(await per_request_us(through, args.requests, args.concurrency))
    med = {k: round(statistics.median(v), 1) for k, v in times.items()}
    result = {"date": time.strftime("%Y-%m-%d"), "requests": args.requests, "concurrency": args.concurrency,
              "rounds": args.rounds, "us_per_request": times, "median_us": med,
              "gateway_share_us": round(med["gateway"] - med["replica"], 1),
              "statuses": {"replica": dict(direct_statuses), "gateway": dict(through_statuses)}}
    if args.profile:
        profiler = cProfile.Profile()
        await per_request_us(through, args.requests, args.concurrency, profiler)
        result["profile_share_by_file"] = by_file(profiler)
    await gw.close()
    await asyncio.to_thread(replica.stop)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
