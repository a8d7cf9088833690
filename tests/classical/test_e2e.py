"""The demo iris-classifier through a real `inferd serve` (the shared server: it trains the model on its first
start): predictions equal scikit-learn's on the same rows, /v1 and /v2 (tritonclient) through the gateway,
keys, access lists, a tiny RPM and a usage record per request."""

import httpx
import numpy as np
import pytest
from sqlalchemy import create_engine, text

from tests.conftest import SMOLLM2_ADMIN_KEY, SMOLLM2_KEY
from tests.server import db_url, new_tenant_key, wait_stored

MODEL = "iris-classifier"
FEATURES = ["sepal_length_cm", "sepal_width_cm", "petal_length_cm", "petal_width_cm"]
IRIS = [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3], [5.9, 3.0, 4.2, 1.5], [6.3, 2.8, 5.1, 1.5]]


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


def post(url: str, path: str, body: dict, key: str = SMOLLM2_KEY) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)


@pytest.fixture(scope="module")
def card(server):
    cards = httpx.get(f"{server[0]}/v1/models", headers={"authorization": f"Bearer {SMOLLM2_KEY}"}).json()["data"]
    return {c["id"]: c for c in cards}[MODEL]


@pytest.fixture(scope="module")
def forest(server, card):
    """The very file the replica serves (its path: the admin API's card), loaded by skops, pinned by the card's
    digest."""
    import skops.io as sio
    from inferd.models.unpack import file_sha256
    from pathlib import Path
    cards = httpx.get(f"{server[0]}/admin/models", headers={"authorization": f"Bearer {SMOLLM2_ADMIN_KEY}"}).json()
    path = Path({c["id"]: c for c in cards["data"]}[MODEL]["source_path"])
    assert file_sha256(path) == card["digests"]["model"]
    return sio.load(path, trusted=sio.get_untrusted_types(file=path))


def test_listed_with_its_kind_schema_and_digests(card):
    assert (card["kind"], card["task"], card["format"]) == ("classical", "classifier", "skops")
    assert [f["name"] for f in card["schema"]["features"]] == FEATURES
    assert card["schema"]["classes"] == ["setosa", "versicolor", "virginica"] and card["digests"]["schema"]


def test_predictions_equal_scikit_learns_on_the_same_rows(server, forest):
    rows = [dict(zip(FEATURES, r)) for r in IRIS]
    answer = post(server[0], "/v1/predict", {"model": MODEL, "inputs": rows}).json()
    assert answer["predictions"] == forest.predict(np.array(IRIS)).tolist()
    assert answer["probabilities"] == forest.predict_proba(np.array(IRIS)).tolist()
    one = post(server[0], "/v1/predict", {"columns": {f: [IRIS[1][j]] for j, f in enumerate(FEATURES)}}).json()
    assert one["predictions"] == ["virginica"] and one["usage"] == {"rows": 1}


def test_the_v2_protocol_through_the_gateway_with_tritonclient(server, forest):
    http = pytest.importorskip("tritonclient.http")
    from tritonclient.utils import InferenceServerException
    client = http.InferenceServerClient(url=server[0].removeprefix("http://"))
    auth = lambda: {"authorization": f"Bearer {SMOLLM2_KEY}"}  # noqa: E731 (tritonclient adds to the dict)
    assert client.is_server_live(headers=auth()) and client.is_model_ready(MODEL, headers=auth())
    meta = client.get_model_metadata(MODEL, headers=auth())
    assert meta["versions"] == ["v1"] and meta["outputs"][0] == {"name": "predict", "datatype": "BYTES",
                                                                 "shape": [-1]}
    tensor = http.InferInput("input", [len(IRIS), 4], "FP64")
    tensor.set_data_from_numpy(np.array(IRIS), binary_data=False)
    outputs = [http.InferRequestedOutput("predict_proba", binary_data=False)]
    result = client.infer(MODEL, [tensor], outputs=outputs, model_version="v1", headers=auth())
    assert np.array_equal(result.as_numpy("predict_proba"), forest.predict_proba(np.array(IRIS)))
    assert not client.is_server_live(headers={"authorization": "Bearer sk-nope"})  # a 401
    with pytest.raises(InferenceServerException, match="API key"):
        client.get_model_metadata(MODEL, headers={"authorization": "Bearer sk-nope"})


def test_bad_inputs_are_refused_and_the_model_keeps_serving(server):
    url = server[0]
    bad = post(url, "/v1/predict", {"model": MODEL, "inputs": [{"sepal_length_cm": 5.1}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "inputs[0].sepal_width_cm"
    nan = post(url, "/v1/predict", {"columns": {f: [None] for f in FEATURES}})
    assert nan.status_code == 400 and "may not be missing" in nan.json()["error"]["message"]
    v2 = post(url, f"/v2/models/{MODEL}/infer", {"inputs": [{"name": "input", "shape": [1, 3], "datatype": "FP64",
                                                            "data": [1.0, 2.0, 3.0]}]})
    assert v2.status_code == 400 and "[rows, 4]" in v2.json()["error"]
    assert post(url, "/v1/predict", {"inputs": [dict(zip(FEATURES, IRIS[0]))]}).status_code == 200


def test_access_lists_rate_limits_and_usage_records(server):
    url, log_path = server
    rows = {"model": MODEL, "inputs": [dict(zip(FEATURES, r)) for r in IRIS]}
    chat_only = new_tenant_key(log_path, "no-iris", "--models", "SmolLM2-135M-Instruct")
    denied = post(url, "/v1/predict", rows, chat_only)
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "model_not_allowed"
    assert post(url, f"/v2/models/{MODEL}/infer", {"inputs": []}, chat_only).status_code in (400, 403)
    tiny = new_tenant_key(log_path, "tiny-rpm", "--rpm", "2")
    assert [post(url, "/v1/predict", rows, tiny).status_code for _ in range(2)] == [200, 200]
    limited = post(url, "/v1/predict", rows, tiny)
    assert limited.status_code == 429 and limited.headers["retry-after"]
    assert limited.json()["error"]["code"] == "requests_per_minute"
    wait_stored(url)
    engine = create_engine(db_url(log_path))
    with engine.connect() as conn:
        records = conn.execute(text(
            "SELECT u.status, u.prompt_tokens, u.model FROM usage_records u JOIN tenants t ON t.id = u.tenant_id "
            "WHERE t.name = 'tiny-rpm' ORDER BY u.started_unix_s")).all()
    engine.dispose()
    assert [tuple(r) for r in records] == [("completed", 4, MODEL)] * 2 + [("rejected", 0, MODEL)]


def test_a_refused_body_is_recorded_under_the_model_it_names(server):
    url, log_path = server
    key = new_tenant_key(log_path, "refused-rows")
    too_large = httpx.post(f"{url}/v2/models/{MODEL}/infer", content=b" " * (11 * 2**20), timeout=60,
                           headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
    assert too_large.status_code == 413
    assert post(url, "/v1/predict", {"model": MODEL, "inputs": [{"sepal_length_cm": 5.1}]}, key).status_code == 400
    wait_stored(url)
    engine = create_engine(db_url(log_path))
    with engine.connect() as conn:
        records = conn.execute(text(
            "SELECT u.model, u.http_status FROM usage_records u JOIN tenants t ON t.id = u.tenant_id "
            "WHERE t.name = 'refused-rows' ORDER BY u.started_unix_s")).all()
    engine.dispose()
    assert [tuple(r) for r in records] == [(MODEL, 413), (MODEL, 400)]
