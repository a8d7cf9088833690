"""Embeddings over HTTP at fixed arrival rates, in one run: `inferd serve` (gateway + embedding replica, what a
user calls), inferd's embedding replica alone, and infinity-emb (bf16, its better dtype here) serving the same
unpacked all-MiniLM-L6-v2.

Open loop: single-input requests (~16-token texts, each different) arrive as a Poisson process at each rate for
--seconds; latency is measured from each request's scheduled time, so a server that falls behind pays for its
queue. A rate is held when p99 <= --p99-ms, no request failed and at least 95 % of the offered rate was served.
The servers, in turn, share the 2 cores with this client.

    PYTHONPATH=. .venv/bin/python benchmarks/embeddings_open_loop.py  # ~4 min; needs benchmarks/.venvs/infinity
"""
import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from benchmarks.embeddings import ROOT, infinity_server, infinity_version, inferd_server, machine, started_server, \
    stopped, texts
from inferd.models.sentence import load_embedding_model

KEY = "sk-bench-open-loop"
RATES = (25, 50, 100, 200, 300, 400)


async def run_rate(url: str, model: str, key: str | None, pool: list[str], rate: float, seconds: float) -> dict:
    rng, latencies, failed = random.Random(7), [], 0
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=512)) as client:
        async def one(i: int, at: float) -> None:
            nonlocal failed
            await asyncio.sleep(max(at - time.perf_counter(), 0))
            try:
                r = await client.post(url, json={"input": pool[i % len(pool)], "model": model,
                                                 "encoding_format": "base64"}, headers=headers)
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                latencies.append((time.perf_counter() - at) * 1000)
            else:
                failed += 1
        start, t, arrivals = time.perf_counter() + 0.2, 0.0, []
        while t < seconds:
            arrivals.append(start + t)
            t += rng.expovariate(rate)
        began = time.perf_counter()
        await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals)))
        wall = time.perf_counter() - began
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [float("nan")] * 99
    return {"rate": rate, "offered": len(arrivals), "served_per_s": round(len(latencies) / wall, 1),
            "failed": failed, "p50_ms": round(q[49], 1), "p99_ms": round(q[98], 1)}


def measure(name: str, url: str, model: str, key: str | None, pool: list[str], args) -> dict:
    rows = []
    for rate in RATES:
        asyncio.run(run_rate(url, model, key, pool, 10, 1.0))  # warm the connections and the model
        row = asyncio.run(run_rate(url, model, key, pool, rate, args.seconds))
        row["held"] = row["failed"] == 0 and row["p99_ms"] <= args.p99_ms and row["served_per_s"] >= 0.95 * rate
        rows.append(row)
        print(f"  {name:28s} {rate:4d}/s: p50 {row['p50_ms']:7.1f} ms p99 {row['p99_ms']:7.1f} ms "
              f"served {row['served_per_s']:6.1f}/s failed {row['failed']}", flush=True)
        if not row["held"] and row["p99_ms"] > 10 * args.p99_ms:
            break  # far past its capacity: higher rates only pile up
    held = [r["rate"] for r in rows if r["held"]]
    return {"rows": rows, "max_rate_held": max(held, default=0)}


def inferd_serve(port: int, folder: Path) -> object:
    spec = folder / "deploy.yaml"
    spec.write_text("deployments:\n  - name: all-MiniLM-L6-v2\n    kind: embedding\n    model: {source: default}\n")
    command = [sys.executable, "-m", "inferd.cli", "serve", "--config", str(spec), "--port", str(port),
               "--api-key", KEY, "--db", f"sqlite:///{folder / 'inferd.db'}", "--spill-path",
               str(folder / "spill.jsonl"), "--log-level", "warning"]
    return started_server(command, f"http://127.0.0.1:{port}/ready", {"PYTHONPATH": str(ROOT)}, "inferd-serve")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "embeddings-open-loop.json")
    p.add_argument("--seconds", type=float, default=4.0, help="seconds of arrivals per rate")
    p.add_argument("--p99-ms", type=float, default=50.0)
    p.add_argument("--port", type=int, default=8960)
    args = p.parse_args()
    files = load_embedding_model()
    pool = texts(files.tokenizer, 16, 512)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "p99_ms": args.p99_ms, "seconds": args.seconds, "systems": {}}
    with tempfile.TemporaryDirectory() as folder:
        targets = [("inferd serve (gateway)", lambda: inferd_serve(args.port, Path(folder)),
                    f"http://127.0.0.1:{args.port}/v1/embeddings", "all-MiniLM-L6-v2", KEY),
                   ("inferd embedding replica", lambda: inferd_server(args.port + 1),
                    f"http://127.0.0.1:{args.port + 1}/v1/embeddings", "all-MiniLM-L6-v2", None),
                   (f"infinity-emb {infinity_version()} (bf16)",
                    lambda: infinity_server(files.directory, args.port + 2, "bfloat16"),
                    f"http://127.0.0.1:{args.port + 2}/embeddings", "minilm", None)]
        for name, start, url, model, key in targets:
            proc = start()
            try:
                result["systems"][name] = measure(name, url, model, key, pool, args)
            finally:
                stopped(proc)
    result["machine"]["load_average_after"] = os.getloadavg()
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(args.out.with_suffix(".md").read_text())


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Embeddings at fixed arrival rates ({result['date']})", "",
             f"{m['cpu']}, {m['cores']} cores, a shared machine (load average before {m['load_average_before']}, "
             f"after {m['load_average_after']}). Single-input requests (~16 tokens), Poisson arrivals, "
             f"{result['seconds']:g} s per rate; held = p99 <= {result['p99_ms']:g} ms, no failures, >= 95 % served.",
             "", "| system | rate/s | p50 ms | p99 ms | served/s | failed | held |", "|---|---|---|---|---|---|---|"]
    for name, s in result["systems"].items():
        for r in s["rows"]:
            lines.append(f"| {name} | {r['rate']} | {r['p50_ms']} | {r['p99_ms']} | {r['served_per_s']} | "
                         f"{r['failed']} | {'yes' if r['held'] else 'no'} |")
    lines += ["", "| system | highest rate held |", "|---|---|"]
    lines += [f"| {name} | {s['max_rate_held']}/s |" for name, s in result["systems"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
