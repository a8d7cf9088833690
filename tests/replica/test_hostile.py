"""Hostile requests (tests/hostile.py) against every replica kind's app in process: the text replica over a tiny
model, embeddings, classical and policy. What the gateway asks of them and what a client could send: every
route and unknown ones, with the replica's key or another; the answer is never an internal error (a deadline a
hostile header set may pass: 504, and a replica may say it is busy: 503) and every error is in its API's shape."""
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from starlette.testclient import TestClient

from inferd.classical.config import ClassicalConfig
from inferd.classical.metrics import ClassicalMetrics
from inferd.classical.runtime import ClassicalRuntime
from inferd.classical.server import build_classical_app
from inferd.embeddings.config import EmbeddingConfig
from inferd.embeddings.metrics import EmbeddingMetrics
from inferd.embeddings.runtime import EmbeddingRuntime
from inferd.embeddings.server import build_embedding_app
from inferd.engine.async_engine import AsyncEngine
from inferd.engine.config import EngineConfig
from inferd.engine.engine import LLMEngine
from inferd.policy.config import PolicyConfig
from inferd.policy.metrics import PolicyMetrics
from inferd.policy.runtime import PolicyRuntime
from inferd.policy.server import build_policy_app
from inferd.replica.server import ReplicaConfig, build_replica_app
from tests.classical import models
from tests.hostile import check_answer, endpoints, requests, send
from tests.minilm import minilm_files
from tests.policy.tiny import TinyPolicy
from tests.tiny import tiny_loaded_model

KEY = "sk-replica-fuzz"
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.data_too_large])


def text_app():
    model = tiny_loaded_model()
    engine = LLMEngine(model, EngineConfig(dtype="float32", num_kv_blocks=256, block_size=4))
    return build_replica_app(AsyncEngine(engine), model, ReplicaConfig(api_key=KEY, served_model_name="tiny"))


def embedding_app():
    metrics = EmbeddingMetrics()
    runtime = EmbeddingRuntime(minilm_files(), EmbeddingConfig(), "minilm", on_batch=metrics.observe_batch)
    return build_embedding_app(runtime, metrics, api_key=KEY)


def classical_app():
    metrics = ClassicalMetrics()
    runtime = ClassicalRuntime.load(models.forest_skops().path, ClassicalConfig(), "forest",
                                    on_batch=metrics.observe_batch)
    return build_classical_app(runtime, metrics, api_key=KEY)


def policy_app():
    metrics = PolicyMetrics()
    return build_policy_app(PolicyRuntime(TinyPolicy(), PolicyConfig(), on_batch=metrics.observe_batch), metrics,
                            api_key=KEY)


@pytest.fixture(params=[text_app, embedding_app, classical_app, policy_app], ids=lambda f: f.__name__)
def replica(request) -> Iterator[tuple[TestClient, list, str]]:
    app = request.param()
    with TestClient(app, raise_server_exceptions=False) as client:
        deadline = time.monotonic() + 60
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, "the replica never got ready"
            time.sleep(0.05)
        [card] = client.get("/v1/models", headers={"authorization": f"Bearer {KEY}"}).json()["data"]
        yield client, endpoints(app), card["id"]


def test_hostile_requests_to_a_replica_get_no_internal_error_and_the_api_error_shape(replica):
    client, eps, model = replica

    @FUZZ
    @given(requests(eps, [model], KEY))
    def one(req):
        check_answer(req, send(client, req), eps, server_errors=(503, 504))
    one()
