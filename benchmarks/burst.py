"""A burst: N chat requests arriving at once at `inferd serve`, on connections opened beforehand, so that only
the requests burst. What the queue cannot hold is refused (429 tenant_queue_share, 503 queue_full); this times
each request's status line from the moment its bytes were written, refusals and admissions apart.

The client is as light as a client gets: raw sockets, every request written in one loop, then each status line
read. Admitted requests stream (their status line is their first token's head) and are closed once it came, or
after --wait-s if it has not (those still queued: "waiting").
Rounds take turns with a pause for the server to settle; medians of the rounds' percentiles.

--floor sends the same bursts to a bare ASGI app on uvicorn (as `inferd serve` runs it: httptools, uvloop) that
reads each body, parses its JSON and refuses it 429 with no other work: what the HTTP server and this client cost
on this machine, the least any app behind uvicorn can answer the burst in.

    PYTHONPATH=. .venv/bin/python benchmarks/burst.py --out benchmarks/results/burst.json
    PYTHONPATH=. .venv/bin/python benchmarks/burst.py --floor --out benchmarks/results/burst-floor.json
"""
import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.embeddings import ROOT, started_server, stopped, text_server_command
from benchmarks.machine import describe
from benchmarks.overload import quantile
from inferd.gateway.store import Store

KEY = "sk-bench-burst"
WORDS = "apple river stone cloud maple violet copper meadow lantern harbor".split()


def request_bytes(port: int, i: int, prompt_words: int) -> bytes:
    words = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(prompt_words))
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 16, "stream": True,
                       "messages": [{"role": "user", "content": f"{i}: {words}"}]}).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nauthorization: Bearer {KEY}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body


async def burst(port: int, n: int, prompt_words: int, wait_s: float) -> dict:
    """One burst: the status and seconds to the status line of each request."""
    conns = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", port) for _ in range(n)))
    payloads = [request_bytes(port, i, prompt_words) for i in range(n)]
    await asyncio.sleep(0.5)  # the server has accepted every connection

    async def status(i: int, reader: asyncio.StreamReader, sent_s: float) -> tuple[int | str, float]:
        try:
            async with asyncio.timeout(wait_s):
                line = await reader.readline()
        except TimeoutError:
            return "waiting", wait_s
        return int(line.split()[1]), time.perf_counter() - sent_s

    sent = []
    for (_, writer), payload in zip(conns, payloads):
        writer.write(payload)
        sent.append(time.perf_counter())
    written_ms = (sent[-1] - sent[0]) * 1e3  # how long the client took to send the burst
    try:
        results = await asyncio.gather(*(status(i, r, s) for i, ((r, _), s) in enumerate(zip(conns, sent))))
    finally:
        for _, writer in conns:
            writer.close()
    refused = [s for code, s in results if code in (429, 503)]
    admitted = [s for code, s in results if code == 200]
    codes: dict[str, int] = {}
    for code, _ in results:
        codes[str(code)] = codes.get(str(code), 0) + 1
    return {"codes": codes, "written_ms": round(written_ms, 2), "refusal_ms": {"p50": quantile(refused, 0.5), "p99": quantile(refused, 0.99),
                                           "max": quantile(refused, 1.0)},
            "admitted_first_token_ms": {"p50": quantile(admitted, 0.5), "p99": quantile(admitted, 0.99)}}


FLOOR_APP = """
import json, sys, uvicorn

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        return await send({"type": "lifespan.shutdown.complete"})
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] != "/ready":
        json.loads(body)
    status = 200 if scope["path"] == "/ready" else 429
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": b'{"error":{"message":"refused","type":"rate_limit"}}'})

uvicorn.run(app, port=int(sys.argv[1]), log_level="warning", access_log=False)
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--prompt-words", type=int, default=200, help="about 256 prompt tokens with the template")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--wait-s", type=float, default=10.0, help="how long an admitted request's status may take")
    p.add_argument("--port", type=int, default=8973)
    p.add_argument("--serve-args", default="", help="more `inferd serve` flags")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--machine-note", default="", help="what else ran on the machine, for the report")
    p.add_argument("--floor", action="store_true", help="a bare ASGI app on uvicorn that refuses everything")
    args = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="inferd-burst-"))
    command = text_server_command(folder, args.port, KEY, *args.serve_args.split())
    if args.floor:
        command = [sys.executable, "-c", FLOOR_APP, str(args.port)]
    else:
        store = Store(f"sqlite:///{folder / 'inferd.db'}")  # the key's tenant, with no concurrency limit to hit first
        store.migrate()
        store.create_tenant("default", limits={"max_concurrency": 100_000})
        store.close()
    proc = started_server(command, f"http://127.0.0.1:{args.port}/ready", {"PYTHONPATH": str(ROOT)}, "inferd-burst")
    rounds = []
    try:
        for _ in range(args.rounds):
            rounds.append(asyncio.run(burst(args.port, args.requests, args.prompt_words, args.wait_s)))
            print(json.dumps(rounds[-1]), flush=True)
            time.sleep(5.0)  # the admitted requests were cancelled; the engine drains
    finally:
        stopped(proc)

    def median(path: tuple[str, str]) -> float | None:
        xs = [r[path[0]][path[1]] for r in rounds if r[path[0]][path[1]] is not None]
        return statistics.median(xs) if xs else None
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": describe() | {"load_average_before": os.getloadavg(),
                                       "shared": args.machine_note or "nothing else running"},
              "settings": vars(args) | {"out": args.out.name if args.out else None},
              "refusal_ms_p50": median(("refusal_ms", "p50")), "refusal_ms_p99": median(("refusal_ms", "p99")),
              "admitted_first_token_ms_p50": median(("admitted_first_token_ms", "p50")), "rounds": rounds}
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
