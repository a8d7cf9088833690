"""Anthropic's Messages API through the real `inferd serve` (SmolLM2-135M), with the official anthropic client,
unmodified: text, streaming, tools, a tool loop, count_tokens, and errors as its exception classes."""
import json

import anthropic
import jsonschema
import openai
import pytest

from tests.conftest import SMOLLM2_KEY
from tests.server import new_tenant_key

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
WEATHER = {"name": "get_weather", "description": "The current weather in a city.", "input_schema": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 40}}}}
GREEDY = {"temperature": 0}  # the SDK no longer names sampling parameters; the API still takes them


@pytest.fixture(scope="module")
def url(smollm2_server) -> str:
    return smollm2_server[0]


@pytest.fixture(scope="module")
def client(url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=SMOLLM2_KEY, max_retries=0, timeout=120)


def test_a_text_message_and_its_stream(client):
    m = client.messages.create(model=MODEL, max_tokens=12, system="Answer briefly.", messages=ASK,
                               extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens <= 12
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 10
    with client.messages.stream(model=MODEL, max_tokens=12, system="Answer briefly.", messages=ASK,
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == m.content[0].text and final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens


def test_tools_with_any_give_a_valid_tool_use_whole_or_streamed(client):
    kw = dict(model=MODEL, max_tokens=60, messages=ASK, tools=[WEATHER],
              tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    m = client.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    [use] = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER["input_schema"])
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        ("tool_use", use.name, use.input)]


def test_a_tool_loop(client):
    first = client.messages.create(model=MODEL, max_tokens=60, messages=ASK, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    use = next(b for b in first.content if b.type == "tool_use")
    history = ASK + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": json.dumps({"celsius": 18, "sky": "clear"})}]}]
    second = client.messages.create(model=MODEL, max_tokens=30, messages=history, tools=[WEATHER],
                                    tool_choice={"type": "none"}, extra_body=GREEDY)
    assert [b.type for b in second.content] == ["text"] and second.stop_reason in ("end_turn", "max_tokens")


def test_count_tokens_is_what_a_message_is_billed(client):
    counted = client.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER])
    m = client.messages.create(model=MODEL, max_tokens=1, messages=ASK, tools=[WEATHER],
                               tool_choice={"type": "auto"})
    assert counted.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)


def test_the_same_conversation_is_the_same_tokens_by_either_api(client, url):
    m = client.messages.create(model=MODEL, max_tokens=8, messages=ASK, extra_body=GREEDY)
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key=SMOLLM2_KEY, max_retries=0).chat.completions.create(
        model=MODEL, max_tokens=8, messages=ASK, temperature=0)
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens
    assert m.usage.output_tokens == chat.usage.completion_tokens
    assert m.content[0].text == chat.choices[0].message.content


def test_errors_are_the_sdks_exceptions(client, url, smollm2_server):
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="sk-nope", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=ASK)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=4, messages=ASK)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    key = new_tenant_key(smollm2_server[1], "anthropic-rpm", "--rpm", "1")
    limited = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
    limited.messages.create(model=MODEL, max_tokens=1, messages=ASK)
    with pytest.raises(anthropic.RateLimitError) as e:
        limited.messages.create(model=MODEL, max_tokens=1, messages=ASK)
    assert int(e.value.response.headers["retry-after"]) >= 1
