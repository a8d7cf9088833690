"""Start a real `inferd serve` on a free loopback port for end-to-end tests."""
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from inferd.control.replicas import free_port, wait_until_ready  # noqa: F401 (free_port: for the tests)

STARTUP_TIMEOUT_S = 180
ROOT = Path(__file__).parents[1]


@contextmanager
def running_server(log_path: Path, *args: str, embeddings: bool = False, classical: bool = False,
                   policy: bool = False, port: int | None = None) -> Iterator[str]:
    """`inferd serve --dtype float32 ARGS` until the block ends; yields its base URL once /ready answers 200.

    Its store is an SQLite file beside the log (db_url(log_path)), so each server starts empty; so is its
    usage journal. Without `embeddings` it serves no embedding model, without `classical` no classical one,
    without `policy` no robot policy (a replica fewer each). port: the one to listen on (default: a free one)."""
    with server_process(log_path, *args, embeddings=embeddings, classical=classical, policy=policy,
                        port=port) as (_, url):
        yield url


@contextmanager
def server_process(log_path: Path, *args: str, embeddings: bool = False, classical: bool = False,
                   policy: bool = False, startup_timeout_s: float = STARTUP_TIMEOUT_S, own_group: bool = False,
                   port: int | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    """running_server's process and URL, for a test that kills it; terminated at the end if it still runs.
    own_group: its own process group (os.killpg(proc.pid, SIGINT) is a terminal's Ctrl-C)."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "inferd.cli", "serve", "--dtype", "float32", "--port", str(port),
           "--db", db_url(log_path), "--usage-journal", str(log_path.with_name("usage.journal")),
           "--files-dir", str(log_path.with_name("files")), *args]
    if not embeddings and "--config" not in args:
        cmd += ["--embedding-model", "none"]
    if not classical and "--config" not in args:
        cmd += ["--classical-model", "none"]
    if not policy and "--config" not in args:
        cmd += ["--policy-model", "none"]
    with log_path.open("a") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=own_group)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log_path, startup_timeout_s)
        yield proc, url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def db_url(log_path: Path) -> str:
    return f"sqlite:///{log_path.with_name('inferd.db')}"


def inferd(*args: str) -> str:
    """Run an `inferd` command (keys, tenants, usage) and return its stdout; fails the test if it fails."""
    done = subprocess.run([sys.executable, "-m", "inferd.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    if done.returncode != 0:
        pytest.fail(f"inferd {' '.join(args)} exited with {done.returncode}:\n{done.stderr[-2000:]}")
    return done.stdout


def new_tenant_key(log_path: Path, name: str, *flags: str) -> str:
    """A new tenant (with flags such as --tpm 100) and a key for it, made with the CLI on a server's store."""
    import json
    inferd("tenants", "create", name, "--db", db_url(log_path), *flags)
    return json.loads(inferd("keys", "create", "--tenant", name, "--db", db_url(log_path), "--format", "json"))["key"]


def wait_ready(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    try:
        wait_until_ready(url, lambda: proc.poll() is None, lambda: f"(inferd serve) exited with {proc.returncode}",
                         timeout_s)
    except RuntimeError as exc:
        pytest.fail(f"{exc}:\n{log_path.read_text()[-4000:]}")


def wait_stored(url: str, timeout_s: float = 30.0) -> None:
    """Until the server's usage writer has stored every record it journaled (its pending gauge reads 0): a record
    is journaled as its request ends and stored in batches (every 0.5 s, later on a busy machine)."""
    time.sleep(0.3)  # the answer's last byte can reach the client just before its record is journaled
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if re.search(r"^inferd_gateway_usage_records_pending 0(\.0)?$", httpx.get(f"{url}/metrics", timeout=10).text,
                     re.M):
            return
        time.sleep(0.2)
    pytest.fail(f"usage records still pending after {timeout_s:.0f} s")
