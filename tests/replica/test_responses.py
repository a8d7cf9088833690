import json

import pytest
from pydantic import ValidationError

from inferd.protocol.errors import ContextLengthExceeded, InvalidRequest
from inferd.protocol.openai import ChatCompletionRequest, CompletionRequest, usage_body
from inferd.protocol.sse import SSE_DONE, sse_event
from inferd.replica.responses import (ChoiceResult, Echo, ResponseMeta, chat_chunk, chat_logprobs, completion_logprobs,
                                      completion_response, sampling_params, usage_chunk)
from inferd.engine.request import EngineError, RequestOutput, TokenLogprob

USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER} | fields)


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi"} | fields)


# chat requests

def test_chat_defaults_and_unknown_fields_ignored():
    req = chat(model="m", logit_bias={"1": 2}, tools=[], response_format={"type": "text"})
    params = sampling_params(req, num_prompt_tokens=10, max_model_len=100)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (1.0, 1.0, 0, None)
    assert params.max_tokens == 90
    assert params.stop == [] and not params.logprobs and req.num_choices == 1


def test_content_parts_and_developer_role():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}]})
    assert [m.as_template_dict() for m in req.messages] == [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""}]


@pytest.mark.parametrize("fields", [
    {"messages": []}, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
    {"messages": [{"role": "robot", "content": "x"}]}, {"temperature": 2.5}, {"temperature": -0.1}, {"top_p": 0},
    {"n": 0}, {"n": 17}, {"max_tokens": 0}, {"stop": ["a", "b", "c", "d", "e"]}, {"stop": ""},
    {"presence_penalty": 3}, {"frequency_penalty": -2.5}, {"top_logprobs": 21, "logprobs": True},
    {"stop_token_ids": [-1]}, {"seed": 2**64}, {"stream": "maybe"},
])
def test_chat_rejects(fields):
    with pytest.raises((ValidationError, InvalidRequest)):
        ChatCompletionRequest.model_validate({"messages": USER} | fields)


def test_top_logprobs_requires_logprobs():
    with pytest.raises(InvalidRequest) as e:
        chat(top_logprobs=2)
    assert e.value.param == "top_logprobs"
    assert sampling_params(chat(logprobs=True, top_logprobs=2), 1, 10).top_logprobs == 2


def test_sampling_fields_reach_the_engine():
    req = chat(max_tokens=5, max_completion_tokens=7, temperature=0.5, top_p=0.9, top_k=40, seed=3, stop="###",
               presence_penalty=0.5, frequency_penalty=-0.5, ignore_eos=True, stop_token_ids=[2], logprobs=True)
    p = sampling_params(req, num_prompt_tokens=3, max_model_len=100)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (7, 0.5, 0.9, 40, 3)
    assert (p.stop, p.stop_token_ids, p.ignore_eos) == (["###"], [2], True)
    assert (p.presence_penalty, p.frequency_penalty, p.logprobs, p.top_logprobs) == (0.5, -0.5, True, 0)


def test_top_k_minus_one_means_off():
    assert sampling_params(chat(top_k=-1), 1, 10).top_k == 0


def test_each_choice_gets_its_own_seed():
    req = chat(seed=7, n=3)
    assert [sampling_params(req, 1, 10, j).seed for j in range(3)] == [7, 8, 9]
    assert sampling_params(chat(seed=2**63 - 1), 1, 10, 1).seed == 0
    assert sampling_params(chat(), 1, 10, 2).seed is None


def test_null_fields_take_defaults():
    p = sampling_params(chat(temperature=None, top_p=None, n=None, stop=None, max_tokens=None), 4, 10)
    assert (p.temperature, p.top_p, p.max_tokens) == (1.0, 1.0, 6)


def test_context_length_exceeded_before_any_work():
    with pytest.raises(ContextLengthExceeded) as e:
        sampling_params(chat(), num_prompt_tokens=10, max_model_len=10)
    assert (e.value.param, e.value.code, e.value.status) == ("messages", "context_length_exceeded", 400)
    with pytest.raises(ContextLengthExceeded) as e:
        sampling_params(completion(max_tokens=5), num_prompt_tokens=6, max_model_len=10)
    assert e.value.param == "prompt"
    assert sampling_params(completion(max_tokens=4), 6, 10).max_tokens == 4


def test_include_usage_only_when_streaming():
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    assert not chat(stream=False, stream_options={"include_usage": True}).include_usage
    assert not chat(stream=True).include_usage


# completion requests

@pytest.mark.parametrize("prompt, expected", [
    ("abc", ["abc"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("prompt", [[], [[]], [1, "a"], [-1], [True], [[1], "a"], {"x": 1}, 5, None])
def test_bad_prompts(prompt):
    with pytest.raises((ValidationError, InvalidRequest)):
        completion(prompt=prompt)


def test_completion_logprobs_and_unsupported_fields():
    assert completion(logprobs=0).logprob_settings() == (True, 0)
    assert completion(logprobs=5).logprob_settings() == (True, 5)
    assert completion().logprob_settings() == (False, 0)
    with pytest.raises(ValidationError):
        completion(logprobs=6)
    assert completion(echo=False).echo is False


def test_echo_rules():
    assert completion(echo=True, logprobs=1).prompt_logprobs()
    assert not completion(echo=True).prompt_logprobs() and not completion(logprobs=1).prompt_logprobs()
    assert completion(echo=True, max_tokens=0).checked_max_tokens(10, 10) == 0  # the prompt may fill the context
    with pytest.raises(ContextLengthExceeded):
        completion(echo=True, max_tokens=1).checked_max_tokens(10, 10)
    for fields, param in [(dict(echo=True, stream=True), "echo"), (dict(echo=True, n=2), "echo"),
                          (dict(max_tokens=0), "max_tokens")]:
        with pytest.raises(InvalidRequest) as e:
            completion(**fields)
        assert e.value.param == param


def test_token_ids_outside_the_vocabulary():
    class Ids:
        def encode(self, text, add_special_tokens=True):
            return [ord(c) for c in text]
    assert completion(prompt=[[1, 2], [3]]).prompt_token_ids(Ids(), 10) == [[1, 2], [3]]
    assert completion(prompt="ab").prompt_token_ids(Ids(), 100) == [[97, 98]]
    with pytest.raises(InvalidRequest) as e:
        completion(prompt=[[1, 2], [3, 10]]).prompt_token_ids(Ids(), 10)
    assert e.value.param == "prompt" and "prompt[1]" in e.value.message and "token id 10" in e.value.message


def test_choices_per_request_are_bounded():
    assert len(completion(prompt=["a"] * 16, n=16).prompts()) == 16
    with pytest.raises(InvalidRequest):
        completion(prompt=["a"] * 17, n=16)


def test_invalid_engine_values_are_engine_errors():
    req = chat(max_tokens=3)
    with pytest.raises(EngineError):
        sampling_params(req.model_copy(update={"top_p": 0.0}), 1, 10)


# response shaping

def token_bytes(token_id: int) -> bytes:
    return {1: b"He", 2: b"llo", 3: "é".encode(), 4: "é".encode()[:1]}[token_id]


META = ResponseMeta("chatcmpl-x", 1, "m", "fp_1")


def test_chat_logprobs_shape():
    body = chat_logprobs([TokenLogprob(1, -0.1, [(1, -0.1), (2, -2.0)]), TokenLogprob(3, -0.5, []),
                          TokenLogprob(4, -0.7, [])], token_bytes)
    first, second, partial = body["content"]
    assert first == {"token": "He", "logprob": -0.1, "bytes": [72, 101], "top_logprobs": [
        {"token": "He", "logprob": -0.1, "bytes": [72, 101]},
        {"token": "llo", "logprob": -2.0, "bytes": [108, 108, 111]}]}
    assert second["bytes"] == [195, 169] and second["top_logprobs"] == []
    assert partial["token"] == "\ufffd" and partial["bytes"] == [195]  # half a character: the bytes say which


def test_completion_logprobs_offsets():
    body = completion_logprobs([TokenLogprob(1, -0.1, [(1, -0.1), (3, -3.0)]), TokenLogprob(2, -0.2, [])],
                               token_bytes, text_offset=5)
    assert body == {"tokens": ["He", "llo"], "token_logprobs": [-0.1, -0.2],
                    "top_logprobs": [{"He": -0.1, "é": -3.0}, {}], "text_offset": [5, 7]}


def test_echo_puts_the_prompt_first_with_a_null_first_logprob():
    result = ChoiceResult(0)
    result.add(RequestOutput("r", "llo", [2], [TokenLogprob(2, -0.2, [(2, -0.2)])], True, "length", 2, 1,
                             prompt_logprobs=[TokenLogprob(3, -1.5, [(1, -0.5)])]))
    echo = Echo("Heé", [1, 3])
    body = completion_response(META, [result], {}, token_bytes, True, [echo])["choices"][0]
    assert body["text"] == "Heéllo"
    assert body["logprobs"] == {"tokens": ["He", "é", "llo"], "token_logprobs": [None, -1.5, -0.2],
                                "top_logprobs": [None, {"He": -0.5}, {"llo": -0.2}], "text_offset": [0, 2, 3]}
    plain = completion_response(META, [result], {}, token_bytes, False, [echo])["choices"][0]
    assert plain["text"] == "Heéllo" and plain["logprobs"] is None


def test_choice_result_accumulates():
    result = ChoiceResult(0)
    result.add(RequestOutput("r", "He", [1], [TokenLogprob(1, -0.1, [])], False, None, 4, 1))
    result.add(RequestOutput("r", "llo", [2], None, True, "stop", 4, 2))
    assert (result.text, result.finish_reason, result.num_output_tokens) == ("Hello", "stop", 2)
    assert len(result.logprobs) == 1


def test_usage_reports_cached_prompt_tokens_the_openai_way():
    result = ChoiceResult(0)
    result.add(RequestOutput("r", "Hi", [1], None, True, "stop", 40, 1, num_cached_tokens=32))
    assert result.num_cached_tokens == 32
    assert usage_body(40, 1, 32) == {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41,
                                     "prompt_tokens_details": {"cached_tokens": 32}}
    assert usage_body(40, 1)["prompt_tokens_details"] == {"cached_tokens": 0}


def test_stream_chunks_and_sse_framing():
    chunk = chat_chunk(META, 1, {"content": "é"}, None, "length", usage=True)
    assert chunk["choices"] == [{"index": 1, "delta": {"content": "é"}, "logprobs": None, "finish_reason": "length"}]
    assert chunk["usage"] is None and "usage" not in chat_chunk(META, 0, {}, None, None, usage=False)
    final = usage_chunk(META, "chat.completion.chunk", {"prompt_tokens": 1})
    assert final["choices"] == [] and final["usage"] == {"prompt_tokens": 1}
    event = sse_event(chunk)
    assert event.startswith(b"data: {") and event.endswith(b"}\n\n") and b"\n" not in event[:-2]
    assert json.loads(event[6:])["choices"][0]["delta"]["content"] == "é"
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_an_event_is_one_line_to_clients_that_split_at_unicode_line_separators():
    text = "a\u2028b\u2029c\x85d é"  # str.splitlines (httpx's aiter_lines) ends a line at the first three
    event = sse_event(chat_chunk(META, 0, {"content": text}, None, None, usage=False))
    assert event.decode().splitlines() == [event[:-2].decode(), ""] and b"\\u2028" in event
    assert json.loads(event[6:])["choices"][0]["delta"]["content"] == text
