"""Faults under load, against real processes: the store and Redis down, replicas killed, one tenant against another.

outage:    `inferd serve` (one replica) on a PostgreSQL and a redis-server of this script's own. Chat at
           --rate req/s (open loop, Poisson) from a key the gateway has seen, and every 0.5 s one request from a
           key it has not (a fresh one each time); after --before-s both stores are stopped (pg_ctl stop -m
           immediate, SIGTERM to Redis) for --outage-s, then started again. Per phase: answered, refused by code,
           errors; when a new key works again after the restart; usage records lost and doubled (every answered
           request id looked up in PostgreSQL once the gateway's journal is empty); concurrency leases left in Redis.
crash:     `inferd serve --config` with two replicas of the default model. Chat at --crash-rate req/s (a quarter
           streamed); --trials times, with both replicas ready, one of them (at random) is killed with SIGKILL at
           a random moment, and the time until two are ready again is measured. Every non-200 answer is a request
           failed while the other replica was healthy; streams cut after their first byte are counted apart.
           Records: each answered request has exactly one `completed` record; each retried attempt its own.
isolation: one replica, two tenants. (1) Tenant A sends a prompt twice (its second is served from A's prefix
           cache), then tenant B sends the same prompt: B's cached_tokens and B's time to first token against a
           cold prompt of the same length (median of --probes prompts). (2) Tenant A's TTFT alone, then while
           tenant B (max_concurrency --flood-cap) floods with --flood-workers closed-loop clients: the ratio.

    PYTHONPATH=. .venv/bin/python benchmarks/faults.py               # all three, ~12 min on 2 cores
    PYTHONPATH=. .venv/bin/python benchmarks/faults.py --only crash  # one part; its result merged into the file
"""
import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from benchmarks.embeddings import ROOT, started_server, stopped
from inferd.gateway.redis_limiter import PREFIX
from inferd.gateway.store import Store
from inferd.models.loader import default_model_path
from tests.gateway.services import OwnPostgres, OwnRedis

KEY = "sk-bench-faults-key"
WORDS = "apple river stone cloud maple violet copper meadow lantern harbor".split()
OUT = ROOT / "benchmarks" / "results" / "faults.json"
MACHINE_NOTE = ["nothing else running"]  # --machine-note


def serve(args_: list[str], port: int, folder: Path, log: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "inferd.cli", "serve", "--port", str(port), "--api-key", KEY,
               "--usage-journal", str(folder / "usage.journal"), "--files-dir", str(folder / "files"),
               "--log-level", "warning", *args_]
    if "--db" not in args_:
        command += ["--db", f"sqlite:///{folder / 'inferd.db'}"]
    if "--config" not in args_:
        command += [str(default_model_path()), "--embedding-model", "none", "--classical-model", "none",
                    "--policy-model", "none", "--max-model-len", "1024", "--num-threads", "1"]
    return started_server(command, f"http://127.0.0.1:{port}/ready", {"PYTHONPATH": str(ROOT)}, log, 300)


def prompt(rng: random.Random, i: int, words: int = 12) -> list[dict]:
    return [{"role": "user", "content": f"{i} " + " ".join(rng.choices(WORDS, k=words))}]


def metric_sum(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M):
        if all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def wait_journal_empty(url: str, timeout_s: float = 60) -> float:
    start = time.monotonic()
    while metric_sum(url, "inferd_gateway_usage_records_pending") > 0 and time.monotonic() - start < timeout_s:
        time.sleep(0.25)
    return metric_sum(url, "inferd_gateway_usage_records_pending")


def median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 2) if xs else None


def quantile_ms(xs: list[float], q: float) -> float | None:
    return round(sorted(xs)[min(int(q * len(xs)), len(xs) - 1)] * 1000, 2) if xs else None


class Load:
    """Open-loop chat at a rate; each answer is (scheduled time, status, code, request id, cut mid-stream)."""

    def __init__(self, url: str, key: str, rate: float, max_tokens: int, stream_share: float = 0.0, seed: int = 17,
                 deadline_ms: int = 30_000):
        self.url, self.key, self.rate, self.max_tokens, self.stream_share = url, key, rate, max_tokens, stream_share
        self.headers = {"authorization": f"Bearer {key}", "x-inferd-deadline-ms": str(deadline_ms)}
        self.rng = random.Random(seed)
        self.answers: list[dict] = []
        self.stopping = False

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=1024)) as client:
            tasks, i, at = [], 0, time.monotonic()
            while not self.stopping:
                at += self.rng.expovariate(self.rate)
                await asyncio.sleep(max(at - time.monotonic(), 0))
                i += 1
                tasks.append(asyncio.create_task(self.one(client, i, self.rng.random() < self.stream_share)))
            await asyncio.gather(*tasks)

    async def one(self, client: httpx.AsyncClient, i: int, stream: bool) -> None:
        body = {"messages": prompt(self.rng, i), "max_tokens": self.max_tokens, "ignore_eos": True, "stream": stream}
        sent = time.monotonic()
        out = {"sent_s": sent, "stream": stream, "status": None, "code": None, "request_id": None, "cut": False}
        try:
            async with client.stream("POST", f"{self.url}/v1/chat/completions", json=body, headers=self.headers) as r:
                text = (await r.aread()).decode()
            out["status"], out["request_id"] = r.status_code, r.headers.get("x-request-id")
            if r.status_code != 200:
                out["code"] = json.loads(text)["error"]["code"]
            elif stream and (not text.endswith("data: [DONE]\n\n") or 'data: {"error"' in text):
                out["cut"] = True  # the stream had begun: the client got part of the answer, then an error event
        except httpx.HTTPError as exc:
            out["code"] = type(exc).__name__
        out["e2e_s"] = time.monotonic() - sent
        self.answers.append(out)


def tally(answers: list[dict]) -> dict:
    codes: dict[str, int] = {}
    for a in answers:
        if a["status"] != 200 or a["cut"]:
            key = f"{a['status']} {a['code']}" if not a["cut"] else "200 cut mid-stream"
            codes[key] = codes.get(key, 0) + 1
    ok = [a["e2e_s"] for a in answers if a["status"] == 200 and not a["cut"]]
    return {"sent": len(answers), "answered": len(ok), "not_answered": codes, "answered_p50_ms": quantile_ms(ok, 0.5),
            "answered_p99_ms": quantile_ms(ok, 0.99)}


# (a) the store and Redis down

async def outage_run(url: str, known: str, unseen: list[str], pg: OwnPostgres, redis_: OwnRedis,
                     args: argparse.Namespace) -> dict:
    load = Load(url, known, args.rate, 8)
    probes: list[dict] = []
    marks: dict[str, float] = {}

    async def probe_new_keys() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            for key in unseen:
                if load.stopping:
                    return
                sent = time.monotonic()
                r = await client.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
                probes.append({"sent_s": sent, "status": r.status_code, "latency_s": time.monotonic() - sent,
                               "code": r.json()["error"]["code"] if r.status_code != 200 else None})
                await asyncio.sleep(0.5)

    async def faults() -> None:
        await asyncio.sleep(args.before_s)
        await asyncio.to_thread(pg.stop)
        await asyncio.to_thread(redis_.stop)
        marks["down_s"] = time.monotonic()
        await asyncio.sleep(args.outage_s)
        marks["restart_s"] = time.monotonic()
        await asyncio.to_thread(pg.start)
        await asyncio.to_thread(redis_.start)
        marks["up_s"] = time.monotonic()
        await asyncio.sleep(args.after_s)
        load.stopping = True

    await asyncio.gather(load.run(), probe_new_keys(), faults())
    phases = {"before": (0, marks["down_s"]), "outage": (marks["down_s"], marks["up_s"]),
              "after": (marks["up_s"], float("inf"))}
    out = {}
    for name, (lo, hi) in phases.items():
        mine = [p for p in probes if lo <= p["sent_s"] < hi]
        codes: dict[str, int] = {}
        for p in mine:
            k = f"{p['status']} {p['code'] or ''}".strip()
            codes[k] = codes.get(k, 0) + 1
        out[name] = {"seen_key": tally([a for a in load.answers if lo <= a["sent_s"] < hi]),
                     "new_keys": codes,
                     "new_key_refusal_p50_ms": quantile_ms([p["latency_s"] for p in mine if p["status"] == 503], 0.5)}
    back = [p["sent_s"] for p in probes if p["sent_s"] >= marks["up_s"] and p["status"] == 200]
    out["new_key_works_s_after_restart"] = round(back[0] - marks["up_s"], 2) if back else None
    out["stores_restart_s"] = round(marks["up_s"] - marks["restart_s"], 2)
    out["answered_ids"] = [a["request_id"] for a in load.answers if a["status"] == 200]
    return out


def outage(args: argparse.Namespace) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="inferd-faults-"))
    pg, redis_ = OwnPostgres(), OwnRedis(str(folder))
    pg.start()
    redis_.start()
    store = Store(pg.url)
    store.migrate()
    tenant = store.create_tenant("outage", limits={"rpm": 1_000_000, "max_concurrency": 64})
    _, known = store.create_key("outage")
    unseen = [store.create_key("outage")[1].key for _ in range(int(
        (args.before_s + args.outage_s + args.after_s) * 2) + 10)]
    store.close()
    url = f"http://127.0.0.1:{args.port}"
    proc = serve(["--db", pg.url, "--redis-url", redis_.url, "--max-inflight", "16"], args.port, folder,
                 "inferd-faults-outage")
    try:
        httpx.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {known.key}"}, timeout=60,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).raise_for_status()
        result = asyncio.run(outage_run(url, known.key, unseen, pg, redis_, args))
        pending = wait_journal_empty(url)
        engine = Store(pg.url).engine
        from sqlalchemy import text
        with engine.connect() as conn:
            stored = [r[0] for r in conn.execute(text("SELECT request_id FROM usage_records"))]
        engine.dispose()
        import redis
        direct = redis.Redis(port=redis_.port)
        leases = direct.zcard(f"{PREFIX}{tenant.id}:concurrency")
        direct.close()
    finally:
        stopped(proc)
        redis_.stop()
        pg.remove()
    answered = result.pop("answered_ids")
    counts = {i: 0 for i in answered}
    for i in stored:
        if i in counts:
            counts[i] += 1
    result["records"] = {"answered": len(answered), "lost": sum(1 for n in counts.values() if n == 0),
                         "doubled": sum(1 for n in counts.values() if n > 1), "journal_pending_at_end": pending}
    result["redis_concurrency_leases_left"] = leases
    return result


# (b) replica crashes

CRASH_SPEC = """
deployments:
  - name: chat
    model: {{source: default}}
    runtime: {{dtype: float32, max_num_seqs: 4, max_model_len: 512, kv_cache_gib: 0.1, num_threads: 1}}
    replicas: 2
    router: {{policy: {router}}}
"""


def replica_pids(parent: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(fields[1]) == parent and b"replica" in cmd:
            out.append(int(stat.parent.name))
    return out


async def crash_run(url: str, pid: int, args: argparse.Namespace) -> tuple[Load, list[dict]]:
    load = Load(url, KEY, args.crash_rate, 16, stream_share=0.25, seed=5)
    rng = random.Random(11)
    trials = []

    async def ready() -> float:
        return await asyncio.to_thread(metric_sum, url, "inferd_deployment_replicas", state="ready")

    async def kills() -> None:
        await asyncio.sleep(3.0)
        for _ in range(args.trials):
            await asyncio.sleep(rng.uniform(1.0, 6.0))
            victims = replica_pids(pid)
            victim = rng.choice(victims)
            killed = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            noticed = None
            while True:
                n = await ready()
                if noticed is None and n < 2:
                    noticed = time.monotonic() - killed
                if noticed is not None and n >= 2:
                    break
                await asyncio.sleep(0.2)
            trials.append({"killed_s": killed, "noticed_s": round(noticed, 2),
                           "capacity_back_s": round(time.monotonic() - killed, 2)})
        await asyncio.sleep(3.0)
        load.stopping = True

    await asyncio.gather(load.run(), kills())
    return load, trials


BACKPRESSURE = {"tenant_queue_share", "queue_full", "queued_tokens", "deadline_unmeetable", "deadline_exceeded"}


def failed(a: dict) -> bool:
    """Not answered, before any byte of the answer, for another reason than backpressure (a full queue, a
    deadline the queue could not meet): what a retry on the healthy replica should have saved."""
    return a["status"] != 200 and a["code"] not in BACKPRESSURE


def crash(args: argparse.Namespace) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="inferd-faults-"))
    (folder / "deploy.yaml").write_text(CRASH_SPEC.format(router=args.crash_router))
    url = f"http://127.0.0.1:{args.port}"
    proc = serve(["--config", str(folder / "deploy.yaml")], args.port, folder, "inferd-faults-crash")
    try:
        load, trials = asyncio.run(crash_run(url, proc.pid, args))
        pending = wait_journal_empty(url)
    finally:
        stopped(proc)
    store = Store(f"sqlite:///{folder / 'inferd.db'}")
    from sqlalchemy import text
    with store.engine.connect() as conn:
        rows = conn.execute(text("SELECT request_id, status, attempt, error_code FROM usage_records")).all()
    store.close()
    by_id: dict[str, list] = {}
    for r in rows:
        by_id.setdefault(r.request_id, []).append(r)
    answered = [a for a in load.answers if a["status"] == 200 and not a["cut"]]
    wrong = {a["request_id"]: [f"{r.attempt} {r.status} {r.error_code}" for r in by_id.get(a["request_id"], [])]
             for a in answered if [r.status for r in by_id.get(a["request_id"], [])].count("completed") != 1}
    cut_wrong = [a["request_id"] for a in load.answers if a["cut"]
                 and [r.status for r in by_id.get(a["request_id"], [])] != ["failed"]]
    retried = sum(1 for a in answered if len(by_id.get(a["request_id"], [])) > 1)
    failed_attempts = sum(1 for rs in by_id.values() for r in rs if r.status != "completed")
    for t in trials:
        t["requests_in_flight_or_sent_within_1s"] = sum(1 for a in load.answers
                                                         if a["sent_s"] <= t["killed_s"] + 1.0
                                                         and a["sent_s"] + a["e2e_s"] >= t["killed_s"])
        del t["killed_s"]
    return {"trials": trials, "load": tally(load.answers),
            "failed_with_a_healthy_replica": sum(1 for a in load.answers if failed(a)),
            "streams_cut_mid_answer": sum(1 for a in load.answers if a["cut"]),
            "refused_by_backpressure": sum(1 for a in load.answers if a["status"] != 200 and not failed(a)),
            "records": {"answered": len(answered), "answered_without_exactly_one_completed_record": len(wrong),
                        "those_records": wrong,
                        "cut_streams_without_one_failed_record": len(cut_wrong),
                        "answered_after_a_retry": retried, "failed_attempt_records": failed_attempts,
                        "journal_pending_at_end": pending},
            "capacity_back_s_median": median([t["capacity_back_s"] for t in trials])}


# (c) isolation between tenants

async def ttft(client: httpx.AsyncClient, url: str, key: str, messages: list[dict], max_tokens: int = 1
               ) -> tuple[float, int]:
    """Seconds to the first content chunk, and the prompt's cached tokens (from the stream's usage)."""
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    sent, first, cached = time.monotonic(), None, 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                             headers={"authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200, (r.status_code, await r.aread())
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.monotonic() - sent
            if chunk.get("usage"):
                cached = chunk["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return first, cached


async def isolation_run(url: str, a: str, b: str, b_flood: str, args: argparse.Namespace) -> dict:
    rng = random.Random(23)
    long = lambda i: prompt(rng, 10_000 + i, words=300)  # noqa: E731 (about 330 tokens)
    rows = []
    async with httpx.AsyncClient(timeout=120) as client:
        for i in range(args.probes):
            cold_a, same_b = long(2 * i), long(2 * i + 1)
            t_cold, c_cold = await ttft(client, url, a, cold_a)  # A's first: only the template's public prefix
            await ttft(client, url, a, same_b)  # A primes its cache with the prompt B will send
            t_warm, c_warm = await ttft(client, url, a, same_b)
            t_b, c_b = await ttft(client, url, b, same_b)  # B probes for A's prefix
            rows.append({"cold_a_s": t_cold, "cached_cold": c_cold, "warm_a_s": t_warm, "cached_a": c_warm,
                         "probe_b_s": t_b, "cached_b": c_b})

        async def samples(offset: int) -> list[float]:
            return [(await ttft(client, url, a, prompt(rng, offset + i)))[0] for i in range(args.ttft_samples)]
        flood = {"alone": await samples(20_000)}
        for name, workers in (("at_cap_only", args.flood_cap), ("at_cap_and_refused", args.flood_workers)):
            flood[name], flood[f"{name}_statuses"] = await flooded(url, b_flood, workers, samples(30_000 + workers))
    cold, probe = median([r["cold_a_s"] for r in rows]), median([r["probe_b_s"] for r in rows])
    warm, alone = median([r["warm_a_s"] for r in rows]), statistics.median(flood["alone"])
    out = {"prefix_probe": {"probes": rows,
                            "cached_tokens_b_beyond_a_cold_prompt_max": max(r["cached_b"] - r["cached_cold"]
                                                                            for r in rows),
                            "cached_tokens_cold_median": median([r["cached_cold"] for r in rows]),
                            "cached_tokens_a_warm_median": median([r["cached_a"] for r in rows]),
                            "ttft_cold_a_median_s": cold, "ttft_warm_a_median_s": warm,
                            "ttft_probe_b_median_s": probe,
                            "probe_over_cold": round(probe / cold, 3), "warm_over_cold": round(warm / cold, 3)},
           "flood": {"ttft_alone_median_ms": round(alone * 1000, 1), "ttft_alone_p90_ms": quantile_ms(flood["alone"], 0.9),
                     "flood_cap": args.flood_cap, "flood_workers": args.flood_workers}}
    for name in ("at_cap_only", "at_cap_and_refused"):
        out["flood"][name] = {"ttft_median_ms": round(statistics.median(flood[name]) * 1000, 1),
                              "ttft_p90_ms": quantile_ms(flood[name], 0.9),
                              "ratio_median": round(statistics.median(flood[name]) / alone, 3),
                              "flooder_statuses": flood[f"{name}_statuses"].get("statuses"),
                              "flooder_answers_per_s": round(flood[f"{name}_statuses"].get(
                                  "answers_per_s_while_measured") or 0, 2)}
    return out


async def flooded(url: str, key: str, workers: int, measure) -> tuple[list[float], dict]:
    """Awaits measure while another process runs `workers` closed-loop clients of the flooding tenant."""
    counts = Path(tempfile.mkstemp(prefix="inferd-flood-")[1])
    proc = subprocess.Popen([sys.executable, __file__, "--flood", url, key, str(workers), str(counts)], cwd=ROOT,
                            env=os.environ | {"PYTHONPATH": str(ROOT)})
    try:
        while not counts.read_text() and proc.poll() is None:  # until each of its clients had an answer
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)
        ttfts = await measure
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    statuses = json.loads(counts.read_text() or "{}")
    counts.unlink()
    return ttfts, statuses


def flood_process(url: str, key: str, workers: str, counts_path: str) -> None:
    """The flooding tenant, in a process of its own (so that its clients do not slow the measuring one's loop):
    closed-loop chat of 32 tokens per worker until SIGTERM; the statuses it got written to counts_path."""
    stop, statuses = threading.Event(), {}
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def worker(i: int) -> None:
        rng = random.Random(i)
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                try:
                    status = client.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                                         json={"messages": prompt(rng, rng.randrange(10**6)), "max_tokens": 32,
                                               "ignore_eos": True}).status_code
                except httpx.HTTPError:
                    status = "error"
                statuses[str(status)] = statuses.get(str(status), 0) + 1
                if status != 200:
                    time.sleep(0.01)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(int(workers))]
    for t in threads:
        t.start()
    steady = None  # (when, answers then)
    while not stop.wait(0.2):
        if steady is None and sum(statuses.values()) >= int(workers):
            steady = time.monotonic(), statuses.get("200", 0)
            Path(counts_path).write_text("{}")  # in its steady state: measure now
    ended = time.monotonic(), statuses.get("200", 0)
    for t in threads:
        t.join()
    rate = (ended[1] - steady[1]) / (ended[0] - steady[0]) if steady else None
    Path(counts_path).write_text(json.dumps({"statuses": statuses, "answers_per_s_while_measured": rate}))


def isolation(args: argparse.Namespace) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="inferd-faults-"))
    store = Store(f"sqlite:///{folder / 'inferd.db'}")
    store.migrate()
    keys = {}
    for name, limits in (("tenant-a", {}), ("tenant-b", {}), ("flooder", {"max_concurrency": args.flood_cap})):
        store.create_tenant(name, limits=limits)
        keys[name] = store.create_key(name)[1].key
    store.close()
    url = f"http://127.0.0.1:{args.port}"
    proc = serve(["--max-inflight", str(args.isolation_inflight)], args.port, folder, "inferd-faults-isolation")
    try:
        return asyncio.run(isolation_run(url, keys["tenant-a"], keys["tenant-b"], keys["flooder"], args))
    finally:
        stopped(proc)


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in subprocess.run(["lscpu"], capture_output=True,
                  text=True).stdout.splitlines() if line.startswith("Model name")), "unknown")
    return {"cpu": model, "cores": os.cpu_count(), "load_average_before": os.getloadavg(),
            "shared": MACHINE_NOTE[0]}


def main() -> None:
    if sys.argv[1:2] == ["--flood"]:
        return flood_process(*sys.argv[2:6])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["outage", "crash", "isolation"], action="append")
    p.add_argument("--rate", type=float, default=2.0, help="outage: chat requests per second (8 output tokens)")
    p.add_argument("--before-s", type=float, default=10.0)
    p.add_argument("--outage-s", type=float, default=30.0)
    p.add_argument("--after-s", type=float, default=15.0)
    p.add_argument("--crash-rate", type=float, default=0.6, help="crash: chat requests per second (16 tokens)")
    p.add_argument("--crash-router", default="least_loaded")
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--probes", type=int, default=5)
    p.add_argument("--ttft-samples", type=int, default=25)
    p.add_argument("--flood-cap", type=int, default=4, help="the flooding tenant's max_concurrency")
    p.add_argument("--flood-workers", type=int, default=16)
    p.add_argument("--isolation-inflight", type=int, default=8)
    p.add_argument("--port", type=int, default=8972)
    p.add_argument("--machine-note", default="nothing else running", help="what else ran on the machine")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    MACHINE_NOTE[0] = args.machine_note
    parts = args.only or ["outage", "crash", "isolation"]
    result = json.loads(args.out.read_text()) if args.out.exists() else {}
    for part in parts:
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        figures = {"outage": outage, "crash": crash, "isolation": isolation}[part](args)
        result[part] = {"date": started, "machine": machine(), "settings": {k: v for k, v in vars(args).items()
                        if k not in ("out", "only")}, **figures}
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({part: figures}, indent=2)[:4000], flush=True)
    args.out.with_suffix(".md").write_text(markdown(result))


def markdown(r: dict) -> str:
    lines = ["# Faults under load (`benchmarks/faults.py`)", ""]
    if "outage" in r:
        o = r["outage"]
        s = o["settings"]
        lines += [f"## The store (PostgreSQL) and Redis down for {s['outage_s']:g} s ({o['date']})", "",
                  f"Machine: {o['machine']['cpu']}, {o['machine']['cores']} cores ({o['machine']['shared']}). "
                  f"`inferd serve` (SmolLM2-135M, one replica), chat at {s['rate']:g} req/s (8 output tokens) from a "
                  "key the gateway has seen, and every 0.5 s a request from a key it has not.", "",
                  "| phase | seen key: sent | answered | not answered | new keys | new-key refusal p50 ms |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for phase in ("before", "outage", "after"):
            x = o[phase]
            lines.append(f"| {phase} | {x['seen_key']['sent']} | {x['seen_key']['answered']} | "
                         f"{x['seen_key']['not_answered'] or 0} | {x['new_keys']} | {x['new_key_refusal_p50_ms']} |")
        rec = o["records"]
        lines += ["", f"A new key works {o['new_key_works_s_after_restart']} s after the stores are back "
                  f"(restarting them took {o['stores_restart_s']} s). Usage records: {rec['answered']} answered, "
                  f"**{rec['lost']} lost**, {rec['doubled']} doubled; journal pending at the end "
                  f"{rec['journal_pending_at_end']:g}; concurrency leases left in Redis: "
                  f"{o['redis_concurrency_leases_left']}.", ""]
    if "crash" in r:
        c = r["crash"]
        s = c["settings"]
        lines += [f"## A replica killed (SIGKILL) under load, {s['trials']} trials ({c['date']})", "",
                  f"Machine: {c['machine']['cpu']}, {c['machine']['cores']} cores ({c['machine']['shared']}). "
                  f"`inferd serve --config`: two replicas of SmolLM2-135M (router {s['crash_router']}), chat at "
                  f"{s['crash_rate']:g} req/s, 16 output tokens, a quarter streamed.", "",
                  "| trial | death noticed s | capacity back s | requests in flight or sent within 1 s |",
                  "| --- | --- | --- | --- |"]
        for i, t in enumerate(c["trials"]):
            lines.append(f"| {i + 1} | {t['noticed_s']} | {t['capacity_back_s']} | "
                         f"{t['requests_in_flight_or_sent_within_1s']} |")
        rec = c["records"]
        lines += ["", f"Requests: {c['load']['sent']} sent, {c['load']['answered']} answered; **failed while the "
                  f"other replica was healthy: {c['failed_with_a_healthy_replica']}**, refused by backpressure (a full queue, "
                  f"a deadline of 30 s it could not meet): {c['refused_by_backpressure']}; streams cut mid-answer (the "
                  f"client had part of the answer, then an error event: not retried): {c['streams_cut_mid_answer']}; "
                  f"{c['load']['not_answered']}. "
                  f"Capacity back (median): {c['capacity_back_s_median']} s. Records: "
                  f"{rec['answered_without_exactly_one_completed_record']} answered requests without exactly one "
                  f"completed record, {rec['cut_streams_without_one_failed_record']} cut streams without exactly one failed "
                  f"record; {rec['answered_after_a_retry']} answered after a retry on the other replica, "
                  f"{rec['failed_attempt_records']} failed attempts with their own record.", ""]
    if "isolation" in r:
        x = r["isolation"]
        pp, fl = x["prefix_probe"], x["flood"]
        lines += [f"## Isolation between tenants ({x['date']})", "",
                  f"Machine: {x['machine']['cpu']}, {x['machine']['cores']} cores ({x['machine']['shared']}). "
                  "`inferd serve`, one replica.", "",
                  f"Prefix probe ({len(pp['probes'])} prompts of ~330 tokens, each sent twice by tenant A, then once "
                  f"by tenant B): B's cached_tokens beyond what a cold prompt has (the chat template's public "
                  f"prefix, {pp['cached_tokens_cold_median']:g} tokens): **max "
                  f"{pp['cached_tokens_b_beyond_a_cold_prompt_max']}** (A's own repeat: median "
                  f"{pp['cached_tokens_a_warm_median']}). TTFT medians: A cold {pp['ttft_cold_a_median_s']} s, A warm "
                  f"{pp['ttft_warm_a_median_s']} s, B probing {pp['ttft_probe_b_median_s']} s: probe/cold "
                  f"**{pp['probe_over_cold']}** (a cache hit would be near warm/cold, {pp['warm_over_cold']}).", "",
                  f"Flood: tenant A's TTFT (a short prompt, 1 token, {x['settings']['ttft_samples']} sequential "
                  f"requests) alone: {fl['ttft_alone_median_ms']} ms median (p90 {fl['ttft_alone_p90_ms']}). With "
                  f"the flooding tenant (max_concurrency {fl['flood_cap']}, 32-token answers) in another process:", "",
                  "| flooder | A's TTFT median ms | p90 ms | ratio to alone (goal at most 1.10) | flooder's statuses | "
                  "flooder's answers/s |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for name, what in (("at_cap_only", f"{fl['flood_cap']} clients (at its cap, none refused)"),
                           ("at_cap_and_refused", f"{fl['flood_workers']} clients (at its cap, the rest refused)")):
            y = fl[name]
            lines.append(f"| {what} | {y['ttft_median_ms']} | {y['ttft_p90_ms']} | **{y['ratio_median']}** | "
                         f"{y['flooder_statuses']} | {y.get('flooder_answers_per_s', '')} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
