"""The classical kind through the gateway's lifecycle, in process (replicas are httpx.MockTransport handlers):
rows counted as the plan's tokens, bad requests refused before any replica sees them (in each API's error
shape), the v2 model and version taken from the path, and the v2 GET routes behind the key."""
import json

import httpx
import pytest
from starlette.testclient import TestClient

from inferd.gateway.admission import AdmissionQueue, QueueConfig
from inferd.gateway.app import build_gateway_app
from inferd.gateway.config import ModelPrice
from inferd.gateway.deployments import ClassicalModel, Deployment, Upstream
from inferd.protocol import headers
from inferd.protocol.classical import Feature, TabularSchema
from tests.gateway.test_lifecycle import Replicas, make_gateway

SCHEMA = TabularSchema((Feature("a"), Feature("b", "int64")), "classifier", (0, 1))
ROWS = [{"a": 0.5, "b": 1}, {"a": 1.5, "b": 2}, {"a": 2.5, "b": 3}]
TENSOR = {"inputs": [{"name": "input", "shape": [3, 2], "datatype": "FP64", "data": [0.5, 1, 1.5, 2, 2.5, 3]}]}


async def answer(request: httpx.Request) -> httpx.Response:
    n = len(json.loads(request.content).get("inputs", []))
    if request.url.path.startswith("/v2/"):
        n = json.loads(request.content)["inputs"][0]["shape"][0]
    return httpx.Response(200, json={"predictions": [0] * n}, headers=headers.usage_headers(n))


def classical(name: str, host: str, version: str = "v1") -> Deployment:
    return Deployment(name, ClassicalModel(SCHEMA, "skops", "sklearn"), [Upstream(f"http://{host}:9", name=host)],
                      AdmissionQueue(QueueConfig(max_inflight=8)), version=version, upstream_model=f"{name}-up")


@pytest.fixture
def gateway(tmp_path):
    replicas = Replicas(a=answer, b=answer)
    gw, key = make_gateway(tmp_path, replicas, [classical("clf", "a")], prices={"clf": ModelPrice(2e6, 0, 0)})
    gw.deployments.add(classical("clf", "b", "v2"), canary=True)  # weight 0: only a versioned path reaches it
    records = []
    gw.observers.append(records.append)
    with TestClient(build_gateway_app(gw)) as client:
        client.headers["authorization"] = f"Bearer {key}"
        yield client, replicas, records


def test_rows_are_the_plans_tokens_and_the_upstream_gets_its_model(gateway):
    client, replicas, records = gateway
    r = client.post("/v1/predict", json={"model": "clf", "inputs": ROWS})
    assert r.status_code == 200 and r.json()["predictions"] == [0, 0, 0]
    sent = replicas.requests[-1]
    assert sent.url.path == "/v1/predict" and json.loads(sent.content)["model"] == "clf-up"
    [rec] = records
    assert (rec.status, rec.prompt_tokens, rec.completion_tokens, rec.model) == ("completed", 3, 0, "clf")
    assert rec.cost_usd == pytest.approx(6.0)  # 3 rows at $2 a row (input_usd_per_mtok is per million rows)
    plain = b'{"inputs": [{"a": 0.5, "b": 1}]}'
    assert client.post("/v1/predict", content=plain).status_code == 200  # the kind's default model
    assert replicas.requests[-1].content == plain  # forwarded byte for byte: nothing to rewrite


def test_bad_requests_are_refused_before_any_replica_in_each_apis_shape(gateway):
    client, replicas, records = gateway
    v1 = client.post("/v1/predict", json={"model": "clf", "inputs": [{"a": 1.0, "b": 1.5}]})
    assert v1.status_code == 400 and v1.json()["error"]["param"] == "inputs[0].b"
    bad = dict(TENSOR, inputs=[dict(TENSOR["inputs"][0], shape=[2, 3])])
    v2 = client.post("/v2/models/clf/infer", json=bad)
    assert v2.status_code == 400 and set(v2.json()) == {"error"} and "reads [rows, 2]" in v2.json()["error"]
    huge = client.post("/v1/predict", content=b'{"inputs": [' + b"1," * (6 * 2**20) + b"1]}")
    assert huge.status_code == 413
    assert replicas.requests == [] and [r.status for r in records] == ["rejected"] * 3
    chat = client.post("/v1/chat/completions", json={"model": "clf", "messages": [{"role": "user", "content": "x"}]})
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "wrong_model_kind"


def test_v2_infer_takes_the_model_and_version_from_the_path(gateway):
    client, replicas, records = gateway
    assert client.post("/v2/models/clf/infer", json=TENSOR).status_code == 200
    assert replicas.requests[-1].url.path == "/v2/models/clf-up/infer" and replicas.requests[-1].url.host == "a"
    assert client.post("/v2/models/clf/versions/v2/infer", json=TENSOR).status_code == 200
    assert replicas.requests[-1].url.path == "/v2/models/clf-up/infer" and replicas.requests[-1].url.host == "b"
    assert [(r.deployment_version, r.prompt_tokens) for r in records] == [("v1", 3), ("v2", 3)]
    missing = client.post("/v2/models/clf/versions/v9/infer", json=TENSOR)
    assert missing.status_code == 404 and "version 'v9'" in missing.json()["error"]
    assert client.post("/v2/models/nope/infer", json=TENSOR).status_code == 404


def test_v2_health_and_metadata_need_a_key_that_may_use_the_model(gateway, tmp_path):
    client, _, _ = gateway
    meta = client.get("/v2/models/clf").json()
    assert meta["versions"] == ["v1", "v2"] and meta["platform"] == "sklearn"
    assert meta["inputs"] == [{"name": "input", "datatype": "FP64", "shape": [-1, 2]}]
    assert client.get("/v2/models/clf/versions/v2").json()["name"] == "clf"
    assert client.get("/v2/models/clf/ready").json() == {"name": "clf", "ready": True}
    assert client.get("/v2/health/live").json() == {"live": True}
    assert client.get("/v2/health/ready").status_code == 200
    anonymous = client.get("/v2/health/live", headers={"authorization": ""})
    assert anonymous.status_code == 401 and set(anonymous.json()) == {"error"}
    assert client.get("/v2/models/nope").status_code == 404
    cards = client.get("/v1/models").json()["data"]
    assert cards[0]["kind"] == "classical" and cards[0]["schema"]["features"][1]["dtype"] == "int64"
