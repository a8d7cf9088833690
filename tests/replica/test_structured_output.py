"""response_format over HTTP: the request shape, its errors, and JSON out of a replica (tiny model in
process, then the real `inferd serve` with SmolLM2) through the openai client."""
import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from pydantic import ValidationError
from starlette.testclient import TestClient

from inferd.protocol.errors import InvalidRequest, error_response
from inferd.protocol.openai import ChatCompletionRequest, CompletionRequest
from inferd.replica.errors import replica_error
from inferd.replica.responses import sampling_params
from inferd.engine.async_engine import AsyncEngine
from inferd.engine.config import EngineConfig
from inferd.engine.engine import LLMEngine
from inferd.engine.request import GrammarError, ResponseFormat
from inferd.replica.server import ReplicaConfig, build_replica_app
from tests.conftest import SMOLLM2_KEY
from tests.tiny import tiny_loaded_model

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["name", "kind", "owner", "tags"],
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog"]},
        "owner": {"type": "object", "additionalProperties": False, "required": ["id", "admin"],
                  "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                 "admin": {"type": "boolean"}}},
        "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "b"]}},
    },
}


def json_schema(schema: dict, **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True} | extra}


# the request shape

def test_response_formats_reach_the_engine():
    def params(rf, body=ChatCompletionRequest, **fields):
        req = body.model_validate(({"messages": USER} if body is ChatCompletionRequest else {"prompt": "hi"})
                                  | {"response_format": rf} | fields)
        return sampling_params(req, 1, 100).response_format
    assert params({"type": "text"}) is None
    assert params({"type": "json_object"}) == ResponseFormat("json_object")
    got = params(json_schema({"type": "object", "properties": {"b": {}, "a": {}}}, description="d"))
    assert got == ResponseFormat("json_schema", '{"type":"object","properties":{"b":{},"a":{}}}')  # in its order
    assert params({"type": "json_object"}, CompletionRequest) == ResponseFormat("json_object")  # an extension


@pytest.mark.parametrize("rf, param", [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
])
def test_malformed_response_formats_name_the_field(rf, param):
    with pytest.raises((ValidationError, InvalidRequest)) as e:
        ChatCompletionRequest.model_validate({"messages": USER, "response_format": rf})
    response = error_response(e.value)
    assert response.status_code == 400 and json.loads(response.body)["error"]["param"] == param


def test_grammar_errors_are_400_on_response_format():
    response = error_response(GrammarError("the JSON schema cannot be used: Invalid type: nonsense"), replica_error)
    error = json.loads(response.body)["error"]
    assert response.status_code == 400 and error["param"] == "response_format"
    assert error["message"].endswith("Invalid type: nonsense") and error["type"] == "invalid_request_error"


# a replica of the tiny random model, in process

@pytest.fixture(scope="module")
def tiny() -> Iterator[openai.OpenAI]:
    model = tiny_loaded_model()
    engine = LLMEngine(model, EngineConfig(dtype="float32", num_kv_blocks=512, block_size=4))
    engine.grammars.max_whitespace = 2  # a random model loves whitespace; shorter runs keep the tests quick
    app = build_replica_app(AsyncEngine(engine), model, ReplicaConfig())
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def valid(text: str, schema: dict = SCHEMA) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_choices_follow_the_schema(tiny, temperature):
    r = tiny.chat.completions.create(model="tiny-llama", messages=USER, n=3, seed=7, temperature=temperature,
                                     max_tokens=300, response_format=json_schema(SCHEMA))
    assert [c.finish_reason for c in r.choices] == ["stop"] * 3
    values = [valid(c.message.content) for c in r.choices]
    if temperature == 0.0:
        assert values[0] == values[1] == values[2]


def test_streamed_chat_follows_the_schema_and_seed_repeats_it(tiny):
    def stream() -> list[str]:
        texts, finish = ["", ""], [None, None]
        for chunk in tiny.chat.completions.create(model="tiny-llama", messages=USER, n=2, seed=11, max_tokens=300,
                                                  stream=True, response_format=json_schema(SCHEMA)):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                finish[c.index] = c.finish_reason or finish[c.index]
        assert finish == ["stop", "stop"]
        return texts
    first = stream()
    assert all(valid(t) for t in first) and stream() == first


def test_completions_take_response_format_as_an_extension(tiny):
    r = tiny.completions.create(model="tiny-llama", prompt="x", max_tokens=300, seed=1,
                                extra_body={"response_format": json_schema(SCHEMA)})
    assert r.choices[0].finish_reason == "stop" and valid(r.choices[0].text)


def test_json_object_is_an_object_or_cut_at_max_tokens(tiny):
    r = tiny.chat.completions.create(model="tiny-llama", messages=USER, n=4, seed=3, max_tokens=100,
                                     response_format={"type": "json_object"})
    for c in r.choices:
        assert isinstance(json.loads(c.message.content), dict) if c.finish_reason == "stop" else \
            c.finish_reason == "length" and c.message.content.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_an_unusable_schema_is_400_on_response_format(tiny, stream):
    with pytest.raises(openai.BadRequestError) as e:
        tiny.chat.completions.create(model="tiny-llama", messages=USER, stream=stream,
                                     response_format=json_schema({"type": "string", "pattern": "("}))
    assert e.value.status_code == 400 and e.value.body["param"] == "response_format"
    assert "JSON schema" in e.value.body["message"]


# the real server, SmolLM2

PERSON = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "hobbies", "pet"],
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
        "pet": {"type": "object", "additionalProperties": False, "required": ["kind", "name"],
                "properties": {"kind": {"enum": ["cat", "dog", "none"]}, "name": {"type": "string"}}},
    },
}
ALICE = [{"role": "user", "content": "Describe Alice, a 30 year old who likes chess and hiking and has a cat "
                                     "called Tom, as JSON."}]


@pytest.fixture(scope="module")
def smollm2(smollm2_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smollm2_server[0]}/v1", api_key=SMOLLM2_KEY, max_retries=0, timeout=120)


def test_smollm2_greedy_json_schema(smollm2):
    r = smollm2.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ALICE, temperature=0,
                                        max_tokens=200, response_format=json_schema(PERSON))
    assert r.choices[0].finish_reason == "stop"
    person = valid(r.choices[0].message.content, PERSON)
    assert list(person) == ["name", "age", "hobbies", "pet"]  # the schema's order
    assert person["name"] == "Alice" and person["pet"]["kind"] == "cat"


def test_smollm2_sampled_streams_follow_the_schema(smollm2):
    texts, finish = ["", ""], [None, None]
    for chunk in smollm2.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ALICE, n=2, seed=5,
                                                 temperature=0.8, max_tokens=200, stream=True,
                                                 response_format=json_schema(PERSON)):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    for text, reason in zip(texts, finish):  # sampling may wander into a long string: then it is cut
        assert (reason == "stop" and valid(text, PERSON)) or (reason == "length" and text.startswith("{"))


def test_smollm2_json_object_and_a_bad_schema(smollm2):
    r = smollm2.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=120, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give the capital of France as JSON with the key capital."}])
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as e:
        smollm2.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ALICE,
                                        response_format=json_schema({"type": "object", "required": 5}))
    assert e.value.body["param"] == "response_format"
