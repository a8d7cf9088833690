"""Routing across 2 replicas on the shared-prefix workload: prefix-aware vs least-loaded vs round-robin.

For each policy: `inferd serve --replicas 2 --num-threads 1 --router POLICY`, then `inferd bench run`
with K documents of L tokens and M questions each (interleaved), Poisson arrivals. Reported: TTFT
p50/p95, goodput against the SLO, and the replicas' prefix-cache hit ratio.

    python benchmarks/router.py --out benchmarks/results/router.json
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

ROOT = Path(__file__).parents[1]
KEY = "sk-router-bench-key"


def serve(policy: str, port: int, folder: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "inferd.cli", "serve", "--replicas", "2", "--num-threads", "1", "--router", policy,
           "--dtype", "float32", "--max-model-len", "2048", "--port", str(port), "--api-key", KEY,
           "--db", f"sqlite:///{folder / policy}.db", "--spill-path", str(folder / f"{policy}.spill"),
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=(folder / f"{policy}.log").open("w"), stderr=subprocess.STDOUT)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"inferd serve --router {policy} exited; see {folder / policy}.log")
        time.sleep(1)
    raise SystemExit("inferd serve did not become ready")


def bench(port: int, out: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "inferd.cli", "bench", "run", "--base-url", f"http://127.0.0.1:{port}/v1",
           "--api-key", KEY, "--workload", "shared-prefix", "--num-documents", str(args.documents),
           "--document-tokens", str(args.document_tokens), "--questions-per-document", str(args.questions),
           "--question-tokens", "24", "--output-tokens", "16", "--arrival", "poisson", "--rate", str(args.rate),
           "--warmup-requests", "0", "--slo", args.slo, "--seed", "1", "--out", str(out), "--no-html",
           "--no-progress"]
    subprocess.run(cmd, cwd=ROOT, check=True)
    return json.loads(out.with_suffix(".json").read_text())


def row(policy: str, report: dict) -> dict:
    s, server = report["summary"], report.get("server") or {}
    ttft = s["latency"]["ttft_ms"]
    return {"policy": policy, "ttft_p50_ms": ttft["p50"], "ttft_p95_ms": ttft["p95"],
            "e2e_p50_ms": s["latency"]["e2e_ms"]["p50"], "completed": s["counts"]["completed"],
            "failed": s["counts"]["failed"], "goodput_per_s": s["goodput"]["goodput_per_s"],
            "met_slo": s["goodput"]["met_slo"], "prefix_cache_hit_ratio": server.get("prefix_cache_hit_ratio")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policies", default="prefix,least_loaded,round_robin")
    p.add_argument("--documents", type=int, default=8)
    p.add_argument("--document-tokens", type=int, default=768)
    p.add_argument("--questions", type=int, default=6)
    p.add_argument("--rate", type=float, default=0.4)
    p.add_argument("--slo", default="ttft_ms=3000,tpot_ms=300")
    p.add_argument("--port", type=int, default=8790)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows, load = [], [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for policy in args.policies.split(","):
            proc = serve(policy, args.port, Path(tmp))
            try:
                rows.append(row(policy, bench(args.port, Path(tmp) / policy, args)))
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            print(json.dumps(rows[-1]), flush=True)
    load.append(os.getloadavg()[0])
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cores": os.cpu_count(),
              "load_avg_before_after": load, "settings": vars(args), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
