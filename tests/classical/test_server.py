"""The classical replica in process (Starlette's TestClient): /v1/predict and the v2 protocol answer what the
library answers, in input order, for single rows and mixed concurrent batches; bad requests are 4xx in
their API's error shape and the replica keeps serving."""
import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from starlette.testclient import TestClient

from inferd.classical.config import ClassicalConfig
from inferd.classical.metrics import ClassicalMetrics
from inferd.classical.runtime import ClassicalRuntime
from inferd.classical.server import build_classical_app
from inferd.protocol import headers
from tests.classical import models

KEY = "sk-classical"
AUTH = {"authorization": f"Bearer {KEY}"}
NAME = "forest"


def serving(trained, name: str, **config):
    metrics = ClassicalMetrics()
    runtime = ClassicalRuntime.load(trained.path, ClassicalConfig(**config), name, on_batch=metrics.observe_batch)
    client = TestClient(build_classical_app(runtime, metrics, api_key=KEY))
    client.__enter__()
    deadline = time.monotonic() + 30
    while client.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, "the replica never got ready"
        time.sleep(0.02)
    return client


@pytest.fixture(scope="module")
def forest():
    client = serving(models.forest_skops(), NAME, max_batch_rows=64)
    yield client
    client.__exit__(None, None, None)


def predict(client: TestClient, expect: int = 200, extra_headers: dict | None = None, **body) -> dict:
    r = client.post("/v1/predict", json=body, headers=AUTH | (extra_headers or {}))
    assert r.status_code == expect, r.text
    return r.json()


def test_one_row_a_batch_and_columns_answer_what_the_forest_does(forest):
    trained = models.forest_skops()
    one = predict(forest, model=NAME, inputs=models.rows(trained, [3]))
    assert one["object"] == "list" and one["model"] == NAME and one["usage"] == {"rows": 1}
    assert (one["predictions"], one["probabilities"]) == models.expected(trained, [3])
    indices = list(range(0, 569, 3))  # 190 rows: three batches of at most 64
    many = predict(forest, inputs=models.rows(trained, indices))
    assert (many["predictions"], many["probabilities"]) == models.expected(trained, indices)
    columns = {n: trained.X[indices, j].tolist() for j, n in enumerate(trained.features)}
    assert predict(forest, columns=columns)["probabilities"] == many["probabilities"]


def test_mixed_concurrent_requests_are_batched_and_each_gets_its_own_rows(forest):
    trained = models.forest_skops()
    asks = [list(range(i, i + 1 + (i * 7) % 40)) for i in range(0, 480, 12)]
    before = forest.get("/metrics").text
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda ix: predict(forest, inputs=models.rows(trained, ix)), asks))
    for ix, answer in zip(asks, answers):
        assert (answer["predictions"], answer["probabilities"]) == models.expected(trained, ix)
    after = forest.get("/metrics").text
    assert _count(after, "inferd_classical_requests_total") - _count(before, "inferd_classical_requests_total") \
        == len(asks)
    batches = _value(after, "inferd_classical_batch_requests_count") - \
        _value(before, "inferd_classical_batch_requests_count")
    assert batches < len(asks)  # some model calls served several requests


def test_v2_infer_metadata_and_readiness(forest):
    trained = models.forest_skops()
    meta = forest.get(f"/v2/models/{NAME}", headers=AUTH).json()
    assert meta["platform"] == "sklearn" and meta["inputs"] == [{"name": "input", "datatype": "FP64",
                                                                 "shape": [-1, 30]}]
    [version] = meta["versions"]
    rows = trained.X[[5, 9, 200]]
    body = {"id": "r1", "inputs": [{"name": "input", "shape": [3, 30], "datatype": "FP64", "data": rows.tolist()}]}
    answer = forest.post(f"/v2/models/{NAME}/versions/{version}/infer", json=body, headers=AUTH)
    assert answer.status_code == 200 and answer.headers[headers.USAGE]
    out = {o["name"]: o for o in answer.json()["outputs"]}
    want, want_proba = models.expected(trained, [5, 9, 200])
    assert out["predict"]["data"] == want and out["predict"]["datatype"] == "INT64"
    assert out["predict_proba"]["shape"] == [3, 2] and out["predict_proba"]["data"] == sum(want_proba, [])
    assert answer.json()["id"] == "r1" and answer.json()["model_version"] == version
    per_feature = {"inputs": [{"name": n, "shape": [3], "datatype": "FP64", "data": rows[:, j].tolist()}
                              for j, n in enumerate(trained.features)], "outputs": [{"name": "predict"}]}
    only = forest.post(f"/v2/models/{NAME}/infer", json=per_feature, headers=AUTH).json()["outputs"]
    assert [o["name"] for o in only] == ["predict"] and only[0]["data"] == want
    for path in ("/v2/health/live", "/v2/health/ready", f"/v2/models/{NAME}/ready"):
        assert forest.get(path, headers=AUTH).status_code == 200
    gone = forest.get(f"/v2/models/{NAME}/versions/nope/ready", headers=AUTH)
    assert gone.status_code == 404 and set(gone.json()) == {"error"}


@pytest.mark.parametrize("mutate, param", [
    (lambda r: r | {"bogus": 1.0}, "inputs[1].bogus"),
    (lambda r: {k: v for k, v in r.items() if k != "mean_radius"}, "inputs[1].mean_radius"),
    (lambda r: r | {"mean_radius": "big"}, "inputs[1].mean_radius"),
    (lambda r: r | {"mean_radius": None}, "inputs[1].mean_radius"),
    (lambda r: [1, 2, 3], "inputs[1]"),
])
def test_bad_rows_are_400_in_openais_shape_and_the_replica_keeps_serving(forest, mutate, param):
    good = models.rows(models.forest_skops(), [0, 1])
    error = predict(forest, 400, inputs=[good[0], mutate(good[1])])["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert len(predict(forest, inputs=good)["predictions"]) == 2


def test_nan_where_forbidden_wrong_shape_and_big_bodies(forest):
    row = models.rows(models.forest_skops(), [0])[0]
    missing = predict(forest, 400, inputs=[row | {"mean_area": None}])["error"]
    assert missing["param"] == "inputs[0].mean_area" and "may not be missing" in missing["message"]
    nan = forest.post("/v1/predict", content=json.dumps({"inputs": [row | {"mean_area": float("nan")}]}),
                      headers=AUTH)  # a NaN literal is not JSON
    assert nan.status_code == 400 and nan.json()["error"]["code"] == "invalid_json"
    bad_shape = {"inputs": [{"name": "input", "shape": [1, 29], "datatype": "FP64", "data": [1.0] * 29}]}
    refused = forest.post(f"/v2/models/{NAME}/infer", json=bad_shape, headers=AUTH)
    assert refused.status_code == 400 and "[rows, 30]" in refused.json()["error"]
    huge = b'{"inputs": [' + b"1.0," * (3 * 2**20) + b"1.0]}"  # 12 MB
    assert forest.post("/v1/predict", content=huge, headers=AUTH).status_code == 413
    big_v2 = forest.post(f"/v2/models/{NAME}/infer", content=huge, headers=AUTH)
    assert big_v2.status_code == 413 and set(big_v2.json()) == {"error"}
    assert predict(forest, inputs=[row])["usage"] == {"rows": 1}


def test_model_key_priority_and_deadline_headers(forest):
    row = models.rows(models.forest_skops(), [0])
    assert predict(forest, 404, model="other", inputs=row)["error"]["code"] == "model_not_found"
    assert forest.post("/v1/predict", json={"inputs": row}).status_code == 401
    assert forest.post(f"/v2/models/{NAME}/infer", json={}).status_code == 401
    assert predict(forest, 400, {headers.PRIORITY: "urgent"}, inputs=row)["error"]["param"] == headers.PRIORITY
    assert len(predict(forest, 200, {headers.PRIORITY: "batch", headers.DEADLINE_MS: "5000"},
                       inputs=row)["predictions"]) == 1


def test_card_ready_health_and_metrics(forest):
    [card] = forest.get("/v1/models", headers=AUTH).json()["data"]
    assert (card["id"], card["kind"], card["task"], card["format"]) == (NAME, "classical", "classifier", "skops")
    assert card["schema"]["features"][0] == {"name": "mean_radius", "dtype": "float64", "allow_nan": False}
    assert card["digests"]["model"].startswith(card["version"]) and card["digests"]["schema"]
    ready = forest.get("/ready").json()
    assert ready["status"] == "ready" and ready["loaded_unix_s"] <= ready["warm_unix_s"]
    scrape = forest.get("/metrics").text
    for name in ('inferd_classical_requests_total{api="v1",outcome="completed"}', "inferd_classical_rows_total",
                 "inferd_classical_batch_rows_bucket", "inferd_classical_queue_time_seconds_bucket",
                 'inferd_classical_requests_total{api="v1",outcome="rejected"}', "inferd_classical_queue_rows"):
        assert name in scrape, name


def test_a_regressor_answers_predictions_only():
    trained = models.lightgbm_regressor()
    client = serving(trained, "diabetes")
    try:
        answer = predict(client, inputs=models.rows(trained, [0, 1, 2]))
        assert "probabilities" not in answer
        assert np.array_equal(answer["predictions"], models.expected(trained, [0, 1, 2])[0])
        meta = client.get("/v2/models/diabetes", headers=AUTH).json()
        assert [o["name"] for o in meta["outputs"]] == ["predict"] and meta["platform"] == "lightgbm"
    finally:
        client.__exit__(None, None, None)


def _count(scrape: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in scrape.splitlines() if line.startswith(name + "{"))


def _value(scrape: str, name: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in scrape.splitlines() if line.startswith(name + " "))
