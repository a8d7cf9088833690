"""Batches on `inferd serve` (SmolLM2-135M, one replica): throughput alone, and beside interactive traffic.

Workload: chat, a short prompt (each different), --max-tokens output tokens (ignore_eos).
1. capacity: the same requests sent interactively by --concurrency closed-loop clients: answers per second.
2. the batch alone: --lines lines, from create to completed: lines per second, against 1.
3. interactive alone, then interactive while a batch runs: Poisson arrivals at --rate for --seconds, streamed;
   p50/p95 TTFT and TPOT of each run side by side, and the batch lines done during the second.
Kill and restart mid-batch is tests/gateway/test_batches_e2e.py (real SIGKILL, same store).

    PYTHONPATH=. .venv/bin/python benchmarks/batch.py  # ~6 min on 2 cores
"""
import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import openai

from benchmarks.embeddings import ROOT, started_server, stopped
from inferd.control.replicas import free_port
from inferd.models.loader import default_model_path

KEY = "sk-bench-batch"
WORDS = "apple river stone cloud maple violet copper meadow lantern harbor".split()


def body(i: int, max_tokens: int, rng: random.Random) -> dict:
    return {"messages": [{"role": "user", "content": f"{i} " + " ".join(rng.choices(WORDS, k=12))}],
            "max_tokens": max_tokens, "ignore_eos": True}


def q(xs: list[float], p: float) -> float | None:
    return round(sorted(xs)[min(int(p * len(xs)), len(xs) - 1)] * 1000, 1) if xs else None


async def capacity(url: str, n: int, concurrency: int, max_tokens: int) -> float:
    rng, todo = random.Random(1), list(range(n))
    async with httpx.AsyncClient(timeout=300, headers={"authorization": f"Bearer {KEY}"}) as client:
        async def worker() -> None:
            while todo:
                r = await client.post(f"{url}/v1/chat/completions", json=body(todo.pop(), max_tokens, rng))
                r.raise_for_status()
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - start)


def start_batch(api: openai.OpenAI, n: int, max_tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    lines = b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": body(10_000 * seed + i, max_tokens, rng)}).encode() + b"\n" for i in range(n))
    f = api.files.create(file=("in.jsonl", lines), purpose="batch")
    return api.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id


async def interactive(url: str, rate: float, seconds: float, max_tokens: int) -> dict:
    rng, ttft, tpot, failed = random.Random(7), [], [], 0
    async with httpx.AsyncClient(timeout=300, headers={"authorization": f"Bearer {KEY}"}) as client:
        async def one(i: int, at: float) -> None:
            nonlocal failed
            await asyncio.sleep(max(at - time.perf_counter(), 0))
            first = last = None
            async with client.stream("POST", f"{url}/v1/chat/completions",
                                     json=body(i, max_tokens, rng) | {"stream": True}) as r:
                if r.status_code != 200:
                    failed += 1
                    return
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        last = time.perf_counter()
                        first = first or last
            ttft.append(first - at)
            tpot.append((last - first) / max(max_tokens - 1, 1))
        start, arrivals, t = time.perf_counter(), [], 0.0
        while (t := t + random.Random(len(arrivals)).expovariate(rate)) < seconds:
            arrivals.append(start + t)
        await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals)))
    return {"requests": len(arrivals), "failed": failed, "ttft_p50_ms": q(ttft, 0.5), "ttft_p95_ms": q(ttft, 0.95),
            "tpot_p50_ms": q(tpot, 0.5), "tpot_p95_ms": q(tpot, 0.95)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lines", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rate", type=float, default=0.5, help="interactive requests per second")
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "batch"))
    args = p.parse_args()
    tmp, port = Path(tempfile.mkdtemp()), free_port()
    url = f"http://127.0.0.1:{port}"
    proc = started_server([sys.executable, "-m", "inferd.cli", "serve", str(default_model_path()), "--port", str(port),
                           "--api-key", KEY, "--db", f"sqlite:///{tmp / 'db.sqlite'}", "--usage-journal",
                           str(tmp / "usage.journal"), "--files-dir", str(tmp / "files"), "--embedding-model", "none",
                           "--classical-model", "none", "--policy-model", "none", "--max-num-seqs",
                           str(args.concurrency)], f"{url}/ready", {"PYTHONPATH": str(ROOT)}, "batch-bench")
    api = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=60)
    try:
        cap = asyncio.run(capacity(url, args.lines // 2, args.concurrency, args.max_tokens))
        start, batch_id = time.perf_counter(), start_batch(api, args.lines, args.max_tokens, 1)
        while (b := api.batches.retrieve(batch_id)).status not in ("completed", "failed"):
            time.sleep(0.2)
        alone_s = time.perf_counter() - start
        assert b.status == "completed" and b.request_counts.completed == args.lines, b
        quiet = asyncio.run(interactive(url, args.rate, args.seconds, args.max_tokens))
        batch_id = start_batch(api, args.lines * 10, args.max_tokens, 2)
        while api.batches.retrieve(batch_id).status != "in_progress":
            time.sleep(0.2)
        before = api.batches.retrieve(batch_id).request_counts.completed
        busy = asyncio.run(interactive(url, args.rate, args.seconds, args.max_tokens))
        during = api.batches.retrieve(batch_id).request_counts.completed - before
        api.batches.cancel(batch_id)
    finally:
        stopped(proc)
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": f"{os.cpu_count()} cores",
        "model": default_model_path().name, "settings": vars(args) | {"out": Path(args.out).name},
        "capacity_req_s": round(cap, 3), "batch_alone_lines_s": round(args.lines / alone_s, 3),
        "batch_share_of_capacity": round(args.lines / alone_s / cap, 3),
        "interactive_alone": quiet, "interactive_with_batch": busy,
        "batch_lines_done_during_interactive": during,
        "batch_lines_s_during_interactive": round(during / args.seconds, 3)}
    Path(args.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    rows = [("p50 TTFT (ms)", "ttft_p50_ms"), ("p95 TTFT (ms)", "ttft_p95_ms"), ("p50 TPOT (ms)", "tpot_p50_ms"),
            ("p95 TPOT (ms)", "tpot_p95_ms"), ("requests", "requests"), ("failed", "failed")]
    md = [f"# Batches beside interactive traffic ({result['date']}, {result['machine']}, {result['model']})", "",
          f"Capacity (interactive, {args.concurrency} closed-loop clients, {args.max_tokens} output tokens): "
          f"{result['capacity_req_s']} req/s. A {args.lines}-line batch alone: {result['batch_alone_lines_s']} "
          f"lines/s ({result['batch_share_of_capacity']:.0%} of capacity).", "",
          f"Interactive at {args.rate} req/s for {args.seconds:.0f} s, streamed:", "",
          "| | alone | with a batch running |", "| --- | --- | --- |",
          *(f"| {name} | {quiet[k]} | {busy[k]} |" for name, k in rows), "",
          f"The batch meanwhile: {during} lines ({result['batch_lines_s_during_interactive']} lines/s).", ""]
    Path(args.out + ".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
