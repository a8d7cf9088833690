"""The embedding replica in process (Starlette's TestClient): OpenAI's contract, its errors, its probes."""
import base64
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from starlette.testclient import TestClient

from inferd.embeddings.config import EmbeddingConfig
from inferd.embeddings.metrics import EmbeddingMetrics
from inferd.embeddings.runtime import EmbeddingRuntime
from inferd.embeddings.server import build_embedding_app
from inferd.protocol import headers
from tests.minilm import TEXTS, minilm_files, sentence_transformer, text

KEY = "sk-embed"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def client():
    metrics = EmbeddingMetrics()
    runtime = EmbeddingRuntime(minilm_files(), EmbeddingConfig(max_batch_inputs=16), "minilm",
                               on_batch=metrics.observe_batch)
    with TestClient(build_embedding_app(runtime, metrics, api_key=KEY)) as client:
        deadline = time.monotonic() + 60
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, "the replica never got ready"
            time.sleep(0.05)
        yield client


def embed(client: TestClient, expect: int = 200, extra_headers: dict | None = None, **body) -> dict:
    response = client.post("/v1/embeddings", json=body, headers=AUTH | (extra_headers or {}))
    assert response.status_code == expect, response.text
    return response.json()


def vectors(answer: dict) -> torch.Tensor:
    assert [d["index"] for d in answer["data"]] == list(range(len(answer["data"])))
    return torch.tensor([d["embedding"] for d in answer["data"]])


def test_the_response_has_openais_shape_and_sentence_transformers_values(client):
    answer = embed(client, input=TEXTS, model="minilm", user="someone")
    assert answer["object"] == "list" and answer["model"] == "minilm"
    assert all(d["object"] == "embedding" and len(d["embedding"]) == 384 for d in answer["data"])
    tokens = sum(len(e.ids) for e in minilm_files().tokenizer.encode_batch(TEXTS))
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    reference = sentence_transformer().encode(TEXTS, convert_to_tensor=True)
    assert min(F.cosine_similarity(vectors(answer), reference).tolist()) >= 0.999  # bf16 here (auto)


def test_base64_is_the_same_float32_bytes_and_the_openai_sdk_reads_it(client):
    floats = vectors(embed(client, input=TEXTS[:3]))
    packed = embed(client, input=TEXTS[:3], encoding_format="base64")["data"]
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in packed])
    assert torch.equal(torch.from_numpy(decoded.copy()), floats)
    openai = pytest.importorskip("openai")
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=client)
    answer = sdk.embeddings.create(input=TEXTS[:3], model="minilm")  # asks for base64 and decodes it
    assert torch.equal(torch.tensor([d.embedding for d in answer.data]), floats)


def test_token_ids_embed_like_their_text(client):
    ids = minilm_files().tokenizer.encode(TEXTS[1], add_special_tokens=False).ids
    by_text, by_ids = vectors(embed(client, input=TEXTS[1])), vectors(embed(client, input=ids))
    assert torch.equal(by_text, by_ids)
    both = vectors(embed(client, input=[ids, ids[:3]]))
    assert both.shape == (2, 384) and torch.equal(both[0], by_ids[0])


def test_a_hundred_inputs_come_back_in_order(client):
    inputs = [text(3 + (i * 37) % 120, i) for i in range(100)]
    got = vectors(embed(client, input=inputs))
    reference = sentence_transformer().encode(inputs, convert_to_tensor=True)
    similarity = F.cosine_similarity(got[:, None], reference[None], dim=-1)  # [ours, theirs]
    assert min(similarity.diagonal().tolist()) >= 0.999
    assert torch.equal(similarity.argmax(1), torch.arange(100))


def test_dimensions_the_models_own_or_refused(client):
    assert len(embed(client, input="hi", dimensions=384)["data"][0]["embedding"]) == 384
    for asked in (100, 1000, 0):
        assert embed(client, 400, input="hi", dimensions=asked)["error"]["param"] == "dimensions"


@pytest.mark.parametrize("body, param, says", [
    ({"input": ""}, "input", "empty string"),
    ({"input": []}, "input", "empty list"),
    ({"input": ["a", 3]}, "input", "input[1] is not a string"),
    ({"input": ["a", ""]}, "input", "input[1] is an empty string"),
    ({"input": [[1], []]}, "input", "input[1]"),
    ({"input": [5, 30522]}, "input", "token id 30522"),
    ({"input": ["x"] * 2049}, "input", "at most 2048"),
    ({"input": ["short", text(400)]}, "input", "Input 1 has"),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format", "'float' or 'base64'"),
    ({}, "input", "required"),
])
def test_bad_requests_are_400_in_the_error_shape(client, body, param, says):
    error = embed(client, 400, **body)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and says in error["message"]


def test_truncate_cuts_what_is_too_long(client):
    answer = embed(client, input=[text(400)], truncate=True)
    assert answer["usage"]["prompt_tokens"] == 256 and len(answer["data"]) == 1


def test_model_key_priority_and_deadline_headers(client):
    assert embed(client, 404, input="hi", model="other")["error"]["code"] == "model_not_found"
    wrong = client.post("/v1/embeddings", json={"input": "hi"}, headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert embed(client, 400, {headers.PRIORITY: "urgent"}, input="hi")["error"]["param"] == headers.PRIORITY
    assert len(embed(client, 200, {headers.PRIORITY: "batch"}, input="hi")["data"]) == 1
    many = [text(30, i) for i in range(2048)]  # tokenizing them takes longer than the 1 ms left
    late = embed(client, 504, {headers.DEADLINE_MS: "1"}, input=many)["error"]
    assert late["code"] == "deadline_exceeded"


def test_models_ready_health_and_metrics(client):
    [card] = client.get("/v1/models", headers=AUTH).json()["data"]
    assert {k: card[k] for k in ("id", "object", "owned_by", "kind", "dimensions", "max_input_tokens", "matryoshka")} \
        == {"id": "minilm", "object": "model", "owned_by": "inferd", "kind": "embedding", "dimensions": 384,
            "max_input_tokens": 256, "matryoshka": False}
    assert card["digests"] == minilm_files().digests and card["source_path"]
    ready = client.get("/ready").json()
    assert ready["status"] == "ready" and ready["loaded_unix_s"] <= ready["warm_unix_s"] <= time.time()
    assert client.get("/health").json() == {"status": "ok"}
    embed(client, input=["one", "two"])
    scrape = client.get("/metrics").text
    for name in ("inferd_embedding_requests_total{outcome=\"completed\"}", "inferd_embedding_inputs_total",
                 "inferd_embedding_tokens_total", "inferd_embedding_batch_inputs_bucket",
                 "inferd_embedding_queue_time_seconds_bucket", "inferd_embedding_batch_compute_seconds_bucket",
                 "inferd_embedding_queue_inputs", "inferd_embedding_requests_total{outcome=\"rejected\"}"):
        assert name in scrape, name
