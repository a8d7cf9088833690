"""Batches and async jobs against a real `inferd serve` (SmolLM2): the official openai SDK unchanged, async chat
and embeddings answered with the bodies the SDK parses, and a server killed with SIGKILL mid-batch that resumes
on the same store without losing or rerunning a completed line."""
import json
import signal
import time

import httpx
import openai
from openai.types import CreateEmbeddingResponse
from openai.types.chat import ChatCompletion
from sqlalchemy import create_engine, text

from inferd.models.loader import default_model_path
from tests.conftest import SMOLLM2_KEY
from tests.server import db_url, server_process

KEY = "sk-batch-kill-key"


def lines(n: int, max_tokens: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "messages": [{"role": "user", "content": f"Count to {i}"}], "max_tokens": max_tokens,
        "ignore_eos": True}}).encode() + b"\n"
        for i in range(n))


def wait_status(api: openai.OpenAI, batch_id: str, until, timeout_s: float = 300):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        batch = api.batches.retrieve(batch_id)
        if until(batch):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id}: {batch.status}, {batch.request_counts}")


def test_the_openai_sdk_runs_a_batch_unchanged(smollm2_server):
    url, _ = smollm2_server
    api = openai.OpenAI(base_url=f"{url}/v1", api_key=SMOLLM2_KEY)
    f = api.files.create(file=("in.jsonl", lines(3, 4)), purpose="batch")
    batch = api.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_status(api, batch.id, lambda b: b.status in ("completed", "failed"), 120)
    assert done.status == "completed" and done.request_counts.completed == 3, done
    out = [json.loads(x) for x in api.files.content(done.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in out) == ["c0", "c1", "c2"]
    assert all(x["response"]["status_code"] == 200 and x["response"]["body"]["usage"]["completion_tokens"] == 4
               for x in out)


def test_async_chat_and_embeddings_answer_what_the_sdk_parses(smollm2_server):
    url, _ = smollm2_server
    api = openai.OpenAI(base_url=f"{url}/v1", api_key=SMOLLM2_KEY)
    prefer = {"Prefer": "respond-async"}
    chat = api.chat.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        extra_headers=prefer)
    embed = api.embeddings.with_raw_response.create(model="all-MiniLM-L6-v2", input=["a", "b"],
                                                    encoding_format="float", extra_headers=prefer)
    bodies = []
    for raw in (chat, embed):
        assert raw.status_code == 202 and raw.headers["location"].startswith("/v1/async/async_")
        end = time.monotonic() + 60
        while (job := httpx.get(url + raw.headers["location"], headers={
                "authorization": f"Bearer {SMOLLM2_KEY}"}).json())["status"] != "completed":
            assert job["status"] in ("queued", "in_progress") and time.monotonic() < end, job
            time.sleep(0.1)
        assert job["response"]["status_code"] == 200
        bodies.append(job["response"]["body"])
    assert ChatCompletion.model_validate(bodies[0]).usage.completion_tokens == 3
    assert len(CreateEmbeddingResponse.model_validate(bodies[1]).data[1].embedding) == 384


def test_sigkill_mid_batch_resumes_without_losing_or_rerunning_lines(tmp_path):
    n, log_path = 40, tmp_path / "serve.log"
    flags = (str(default_model_path()), "--api-key", KEY, "--max-model-len", "256", "--kv-cache-gib", "0.1",
             "--max-num-seqs", "4", "--lease-s", "2")  # the restarted server takes the killed one's lines after 2 s
    with server_process(log_path, *flags) as (proc, url):
        api = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
        f = api.files.create(file=("in.jsonl", lines(n, 16)), purpose="batch")
        batch = api.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_status(api, batch.id, lambda b: b.request_counts.completed >= 8)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    engine = create_engine(db_url(log_path))
    with engine.connect() as conn:
        done_before = {r[0] for r in conn.execute(text(
            "SELECT line FROM batch_lines WHERE batch_id = :b AND state = 'done'"), {"b": batch.id})}
    assert 8 <= len(done_before) < n
    with server_process(log_path, *flags) as (_, url):
        api = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
        done = wait_status(api, batch.id, lambda b: b.status in ("completed", "failed"))
        out = [json.loads(x) for x in api.files.content(done.output_file_id).text.splitlines()]
        for _ in range(100):  # the last lines' records reach the store from the journal within a second
            with engine.connect() as conn:
                records = conn.execute(text("SELECT request_id, gateway_id, status, cost_usd FROM usage_records "
                                            "WHERE batch_id = :b"), {"b": batch.id}).all()
            if sum(r[2] == "completed" for r in records) >= n:
                break
            time.sleep(0.1)
    assert done.status == "completed" and done.request_counts.completed == n
    assert sorted(x["custom_id"] for x in out) == sorted(f"c{i}" for i in range(n))  # none lost, none twice
    completed = {}
    for request_id, gateway_id, status, _ in records:
        if status == "completed":
            completed.setdefault(int(request_id.rsplit("-", 1)[1]), []).append(gateway_id)
    assert sorted(completed) == list(range(1, n + 1))
    rerun = [line for line in done_before if len(completed[line]) > 1]
    assert rerun == []  # a line done before the kill never ran again
