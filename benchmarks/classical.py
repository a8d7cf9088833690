"""Classical (tabular) serving, in one run: logistic regression (a StandardScaler pipeline), a random forest
and XGBoost, trained here on the same data (scikit-learn's breast cancer set, 30 features, 569 rows), served by

    inferd    `inferd serve --config`: the gateway (keys, limits, usage records) in front of one replica
              process per model, POST /v1/predict with named rows (client batches also column-major),
              through the shared batcher
    inferd-in-process  the same with each model in the gateway's process (placement.backend: in_process)
    ray       Ray Serve with @serve.batch (benchmarks/classical_peers.py), POST /{model}, rows as lists
    plain     a plain unbatched Starlette + library server (classical_peers.py), POST /{model}

One thread per model everywhere. Open loop: single-row requests at fixed arrival rates (RATES, each for
--cell-s seconds, a system's sweep stops at the first rate it misses), p50/p99 from each request's due
time; the highest rate held at p99 <= 20 ms with no errors is reported. Closed loop: client batches of 1,
32 and 1,024 rows from a few concurrent clients: rows/s and p50/p99 per request. The client runs on the
same cores as the servers (benchmarks/classical_load.py).

    PYTHONPATH=. .venv/bin/python benchmarks/classical.py   # about 4 minutes; needs pip install 'inferd[bench]'
"""
import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np

from benchmarks.classical_load import Target, closed_loop, open_loop
from benchmarks.classical_peers import MODELS, answer, load
from benchmarks.classical_report import markdown

ROOT = Path(__file__).parents[1]
RATES = (100, 200, 400, 800, 1600, 3200)
BATCHES = {1: 4, 32: 4, 1024: 2}  # rows per request: concurrent clients
P99_TARGET_MS = 20.0
KEY = "sk-bench-classical"


def train(directory: Path) -> tuple[np.ndarray, list[str]]:
    import skops.io as sio
    import xgboost as xgb
    from sklearn.datasets import load_breast_cancer
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    data = load_breast_cancer()
    X, y, names = data.data, data.target, [n.replace(" ", "_") for n in data.feature_names]
    schema = json.dumps({"features": [{"name": n, "dtype": "float64"} for n in names]})
    for name, model in (("logreg", make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))),
                        ("forest", RandomForestClassifier(n_estimators=100, max_depth=8, random_state=0))):
        sio.dump(model.fit(X, y), directory / f"{name}.skops")
        (directory / f"{name}.schema.json").write_text(schema)
    booster = xgb.XGBClassifier(n_estimators=100, max_depth=6, random_state=0).fit(X, y).get_booster()
    booster.feature_names = names
    booster.save_model(directory / "xgboost.json")
    return X, names


def bodies(system: str, model: str, X: np.ndarray, names: list[str], batch: int, count: int = 64,
           columns: bool = False) -> list[bytes]:
    """inferd: named rows (or column-major, its compact form); the peers: rows as lists."""
    out = []
    for k in range(count):
        rows = X[[(k * batch + i) % len(X) for i in range(batch)]]
        if not system.startswith("inferd"):
            body = {"inputs": rows.tolist()}
        elif columns:
            body = {"model": model, "columns": dict(zip(names, rows.T.tolist()))}
        else:
            body = {"model": model, "inputs": [dict(zip(names, r)) for r in rows.tolist()]}
        out.append(json.dumps(body).encode())
    return out


# the systems

def started(command: list[str], ready, log: Path, timeout_s: float = 180, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(command, cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)} | (env or {}),
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if ready():
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"{command[:4]} not ready within {timeout_s:.0f} s (exit {proc.poll()}); see {log}")


def inferd(directory: Path, port: int, backend: str = "local") -> subprocess.Popen:
    spec = "deployments:\n" + "".join(
        f"  - {{name: {m}, kind: classical, model: {{source: '{directory / f}'}}, placement: {{backend: {backend}}}}}\n"
        for m, f in zip(MODELS, ("logreg.skops", "forest.skops", "xgboost.json")))
    (directory / "deploy.yaml").write_text(spec)
    command = [sys.executable, "-m", "inferd.cli", "serve", "--config", str(directory / "deploy.yaml"), "--port",
               str(port), "--api-key", KEY, "--db", f"sqlite:///{directory / 'inferd.db'}", "--spill-path",
               str(directory / "spill.jsonl"), "--log-level", "warning"]
    return started(command, lambda: httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200,
                   directory / "inferd.log")


def peer(kind: str, directory: Path, port: int) -> subprocess.Popen:
    command = [sys.executable, str(ROOT / "benchmarks" / "classical_peers.py"), kind, "--port", str(port),
               "--models", str(directory)]
    def probe() -> bool:
        return all(httpx.post(f"http://127.0.0.1:{port}/{m}", json={"inputs": [[0.0] * 30]}).status_code == 200
                   for m in MODELS)
    # HOME: Ray keeps files under ~/.ray (an auth token that later Ray clusters on this machine trip over)
    return started(command, probe, directory / f"{kind}.log", timeout_s=240, env={"HOME": str(directory)})


def target(system: str, model: str, port: int) -> Target:
    if system.startswith("inferd"):
        return Target("127.0.0.1", port, "/v1/predict", {"Authorization": f"Bearer {KEY}"})
    return Target("127.0.0.1", port, f"/{model}", {})


# measuring

def check_answers(system: str, port: int, X: np.ndarray, names: list[str], references: dict) -> None:
    """Each system answers what the library answers for the same rows, before any is timed."""
    for model in MODELS:
        t = target(system, model, port)
        body = json.loads(bodies(system, model, X, names, 16, count=1)[0])
        got = httpx.post(f"http://127.0.0.1:{port}{t.path}", json=body, headers=t.headers, timeout=30).json()
        want = answer(model, references[model], X[:16])
        assert got["predictions"] == want[0] and np.allclose(got["probabilities"], want[1], rtol=0, atol=1e-12), \
            f"{system} {model} answers differently from the library"


async def measure(system: str, port: int, X: np.ndarray, names: list[str], cell_s: float,
                  rates_asked: tuple[int, ...] = RATES) -> dict:
    out = {}
    for model in MODELS:
        t, singles = target(system, model, port), bodies(system, model, X, names, 1, count=len(X))
        await open_loop(t, singles, 50, 0.5)  # warm-up
        rates, held = {}, None
        for rate in rates_asked:
            rates[rate] = cell = await open_loop(t, singles, rate, cell_s)
            print(f"{system:7s} {model:8s} {rate:5d}/s  {cell}", flush=True)
            if cell["errors"] or cell["p99_ms"] is None or cell["p99_ms"] > P99_TARGET_MS:
                break
            held = rate
        out[model] = {"rates": rates, "max_rate_p99_20ms": held}
        for key, columns in (("batches", False), ("batches_columns", True)):
            if columns and not system.startswith("inferd"):
                continue
            out[model][key] = cells = {}
            for batch, clients in BATCHES.items():
                cells[batch] = cell = await closed_loop(t, bodies(system, model, X, names, batch, columns=columns),
                                                        batch, clients, cell_s)
                print(f"{system:7s} {model:8s} {key} {batch:4d} x{clients}  {cell}", flush=True)
    return out


def machine() -> dict:
    from importlib.metadata import version
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "?")
    return {"cpu": cpu, "cores": os.cpu_count(), "shared": True, "load_average_before": os.getloadavg(),
            "versions": {p: version(p) for p in ("scikit-learn", "xgboost-cpu", "skops", "ray", "starlette",
                                                 "uvicorn", "numpy")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "classical.json")
    p.add_argument("--cell-s", type=float, default=2.0, help="seconds per rate or batch cell")
    p.add_argument("--port", type=int, default=8970)
    p.add_argument("--systems", default="inferd,ray,plain", help="of inferd, inferd-in-process, ray, plain")
    p.add_argument("--rates", default=",".join(map(str, RATES)), help="the open loop's arrival rates, rising")
    args = p.parse_args()
    rates = tuple(int(r) for r in args.rates.split(","))
    directory = Path(tempfile.mkdtemp(prefix="inferd-bench-classical-"))
    X, names = train(directory)
    references = {m: load(directory, m) for m in MODELS}
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "cell_s": args.cell_s, "p99_target_ms": P99_TARGET_MS, "rates": rates, "batches": BATCHES,
              "systems": {}, "notes": {}}
    starts = {"inferd": lambda: inferd(directory, args.port), "ray": lambda: peer("ray", directory, args.port + 1),
              "plain": lambda: peer("plain", directory, args.port + 2),
              "inferd-in-process": lambda: inferd(directory, args.port + 3, "in_process")}
    ports = {"inferd": args.port, "ray": args.port + 1, "plain": args.port + 2, "inferd-in-process": args.port + 3}
    for system in args.systems.split(","):
        t = time.monotonic()
        try:
            proc = starts[system]()
        except RuntimeError as exc:
            result["notes"][system] = f"not measured: {exc}"
            continue
        try:
            result["notes"][f"{system} start_s"] = round(time.monotonic() - t, 1)
            check_answers(system, ports[system], X, names, references)
            result["systems"][system] = asyncio.run(measure(system, ports[system], X, names, args.cell_s, rates))
        finally:
            proc.terminate()
            proc.wait(60)
    result["machine"]["load_average_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    result = json.loads(json.dumps(result))  # the keys as the file has them
    args.out.with_suffix(".md").write_text(markdown(result))
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
