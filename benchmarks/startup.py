"""Start-up costs a replica pays: imports, loading the GGUF (cold: parsed and dequantized; warm: from the
load cache), the gateway's tokenizer load, and a whole `inferd replica` to its /ready.

Each measurement runs in a fresh Python process (nothing already imported), with a fresh empty load cache
for the cold load. Medians of --repeats.

    PYTHONPATH=. .venv/bin/python benchmarks/startup.py --out benchmarks/results/startup.json
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

ROOT = Path(__file__).parents[1]
TIMED = """
import time
{imports}
t = time.perf_counter()
{call}
print(time.perf_counter() - t)
"""
LOADER = "from inferd.models.loader import load_model, load_tokenizer"
STEPS = {  # name: (imported before the clock starts, timed)
    "import the replica (inferd.replica.server, the engine)":
        ("", "import inferd.replica.server, inferd.engine.async_engine"),
    "load_model(SmolLM2), load cache empty": (LOADER, "load_model(None, False)"),
    "load_model(SmolLM2), load cache warm": (LOADER, "load_model(None, False)"),
    "load_tokenizer(SmolLM2) (the gateway)": (LOADER, "load_tokenizer(None)"),
}


def timed(step: tuple[str, str], cache: str) -> float:
    env = os.environ | {"INFERD_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
    code = TIMED.format(imports=step[0], call=step[1])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, cwd=ROOT)
    return float(out.stdout.split()[-1])


def replica_ready(cache: str) -> dict:
    """`inferd replica` from process start to /ready 200, and the phases it reports."""
    port = 8700 + os.getpid() % 200
    env = os.environ | {"INFERD_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
    start = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "inferd.cli", "replica", "--dtype", "float32", "--port", str(port),
                             "--kv-cache-gib", "0.05", "--log-level", "warning"], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2)
                if r.status_code == 200:
                    body, ready = r.json(), time.time()
                    return {"weights_loaded_s": body["loaded_unix_s"] - start, "warm_s": body["warm_unix_s"] - start,
                            "ready_s": ready - start}
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.time() - start > 300:
                raise SystemExit("inferd replica did not become ready")
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    runs: dict[str, list] = {name: [] for name in STEPS} | {"inferd replica to /ready (load cache warm)": []}
    with tempfile.TemporaryDirectory() as warm:
        timed(STEPS["load_model(SmolLM2), load cache warm"], warm)  # fills the warm cache once
        for _ in range(args.repeats):
            for name, code in STEPS.items():
                if "empty" in name:
                    with tempfile.TemporaryDirectory() as empty:
                        runs[name].append(timed(code, empty))
                else:
                    runs[name].append(timed(code, warm))
            runs["inferd replica to /ready (load cache warm)"].append(replica_ready(warm))
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cores": os.cpu_count(),
              "load_average": os.getloadavg()[0], "runs": runs,
              "medians_s": {k: (statistics.median(v) if not isinstance(v[0], dict) else
                                {p: statistics.median(r[p] for r in v) for p in v[0]}) for k, v in runs.items()}}
    print(json.dumps(result["medians_s"], indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
