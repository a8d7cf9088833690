"""A hosted provider in Anthropic's protocol behind the gateway's chat completions: a second `inferd serve` whose
one deployment is external with `api: anthropic`, in front of the shared server's own Messages API (a real server
that speaks it; the network to Anthropic's is not reachable here). Called with the openai client: text, streams,
tool calls and errors come back in OpenAI's shape, and the usage records hold the provider's usage."""
import json
import os

import jsonschema
import openai
import pytest

from tests.conftest import SMOLLM2_KEY
from tests.gateway.test_e2e import records
from tests.server import running_server

KEY = "sk-front-gateway"
SPEC = """
deployments:
  - name: hosted
    external: {{base_url: "{url}/v1", api_key_env: INFERD_TEST_PROVIDER_KEY, model: SmolLM2-135M-Instruct,
                api: anthropic, max_model_len: 2048}}
"""
ASK = [{"role": "user", "content": "Name a colour."}]
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 40}}}


@pytest.fixture(scope="module")
def front(smollm2_server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("front")
    (folder / "deploy.yaml").write_text(SPEC.format(url=smollm2_server[0]))
    os.environ["INFERD_TEST_PROVIDER_KEY"] = SMOLLM2_KEY  # the server process reads it from its environment
    log_path = folder / "serve.log"
    with running_server(log_path, "--config", str(folder / "deploy.yaml"), "--api-key", KEY) as url:
        yield url, log_path


@pytest.fixture(scope="module")
def client(front) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{front[0]}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_text_whole_and_streamed_with_the_providers_usage(client, front):
    r = client.chat.completions.create(model="hosted", messages=ASK, max_tokens=8, temperature=0)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 5
    chunks = list(client.chat.completions.create(model="hosted", messages=ASK, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    rows = [row for row in records(front, "default") if row["model"] == "hosted"]
    assert [(row["status"], row["completion_tokens"]) for row in rows[-2:]] == [
        ("completed", r.usage.completion_tokens)] * 2


def test_tool_calls_through_the_provider(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    r = client.chat.completions.create(model="hosted", max_tokens=60, temperature=0, tools=tools,
                                       tool_choice="required", parallel_tool_calls=False,
                                       messages=[{"role": "user", "content": "Weather in Rome?"}])
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    streamed = {}
    for chunk in client.chat.completions.create(model="hosted", max_tokens=60, temperature=0, tools=tools,
                                                tool_choice="required", parallel_tool_calls=False, stream=True,
                                                messages=[{"role": "user", "content": "Weather in Rome?"}]):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            streamed["name"] = d.function.name or streamed.get("name")
            streamed["arguments"] = streamed.get("arguments", "") + (d.function.arguments or "")
    assert json.loads(streamed["arguments"]) == json.loads(call.function.arguments)
    assert streamed["name"] == "get_weather"


def test_what_the_provider_cannot_take_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="hosted", messages=ASK, max_tokens=4, n=2)
    assert "'n'" in e.value.body["message"]


def test_messages_to_a_provider_deployment_come_back_in_anthropics_shape(front):
    import anthropic
    client = anthropic.Anthropic(base_url=front[0], api_key=KEY, max_retries=0, timeout=120)
    with client.messages.stream(model="hosted", max_tokens=8, messages=ASK, extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    whole = client.messages.create(model="hosted", max_tokens=8, messages=ASK, extra_body={"temperature": 0})
    assert text and whole.content[0].text == text and final.usage.output_tokens == whole.usage.output_tokens
