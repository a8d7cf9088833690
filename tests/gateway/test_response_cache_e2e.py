"""The response cache through the real `inferd serve --response-cache-ttl-s` (SmolLM2-135M) with the official
openai client: a repeated greedy request is a hit (the same text, a new id, the header), a streamed request is
replayed from it, a sampled one is never cached, and the store's usage records say which answers were hits."""
import time

import openai
import pytest
from sqlalchemy import create_engine, text

from tests.server import db_url, running_server

KEY = "sk-test-response-cache"
ASK = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("response-cache") / "serve.log"
    with running_server(log_path, "--api-key", KEY, "--max-model-len", "512", "--kv-cache-gib", "0.25",
                        "--response-cache-ttl-s", "300") as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120), log_path


def test_a_repeated_greedy_request_is_a_hit_and_a_stream_replays_it(served):
    client, log_path = served
    ask = {"model": "SmolLM2-135M-Instruct", "messages": ASK, "max_tokens": 12, "temperature": 0}
    first = client.chat.completions.with_raw_response.create(**ask)
    second = client.chat.completions.with_raw_response.create(**ask)
    assert (first.headers["x-inferd-cache"], second.headers["x-inferd-cache"]) == ("miss", "hit")
    a, b = first.parse(), second.parse()
    assert b.choices[0].message.content == a.choices[0].message.content and b.id != a.id
    assert b.usage.completion_tokens == a.usage.completion_tokens

    stream = client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == a.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == a.usage.completion_tokens

    sampled = client.chat.completions.with_raw_response.create(**ask | {"temperature": 0.8})
    assert sampled.headers["x-inferd-cache"] == "uncacheable"

    engine = create_engine(db_url(log_path))  # the records reach the store within a flush interval
    deadline, rows = time.monotonic() + 10, []
    while len(rows) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT cache_hit, cost_usd FROM usage_records")).all()
    assert sorted(hit for hit, _ in rows) == [False, False, True, True]
    assert all(cost == 0 for hit, cost in rows if hit)
