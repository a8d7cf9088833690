"""Tool calling through a replica of the tiny random model, in process, with the openai client: whatever the
weights sample, a finished call names an offered function and its arguments validate; the stream's pieces add up
to the whole answer. The request's shapes and errors, the prompt, and the parser on their own."""
import json
import random
from collections.abc import Iterator
from dataclasses import replace

import jsonschema
import openai
import pytest
from starlette.testclient import TestClient

from inferd.engine.async_engine import AsyncEngine
from inferd.engine.config import EngineConfig
from inferd.engine.engine import LLMEngine
from inferd.models.tokenizer import compile_chat_template
from inferd.protocol import tools
from inferd.protocol.errors import InvalidRequest
from inferd.protocol.openai import ChatCompletionRequest
from inferd.replica.server import ReplicaConfig, build_replica_app
from tests.tiny import tiny_loaded_model

USER = [{"role": "user", "content": "What is the weather in Paris, and what time is it?"}]
# every value bounded, so that a random model must finish a call
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}}}
CLOCK = {"type": "object", "additionalProperties": False, "required": ["zone"],
         "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "parameters": CLOCK}},
         {"type": "function", "function": {"name": "ping"}}]
SCHEMAS = {"get_weather": WEATHER, "clock": CLOCK, "ping": tools.NO_PARAMETERS}


@pytest.fixture(scope="module")
def tiny() -> Iterator[openai.OpenAI]:
    model = tiny_loaded_model()  # its tokenizer is about one token a character: the tools take ~700 of them
    model.config = replace(model.config, max_position_embeddings=2048)
    engine = LLMEngine(model, EngineConfig(dtype="float32", num_kv_blocks=4096, block_size=4))
    app = build_replica_app(AsyncEngine(engine), model, ReplicaConfig())
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def valid_calls(message, allowed=SCHEMAS) -> list[tuple[str, dict]]:
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in allowed
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, allowed[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


# whatever the model samples

@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_name_an_offered_function_and_validate(tiny, parallel):
    r = tiny.chat.completions.create(model="tiny-llama", messages=USER, tools=TOOLS, tool_choice="required", n=4,
                                     seed=5, temperature=1.0, max_tokens=300, parallel_tool_calls=parallel)
    for c in r.choices:  # a random model may go on calling in parallel up to max_tokens: its finished calls count
        assert c.finish_reason == ("tool_calls" if not parallel else c.finish_reason) in ("tool_calls", "length")
        if c.message.tool_calls:
            calls = valid_calls(c.message)
            assert c.message.content is None and (parallel or len(calls) == 1)
    assert sum(len(c.message.tool_calls or []) for c in r.choices) >= 4


def test_a_named_function_is_the_one_called(tiny):
    r = tiny.chat.completions.create(model="tiny-llama", messages=USER, tools=TOOLS, n=3, seed=2, max_tokens=200,
                                     tool_choice={"type": "function", "function": {"name": "clock"}})
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and [name for name, _ in valid_calls(c.message)] == ["clock"]


def test_auto_answers_in_text_or_in_valid_calls(tiny):
    r = tiny.chat.completions.create(model="tiny-llama", messages=USER, tools=TOOLS, n=8, seed=9, max_tokens=60)
    for c in r.choices:
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls" and valid_calls(c.message)
        else:
            assert c.message.content is not None and not c.message.content.startswith("<")


def test_none_offers_no_tools_and_adds_nothing_to_the_prompt(tiny):
    asked = tiny.chat.completions.create(model="tiny-llama", messages=USER, tools=TOOLS, tool_choice="none",
                                         max_tokens=5, temperature=0)
    plain = tiny.chat.completions.create(model="tiny-llama", messages=USER, max_tokens=5, temperature=0)
    assert asked.choices[0].message.tool_calls is None and asked.choices[0].message.content == \
        plain.choices[0].message.content
    assert asked.usage.prompt_tokens == plain.usage.prompt_tokens


def test_tool_definitions_count_in_the_prompt_tokens(tiny):
    with_tools = tiny.chat.completions.create(model="tiny-llama", messages=USER, tools=TOOLS, max_tokens=1)
    plain = tiny.chat.completions.create(model="tiny-llama", messages=USER, max_tokens=1)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_the_stream_adds_up_to_the_whole_answer(tiny, choice):
    kw = dict(model="tiny-llama", messages=USER, tools=TOOLS, tool_choice=choice, n=3, seed=4, temperature=1.0,
              max_tokens=150)
    whole = tiny.chat.completions.create(**kw)
    calls: list[dict[int, dict]] = [{}, {}, {}]
    text, finish = ["", "", ""], [None, None, None]
    for chunk in tiny.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
            for d in c.delta.tool_calls or []:
                if d.id is not None:  # a call's head: its id and name, once
                    assert d.index not in calls[c.index] and d.function.name
                    calls[c.index][d.index] = {"name": d.function.name, "arguments": d.function.arguments or ""}
                else:
                    assert d.function.name is None
                    calls[c.index][d.index]["arguments"] += d.function.arguments
    for i, c in enumerate(whole.choices):
        assert finish[i] == c.finish_reason
        streamed = [calls[i][k] for k in sorted(calls[i])]
        assert streamed == [{"name": t.function.name, "arguments": t.function.arguments}
                            for t in c.message.tool_calls or []]
        assert text[i] == (c.message.content or "")


def test_a_conversation_with_calls_and_results_goes_on(tiny):
    first = tiny.chat.completions.create(model="tiny-llama", messages=USER, tools=TOOLS, tool_choice="required",
                                         max_tokens=200, seed=1, parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = USER + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "18 C, clear"}]
    second = tiny.chat.completions.create(model="tiny-llama", messages=history, tools=TOOLS, max_tokens=8, seed=1)
    written = len(tools.call_text(call.function.name, call.function.arguments) + tools.response_text("18 C, clear"))
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + written // 2  # the call and its result are in it


# errors

@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "("}}}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tools": TOOLS[:1] * 2}, "tools[1].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": USER + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tool_requests_are_400_naming_the_field(tiny, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        tiny.chat.completions.create(**{"model": "tiny-llama", "messages": USER} | fields)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    if param.endswith("parameters"):
        assert "'f'" in e.value.body["message"]


# the prompt

def test_the_generic_format_offers_the_tools_and_writes_calls_and_results_back():
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "be brief"}, *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "clock", "arguments": '{"zone": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}], "tools": TOOLS})
    seen = {}

    class Tok:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages, add_generation_prompt=True, tools=None):
            seen.update(messages=messages, tools=tools)
            return "prompt"
    body.chat_prompt(Tok())
    system, user, assistant, result = seen["messages"]
    assert system["content"].startswith("be brief\n\nYou can call these functions:\n")
    assert '"name": "get_weather"' in system["content"] and seen["tools"] is None
    assert assistant == {"role": "assistant", "content": tools.call_text("clock", '{"zone": 1}')}
    assert result == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}


def test_a_template_with_its_own_tools_section_writes_them():
    template = compile_chat_template(
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% for c in m.tool_calls or [] %}"
        "CALL {{ c.function.name }} {{ c.function.arguments.zone }}{% endfor %}{% endfor %}")

    class Tok:
        chat_template = "tools"

        def apply_chat_template(self, messages, add_generation_prompt=True, tools=None):
            return template.render(messages=messages, tools=tools)
    body = ChatCompletionRequest.model_validate({"messages": [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "clock", "arguments": '{"zone": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "tools": TOOLS})
    assert body.chat_prompt(Tok()) == ("TOOLS:get_weather;clock;ping;[user]" + USER[0]["content"] +
                                       "[assistant]CALL clock 3[tool]ok")


# the parser

def answer(*calls: tuple[str, str]) -> str:
    return tools.BETWEEN.join(tools.call_text(name, args) for name, args in calls)


@pytest.mark.parametrize("seed", range(20))
def test_the_parser_reads_any_split_of_an_answer_as_the_whole(seed):
    rng = random.Random(seed)
    text = answer(("get_weather", '{"city": "Pa}\\n", "unit":"c"}'), ("ping", "{}"), ("clock", '{ "zone" : -3 }'))
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 30)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    parser, deltas = tools.CallParser("call_x", auto=True), []
    for piece in pieces:
        deltas += parser.feed(piece)
    whole = tools.CallParser("call_x", auto=True)
    whole.feed(text)
    assert parser.complete and [c.as_dict() for c in parser.calls] == [c.as_dict() for c in whole.calls]
    assert [(c.name, c.arguments) for c in whole.calls] == [
        ("get_weather", '{"city": "Pa}\\n", "unit":"c"}'), ("ping", "{}"), ("clock", '{ "zone" : -3 }')]
    heads = [d["tool_calls"][0] for d in deltas if "id" in d["tool_calls"][0]]
    assert [h["function"]["name"] for h in heads] == ["get_weather", "ping", "clock"]
    args = ["", "", ""]
    for d in deltas:
        args[d["tool_calls"][0]["index"]] += d["tool_calls"][0]["function"]["arguments"]
    assert args == [c.arguments for c in whole.calls]


def test_a_call_cut_short_is_not_complete_and_text_is_text():
    cut = tools.CallParser("c", auto=False)
    cut.feed(answer(("clock", '{"zone": 1}'))[:-4])
    assert not cut.complete and cut.calls[0].name == "clock" and not cut.calls[0].done
    text = tools.CallParser("c", auto=True)
    assert text.feed("Hello") == [{"content": "Hello"}] and text.feed(" <b>") == [{"content": " <b>"}]
    assert not text.complete and text.mode == "text"


def test_the_grammar_rejects_what_the_parser_could_not_read():
    grammar = tools.grammar([tools.Function("clock", None, CLOCK)], "auto", parallel=False)
    assert 'start: TEXT | calls' in grammar and "fn_0" in grammar and "fn_1" not in grammar
    named = tools.grammar([tools.Function("a", None, None), tools.Function("b", None, None)], "b", parallel=True)
    assert '\\"name\\": \\"b\\"' in named and '\\"name\\": \\"a\\"' not in named
    assert "calls: call\n" in named  # one call of a named function
    with pytest.raises(InvalidRequest):
        ChatCompletionRequest.model_validate({"messages": USER, "tools": TOOLS, "tool_choice": "required",
                                              "response_format": {"type": "json_schema", "json_schema": {
                                                  "name": "x", "schema": {}}}})
