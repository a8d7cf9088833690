"""`inferd serve` stopped as a terminal's Ctrl-C stops it (SIGINT to the gateway and every replica at once): the
pools stop first, so no replica that exits is taken for a crash and replaced; the shutdown is logged at info."""
import json
import os
import re
import signal
import socket
import time

from tests.server import server_process

KEY = "sk-shutdown-test-key"


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_ctrl_c_replaces_no_replica_and_logs_no_error(tmp_path):
    log_path = tmp_path / "serve.log"
    with server_process(log_path, "--api-key", KEY, "--max-model-len", "512", "--kv-cache-gib", "0.25",
                        classical=True, own_group=True) as (proc, url):
        replicas = [int(p) for p in re.findall(r"started replica pid \d+ on http://127.0.0.1:(\d+)",
                                               log_path.read_text())]
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"authorization: Bearer " + KEY.encode() + b"\r\ncontent-length: 2\r\n\r\n{")
            time.sleep(0.5)
            before = len(log_path.read_bytes())
            os.killpg(proc.pid, signal.SIGINT)
            deadline = time.monotonic() + 3.5  # the gateway's shutdown waits for this request (5 s at most) while
            while any(map(listening, replicas)) and time.monotonic() < deadline:  # the replicas exit
                time.sleep(0.1)
            time.sleep(1.0)  # two rounds of the pools' checks (0.5 s)
            s.sendall(b"}")  # the request ends (400: no messages), and with it the gateway's wait
            assert s.recv(1000).startswith(b"HTTP/1.1 400")
            proc.wait(timeout=60)
    lines = [json.loads(line) for line in log_path.read_bytes()[before:].decode().splitlines()
             if line.startswith("{")]
    assert proc.returncode == 0
    assert not [x for x in lines if x["level"] in ("error", "critical")], lines
    assert not [x for x in lines if "started replica" in x["msg"]], lines  # none replaced
    stopping = [x for x in lines if x["logger"] == "inferd.control.pool" and "stopping" in x["msg"]]
    assert len(stopping) == 2 and all(x["level"] == "info" for x in stopping), lines
