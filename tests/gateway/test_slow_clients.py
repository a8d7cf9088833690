"""Slow-loris clients (a request's head or body trickled a byte at a time) against the shared real server:
they are disconnected at their deadline (protocol/slow_clients.py), and good traffic beside them keeps its
latency. Good traffic and trickles are raw sockets, so nothing in a client library hides a stall."""
import json
import socket
import statistics
import threading
import time
from urllib.parse import urlsplit

import pytest

from inferd.protocol.slow_clients import HEADERS_TIMEOUT_S, MAX_HEAD_BYTES
from tests.conftest import SMOLLM2_KEY

TRICKLERS = 60


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname, parts.port


def good_request(address) -> float:
    """One GET /v1/models (authenticated) on a new connection; its latency in seconds."""
    started = time.perf_counter()
    with socket.create_connection(address, timeout=10) as s:
        s.sendall(f"GET /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {SMOLLM2_KEY}\r\n"
                  "connection: close\r\n\r\n".encode())
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    return time.perf_counter() - started


def latencies_ms(address, n: int = 40) -> list[float]:
    return [good_request(address) * 1000 for _ in range(n)]


def trickle(address, head: bytes, slowly: bytes, closed_after_s: list, stop: threading.Event) -> None:
    """Send head at once, then slowly a byte every 0.2 s until the server closes the connection (or stop)."""
    started = time.monotonic()
    with socket.create_connection(address, timeout=30) as s:
        s.sendall(head)
        for i in range(10**6):
            if stop.is_set():
                return
            try:
                s.sendall(slowly[i % len(slowly):i % len(slowly) + 1])
            except OSError:
                break
            time.sleep(0.2)
    closed_after_s.append(time.monotonic() - started)


def test_trickled_heads_and_bodies_are_cut_off_and_good_traffic_keeps_its_latency(smollm2_server):
    address = _address(smollm2_server[0])
    before = latencies_ms(address)
    heads = [(b"", b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 1000),  # a head that never ends
             (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n"
              b"authorization: Bearer " + SMOLLM2_KEY.encode() + b"\r\n\r\n", b" " * 100000)]  # a slow body
    closed, stop = [], threading.Event()
    threads = [threading.Thread(target=trickle, args=(address, *heads[i % 2], closed, stop), daemon=True)
               for i in range(TRICKLERS)]
    for t in threads:
        t.start()
    time.sleep(1)
    beside = latencies_ms(address)
    heads_cut = time.monotonic() + HEADERS_TIMEOUT_S + 3
    while time.monotonic() < heads_cut and len(closed) < TRICKLERS // 2:
        time.sleep(0.2)
    stop.set()
    p50_before, p50_beside = statistics.median(before), statistics.median(beside)
    print(f"good traffic p50 {p50_before:.1f} ms alone, {p50_beside:.1f} ms beside {TRICKLERS} slow-loris clients;"
          f" max {max(before):.1f} / {max(beside):.1f} ms")
    assert p50_beside < max(2 * p50_before, p50_before + 5)
    assert len(closed) == TRICKLERS // 2 and max(closed) < HEADERS_TIMEOUT_S + 3  # the trickled heads (bodies: 60 s)


@pytest.mark.parametrize("head", [b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * MAX_HEAD_BYTES + b"a\r\n\r\n",
                                  b"GET /health HTTP/9.9\x00\r\n\r\n"], ids=["above the cap", "not HTTP"])
def test_a_head_above_the_cap_or_not_http_is_refused_in_the_error_shape(smollm2_server, head):
    with socket.create_connection(_address(smollm2_server[0]), timeout=10) as s:
        s.sendall(head)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in status.lower(), answer
    assert json.loads(body)["error"]["code"] == "invalid_http_request"
