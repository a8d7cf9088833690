"""Real Redis and PostgreSQL for the gateway's tests: Redis is started here, PostgreSQL comes from the
environment (`.ci/run` starts it and sets INFERD_TEST_POSTGRES_URL). Without them the tests skip, unless
INFERD_REQUIRE_SERVICES=1 (as in CI), where a missing service fails the test."""
import glob
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import create_engine, text

from tests.server import free_port


def missing(what: str) -> None:
    if os.environ.get("INFERD_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{what} is required (INFERD_REQUIRE_SERVICES=1) but not available")
    pytest.skip(f"{what} not available")


@contextmanager
def redis_server() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        missing("redis-server")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--save", "", "--appendonly", "no",
                             "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL)
    try:
        import redis
        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait()


def postgres_url() -> str:
    """An empty PostgreSQL store: a schema of this test process's own (pytest-xdist's worker), dropped and made
    again, so parallel workers never drop each other's tables."""
    url = os.environ.get("INFERD_TEST_POSTGRES_URL")
    if not url:
        missing("PostgreSQL (INFERD_TEST_POSTGRES_URL)")
    schema = f"tests_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    engine.dispose()
    return with_search_path(url, schema)


def with_search_path(url: str, schema: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}options=-csearch_path%3D{schema}"


@contextmanager
def postgres_schema() -> Iterator[str]:
    """A URL of the test PostgreSQL whose tables live in a new schema of their own (dropped at the end), so a
    test's gateways share a store that no other test's cleanup touches."""
    url = os.environ.get("INFERD_TEST_POSTGRES_URL")
    if not url:
        missing("PostgreSQL (INFERD_TEST_POSTGRES_URL)")
    schema = f"t_{os.getpid()}_{time.monotonic_ns()}"
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    try:
        yield with_search_path(url, schema)
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        engine.dispose()


PG_BIN = max(glob.glob("/usr/lib/postgresql/*/bin"), default="/usr/lib/postgresql/15/bin")  # Debian's layout


class OwnRedis:
    """A redis-server of the test's own on its own port, that the test may stop and start again: its data kept
    across restarts (an append-only file in a folder of its own), as a Redis that was unreachable would keep it."""

    def __init__(self, folder: str):
        binary = shutil.which("redis-server")
        if binary is None:
            missing("redis-server")
        self.binary, self.folder, self.port = binary, folder, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "yes", "--appendfsync", "always", "--dir", self.folder],
                                     stdout=subprocess.DEVNULL)
        import redis
        client = redis.Redis(port=self.port)
        for _ in range(200):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.proc = None


class OwnPostgres:
    """A PostgreSQL cluster of the test's own (initdb in a temporary folder, its own port, trust on loopback),
    that the test may stop and start again with pg_ctl. Never the shared one."""

    def __init__(self):
        if not os.path.exists(f"{PG_BIN}/initdb"):
            missing("PostgreSQL's initdb")
        import tempfile
        self.folder = tempfile.mkdtemp(prefix="inferd-pg-")
        self.port = free_port()
        self.url = f"postgresql+psycopg://inferd@127.0.0.1:{self.port}/postgres"
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            shutil.chown(self.folder, "postgres")
        self._run("initdb", "-D", f"{self.folder}/data", "-U", "inferd", "--auth=trust", "-E", "UTF8", "--no-sync")

    def _run(self, tool: str, *args: str) -> None:
        cmd = [f"{PG_BIN}/{tool}", *args]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)

    def start(self) -> None:
        self._run("pg_ctl", "-D", f"{self.folder}/data", "-l", f"{self.folder}/log", "-w", "start", "-o",
                  f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", f"{self.folder}/data", "-m", "immediate", "-w", "stop")

    def remove(self) -> None:
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass  # already stopped
        shutil.rmtree(self.folder, ignore_errors=True)
