"""Files and batches in process, with the official openai SDK over the app (replicas are MockTransport
handlers): the round trip, validation, tenants apart, cancel, expiry, the token cap, resuming on a new gateway."""
import asyncio
import json
import time

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from inferd.gateway.app import Gateway, build_gateway_app
from inferd.gateway.config import GatewayConfig, ModelPrice
from inferd.gateway.deployments import Deployments
from inferd.gateway.limits import MemoryLimiter
from tests.gateway.test_lifecycle import Replicas, completion_body, deployment, make_gateway

ENDED = ("completed", "failed", "expired", "cancelled")


def line(i: int, **body) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": 4} | body}


def jsonl(lines: list) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def sdk(client: TestClient, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{client.base_url}/v1", api_key=key, http_client=client, max_retries=0)


def wait_ended(api: openai.OpenAI, batch_id: str, timeout_s: float = 20) -> "openai.types.Batch":
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        batch = api.batches.retrieve(batch_id)
        if batch.status in ENDED:
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} still {batch.status}")


def output(api: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    return {item["custom_id"]: item for item in map(json.loads, api.files.content(file_id).text.splitlines())}


def slow(delay_s: float):
    async def answer(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(delay_s)
        return httpx.Response(200, json=completion_body())
    return answer


async def ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json=completion_body())


def test_a_batch_round_trip_with_the_openai_sdk(tmp_path):
    replicas = Replicas(a=ok)
    gw, key = make_gateway(tmp_path, replicas, [deployment("m", "a")], prices={"m": ModelPrice(1e6, 0, 2e6)},
                           files_dir=tmp_path / "files")
    records = []
    gw.observers.append(records.append)
    with TestClient(build_gateway_app(gw)) as client:
        api = sdk(client, key)
        f = api.files.create(file=("in.jsonl", jsonl([line(i) for i in range(5)])), purpose="batch")
        assert f.purpose == "batch" and f.bytes > 0 and api.files.retrieve(f.id).filename == "in.jsonl"
        batch = api.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                   metadata={"job": "t"})
        assert batch.status == "validating" and batch.metadata == {"job": "t"}
        done = wait_ended(api, batch.id)
        assert done.status == "completed" and done.error_file_id is None
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 5, 0)
        assert done.in_progress_at and done.finalizing_at and done.completed_at
        out = output(api, done.output_file_id)
        assert sorted(out) == [f"req-{i}" for i in range(5)]
        assert out["req-0"]["response"]["status_code"] == 200
        assert out["req-0"]["response"]["body"]["choices"][0]["message"]["content"] == "hi there"
        assert [b.id for b in api.batches.list(limit=10)] == [batch.id]
        assert {x.id for x in api.files.list()} == {f.id, done.output_file_id}
        assert api.files.delete(f.id).deleted and f.id not in {x.id for x in api.files.list()}
    assert all(r.headers["x-inferd-priority"] == "batch" for r in replicas.requests)
    assert len(records) == 5 and all(r.batch_id == batch.id and r.priority_class == "batch" for r in records)
    assert records[0].cost_usd == pytest.approx(0.5 * (3 * 1 + 2 * 2))  # half price
    rows = gw.store.usage_summary(0, time.time() + 10)
    assert [(r["spend"], r["requests"]) for r in rows] == [("batch", 5)]


def test_validation_fails_the_batch_with_line_numbers(tmp_path):
    gw, key = make_gateway(tmp_path, Replicas(a=ok), [deployment("m", "a")], files_dir=tmp_path / "files")
    bad = [line(1), b"{not json", line(1), dict(line(3), url="/v1/completions"), line(4, stream=True),
           line(5, model="nope"), line(6, max_tokens=10_000)]
    with TestClient(build_gateway_app(gw)) as client:
        api = sdk(client, key)
        f = api.files.create(file=("in.jsonl", jsonl(bad)), purpose="batch")
        done = wait_ended(api, api.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h").id)
    assert done.status == "failed" and done.failed_at and done.output_file_id is None
    assert [(e.line, e.code) for e in done.errors.data] == [
        (2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "mismatched_url"), (5, "streaming_unsupported"),
        (6, "model_not_found"), (7, "context_length_exceeded")]
    assert done.request_counts.total == 0


def test_a_tenant_sees_only_its_own_files_and_batches(tmp_path):
    gw, key = make_gateway(tmp_path, Replicas(a=ok), [deployment("m", "a")], files_dir=tmp_path / "files")
    gw.store.create_tenant("other")
    _, other = gw.store.create_key("other")
    with TestClient(build_gateway_app(gw)) as client:
        mine, theirs = sdk(client, key), sdk(client, other.key)
        f = mine.files.create(file=("in.jsonl", jsonl([line(1)])), purpose="batch")
        batch = mine.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        for call in (lambda: theirs.files.retrieve(f.id), lambda: theirs.files.content(f.id),
                     lambda: theirs.files.delete(f.id), lambda: theirs.batches.retrieve(batch.id),
                     lambda: theirs.batches.cancel(batch.id),
                     lambda: theirs.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                   completion_window="24h")):
            with pytest.raises(openai.NotFoundError):
                call()
        assert list(theirs.files.list()) == [] and list(theirs.batches.list()) == []
        assert wait_ended(mine, batch.id).status == "completed"


def test_cancel_stops_new_lines_and_ends_cancelled_with_partial_output(tmp_path):
    gw, key = make_gateway(tmp_path, Replicas(a=slow(0.2)), [deployment("m", "a", inflight=2)],
                           files_dir=tmp_path / "files")
    with TestClient(build_gateway_app(gw)) as client:
        api = sdk(client, key)
        f = api.files.create(file=("in.jsonl", jsonl([line(i) for i in range(20)])), purpose="batch")
        batch = api.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        while api.batches.retrieve(batch.id).request_counts.completed < 2:
            time.sleep(0.02)
        assert api.batches.cancel(batch.id).status == "cancelling"
        done = wait_ended(api, batch.id)
        answered, errors = output(api, done.output_file_id), output(api, done.error_file_id)
    assert done.status == "cancelled" and done.cancelling_at and done.cancelled_at
    assert 2 <= len(answered) < 20 and len(answered) + len(errors) == 20
    assert {e["error"]["code"] for e in errors.values()} == {"batch_cancelled"}
    assert done.request_counts.completed == len(answered) and done.request_counts.failed == len(errors)


def test_the_completion_window_expires_unfinished_lines(tmp_path):
    gw, key = make_gateway(tmp_path, Replicas(a=slow(0.3)), [deployment("m", "a", inflight=1)],
                           files_dir=tmp_path / "files")
    with TestClient(build_gateway_app(gw)) as client:
        api = sdk(client, key)
        f = api.files.create(file=("in.jsonl", jsonl([line(i) for i in range(30)])), purpose="batch")
        done = wait_ended(api, api.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                  completion_window="2s").id)
        answered, errors = output(api, done.output_file_id), output(api, done.error_file_id)
    assert done.status == "expired" and done.expired_at
    assert 1 <= len(answered) < 30 and len(answered) + len(errors) == 30
    assert {e["error"]["code"] for e in errors.values()} == {"batch_expired"}


def test_the_tenant_cap_on_queued_batch_tokens(tmp_path):
    gw, key = make_gateway(tmp_path, Replicas(a=ok), [deployment("m", "a")], files_dir=tmp_path / "files",
                           tenant_batch_queued_tokens=20)
    with TestClient(build_gateway_app(gw)) as client:
        api = sdk(client, key)
        f = api.files.create(file=("in.jsonl", jsonl([line(i) for i in range(5)])), purpose="batch")  # 6 each
        done = wait_ended(api, api.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h").id)
    assert done.status == "failed" and [e.code for e in done.errors.data] == ["token_limit_exceeded"]
    own = tmp_path / "own"
    own.mkdir()
    gw, key = make_gateway(own, Replicas(a=ok), [deployment("m", "a")], files_dir=own / "files",
                           tenant_batch_queued_tokens=20)
    gw.store.update_tenant("t", batch_queued_tokens=30)  # the tenant's own cap replaces the gateway's
    with TestClient(build_gateway_app(gw)) as client:
        api = sdk(client, key)
        f = api.files.create(file=("in.jsonl", jsonl([line(i) for i in range(5)])), purpose="batch")
        done = wait_ended(api, api.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h").id)
    assert done.status == "completed"


def test_a_new_gateway_on_the_same_store_resumes_without_rerunning_lines(tmp_path):
    replicas = Replicas(a=slow(0.05))
    gw, key = make_gateway(tmp_path, replicas, [deployment("m", "a", inflight=2)], files_dir=tmp_path / "files")
    with TestClient(build_gateway_app(gw)) as client:
        api = sdk(client, key)
        f = api.files.create(file=("in.jsonl", jsonl([line(i) for i in range(30)])), purpose="batch")
        batch = api.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        while api.batches.retrieve(batch.id).request_counts.completed < 5:
            time.sleep(0.01)
    first = {json.loads(r.content)["messages"][0]["content"] for r in replicas.requests}
    stored = [ln for ln in gw.batches.lines(batch.id) if ln["state"] == "done"]
    assert 5 <= len(stored) < 30
    replicas.requests.clear()
    ds = Deployments()
    ds.add(deployment("m", "a", inflight=2))
    again = Gateway(GatewayConfig(db_url=gw.store.url, usage_journal=tmp_path / "again.journal",
                                  files_dir=tmp_path / "files"), gw.store, MemoryLimiter(), ds,
                    transport=httpx.MockTransport(replicas))
    with TestClient(build_gateway_app(again)) as client:
        done = wait_ended(sdk(client, key), batch.id)
        out = output(sdk(client, key), done.output_file_id)
    second = [json.loads(r.content)["messages"][0]["content"] for r in replicas.requests]
    assert done.status == "completed" and sorted(out) == sorted(f"req-{i}" for i in range(30))
    assert not {f"line {ln['custom_id'][4:]}" for ln in stored} & set(second)  # no completed line ran again
    assert len(second) == len(set(second)) and set(second) | first >= {f"line {i}" for i in range(30)}
