"""Two `inferd gateway` processes on one PostgreSQL store (a schema of its own) in front of one upstream (a
plain OpenAI-compatible server on loopback that counts what it is sent): a batch's lines and async jobs are
leased, so both gateways run lines and none runs one another runs; one gateway SIGKILLed mid-batch, the other
takes its lines and jobs over once their leases lapse, and no line done before the kill runs again."""
import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
from sqlalchemy import create_engine, text

from inferd.models.loader import default_model_path
from tests.gateway.services import postgres_schema
from tests.server import ROOT, free_port, wait_ready

KEY = "sk-shared-batches-key"
LINES = 40
DELAY_S = 0.4


class Upstream:
    """Answers each chat completion after DELAY_S (an async job's once `release` is set: the ones b runs are
    still running when b is killed); counts the prompts it was sent."""

    def __init__(self):
        self.sent: Counter[str] = Counter()
        self.release = threading.Event()
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self._json({"object": "list", "data": [{"id": "m", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                prompt = body["messages"][0]["content"]
                upstream.sent[prompt] += 1
                if prompt.startswith("job"):
                    upstream.release.wait(60)
                time.sleep(DELAY_S)
                self._json({"id": "x", "object": "chat.completion", "model": "m", "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})

            def _json(self, obj):
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                pass  # b's connections, cut by its kill

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def gateway(tmp_path, name: str, db: str, upstream: str) -> tuple[subprocess.Popen, str]:
    port, log_path = free_port(), tmp_path / f"{name}.log"
    cmd = [sys.executable, "-m", "inferd.cli", "gateway", "--upstream", upstream, "--model", "m", "--tokenizer",
           str(default_model_path()), "--max-model-len", "512", "--db", db, "--api-key", KEY, "--port", str(port),
           "--lease-s", "2", "--max-inflight", "4", "--usage-journal", str(tmp_path / f"{name}.journal"),
           "--files-dir", str(tmp_path / "files")]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    wait_ready(f"http://127.0.0.1:{port}", proc, log_path)
    return proc, f"http://127.0.0.1:{port}"


def until(done, timeout_s: float = 60) -> None:
    end = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def rows(engine, sql: str, **params) -> list:
    with engine.connect() as conn:
        return conn.execute(text(sql), params).all()


def test_two_gateways_share_a_batch_and_take_over_a_killed_ones_lines_and_jobs(tmp_path):
    upstream = Upstream()
    content = b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": 1}}).encode() + b"\n"
        for i in range(LINES))
    with postgres_schema() as db:
        engine, procs = create_engine(db), []
        try:
            b, b_url = gateway(tmp_path, "b", db, upstream.url)
            procs.append(b)
            jobs = [httpx.post(f"{b_url}/v1/chat/completions", headers={
                "authorization": f"Bearer {KEY}", "prefer": "respond-async"},
                json={"messages": [{"role": "user", "content": f"job {i}"}], "max_tokens": 1}).json()["id"]
                for i in range(2)]
            until(lambda: len(upstream.sent) == 2)  # b runs both jobs (a is not up yet)
            a, a_url = gateway(tmp_path, "a", db, upstream.url)
            procs.append(a)
            api = openai.OpenAI(base_url=f"{a_url}/v1", api_key=KEY, max_retries=0)
            f = api.files.create(file=("in.jsonl", content), purpose="batch")
            batch = api.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
            until(lambda: len(rows(engine, "SELECT DISTINCT lease_owner FROM batch_lines WHERE batch_id = :b AND "
                                   "lease_owner IS NOT NULL", b=batch.id)) == 2)  # both gateways run lines now
            assert [r[0] for r in rows(engine, "SELECT status FROM async_jobs")] == ["in_progress"] * 2
            b.send_signal(signal.SIGKILL)
            b.wait()
            upstream.release.set()
            done_at_kill = {r[0] for r in rows(engine, "SELECT custom_id FROM batch_lines WHERE batch_id = :b AND "
                                               "state = 'done'", b=batch.id)}
            assert len(done_at_kill) < LINES
            until(lambda: api.batches.retrieve(batch.id).status == "completed")
            status = api.batches.retrieve(batch.id)
            out = [json.loads(x) for x in api.files.content(status.output_file_id).text.splitlines()]

            def job(job_id: str) -> dict:
                return httpx.get(f"{a_url}/v1/async/{job_id}", headers={"authorization": f"Bearer {KEY}"}).json()
            until(lambda: all(job(j)["status"] == "completed" for j in jobs))
            finished = [job(j) for j in jobs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(timeout=30)
            engine.dispose()
            upstream.release.set()
            upstream.server.shutdown()
    assert status.status == "completed" and status.request_counts.completed == LINES
    assert sorted(x["custom_id"] for x in out) == sorted(f"c{i}" for i in range(LINES))
    twice = {prompt for prompt, n in upstream.sent.items() if n > 1 and prompt.startswith("line")}
    assert not {f"line {c[1:]}" for c in done_at_kill} & twice  # a line done before the kill never ran again
    assert len(twice) <= 2  # only those b had in flight (--max-inflight 4, 2 of them jobs) when it was killed
    assert all(upstream.sent[f"line {i}"] >= 1 for i in range(LINES))
    assert [j["status"] for j in finished] == ["completed"] * 2
    assert [upstream.sent[f"job {i}"] for i in range(2)] == [2, 2]  # b's, cut by the kill; then a's, once
    assert all(j["response"]["body"]["choices"][0]["message"]["content"] == "ok" for j in finished)
