"""Hosted providers in their own protocols, in process: the gateway's app with an external deployment whose
transport translates to the provider, and the provider played by a mock that checks each request against the
provider's published API reference and answers in the reference's shapes. The providers' servers are out of
reach here (no network); Anthropic's protocol is also checked against a real server in test_providers_e2e.py."""
import json
import zlib

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from inferd.gateway.admission import AdmissionQueue, QueueConfig
from inferd.gateway.app import build_gateway_app
from inferd.gateway.deployments import Deployment, TextModel, Upstream
from inferd.gateway.providers import AzureTransport
from tests.gateway.test_lifecycle import Replicas, WordTokenizer, deployment, make_gateway

ASK = [{"role": "user", "content": "one two three"}]
SSE = {"content-type": "text/event-stream"}


def provider_deployment(base_url: str, transport: httpx.AsyncBaseTransport, runtime: str) -> Deployment:
    return Deployment("hosted", TextModel(WordTokenizer(), 64), [Upstream(base_url, "provider-key", name="hosted",
                                                                           transport=transport)],
                      AdmissionQueue(QueueConfig(max_inflight=4)), internal_headers=False, runtime=runtime,
                      upstream_model="my-gpt-deployment")


def served(tmp_path, deployment: Deployment):
    gw, key = make_gateway(tmp_path, Replicas(), [deployment])  # its replicas: none; the provider has its own
    records = []
    gw.observers.append(records.append)
    return gw, key, records


# Azure OpenAI: POST {endpoint}/openai/deployments/{deployment-id}/chat/completions?api-version=..., api-key header

def test_azure_gets_its_url_version_and_key_and_its_answer_passes(tmp_path):
    seen = []

    def azure(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        body = json.loads(request.content)
        if body.get("stream"):
            chunks = [{"id": "chatcmpl-az2", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o",
                       "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
                      for piece in ("Hel", "lo")]
            chunks.append({"id": "chatcmpl-az2", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o",
                           "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}})
            text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return httpx.Response(200, stream=httpx.ByteStream(text.encode()), headers=SSE)
        return httpx.Response(200, json={
            "id": "chatcmpl-az1", "object": "chat.completion", "created": 1, "model": "gpt-4o",
            "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": {}}],
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hi."},
                         "content_filter_results": {}}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}})
    transport = AzureTransport("my-gpt-deployment", "2024-10-21", inner=httpx.MockTransport(azure))
    gw, key, records = served(tmp_path, provider_deployment("https://res.openai.azure.com", transport, "azure"))
    with TestClient(build_gateway_app(gw)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)
        r = client.chat.completions.create(model="hosted", messages=ASK, max_tokens=5)
        streamed = list(client.chat.completions.create(model="hosted", messages=ASK, max_tokens=5, stream=True))
    request = seen[0]
    assert str(request.url) == ("https://res.openai.azure.com/openai/deployments/my-gpt-deployment/chat/completions"
                                "?api-version=2024-10-21")
    assert request.headers["api-key"] == "provider-key" and "authorization" not in request.headers
    assert json.loads(request.content)["messages"] == ASK
    assert json.loads(seen[1].content)["stream_options"] == {"include_usage": True}  # its usage, for the record
    assert r.choices[0].message.content == "Hi." and r.usage.completion_tokens == 3
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "Hello"
    assert [(x.status, x.prompt_tokens, x.completion_tokens) for x in records] == [("completed", 9, 3),
                                                                                  ("completed", 9, 2)]


@pytest.mark.parametrize("status, code", [(429, "429"), (400, "400")])
def test_azure_errors_pass_in_openais_shape(tmp_path, status, code):
    def azure(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json={"error": {"code": code, "message": "Requests to the deployment have "
                                                      "exceeded a limit."}}, headers={"retry-after": "7"})
    transport = AzureTransport("my-gpt-deployment", "2024-10-21", inner=httpx.MockTransport(azure))
    gw, key, records = served(tmp_path, provider_deployment("https://res.openai.azure.com", transport, "azure"))
    with TestClient(build_gateway_app(gw)) as http:
        r = http.post("/v1/chat/completions", json={"model": "hosted", "messages": ASK, "max_tokens": 5},
                      headers={"authorization": f"Bearer {key}"})
    assert r.status_code == status and "exceeded" in r.json()["error"]["message"]
    assert [x.status for x in records] == ["failed"]


# Gemini: POST {base}/models/{model}:generateContent (:streamGenerateContent?alt=sse), x-goog-api-key header

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": CITY}}]
HISTORY = [{"role": "system", "content": "be brief"}, *ASK,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def gemini_answer(parts: list[dict], finish: str = "STOP") -> dict:
    return {"candidates": [{"content": {"role": "model", "parts": parts}, "finishReason": finish, "index": 0}],
            "usageMetadata": {"promptTokenCount": 11, "candidatesTokenCount": 4, "thoughtsTokenCount": 2,
                              "cachedContentTokenCount": 3, "totalTokenCount": 17},
            "modelVersion": "gemini-2.5-flash", "responseId": "resp1"}


def gemini_gateway(tmp_path, handler):
    from inferd.gateway.providers import GeminiTransport
    d = provider_deployment("https://generativelanguage.googleapis.com/v1beta",
                            GeminiTransport(inner=httpx.MockTransport(handler)), "gemini")
    d.upstream_model = "gemini-2.5-flash"
    return served(tmp_path, d)


def test_gemini_gets_its_request_and_answers_with_a_call(tmp_path):
    seen = []

    def gemini(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        call = {"functionCall": {"name": "get_weather", "args": {"city": "Oslo"}}}
        return httpx.Response(200, json=gemini_answer([{"text": "Let me check."}, call]))
    gw, key, records = gemini_gateway(tmp_path, gemini)
    with TestClient(build_gateway_app(gw)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)
        r = client.chat.completions.create(model="hosted", messages=HISTORY, max_tokens=7, temperature=0.3, stop="END",
                                           tools=TOOLS, tool_choice={"type": "function",
                                                                     "function": {"name": "get_weather"}})
    request = seen[0]
    assert str(request.url) == ("https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-flash"
                                ":generateContent")
    assert request.headers["x-goog-api-key"] == "provider-key" and "authorization" not in request.headers
    body = json.loads(request.content)
    assert body["systemInstruction"] == {"parts": [{"text": "be brief"}]}
    assert body["contents"] == [
        {"role": "user", "parts": [{"text": "one two three"}]},
        {"role": "model", "parts": [{"functionCall": {"name": "get_weather", "args": {"city": "Rome"}}}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "get_weather", "response": {"content": "sunny"}}}]}]
    assert body["generationConfig"] == {"maxOutputTokens": 7, "temperature": 0.3, "stopSequences": ["END"]}
    assert body["tools"][0]["functionDeclarations"][0]["parametersJsonSchema"] == TOOLS[0]["function"]["parameters"]
    assert body["toolConfig"] == {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["get_weather"]}}
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Oslo"})]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.prompt_tokens_details.cached_tokens) == (11, 6, 3)
    assert [(x.status, x.prompt_tokens, x.cached_tokens, x.completion_tokens) for x in records] == [
        ("completed", 11, 3, 6)]


def test_gemini_streams_as_chunks_with_its_usage(tmp_path):
    seen = []

    def gemini(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        events = [gemini_answer([{"text": "Hel"}], None), gemini_answer([{"text": "lo"}], None),
                  gemini_answer([{"functionCall": {"name": "get_weather", "args": {"city": "Rome"}}}], "STOP")]
        for e in events[:-1]:
            del e["candidates"][0]["finishReason"]
        text = "".join(f"data: {json.dumps(e)}\r\n\r\n" for e in events)
        return httpx.Response(200, stream=httpx.ByteStream(text.encode()), headers=SSE)
    gw, key, records = gemini_gateway(tmp_path, gemini)
    with TestClient(build_gateway_app(gw)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)
        chunks = list(client.chat.completions.create(model="hosted", messages=ASK, max_tokens=9, stream=True,
                                                     stream_options={"include_usage": True}, tools=TOOLS))
    assert seen[0].url.path.endswith(":streamGenerateContent") and seen[0].url.params["alt"] == "sse"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    [call] = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert (call.index, call.function.name, json.loads(call.function.arguments)) == (0, "get_weather", {"city": "Rome"})
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens == 11
    assert [(x.status, x.completion_tokens) for x in records] == [("completed", 6)]


@pytest.mark.parametrize("status, kind", [(400, "INVALID_ARGUMENT"), (429, "RESOURCE_EXHAUSTED"),
                                          (503, "UNAVAILABLE")])
def test_gemini_errors_in_openais_shape(tmp_path, status, kind):
    def gemini(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json={"error": {"code": status, "message": "no good", "status": kind}})
    gw, key, records = gemini_gateway(tmp_path, gemini)
    with TestClient(build_gateway_app(gw)) as http:
        r = http.post("/v1/chat/completions", json={"model": "hosted", "messages": ASK, "max_tokens": 5},
                      headers={"authorization": f"Bearer {key}"})
    assert r.status_code == status and r.json()["error"] == {"message": "no good", "type": kind.lower(),
                                                             "param": None, "code": kind.lower()}
    assert [x.status for x in records] == ["failed"]


# Bedrock: POST {base}/model/{modelId}/converse (converse-stream: AWS event-stream frames), signed with SigV4

def frame(event_type: str, payload: dict, message_type: str = "event") -> bytes:
    """One AWS event-stream message, as the format's reference lays it out: prelude (total and headers length,
    its CRC32), string headers, the payload, the message's CRC32."""
    headers = b""
    for name, value in ((":event-type", event_type), (":message-type", message_type),
                        (":content-type", "application/json")):
        headers += bytes([len(name)]) + name.encode() + bytes([7]) + len(value).to_bytes(2, "big") + value.encode()
    body = json.dumps(payload).encode()
    prelude = (12 + len(headers) + len(body) + 4).to_bytes(4, "big") + len(headers).to_bytes(4, "big")
    prelude += zlib.crc32(prelude).to_bytes(4, "big")
    message = prelude + headers + body
    return message + zlib.crc32(message).to_bytes(4, "big")


@pytest.fixture
def aws(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")


def signature_checked(request: httpx.Request) -> None:
    """Signs the request as received again with botocore at its X-Amz-Date: the signature sent must be that."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials
    aws = AWSRequest("POST", str(request.url), data=request.content,
                     headers={k: v for k, v in request.headers.items() if k in ("content-type", "host", "x-amz-date")})
    aws.context["timestamp"] = request.headers["x-amz-date"]
    auth = SigV4Auth(Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"), "bedrock", "eu-west-1")
    expected = auth.signature(auth.string_to_sign(aws, auth.canonical_request(aws)), aws)
    sent = request.headers["authorization"]
    assert sent.startswith("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/") and "/eu-west-1/bedrock/aws4_request" in sent
    assert sent.endswith(f"Signature={expected}")


def bedrock_gateway(tmp_path, handler, key: str | None = None):
    from inferd.gateway.providers import BedrockTransport
    d = provider_deployment("https://bedrock-runtime.eu-west-1.amazonaws.com",
                            BedrockTransport(inner=httpx.MockTransport(handler)), "bedrock")
    d.upstreams[0].api_key = key
    d.upstream_model = "anthropic.claude-3-haiku-20240307-v1:0"
    return served(tmp_path, d)


def test_bedrock_converse_signed_translated_and_answered(tmp_path, aws):
    seen = []

    def bedrock(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        signature_checked(request)
        return httpx.Response(200, json={
            "output": {"message": {"role": "assistant", "content": [
                {"text": "Checking."},
                {"toolUse": {"toolUseId": "tu1", "name": "get_weather", "input": {"city": "Oslo"}}}]}},
            "stopReason": "tool_use", "usage": {"inputTokens": 20, "outputTokens": 9, "totalTokens": 29},
            "metrics": {"latencyMs": 300}})
    gw, key, records = bedrock_gateway(tmp_path, bedrock)
    with TestClient(build_gateway_app(gw)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)
        r = client.chat.completions.create(model="hosted", messages=HISTORY, max_tokens=7, tools=TOOLS,
                                           tool_choice="required")
    request = seen[0]
    assert request.url.raw_path == b"/model/anthropic.claude-3-haiku-20240307-v1%3A0/converse"
    body = json.loads(request.content)
    assert body["system"] == [{"text": "be brief"}] and body["inferenceConfig"] == {"maxTokens": 7}
    assert body["messages"] == [
        {"role": "user", "content": [{"text": "one two three"}]},
        {"role": "assistant", "content": [{"toolUse": {"toolUseId": "c1", "name": "get_weather",
                                                       "input": {"city": "Rome"}}}]},
        {"role": "user", "content": [{"toolResult": {"toolUseId": "c1", "content": [{"text": "sunny"}]}}]}]
    assert body["toolConfig"] == {"tools": [{"toolSpec": {"name": "get_weather", "description": "Weather",
                                                          "inputSchema": {"json": CITY}}}], "toolChoice": {"any": {}}}
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("tu1", "get_weather", {"city": "Oslo"})]
    assert [(x.status, x.prompt_tokens, x.completion_tokens) for x in records] == [("completed", 20, 9)]


def test_bedrock_converse_stream_frames_as_chunks(tmp_path, aws):
    def bedrock(request: httpx.Request) -> httpx.Response:
        signature_checked(request)
        assert request.url.path.endswith("/converse-stream")
        frames = [frame("messageStart", {"role": "assistant"}),
                  frame("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": "Hel"}}),
                  frame("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": "lo"}}),
                  frame("contentBlockStop", {"contentBlockIndex": 0}),
                  frame("contentBlockStart", {"contentBlockIndex": 1, "start": {"toolUse": {
                      "toolUseId": "tu2", "name": "get_weather"}}}),
                  frame("contentBlockDelta", {"contentBlockIndex": 1, "delta": {"toolUse": {"input": '{"city":'}}}),
                  frame("contentBlockDelta", {"contentBlockIndex": 1, "delta": {"toolUse": {"input": ' "Rome"}'}}}),
                  frame("contentBlockStop", {"contentBlockIndex": 1}),
                  frame("messageStop", {"stopReason": "tool_use"}),
                  frame("metadata", {"usage": {"inputTokens": 12, "outputTokens": 8, "totalTokens": 20},
                                     "metrics": {"latencyMs": 90}})]
        data = b"".join(frames)
        pieces = [data[i:i + 37] for i in range(0, len(data), 37)]  # frames cut across the stream's pieces
        return httpx.Response(200, stream=httpx.ByteStream(b"".join(pieces)),
                              headers={"content-type": "application/vnd.amazon.eventstream"})
    gw, key, records = bedrock_gateway(tmp_path, bedrock)
    with TestClient(build_gateway_app(gw)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)
        chunks = list(client.chat.completions.create(model="hosted", messages=ASK, max_tokens=9, stream=True,
                                                     stream_options={"include_usage": True}, tools=TOOLS))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert calls[0].id == "tu2" and calls[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in calls)) == {"city": "Rome"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.prompt_tokens == 12 and chunks[-1].usage.completion_tokens == 8
    assert [(x.status, x.completion_tokens) for x in records] == [("completed", 8)]


def test_bedrock_with_an_api_key_sends_it_as_a_bearer_token_and_its_errors_keep_their_status(tmp_path, aws):
    def bedrock(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer bedrock-api-key"
        return httpx.Response(429, json={"message": "Too many requests, please wait before trying again."},
                              headers={"x-amzn-errortype": "ThrottlingException"})
    gw, key, records = bedrock_gateway(tmp_path, bedrock, key="bedrock-api-key")
    with TestClient(build_gateway_app(gw)) as http:
        r = http.post("/v1/chat/completions", json={"model": "hosted", "messages": ASK, "max_tokens": 5},
                      headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    assert "Too many requests" in r.json()["error"]["message"] and [x.status for x in records] == ["failed"]


def test_an_answer_the_gateway_cannot_read_is_a_502_not_a_500(tmp_path):
    from inferd.gateway.providers import GeminiTransport
    d = provider_deployment("https://generativelanguage.googleapis.com/v1beta",
                            GeminiTransport(inner=httpx.MockTransport(lambda r: httpx.Response(200, content=b"[1"))),
                            "gemini")
    gw, key, records = served(tmp_path, d)
    with TestClient(build_gateway_app(gw)) as http:
        r = http.post("/v1/chat/completions", json={"model": "hosted", "messages": ASK, "max_tokens": 5},
                      headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
    assert [x.status for x in records] == ["failed"]


def test_a_providers_429_goes_to_the_fallback_and_messages_come_back_in_anthropics_shape(tmp_path):
    from inferd.gateway.providers import GeminiTransport

    def limited(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, json={"error": {"code": 429, "message": "quota", "status": "RESOURCE_EXHAUSTED"}})

    async def backup(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"id": "chatcmpl-b", "object": "chat.completion", "model": "b", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "from the backup"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}})
    hosted = provider_deployment("https://generativelanguage.googleapis.com/v1beta",
                                 GeminiTransport(inner=httpx.MockTransport(limited)), "gemini")
    hosted.fallbacks = ["backup"]
    gw, key = make_gateway(tmp_path, Replicas(b=backup), [hosted, deployment("backup", "b")])
    records = []
    gw.observers.append(records.append)
    with TestClient(build_gateway_app(gw)) as http:
        r = http.post("/v1/messages", json={"model": "hosted", "messages": ASK, "max_tokens": 5},
                      headers={"x-api-key": key})
    assert r.status_code == 200 and r.json()["content"] == [{"type": "text", "text": "from the backup"}]
    assert r.headers["x-inferd-fallback"] == "hosted->backup"
    assert [(x.model, x.status, x.http_status) for x in records] == [("hosted", "failed", 429),
                                                                    ("backup", "completed", 200)]
