"""How fast the console's Usage page answers with many usage records in the store.

Seeds a fresh store with RECORDS usage records through Store.insert_usage (the one write path: records and
their daily rollups in one transaction, BATCH records a call, as the usage writer sends them), spread over
DAYS days, TENANTS tenants, 4 models and both priority classes; then times, REPEAT times each, the Usage
page's query (Store.usage_daily: 30 days, every tenant; and one tenant) against a scan of the records for
the same 30 days (Store.usage_summary, what `inferd usage` reads).

    python benchmarks/console_usage.py --db sqlite:////tmp/usage.db --records 1000000 --out results/x.json
"""
import argparse
import json
import platform
import random
import statistics
import time
import uuid

from inferd.gateway.rollups import DAY_S
from inferd.gateway.store import Store

MODELS = ("SmolLM2-135M-Instruct", "all-MiniLM-L6-v2", "iris-classifier", "reacher-bc")


def seed(store: Store, records: int, days: int, tenants: int, batch: int, now: float) -> float:
    ids = [store.create_tenant(f"tenant-{i:03d}").id for i in range(tenants)]
    rng, started = random.Random(0), time.perf_counter()
    for offset in range(0, records, batch):
        rows = []
        for _ in range(min(batch, records - offset)):
            ended = now - rng.random() * days * DAY_S
            rows.append(dict(record_id=uuid.uuid4().hex, request_id="req", attempt=1, tenant_id=rng.choice(ids),
                             key_id=None, model=rng.choice(MODELS), deployment_version="v1", replica="replica-0",
                             priority_class=rng.choice(("interactive", "batch")),
                             status="completed" if rng.random() < 0.97 else "rejected", http_status=200,
                             error_code=None, prompt_tokens=rng.randint(10, 2000), cached_tokens=0,
                             completion_tokens=rng.randint(1, 500), queue_s=0.0, ttft_s=0.1, e2e_s=0.5,
                             cost_usd=rng.random() * 0.01, started_unix_s=ended - 0.5, ended_unix_s=ended,
                             gateway_id="bench"))
        store.insert_usage(rows)
    return time.perf_counter() - started


def timed(fn, repeat: int) -> dict:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        rows = fn()
        times.append((time.perf_counter() - started) * 1000)
    return {"p50_ms": statistics.median(times), "max_ms": max(times), "rows": len(rows)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--days", type=int, default=90)
    p.add_argument("--tenants", type=int, default=50)
    p.add_argument("--batch", type=int, default=5000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    store, now = Store(args.db), time.time()
    store.migrate()
    seconds = seed(store, args.records, args.days, args.tenants, args.batch, now)
    since = now - 30 * DAY_S
    result = {"db": store.engine.dialect.name, "records": args.records, "days": args.days, "tenants": args.tenants,
              "seed_s": seconds, "seed_records_per_s": args.records / seconds,
              "usage_page_30_days_all_tenants": timed(lambda: store.usage_daily(since, now), args.repeat),
              "usage_page_30_days_one_tenant": timed(lambda: store.usage_daily(since, now, "tenant-007"), args.repeat),
              "scan_of_records_30_days": timed(lambda: store.usage_summary(since, now), min(args.repeat, 3)),
              "machine": f"{platform.machine()}, {platform.python_version()}", "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    store.close()


if __name__ == "__main__":
    main()
