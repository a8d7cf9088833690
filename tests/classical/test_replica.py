"""`inferd replica --kind classical MODEL` as a process, called with tritonclient (the v2 protocol as Triton's
own client speaks it) and with many concurrent requests of mixed sizes over HTTP."""
import asyncio
import os
import subprocess
import sys

import httpx
import numpy as np
import pytest

from inferd.control.replicas import free_port, wait_until_ready
from tests.classical import models

KEY = "sk-replica"
AUTH = {"authorization": f"Bearer {KEY}"}
NAME = "iris-xgb"


@pytest.fixture(scope="module")
def replica():
    port = free_port()
    cmd = [sys.executable, "-m", "inferd.cli", "replica", "--kind", "classical", str(models.xgboost_iris().path),
           "--served-model-name", NAME, "--port", str(port), "--max-batch-rows", "128", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=os.environ | {"INFERD_API_KEY": KEY})
    url = f"127.0.0.1:{port}"
    try:
        wait_until_ready(f"http://{url}", lambda: proc.poll() is None, lambda: f"exited with {proc.returncode}", 60)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_tritonclient_reads_health_metadata_and_infers(replica):
    http = pytest.importorskip("tritonclient.http")
    from tritonclient.utils import InferenceServerException
    client = http.InferenceServerClient(url=replica)
    auth = lambda: dict(AUTH)  # noqa: E731 (tritonclient adds its own headers to the dict it is given)
    assert client.is_server_live(headers=auth()) and client.is_server_ready(headers=auth())
    assert client.is_model_ready(NAME, headers=auth())
    meta = client.get_model_metadata(NAME, headers=auth())
    assert meta["platform"] == "xgboost" and meta["inputs"][0]["shape"] == [-1, 4]
    trained = models.xgboost_iris()
    X = trained.X[::7]
    tensor = http.InferInput("input", list(X.shape), "FP64")
    tensor.set_data_from_numpy(X, binary_data=False)
    outputs = [http.InferRequestedOutput(n, binary_data=False) for n in ("predict", "predict_proba")]
    result = client.infer(NAME, [tensor], outputs=outputs, headers=auth(), model_version=meta["versions"][0])
    assert np.array_equal(result.as_numpy("predict"), trained.reference.predict(X))
    assert np.array_equal(result.as_numpy("predict_proba"), trained.reference.predict_proba(X))  # exact: trees
    wrong = http.InferInput("input", [1, 3], "FP64")
    wrong.set_data_from_numpy(np.ones((1, 3)), binary_data=False)
    with pytest.raises(InferenceServerException, match=r"this model reads \[rows, 4\]"):
        client.infer(NAME, [wrong], headers=auth())
    binary = http.InferInput("input", list(X.shape), "FP64")
    binary.set_data_from_numpy(X, binary_data=True)
    with pytest.raises(InferenceServerException):
        client.infer(NAME, [binary], headers=auth())
    assert client.is_server_live(headers=auth())


def test_many_concurrent_requests_of_mixed_sizes_each_get_their_rows(replica):
    trained = models.xgboost_iris()
    rng = np.random.default_rng(0)
    asks = [rng.integers(0, len(trained.X), size=int(n)).tolist() for n in rng.integers(1, 300, size=48)]

    async def ask(client: httpx.AsyncClient, indices: list[int]) -> dict:
        body = {"inputs": models.rows(trained, indices)}
        body["inputs"][0]["petal_width_cm"] = None  # missing: XGBoost routes it (allow_nan from the schema file)
        r = await client.post(f"http://{replica}/v1/predict", json=body, headers=AUTH)
        assert r.status_code == 200, r.text
        return r.json()

    async def all_of_them() -> list[dict]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(ask(client, ix) for ix in asks))

    for indices, answer in zip(asks, asyncio.run(all_of_them())):
        X = trained.X[indices].copy()
        X[0, 3] = np.nan
        assert answer["predictions"] == trained.reference.predict(X).tolist()
        assert answer["probabilities"] == trained.reference.predict_proba(X).tolist()
        assert answer["usage"] == {"rows": len(indices)}
    scrape = httpx.get(f"http://{replica}/metrics").text
    batches = next(float(line.split()[1]) for line in scrape.splitlines()
                   if line.startswith("inferd_classical_batch_rows_count"))
    pieces = sum(-(-len(ix) // 128) for ix in asks)  # --max-batch-rows 128: a longer request runs in pieces
    assert batches < pieces  # some model calls served several requests
