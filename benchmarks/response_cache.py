"""The response cache through `inferd serve --response-cache-ttl-s 300` (SmolLM2-135M): what a hit takes, against
what the gateway takes to answer a request itself and what the model takes.

One client on a kept-alive connection, one request at a time (--requests each, after a warm-up):
  hit:   the same greedy chat request again and again (the first fills the cache)
  floor: a chat request the gateway answers itself, 400 (its body names the model but is invalid): the key,
         the body, the deployment and the plan lane, no cache and no replica
  miss:  greedy chat requests that differ (`cache: false`), answered by the model (--max-tokens each)
A hit's added latency is its p50 less the floor's.

    PYTHONPATH=. .venv/bin/python benchmarks/response_cache.py --out benchmarks/results/response-cache.json
    PYTHONPATH=. .venv/bin/python benchmarks/response_cache.py --busy --out ...  # beside a busy process
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from benchmarks.embeddings import ROOT, started_server, stopped, text_server_command
from benchmarks.machine import describe
from benchmarks.overload import quantile

KEY = "sk-bench-response-cache"
MODEL = "SmolLM2-135M-Instruct"


def timed(client: httpx.Client, body, n: int, status: int) -> list[float]:
    """Seconds each of n requests took (body: a dict, or a function of the request's number)."""
    out = []
    for i in range(n):
        payload = body(i) if callable(body) else body
        started = time.perf_counter()
        r = client.post("/v1/chat/completions", json=payload)
        out.append(time.perf_counter() - started)
        assert r.status_code == status, r.text
    return out


def summary(seconds: list[float]) -> dict:
    return {"n": len(seconds), "p50_ms": quantile(seconds, 0.5), "p99_ms": quantile(seconds, 0.99)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--misses", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--port", type=int, default=8974)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--busy", action="store_true", help="a CPU-bound Python process beside the server throughout")
    args = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="inferd-response-cache-"))
    command = text_server_command(folder, args.port, KEY, "--response-cache-ttl-s", "300")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    proc = started_server(command, f"http://127.0.0.1:{args.port}/ready", {"PYTHONPATH": str(ROOT)},
                          "inferd-response-cache")
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}],
           "max_tokens": args.max_tokens, "temperature": 0}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=120,
                          headers={"authorization": f"Bearer {KEY}"}) as client:
            timed(client, ask, 20, 200)  # fills the cache, warms the path
            timed(client, {"model": MODEL, "messages": "?"}, 20, 400)
            floor = timed(client, {"model": MODEL, "messages": "?"}, args.requests, 400)
            hit = timed(client, ask, args.requests, 200)
            miss = timed(client, lambda i: ask | {"cache": False, "messages": [
                {"role": "user", "content": f"Name a colour ({i})."}]}, args.misses, 200)
    finally:
        stopped(proc)
        if busy is not None:
            busy.kill()
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": describe() | {"load_average_before": os.getloadavg(),
                                       "shared": "a busy Python loop beside" if args.busy else "nothing else running"},
              "settings": vars(args) | {"out": args.out.name if args.out else None},
              "hit": summary(hit), "floor": summary(floor), "miss": summary(miss),
              "hit_added_p50_ms": round((statistics.median(hit) - statistics.median(floor)) * 1e3, 3)}
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "settings")}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
