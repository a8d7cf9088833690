"""A gateway killed with SIGKILL right after answering: every answered request has exactly one usage record
once it starts again on the same store and journal."""
import json
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
from sqlalchemy import create_engine, text

from inferd.models.loader import default_model_path
from tests.server import db_url, server_process

KEY = "sk-crash-test-key"
N = 40


def chat(url: str, i: int, stream: bool) -> tuple[int, str, int]:
    """Status, request id and the completion tokens the client was told of (a sampled answer may end before 4)."""
    body = {"messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 4, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=120)
    if stream:
        assert r.text.endswith("data: [DONE]\n\n")  # a stream counts as answered once [DONE] came
        usage = json.loads(r.text.split("data: ")[-2])["usage"]
    else:
        usage = r.json()["usage"]
    return r.status_code, r.headers["x-request-id"], usage["completion_tokens"]


def test_sigkill_after_answers_loses_no_usage_record_and_doubles_none(tmp_path):
    log_path = tmp_path / "serve.log"
    flags = (str(default_model_path()), "--api-key", KEY, "--max-model-len", "256", "--kv-cache-gib", "0.1",
             "--num-threads", "1")
    with server_process(log_path, *flags) as (proc, url):
        with ThreadPoolExecutor(16) as pool:
            answered = list(pool.map(lambda i: chat(url, i, stream=i % 2 == 1), range(N)))
        proc.send_signal(signal.SIGKILL)  # at once: the writer had no time to insert anything
        proc.wait()
    assert [status for status, _, _ in answered] == [200] * N
    with server_process(log_path, *flags):  # the same store and journal: its start inserts what was journaled
        engine = create_engine(db_url(log_path))
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT request_id, status, completion_tokens FROM usage_records")).all()
    by_request = {}
    for request_id, status, completion_tokens in rows:
        by_request.setdefault(request_id, []).append((status, completion_tokens))
    assert sorted(by_request) == sorted(request_id for _, request_id, _ in answered)
    assert {request_id: [("completed", tokens)] for _, request_id, tokens in answered} == by_request
    assert len(rows) == N
