"""Start a real `inferd serve` on a free loopback port for end-to-end tests."""
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

STARTUP_TIMEOUT_S = 180
ROOT = Path(__file__).parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(log_path: Path, *args: str) -> Iterator[str]:
    """`inferd serve --dtype float32 ARGS` until the block ends; yields its base URL once /ready answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "inferd.cli", "serve", "--dtype", "float32", "--port", str(port), *args]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log_path)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_ready(url: str, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"inferd serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"inferd serve not ready after {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
