"""The real `inferd serve` (default SmolLM2 model, float32) driven by the official openai client."""
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server import db_url, inferd, new_tenant_key

from tests.conftest import SMOLLM2_ADMIN_KEY, SMOLLM2_KEY as API_KEY, SMOLLM2_MAX_MODEL_LEN as MAX_MODEL_LEN


# server

@pytest.fixture(scope="module")
def server(smollm2_server) -> tuple[str, Path]:
    return smollm2_server


@pytest.fixture(scope="module")
def url(server) -> str:
    return server[0]


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def metrics(url: str) -> dict[str, float]:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "replica")
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def chat_messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# health, models

def test_health_ready_models(url, client):
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/ready").status_code == 200
    card = client.models.list().data[0]
    assert card.id == "SmolLM2-135M-Instruct"
    extra = card.model_extra
    assert extra["max_model_len"] == MAX_MODEL_LEN
    assert set(extra["digests"]) == {"weights", "tokenizer", "chat_template"}
    assert all(len(d) == 64 for d in extra["digests"].values())


def test_a_tenant_sees_no_server_paths_the_admin_api_does(url):
    cards = httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {API_KEY}"}).json()["data"]
    assert {c["kind"] for c in cards} == {"text", "embedding", "classical", "policy"}
    assert all("source_path" not in c and c["digests"] for c in cards), cards
    assert "site-packages" not in json.dumps(cards)  # where the packaged models lie
    assert httpx.get(f"{url}/admin/models", headers={"authorization": f"Bearer {API_KEY}"}).status_code == 401
    admin = httpx.get(f"{url}/admin/models", headers={"authorization": f"Bearer {SMOLLM2_ADMIN_KEY}"}).json()["data"]
    assert sorted(c["id"] for c in admin) == sorted(c["id"] for c in cards)
    assert all(Path(c["source_path"]).exists() and c["version"] == "v1" for c in admin), admin


# chat

def test_chat_non_stream(client, model):
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=chat_messages("What is the capital of France?"), max_tokens=8, temperature=0,
        extra_headers={"x-request-id": "e2e-chat-1"})
    assert raw.headers["x-request-id"] == "e2e-chat-1"
    r = raw.parse()
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == model and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_with_usage_and_n(client, model):
    stream = client.chat.completions.create(model=model, messages=chat_messages("Count to five."), max_tokens=6,
                                            n=2, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    texts, reasons = {0: "", 1: ""}, {}
    for c in chunks[:-1]:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert reasons == {0: "length", 1: "length"} and all(texts.values())


def test_chat_n_choices(client, model):
    r = client.chat.completions.create(model=model, messages=chat_messages("Hi"), max_tokens=4, n=2,
                                       extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.completion_tokens == 8


def test_chat_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=chat_messages("Hi"), max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and isinstance(entry.bytes, list) and len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy picks the best


def test_seed_reproducible_at_temperature_one(client, model):
    def sample(seed: int) -> str:
        r = client.completions.create(model=model, prompt="My favourite word is", max_tokens=12, temperature=1,
                                      seed=seed, extra_body={"ignore_eos": True})
        return r.choices[0].text
    assert sample(1234) == sample(1234)
    assert len({sample(1), sample(2), sample(3)}) > 1


# completions

def test_completion_prompt_forms(client, model):
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=3)
    assert r.object == "text_completion" and len(r.choices) == 1 and r.choices[0].text
    r = client.completions.create(model=model, prompt=["One, two,", "Red, green,"], max_tokens=3, n=2,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 12
    r = client.completions.create(model=model, prompt=[504, 3458, 282], max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 3 and r.choices[0].text
    r = client.completions.create(model=model, prompt=[[504, 3458], [504, 3458, 282, 314]], max_tokens=2)
    assert len(r.choices) == 2 and r.usage.prompt_tokens == 6


def test_max_tokens_gives_length(client, model):
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=3,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert r.usage.total_tokens == r.usage.prompt_tokens + 3


def test_stop_string_is_cut(client, model):
    prompt = "One, two, three, four,"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full.strip().split()[1]
    r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stop=[stop, "@@@"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(stop)] and stop not in r.choices[0].text


def test_completion_logprobs_and_stream(client, model):
    r = client.completions.create(model=model, prompt="One, two,", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="One, two,", max_tokens=4, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text


# errors

def error_of(exc: openai.APIStatusError) -> dict:
    assert exc.response.headers["x-request-id"]
    return exc.response.json()["error"]


def test_bad_key(url, model):
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and error_of(e.value)["code"] == "invalid_api_key"


def test_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=chat_messages("hi"), max_tokens=1)
    error = error_of(e.value)
    assert (error["code"], error["param"]) == ("model_not_found", "model")


def test_prompt_too_long(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=chat_messages("hello " * MAX_MODEL_LEN), max_tokens=1)
    error = error_of(e.value)
    assert (error["code"], error["param"], error["type"]) == ("context_length_exceeded", "messages",
                                                              "invalid_request_error")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hi", max_tokens=MAX_MODEL_LEN, stream=True)
    assert error_of(e.value)["param"] == "prompt"


def test_invalid_temperature(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=chat_messages("hi"), temperature=3)
    assert error_of(e.value)["param"] == "temperature"


def test_malformed_json(url):
    r = httpx.post(f"{url}/v1/chat/completions", content=b'{"messages": [',
                   headers={"Authorization": f"Bearer {API_KEY}", "content-type": "application/json",
                            "x-request-id": "bad-json-1"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "bad-json-1"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# prefix cache

DOCUMENT = " ".join(f"Fact {i}: the code word for item {i} is {i * 37 % 101}." for i in range(30))
NAMESPACE_HEADER = "x-inferd-cache-namespace"


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def ask_about_document(client: openai.OpenAI, model: str, question: str, **kw):
    return client.chat.completions.create(model=model, messages=chat_messages(f"{DOCUMENT}\n\nQuestion: {question}"),
                                          max_tokens=2, **kw)


def test_cached_tokens_in_usage_within_one_tenant_only(server, url, model):
    """The gateway sets the cache namespace to the tenant; a client's own namespace header is ignored."""
    suffix = time.monotonic_ns()
    a, b = (openai.OpenAI(base_url=f"{url}/v1", api_key=new_tenant_key(server[1], f"{n}-{suffix}"), max_retries=0,
                          timeout=60) for n in ("a", "b"))
    tenant_a = json.loads(inferd("tenants", "list", "--db", db_url(server[1]), "--format", "json"))
    tenant_a = next(t["id"] for t in tenant_a if t["name"] == f"a-{suffix}")
    before = metrics(url)
    first = ask_about_document(a, model, "Which code word belongs to item 3?")
    assert cached(first.usage) == 0  # a new tenant has nothing cached, not even the system prompt
    second = ask_about_document(a, model, "And item 4?")
    assert cached(second.usage) >= 256 and cached(second.usage) < second.usage.prompt_tokens
    other = ask_about_document(b, model, "And item 4?", extra_headers={NAMESPACE_HEADER: tenant_a})
    assert cached(other.usage) == 0
    stream = ask_about_document(a, model, "And item 5?", stream=True, stream_options={"include_usage": True})
    assert cached(list(stream)[-1].usage) == cached(second.usage)
    after = metrics(url)
    hits = after["inferd_prefix_cache_hit_tokens_total"] - before["inferd_prefix_cache_hit_tokens_total"]
    assert hits >= 2 * cached(second.usage)
    assert after["inferd_prefix_cache_query_tokens_total"] > before["inferd_prefix_cache_query_tokens_total"] + hits
    assert "inferd_prefix_cache_evictions_total" in after


def test_cached_tokens_in_completions_usage(client, model):
    prompt = f"{DOCUMENT}\nThe code word for item 7 is"
    client.completions.create(model=model, prompt=prompt, max_tokens=1)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=1)
    assert r.usage.prompt_tokens - 16 <= cached(r.usage) < r.usage.prompt_tokens
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=1, stream=True,
                                       stream_options={"include_usage": True})
    assert cached(list(stream)[-1].usage) == cached(r.usage)


# metrics and cancellation

def test_metrics_move(url, client, model):
    before = metrics(url)
    client.completions.create(model=model, prompt="Hello", max_tokens=2, extra_body={"ignore_eos": True})
    after = metrics(url)
    for name in ["inferd_time_to_first_token_seconds_count", "inferd_inter_token_latency_seconds_count",
                 "inferd_e2e_request_latency_seconds_count", "inferd_queue_time_seconds_count",
                 "inferd_num_requests_running", "inferd_num_requests_waiting", "inferd_kv_cache_blocks_used",
                 "inferd_kv_cache_blocks_capacity", "inferd_preemptions_total",
                 'inferd_requests_total{finish_reason="length"}']:
        assert name in after, name
    assert after['inferd_requests_total{finish_reason="length"}'] == before.get(
        'inferd_requests_total{finish_reason="length"}', 0) + 1
    assert after["inferd_generation_tokens_total"] == before["inferd_generation_tokens_total"] + 2
    assert after["inferd_prompt_tokens_total"] > before["inferd_prompt_tokens_total"]
    assert after["inferd_kv_cache_blocks_capacity"] > 0


def test_prompts_that_arrive_while_a_stream_decodes_are_prefilled_inside_its_steps(url, client, model):
    before = metrics(url).get("inferd_nested_prefills_total", 0)
    stream = client.completions.create(model=model, prompt="Count slowly:", max_tokens=96, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # it decodes now: a step is nearly always in flight
    answers = [client.completions.create(model=model, prompt=f"Say {i}", max_tokens=2) for i in range(3)]
    assert sum(1 for _ in stream) > 0 and all(a.usage.completion_tokens for a in answers)
    assert metrics(url)["inferd_nested_prefills_total"] >= before + 1  # three arrivals cannot all fall between steps


def wait_idle(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = metrics(url)
        if m["inferd_kv_cache_blocks_used"] == 0 and m["inferd_num_requests_running"] == 0:
            return m
        time.sleep(0.05)
    pytest.fail(f"engine still busy {timeout_s} s after the client left: {m}")


def test_stream_disconnect_aborts(url, client, model):
    aborted = metrics(url).get('inferd_requests_total{finish_reason="abort"}', 0)
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True,
            "n": 2}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        events = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            next(events)
        assert metrics(url)["inferd_num_requests_running"] == 2
    after = wait_idle(url)
    assert after['inferd_requests_total{finish_reason="abort"}'] == aborted + 2
    assert client.completions.create(model=model, prompt="Hi", max_tokens=2).choices[0].text


def test_non_stream_disconnect_aborts(url, client, model):
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=1.0, headers={"Authorization": f"Bearer {API_KEY}"})
    wait_idle(url)
    assert client.completions.create(model=model, prompt="Hi", max_tokens=2).choices[0].text


def test_logs_hold_no_prompt_text_nor_key(server):
    _, log_path = server
    log = log_path.read_text()
    assert "inferd ready: model=SmolLM2-135M-Instruct, all-MiniLM-L6-v2, iris-classifier, reacher-bc url=http://127.0.0.1:" in log
    assert API_KEY not in log and "capital of France" not in log and "Once upon a time" not in log
