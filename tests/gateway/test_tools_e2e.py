"""Tool calling through the real `inferd serve` (SmolLM2-135M, whose template has no tools section: the generic
format), with the official openai client: each tool_choice, parallel calls, a loop of call, result and answer,
the stream against the whole answer, and the errors; the usage records count the tools' tokens."""
import json

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import SMOLLM2_KEY

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["timezone"],
        "properties": {"timezone": {"type": "string", "maxLength": 40}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The current time in a timezone.",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def url(smollm2_server) -> str:
    return smollm2_server[0]


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=SMOLLM2_KEY, max_retries=0, timeout=120)


def chat(client, **kw):
    return client.chat.completions.create(**{"model": "SmolLM2-135M-Instruct", "messages": ASK, "tools": TOOLS,
                                             "max_tokens": 80, "temperature": 0} | kw)


def checked(message) -> list[tuple[str, dict]]:
    out = []
    for call in message.tool_calls:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def test_required_gives_a_call_that_validates(client):
    r = chat(client, tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [(name, arguments)] = checked(choice.message)
    assert name == "get_weather" and "paris" in arguments["city"].lower()


def test_a_named_function_is_called(client):
    r = chat(client, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [name for name, _ in checked(r.choices[0].message)] == ["get_time"]


def test_auto_and_parallel_calls_validate_at_any_temperature(client):
    r = chat(client, n=6, temperature=1.0, seed=3, max_tokens=120)
    for c in r.choices:
        if c.message.tool_calls:
            assert checked(c.message)
        else:
            assert c.message.content is not None and c.finish_reason in ("stop", "length")


def test_a_loop_of_call_result_and_answer(client):
    first = chat(client, tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 18, "sky": "clear"})}]
    second = chat(client, messages=history, tool_choice="none", max_tokens=40)
    assert second.choices[0].finish_reason in ("stop", "length") and second.choices[0].message.content
    assert second.choices[0].message.tool_calls is None


def test_the_stream_is_the_whole_answer_in_pieces(client):
    whole = chat(client, tool_choice="required", parallel_tool_calls=False)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chat(client, tool_choice="required", parallel_tool_calls=False, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": None, "arguments": ""})
                entry["name"] = d.function.name or entry["name"]
                entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [{"name": t.function.name, "arguments": t.function.arguments}
                                                 for t in whole.choices[0].message.tool_calls]


def test_tool_definitions_are_billed_as_prompt_tokens(client):
    plain = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=1)
    offered = chat(client, max_tokens=1, tool_choice="auto")
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens + 60


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}]},
     "tools[0].function.parameters"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
])
def test_bad_tools_are_400_in_the_error_shape(url, fields, param):
    r = httpx.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {SMOLLM2_KEY}"},
                   json={"model": "SmolLM2-135M-Instruct", "messages": ASK, "tools": TOOLS} | fields)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
