"""A replica killed under load: no client hangs, every request ends or errs explicitly, capacity returns."""
import os
import re
import signal
import threading
import time

import httpx
from sqlalchemy import create_engine, text

from tests.server import db_url, running_server

KEY = "sk-failure-test-key"


def stream_chat(url: str, results: list, max_tokens: int = 48) -> None:
    body = {"messages": [{"role": "user", "content": "Count to fifty"}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60,
                          headers={"authorization": f"Bearer {KEY}"}) as r:
            if r.status_code != 200:  # failed before streaming: an error body, e.g. 503 upstream_unavailable
                r.read()
                results.append(("error", r.status_code, [r.json()["error"]["code"]]))
                return
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        errored = any('"error"' in line for line in lines)
        results.append(("error" if errored else "ok", r.status_code, lines[-1:] or [""]))
    except httpx.HTTPError as exc:  # a hang shows up as a ReadTimeout here
        results.append(("exception", type(exc).__name__, []))


def replica_pids(log_path) -> list[int]:
    return [int(p) for p in re.findall(r"started replica pid (\d+)", log_path.read_text())]


def test_killing_a_replica_under_load(tmp_path):
    log_path = tmp_path / "serve.log"
    with running_server(log_path, "--replicas", "2", "--router", "round_robin", "--num-threads", "1", "--api-key", KEY,
                        "--max-model-len", "512",
                        "--kv-cache-gib", "0.1") as url:
        victim = replica_pids(log_path)[1]
        results: list = []
        threads = [threading.Thread(target=stream_chat, args=(url, results)) for _ in range(8)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        for t in threads:
            t.join(timeout=90)
        assert not any(t.is_alive() for t in threads), "a client hung"
        assert [r for r in results if r[0] == "exception"] == []
        assert {r[0] for r in results} <= {"ok", "error"} and any(r[0] == "ok" for r in results)
        for status, code, last in results:  # a broken stream ends with an explicit error event, then [DONE]
            assert status == "ok" or (code == 200 and last == ["data: [DONE]"]) or \
                (code == 503 and last == ["upstream_unavailable"]), (status, code, last)
        after = [(time.sleep(0.2), httpx.post(f"{url}/v1/chat/completions", timeout=60,
                  headers={"authorization": f"Bearer {KEY}"},
                  json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).status_code)[1]
                 for _ in range(4)]
        assert after == [200] * 4, "requests fail after a replica died (not removed from routing?)"
        assert time.monotonic() - killed_at < 60
        while len(replica_pids(log_path)) < 3:  # the supervisor started a new one
            assert time.monotonic() - killed_at < 120, "the dead replica was not replaced"
            time.sleep(0.5)
        while "is back" not in log_path.read_text():
            assert time.monotonic() - killed_at < 180, "the replacement never became ready"
            time.sleep(0.5)
        metrics = httpx.get(f"{url}/metrics").text
        assert 'replica="replica-1"' in metrics
    engine = create_engine(db_url(log_path))
    with engine.connect() as conn:
        statuses = [r[0] for r in conn.execute(text("SELECT status FROM usage_records"))]
    engine.dispose()
    errors = sum(r[0] == "error" for r in results)
    assert statuses.count("failed") >= errors and statuses.count("completed") >= len(results) - errors + 4
