import json

import pytest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from inferd.engine.request import EngineError
from inferd.models.errors import ChatTemplateError
from inferd.protocol.errors import (APIError, AuthenticationFailed, ContextLengthExceeded, InvalidRequest,
                                    ModelNotFound, error_response, to_api_error)
from inferd.protocol.http import RequestContextMiddleware, http_exception_handler
from inferd.protocol.openai import ChatCompletionRequest, CompletionRequest
from inferd.replica.errors import replica_error


def body_of(exc: BaseException) -> tuple[int, dict]:
    """As a replica answers (its runtime's errors first, then the contract's mapping)."""
    response = error_response(exc, replica_error)
    return response.status_code, json.loads(response.body)["error"]


def validation_error(model, data) -> ValidationError:
    with pytest.raises(ValidationError) as e:
        model.model_validate(data)
    return e.value


# mapping

@pytest.mark.parametrize("exc, status, code", [
    (InvalidRequest("x"), 400, None), (ContextLengthExceeded("x"), 400, "context_length_exceeded"),
    (AuthenticationFailed("x"), 401, "invalid_api_key"), (ModelNotFound("x"), 404, "model_not_found"),
    (EngineError("prompt too long"), 400, None), (json.JSONDecodeError("bad", "{", 0), 400, "invalid_json"),
    (HTTPException(404), 404, "not_found"), (HTTPException(405), 405, "method_not_allowed"),
    (ChatTemplateError("no template"), 400, None),
])
def test_statuses(exc, status, code):
    got_status, error = body_of(exc)
    assert (got_status, error["code"]) == (status, code)
    assert set(error) == {"message", "type", "param", "code"}


def test_engine_and_template_messages_reach_the_user():
    assert body_of(EngineError("prompt too long"))[1]["message"] == "prompt too long"
    assert body_of(ChatTemplateError("no template"))[1]["param"] == "messages"


def test_internal_errors_hide_details():
    status, error = body_of(RuntimeError("secret internal detail /etc/passwd"))
    assert status == 500 and "secret" not in error["message"] and error["type"] == "server_error"


def test_validation_error_names_the_field():
    status, error = body_of(validation_error(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                                                      "temperature": 9}))
    assert (status, error["param"], error["type"]) == (400, "temperature", "invalid_request_error")
    assert error["message"] == "Invalid 'temperature': Input should be less than or equal to 2"


def test_validation_missing_field():
    _, error = body_of(validation_error(ChatCompletionRequest, {}))
    assert (error["param"], error["message"]) == ("messages", "'messages' is a required property")


def test_validation_union_picks_the_informative_branch():
    bad_part = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]}
    _, error = body_of(validation_error(ChatCompletionRequest, bad_part))
    assert error["param"] == "messages.0.content.0.type"
    too_many = {"messages": [{"role": "user", "content": "x"}], "stop": list("abcde")}
    _, error = body_of(validation_error(ChatCompletionRequest, too_many))
    assert error["param"] == "stop" and "at most 4" in error["message"]


def test_validation_of_a_non_object_body():
    status, error = body_of(validation_error(CompletionRequest, [1, 2]))
    assert status == 400 and error["param"] is None


def test_never_422():
    for data in [{}, {"prompt": "x", "max_tokens": "lots"}, {"prompt": "x", "n": "many"}, "text"]:
        assert error_response(validation_error(CompletionRequest, data)).status_code == 400


def test_api_error_fields():
    err = APIError("m", param="p", code="c")
    assert (err.status, err.message, err.param, err.code, err.type) == (400, "m", "p", "c", "invalid_request_error")
    assert to_api_error(err) is err


# request id and authentication, on a bare app

def make_client(api_key: str | None = "sk-1") -> TestClient:
    async def ok(request: Request) -> JSONResponse:
        return JSONResponse({"request_id": request.state.request_id})

    async def boom(request: Request) -> JSONResponse:
        raise RuntimeError("internal detail")

    async def bad(request: Request) -> JSONResponse:
        raise InvalidRequest("no", param="x")

    routes = [Route("/v1/ok", ok), Route("/v1/boom", boom), Route("/v1/bad", bad), Route("/open", ok)]
    app = Starlette(routes=routes, middleware=[Middleware(RequestContextMiddleware, api_key=api_key)],
                    exception_handlers={HTTPException: http_exception_handler})
    return TestClient(app, raise_server_exceptions=False)


AUTH = {"Authorization": "Bearer sk-1"}


def test_request_id_accepted_or_generated():
    client = make_client()
    r = client.get("/v1/ok", headers=AUTH | {"x-request-id": "trace.A-1_b"})
    assert r.headers["x-request-id"] == "trace.A-1_b" == r.json()["request_id"]
    for bad_id in ["has space", "x" * 129, "semi;colon", ""]:
        rid = client.get("/v1/ok", headers=AUTH | {"x-request-id": bad_id}).headers["x-request-id"]
        assert rid.startswith("req_") and len(rid) == 36


@pytest.mark.parametrize("headers, message", [
    ({}, "Missing"), ({"Authorization": "Bearer sk-2"}, "Incorrect"), ({"Authorization": "sk-1"}, "Missing"),
    ({"Authorization": "Basic sk-1"}, "Missing"),
])
def test_authentication(headers, message):
    r = make_client().get("/v1/ok", headers=headers | {"x-request-id": "r1"})
    assert r.status_code == 401 and r.headers["x-request-id"] == "r1"
    assert r.json()["error"]["code"] == "invalid_api_key" and message in r.json()["error"]["message"]


def test_open_paths_and_no_key_configured():
    assert make_client().get("/open").status_code == 200
    assert make_client(api_key=None).get("/v1/ok").status_code == 200
    assert make_client().get("/v1/ok", headers={"authorization": "bearer sk-1"}).status_code == 200


def test_every_error_has_the_shape_and_a_request_id():
    client = make_client()
    for path, status in [("/v1/boom", 500), ("/v1/bad", 400), ("/v1/missing", 404)]:
        r = client.get(path, headers=AUTH)
        assert r.status_code == status and r.headers["x-request-id"].startswith("req_")
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "internal detail" not in client.get("/v1/boom", headers=AUTH).text
    assert client.post("/v1/ok", headers=AUTH).status_code == 405
