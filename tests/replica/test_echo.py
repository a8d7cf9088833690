"""The replica's own echo and tokenizer routes (a tiny random model in process, no gateway): echoed prompt
logprobs equal transformers' across prompt chunks, and /tokenize, /detokenize, /tokenizer_info answer."""
from collections.abc import Iterator

import pytest
import torch
from starlette.testclient import TestClient

from inferd.engine.async_engine import AsyncEngine
from inferd.engine.config import EngineConfig
from inferd.engine.engine import LLMEngine
from inferd.replica.server import ReplicaConfig, build_replica_app
from tests.tiny import tiny_hf_model, tiny_loaded_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    model = tiny_loaded_model()
    engine = LLMEngine(model, EngineConfig(dtype="float32", num_kv_blocks=256, block_size=4,
                                           max_num_batched_tokens=8))
    with TestClient(build_replica_app(AsyncEngine(engine), model, ReplicaConfig())) as client:
        yield client


def test_echo_of_token_id_prompts_longer_than_a_chunk(http):
    hf, _ = tiny_hf_model("llama")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (21, 3)]
    r = http.post("/v1/completions", json={"prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    for ids, choice in zip(prompts, sorted(r.json()["choices"], key=lambda c: c["index"])):
        with torch.no_grad():
            lp = hf(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        ref = lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()
        got = choice["logprobs"]
        assert got["token_logprobs"][0] is None and got["token_logprobs"][1:] == pytest.approx(ref, abs=1e-4)
        assert len(got["tokens"]) == len(ids) and choice["finish_reason"] == "length"
    assert r.json()["usage"] == {"prompt_tokens": 24, "completion_tokens": 0, "total_tokens": 24,
                                 "prompt_tokens_details": {"cached_tokens": 0}}


def test_tokenizer_routes(http):
    r = http.post("/tokenize", json={"prompt": "tea set", "add_special_tokens": False})
    assert r.status_code == 200
    tokens = r.json()["tokens"]
    assert r.json()["count"] == len(tokens) and r.json()["max_model_len"] == 512
    assert http.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": "tea set"}
    assert http.post("/detokenize", json={"tokens": [384]}).status_code == 400
    assert http.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404
    assert http.get("/tokenizer_info").json()["eos_token"] == "</s>"
