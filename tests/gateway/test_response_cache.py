"""The exact-match response cache, in process: replicas are httpx.MockTransport handlers whose answer echoes the
request they got, so a hit that returned another request's answer would be seen."""
import asyncio
import copy
import json
import random

import httpx
import pytest
from starlette.testclient import TestClient

from inferd.gateway.app import Gateway, build_gateway_app
from inferd.gateway.config import GatewayConfig, ModelPrice
from inferd.gateway.deployments import Deployments
from inferd.gateway.limits import MemoryLimiter
from inferd.gateway.response_cache import (BYPASS, HIT, MISS, UNCACHEABLE, ResponseCache, ResponseCacheConfig,
                                           cache_key)
from inferd.protocol import headers
from tests.gateway.services import redis_server
from tests.gateway.test_lifecycle import Replicas, deployment, make_gateway, usage

ASK = {"model": "m", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 4, "temperature": 0}


async def echo(request: httpx.Request) -> httpx.Response:
    """An answer that is a function of the request: the request itself, as the message's content."""
    body = json.loads(request.content)
    content = json.dumps({k: v for k, v in body.items() if k not in ("stream", "stream_options")}, sort_keys=True)
    return httpx.Response(200, json={"id": "chatcmpl-r1", "object": "chat.completion", "created": 1, "model": "m",
                                     "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                                  "finish_reason": "stop", "logprobs": None}],
                                     "usage": usage(3, 2)})


def cached_gateway(tmp_path, config: ResponseCacheConfig | None = None, **kw):
    d = deployment("m", "a")
    d.response_cache = ResponseCache(config or ResponseCacheConfig())
    replicas = Replicas(a=echo)
    gw, key = make_gateway(tmp_path, replicas, [d], prices={"m": ModelPrice(1.0, 0.5, 2.0)}, **kw)
    records = []
    gw.observers.append(records.append)
    return gw, key, d, replicas, records


def post(client, key: str, body: dict, **kw) -> httpx.Response:
    return client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"} | kw)


def echoed(r: httpx.Response) -> dict:
    return json.loads(r.json()["choices"][0]["message"]["content"])


# the store

async def test_the_store_keeps_the_recently_used_within_its_bytes_and_nothing_past_its_ttl():
    now = [0.0]
    cache = ResponseCache(ResponseCacheConfig(ttl_s=10, max_bytes=10), clock=lambda: now[0])
    await cache.put("a", b"aaaa")
    await cache.put("b", b"bbbb")
    assert await cache.get("a") == b"aaaa"  # now b is the least recently used
    await cache.put("c", b"cccc")
    assert [await cache.get(k) for k in "bac"] == [None, b"aaaa", b"cccc"] and cache.bytes == 8
    await cache.put("big", b"x" * 11)  # larger than the bound: not kept, nothing evicted for it
    assert await cache.get("big") is None and len(cache) == 2
    now[0] = 10.0
    assert await cache.get("a") is None and cache.bytes == 4


async def test_in_redis_answers_expire_and_an_unreachable_redis_is_a_miss():
    with redis_server() as url:
        cache = ResponseCache(ResponseCacheConfig(ttl_s=0.2, max_bytes=10), redis_url=url)
        await cache.put("a", b"aaaa")
        await cache.put("big", b"x" * 11)
        assert (await cache.get("a"), await cache.get("big")) == (b"aaaa", None)
        await asyncio.sleep(0.3)
        assert await cache.get("a") is None
    assert await cache.get("a") is None and cache.failures == 1  # Redis is gone
    await cache.put("a", b"aaaa")
    assert cache.failures == 2


def test_only_what_is_a_function_of_the_request_may_be_cached():
    cache = ResponseCache(ResponseCacheConfig())
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert cache.verdict("chat", {"temperature": 0}) == MISS
    assert cache.verdict("chat", {"temperature": 0.7, "seed": 3}) == MISS
    assert cache.verdict("chat", {"temperature": 0.7}) == UNCACHEABLE
    assert cache.verdict("chat", {}) == UNCACHEABLE  # the default temperature samples
    assert cache.verdict("chat", {"temperature": 0, "tools": tools}) == UNCACHEABLE
    assert ResponseCache(ResponseCacheConfig(tools=True)).verdict("chat", {"temperature": 0, "tools": tools}) == MISS
    assert cache.verdict("chat", {"temperature": 0, "cache": False}) == BYPASS
    assert cache.verdict("embeddings", {"input": "x"}) == MISS


def test_the_key_holds_the_tenant_the_version_and_digests_and_not_the_delivery():
    req = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    key = cache_key("t1", "m", "v1", {"weights": "w"}, "chat", req)
    assert key == cache_key("t1", "m", "v1", {"weights": "w"}, "chat", req | {"stream": True, "user": "u"})
    assert key != cache_key("t2", "m", "v1", {"weights": "w"}, "chat", req)
    assert key != cache_key("t1", "m", "v2", {"weights": "w"}, "chat", req)
    assert key != cache_key("t1", "m", "v1", {"weights": "w2"}, "chat", req)
    assert key != cache_key("t1", "m", "v1", {"weights": "w"}, "text_completion", req)


# through the gateway

def test_a_repeated_request_is_answered_from_the_cache_labelled_free_and_still_recorded(tmp_path):
    gw, key, d, replicas, records = cached_gateway(tmp_path)
    with TestClient(build_gateway_app(gw)) as client:
        first, second = post(client, key, ASK), post(client, key, ASK)
        assert (first.status_code, second.status_code) == (200, 200) and len(replicas.requests) == 1
        assert first.headers[headers.RESPONSE_CACHE] == MISS and second.headers[headers.RESPONSE_CACHE] == HIT
        assert echoed(second) == echoed(first) and second.json()["usage"] == first.json()["usage"]
        assert second.json()["id"] != first.json()["id"] and second.json()["id"].startswith("chatcmpl-")
        metrics = client.get("/metrics").text
    assert [(r.cache_hit, r.cost_usd > 0, r.completion_tokens, r.replica) for r in records] == \
        [(False, True, 2, "a"), (True, False, 2, None)]
    assert 'inferd_gateway_response_cache_total{model="m",result="hit"} 1.0' in metrics
    assert f'inferd_gateway_response_cache_bytes{{model="m"}} {float(d.response_cache.bytes)}' in metrics


def test_a_hit_is_replayed_as_a_stream_that_adds_up_to_the_answer(tmp_path):
    gw, key, _, replicas, _ = cached_gateway(tmp_path)
    with TestClient(build_gateway_app(gw)) as client:
        whole = post(client, key, ASK).json()
        r = post(client, key, ASK | {"stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers[headers.RESPONSE_CACHE] == HIT and len(replicas.requests) == 1
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"] and chunks[0]["object"] == "chat.completion.chunk"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == [None, "stop"]
    assert chunks[-1]["usage"] == whole["usage"] and chunks[-1]["choices"] == []


def test_what_may_not_be_cached_goes_to_the_replica_each_time(tmp_path):
    gw, key, _, replicas, _ = cached_gateway(tmp_path)
    with TestClient(build_gateway_app(gw)) as client:
        sampled = [post(client, key, ASK | {"temperature": 0.7}) for _ in range(2)]
        bypassed = [post(client, key, ASK | {"cache": False}) for _ in range(2)]
    assert [r.headers[headers.RESPONSE_CACHE] for r in sampled + bypassed] == [UNCACHEABLE] * 2 + [BYPASS] * 2
    assert len(replicas.requests) == 4


def test_gateways_that_share_redis_share_their_answers(tmp_path):
    with redis_server() as url:
        gw1, key, d1, first, _ = cached_gateway(tmp_path)
        d2, second = deployment("m", "a"), Replicas(a=echo)
        gw2 = Gateway(GatewayConfig(db_url=gw1.store.url, usage_journal=tmp_path / "usage2.journal"), gw1.store,
                      MemoryLimiter(), Deployments(), transport=httpx.MockTransport(second))
        gw2.deployments.add(d2)
        for d in (d1, d2):
            d.response_cache = ResponseCache(ResponseCacheConfig(), redis_url=url)
        said = []
        for gw in (gw1, gw2):
            with TestClient(build_gateway_app(gw)) as client:
                said.append(post(client, key, ASK).headers[headers.RESPONSE_CACHE])
    assert said == [MISS, HIT] and (len(first.requests), len(second.requests)) == (1, 0)


def test_another_tenant_or_a_new_version_never_reads_an_answer(tmp_path):
    gw, key, d, replicas, _ = cached_gateway(tmp_path)
    gw.store.create_tenant("other")
    _, other = gw.store.create_key("other")
    with TestClient(build_gateway_app(gw)) as client:
        post(client, key, ASK)
        assert post(client, other.key, ASK).headers[headers.RESPONSE_CACHE] == MISS
        d.version = "v2"
        assert post(client, key, ASK).headers[headers.RESPONSE_CACHE] == MISS
    assert len(replicas.requests) == 3


def test_a_hit_still_passes_the_rate_limits(tmp_path):
    gw, key, _, replicas, records = cached_gateway(tmp_path)
    gw.store.update_tenant("t", limits={"rpm": 2})
    with TestClient(build_gateway_app(gw)) as client:
        statuses = [post(client, key, ASK).status_code for _ in range(3)]
    assert statuses == [200, 200, 429] and len(replicas.requests) == 1
    assert [(r.status, r.cache_hit) for r in records] == [("completed", False), ("completed", True), ("rejected", False)]


MUTATIONS = [
    lambda b: b["messages"][0].update(content=b["messages"][0]["content"] + "!"),
    lambda b: b["messages"].insert(0, {"role": "system", "content": "be brief"}),
    lambda b: b.update(max_tokens=b["max_tokens"] + 1),
    lambda b: b.update(stop=["x"]),
    lambda b: b.update(top_p=0.5),
    lambda b: b.update(presence_penalty=0.5),
    lambda b: b.update(frequency_penalty=0.5),
    lambda b: b.update(n=2),
    lambda b: b.update(seed=7),
    lambda b: b.update(temperature=0.5, seed=11),
    lambda b: b.update(logprobs=True),
    lambda b: b.update(response_format={"type": "json_object"}),
    lambda b: b.update(ignore_eos=True),
    lambda b: b.update(stop_token_ids=[2]),
    lambda b: b["messages"].append({"role": "assistant", "content": "ok"}),
]


def test_differential_fuzz_no_hit_ever_answers_another_request(tmp_path):
    """Random pairs of requests one field apart, each sent twice: every answer echoes its own request."""
    rng = random.Random(7)
    gw, key, _, replicas, _ = cached_gateway(tmp_path)
    with TestClient(build_gateway_app(gw)) as client:
        hits = 0
        for i in range(60):
            base = copy.deepcopy(ASK)
            base["messages"][0]["content"] = " ".join(rng.choice("ab") for _ in range(rng.randint(1, 4)))
            near = copy.deepcopy(base)
            rng.choice(MUTATIONS)(near)
            for body in rng.sample([base, near, base, near], 4):
                r = post(client, key, body)
                assert r.status_code == 200, r.text
                assert echoed(r) == {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
                hits += r.headers[headers.RESPONSE_CACHE] == HIT
    assert hits >= 60 and len(replicas.requests) == 240 - hits


@pytest.mark.parametrize("ttl, mib, error", [("-1", "64", "ttl"), ("10", "0", "mib")])
def test_the_flags_refuse_a_negative_ttl_or_an_empty_bound(ttl, mib, error):
    from inferd.cli import _parser
    from inferd.control.gateway_setup import gateway_config
    args = _parser().parse_args(["serve", "--response-cache-ttl-s", ttl, "--response-cache-mib", mib])
    with pytest.raises(ValueError, match="response-cache"):
        gateway_config(args, 8)
