"""Real Redis and PostgreSQL for the gateway's tests: Redis is started here, PostgreSQL comes from the
environment (`.ci/run` starts it and sets INFERD_TEST_POSTGRES_URL). Without them the tests skip, unless
INFERD_REQUIRE_SERVICES=1 (as in CI), where a missing service fails the test."""
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import create_engine, text

from tests.server import free_port


def _missing(what: str) -> None:
    if os.environ.get("INFERD_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{what} is required (INFERD_REQUIRE_SERVICES=1) but not available")
    pytest.skip(f"{what} not available")


@contextmanager
def redis_server() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        _missing("redis-server")
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
    """An empty PostgreSQL database (every table of an earlier run dropped)."""
    url = os.environ.get("INFERD_TEST_POSTGRES_URL")
    if not url:
        _missing("PostgreSQL (INFERD_TEST_POSTGRES_URL)")
    engine = create_engine(url)
    with engine.begin() as conn:
        for table in ("webhook_deliveries", "webhook_secrets", "async_jobs", "batch_lines", "batches", "files",
                      "usage_records", "usage_daily", "audit_log", "api_keys", "tenants", "console_users", "alembic_version"):
            conn.execute(text(f"DROP TABLE IF EXISTS {table} CASCADE"))
    engine.dispose()
    return url


@contextmanager
def postgres_schema() -> Iterator[str]:
    """A URL of the test PostgreSQL whose tables live in a new schema of their own (dropped at the end), so a
    test's gateways share a store that no other test's cleanup touches."""
    url = os.environ.get("INFERD_TEST_POSTGRES_URL")
    if not url:
        _missing("PostgreSQL (INFERD_TEST_POSTGRES_URL)")
    schema = f"t_{os.getpid()}_{time.monotonic_ns()}"
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    try:
        yield f"{url}{'&' if '?' in url else '?'}options=-csearch_path%3D{schema}"
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        engine.dispose()
