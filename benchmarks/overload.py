"""Overload of `inferd serve` (SmolLM2-135M, one replica): capacity, then 3x and 10x of it, open loop.

Chat requests (a short prompt, 32 output tokens, each prompt different) arrive as a Poisson process; latency is
measured from each request's scheduled time. Capacity: the completed requests per second at a rate well
above what the replica can do (the queue bounded, so the excess is refused). Then 3x and 10x of capacity for
--seconds each. Per rate: goodput (answers 200 within --slo-s per second), rejections (429/503) and their
latency as the client measures it (p50/p99) beside the client's own event-loop lag (a 10 ms sleep's
overshoot: what of a p99 is the client's), errors, requests past their deadline. After the load: from
/metrics, the gateway's queue length, in-flight count (per deployment and per replica), the concurrency leases
it holds (the tenant has a max_concurrency limit, so every request takes one) and usage records pending, all
of which must be 0 (`after_load_all_zero`); the RSS of the gateway process before/after. With --soak-minutes,
then --soak-factor x capacity for that long: the gateway's RSS before and after (goal: within 10 %).
The client (--client raw, the default) writes each request on a connection of its own with no HTTP library, so
that its own work on the shared cores stays out of the latencies; --client httpx measures through httpx's pool.

    PYTHONPATH=. .venv/bin/python benchmarks/overload.py  # ~3 min on 2 cores
    PYTHONPATH=. .venv/bin/python benchmarks/overload.py --soak-minutes 5 --out benchmarks/results/overload-soak.json
"""
import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from benchmarks.machine import describe
from benchmarks.embeddings import ROOT, started_server, stopped
from inferd.bench.lag import LagMonitor
from inferd.gateway.store import Store
from inferd.models.loader import default_model_path

KEY = "sk-bench-overload"
WORDS = "apple river stone cloud maple violet copper meadow lantern harbor".split()


def rss_mib(pid: int) -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1)) / 1024


def quantile(xs: list[float], q: float) -> float | None:
    return round(sorted(xs)[min(int(q * len(xs)), len(xs) - 1)] * 1000, 2) if xs else None


async def post_json(host: str, port: int, path: str, body: dict, headers: dict) -> tuple[int, dict]:
    """One POST on a connection of its own (`connection: close`), read to the end: a client with next to no
    work of its own per request, so that what it times is the server's."""
    payload = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(payload)}\r\nconnection: close\r\n{head}\r\n".encode() + payload)
        response = await reader.read()
    finally:
        writer.close()
    status_line, _, rest = response.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])  # JSON with a content-length


async def run_rate(url: str, rate: float, seconds: float, slo_s: float, client: str = "raw") -> dict:
    rng = random.Random(17)
    ok, rejected, rejected_from_send, errors = [], [], [], []
    codes: dict[str, int] = {}
    host, port = url.removeprefix("http://").split(":")
    headers = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=4096)) as pool:
        async def send(body: dict) -> tuple[int, dict]:
            if client == "raw":
                return await asyncio.wait_for(post_json(host, int(port), "/v1/chat/completions", body, headers), 120)
            r = await pool.post(f"{url}/v1/chat/completions", json=body, headers=headers)
            return r.status_code, r.json()

        async def one(i: int, at: float) -> None:
            await asyncio.sleep(max(at - time.perf_counter(), 0))
            body = {"messages": [{"role": "user", "content": f"{i} " + " ".join(rng.choices(WORDS, k=12))}],
                    "max_tokens": 32, "ignore_eos": True}
            sent = time.perf_counter()
            try:
                status, answer = await send(body)
            except (httpx.HTTPError, OSError, asyncio.TimeoutError, ValueError) as exc:
                errors.append(type(exc).__name__)
                return
            latency = time.perf_counter() - at
            if status == 200:
                ok.append(latency)
            elif status in (429, 503):
                rejected.append(latency)
                rejected_from_send.append(time.perf_counter() - sent)
                code = answer["error"]["code"]
                codes[code] = codes.get(code, 0) + 1
            else:
                errors.append(str(status))

        lag = LagMonitor()
        watch = asyncio.create_task(lag.run())  # the client's own delay is inside what it measures
        t0, at, tasks = time.perf_counter() + 0.2, 0.0, []
        while at < seconds:
            tasks.append(asyncio.create_task(one(len(tasks), t0 + at)))
            at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        watch.cancel()
    good = [x for x in ok if x <= slo_s]
    return {"rate_per_s": round(rate, 2), "seconds": seconds, "sent": len(tasks), "answered": len(ok),
            "goodput_per_s": round(len(good) / seconds, 2), "answered_p50_ms": quantile(ok, 0.5),
            "answered_p99_ms": quantile(ok, 0.99), "rejected": len(rejected), "rejection_codes": codes,
            "rejection_p50_ms": quantile(rejected, 0.5), "rejection_p99_ms": quantile(rejected, 0.99),
            "rejection_max_ms": quantile(rejected, 1.0),
            "rejection_from_send_p50_ms": quantile(rejected_from_send, 0.5),
            "rejection_from_send_p99_ms": quantile(rejected_from_send, 0.99), "errors": len(errors), "error_kinds": sorted(set(errors)),
            "client_lag_ms": {k: round(v, 2) for k, v in lag.summary().items()}}


AFTER_LOAD = ("inferd_gateway_queue_length", "inferd_gateway_inflight_requests",
              "inferd_gateway_replica_inflight_requests", "inferd_gateway_concurrency_leases",
              "inferd_gateway_usage_records_pending")


def gateway_state(url: str) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for name in AFTER_LOAD:
        out[name] = sum(float(m) for m in re.findall(rf"^{name}{{?[^\n]*}}? ([0-9.e+-]+)$", text, re.M))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=20.0, help="per rate (the issue asks 60)")
    p.add_argument("--capacity-seconds", type=float, default=20.0)
    p.add_argument("--slo-s", type=float, default=5.0, help="an answer within this counts as goodput")
    p.add_argument("--max-inflight", type=int, default=16)
    p.add_argument("--max-queue-len", type=int, default=4, help="short, so that a wait stays within the SLO")
    p.add_argument("--num-threads", type=int, default=1, help="the replica's engine threads")
    p.add_argument("--soak-minutes", type=float, default=0.0, help="then this long at --soak-factor x capacity")
    p.add_argument("--soak-factor", type=float, default=5.0)
    p.add_argument("--port", type=int, default=8971)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "overload.json")
    p.add_argument("--client", choices=("raw", "httpx"), default="raw",
                   help="raw: a connection per request, no client library; httpx: one AsyncClient's pool")
    p.add_argument("--machine-note", default="", help="what else ran on the machine, for the report")
    args = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="inferd-overload-"))
    url = f"http://127.0.0.1:{args.port}"
    command = [sys.executable, "-m", "inferd.cli", "serve", str(default_model_path()), "--port", str(args.port), "--api-key", KEY,
               "--db", f"sqlite:///{folder / 'inferd.db'}", "--usage-journal", str(folder / "usage.journal"),
               "--embedding-model", "none", "--classical-model", "none", "--policy-model", "none",
               "--max-model-len", "512", "--num-threads", str(args.num_threads),
               "--max-inflight", str(args.max_inflight), "--max-queue-len", str(args.max_queue_len),
               "--log-level", "warning"]
    store = Store(f"sqlite:///{folder / 'inferd.db'}")  # the key's tenant, with a concurrency limit to lease
    store.migrate()
    store.create_tenant("default", limits={"max_concurrency": 100_000})
    store.close()
    load_before = os.getloadavg()
    proc = started_server(command, f"{url}/ready", {"PYTHONPATH": str(ROOT)}, "inferd-overload")
    try:
        asyncio.run(run_rate(url, 2.0, 3.0, args.slo_s, args.client))  # warm up
        rss_before = rss_mib(proc.pid)
        probe = asyncio.run(run_rate(url, 40.0, args.capacity_seconds, args.slo_s, args.client))
        capacity = max(probe["answered"] / args.capacity_seconds, 0.5)
        at_capacity = asyncio.run(run_rate(url, capacity, args.seconds, args.slo_s, args.client))
        rates = {"capacity_probe": probe, "1x": at_capacity}
        for factor in (3, 10):
            rates[f"{factor}x"] = asyncio.run(run_rate(url, factor * capacity, args.seconds, args.slo_s, args.client))
        time.sleep(2.0)
        after = gateway_state(url)
        rss_after = rss_mib(proc.pid)
        soak = None
        if args.soak_minutes:
            x = asyncio.run(run_rate(url, args.soak_factor * capacity, args.soak_minutes * 60, args.slo_s,
                                     args.client))
            time.sleep(2.0)
            soak = {"rate": x, "after_load": gateway_state(url), "rss_mib_before": round(rss_after, 1),
                    "rss_mib_after": round(rss_mib(proc.pid), 1)}
            soak["rss_ratio"] = round(soak["rss_mib_after"] / soak["rss_mib_before"], 3)
    finally:
        stopped(proc)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": describe() | {"load_average_before": load_before,
                                       "shared": args.machine_note or "nothing else running"},
              "settings": vars(args) | {"out": args.out.name, "model": "SmolLM2-135M-Instruct (default)"},
              "capacity_per_s": round(capacity, 2), "rates": rates, "after_load": after,
              "after_load_all_zero": not any(after.values()),
              "gateway_rss_mib": {"before": round(rss_before, 1), "after": round(rss_after, 1)}}
    if soak is not None:
        result["soak"] = soak
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    lines = [f"# Overload of `inferd serve` ({r['date']})", "",
             f"Machine: {r['machine'].get('cpu', '')} {r['machine']['cores']} cores ({r['machine']['shared']}), load before "
             f"{r['machine']['load_average_before'][0]:.2f}. Model: SmolLM2-135M-Instruct, one replica, "
             f"{r['settings']['num_threads']} engine thread(s); gateway --max-inflight "
             f"{r['settings']['max_inflight']} --max-queue-len {r['settings']['max_queue_len']}. Chat, 32 output "
             f"tokens, open loop (Poisson), {r['settings']['seconds']:g} s per rate (the issue asks 60 s), "
             f"client {r['settings'].get('client', 'httpx')}. "
             f"SLO: answered within {r['settings']['slo_s']:g} s.", "",
             f"Capacity: **{r['capacity_per_s']} req/s** (answered per second at 40 req/s offered).", "",
             "Rejection latency from each request's scheduled time (what the open-loop client's own lateness "
             "adds is in it) and from when the client began to send it.", "",
             "| rate | offered/s | goodput/s | answered p50 ms | rejected | rejection p50 ms | p99 ms | max ms "
             "| from send p50 ms | from send p99 ms | client loop lag p99 ms | errors | codes |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, x in r["rates"].items():
        lag = x.get("client_lag_ms", {}).get("p99_ms")
        lines.append(f"| {name} | {x['rate_per_s']} | {x['goodput_per_s']} | {x['answered_p50_ms']} | {x['rejected']} "
                     f"| {x['rejection_p50_ms']} | {x['rejection_p99_ms']} | {x['rejection_max_ms']} "
                     f"| {x.get('rejection_from_send_p50_ms')} | {x.get('rejection_from_send_p99_ms')} | {lag} "
                     f"| {x['errors']} | {x['rejection_codes']} |")
    a, m = r["after_load"], r["gateway_rss_mib"]
    lines += ["", f"After the load (2 s later): queue length {a['inferd_gateway_queue_length']:g}, in flight "
              f"{a['inferd_gateway_inflight_requests']:g} (on replicas "
              f"{a.get('inferd_gateway_replica_inflight_requests', 0):g}), concurrency leases "
              f"{a.get('inferd_gateway_concurrency_leases', 0):g}, usage records pending "
              f"{a['inferd_gateway_usage_records_pending']:g}; gateway RSS {m['before']} MiB before, {m['after']} MiB "
              "after.", ""]
    if "soak" in r:
        s, x = r["soak"], r["soak"]["rate"]
        lines += [f"Soak: {r['settings']['soak_factor']:g}x capacity ({x['rate_per_s']} req/s) for "
                  f"{r['settings']['soak_minutes']:g} min: {x['sent']} sent, {x['answered']} answered, {x['rejected']} "
                  f"rejected (p99 {x['rejection_p99_ms']} ms), {x['errors']} errors. Gateway RSS {s['rss_mib_before']} "
                  f"MiB before, {s['rss_mib_after']} MiB after: **ratio {s['rss_ratio']}** (goal at most 1.10). After "
                  f"it: {s['after_load']}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
