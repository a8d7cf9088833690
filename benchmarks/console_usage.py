"""How fast the console's Usage page answers with many usage records in the store.

Seeds a fresh store with RECORDS usage records, in time order over DAYS days (as a gateway writes them), from
TENANTS tenants, 4 models and both priority classes, BATCH records a transaction: the records go in by the
driver's fastest path (SQLite: executemany; PostgreSQL: COPY), and in the same transaction their daily rollups
by rollups.add, the function Store.insert_usage calls for every batch the gateway writes. Then it times, REPEAT
times each:
  - the Usage page's query (Store.usage_daily: 30 days, every tenant; and one tenant),
  - the page's whole answer through the real console route: a real `inferd gateway` on that store, signed in
    with the admin key, GET /console/api/usage and /console/usage.csv over loopback (status, body read),
  - the baseline: a scan of the records for the same 30 days (Store.usage_summary, what `inferd usage` reads).

    python benchmarks/console_usage.py --db sqlite:////tmp/usage.db --records 10000000 --out results/x.json
"""
import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from inferd.gateway import rollups
from inferd.gateway.rollups import DAY_S
from inferd.gateway.store import Store
from inferd.gateway.tables import usage_records

MODELS = ("SmolLM2-135M-Instruct", "all-MiniLM-L6-v2", "iris-classifier", "reacher-bc")
COLUMNS = [c.name for c in usage_records.c if c.name != "id"]
ADMIN_KEY = "console-usage-bench-admin-key"
ROOT = Path(__file__).resolve().parents[1]


def seed(store: Store, records: int, days: int, tenants: int, batch: int, now: float) -> float:
    ids = [store.create_tenant(f"tenant-{i:03d}").id for i in range(tenants)]
    rng, started, first = random.Random(0), time.perf_counter(), now - days * DAY_S
    step = days * DAY_S / records
    for offset in range(0, records, batch):
        rows = []
        for i in range(offset, min(offset + batch, records)):
            ended = first + (i + rng.random()) * step
            completion = rng.randint(1, 500)
            rows.append(dict(record_id=f"{i:032x}", request_id=f"req-{i}", attempt=1, tenant_id=rng.choice(ids),
                             key_id=None, model=rng.choice(MODELS), deployment_version="v1", replica="replica-0",
                             priority_class=rng.choice(("interactive", "batch")),
                             status="completed" if rng.random() < 0.97 else "rejected", http_status=200,
                             error_code=None, prompt_tokens=rng.randint(10, 2000), cached_tokens=0,
                             completion_tokens=completion, queue_s=0.0, ttft_s=0.1, e2e_s=0.5,
                             cost_usd=rng.random() * 0.01, started_unix_s=ended - 0.5, ended_unix_s=ended,
                             gateway_id="bench", units=None, batch_id=None, tpot_s=0.4 / completion))
        with store.engine.begin() as conn:
            _insert_fast(conn, rows)
            rollups.add(conn, rows)
    return time.perf_counter() - started


def _insert_fast(conn, rows: list[dict]) -> None:
    values = [tuple(r[c] for c in COLUMNS) for r in rows]
    if conn.dialect.name == "postgresql":
        with conn.connection.driver_connection.cursor() as cur:
            with cur.copy(f"COPY usage_records ({', '.join(COLUMNS)}) FROM STDIN") as copy:
                for v in values:
                    copy.write_row(v)
    else:
        conn.exec_driver_sql(f"INSERT INTO usage_records ({', '.join(COLUMNS)}) VALUES "
                             f"({', '.join('?' * len(COLUMNS))})", values)


def timed(fn, repeat: int, unit: str = "rows") -> dict:
    times, size = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        size = fn()
        times.append((time.perf_counter() - started) * 1000)
    return {"p50_ms": statistics.median(times), "max_ms": max(times), unit: size}


def console_route(db: str, repeat: int, since: str, until: str) -> dict:
    """The Usage page's answers through a real gateway's console routes on this store."""
    port, folder = _free_port(), Path(tempfile.mkdtemp(prefix="console-usage-"))
    proc = subprocess.Popen([sys.executable, "-m", "inferd.cli", "gateway", "--upstream", "http://127.0.0.1:9",
                             "--model", "chat", "--db", db, "--admin-key", ADMIN_KEY, "--port", str(port),
                             "--usage-journal", str(folder / "usage.journal"), "--files-dir", str(folder / "files")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=60, headers={"origin": base}) as client:
            for _ in range(600):
                try:
                    if client.get("/console").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            r = client.post("/console/sign-in", data={"key": ADMIN_KEY})
            assert r.status_code == 303 and "inferd_console" in client.cookies, r.text

            def get(path: str):
                def fn():
                    response = client.get(path)
                    assert response.status_code == 200, response.text[:500]
                    return len(response.content)
                return fn
            window = f"since={since}&until={until}"
            return {"api_usage_30_days_all_tenants": timed(get(f"/console/api/usage?{window}"), repeat, "bytes"),
                    "api_usage_30_days_one_tenant": timed(get(f"/console/api/usage?{window}&tenant=tenant-007"),
                                                          repeat, "bytes"),
                    "usage_csv_30_days_all_tenants": timed(get(f"/console/usage.csv?{window}"), repeat, "bytes")}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    return f"{model}, {os.cpu_count()} cores (shared with other work), {platform.machine()}, " \
           f"Python {platform.python_version()}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--records", type=int, default=10_000_000)
    p.add_argument("--days", type=int, default=90)
    p.add_argument("--tenants", type=int, default=50)
    p.add_argument("--batch", type=int, default=50_000)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    store, now = Store(args.db), time.time()
    store.migrate()
    seconds = seed(store, args.records, args.days, args.tenants, args.batch, now)
    if store.engine.dialect.name == "postgresql":
        with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM ANALYZE usage_records")
            conn.exec_driver_sql("VACUUM ANALYZE usage_daily")
    since, day = now - 30 * DAY_S, time.strftime("%Y-%m-%d", time.gmtime(now))
    result = {"db": store.engine.dialect.name, "records": args.records, "days": args.days, "tenants": args.tenants,
              "usage_daily_rows": len(store.usage_daily(0, now + DAY_S)),
              "seed_s": seconds, "seed_records_per_s": args.records / seconds,
              "usage_page_query_30_days_all_tenants": timed(lambda: len(store.usage_daily(since, now)), args.repeat),
              "usage_page_query_30_days_one_tenant": timed(lambda: len(store.usage_daily(since, now, "tenant-007")),
                                                           args.repeat),
              "console_route": console_route(args.db, args.repeat,
                                             time.strftime("%Y-%m-%d", time.gmtime(since)), day),
              "scan_of_records_30_days": timed(lambda: len(store.usage_summary(since, now)), 3),
              "machine": _machine(), "date": time.strftime("%Y-%m-%d")}
    s = result["scan_of_records_30_days"]["p50_ms"]
    result["scan_over_page_query"] = s / result["usage_page_query_30_days_all_tenants"]["p50_ms"]
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    store.close()


if __name__ == "__main__":
    main()
