"""CPU time per single-row request: inferd (gateway + classical replica) against the plain unbatched server
of benchmarks/classical.py (Starlette + the library), the same models and bodies.

A closed loop of --requests single-row requests (concurrency 8) per system and model; the CPU seconds each
server process used over them (user + system, /proc/PID/stat), divided by the requests. On a machine whose
cores the load generator shares, a system's highest arrival rate is bounded by its CPU per request, so
this says what benchmarks/classical.py's rate sweep can and cannot show.

    python benchmarks/classical_cpu.py --out benchmarks/results/classical_cpu.json
"""
import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import classical as bench  # noqa: E402  (its models, bodies, servers and targets)


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> dict[int, str]:
    """pid and its descendants, with their command lines (to name the gateway and the replicas)."""
    out, children = {}, {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(p))
        except OSError:
            continue
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            out[p] = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:
            continue
        todo += children.get(p, [])
    return out


def process_name(cmdline: str) -> str:
    """inferd's gateway or replica (with its kind and model file), or the peer's script: no machine paths."""
    if " -m inferd.cli serve" in cmdline:
        return "inferd gateway"
    if " -m inferd.cli replica" in cmdline:
        model = next((Path(a).name for a in cmdline.split() if "." in Path(a).name and "/" in a), "")
        return f"inferd replica {model}".strip()
    return Path(cmdline.split()[1]).name if len(cmdline.split()) > 1 else cmdline


async def closed_loop(url: str, headers: dict, bodies: list[bytes], n: int, concurrency: int = 8) -> float:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency), timeout=30) as client:
        queue = asyncio.Queue()
        for i in range(n):
            queue.put_nowait(bodies[i % len(bodies)])

        async def worker():
            while not queue.empty():
                r = await client.post(url, content=queue.get_nowait(), headers=headers | {"content-type": "application/json"})
                assert r.status_code == 200, r.text

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = {"machine": bench.machine(),
               "date": time.strftime("%Y-%m-%d"), "requests": args.requests, "cells": []}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        X, names = bench.train(directory)
        for system, port in (("inferd", 8990), ("plain", 8992)):
            proc = bench.inferd(directory, port) if system == "inferd" else bench.peer("plain", directory, port)
            try:
                for model in bench.MODELS:
                    t = bench.target(system, model, port)
                    url, bodies = f"http://127.0.0.1:{port}{t.path}", bench.bodies(system, model, X, names, 1)
                    asyncio.run(closed_loop(url, t.headers, bodies, 200))  # warm
                    tree = process_tree(proc.pid)
                    before = {pid: cpu_s(pid) for pid in tree}
                    wall = asyncio.run(closed_loop(url, t.headers, bodies, args.requests))
                    used = {pid: cpu_s(pid) - before[pid] for pid in tree}
                    busy = {pid: round(s * 1000 / args.requests, 3) for pid, s in used.items()
                            if s * 1000 / args.requests >= 0.02}
                    cell = {"system": system, "model": model, "requests_per_s": round(args.requests / wall),
                            "cpu_ms_per_request": round(sum(used.values()) * 1000 / args.requests, 3),
                            "by_process": {process_name(tree[pid]): ms for pid, ms in busy.items()}}
                    print(json.dumps(cell), flush=True)
                    results["cells"].append(cell)
            finally:
                proc.terminate()
                proc.wait(30)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
