"""The peers benchmarks/classical.py measures inferd against, each serving the same model files:

    plain    one Starlette app on uvicorn, POST /{model}: the library called in the handler, one request at
             a time, no batching (what a hand-written model server does)
    ray      Ray Serve, one deployment per model, POST /{model}: @serve.batch gathers concurrent calls
             (max_batch_size 64, batch_wait_timeout_s 0.002) and the library runs once per batch

Both take {"inputs": [[30 floats], ...]} and answer {"predictions", "probabilities"}, computed as inferd's
replica computes them (answer()). Run: python benchmarks/classical_peers.py plain|ray --port P --models DIR
"""
import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per model, as inferd's num_threads default

import numpy as np  # noqa: E402

MODELS = ("logreg", "forest", "xgboost")


def load(directory: Path, name: str):
    if name == "xgboost":
        import xgboost as xgb
        booster = xgb.Booster(model_file=str(directory / "xgboost.json"))
        booster.set_param({"nthread": 1})
        return booster
    import skops.io as sio
    path = directory / f"{name}.skops"
    return sio.load(path, trusted=sio.get_untrusted_types(file=path))


def answer(name: str, model, rows: np.ndarray) -> tuple[list, list]:
    """What inferd's replica answers for the same model: XGBoost's booster (p > 0.5), the forest's argmax of
    its probabilities (scikit-learn's own predict), the pipeline's predict and predict_proba."""
    if name == "xgboost":
        p = model.inplace_predict(rows, predict_type="value", missing=np.nan, validate_features=False)
        return (p > 0.5).astype(np.int64).tolist(), np.vstack((1 - p, p)).T.tolist()
    proba = model.predict_proba(rows)
    labels = model.classes_.take(np.argmax(proba, axis=1)) if name == "forest" else model.predict(rows)
    return labels.tolist(), proba.tolist()


# plain Starlette

def plain(directory: Path, port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from threadpoolctl import threadpool_limits
    threadpool_limits(1)
    models = {name: load(directory, name) for name in MODELS}

    def endpoint(name: str):
        async def predict(request):
            rows = np.asarray((await request.json())["inputs"], dtype=np.float64)
            labels, proba = answer(name, models[name], rows)
            return JSONResponse({"predictions": labels, "probabilities": proba})
        return predict

    async def ready(request):
        return JSONResponse({"status": "ready"})

    routes = [Route(f"/{n}", endpoint(n), methods=["POST"]) for n in MODELS] + [Route("/ready", ready)]
    uvicorn.run(Starlette(routes=routes), host="127.0.0.1", port=port, log_level="warning", access_log=False)


# Ray Serve

def ray(directory: Path, port: int) -> None:
    import ray as ray_core
    from ray import serve
    from starlette.requests import Request

    @serve.deployment(max_ongoing_requests=256, ray_actor_options={"num_cpus": 0.5})
    class Model:
        def __init__(self, name: str, directory: str):
            from threadpoolctl import threadpool_limits
            threadpool_limits(1)
            self.name, self.model = name, load(Path(directory), name)

        @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.002)
        async def run(self, batches: list[np.ndarray]) -> list[dict]:
            labels, proba = answer(self.name, self.model, np.concatenate(batches))
            out, at = [], 0
            for b in batches:
                out.append({"predictions": labels[at:at + len(b)], "probabilities": proba[at:at + len(b)]})
                at += len(b)
            return out

        async def __call__(self, request: Request) -> dict:
            return await self.run(np.asarray((await request.json())["inputs"], dtype=np.float64))

    ray_core.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    for name in MODELS:
        serve.run(Model.bind(name, str(directory)), name=name, route_prefix=f"/{name}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(json.dumps({"ray": ray_core.__version__, "ready": True}), flush=True)
    try:
        while True:
            time.sleep(1)
    finally:
        serve.shutdown()
        ray_core.shutdown()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("peer", choices=("plain", "ray"))
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--models", type=Path, required=True)
    a = p.parse_args()
    (plain if a.peer == "plain" else ray)(a.models, a.port)
